"""Where one decode launch's time goes: a per-program timeline of the decode kernel, and reads of the same bytes (GPU).

``kernels/decode_triton.py``'s kernel, instrumented (a copy, patched below): each program stores ``%globaltimer`` at
its start, once its split's key range is known (the prologue's loads have arrived), after its key loop (and the
merge of its warps' states), after its split-counter atomic and, for the program that merges, after the merge. Each
stamp is predicated on the value it follows, so it cannot be taken before that value exists. Launches run eagerly
over the full compact caches of ``bench_generation.py``'s 1B hybrid (``bench_generation.full_caches``); percentiles
per phase, in microseconds from the launch's first program start.

Beside it, reads of 50 MB in one launch by a trivial kernel: each program summing one contiguous chunk (as the
decode kernel's splits stream theirs), and the grid-stride read of ``bench_generation.read_ceiling``::

    python bench/decode_timeline.py --out $OUT/decode_timeline.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from bench_generation import copy_bandwidth, full_caches, graph_seconds, streaming_sum_kernel
from decode_ab import launch, sparse_layout
from kernel_versions import patched_module

from s2_models.kernels.triton_setup import tl, triton

KERNEL = Path(__file__).resolve().parents[1] / "kernels" / "decode_triton.py"
STAMP = '''@triton.jit
def _stamp(trace, index, dep):
    """%globaltimer once ``dep`` (int32) exists (the read is predicated on it), stored at ``trace[index]``."""
    t = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $1, -2147483647; @p mov.u64 $0, %globaltimer; @!p mov.u64 $0, %globaltimer; }",
        "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(trace + index, t)


'''
ALLOCATE_TRACE = ("    grid = (num_splits, num_row_tiles, b * hkv)\n",
                  "    global TRACE\n"
                  "    TRACE = torch.full((num_splits * num_row_tiles * b * hkv, 8), -1, dtype=torch.int64,"
                  " device=q.device)\n")
# (anchor in the kernel's source, text inserted after it; or before it where the text ends the anchor's tuple)
PATCHES = [
    ("    q, k_cache, v_cache, seq_lens, residues, ranks, counts, out, partial, lse, split_counters,", " trace,"),
    ("    row_tile = tl.program_id(1)\n",
     "    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))\n"
     "    trace_row = trace + pid.to(tl.int64) * 8\n"
     "    _stamp(trace_row, 0, pid)\n"
     "    tl.store(trace_row + 5, tl.extra.cuda.smid().to(tl.int64))\n"),
    ("    if KEY_GROUPS == 1:\n", "    _stamp(trace_row, 1, end)\n", "before"),
    ("    seen = l_i > 0\n",
     "    _stamp(trace_row, 2, (tl.sum(l_i, 0) + tl.sum(tl.sum(acc, 1), 0) * 1e-30 > -1.0).to(tl.int32))\n", "before"),
    ('        counter = split_counters + tl.program_id(2) * tl.num_programs(1) + row_tile\n',
     '        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")\n'
     "        _stamp(trace_row, 3, arrived)\n"),
    ("            tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=o_mask)\n",
     "            _stamp(trace_row, 4, (tl.sum(total, 0) > -1.0).to(tl.int32))\n"),
    ALLOCATE_TRACE,
    ("tables.residues, tables.rank, tables.counts, out, partial, lse, split_counters,", " TRACE,"),
    ('        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:',
     "        if arrived == num_splits - 1:", "replace"),
    ("# Tile heights independent", STAMP, "before"),
]


# Inside a CUDA graph a launch must not allocate its trace (the fill would be a kernel of its own between the graph's
# launches): each launch takes the next of the caller's ``module.TRACE_BUFFERS`` (each >= the launch's programs x 8,
# filled with -1 by the caller before a replay), round robin, counting in ``module.TRACE_CALLS``.
PREALLOCATED_TRACE = (ALLOCATE_TRACE[0],
                      "    global TRACE, TRACE_CALLS\n"
                      "    TRACE = TRACE_BUFFERS[TRACE_CALLS % len(TRACE_BUFFERS)]\n"
                      "    TRACE = TRACE[:num_splits * num_row_tiles * b * hkv]\n"
                      "    TRACE_CALLS += 1\n")


def instrumented_kernel(directory: str, preallocated: bool = False):
    """A copy of the decode kernel's module with the timeline stamps (``module.TRACE`` after each launch; with
    ``preallocated``, in the caller's ``module.TRACE_BUFFERS``, for launches inside a CUDA graph)."""
    if not preallocated:
        return patched_module(KERNEL, PATCHES, directory)
    patches = [PREALLOCATED_TRACE if patch is ALLOCATE_TRACE else patch for patch in PATCHES]
    module = patched_module(KERNEL, patches, directory, "instrumented_preallocated")
    module.TRACE_BUFFERS, module.TRACE_CALLS = [], 0
    return module


