"""Training-step benchmark (GPU): transformers' dense Llama (SDPA) vs the S2 hybrid, with a per-layer breakdown.

    python bench/bench_training.py --out bench/results/training_h100.json            # 8k, 32k, 128k: ~4-5 min, H100
    python bench/bench_training.py --out /tmp/training_quick.json --quick             # 8k and 32k, 2 steps: ~1.5 min

Model: Llama-3.2-1B shapes (hidden 2048, 16 layers, 32 query / 8 KV heads, head dim 64, MLP 8192, tied embeddings)
with a 32000-token vocabulary instead of 128256: at 131072 tokens the float32 logits of the loss alone would take
67 GB. Dense: ``LlamaForCausalLM`` with ``attn_implementation="sdpa"`` (PyTorch's default SDPA backend choice). S2:
``S2LlamaForCausalLM``, layers 0-1 dense (SDPA), layers 2-15 S2 (block 64, local 16 blocks, every 16th block).

A step is what a trainer runs: forward with labels, backward, ``AdamW(fused=True)`` step, ``zero_grad``; gradient
checkpointing on (non-reentrant); same tokens per step for both models: T=8192 x B=4, T=32768 x B=1, T=131072 x B=1.
Precision (``--precision``, the same for both models): ``bf16`` (default) = bf16 weights, gradients and optimizer
states, no autocast; ``autocast`` = float32 master weights under ``torch.autocast(dtype=torch.bfloat16)``, what
``Trainer(bf16=True)`` runs (at 131072 tokens its float32 weights, AdamW states and checkpoints may not fit 80 GB).
Times are medians over timed steps (CUDA events) after warm-up steps (which include the kernels' autotuning).

Breakdown, per model: the same step with attention replaced by a no-op (queries pass through; keys and values get zero
gradients, so every projection still runs forward and backward) gives the rest of the step. The S2 model's rest is
shorter (its RMSNorms, rotary and SwiGLU are fused kernels on CUDA); "speed-up from attention alone" puts Llama's rest
in its place. For the hybrid, replacing only its sparse layers gives their cost, so one sparse layer = (step - step
with sparse no-ops) / 14. It is compared with the kernels' own time at the layer's shapes, timed alone in the same run
with ``triton.testing.do_bench``: ``s2_attention`` forward twice (forward and checkpoint recompute) plus backward.
Target: <= 1.1x.

Each measurement records its error instead of aborting the run; the JSON holds every raw median and step time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import time
import traceback

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # long sequences: less fragmentation

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity  # noqa: E402
from s2_models.kernels import S2Pattern, s2_attention  # noqa: E402

PATTERN = {"block_size": 64, "local_blocks": 16, "vert_stride": 16}
DENSE_LAYERS = (0, 1)
SHAPES = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True)
SECTIONS = {"8k": (8192, 4), "32k": (32768, 1), "128k": (131072, 1)}  # name: (T, B)
TARGETS = {"speedup": {"32k": 1.7, "128k": 3.0}, "sparse_layer_over_kernels": 1.1}
# --tiny: a CPU smoke run of this script (tiny model, PyTorch attention path); its numbers mean nothing.
TINY_SHAPES = dict(SHAPES, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
TINY_PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}


# ---------------------------------------------------------------------------------------------- models
def build(kind: str, shapes: dict, pattern: dict, precision: str, device: str):
    """``("dense" | "s2")`` model with gradient checkpointing, and its AdamW."""
    with torch.device(device):  # initialized where it runs: a 1B-parameter init on the CPU takes long
        if kind == "dense":
            model = LlamaForCausalLM(LlamaConfig(**shapes, attn_implementation="sdpa"))
        else:
            sparsity = hybrid_sparsity(shapes["num_hidden_layers"], pattern, dense_layers=DENSE_LAYERS)
            model = S2LlamaForCausalLM(S2LlamaConfig(**shapes, sparsity=sparsity))
    model.to(device, torch.bfloat16 if precision == "bf16" else torch.float32).train()
    model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    return model, optimizer


class NoOpAttention(torch.autograd.Function):
    """Attention replaced by a pass-through: ``out [B, T, Hq, D]`` = the queries; keys and values get zero gradients
    so that their projections' backward runs as in a real step."""

    @staticmethod
    def forward(ctx, query, key, value):
        ctx.key_like = (key.shape, key.dtype, key.device)
        ctx.value_dtype = value.dtype
        return query.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        shape, key_dtype, device = ctx.key_like
        return grad.transpose(1, 2), torch.zeros(shape, dtype=key_dtype, device=device), torch.zeros(
            shape, dtype=ctx.value_dtype, device=device
        )


