"""What the evaluation CLIs evaluate, and where they write: shared by needle, lm-eval and perplexity."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

SMOLLM2_DENSE = "SmolLM2-135M-Instruct dense"
SMOLLM2_HYBRID = "SmolLM2-135M-Instruct S2 hybrid (smollm2_hybrid_sparsity())"


def default_dtype(device: str) -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def models_to_evaluate(model: str | None, dtype: torch.dtype, device: str) -> tuple[object, dict[str, Callable]]:
    """``(tokenizer, {name: load})``: the checkpoint ``model`` (a folder or Hub id, loaded with
    ``trust_remote_code``), or, with ``model=None``, SmolLM2-135M-Instruct dense next to its S2 hybrid."""
    if model is None:
        from s2_models import smollm2

        return smollm2.load_tokenizer(), {
            SMOLLM2_DENSE: lambda: smollm2.load_llama(dtype, device),
            SMOLLM2_HYBRID: lambda: smollm2.load_s2(smollm2.smollm2_hybrid_sparsity(), dtype, device),
        }
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load():
        return AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True, dtype=dtype).to(device).eval()

    return AutoTokenizer.from_pretrained(model), {model: load}


def write_report(report: dict, output: Path | None) -> None:
    """Write ``report`` as indented JSON to ``output`` (nothing if ``None``)."""
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
