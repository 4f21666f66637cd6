"""Retrieval at long context: needle in a haystack and passkey, on a length x depth grid.

Two tasks, each a fact hidden at depth d (0 = start, 1 = end) of a prompt of about L tokens, then a question:

- ``needle``: the haystack is held-out documentation text; the needle sentence ("The magic number is 73914.") is
  inserted at the sentence boundary nearest to fraction d of it. Each sample of a cell starts the haystack at a
  different place in the text.
- ``passkey``: the classic synthetic test (Mohtashami & Jaggi, 2023): the same filler sentences repeated ("The grass
  is green. The sky is blue. ..."), with "The pass key is 73914. Remember it." at depth d.

The model generates greedily; a sample scores 1 when the hidden number appears in its answer, and a cell's accuracy
is the mean over its samples (a fresh random number each). Results: a JSON report (every sample, with the prompt
length actually used), a JSONL file with one line per (model, length, depth) cell, and a heat map PNG (matplotlib,
from the ``eval`` extra; skipped with a note when it is missing) with one panel per model.

Command line (``s2-niah`` / ``python -m s2_models.eval.needle --help``): a checkpoint (``--model``, loaded with
``trust_remote_code``), two side by side (``--model A --compare B``), or, by default, SmolLM2-135M-Instruct dense
and as the demo's S2 hybrid.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from s2_models.eval.models import default_dtype, models_to_evaluate, write_report

TASKS = ("needle", "passkey")
QUESTION = "\n\nWhat is the magic number mentioned in the text above? The magic number is"
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about it.")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


def needle_sentence(number: int) -> str:
    return f" The magic number is {number}. "


def passkey_sentence(number: int) -> str:
    return f" The pass key is {number}. Remember it. {number} is the pass key."


def _check(context_length: int, depth: float) -> None:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if context_length < 1:
        raise ValueError(f"context_length must be >= 1, got {context_length}")


def _num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def build_prompt(tokenizer, haystack: str | list[int], context_length: int, depth: float, number: int) -> str:
    """A needle prompt of about ``context_length`` tokens: haystack text (a string, or its token ids) with the needle
    at ``depth`` and the question."""
    _check(context_length, depth)
    needle = needle_sentence(number)
    budget = context_length - _num_tokens(tokenizer, needle + QUESTION)
    if budget < 1:
        raise ValueError(f"context_length={context_length} leaves no room for the haystack (needle + question need "
                         f"{context_length - budget} tokens)")
    ids = tokenizer(haystack, add_special_tokens=False).input_ids if isinstance(haystack, str) else haystack
    if len(ids) < budget:
        raise ValueError(f"the haystack has {len(ids)} tokens, fewer than the {budget} needed for L={context_length}")
    text = tokenizer.decode(ids[:budget])
    cut = int(len(text) * depth)
    boundary = text.rfind(". ", 0, cut)  # insert between sentences so the needle reads as part of the text
    cut = 0 if boundary < 0 or depth == 0.0 else boundary + 1
    return text[:cut] + needle + text[cut:].lstrip() + QUESTION


def build_passkey_prompt(tokenizer, context_length: int, depth: float, number: int) -> str:
    """A passkey prompt of about ``context_length`` tokens: the intro, repeated filler with the pass key after
    fraction ``depth`` of it, and the question."""
    _check(context_length, depth)
    fixed = _num_tokens(tokenizer, PASSKEY_INTRO + passkey_sentence(number) + PASSKEY_QUESTION)
    repeats = (context_length - fixed) // _num_tokens(tokenizer, PASSKEY_FILLER)
    if repeats < 1:
        raise ValueError(f"context_length={context_length} leaves no room for the filler (the rest needs {fixed} "
                         "tokens)")
    before = round(repeats * depth)
    return (PASSKEY_INTRO + PASSKEY_FILLER * before + passkey_sentence(number) + PASSKEY_FILLER * (repeats - before)
            + PASSKEY_QUESTION)


@torch.no_grad()
def run_grid(model, tokenizer, context_lengths, depths, task: str = "needle", haystack: str | None = None,
             samples: int = 5, max_new_tokens: int = 8, seed: int = 0, progress: bool = True) -> dict:
    """Score every (context length, depth) cell over ``samples`` samples; returns the JSON-ready grid.

    ``haystack`` (text) is needed for ``task="needle"``; it must hold the longest context plus room to start each
    sample at a different place. ``grid["accuracy"][i][j]`` is the accuracy at ``depths[i]``, ``context_lengths[j]``.
    """
    from tqdm.auto import tqdm

    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not context_lengths or not depths:
        raise ValueError("context_lengths and depths must be non-empty")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    haystack_ids = None
    if task == "needle":
        if not haystack:
            raise ValueError("task='needle' needs a haystack text")
        haystack_ids = tokenizer(haystack, add_special_tokens=False).input_ids
    device = next(model.parameters()).device
    rng = random.Random(seed)
    cells = []
    bar = tqdm(total=len(context_lengths) * len(depths) * samples, desc=task, disable=not progress)
    for length in context_lengths:
        # the samples' haystacks start this far apart, so each sample reads different text
        spread = max(0, len(haystack_ids) - length) // samples if haystack_ids is not None else 0
        for depth in depths:
            for sample in range(samples):
                number = rng.randrange(10000, 100000)
                if task == "needle":
                    prompt = build_prompt(tokenizer, haystack_ids[sample * spread :], length, depth, number)
                else:
                    prompt = build_passkey_prompt(tokenizer, length, depth, number)
                inputs = tokenizer(prompt, return_tensors="pt").to(device)
                output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
                answer = tokenizer.decode(output[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
                cells.append({"context_length": length, "depth": depth, "sample": sample,
                              "prompt_tokens": inputs.input_ids.shape[1], "number": number,
                              "answer": answer.strip(), "retrieved": str(number) in answer})
                bar.update()
    bar.close()
    accuracy = [[_mean(c["retrieved"] for c in cells if c["depth"] == d and c["context_length"] == n)
                 for n in context_lengths] for d in depths]
    return {"task": task, "context_lengths": list(context_lengths), "depths": list(depths), "samples": samples,
            "mean_accuracy": _mean(c["retrieved"] for c in cells), "accuracy": accuracy, "cells": cells}


def _mean(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags)


def grid_rows(model_name: str, grid: dict) -> list[dict]:
    """One JSON-ready row per (length, depth) cell of ``grid``."""
    rows = []
    for i, depth in enumerate(grid["depths"]):
        for j, length in enumerate(grid["context_lengths"]):
            answers = [c["answer"] for c in grid["cells"] if c["depth"] == depth and c["context_length"] == length]
            rows.append({"model": model_name, "task": grid["task"], "context_length": length, "depth": depth,
                         "accuracy": grid["accuracy"][i][j], "samples": len(answers), "answers": answers})
    return rows


def write_grid_jsonl(grids: dict[str, dict], path: Path) -> None:
    """``grids`` ({model name: grid}) as JSONL, one line per (model, length, depth) cell."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for name, grid in grids.items():
            for row in grid_rows(name, grid):
                f.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


