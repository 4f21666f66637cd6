"""Does a programmatically launched (PDL) successor slow the decode kernel? One sparse layer's launches, arranged as
the static cache's decode step arranges them, in CUDA graphs over ``bench_generation.full_caches`` (GPU).

In the 1B hybrid's step at batch 8 / 32k on an H200, a one-program PDL kernel that only waits, placed behind each
decode kernel, costs the step ~93-104 us (bench/NOTES.md, fifty-fourth and fifty-fifth sessions). Each arm here
launches, for every cache of the graph: [the cache append (PDL, the package's: up to the fifty-seventh session it
let the decode kernel launch only at its end, since then right after its wait)], the decode kernel,
[``marker_kernel``: one program that only waits], [a tiny ordinary PyTorch kernel, standing for cuBLAS's o_proj].
``--after marker`` puts the marker before the ordinary kernel. Times are per layer (all of an arm's launches),
medians over ``--rounds``, arms alternated in one process.

``--variants`` adds copies of the decode kernel whose split merge is cut down, to see what of it a programmatic
edge slows. They are for timing only: their outputs are wrong wherever a split would have waited for another.
``relaxed``: the split counter's atomic without its acquire/release; ``noatomic``: no counter, the highest split id
merges whatever is there; ``nomerge``: no counter and no merge. ``--placement`` also records, for every arm of the
package's kernel (``head``), a graph of an instrumented copy (``decode_timeline.py``'s stamps, buffers allocated
before the capture) whose marker and ordinary kernel stamp the edges between the launches: back-to-back replays
event-timed, then single replays read back for each program's SM and phases, how many SMs ran none, and the gaps
between the kernels::

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
from bench_generation import full_caches, graph_seconds, replay_seconds
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
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def marker_kernel(edges, PDL: tl.constexpr, STAMP: tl.constexpr):
    """A PDL kernel of no work: it waits for the kernel before it, then lets the next one launch. With ``STAMP``
    (placement) it stores ``%globaltimer`` at its start (``edges[0]``) and past its wait (``edges[1]``), and its SM
    (``edges[3]``)."""
    if STAMP:
        tl.store(edges, _globaltimer())
    wait_for_preceding_kernel(PDL)
    if STAMP:
        tl.store(edges + 1, _globaltimer())
        tl.store(edges + 3, tl.extra.cuda.smid().to(tl.int64))


@triton.jit
def closing_stamp_kernel(edges):
    """Placement's ordinary kernel after the decode kernel (an ordinary launch, as o_proj's): ``%globaltimer`` at its
    start, in ``edges[2]``."""
    tl.store(edges + 2, _globaltimer())


def variant_module(name: str, directory: str):
    """The package's decode kernel module (``head``) or a copy with its split merge cut down (``VARIANTS``)."""
    if name == "head":
        return decode_triton
    if name not in VARIANTS:
        raise ValueError(f"variant must be head or one of {sorted(VARIANTS)}, got {name!r}")
    return patched_module(Path(decode_triton.__file__), [(SPLIT_COUNTER, VARIANTS[name], "replace")], directory, name)


def layer_launches(module, setup: dict, layout, splits: int | None, k, v, before: str, after: str,
                   ordinary: torch.Tensor, edges: torch.Tensor | None = None) -> torch.Tensor:
    """One sparse layer's launches of an arm over one cache: [append], decode, [marker], [ordinary kernel]. With
    ``edges`` (int64 [4], placement) the marker stamps and the ordinary kernel is ``closing_stamp_kernel``."""
    if before == "append":
        new = setup["q"][:, ::layout.q_heads_per_kv, :1]  # one new token a KV head, written at seq_lens - 1
        s2_cache_append(k, v, new, new, setup["seq_lens"], layout, num_ring_slots=setup["num_ring"])
    out = launch(module, setup, layout, TILES, splits, k, v)
    if after == "marker":
        marker_kernel[(1,)](ordinary if edges is None else edges, STAMP=edges is not None,
                            **launch_options(out.device))
    if after != "none":
        if edges is None:
            ordinary.add_(1.0)
        else:
            closing_stamp_kernel[(1,)](edges)
    return out


