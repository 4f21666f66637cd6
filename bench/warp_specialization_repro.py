"""Triton 3.6's automatic warp specialization on Hopper: it compiles, and the kernel never finishes. (GPU, sm_90)

Why this file exists: on Hopper, FlashAttention-3 and cuDNN overlap one warp group's softmax with another's matrix
products (a producer warp group issues TMA loads, two consumer warp groups take half the query rows each). Triton
3.6 runs Meta's Hopper auto-warp-specialization pass (``nvidia.passes.hopper.add_hopper_warpspec`` in
``backends/nvidia/compiler.py``) on loops written ``tl.range(..., warp_specialize=True)``, so this is the one way a
Triton kernel could get that structure (bench/NOTES.md, 2026-11-24, third session). Two minimal loops, each run with
and without ``warp_specialize``, the version without it checked against PyTorch:

* ``gemm``: ``acc += Q_tile @ K_i^T`` over TMA tiles (the matrix-product loop alone);
* ``attention``: a dense FlashAttention forward (online softmax, TMA loads of Q, K, V).

Offline (``triton.compile`` for ``GPUTarget("cuda", 90, 64)``, no GPU) both specialized kernels compile, with
``num_warps=4``: a 4-warp producer (``setmaxnreg.dec`` to 40) and two 4-warp consumers (``setmaxnreg.inc`` to 232).
With ``num_warps=8`` the pass leaves the loop alone. On an H100 (2026-11-24) the unspecialized kernels are exact
(attention 0.64 ms for 32 heads x 4096 x 4096 x 128, 430 TFLOP/s, max absolute error 5e-4 against SDPA) and both
specialized kernels hang: no result after 45 s, where the unspecialized ones finish in milliseconds. What ran was a
probe with these two kernels (the attention one also with its K/V rows read from a list, which hung the same way);
this file is its cleaned copy, not yet run as such (the session's device time ended).

    python bench/warp_specialization_repro.py gemm 0        # unspecialized: prints its error
    timeout 60 python bench/warp_specialization_repro.py gemm 1 || echo "did not finish"
    python bench/warp_specialization_repro.py attention 0   # error and TFLOP/s
    timeout 60 python bench/warp_specialization_repro.py attention 1 || echo "did not finish"
"""

import argparse
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

HEADS, SEQLEN, HEAD_DIM, BLOCK_M, BLOCK_N = 32, 4096, 128, 128, 128


@triton.jit
def gemm_loop_kernel(q_desc, k_desc, out, num_iters, seqlen, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr):
    """``out[rows, :BLOCK_N] = sum_i Q[rows] @ K[i-th tile]^T`` (``out`` rows of width BLOCK_N)."""
    tile, head = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, num_iters, warp_specialize=WARP_SPECIALIZE):
        q = q_desc.load([head * seqlen + tile * BLOCK_M, 0])
        k = k_desc.load([head * seqlen + i * BLOCK_N, 0])
        acc = tl.dot(q, tl.trans(k), acc)
    rows = head * seqlen + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(out + rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], acc.to(out.dtype.element_ty))


@triton.jit
def attention_loop_kernel(q_desc, k_desc, v_desc, out, num_iters, seqlen, qk_scale, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Dense (non-causal) attention of one query tile, online softmax in base 2."""
    tile, head = tl.program_id(0), tl.program_id(1)
    q = q_desc.load([head * seqlen + tile * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for i in tl.range(0, num_iters, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([head * seqlen + i * BLOCK_N, 0])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([head * seqlen + i * BLOCK_N, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    rows = head * seqlen + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(out + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("loop", choices=["gemm", "attention"])
    parser.add_argument("warp_specialize", type=int, choices=[0, 1])
    args = parser.parse_args()
    specialize = bool(args.warp_specialize)
    num_warps = 4 if specialize else 8  # the Hopper pass specializes 4-warp kernels (+ a 4-warp producer)
    rows = HEADS * SEQLEN
    q, k, v = (torch.randn(rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    boxes = lambda t, box_rows: TensorDescriptor(t, [rows, HEAD_DIM], [HEAD_DIM, 1], [box_rows, HEAD_DIM])  # noqa: E731
    grid = (SEQLEN // BLOCK_M, HEADS)
    num_iters = SEQLEN // BLOCK_N
    if args.loop == "gemm":
        out = torch.empty(rows, BLOCK_N, device="cuda", dtype=torch.float32)

        def launch():
            gemm_loop_kernel[grid](boxes(q, BLOCK_M), boxes(k, BLOCK_N), out, num_iters, SEQLEN, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, WARP_SPECIALIZE=specialize, num_warps=num_warps, num_stages=2)

        k_tiles = k.view(HEADS, num_iters, BLOCK_N, HEAD_DIM).float().sum(1)  # [H, BLOCK_N, D]
        reference = torch.einsum("htd,hnd->htn", q.view(HEADS, SEQLEN, HEAD_DIM).float(), k_tiles).reshape(rows, -1)
        flops = 2 * rows * SEQLEN * HEAD_DIM
    else:
        out = torch.empty_like(q)

        def launch():
            attention_loop_kernel[grid](boxes(q, BLOCK_M), boxes(k, BLOCK_N), boxes(v, BLOCK_N), out, num_iters,
                                        SEQLEN, HEAD_DIM ** -0.5 * 1.4426950408889634, BLOCK_M=BLOCK_M,
                                        BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, WARP_SPECIALIZE=specialize,
                                        num_warps=num_warps, num_stages=2)

        reference = torch.nn.functional.scaled_dot_product_attention(
            *(t.view(1, HEADS, SEQLEN, HEAD_DIM) for t in (q, k, v))).view(rows, HEAD_DIM).float()
        flops = 4 * rows * SEQLEN * HEAD_DIM
    start = time.time()
    launch()
    torch.cuda.synchronize()
    print(f"{args.loop}, warp_specialize={specialize}: first call (compile + run) {time.time() - start:.1f} s")
    error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
    ms = triton.testing.do_bench(launch, return_mode="median")
    print(f"max error / max |reference| {error:.2e}; {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
