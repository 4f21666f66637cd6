r"""The backward with its dq or its dk/dv kernel forced, alternated in one process (GPU): the tuner's best Triton tile
against the warp-specialized Gluon kernels (``kernels/hopper_bwd.py``).

``--kernel dq`` or ``dkdv`` picks the kernel under test; the other one is the tuner's pick in every arm, so the arms
differ only by the kernel under test. The ``triton`` arm is the tile the tuner picks when the Gluon kernel is not
among its candidates (found first, by tuning with it reported unsupported). Each round runs every arm's backward
``RUNS_PER_ROUND`` times under the profiler and keeps the GPU's own kernel times: the kernel under test's, and all the
backward's kernels together. (Timing whole backward calls with ``triton.testing.do_bench`` instead, the same arm
varied by up to 10% from one round to the next on an H100, more than the arms differ; the kernel times did not.) The
JSON keeps every round and the median, and the largest difference of the arms' gradients from the first arm's,
relative to its largest magnitude. ``--version NAME=FILE`` adds, for each Gluon arm, the same arm run by another copy
of ``hopper_bwd.py`` (a variant, another commit's), loaded as a module of ``s2_models.kernels``::

    python bench/backward_ab.py --kernel dq --out $OUT/dq_ab.json
    python bench/backward_ab.py --kernel dq --arms gluon-3-slots,gluon-3-slots@patched \
        --version patched=.gpu/hopper_bwd_patched.py --out $OUT/dq_versions.json
"""

import argparse
import json

import torch
from bench_s2_attention import shape_selected
from kernel_versions import load_version
from tile_candidates import attention_inputs

from s2_models.kernels import S2Pattern, hopper_bwd, triton_impl
from s2_models.kernels.layouts import BlockLayout

# Per kernel: hopper_bwd's test of whether the Gluon kernel runs a call, the Gluon arms, and what the kernels' names
# (Triton's and Gluon's) contain.
SUPPORTED = {"dq": "supported_dq", "dkdv": "supported_dkdv"}
KERNEL_NAMES = {"dq": "bwd_dq", "dkdv": "bwd_dkdv"}
RUNS_PER_ROUND = 4
GLUON_ARMS = {
    "dq": {f"gluon-{c.num_stages}-slots": c for c in triton_impl._GLUON_DQ},
    "dkdv": {"gluon": triton_impl._GLUON_DKDV[0]},
}
# name, (B, Hq, Hkv, T, D), (block_size, local_blocks, vert_stride), q/k/v as the model's [B, T, H, D] projections
SHAPES = [
    ("block 64, 16 x 8192", (16, 32, 32, 8192, 128), (64, 16, 16), False),
    ("block 64, 4 x 32768", (4, 32, 32, 32768, 128), (64, 16, 16), False),
    ("block 64, 1 x 131072", (1, 32, 32, 131072, 128), (64, 16, 16), False),
    ("block 32, 8 x 16384", (8, 32, 32, 16384, 128), (32, 32, 16), False),
    ("block 128, 8 x 16384", (8, 32, 32, 16384, 128), (128, 8, 16), False),
    ("D=64, 4 x 32768", (4, 32, 32, 32768, 64), (64, 16, 16), False),
    ("GQA 32/8, 4 x 32768", (4, 32, 8, 32768, 128), (64, 16, 16), False),
    ("GQA 32/8, D=64, 8 x 16384", (8, 32, 8, 16384, 64), (64, 16, 16), False),
    ("1B model, 1 x 32768", (1, 32, 8, 32768, 64), (64, 16, 16), True),
]


