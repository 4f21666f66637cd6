"""Does a programmatically launched (PDL) successor slow the decode kernel? One sparse layer's launches, arranged as
the static cache's decode step arranges them, in CUDA graphs over ``bench_generation.full_caches`` (GPU).

In the 1B hybrid's step at batch 8 / 32k on an H200, a one-program PDL kernel that only waits, placed behind each
decode kernel, costs the step ~93-104 us (bench/NOTES.md, fifty-fourth and fifty-fifth sessions). Each arm here
launches, for every cache of the graph: [the cache append (PDL; it lets the decode kernel launch at its end, as in
the step)], the decode kernel, [``marker_kernel``: one program that only waits], [a tiny ordinary PyTorch kernel,
standing for cuBLAS's o_proj]. ``--after marker`` puts the marker before the ordinary kernel. Times are per layer
(all of an arm's launches), medians over ``--rounds``, arms alternated in one process.

``--variants`` adds copies of the decode kernel whose split merge is cut down, to see what of it a programmatic
edge slows. They are for timing only: their outputs are wrong wherever a split would have waited for another.
``relaxed``: the split counter's atomic without its acquire/release; ``noatomic``: no counter, the highest split id
merges whatever is there; ``nomerge``: no counter and no merge. ``--placement`` also records, for every arm of the
package's kernel (``head``), one graph replay of an instrumented copy (``decode_timeline.py``'s stamps, buffers
allocated before the capture): each program's SM and phases, and how many programs shared an SM::

    python bench/pdl_edge.py --out $OUT/pdl_edge.json --variants head,nomerge --placement
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

import decode_timeline
import numpy as np
import torch
from bench_generation import full_caches, graph_seconds
from decode_ab import launch, sparse_layout
from kernel_versions import patched_module

from s2_models.kernels import decode_triton
from s2_models.kernels.decode import s2_cache_append
from s2_models.kernels.dependent_launch import launch_options, wait_for_preceding_kernel
from s2_models.kernels.triton_setup import tl, triton

TILES = (128, 4, 3)  # the default launch shape (keys x warps x stages)
SPLIT_COUNTER = 'if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:'
VARIANTS = {  # timing only (see the module docstring)
    "relaxed": SPLIT_COUNTER.replace("acq_rel", "relaxed"),
    "noatomic": "if split == num_splits - 1:",
    "nomerge": "if split < 0:",
}


@triton.jit
def marker_kernel(x, PDL: tl.constexpr):
    """A PDL kernel of no work: it waits for the kernel before it, then lets the next one launch."""
    wait_for_preceding_kernel(PDL)


def variant_module(name: str, directory: str):
    """The package's decode kernel module (``head``) or a copy with its split merge cut down (``VARIANTS``)."""
    if name == "head":
        return decode_triton
    if name not in VARIANTS:
        raise ValueError(f"variant must be head or one of {sorted(VARIANTS)}, got {name!r}")
    return patched_module(Path(decode_triton.__file__), [(SPLIT_COUNTER, VARIANTS[name], "replace")], directory, name)


def layer_launches(module, setup: dict, layout, splits: int | None, k, v, before: str, after: str,
                   ordinary: torch.Tensor) -> torch.Tensor:
    """One sparse layer's launches of an arm over one cache: [append], decode, [marker], [ordinary kernel]."""
    if before == "append":
        new = setup["q"][:, ::layout.q_heads_per_kv, :1]  # one new token a KV head, written at seq_lens - 1
        s2_cache_append(k, v, new, new, setup["seq_lens"], layout, num_ring_slots=setup["num_ring"])
    out = launch(module, setup, layout, TILES, splits, k, v)
    if after == "marker":
        marker_kernel[(1,)](out, **launch_options(out.device))
    if after != "none":
        ordinary.add_(1.0)
    return out