@contextlib.contextmanager
def attention_replaced(implementation: str, replaced):
    """Within the block, layers for which ``replaced(attention_module)`` holds run ``NoOpAttention`` (through the
    attention registry both Llama and S2Llama dispatch on); yields a counter of replaced calls."""
    original = ALL_ATTENTION_FUNCTIONS[implementation]
    calls = {"replaced": 0}

    def attention(module, query, key, value, *args, **kwargs):
        if replaced(module):
            calls["replaced"] += 1
            return NoOpAttention.apply(query, key, value), None
        return original(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = attention  # the instance's own mapping, ahead of the global one
    try:
        yield calls
    finally:
        del ALL_ATTENTION_FUNCTIONS[implementation]


def is_sparse(module) -> bool:
    return getattr(module, "s2_pattern", None) is not None


# ---------------------------------------------------------------------------------------------- timing
def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def timed_steps(step, warmup: int, steps: int, device: str) -> list[float]:
    """Milliseconds of each timed step (CUDA events on the GPU), after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    return times


def bench_ms(fn, device: str) -> float:
    """Median milliseconds of ``fn`` alone: ``triton.testing.do_bench`` on the GPU."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return statistics.median(timed_steps(fn, warmup=2, steps=5, device=device))


def training_step(model, optimizer, input_ids, precision: str, losses: list):
    def step():
        autocast = torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=precision == "autocast")
        with autocast:
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return step


def measure_model(kind, ids, args, shapes, pattern, device) -> dict:
    """Step time and peak memory of one model, then the same step with attention replaced by no-ops."""
    model, optimizer = build(kind, shapes, pattern, args.precision, device)
    implementation = model.config._attn_implementation
    result = {"attn_implementation": implementation, "parameters": model.num_parameters()}
    losses = []
    step = training_step(model, optimizer, ids, args.precision, losses)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed_steps(step, args.warmup, args.steps, device)
    result.update(step_ms=statistics.median(times), step_times_ms=times, losses=[float(x) for x in losses])
    if device == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if not all(torch.isfinite(torch.tensor(result["losses"]))):
        result["error"] = "non-finite loss"
    variants = {"noop_all": lambda module: True}
    if kind == "s2":
        variants["noop_sparse"] = is_sparse
    for name, replaced in variants.items():
        try:
            with attention_replaced(implementation, replaced) as calls:
                times = timed_steps(step, 1, args.steps, device)
            if calls["replaced"] == 0:
                raise RuntimeError("the attention registry was not used: the no-op replaced nothing")
        except Exception as e:  # noqa: BLE001 - keep the real step's numbers
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"
            continue
        result[f"{name}_step_ms"] = statistics.median(times)
        result[f"{name}_step_times_ms"] = times
    result["gradient_checkpointing"] = model.is_gradient_checkpointing
    del model, optimizer, step
    return result