def plot_heatmaps(grids: dict[str, dict], path: Path, title: str | None = None) -> Path | None:
    """One accuracy heat map (depth x length) per model, side by side, as a PNG. Returns ``None`` (with a note)
    when matplotlib is not installed (it is in the ``eval`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 's2-models[eval]'): no heat map written to {path}")
        return None
    fig, axes = plt.subplots(1, len(grids), figsize=(1.2 + 4.2 * len(grids), 3.8), squeeze=False)
    for ax, (name, grid) in zip(axes[0], grids.items()):
        image = ax.imshow(grid["accuracy"], vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(grid["context_lengths"])), [str(n) for n in grid["context_lengths"]])
        ax.set_yticks(range(len(grid["depths"])), [f"{d:g}" for d in grid["depths"]])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("depth")
        ax.set_title(f"{name}\n{grid['task']}: {grid['mean_accuracy']:.0%} of {len(grid['cells'])}", fontsize=9)
        for i, row in enumerate(grid["accuracy"]):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10, y=1.05)  # above the panels' two-line titles
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint dir or Hub id (trust_remote_code); default: SmolLM2 dense + S2")
    parser.add_argument("--compare", help="a second checkpoint, evaluated the same way and drawn beside --model")
    parser.add_argument("--task", choices=TASKS, default="needle")
    parser.add_argument("--lengths", default="256,512,1024", help="comma-separated context lengths in tokens")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma-separated depths in [0, 1]")
    parser.add_argument("--samples", type=int, default=5, help="samples per cell (default 5)")
    parser.add_argument("--haystack", type=Path, default=None,
                        help="text file for the needle task's haystack (default: held-out documentation text)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON report path; the JSONL grid and PNG heat map are written beside it (default: "
                             "bench/results/smollm2_<task>.json, or <task>.json with --model)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    if args.compare and not args.model:
        raise ValueError("--compare needs --model (the checkpoint drawn beside it)")
    if args.compare and args.compare == args.model:
        raise ValueError(f"--compare must name a checkpoint other than --model, got {args.compare!r} twice")
    dtype = default_dtype(args.device)

    evaluated = []  # (tokenizer, {name: load}) per checkpoint
    for model in [args.model, args.compare] if args.compare else [args.model]:
        evaluated.append(models_to_evaluate(model, dtype, args.device))
    default_name = f"smollm2_{args.task}.json" if args.model is None else f"{args.task}.json"
    output = args.output or Path("bench/results") / default_name
    haystack = None
    if args.task == "needle":
        if args.haystack is not None:
            haystack = args.haystack.read_text(encoding="utf-8")
        else:
            from s2_models.training.data import heldout_text

            haystack = heldout_text(max(lengths) * 8 + 4096 * args.samples)
    report = {"task": args.task, "device": args.device, "dtype": str(dtype).removeprefix("torch."), "models": {}}
    for tokenizer, models in evaluated:
        for name, load in models.items():
            grid = run_grid(load(), tokenizer, lengths, depths, args.task, haystack, args.samples,
                            args.max_new_tokens, args.seed)
            report["models"][name] = grid
            print(f"{name}: {args.task} accuracy {grid['mean_accuracy']:.2f} over {len(grid['cells'])} samples",
                  flush=True)
    write_report(report, output)
    write_grid_jsonl(report["models"], output.with_suffix(".jsonl"))
    plot_heatmaps(report["models"], output.with_suffix(".png"), title=f"{args.task}, {report['dtype']}")
    return report


if __name__ == "__main__":
    main()
