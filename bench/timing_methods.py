"""One comparison shape's implementations timed four ways in one process (GPU): is the comparison's method fair?

``bench_s2_attention.py --compare`` times each forward with ``triton.testing.do_bench`` (median, the L2 cache
flushed before every call), the A/B scripts with the profiler's kernel times (calls back to back). Between calls the
same kernel's time moves by up to ~10% on an H100, so only numbers from one process compare. Here each
implementation (S2, dkernel, cuDNN) runs, alternated ``--rounds`` times: ``do_bench`` as the comparison does, CUDA
events around calls back to back without a flush, the profiler's kernel time a call, and the host's time a call
(launches only, no sync; it is hidden behind the GPU's work wherever a call's kernels run longer than it)::

    python bench/timing_methods.py --only "block 64, T=8192;D=64, block 64, T=32768" --out $OUT/timing_methods.json

dkernel must be importable (``bench_s2_attention.py``'s module docstring says how).
"""

import argparse
import json
import statistics
import time

import torch
from backward_ab import kernel_times
from bench_s2_attention import COMPARE_SHAPES, compare_pattern, dkernel, median_ms, s2, sdpa
from torch.nn.attention import SDPBackend


def events_ms(fn, calls: int = 20) -> float:
    """Median of CUDA-event times around ``calls`` calls issued back to back (no flush between them)."""
    pairs = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def host_us(fn, calls: int = 20) -> float:
    """The host's time a call, launches only (the GPU's queue absorbs the calls)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", required=True, help="COMPARE_SHAPES names, separated by ';'")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "rows": {}}
    for name, fields, batch, seqlen, heads, kv_heads, head_dim in COMPARE_SHAPES:
        if name not in args.only.split(";"):
            continue
        pattern = compare_pattern(fields, heads)
        q = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        implementations = {"s2": s2(pattern), "dkernel": dkernel(pattern, heads, kv_heads, seqlen),
                           "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
        for round_ in range(args.rounds):
            for impl, attention in implementations.items():
                def call(attention=attention, inputs=(q, k, v)):
                    return attention(*inputs)

                row = {"do_bench_ms": median_ms(call, 2000), "events_ms": events_ms(call),
                       "kernel_ms": kernel_times(call, "")[1], "host_us": host_us(call)}
                results["rows"].setdefault(name, {}).setdefault(impl, []).append(row)
                print(name, round_, impl, {key: round(value, 3) for key, value in row.items()}, flush=True)
        with open(args.out, "w") as f:  # after each shape: a run cut by its time limit keeps what it measured
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
