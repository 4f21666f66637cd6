"""Needle in a haystack: can the model retrieve one fact hidden at depth d of a context of L tokens?

For every context length L and depth d, the haystack is held-out documentation text cut to fit L tokens, the
needle sentence ("The magic number is 73914.") is inserted at the sentence boundary nearest to fraction d of it,
and the prompt ends with a question. The model generates greedily; a cell scores 1 when the needle's number
appears in the answer. The grid, with the prompt lengths actually used, is written as JSON.

Command line (``python -m s2_models.eval.needle --help``): a checkpoint (``--model``, loaded with
``trust_remote_code``) or, by default, SmolLM2-135M-Instruct dense and as the demo's S2 hybrid, side by side.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from s2_models.eval.models import default_dtype, models_to_evaluate, write_report

QUESTION = "\n\nWhat is the magic number mentioned in the text above? The magic number is"


def needle_sentence(number: int) -> str:
    return f" The magic number is {number}. "


def build_prompt(tokenizer, haystack: str, context_length: int, depth: float, number: int) -> str:
    """A prompt of about ``context_length`` tokens: haystack text with the needle at ``depth`` and the question."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = needle_sentence(number)
    fixed = len(tokenizer(needle + QUESTION, add_special_tokens=False).input_ids)
    budget = context_length - fixed
    if budget < 1:
        raise ValueError(f"context_length={context_length} leaves no room for the haystack (needle+question: {fixed})")
    ids = tokenizer(haystack, add_special_tokens=False).input_ids
    if len(ids) < budget:
        raise ValueError(f"the haystack has {len(ids)} tokens, fewer than the {budget} needed for L={context_length}")
    text = tokenizer.decode(ids[:budget])
    cut = int(len(text) * depth)
    boundary = text.rfind(". ", 0, cut)  # insert between sentences so the needle reads as part of the text
    cut = 0 if boundary < 0 or depth == 0.0 else boundary + 1
    return text[:cut] + needle + text[cut:].lstrip() + QUESTION


@torch.no_grad()
def run_needle_grid(model, tokenizer, haystack: str, context_lengths, depths, max_new_tokens: int = 8,
                    seed: int = 0) -> dict:
    """Score every (context length, depth) cell; returns the JSON-ready grid."""
    if not context_lengths or not depths:
        raise ValueError("context_lengths and depths must be non-empty")
    device = next(model.parameters()).device
    rng = random.Random(seed)
    cells = []
    for length in context_lengths:
        for depth in depths:
            number = rng.randrange(10000, 100000)
            prompt = build_prompt(tokenizer, haystack, length, depth, number)
            inputs = tokenizer(prompt, return_tensors="pt").to(device)
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            answer = tokenizer.decode(output[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
            cells.append({
                "context_length": length,
                "prompt_tokens": inputs.input_ids.shape[1],
                "depth": depth,
                "needle": number,
                "answer": answer.strip(),
                "retrieved": str(number) in answer,
            })
    accuracy = sum(c["retrieved"] for c in cells) / len(cells)
    return {"context_lengths": list(context_lengths), "depths": list(depths), "accuracy": accuracy, "cells": cells}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint dir or Hub id (trust_remote_code); default: SmolLM2 dense + S2")
    parser.add_argument("--lengths", default="256,512,1024", help="comma-separated context lengths in tokens")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma-separated depths in [0, 1]")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default: bench/results/smollm2_needle.json, or needle.json with --model)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    dtype = default_dtype(args.device)

    from s2_models.training.data import heldout_text

    tokenizer, models = models_to_evaluate(args.model, dtype, args.device)
    output = args.output or Path("bench/results/" + ("smollm2_needle.json" if args.model is None else "needle.json"))
    haystack = heldout_text(max(lengths) * 8)
    report = {"device": args.device, "dtype": str(dtype).removeprefix("torch."), "models": {}}
    for name, load in models.items():
        grid = run_needle_grid(load(), tokenizer, haystack, lengths, depths, args.max_new_tokens)
        report["models"][name] = grid
        print(f"{name}: accuracy {grid['accuracy']:.2f} over {len(grid['cells'])} cells", flush=True)
    write_report(report, output)


if __name__ == "__main__":
    main()
