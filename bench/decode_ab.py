"""The decode kernel (kernels/decode_triton.py) against other versions of that file, at one layer's launches (GPU).

Each version's ``decode_attention_triton`` runs over full compact caches of ``bench_generation.py``'s 1B hybrid
(batch x context of ``--shapes``), at each launch shape of ``--tiles`` (keys per tile x warps x pipeline stages;
``auto``: the version's own choice) and each split count of ``--splits`` (``auto``: the version's own heuristic).
Every timing is a CUDA graph over ``bench_generation.full_caches`` (distinct caches of >= 400 MB in all, so that the
L2 cache serves none of them), the arms alternated ``--rounds`` times in one process; bandwidth counts the K and V
bytes read, as a fraction of this run's copy ceiling. A shape ``BxT+S`` gives each row ``S`` slots it does not fill
(a static cache's rows, with other strides); ``--query-tokens`` times chunks (speculative decoding's verify chunks)
instead of one-token steps. Each arm's output is compared with the first version's at its first launch shape (a
timing-only variant shows up as a large difference). The other versions are copies of ``decode_triton.py``, loaded
as modules of ``s2_models.kernels`` so that their relative imports resolve::

    git show HEAD~1:kernels/decode_triton.py > .gpu/decode_before.py
    python bench/decode_ab.py --version before=.gpu/decode_before.py --out $OUT/decode_ab.json

The JSON's ``variants`` give each version's compiled kernels: warps, stages, registers, shared memory and how many of
its programs fit on one SM (the driver's occupancy query). Versions that differ there pack a launch differently: under
programmatic dependent launch the next launch's programs take an SM's spare slots early, and a one-split launch of ~2
programs an SM lost 20% where three fitted (bench/NOTES.md, forty-eighth session).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import json

import kernel_versions
import torch
from bench_generation import SHAPES, build, copy_bandwidth, full_caches, graph_seconds, prefill

from s2_models.kernels import decode_triton
from s2_models.static_cache_s2_llama import S2StaticCache


def load_version(path: str):
    """A copy of ``decode_triton.py`` as a module of ``s2_models.kernels`` (``kernel_versions.load_version``)."""
    return kernel_versions.load_version(path, "_decode_")


def sparse_layout():
    """The compact layout ``generate``'s static cache gives the 1B hybrid's sparse layers."""
    model = build(dense=False)
    cache = S2StaticCache(model.config, max_cache_len=256)
    prefill(model, 1, 128, cache=cache)
    layout = next(layer for layer in cache.layers if layer.is_sparse).layout
    del model, cache
    torch.cuda.empty_cache()
    return layout


def launch(module, setup, layout, tiles, splits, k, v):
    return module.decode_attention_triton(setup["q"], k, v, setup["seq_lens"], layout, setup["num_ring"],
                                          SHAPES["head_dim"] ** -0.5, splits,
                                          tiles=None if tiles is None else module.DecodeTiles(*tiles),
                                          split_counters=setup["split_counters"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--version", action="append", default=[], help="name=path of a decode_triton.py copy")
    parser.add_argument("--tiles", default="128x4x3",
                        help="comma-separated keys x warps x stages; auto: the version's own choice")
    parser.add_argument("--splits", default="auto", help="comma-separated split counts; auto: the heuristic")
    parser.add_argument("--shapes", default="8x32768,8x4096,8x16384,1x32768,8x131072,32x32768",
                        help="comma-separated batch x context, each optionally +S: S spare slots a row (unread)")
    parser.add_argument("--query-tokens", type=int, default=1, help="new tokens a row (1: a decode step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--counters", choices=("persistent", "fresh"), default="persistent",
                        help="persistent: split counters kept across launches, as the model's caches keep them; "
                             "fresh: each launch zeroes a new buffer (how this script timed before 2026-11-26)")
    args = parser.parse_args()
    versions = {"head": decode_triton} | {name: load_version(path) for name, path in
                                          (v.split("=", 1) for v in args.version)}
    tiles = [None if t == "auto" else tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    splits = [None if s == "auto" else int(s) for s in args.splits.split(",")]
    arms = list(itertools.product(versions, tiles, splits))
    layout = sparse_layout()
    copy_bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9, "versions": list(versions),
               "query_tokens": args.query_tokens, "counters": args.counters, "shapes": {}}
    for shape in args.shapes.split(","):
        size, _, spare = shape.partition("+")
        batch, length = (int(x) for x in size.split("x"))
        results["shapes"][shape] = row = measure_shape(versions, arms, layout, batch, length, int(spare or 0),
                                                       args.query_tokens, args.rounds, copy_bw, args.counters)
        print(shape, f"{row['bytes'] / 1e6:.0f} MB", flush=True)
        for label, arm in row["arms"].items():
            print(f"  {label:36s} {arm['median_us']:7.2f} us  {arm['fraction_of_copy_bandwidth']:.3f}"
                  f"  diff {arm['max_abs_diff_vs_head']:.2e}  rounds {[round(u, 2) for u in arm['us']]}", flush=True)
        torch.cuda.empty_cache()
        results["variants"] = {name: compiled_variants(module) for name, module in versions.items()}
        with open(args.out, "w") as f:  # after each shape, so that a run cut by its time limit keeps what it measured
            json.dump(results, f, indent=1)
    for name, variants in results["variants"].items():
        print(name, *variants, sep="\n  ")


def compiled_variants(module) -> list[dict]:
    """Every variant of ``module``'s decode kernel compiled so far (on a GPU; none in the interpreter): warps, stages,
    registers, shared memory and programs an SM."""
    variants = []
    for kernel_cache, *_ in getattr(module.s2_decode_fwd_kernel, "device_caches", {}).values():
        for compiled in kernel_cache.values():
            compiled._init_handles()  # loads the binary, which gives its register count
            meta = compiled.metadata
            variants.append({"num_warps": meta.num_warps, "num_stages": meta.num_stages, "registers": compiled.n_regs,
                             "shared_bytes": meta.shared, "programs_per_sm": programs_per_sm(compiled)})
    return variants


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def programs_per_sm(compiled) -> int:
    """How many programs of a compiled Triton kernel can be resident on one SM at once
    (``cuOccupancyMaxActiveBlocksPerMultiprocessor`` over its registers, threads and shared memory)."""
    count = ctypes.c_int()
    status = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(count), ctypes.c_void_p(compiled.function), 32 * compiled.metadata.num_warps,
        ctypes.c_size_t(compiled.metadata.shared))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {status}")
    return count.value


def measure_shape(versions, arms, layout, batch, length, spare_slots, query_tokens, rounds, copy_bw,
                  counters="persistent") -> dict:
    """Every arm at one batch x context: its output's difference from the first arm's, its times over ``rounds``."""
    setup = full_caches(layout, batch, length, spare_slots, query_tokens)
    if counters == "fresh":
        setup["split_counters"] = None
    k0, v0 = setup["caches"][0]
    _, tile0, split0 = arms[0]
    reference = launch(versions["head"], setup, layout, tile0, split0, k0, v0).float()
    row = {"bytes": setup["bytes"], "arms": {}}
    for name, tile, split in arms:
        out = launch(versions[name], setup, layout, tile, split, k0, v0).float()
        row["arms"][f"{name} {'x'.join(map(str, tile or ['auto']))} splits={split or 'auto'}"] = {
            "max_abs_diff_vs_head": (out - reference).abs().max().item(), "us": []}
    for _ in range(rounds):
        for (name, tile, split), arm in zip(arms, row["arms"].values()):
            def run(name=name, tile=tile, split=split):
                for k, v in setup["caches"]:
                    launch(versions[name], setup, layout, tile, split, k, v)
            arm["us"].append(min(graph_seconds(run, calls=2) for _ in range(3)) / len(setup["caches"]) * 1e6)
    for arm in row["arms"].values():
        arm["median_us"] = sorted(arm["us"])[len(arm["us"]) // 2]
        arm["fraction_of_copy_bandwidth"] = setup["bytes"] / (arm["median_us"] / 1e6) / copy_bw
    return row

if __name__ == "__main__":
    main()
