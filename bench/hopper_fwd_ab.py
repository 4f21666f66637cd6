"""The warp-specialized forward (kernels/hopper_fwd.py) against other versions of that file, forced tiles (GPU).

Each version runs as the tuner's only forward candidate (``triton_impl._WARP_SPECIALIZED_FWD``), all alternated
``--rounds`` times in one process, shape by shape (a round's arms back to back, each in turn first), at issue 9's
shapes with blocks of 32 and more (``bench_s2_attention.py``'s ``COMPARE_SHAPES`` and patterns; bf16, causal), timed
as the GPU's own kernel times under the profiler (``backward_ab.kernel_times``: whole calls timed with ``do_bench``
moved by up to 15% between rounds on an H100, more than the versions differ), after the worst relative error of each
against the fp32 PyTorch path on odd shapes (with few programs, so that every program runs many work items). The other
versions are copies of ``hopper_fwd.py`` (another commit's, or variants); each is loaded as a module of
``s2_models.kernels`` so that its relative imports resolve; a version must read the lists this checkout's
``triton_impl`` builds for it (since the twenty-third session, ``split_first_step``'s: an older file would read a
split step as an ordinary one and fail its error check). Each version runs with each ``--tiles`` entry (keys per step
x ring slots, as that version's ``launch`` reads ``num_buffers``; without ``--tiles``, the package's tile for each head
dim), one arm each; ratios are the first arm's time over
each arm's in the same round, their median and range (above 1: the arm is faster)::

    git show HEAD~1:kernels/hopper_fwd.py > .gpu/hopper_fwd_before.py
    python bench/hopper_fwd_ab.py --version before=.gpu/hopper_fwd_before.py --out $OUT/hopper_fwd_ab.json
    python bench/hopper_fwd_ab.py --tiles 64x3,128x2 --out $OUT/hopper_fwd_tiles.json
    python bench/hopper_fwd_ab.py --without-split-steps --only "T=8192;T=32768" --out $OUT/hopper_fwd_split.json

With ``--without-split-steps`` every arm also runs on lists without split steps (``plain_lists``), an arm each.

With ``--triton-tile BMxBNxWARPSxSTAGES[xREGS]`` the arms are the Triton forward instead (``triton_impl``'s
``s2_attention_fwd_kernel``, run with that one tile; ``REGS`` its register cap), and each ``--version`` is a copy of
``triton_impl.py`` (e.g. the D=64 row's register-capped tile: ``--triton-tile 64x64x4x2x128 --only D=64``).
"""

import argparse
import json
import math
import os

os.environ["S2_ATTENTION_AUTOTUNE"] = "0"  # the one forced candidate

import torch  # noqa: E402
import triton  # noqa: E402
from backward_ab import kernel_times  # noqa: E402
from bench_s2_attention import COMPARE_SHAPES, compare_pattern, shape_selected  # noqa: E402
from kernel_versions import load_version  # noqa: E402

from s2_models.kernels import S2Pattern, s2_attention, triton_impl  # noqa: E402

# Issue 9's shapes that the warp-specialized forward runs (blocks of 32 and more), with the comparison's patterns.
SHAPES = [shape for shape in COMPARE_SHAPES if shape[1]["block_size"] >= 32]
# (batch, Hq, Hkv, T, D), block size: odd lengths, GQA, the three unit sizes
ERROR_CASES = [((2, 8, 2, 1999, 128), 64), ((1, 8, 8, 3001, 64), 128), ((2, 4, 2, 1501, 128), 32)]


ONE_PER_SM = {}  # module -> its own _num_sms
SPLIT_FIRST_STEP = triton_impl.split_first_step


def plain_lists(units, bits, counts, group: int, blocks_per_tile: int):
    """``triton_impl.split_first_step`` for an arm without split steps: the lists as built, every tile's split count
    0 (what ``split_first_step`` returns where no split can be made)."""
    return units, bits, torch.cat([counts, torch.zeros_like(counts[..., :1])], -1)


