"""The decode-sized projections of the 1B hybrid (GPU): per projection, its time in a CUDA graph of 16 layers, each
a fused RMSNorm (the PDL-launched kernel that precedes every projection but o_proj's in a decode step) followed by
the projection, with each layer's own weights (so no layer reads another's from L2).

    python bench/projection_ab.py --out bench/results/projections_<gpu>.json [--sweep] [--rounds 3]

Arms: ``cublas`` (``F.linear``, as ``nn.Linear`` runs; gate and up then ``silu(gate) * up``; down then the residual
add), ``package`` (the package's launchers with their default tiles) and, with ``--sweep``, ``SkinnyTiles`` launch
shapes. A projection's time is the graph's per layer less that of a graph of the norms alone, and its bandwidth its
weights' bytes over that time, against the device-to-device copy bandwidth measured in the same run (issue 9's
ceiling). Rounds alternate the arms. Run it under another package version (``PYTHONPATH``) to compare versions.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import torch.nn.functional as F
from bench_generation import SHAPES, copy_bandwidth

from s2_models.kernels import fused, fused_triton

LAYERS = 16
HIDDEN, INTERMEDIATE = SHAPES["hidden_size"], SHAPES["intermediate_size"]
Q_ROWS = SHAPES["num_attention_heads"] * SHAPES["head_dim"]
KV_ROWS = SHAPES["num_key_value_heads"] * SHAPES["head_dim"]
# projection -> (input width, output rows of each weight)
PROJECTIONS = {"qkv": (HIDDEN, (Q_ROWS, KV_ROWS, KV_ROWS)), "o": (Q_ROWS, (HIDDEN,)),
               "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)), "down": (INTERMEDIATE, (HIDDEN,))}


def sweep_tiles(width: int, loops: int, weights_per_loop: int) -> list:
    """Launch shapes to time beside the default (weight rows and columns a step, stages) whose pipeline buffers fit
    200 KB of shared memory in bf16 (``fused_triton.pipeline_bytes``)."""
    shapes = []
    for block_n in (16, 32):
        for block_k in ((128, 256) if width <= 4096 else (256, 512, 1024)):
            for stages in (3, 5, 7):
                tiles = fused_triton.SkinnyTiles(block_n, block_k, stages)
                if fused_triton.pipeline_bytes(tiles, loops, weights_per_loop, element_size=2) <= 200 * 1024:
                    shapes.append(tiles)
    return shapes


def projection_call(name: str, weights: list[torch.Tensor], x: torch.Tensor, residual: torch.Tensor, arm):
    """The projection ``name`` on ``x`` as ``arm`` runs it: ``"cublas"``, ``"package"`` or a ``SkinnyTiles``."""
    if arm == "cublas":
        if name == "gate_up":
            return F.silu(F.linear(x, weights[0])) * F.linear(x, weights[1])
        if name == "down":
            return residual + F.linear(x, weights[0])
        return [F.linear(x, w) for w in weights]
    tiles = None if arm == "package" else arm
    kwargs = {} if tiles is None else {"tiles": tiles}
    if name == "gate_up":
        return fused_triton.linear_swiglu_fwd(x, *weights, **kwargs)
    return fused_triton.linear_group_fwd(x, weights, residual if name == "down" else None, **kwargs)


def graph_ms(fn, replays: int = 20, repeats: int = 7) -> float:
    """Median ms of one replay of ``fn`` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def chain(name: str, weights: list, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, arm) -> None:
    """The graph's work: ``LAYERS`` times the norm of ``x``, then (unless ``arm`` is None) the projection of it."""
    for layer in range(LAYERS):
        normed = fused.rms_norm(x, norm_weight, 1e-5)
        if arm is not None:
            projection_call(name, weights[layer], normed, residual, arm)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    copy_bw = copy_bandwidth()
    rows = []
    for name in args.projections:
        width, outputs = PROJECTIONS[name]
        weights = [[torch.randn(n, width, dtype=dtype, device=device) / width**0.5 for n in outputs]
                   for _ in range(LAYERS)]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights[0])
        norm_weight = torch.ones(width, dtype=dtype, device=device)
        arms = ["cublas", "package"]
        if args.sweep and hasattr(fused_triton, "SkinnyTiles"):
            loops, weights_per_loop = (1, 2) if name == "gate_up" else (len(outputs), 1)
            arms += sweep_tiles(width, loops, weights_per_loop)
        for tokens in args.tokens:
            x = torch.randn(tokens, width, dtype=dtype, device=device)
            residual = torch.randn(tokens, outputs[0], dtype=dtype, device=device)
            times = {}
            for _ in range(args.rounds):
                norms_ms = graph_ms(functools.partial(chain, name, weights, x, residual, norm_weight, None))
                for arm in arms:
                    work = functools.partial(chain, name, weights, x, residual, norm_weight, arm)
                    try:
                        times.setdefault(repr(arm), []).append((graph_ms(work) - norms_ms) / LAYERS)
                    except Exception as error:  # reported, not fatal: the other shapes still run
                        times[repr(arm)] = [float("nan")]
                        print(f"{name} {arm}: {type(error).__name__}: {str(error)[:120]}", flush=True)
            for arm, values in times.items():
                ms = statistics.median(values)
                row = {"projection": name, "tokens": tokens, "arm": arm, "us": ms * 1e3,
                       "rounds_us": [v * 1e3 for v in values], "weight_MB": weight_bytes / 1e6,
                       "TBps": weight_bytes / (ms / 1e3) / 1e12,
                       "fraction_of_copy_bandwidth": weight_bytes / (ms / 1e3) / copy_bw}
                rows.append(row)
                print(f"{name:8s} M={tokens:2d} {arm:70s} {row['us']:7.2f} us  {row['fraction_of_copy_bandwidth']:.3f}",
                      flush=True)
    with open(args.out, "w") as f:
        json.dump({"what": f"decode-sized projections, 16 layers in a CUDA graph, {args.label}",
                   "script": "bench/projection_ab.py", "device": torch.cuda.get_device_name(),
                   "copy_bandwidth_TBps": copy_bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
