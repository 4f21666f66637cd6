"""Is the forward kernel correct with software pipelining (num_stages >= 2), and how fast is it then? (GPU)

The kernels run unpipelined (``num_stages=1``) because Triton 3.6 on Hopper gives wrong 16-bit results with 2 or 3
stages. Run this after a Triton upgrade: when the error column drops to the ``num_stages=1`` level, pipelined
candidates can go back into ``triton_impl._CANDIDATES``. Measured on an H200 (2026-11-21): error 0.010 at 1 stage,
3.6 at 2 and 3 stages; headline forward 33.8 / 29.3 / 33.3 ms with this script's fixed tile.
"""

import os

os.environ["S2_ATTENTION_AUTOTUNE"] = "0"  # take the first candidate, which this script sets

import torch  # noqa: E402
import triton  # noqa: E402

from s2_models.kernels import S2Pattern, s2_attention, triton_impl  # noqa: E402

CASES = [(2, 8, 8, 2048, 128, 64), (2, 8, 2, 1500, 64, 16), (1, 4, 4, 3000, 128, 32)]  # B, Hq, Hkv, T, D, bs


def max_error() -> float:
    errors = []
    for dtype in (torch.bfloat16, torch.float16):
        for b, hq, hkv, t, d, bs in CASES:
            torch.manual_seed(t)
            q = torch.randn(b, hq, t, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, hkv, t, d, device="cuda", dtype=dtype) for _ in range(2))
            pattern = S2Pattern(block_size=bs, local_blocks=4, vert_stride=4)
            out = s2_attention(q, k, v, pattern, backend="triton")
            ref = s2_attention(q.float(), k.float(), v.float(), pattern, backend="torch")
            errors.append((out.float() - ref).abs().max().item())
    return max(errors)


def headline_forward_ms() -> float:
    pattern = S2Pattern(block_size=64, local_blocks=16, vert_stride=16)
    q, k, v = (torch.randn(1, 32, 131072, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return triton.testing.do_bench(lambda: s2_attention(q, k, v, pattern, backend="triton"), warmup=50, rep=500,
                                   return_mode="median")


for stages in (1, 2, 3):
    for size, warps in (("small", 4), ("medium", 8)):
        triton_impl._CANDIDATES[("fwd", size)] = [triton_impl.TileConfig(128, 64, warps, stages)]
    triton_impl._TUNED_CONFIGS.clear()
    print(f"num_stages={stages}: max error vs the fp32 PyTorch path {max_error():.4f}; "
          f"headline forward T=131072: {headline_forward_ms():.2f} ms", flush=True)