def use(module, tile, programs=None, split_steps: bool = True) -> None:
    """Run ``module``'s kernel as the only forward candidate, with ``tile = (keys per step, ring slots)`` (``None``:
    each head-dim class's tile of ``triton_impl._WARP_SPECIALIZED_FWD``) (with ``programs`` programs, or one per SM),
    on lists with split steps or without (``plain_lists``). A version whose
    kernel takes other work items can say so: its ``AB_TILE`` replaces ``tile``, and ``SPLIT_STEPS = False`` gives it
    lists without split steps (its tile is ``BLOCK_M`` rows in any case)."""
    tile = getattr(module, "AB_TILE", tile)
    split_steps = split_steps and getattr(module, "SPLIT_STEPS", True)
    triton_impl.split_first_step = SPLIT_FIRST_STEP if split_steps else plain_lists
    triton_impl._UNIT_LIST_CACHE.clear()  # lists built for the other kind of arm
    triton_impl.hopper_fwd = module
    ONE_PER_SM.setdefault(module, module._num_sms)
    module._num_sms = (lambda device: programs) if programs else ONE_PER_SM[module]
    for size in ("small", "medium"):
        package = triton_impl._WARP_SPECIALIZED_FWD[size][0]
        block_n, num_buffers = tile or (package.block_n, package.num_stages)
        triton_impl._CANDIDATES[("fwd", size)] = [triton_impl.TileConfig(module.BLOCK_M, block_n, 4, num_buffers,
                                                                         True)]
    triton_impl._TUNED_CONFIGS.clear()


def use_triton(kernel, config) -> None:
    """Run ``kernel`` (a version's ``s2_attention_fwd_kernel``) as the only forward, with the one tile ``config``."""
    triton_impl.s2_attention_fwd_kernel = kernel
    for size in ("small", "medium"):
        triton_impl._CANDIDATES[("fwd", size)] = [config]
    triton_impl._TUNED_CONFIGS.clear()


def worst_error(select, select_few) -> dict:
    """Worst relative error of out and lse over ERROR_CASES, against the fp32 PyTorch path (PyTorch's own bf16 path
    beside it), with the arm ``select_few()`` forces (a Gluon arm with 4 programs); NaN where an output had one (a
    timing-only variant that skips work)."""
    select_few()
    worst = {"kernel_out": 0.0, "kernel_lse": 0.0, "torch_bf16_out": 0.0}
    for seed, ((batch, q_heads, kv_heads, seqlen, head_dim), block_size) in enumerate(ERROR_CASES):
        torch.manual_seed(seed)
        q = torch.randn(batch, q_heads, seqlen, head_dim, device="cuda")
        k, v = (torch.randn(batch, kv_heads, seqlen, head_dim, device="cuda") for _ in range(2))
        pattern = S2Pattern(block_size=block_size, local_blocks=3, vert_stride=4)
        ref, ref_lse = s2_attention(q, k, v, pattern, backend="torch", return_lse=True)
        low = [x.bfloat16() for x in (q, k, v)]
        try:
            out, lse = s2_attention(*low, pattern, backend="triton", return_lse=True)
        except triton.runtime.errors.OutOfResources:  # a ring too large for this head dim's tiles
            worst.setdefault("does_not_fit", []).append(head_dim)
            continue
        torch_out = s2_attention(*low, pattern, backend="torch")
        for key, x, r in (("kernel_out", out, ref), ("kernel_lse", lse, ref_lse), ("torch_bf16_out", torch_out, ref)):
            error = ((x.float() - r).norm() / r.norm()).item()  # NaN where x has one
            worst[key] = max(worst[key], error, key=lambda e: math.inf if math.isnan(e) else e)
    select()
    return worst