def measure(kind, shape, pattern_fields, model_layout, arms, rounds, versions) -> dict:
    """One shape: every arm's backward, ``rounds`` times alternated, and its gradients against the first arm's."""
    batch, q_heads, kv_heads, seqlen, head_dim = shape
    block_size, local_blocks, vert_stride = pattern_fields
    q, k, v, grad = attention_inputs(*shape, model_layout)
    pattern = S2Pattern(block_size=block_size, local_blocks=local_blocks, vert_stride=vert_stride,
                        head_sliding_offset=0)
    num_blocks = -(-seqlen // block_size)
    block_mask = pattern.block_mask(pattern.num_pattern_heads(q_heads, kv_heads), num_blocks, num_blocks)
    layout = BlockLayout(block_mask.cuda(), block_size, True, None)
    scale = head_dim ** -0.5
    out, lse = triton_impl.s2_attention_fwd(q, k, v, layout, scale, None)
    tune_key = triton_impl._problem(q, k, layout, None).tune_key

    def backward():
        return triton_impl.s2_attention_bwd(q, k, v, out, lse, grad, None, layout, scale, None)

    supported = getattr(hopper_bwd, SUPPORTED[kind])
    setattr(hopper_bwd, SUPPORTED[kind], lambda *args: False)
    try:  # the tuner's best Triton tile for this call
        backward()
    finally:
        setattr(hopper_bwd, SUPPORTED[kind], supported)
    configs = {"triton": triton_impl._TUNED_CONFIGS[(kind, *tune_key, False)], **GLUON_ARMS[kind]}
    configs.update({f"{arm}@{name}": config for arm, config in GLUON_ARMS[kind].items() for name in versions})
    key = (kind, *tune_key, True)  # the tuner's cache entry for the call, set to each arm in turn

    def run(arm):
        triton_impl._TUNED_CONFIGS[key] = configs[arm]
        triton_impl.hopper_bwd = versions[arm.split("@")[1]] if "@" in arm else hopper_bwd
        try:
            return backward()
        finally:
            triton_impl.hopper_bwd = hopper_bwd

    grads = {arm: run(arm) for arm in arms}  # compiles each arm, tunes the other kernel
    first = grads[arms[0]]
    errors = {arm: [float((g.float() - f.float()).abs().max() / f.float().abs().max()) for g, f in
                    zip(grads[arm], first)] for arm in arms}
    kernel_ms = {arm: [] for arm in arms}
    backward_ms = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            kernel, total = kernel_times(lambda a=arm: run(a), KERNEL_NAMES[kind])
            kernel_ms[arm].append(kernel)
            backward_ms[arm].append(total)
    median = lambda times: sorted(times)[len(times) // 2]  # noqa: E731
    return {"configs": {arm: repr(configs[arm]) for arm in arms}, "kernel_ms": kernel_ms, "backward_ms": backward_ms,
            "kernel_median_ms": {arm: median(t) for arm, t in kernel_ms.items()},
            "backward_median_ms": {arm: median(t) for arm, t in backward_ms.items()}, "dq_dk_dv_rel_diff": errors}


def kernel_times(backward, name: str) -> tuple[float, float]:
    """``RUNS_PER_ROUND`` backward calls under the profiler: the mean ms of the kernels whose name contains
    ``name``, and of all the GPU's kernels a call."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(RUNS_PER_ROUND):
            backward()
        torch.cuda.synchronize()
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    matching = [e.device_time_total for e in kernels if name in e.name]
    if not matching:
        raise RuntimeError(f"no kernel named *{name}* ran")
    return sum(matching) / len(matching) / 1e3, sum(e.device_time_total for e in kernels) / RUNS_PER_ROUND / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=sorted(SUPPORTED), required=True)
    parser.add_argument("--arms", help="comma-separated (default: triton and every Gluon arm of the kernel)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="shapes whose name contains one of these (separated by ';'), or is one written "
                        "'=name'")
    parser.add_argument("--version", action="append", default=[], metavar="NAME=FILE",
                        help="a copy of hopper_bwd.py whose Gluon arms run as <arm>@NAME (repeatable)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    versions = {name: load_version(path) for name, path in (v.split("=", 1) for v in args.version)}
    arms = args.arms.split(",") if args.arms else [
        "triton", *GLUON_ARMS[args.kernel], *(f"{arm}@{name}" for arm in GLUON_ARMS[args.kernel] for name in versions)]
    results = {"gpu": torch.cuda.get_device_name(), "kernel": args.kernel, "arms": arms, "shapes": {}}
    for name, shape, pattern_fields, model_layout in SHAPES:
        if not shape_selected(name, args.only):
            continue
        row = measure(args.kernel, shape, pattern_fields, model_layout, arms, args.rounds, versions)
        results["shapes"][name] = row
        kernel, backward = row["kernel_median_ms"], row["backward_median_ms"]
        print(name, args.kernel, {arm: round(ms, 3) for arm, ms in kernel.items()},
              "backward", {arm: round(ms, 2) for arm, ms in backward.items()},
              {arm: round(backward[arms[0]] / ms, 3) for arm, ms in backward.items()}, row["dq_dk_dv_rel_diff"],
              row["configs"].get("triton", ""), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
