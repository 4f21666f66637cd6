"""Run every Triton kernel once on small odd shapes, for compute-sanitizer (memcheck): no out-of-bounds access.

Attention (forward, backward, varlen), decode and cache append, and the fused RMSNorm / SwiGLU / rotary / rotary
tables / decode projections (on compute capability 9.0 also the Gluon ones, ``--hopper-projections-only`` alone).

On compute capability 9.0 the warp-specialized Gluon forward (``hopper_fwd.py``), the split-group dk/dv, the Gluon dq
and dk/dv (``hopper_bwd.py``) run too, forced, on their own cases. The tuner is off unless ``S2_ATTENTION_AUTOTUNE``
says otherwise: each kernel runs its first candidate once (the GPU tests check every candidate's results). With the
tuner's timing launches the whole script under memcheck ran past 170-300 s; without them it took 98 s on an H100
(2026-11-26, 0 errors)::

    compute-sanitizer --tool memcheck python bench/sanitize_kernels.py

Under memcheck the whole script has grown with the kernels: 205 s on an H100 on 2026-11-28, and past a 230 s limit
on a fresh machine the same day (its kernels compiled under the sanitizer). After a change to
the Gluon forward alone, ``--hopper-forward-only`` runs just that kernel, forced, on odd lengths, GQA, a dense head,
Tq < Tk, varlen with an empty sequence, blocks of 32, 64 and 128 (the same cases and calls took 72 s under memcheck,
0 errors, on an H100 on 2026-11-28, run from the script this flag was made of).
"""

import argparse
import os

os.environ.setdefault("S2_ATTENTION_AUTOTUNE", "0")

import torch

from s2_models.kernels import S2Pattern, s2_attention, triton_impl
from s2_models.kernels.decode import CompactLayout, ring_blocks_for, s2_cache_append, s2_decode_attention
from s2_models.kernels.fused import (
    add_rms_norm,
    linear_group,
    linear_swiglu,
    rms_norm,
    rotary_embedding,
    rotary_tables,
    swiglu,
)

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: TRITON_INTERPRET=1, to check the script itself
# (pattern, T, head dim) of the Hopper kernels' own cases
HOPPER_CASES = [
    (S2Pattern(64, 2, 3), 77, 64),
    (S2Pattern(64, 2, 3, num_dense_heads=1), 300, 128),
    (S2Pattern(32, 1, 2, per_query_head=True), 200, 128),
]