def kernel_times(batch, seq_len, shapes, pattern, device) -> dict:
    """``s2_attention`` alone at a sparse layer's shapes and layouts (q, k, v and the output gradient are
    ``[B, T, H, D]`` in memory, as the projections make them): forward, and backward through autograd."""
    s2_pattern = S2Pattern(**pattern)
    heads, kv_heads, head_dim = shapes["num_attention_heads"], shapes["num_key_value_heads"], shapes["head_dim"]

    def projected(num_heads):
        x = torch.randn(batch, seq_len, num_heads, head_dim, device=device, dtype=torch.bfloat16)
        return x.transpose(1, 2)

    q, k, v, grad_out = projected(heads), projected(kv_heads), projected(kv_heads), projected(heads)
    with torch.no_grad():
        forward = bench_ms(lambda: s2_attention(q, k, v, s2_pattern), device)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = s2_attention(q, k, v, s2_pattern)
    backward = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True), device)
    return {"forward_ms": forward, "backward_ms": backward, "layer_work_ms": 2 * forward + backward}


def derive(section: dict, name: str, num_layers: int) -> dict:
    """Speed-up, per-layer costs and the checks against the targets, from the raw medians."""
    dense, s2, kernel = section.get("dense", {}), section.get("s2", {}), section.get("kernel", {})
    num_sparse = num_layers - len(DENSE_LAYERS)
    out = {}
    with contextlib.suppress(KeyError, ZeroDivisionError):
        out["speedup"] = dense["step_ms"] / s2["step_ms"]
        out["dense_tokens_per_s"] = section["tokens_per_step"] / dense["step_ms"] * 1e3
        out["s2_tokens_per_s"] = section["tokens_per_step"] / s2["step_ms"] * 1e3
        target = TARGETS["speedup"].get(name)
        if target is not None:
            out["speedup_target"], out["speedup_meets_target"] = target, out["speedup"] >= target
    with contextlib.suppress(KeyError, ZeroDivisionError):
        out["rest_of_step_ms"] = {"dense": dense["noop_all_step_ms"], "s2": s2["noop_all_step_ms"]}
        out["dense_layer_ms"] = (dense["step_ms"] - dense["noop_all_step_ms"]) / num_layers
        out["s2_dense_layer_ms"] = (s2["noop_sparse_step_ms"] - s2["noop_all_step_ms"]) / len(DENSE_LAYERS)
        out["sparse_layer_ms"] = (s2["step_ms"] - s2["noop_sparse_step_ms"]) / num_sparse
        out["speedup_if_sparse_layers_were_free"] = dense["step_ms"] / s2["noop_sparse_step_ms"]
        # The S2 model runs its norms, rotary and SwiGLU as fused kernels (on CUDA) and Llama does not: with
        # Llama's rest of the step in its place, the speed-up left is what the attention alone gives.
        out["speedup_from_attention_alone"] = dense["step_ms"] / (
            s2["step_ms"] - s2["noop_all_step_ms"] + dense["noop_all_step_ms"])
        out["sparse_layer_over_kernels"] = out["sparse_layer_ms"] / kernel["layer_work_ms"]
        out["sparse_layer_meets_target"] = out["sparse_layer_over_kernels"] <= TARGETS["sparse_layer_over_kernels"]
    return out


def run_section(name, seq_len, batch, args, shapes, pattern, device) -> dict:
    section = {"seq_len": seq_len, "batch": batch, "tokens_per_step": seq_len * batch}
    ids = torch.randint(0, shapes["vocab_size"], (batch, seq_len), device=device)
    parts = {
        "dense": lambda: measure_model("dense", ids, args, shapes, pattern, device),
        "s2": lambda: measure_model("s2", ids, args, shapes, pattern, device),
        "kernel": lambda: kernel_times(batch, seq_len, shapes, pattern, device),
    }
    for part, fn in parts.items():
        start = time.perf_counter()
        try:
            section[part] = fn()
        except Exception as e:  # noqa: BLE001 - a benchmark records failures and goes on
            section[part] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        section[part]["wall_s"] = time.perf_counter() - start
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"[{name}] {part}: {json.dumps(_brief(section[part]))}", flush=True)
    section["derived"] = derive(section, name, shapes["num_hidden_layers"])
    return section