def phases(trace: np.ndarray) -> dict:
    """Percentiles (us) of one launch's phases from its stamps [programs, 8] (-1: not stamped)."""
    stamps = trace[:, :5].astype(np.float64)
    stamps[trace[:, :5] < 0] = np.nan
    stamps = (stamps - np.nanmin(stamps[:, 0])) / 1e3
    ends = np.nanmax(stamps[:, 2:5], axis=1)

    def pct(x, q=(0, 50, 100)):
        x = x[np.isfinite(x)]
        return np.percentile(x, q).round(2).tolist() if x.size else None

    return {"span_us": round(float(np.nanmax(ends)), 2), "start": pct(stamps[:, 0]),
            "prologue": pct(stamps[:, 1] - stamps[:, 0]), "loop_end": pct(stamps[:, 2], (0, 10, 50, 90, 100)),
            "loop": pct(stamps[:, 2] - stamps[:, 1]), "atomic": pct(stamps[:, 3] - stamps[:, 2]),
            "merge": pct(stamps[:, 4] - stamps[:, 3]), "programs": int(trace.shape[0]),
            "most_programs_on_one_sm": int(np.bincount(trace[:, 5]).max()),
            # per program (in grid order: split fastest): its SM, then start, key range known, loop end, last stamp
            "per_program": [[int(sm), *np.round(row, 2).tolist()]
                            for sm, row in zip(trace[:, 5], np.column_stack([stamps[:, :3], ends]))]}


def timelines(shapes: list[str], launches: int = 3) -> dict:
    layout = sparse_layout()
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        module = instrumented_kernel(directory)
        for shape in shapes:
            batch, length = (int(x) for x in shape.split("x"))
            setup = full_caches(layout, batch, length)
            rows = []
            for i, (k, v) in enumerate(setup["caches"]):  # each cache once: none is in L2 when its launch reads it
                launch(module, setup, layout, (128, 4, 3), None, k, v)
                torch.cuda.synchronize()
                if i >= len(setup["caches"]) - launches:
                    rows.append(phases(module.TRACE.cpu().numpy()))
            results[shape] = {"bytes": setup["bytes"], "launches": rows}
            print(shape, f"{setup['bytes'] / 1e6:.0f} MB", *({k: v for k, v in row.items() if k != "per_program"}
                                                            for row in rows), sep="\n  ", flush=True)
            del setup
            torch.cuda.empty_cache()
    return results


@triton.jit
def chunk_sum_kernel(x, partials, num_elements, chunk, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """``partials[p]`` = the float32 sum of the ``p``-th contiguous ``chunk`` of ``x`` (``num_elements`` long; the
    last chunk may be short)."""
    first = tl.program_id(0).to(tl.int64) * chunk
    end = tl.minimum(first + chunk, num_elements)
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.range(first, end, BLOCK, num_stages=STAGES):
        total += tl.load(x + start + offsets, mask=start + offsets < end, other=0.0).to(tl.float32)
    tl.store(partials + tl.program_id(0), tl.sum(total, 0))


def reads(nbytes: int = 50 << 20) -> dict:
    """One launch reading ``nbytes`` (bf16): contiguous chunks per program, and grid-stride; fractions of copy_."""
    copy_bw = copy_bandwidth()
    buffers = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    partials = torch.empty(4096, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arms = {}
    for programs in (128, 256, 384, 512):
        for warps in (4, 8):
            for block, stages in ((8192, 1), (8192, 3), (4096, 3)):
                chunk = -(-(nbytes // 2) // programs)
                arms[f"chunks programs={programs} warps={warps} block={block} stages={stages}"] = (
                    lambda programs=programs, warps=warps, block=block, stages=stages, chunk=chunk: [
                        chunk_sum_kernel[(programs,)](x, partials, x.numel(), chunk, BLOCK=block, STAGES=stages,
                                                      num_warps=warps)
                        for x in buffers])
    for per_sm in (2, 4):
        arms[f"grid-stride {per_sm}/SM warps=8 block=8192 stages=3"] = (lambda per_sm=per_sm: [
            streaming_sum_kernel[(per_sm * sms,)](x, partials, x.numel(), BLOCK=8192, STAGES=3, num_warps=8)
            for x in buffers])
    results = {"copy_GBps": copy_bw / 1e9, "bytes": nbytes, "arms": {}}
    for name, run in arms.items():
        us = min(graph_seconds(run, calls=2) for _ in range(3)) / len(buffers) * 1e6
        results["arms"][name] = {"us": us, "fraction_of_copy_bandwidth": nbytes / (us / 1e6) / copy_bw}
        print(f"{name:60s} {us:7.2f} us {results['arms'][name]['fraction_of_copy_bandwidth']:.3f}", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="8x32768,1x32768,8x131072,8x4096")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "timelines": timelines(args.shapes.split(",")),
               "reads": reads()}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
