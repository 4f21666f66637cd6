"""Every tile candidate's time as the tuner measures it, at the D=64 shapes (GPU).

One forward+backward per shape with the tuner on: it times each candidate of ``triton_impl._CANDIDATES`` with
``triton.testing.do_bench`` (median) in one process, and this script prints and saves those timings (fastest
first). ``--extra`` adds candidates that are not in the package (to decide whether they belong there), e.g. the
dk/dv tiles capped at 168 registers that became candidates on 2026-11-25::

    python bench/tile_candidates.py --extra "dkdv:64,64,4,2,group_split=1,max_registers=168" --out $OUT/c.json

Shapes: the 1B model's sparse layers (32 query / 8 KV heads, D=64, ``[B, T, H, D]`` projections seen through a
transpose) at 32k and 128k tokens, and issue 9's D=64 rows; block 64, local 16, stride 16.
"""

import argparse
import json

import torch

from s2_models.kernels import S2Pattern, s2_attention, triton_impl

# name, (B, Hq, Hkv, T, D), q/k/v as the model's [B, T, H, D] projections
SHAPES = [
    ("model 1x32768", (1, 32, 8, 32768, 64), True),
    ("model 1x131072", (1, 32, 8, 131072, 64), True),
    ("D=64 4x32768", (4, 32, 32, 32768, 64), False),
    ("GQA D=64 8x16384", (8, 32, 8, 16384, 64), False),
]


def attention_inputs(batch, q_heads, kv_heads, seqlen, head_dim, model_layout):
    """Seeded bf16 q, k, v and an output gradient on the GPU, ``[B, H, T, D]``; with ``model_layout`` stored as the
    model's ``[B, T, H, D]`` projections and seen through a transpose."""
    torch.manual_seed(0)
    shapes = [(batch, seqlen, h, head_dim) if model_layout else (batch, h, seqlen, head_dim)
              for h in (q_heads, kv_heads, kv_heads, q_heads)]
    q, k, v, grad = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    if model_layout:
        q, k, v, grad = (t.transpose(1, 2) for t in (q, k, v, grad))
    return q, k, v, grad


def parse_extra(spec: str) -> tuple[str, triton_impl.TileConfig]:
    """``kind:block_m,block_n,num_warps,num_stages[,field=value...]`` -> (kind, TileConfig)."""
    kind, fields = spec.split(":")
    positional = [int(x) for x in fields.split(",") if "=" not in x]
    named = dict(x.split("=") for x in fields.split(",") if "=" in x)
    return kind, triton_impl.TileConfig(*positional, **{name: int(value) for name, value in named.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--extra", action="append", default=[], help="kind:block_m,block_n,warps,stages[,k=v]")
    args = parser.parse_args()
    for kind, config in map(parse_extra, args.extra):
        triton_impl._CANDIDATES[(kind, "small")] = triton_impl._CANDIDATES[(kind, "small")] + [config]
    pattern = S2Pattern(block_size=64, local_blocks=16, vert_stride=16, head_sliding_offset=0)
    results = {}
    for name, (batch, q_heads, kv_heads, seqlen, head_dim), model_layout in SHAPES:
        q, k, v, grad = attention_inputs(batch, q_heads, kv_heads, seqlen, head_dim, model_layout)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        triton_impl._TUNED_CONFIGS.clear()
        triton_impl.TUNING_TIMINGS.clear()
        torch.autograd.grad(s2_attention(q, k, v, pattern, backend="triton"), (q, k, v), grad)
        torch.cuda.synchronize()
        results[name] = {
            key[0]: [[repr(config), round(ms, 4)] for config, ms in sorted(timings.items(), key=lambda kv: kv[1])]
            for key, timings in triton_impl.TUNING_TIMINGS.items()
        }
        for kind, ranked in results[name].items():
            print(name, kind, *ranked[:3], sep="\n  ", flush=True)
        del q, k, v, grad
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "timings_ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
