"""Are the kernels exact with software pipelining (num_stages >= 2), and how fast are they then? (GPU)

For each kernel (forward, dq, dk/dv) and pipelining depth, forces one tile config and compares ``s2_attention``'s
output and gradients with the fp32 PyTorch path (relative error ``|x - ref| / |ref|``) on odd shapes, block sizes
16/32/64/128 and GQA, next to PyTorch's own bf16 error; then times the headline (block 64, T=131072, H=32, D=128)
forward and forward+backward. Prints one JSON line per depth (``kernel_*`` must stay at the level of the depth-1 row
and of ``torch_bf16_*``) and writes ``$OUT/pipelining_check.json`` when ``OUT`` is set. About 3 minutes on an H100,
mostly compilation: give it a generous time limit. When depth 2 passes, ``triton_impl._PIPELINE_DEPTHS`` can be (2, 1).

    python bench/pipelining_check.py
"""

import json
import os
from pathlib import Path

os.environ["S2_ATTENTION_AUTOTUNE"] = "0"  # take the first candidate, which this script sets

import torch  # noqa: E402
import triton  # noqa: E402

from s2_models.kernels import S2Pattern, s2_attention, triton_impl  # noqa: E402

CASES = [(2, 8, 8, 2048, 128, 64), (2, 8, 2, 1500, 64, 16), (1, 4, 4, 3001, 128, 32), (1, 8, 2, 1999, 128, 128)]
TILES = {"fwd": (128, 64, 8), "dq": (128, 64, 8), "dkdv": (64, 64, 4)}  # (block_m, block_n, num_warps)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def errors() -> dict:
    """Worst relative error over CASES of out, dq, dk, dv: kernel (bf16) and PyTorch's bf16 path, vs fp32."""
    worst = {}
    for b, hq, hkv, t, d, bs in CASES:
        torch.manual_seed(t)
        q = torch.randn(b, hq, t, d, device="cuda")
        k, v = (torch.randn(b, hkv, t, d, device="cuda") for _ in range(2))
        grad = torch.randn(b, hq, t, d, device="cuda")
        pattern = S2Pattern(block_size=bs, local_blocks=4, vert_stride=4)
        results = {}
        for name, dtype, backend in (("ref", torch.float32, "torch"), ("torch_bf16", torch.bfloat16, "torch"),
                                     ("kernel", torch.bfloat16, "triton")):
            leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
            out = s2_attention(*leaves, pattern, backend=backend)
            out.backward(grad.to(dtype))
            results[name] = [out.detach()] + [x.grad for x in leaves]
        for name in ("torch_bf16", "kernel"):
            for label, x, ref in zip(("out", "dq", "dk", "dv"), results[name], results["ref"]):
                key = f"{name}_{label}"
                worst[key] = max(worst.get(key, 0.0), rel(x, ref))
    return worst


def headline_ms() -> dict:
    pattern = S2Pattern(block_size=64, local_blocks=16, vert_stride=16)
    q, k, v = (torch.randn(1, 32, 131072, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def fwd_bwd():
        torch.autograd.grad(s2_attention(q, k, v, pattern, backend="triton"), (q, k, v), grad)

    fwd = triton.testing.do_bench(lambda: s2_attention(q.detach(), k.detach(), v.detach(), pattern,
                                                       backend="triton"), warmup=50, rep=400, return_mode="median")
    both = triton.testing.do_bench(fwd_bwd, warmup=200, rep=1000, return_mode="median")
    return {"fwd_ms": round(fwd, 2), "fwd_bwd_ms": round(both, 2)}


def main():
    results = []
    for stages in (1, 2, 3):
        for kind, (block_m, block_n, warps) in TILES.items():
            for size in ("small", "medium", "large"):
                triton_impl._CANDIDATES[(kind, size)] = [triton_impl.TileConfig(block_m, block_n, warps, stages)]
        triton_impl._TUNED_CONFIGS.clear()
        row = {"num_stages": stages}
        try:
            row.update({key: round(value, 5) for key, value in errors().items()})
            row.update(headline_ms())
        except Exception as error:  # e.g. out of shared memory at 3 stages: record and go on
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        print(json.dumps(row), flush=True)
        results.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "pipelining_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