def _brief(part: dict) -> dict:
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in part.items()
            if not k.endswith("times_ms") and k not in ("trace", "losses")}


# ---------------------------------------------------------------------------------------------- report
def table(results: dict) -> str:
    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    rows = [
        "| T x B | dense step ms | S2 step ms | speed-up | dense / S2 tokens/s | dense / S2 peak GiB | rest of step ms "
        "(dense / S2) | dense layer ms | sparse layer ms | kernels fwd x2 + bwd ms | sparse layer / kernels | "
        "speed-up if sparse layers were free | speed-up from attention alone |",
        "|" + "---|" * 13,
    ]
    for name, s in results["sections"].items():
        d, dense, s2, kernel = s.get("derived", {}), s.get("dense", {}), s.get("s2", {}), s.get("kernel", {})
        rest = d.get("rest_of_step_ms", {})
        rows.append(
            f"| {s['seq_len']} x {s['batch']} | {fmt(dense.get('step_ms'))} | {fmt(s2.get('step_ms'))} | "
            f"{fmt(d.get('speedup'), '.2f')}x | {fmt(d.get('dense_tokens_per_s'), '.0f')} / "
            f"{fmt(d.get('s2_tokens_per_s'), '.0f')} | {fmt(dense.get('peak_memory_gib'))} / "
            f"{fmt(s2.get('peak_memory_gib'))} | {fmt(rest.get('dense'))} / {fmt(rest.get('s2'))} | "
            f"{fmt(d.get('dense_layer_ms'), '.2f')} | {fmt(d.get('sparse_layer_ms'), '.2f')} | "
            f"{fmt(kernel.get('layer_work_ms'), '.2f')} ({fmt(kernel.get('forward_ms'), '.2f')} x 2 + "
            f"{fmt(kernel.get('backward_ms'), '.2f')}) | {fmt(d.get('sparse_layer_over_kernels'), '.2f')}x | "
            f"{fmt(d.get('speedup_if_sparse_layers_were_free'), '.2f')}x | "
            f"{fmt(d.get('speedup_from_attention_alone'), '.2f')}x |"
        )
        errors = [f"{part}: {s[part]['error']}" for part in ("dense", "s2", "kernel") if "error" in s.get(part, {})]
        rows += [f"|   error ({name}) {e} |" for e in errors]
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    parser.add_argument("--precision", choices=("bf16", "autocast"), default="bf16")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (autotuning happens in the first)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (median reported)")
    parser.add_argument("--quick", action="store_true", help="8k and 32k only, 2 timed steps")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the script (tiny model, T=256)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        shapes, pattern, sections = TINY_SHAPES, TINY_PATTERN, {"tiny": (256, 2)}
        args.steps = min(args.steps, 2)
    elif device != "cuda":
        raise SystemExit("this benchmark needs a CUDA GPU (or --tiny for a CPU smoke run of the script)")
    else:
        shapes, pattern = SHAPES, PATTERN
        names = ["8k", "32k"] if args.quick else [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = sorted(set(names) - set(SECTIONS))
        if unknown:
            raise SystemExit(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
        sections = {name: SECTIONS[name] for name in names}
        if args.quick:
            args.steps = 2

    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "triton": _triton_version(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "precision": args.precision,
        "shapes": shapes,
        "pattern": pattern,
        "dense_layers": list(DENSE_LAYERS),
        "gradient_checkpointing": "non-reentrant",
        "optimizer": "torch.optim.AdamW(fused=True)",
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "targets": TARGETS,
        "sections": {},
    }
    for name, (seq_len, batch) in sections.items():
        results["sections"][name] = run_section(name, seq_len, batch, args, shapes, pattern, device)
        with open(args.out, "w") as f:  # after every section: a later failure keeps what was measured
            json.dump(results, f, indent=1)
    print(table(results), flush=True)
    print(f"results: {args.out}")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
