"""Which load path and masked-loop depth make the training kernels fastest, and are they exact there? (GPU)

Variants of ``kernels/triton_impl.py``'s module switches, each with the same forced tiles (the tuner's winners at
the headline shapes on an H100: forward 128x64 / 8 warps and 128x128 / 8 warps, dq 128x64 / 8 warps, dk/dv 64x64 /
4 warps, all at 2 stages):

* ``pointers``: K/V (forward, dq) and Q/dO (dk/dv) gathered through per-row pointers (cp.async), masked loops
  unpipelined;
* ``tma``: unmasked steps whose gathered tile is one contiguous unit load it through TMA descriptors;
* ``tma+masked2``: also the masked (partial-entry) loops pipelined at 2 stages.

For each variant: the worst relative error against the fp32 PyTorch path over odd-shaped cases (block 16-128, GQA,
T = 1500-3001; it must stay at the ``pointers`` level and PyTorch's own bf16 error), then the median time of the
forward and forward+backward at issue 9's shapes. ``--warm VARIANT`` only compiles (run one process per variant in
parallel first: compilation, not the GPU, is what takes the time). Writes ``$OUT/kernel_variants.json``.

    for v in pointers tma tma+masked2; do python bench/kernel_variants.py --warm $v & done; wait
    python bench/kernel_variants.py
"""

import argparse
import json
import os
from pathlib import Path

os.environ["S2_ATTENTION_AUTOTUNE"] = "0"  # take the first candidate, which this script sets

import torch  # noqa: E402
import triton  # noqa: E402
from pipelining_check import errors  # noqa: E402  (the odd-shaped exactness cases, worst error per gradient)

from s2_models.kernels import S2Pattern, s2_attention, triton_impl  # noqa: E402

VARIANTS = {"pointers": (False, 1), "tma": (True, 1), "tma+masked2": (True, 2)}  # (_USE_TMA, _MASKED_LOOP_STAGES)
FWD_TILES = ((128, 64, 8), (128, 128, 8))
BWD_TILES = {"dq": (128, 64, 8), "dkdv": (64, 64, 4)}
# name, block size, local blocks, batch, seqlen, q heads, kv heads, head dim (vert_stride 16)
SHAPES = [
    ("block 64, T=131072", 64, 16, 1, 131072, 32, 32, 128),
    ("block 64, T=8192", 64, 16, 16, 8192, 32, 32, 128),
    ("block 128, T=16384", 128, 8, 8, 16384, 32, 32, 128),
    ("block 32, T=16384", 32, 32, 8, 16384, 32, 32, 128),
    ("GQA 32/8, D=64, T=16384", 64, 16, 8, 16384, 32, 8, 64),
]


def use(variant: str, fwd_tile) -> None:
    triton_impl._USE_TMA, triton_impl._MASKED_LOOP_STAGES = VARIANTS[variant]
    tiles = {"fwd": fwd_tile, **BWD_TILES}
    for kind, tile in tiles.items():
        for size in ("small", "medium", "large"):
            triton_impl._CANDIDATES[(kind, size)] = [triton_impl.TileConfig(*tile, 2)]
    triton_impl._TUNED_CONFIGS.clear()


def time_shape(bs, local, batch, seqlen, heads, kv_heads, head_dim, warm_only: bool) -> dict:
    """Median forward and forward+backward ms (``warm_only``: one tiny call of each, to compile)."""
    if warm_only:
        batch, seqlen = 1, 4 * 128  # the same constexprs compile, nothing worth timing runs
    pattern = S2Pattern(block_size=bs, local_blocks=local, vert_stride=16)
    q = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)

    def forward():
        return s2_attention(q.detach(), k.detach(), v.detach(), pattern, backend="triton")

    def forward_backward():
        torch.autograd.grad(s2_attention(q, k, v, pattern, backend="triton"), (q, k, v), grad)

    if warm_only:
        forward(), forward_backward()
        return {}
    return {
        "fwd_ms": round(triton.testing.do_bench(forward, warmup=25, rep=200, return_mode="median"), 3),
        "fwd_bwd_ms": round(triton.testing.do_bench(forward_backward, warmup=25, rep=300, return_mode="median"), 3),
    }


def timings(warm_only: bool) -> dict:
    result = {name: time_shape(*shape, warm_only) for name, *shape in SHAPES}
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", choices=VARIANTS, default=None, help="only compile this variant's kernels")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = [args.warm] if args.warm else args.variants.split(",")
    rows = []
    for variant in variants:
        for fwd_tile in FWD_TILES:
            use(variant, fwd_tile)
            row = {"variant": variant, "fwd_tile": fwd_tile, "errors": {k: round(v, 5) for k, v in errors().items()}}
            row["timings"] = timings(warm_only=bool(args.warm))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.warm:
        return
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernel_variants.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("\n| variant | fwd tile | " + " | ".join(s[0] for s in SHAPES) + " | worst err out/dq/dk/dv |")
    for row in rows:
        cells = [f"{row['timings'][s[0]]['fwd_ms']:.2f} / {row['timings'][s[0]]['fwd_bwd_ms']:.2f}" for s in SHAPES]
        err = "/".join(f"{row['errors'][f'kernel_{x}']:.4f}" for x in ("out", "dq", "dk", "dv"))
        print(f"| {row['variant']} | {row['fwd_tile']} | " + " | ".join(cells) + f" | {err} |")
    ref = "/".join(f"{rows[0]['errors'][f'torch_bf16_{x}']:.4f}" for x in ("out", "dq", "dk", "dv"))
    print(f"PyTorch bf16 error out/dq/dk/dv: {ref}")


if __name__ == "__main__":
    main()