def portable_kernels() -> None:
    """Every Triton kernel's first candidate: attention (forward, backward, varlen), decode, cache append, the fused
    norm / SwiGLU / rotary / rotary-tables / projection kernels."""
    for dtype in (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float16,):
        for pattern, (tq, tk), d in [
            (S2Pattern(16, 2, 4), (77, 77), 64),
            (S2Pattern(64, 2, 3, num_dense_heads=1), (1, 300), 128),
            (S2Pattern(32, 1, 2, per_query_head=True), (130, 200), 80),
        ]:
            q = torch.randn(2, 8, tq, d, device=DEVICE, dtype=dtype, requires_grad=True)
            k = torch.randn(2, 2, tk, d, device=DEVICE, dtype=dtype, requires_grad=True)
            v = torch.randn(2, 2, tk, d, device=DEVICE, dtype=dtype, requires_grad=True)
            out, lse = s2_attention(q, k, v, pattern, return_lse=True)
            (out.float().sum() + lse.sum()).backward()
            cu = torch.tensor([0, 0, 33, tk], device=DEVICE, dtype=torch.int32)
            s2_attention(k.detach()[:1].repeat(1, 4, 1, 1), k.detach()[:1], v.detach()[:1], pattern, cu_seqlens_q=cu,
                         cu_seqlens_k=cu, max_seqlen_q=tk, max_seqlen_k=tk)
            layout = CompactLayout(pattern, 8, 2, pattern.local_blocks)
            n = tk
            slots = layout.num_ring_slots(n) + layout.num_vertical_slots(n)
            cache = torch.randn(2, 2, slots * pattern.block_size, d, device=DEVICE, dtype=dtype)
            seq_lens = torch.tensor([n, n - 5], device=DEVICE)
            s2_decode_attention(q.detach()[:, :, :1], cache, cache, seq_lens, layout,
                                num_ring_slots=layout.num_ring_slots(n))
            ahead = torch.randn(2, 2, (slots + 7) * pattern.block_size, d, device=DEVICE, dtype=dtype)  # static cache
            s2_decode_attention(q.detach()[:, :, :1], ahead, ahead, seq_lens, layout, num_ring_slots=layout.ring_blocks,
                                num_splits=3)  # the last split merges the others
            s2_decode_attention(q.detach()[:, :, :1], ahead, ahead, seq_lens, layout, num_ring_slots=layout.ring_blocks,
                                num_splits=3, split_counters=torch.zeros(4, dtype=torch.int32, device=DEVICE))
            for chunk in (5, 9):  # 20 query rows: two 16-row tiles; 36: one 64-row tile (one-token steps: 8-row tile)
                chunk_layout = CompactLayout(pattern, 8, 2, ring_blocks_for(pattern, chunk))
                chunk_slots = chunk_layout.num_ring_slots(n) + chunk_layout.num_vertical_slots(n)
                chunk_cache = torch.randn(2, 2, chunk_slots * pattern.block_size, d, device=DEVICE, dtype=dtype)
                s2_decode_attention(torch.randn(2, 8, chunk, d, device=DEVICE, dtype=dtype), chunk_cache, chunk_cache,
                                    seq_lens, chunk_layout, num_ring_slots=chunk_layout.num_ring_slots(n), num_splits=2)
            new = k.detach()[:, :, :3]
            s2_cache_append(cache, cache.clone(), new, new, seq_lens, layout, num_ring_slots=layout.num_ring_slots(n))
            # the static cache's step: one program a row, the lengths advanced in the same launch
            s2_cache_append(ahead, ahead.clone(), new[:, :, :1], new[:, :, :1], seq_lens - 1, layout,
                            num_ring_slots=layout.ring_blocks, advance_lengths=True)
        # The fused RMSNorm (more rows than the backward's programs, odd width, row stride != width), SwiGLU (masked
        # tail) and rotary (GQA, half a head not a power of two, cos shared by the batch), forward and backward.
        x = torch.randn(1031, 107, device=DEVICE, dtype=dtype)[:, :100].requires_grad_()
        weight = torch.randn(100, device=DEVICE, requires_grad=True)
        rms_norm(x, weight, 1e-6).float().sum().backward()
        residual = torch.randn(1031, 100, device=DEVICE, requires_grad=True)  # float32 residual: a promoted sum
        sum(t.float().sum() for t in add_rms_norm(x, residual, weight, 1e-6)).backward()
        gate, up = (torch.randn(3, 1031, device=DEVICE, dtype=dtype, requires_grad=True) for _ in "gu")
        swiglu(gate, up).float().sum().backward()
        q = torch.randn(3, 13, 6, 24, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(3, 13, 2, 24, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()
        angles = torch.randn(1, 13, 24, device=DEVICE)
        sum(t.float().sum() for t in rotary_embedding(q, k, angles.cos(), angles.sin())).backward()
        # the rotary tables: 39 tokens (not a multiple of a program's tokens), half a head of 12
        rotary_tables(torch.randint(0, 5000, (3, 13), device=DEVICE), torch.rand(12, device=DEVICE), 1.3, dtype)
        with torch.no_grad():  # decode-sized projections: odd token count, K not a multiple of the steps, odd widths
            x = torch.randn(5, 300, device=DEVICE, dtype=dtype)
            linear_group(x, [torch.randn(n, 300, device=DEVICE, dtype=dtype) for n in (50, 33, 70)])
            linear_group(torch.randn(3, 4100, device=DEVICE, dtype=dtype), [torch.randn(40, 4100, device=DEVICE,
                                                                                         dtype=dtype)])
            linear_swiglu(x, *(torch.randn(70, 300, device=DEVICE, dtype=dtype) for _ in "gu"))
            linear_group(x, [torch.randn(70, 300, device=DEVICE, dtype=dtype)],  # the closing residual add
                         residual=torch.randn(5, 70, device=DEVICE, dtype=dtype))


def hopper_kernels() -> None:
    """The Gluon forward, the Gluon dq, and each dk/dv of the split GQA groups and the Gluon dk/dv, forced."""
    for size in ("small", "medium"):
        triton_impl._CANDIDATES[("fwd", size)] = triton_impl._WARP_SPECIALIZED_FWD[size]
        triton_impl._CANDIDATES[("dq", size)] = triton_impl._GLUON_DQ
    for pattern, t, d in HOPPER_CASES:
        size = "small" if d <= 64 else "medium"
        # split GQA groups (of 4 here), and the Gluon dk/dv where it runs (blocks >= 64)
        gluon_dkdv = triton_impl._GLUON_DKDV if pattern.block_size >= 64 else []
        for dkdv_config in triton_impl._GROUP_SPLIT_DKDV + gluon_dkdv:
            triton_impl._CANDIDATES[("dkdv", size)] = [dkdv_config]
            triton_impl._TUNED_CONFIGS.clear()
            q = torch.randn(2, 8, t, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, 2, t, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
            s2_attention(q, k, v, pattern).float().sum().backward()
            cu = torch.tensor([0, 0, 33, t], device=DEVICE, dtype=torch.int32)
            packed = [x.detach()[:1].requires_grad_() for x in (q, k, v)]
            s2_attention(*packed, pattern, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=t,
                         max_seqlen_k=t).float().sum().backward()


def hopper_projections() -> None:
    """The Gluon decode projections (``hopper_linear``, which ``linear_group`` runs inside CUDA graph captures),
    called directly: odd token counts, K ending inside a step (296, 4104) or one narrow step (64), odd widths, one
    to three weights, the residual add."""
    from s2_models.kernels import hopper_linear

    for dtype in (torch.bfloat16, torch.float16):
        for tokens, k in ((5, 296), (1, 4104), (8, 64)):
            x = torch.randn(tokens, k, device=DEVICE, dtype=dtype)
            weights = [torch.randn(n, k, device=DEVICE, dtype=dtype) for n in (50, 33, 70)]
            hopper_linear.linear_group(x, weights, [x.new_empty(tokens, w.shape[0]) for w in weights], None)
            hopper_linear.linear_group(x, weights[:1], [x.new_empty(tokens, 50)],
                                       torch.randn(tokens, 50, device=DEVICE, dtype=dtype))


def hopper_forward() -> None:
    """The Gluon forward alone, forced: the Hopper cases and a block-128 one, each also with Tq < Tk (its first tile
    partly before the first query: masked stores) and packed (an empty sequence, a tile across a boundary)."""
    for size in ("small", "medium"):
        triton_impl._CANDIDATES[("fwd", size)] = triton_impl._WARP_SPECIALIZED_FWD[size]
    with torch.no_grad():
        for pattern, t, d in HOPPER_CASES + [(S2Pattern(128, 2, 2), 333, 128)]:
            q = torch.randn(2, 8, t, d, device=DEVICE, dtype=torch.bfloat16)
            k, v = (torch.randn(2, 2, t, d, device=DEVICE, dtype=torch.bfloat16) for _ in "kv")
            s2_attention(q, k, v, pattern)
            s2_attention(q[:, :, t // 3:], k, v, pattern)
            cu = torch.tensor([0, 0, 33, t], device=DEVICE, dtype=torch.int32)
            s2_attention(q[:1], k[:1], v[:1], pattern, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=t,
                         max_seqlen_k=t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--hopper-forward-only", action="store_true",
                      help="only the Gluon forward (compute capability 9.0)")
    only.add_argument("--hopper-projections-only", action="store_true",
                      help="only the Gluon decode projections (compute capability 9.0)")
    args = parser.parse_args()
    on_hopper = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    if args.hopper_forward_only or args.hopper_projections_only:
        if not on_hopper:
            raise SystemExit("--hopper-forward-only and --hopper-projections-only need compute capability 9.0")
        if args.hopper_forward_only:
            hopper_forward()
        else:
            hopper_projections()
    else:
        portable_kernels()
        if on_hopper:
            hopper_kernels()
            hopper_projections()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("sanitize run complete")


if __name__ == "__main__":
    main()