def forward_inputs(fields, batch, seqlen, q_heads, kv_heads, head_dim) -> tuple:
    """A shape's q, k, v (bf16) and pattern, shared by every arm and round."""
    q = torch.randn(batch, q_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, compare_pattern(fields, q_heads)


def forward_ms(q, k, v, pattern, kernel_name: str) -> float:
    s2_attention(q, k, v, pattern, backend="triton")  # compiles (an arm's first call), builds the lists
    return kernel_times(lambda: s2_attention(q, k, v, pattern, backend="triton"), kernel_name)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="append", default=[], metavar="NAME=PATH",
                        help="a copy of hopper_fwd.py (triton_impl.py with --triton-tile) to compare with this "
                             "checkout's (repeatable)")
    parser.add_argument("--tiles", help="KEYSxSLOTS,...: keys per step and ring slots (launch's num_buffers), an arm "
                                         "each (default: the package's tile for each head dim)")
    parser.add_argument("--triton-tile", metavar="BMxBNxWARPSxSTAGES[xREGS]",
                        help="time the Triton forward with this tile instead; versions are copies of triton_impl.py")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", help="shapes whose name contains one of these (separated by ';'), or is one written "
                                       "'=name' (bench_s2_attention.shape_selected)")
    parser.add_argument("--without-split-steps", action="store_true",
                        help="also run every arm on lists without split steps (an arm each)")
    args = parser.parse_args()
    versions = {"current": triton_impl if args.triton_tile else triton_impl.hopper_fwd}
    versions.update((name, load_version(path)) for name, path in (v.split("=", 1) for v in args.version))
    arms = {}  # name -> (a call that forces the arm, the same with few programs)
    if args.triton_tile:
        block_m, block_n, warps, stages, *registers = (int(x) for x in args.triton_tile.split("x"))
        config = triton_impl.TileConfig(block_m, block_n, warps, stages, max_registers=(registers or [None])[0])
        current_kernel = triton_impl.s2_attention_fwd_kernel  # the checkout's, before any arm replaces it
        for name, module in versions.items():
            kernel = current_kernel if module is triton_impl else module.s2_attention_fwd_kernel
            arms[f"{name}@{args.triton_tile}"] = (lambda k=kernel: use_triton(k, config),) * 2
        kernel_name = "s2_attention_fwd_kernel"
    else:
        for name, module in versions.items():
            for tile in args.tiles.split(",") if args.tiles else [None]:
                tile = getattr(module, "AB_TILE", tile and tuple(int(x) for x in tile.split("x")))  # as use() runs it
                for split in (True, False) if args.without_split_steps else (True,):
                    arm = name + (f"@{tile[0]}x{tile[1]}" if tile else "") + ("" if split else "-no-split")
                    arms[arm] = (lambda m=module, t=tile, s=split: use(m, t, split_steps=s),
                                 lambda m=module, t=tile, s=split: use(m, t, programs=4, split_steps=s))
        kernel_name = "fwd_ws_kernel"
    results = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
               "errors": {name: worst_error(*arm) for name, arm in arms.items()}, "ms": {}}
    print(json.dumps(results["errors"]), flush=True)
    for shape_name, *shape in SHAPES:
        if not shape_selected(shape_name, args.only):
            continue
        inputs = forward_inputs(*shape)
        runs = results["ms"][shape_name] = {name: [] for name in arms}
        for round_ in range(args.rounds):
            # A round's arms run back to back, in turn first, so that the clocks' drift within a call (up to ~10%
            # between rounds on an H100) falls mostly between rounds, not between the arms a ratio compares.
            for name in list(arms)[:: 1 if round_ % 2 == 0 else -1]:
                arms[name][0]()
                runs[name].append(round(forward_ms(*inputs, kernel_name), 3))
                print(round_, name, shape_name, runs[name][-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump(results, f, indent=1)
    baseline, *others = arms
    header = " | ".join(f"{name} ms, {baseline} / {name} (rounds)" for name in others)
    print(f"\n| shape | {baseline} ms (each round) | {header} |")
    for shape_name, runs in results["ms"].items():
        cells = []
        for name in others:
            ratios = sorted(b / a for b, a in zip(runs[baseline], runs[name]))
            cells.append(f"{runs[name]}, {ratios[len(ratios) // 2]:.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})")
        print(f"| {shape_name} | {runs[baseline]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