def placement(module, setup: dict, layout, splits, before: str, after: str, ordinary: torch.Tensor) -> dict:
    """One replay of a graph of the arm's launches with the instrumented kernel: each launch's phases and SMs."""
    programs = 16 * layout.num_kv_heads * setup["q"].shape[0]  # more than any split count's programs
    module.TRACE_BUFFERS = [torch.empty(programs, 8, dtype=torch.int64, device="cuda") for _ in setup["caches"]]

    def run():
        for k, v in setup["caches"]:
            layer_launches(module, setup, layout, splits, k, v, before, after, ordinary)

    run()  # compiles; one call a cache, so the round robin maps launch i of the graph to buffer i
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    for buffer in module.TRACE_BUFFERS:
        buffer.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launches = []
    for buffer in module.TRACE_BUFFERS:
        trace = buffer.cpu().numpy()
        trace = trace[trace[:, 0] >= 0]  # the rows this launch's programs stamped
        launch_phases = decode_timeline.phases(trace)
        programs_per_sm = np.bincount(trace[:, 5], minlength=sms)
        launch_phases["sms_by_programs"] = np.bincount(programs_per_sm).tolist()  # SMs with 0, 1, 2, ... programs
        launches.append(launch_phases)
    return {"span_us_median": statistics.median(row["span_us"] for row in launches),
            "most_programs_on_one_sm": max(row["most_programs_on_one_sm"] for row in launches),
            "launches": launches}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="8x32768", help="batch x context")
    parser.add_argument("--splits", default="auto,1", help="comma-separated split counts; auto: the heuristic")
    parser.add_argument("--before", default="none,append", help="comma-separated: none, append")
    parser.add_argument("--after", default="none,ordinary,marker", help="comma-separated: none, ordinary, marker")
    parser.add_argument("--variants", default="head", help=f"comma-separated: head, {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--placement", action="store_true", help="also each arm's SMs and phases (instrumented)")
    args = parser.parse_args()
    batch, length = (int(x) for x in args.shape.split("x"))
    layout = sparse_layout()
    setup = full_caches(layout, batch, length)
    ordinary = torch.zeros(64, device="cuda")
    arms = list(itertools.product(args.variants.split(","), [None if s == "auto" else int(s) for s in
                                                             args.splits.split(",")],
                                  args.before.split(","), args.after.split(",")))
    results = {"device": torch.cuda.get_device_name(), "shape": args.shape, "bytes": setup["bytes"],
               "tiles": "x".join(map(str, TILES)), "arms": []}
    with tempfile.TemporaryDirectory() as directory:
        modules = {name: variant_module(name, directory) for name in args.variants.split(",")}
        rows = [{"variant": name, "splits": splits or "auto", "before": before, "after": after, "us_per_layer": []}
                for name, splits, before, after in arms]
        for _ in range(args.rounds):
            for (name, splits, before, after), row in zip(arms, rows):
                def run(module=modules[name], splits=splits, before=before, after=after):
                    for k, v in setup["caches"]:
                        layer_launches(module, setup, layout, splits, k, v, before, after, ordinary)
                row["us_per_layer"].append(min(graph_seconds(run, calls=2) for _ in range(3))
                                           / len(setup["caches"]) * 1e6)
        if args.placement:
            instrumented = decode_timeline.instrumented_kernel(directory, preallocated=True)
        for row in rows:
            row["median_us"] = statistics.median(row["us_per_layer"])
            if args.placement and row["variant"] == "head":
                splits = None if row["splits"] == "auto" else row["splits"]
                row["placement"] = placement(instrumented, setup, layout, splits, row["before"], row["after"],
                                             ordinary)
            print(f"{row['variant']:9s} splits={row['splits']!s:4s} before={row['before']:6s} "
                  f"after={row['after']:8s} {row['median_us']:7.2f} us", *(
                      [f"span {row['placement']['span_us_median']:.2f} us, at most "
                       f"{row['placement']['most_programs_on_one_sm']} programs an SM"] if "placement" in row else []),
                  flush=True)
            results["arms"].append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