def placement(module, setup: dict, layout, splits, before: str, after: str, ordinary: torch.Tensor,
              replays: int = 20, samples: int = 5) -> dict:
    """A graph of the arm's launches with the instrumented kernel, a stamping marker and a stamping ordinary kernel,
    ``samples`` times: ``replays`` back-to-back replays event-timed, the last one's stamps read back (each decode
    launch's phases and SMs, the gaps between the kernels in us). Where a PDL kernel followed the decode kernel, its
    programs ran two to an SM on up to 60 SMs in some graphs and replays and not in others (bench/NOTES.md,
    fifty-sixth session): compare ``us_per_layer`` with the package kernel's time of the same arm."""
    programs = 16 * layout.num_kv_heads * setup["q"].shape[0]  # more than any split count's programs
    module.TRACE_BUFFERS = [torch.empty(programs, 8, dtype=torch.int64, device="cuda") for _ in setup["caches"]]
    edges = torch.full((len(setup["caches"]), 4), -1, dtype=torch.int64, device="cuda")

    def run():
        for i, (k, v) in enumerate(setup["caches"]):
            layer_launches(module, setup, layout, splits, k, v, before, after, ordinary, edges[i])

    module.TRACE_CALLS = 0
    run()  # compiles; one call a cache, so the round robin maps launch i of the graph to buffer i
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gaps = {"closing_to_decode_start": [], "decode_end_to_marker_past_wait": [], "decode_end_to_closing": []}
    times, sms_without_program, spans = [], [], []
    for _ in range(samples):
        for buffer in [*module.TRACE_BUFFERS, edges]:
            buffer.fill_(-1)
        times.append(replay_seconds(graph, replays) / len(setup["caches"]) * 1e6)
        stamps = edges.cpu().numpy()  # the last replay's
        launches = []
        for i, buffer in enumerate(module.TRACE_BUFFERS):
            trace = buffer.cpu().numpy()
            trace = trace[trace[:, 0] >= 0]  # the rows this launch's programs stamped
            launch_phases = decode_timeline.phases(trace)
            programs_per_sm = np.bincount(trace[:, 5], minlength=sms)
            launch_phases["sms_by_programs"] = np.bincount(programs_per_sm).tolist()  # SMs with 0, 1, 2, ... programs
            launches.append(launch_phases)
            sms_without_program.append(launch_phases["sms_by_programs"][0])
            spans.append(launch_phases["span_us"])
            first_start, last_end = trace[:, 0].min(), trace[:, 2:5].max()
            if after != "none":
                gaps["decode_end_to_closing"].append((stamps[i, 2] - last_end) / 1e3)
                if i:
                    gaps["closing_to_decode_start"].append((first_start - stamps[i - 1, 2]) / 1e3)
            if after == "marker":
                gaps["decode_end_to_marker_past_wait"].append((stamps[i, 1] - last_end) / 1e3)
    return {"us_per_layer": statistics.median(times),
            "span_us_median": statistics.median(spans),
            "sms_without_program": sms_without_program,
            "most_programs_on_one_sm": max(row["most_programs_on_one_sm"] for row in launches),
            "gaps_us_median": {key: round(statistics.median(values), 2) for key, values in gaps.items() if values},
            "launches": launches}  # the last sample's


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
            summary = []
            if "placement" in row:
                where = row["placement"]
                summary = [f"instrumented {where['us_per_layer']:.2f} us, span {where['span_us_median']:.2f} us, "
                           f"at most {where['most_programs_on_one_sm']} programs an SM, "
                           f"SMs without one {where['sms_without_program']}", where["gaps_us_median"]]
            print(f"{row['variant']:9s} splits={row['splits']!s:4s} before={row['before']:6s} "
                  f"after={row['after']:8s} {row['median_us']:7.2f} us", *summary, flush=True)
            results["arms"].append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
