"""Run EleutherAI's lm-evaluation-harness on an S2Llama checkpoint (extra ``eval``: ``pip install s2-models[eval]``).

The model goes through lm-eval's own Hugging Face wrapper (``HFLM``), given a loaded model object, so the S2
kernels and any conversion are exactly what was measured. Hub datasets may be out of reach (air-gapped machines),
so two local tasks are built from the held-out documentation text and always available:

* ``s2_docs_rolling``: ``loglikelihood_rolling`` over held-out paragraphs (word / byte perplexity, bits per byte);
  windows follow the model's max length, as lm-eval's wikitext task does.
* ``s2_docs_last_word``: LAMBADA-style last-word prediction on held-out paragraphs (greedy accuracy, perplexity).

Any registered lm-eval task name works too where its dataset can be fetched.

Command line::

    python -m s2_models.eval.lm_eval_harness             # SmolLM2 dense and S2 hybrid, local tasks, CPU or GPU
    python -m s2_models.eval.lm_eval_harness --model outputs/smollm2-s2 --tasks s2_docs_rolling,hellaswag \\
        --batch-size 8 --device cuda --output bench/results/lm_eval.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from s2_models.downloads import build_once, cache_dir
from s2_models.eval.models import default_dtype, models_to_evaluate, write_report

LOCAL_TASKS = ("s2_docs_rolling", "s2_docs_last_word")
TASKS_VERSION = 2  # bump when the data or task definitions change, so cached task folders are rebuilt


def local_tasks_dir(max_paragraphs: int = 200) -> Path:
    """A folder with the local tasks' YAML files and their JSONL data (built once, cached)."""
    target = cache_dir() / f"lm_eval_tasks-v{TASKS_VERSION}-{max_paragraphs}"

    def build(out: Path) -> None:  # out is renamed to target afterwards: the YAML names the data's final path
        from s2_models.training.data import iter_documents

        paragraphs = [p for doc in iter_documents("heldout") for p in doc.text.split("\n\n") if len(p.split()) >= 30]
        paragraphs = paragraphs[:max_paragraphs]
        rows_rolling = [{"text": p} for p in paragraphs]
        rows_last_word = [row for row in map(_last_word_example, paragraphs) if row is not None]
        for task, rows in (("s2_docs_rolling", rows_rolling), ("s2_docs_last_word", rows_last_word)):
            data = out / f"{task}.jsonl"
            data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
            # JSON is YAML: no YAML writer needed, and the absolute data path is embedded safely.
            config = _task_config(task, target / data.name)
            (out / f"{task}.yaml").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return build_once(target, build)


def _last_word_example(paragraph: str) -> dict | None:
    match = re.fullmatch(r"(.*\S)\s+([A-Za-z]{3,})[.!?]?", paragraph.strip(), flags=re.DOTALL)
    return None if match is None else {"context": match.group(1), "target": match.group(2)}


def _task_config(task: str, data: Path) -> dict:
    common = {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "metadata": {"version": TASKS_VERSION},
    }
    if task == "s2_docs_rolling":
        return common | {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            ],
        }
    return common | {
        "output_type": "loglikelihood",
        "doc_to_text": "{{context}}",
        "doc_to_target": " {{target}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
        ],
    }


def evaluate(model, tokenizer, tasks=LOCAL_TASKS, batch_size: int = 4, limit: int | None = None,
             max_length: int | None = None) -> dict:
    """Run lm-eval ``tasks`` on a loaded ``model``; returns ``{task: {metric: value}}``."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("tasks must name at least one lm-eval task")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device, max_length=max_length)
    manager = TaskManager(include_path=str(local_tasks_dir()))
    output = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=manager,
                                     log_samples=False, bootstrap_iters=0)
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if k != "alias" and isinstance(v, (int, float))}
            for task, metrics in output["results"].items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint dir or Hub id (trust_remote_code); default: SmolLM2 dense + S2")
    parser.add_argument("--tasks", default=",".join(LOCAL_TASKS), help="comma-separated lm-eval task names")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--max-length", type=int, default=None, help="context length lm-eval uses (default: model's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default: bench/results/smollm2_lm_eval.json without --model, else none)")
    args = parser.parse_args(argv)
    dtype = default_dtype(args.device)
    tokenizer, models = models_to_evaluate(args.model, dtype, args.device)
    output = args.output or (Path("bench/results/smollm2_lm_eval.json") if args.model is None else None)
    report = {"device": args.device, "dtype": str(dtype).removeprefix("torch."), "limit": args.limit,
              "max_length": args.max_length, "models": {}}
    for name, load in models.items():
        results = evaluate(load(), tokenizer, args.tasks.split(","), args.batch_size, args.limit, args.max_length)
        report["models"][name] = results
        print(name, json.dumps(results, indent=2), flush=True)
    write_report(report, output)


if __name__ == "__main__":
    main()
