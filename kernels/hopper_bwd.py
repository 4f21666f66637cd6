"""Warp-specialized S2-Attention dK/dV backward for Hopper (sm_90), written in Gluon.

The Triton dK/dV kernel (``triton_impl.s2_attention_bwd_dkdv_kernel``) is about 60% of the backward. Like the Triton
forward, its warps issue loads, wait for their matrix products and compute the elementwise softmax backward in turn.
This kernel splits them as ``hopper_fwd.py`` does for the forward: a loader warp issues every tensor-memory-accelerator
(TMA) copy, and two consumer warp groups each own half of the key tile, so one's elementwise work runs while the
other's matrix products occupy the tensor cores.

A work item = one key tile of ``BLOCK_N = 2 * CONSUMER_ROWS`` keys of one KV head (resident: K and V are loaded once),
reduced over the query heads of its GQA group in registers, as the Triton kernel does. It reads the same lists
(``triton_impl.build_unit_lists`` with ``resident_is_query=False``): per key tile the kept query units, full ones
first. The kernel is persistent (one program per SM). Partitions:

* loader (1 warp): per item K and V (one half per consumer), then per step Q and dO of ``BLOCK_M // UNIT`` list
  entries (``UNIT = min(block_size, BLOCK_M)`` query rows each, one TMA box each) into a ring of ``NUM_BUFFERS``
  slots;
* two consumers (4 warps each, 64 keys each): per step ``S^T = K Q^T`` and ``dP^T = V dO^T`` issued together as
  asynchronous warp-group matrix products, ``P^T = exp2(S^T * scale - lse)`` (masked on partial entries),
  ``dV += P^T dO`` issued, ``dS^T = P^T (dP^T - delta)``, ``dK += dS^T Q`` issued; ``P^T`` and ``dS^T`` feed the
  tensor cores from registers. A slot is released when both consumers' products on it are done.

Scope (``supported``): causal, queries and keys the same tokens (training: ``Tq == Tk``, or varlen with equal
lengths), so that no query unit starts before its sequence and TMA boxes need no mask; 16-bit inputs, head dim 64 or
128, ``block_size >= 32``, compute capability 9.0, and tensors ``triton_impl._row_view`` can view as rows. Rows past a
sequence's end inside its last unit read the next rows of the tensor (finite) or TMA's zeros; their lse is read as
``+inf``, so their ``P`` and ``dS`` are 0. Elsewhere the Triton kernel runs, and the tuner picks this one only where
it is faster.
"""

from __future__ import annotations

import torch

from .hopper_fwd import AVAILABLE, CONSUMER_REGISTERS, LOADER_REGISTERS, MAXNREG, _num_sms
from .sequence_bounds import sequence_bounds

if AVAILABLE:
    from .hopper_fwd import GluonTensorDescriptor, gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

CONSUMER_ROWS = 64  # keys per consumer warp group (wgmma's M: 16 rows per warp, 4 warps)
BLOCK_N = 2 * CONSUMER_ROWS
# Registers: hopper_fwd's split (232 per consumer thread). A consumer holds dK and dV (64 x D fp32 each: 128
# registers at D = 128), a step's S^T and dP^T (BLOCK_M / 2 each) and P^T or dS^T in 16 bits. Offline (ptxas, sm_90):
# no spills at D = 64; at D = 128 ~600 bytes with 64-query steps, ~100 with 32-query steps (both are candidates).

if AVAILABLE:

    @gluon.jit
    def _key_tile(work, num_k_tiles, num_kv_heads, cu_seqlens_k, seqlen_k, BLOCK_N: gl.constexpr,
                  IS_VARLEN: gl.constexpr):
        """Work item ``work`` (tiles fastest, then KV heads, then sequences, as the Triton kernel's grid: programs
        running at the same time read the same heads' Q and dO from L2): its sequence, KV head, tile, where the
        sequence's keys start, how many it has, and whether the tile holds any of them."""
        tile = work % num_k_tiles
        kv_head = work // num_k_tiles % num_kv_heads
        seq = work // (num_k_tiles * num_kv_heads)
        k_start, _, seqlen_k, _ = sequence_bounds(cu_seqlens_k, cu_seqlens_k, seq, seqlen_k, seqlen_k, IS_VARLEN)
        return seq, kv_head, tile, k_start, seqlen_k, tile * BLOCK_N < seqlen_k

    @gluon.jit
    def _query_list(unit_lists, unit_bits, unit_counts, q_head, tile, has_keys, q_heads_per_pattern, stride_up,
                    stride_ut, stride_cp, stride_ct):
        """The key tile's list of query units for query head ``q_head``: ``(entries, bits, num_full, num_total)``."""
        pattern_head = q_head // q_heads_per_pattern
        list_offset = pattern_head.to(gl.int64) * stride_up + tile.to(gl.int64) * stride_ut
        counts = unit_counts + pattern_head.to(gl.int64) * stride_cp + tile.to(gl.int64) * stride_ct
        num_full = gl.load(counts, mask=has_keys, other=0)
        num_entries = gl.load(counts + 1, mask=has_keys, other=0)
        return unit_lists + list_offset, unit_bits + list_offset, num_full, num_entries

    @gluon.jit
    def _load_partition(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, kv_ready, kv_free,
                        qdo_ready, qdo_free, work_args, strides, IS_VARLEN: gl.constexpr):
        """Issue every TMA copy: per work item the two halves of K and V, then per step Q and dO of ``GROUP``
        list entries (a step's missing entries repeat the last one; the consumers mask them)."""
        (num_work, num_k_tiles, num_kv_heads, cu_seqlens_k, seqlen_k, unit_lists, unit_bits, unit_counts,
         stride_up, stride_ut, stride_cp, stride_ct, q_heads_per_pattern, q_heads_per_kv) = work_args
        (stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt, stride_kb, stride_kh, stride_kt,
         stride_vb, stride_vh, stride_vt) = strides
        NUM_BUFFERS: gl.constexpr = q_bufs.type.shape[0]
        STEP_ROWS: gl.constexpr = q_bufs.type.shape[1]
        UNIT: gl.constexpr = q_desc.block_type.shape[0]
        GROUP: gl.constexpr = STEP_ROWS // UNIT
        ROWS: gl.constexpr = k_desc.block_type.shape[0]
        step = 0
        iteration = 0
        for work in range(gl.program_id(0), num_work, gl.num_programs(0)):
            seq, kv_head, tile, k_start, seqlen_k_seq, has_keys = _key_tile(
                work, num_k_tiles, num_kv_heads, cu_seqlens_k, seqlen_k, 2 * ROWS, IS_VARLEN)
            k_offset = seq.to(gl.int64) * stride_kb + kv_head.to(gl.int64) * stride_kh
            v_offset = seq.to(gl.int64) * stride_vb + kv_head.to(gl.int64) * stride_vh
            k_row = (k_offset // stride_kt).to(gl.int32) + k_start + tile * 2 * ROWS
            v_row = (v_offset // stride_vt).to(gl.int32) + k_start + tile * 2 * ROWS
            # A fresh mbarrier counts as having completed the phase before 0, so first passes do not wait.
            mbarrier.wait(kv_free, (iteration & 1) ^ 1)
            mbarrier.expect(kv_ready, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
            for half in gl.static_range(2):
                tma.async_copy_global_to_shared(k_desc, [k_row + half * ROWS, (k_offset % stride_kt).to(gl.int32)],
                                                kv_ready, k_smem.index(half))
                tma.async_copy_global_to_shared(v_desc, [v_row + half * ROWS, (v_offset % stride_vt).to(gl.int32)],
                                                kv_ready, v_smem.index(half))
            for member in range(q_heads_per_kv):
                q_head = kv_head * q_heads_per_kv + member
                list_base, _, _, num_entries = _query_list(unit_lists, unit_bits, unit_counts, q_head, tile,
                                                           has_keys, q_heads_per_pattern, stride_up, stride_ut,
                                                           stride_cp, stride_ct)
                q_offset = seq.to(gl.int64) * stride_qb + q_head.to(gl.int64) * stride_qh
                do_offset = seq.to(gl.int64) * stride_gb + q_head.to(gl.int64) * stride_gh
                # Same tokens: a sequence's queries start where its keys do.
                q_row = (q_offset // stride_qt).to(gl.int32) + k_start
                q_col = (q_offset % stride_qt).to(gl.int32)
                do_row = (do_offset // stride_gt).to(gl.int32) + k_start
                do_col = (do_offset % stride_gt).to(gl.int32)
                for j in range(gl.cdiv(num_entries, GROUP)):
                    slot = step % NUM_BUFFERS
                    mbarrier.wait(qdo_free.index(slot), ((step // NUM_BUFFERS) & 1) ^ 1)
                    mbarrier.expect(qdo_ready.index(slot),
                                    GROUP * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
                    ready = qdo_ready.index(slot)
                    for g in gl.static_range(GROUP):
                        first_query = gl.load(list_base + gl.minimum(j * GROUP + g, num_entries - 1)) * UNIT
                        tma.async_copy_global_to_shared(q_desc, [q_row + first_query, q_col], ready,
                                                        q_bufs.index(slot).slice(g * UNIT, UNIT))
                        tma.async_copy_global_to_shared(do_desc, [do_row + first_query, do_col], ready,
                                                        do_bufs.index(slot).slice(g * UNIT, UNIT))
                    step += 1
            iteration += 1

    @gluon.jit
    def _compute_partition(consumer: gl.constexpr, q_bufs, do_bufs, k_smem, v_smem, kv_ready, kv_free, qdo_ready,
                           qdo_free, work_args, grad_args, qk_scale, scale, BLOCK_SIZE: gl.constexpr,
                           UNIT: gl.constexpr, IS_VARLEN: gl.constexpr):
        """Consumer ``consumer`` (0 or 1): keys ``consumer * ROWS ...`` of each work item's key tile."""
        (num_work, num_k_tiles, num_kv_heads, cu_seqlens_k, seqlen_k, unit_lists, unit_bits, unit_counts,
         stride_up, stride_ut, stride_cp, stride_ct, q_heads_per_pattern, q_heads_per_kv) = work_args
        (lse, delta, dk, dv, stride_lb, stride_lh, stride_lt, stride_db, stride_dh, stride_dkb, stride_dkh,
         stride_dkt, stride_dvb, stride_dvh, stride_dvt) = grad_args
        NUM_BUFFERS: gl.constexpr = q_bufs.type.shape[0]
        STEP_ROWS: gl.constexpr = q_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = q_bufs.type.shape[2]
        ROWS: gl.constexpr = k_smem.type.shape[1]
        GROUP: gl.constexpr = STEP_ROWS // UNIT
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, STEP_ROWS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        keys_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        queries_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        keys_acc: gl.constexpr = gl.SliceLayout(1, acc_layout)
        k_tile = k_smem.index(consumer)  # [ROWS, D]
        v_tile = v_smem.index(consumer)
        step = 0
        iteration = 0
        for work in range(gl.program_id(0), num_work, gl.num_programs(0)):
            seq, kv_head, tile, k_start, seqlen_k_seq, has_keys = _key_tile(
                work, num_k_tiles, num_kv_heads, cu_seqlens_k, seqlen_k, 2 * ROWS, IS_VARLEN)
            tile_first = tile * 2 * ROWS
            k_pos = tile_first + consumer * ROWS + gl.arange(0, ROWS, layout=keys_s)  # [ROWS] positions
            block_in_tile = k_pos // BLOCK_SIZE - tile_first // BLOCK_SIZE  # bit index of each key's block
            offs = gl.arange(0, STEP_ROWS, layout=queries_s)
            dk_acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
            dv_acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
            mbarrier.wait(kv_ready, iteration & 1)
            for member in range(q_heads_per_kv):
                q_head = kv_head * q_heads_per_kv + member
                list_base, bits_base, num_full, num_entries = _query_list(
                    unit_lists, unit_bits, unit_counts, q_head, tile, has_keys, q_heads_per_pattern, stride_up,
                    stride_ut, stride_cp, stride_ct)
                lse_head = lse + seq.to(gl.int64) * stride_lb + q_head.to(gl.int64) * stride_lh
                delta_head = delta + seq.to(gl.int64) * stride_db + q_head.to(gl.int64) * stride_dh
                for j in range(gl.cdiv(num_entries, GROUP)):
                    slot = step % NUM_BUFFERS
                    mbarrier.wait(qdo_ready.index(slot), (step // NUM_BUFFERS) & 1)
                    q_tile = q_bufs.index(slot)  # [STEP_ROWS, D]
                    do_tile = do_bufs.index(slot)
                    zeros = gl.zeros([ROWS, STEP_ROWS], gl.float32, s_layout)
                    s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zeros, use_acc=False, is_async=True)
                    dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zeros, use_acc=False, is_async=True)
                    # The step's query positions (the entries' units side by side) and their softmax statistics.
                    q_pos = offs % UNIT
                    listed = offs < STEP_ROWS  # all true; narrowed below for a step's unlisted members
                    for g in gl.static_range(GROUP):
                        entry = j * GROUP + g
                        unit = gl.load(list_base + gl.minimum(entry, num_entries - 1))
                        q_pos += gl.where(offs // UNIT == g, unit * UNIT, 0)
                        listed &= (offs // UNIT != g) | (entry < num_entries)
                    row_real = listed & (q_pos < seqlen_k_seq)
                    rows = (k_start + q_pos).to(gl.int64)
                    lse_row = gl.load(lse_head + rows * stride_lt, mask=row_real, other=float("inf"))
                    lse_row = gl.where(lse_row == -float("inf"), float("inf"), lse_row) * 1.4426950408889634
                    delta_row = gl.load(delta_head + rows, mask=row_real, other=0.0)
                    s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
                    p_t = gl.exp2(s_t * qk_scale - lse_row[None, :])  # [ROWS, STEP_ROWS]; lse = +inf: p = 0
                    if j * GROUP >= num_full:  # partial entries: keep bits and causality
                        bits = gl.zeros([STEP_ROWS], gl.int32, queries_s)
                        for g in gl.static_range(GROUP):
                            entry = j * GROUP + g
                            entry_bits = gl.load(bits_base + entry, mask=entry < num_entries, other=0)
                            bits = gl.where(offs // UNIT == g, entry_bits, bits)
                        kept = ((bits[None, :] >> block_in_tile[:, None]) & 1) != 0
                        p_t = gl.where(kept & (k_pos[:, None] <= q_pos[None, :]), p_t, 0.0)
                    dv_acc = warpgroup_mma(gl.convert_layout(p_t.to(do_bufs.dtype), a_layout), do_tile, dv_acc,
                                           is_async=True)
                    dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
                    ds_t = p_t * (dp_t - delta_row[None, :])
                    dk_acc = warpgroup_mma(gl.convert_layout(ds_t.to(q_bufs.dtype), a_layout), q_tile, dk_acc,
                                           is_async=True)
                    dv_acc, dk_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dv_acc, dk_acc))
                    mbarrier.arrive(qdo_free.index(slot), count=1)
                    step += 1
            mbarrier.arrive(kv_free, count=1)  # the loader may bring the next work item's K and V

            rows = gl.convert_layout((k_start + k_pos).to(gl.int64), keys_acc)
            key_real = gl.convert_layout(k_pos < seqlen_k_seq, keys_acc)[:, None]
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))[None, :]
            dk_head = dk + seq.to(gl.int64) * stride_dkb + kv_head.to(gl.int64) * stride_dkh
            dv_head = dv + seq.to(gl.int64) * stride_dvb + kv_head.to(gl.int64) * stride_dvh
            gl.store(dk_head + rows[:, None] * stride_dkt + cols, (dk_acc * scale).to(dk.dtype.element_ty),
                     mask=key_real)
            gl.store(dv_head + rows[:, None] * stride_dvt + cols, dv_acc.to(dv.dtype.element_ty), mask=key_real)
            iteration += 1

    @gluon.jit
    def s2_attention_bwd_dkdv_ws_kernel(
        q_desc, do_desc, k_desc, v_desc,  # row descriptors (triton_impl._row_view): boxes [UNIT, D] x 2, [ROWS, D] x 2
        lse, delta, dk, dv,  # [B, Hq, T] float32 x 2, [B, Hkv, T, D] x 2
        unit_lists, unit_bits, unit_counts,  # dk/dv lists for BLOCK_N-key tiles (build_unit_lists)
        cu_seqlens_k,  # int32 [S + 1] (queries: the same tokens), read only when IS_VARLEN
        stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
        stride_lb, stride_lh, stride_lt, stride_db, stride_dh, stride_up, stride_ut, stride_cp, stride_ct,
        seqlen_k, qk_scale, scale, q_heads_per_pattern, q_heads_per_kv, num_k_tiles, num_kv_heads, num_work,
        BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, IS_VARLEN: gl.constexpr, NUM_BUFFERS: gl.constexpr,
        CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
    ):
        """Persistent: program ``p`` runs work items ``p, p + P, ...`` of ``num_work = num_k_tiles * Hkv * (B or
        S)`` (``_key_tile``). ``qk_scale = scale * log2(e)``; launched with 4 warps (consumer 0) plus the two worker
        partitions."""
        ROWS: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        UNIT: gl.constexpr = q_desc.block_type.shape[0]
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, ROWS, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, ROWS, HEAD_DIM], v_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUFFERS, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [NUM_BUFFERS, BLOCK_M, HEAD_DIM], do_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        qdo_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        qdo_free = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        mbarrier.init(kv_free, count=2)  # both consumers release K and V
        for slot in gl.static_range(NUM_BUFFERS):
            mbarrier.init(qdo_ready.index(slot), count=1)
            mbarrier.init(qdo_free.index(slot), count=2)  # both consumers release a slot

        work_args = (num_work, num_k_tiles, num_kv_heads, cu_seqlens_k, seqlen_k, unit_lists, unit_bits,
                     unit_counts, stride_up, stride_ut, stride_cp, stride_ct, q_heads_per_pattern,
                     q_heads_per_kv)
        grad_args = (lse, delta, dk, dv, stride_lb, stride_lh, stride_lt, stride_db, stride_dh, stride_dkb,
                     stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt)
        strides = (stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt, stride_kb, stride_kh, stride_kt,
                   stride_vb, stride_vh, stride_vt)
        gl.warp_specialize(
            [
                (_compute_partition, (0, q_bufs, do_bufs, k_smem, v_smem, kv_ready, kv_free, qdo_ready, qdo_free,
                                      work_args, grad_args, qk_scale, scale, BLOCK_SIZE, UNIT, IS_VARLEN)),
                (_compute_partition, (1, q_bufs, do_bufs, k_smem, v_smem, kv_ready, kv_free, qdo_ready, qdo_free,
                                      work_args, grad_args, qk_scale, scale, BLOCK_SIZE, UNIT, IS_VARLEN)),
                (_load_partition, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, kv_ready,
                                   kv_free, qdo_ready, qdo_free, work_args, strides, IS_VARLEN)),
            ],
            [4, 1],
            [CONSUMER_REGISTERS, LOADER_REGISTERS],  # the default partition (consumer 0) gets what is left
        )


def supported(q: torch.Tensor, k: torch.Tensor, causal: bool, block_size: int, same_tokens: bool) -> bool:
    """Whether this kernel can run the call, given row views of q, dout, k and v (``triton_impl._row_view``)."""
    return (
        AVAILABLE and q.is_cuda and causal and same_tokens and q.dtype in (torch.float16, torch.bfloat16)
        and q.dtype == k.dtype and q.shape[-1] in (64, 128) and block_size >= 32
        and torch.cuda.get_device_capability(q.device) == (9, 0)
    )


def launch_dkdv(q, dout, k, v, lse, delta, dk, dv, row_views, lists, problem, scale: float, qk_scale: float,
                block_size: int, block_m: int, num_pattern_heads: int, num_buffers: int) -> None:
    """Run the kernel. ``row_views``: ``(shape, strides)`` of q, dout, k and v seen as rows
    (``triton_impl._row_view``); ``lists``: the dk/dv lists for ``BLOCK_N``-key tiles and ``block_m``-query steps;
    ``problem``: ``triton_impl._Problem``; ``delta``: contiguous ``[B, Hq, T]``."""
    units, bits, counts = lists
    gl_dtype = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    head_dim = q.shape[-1]
    unit = min(block_size, block_m)  # query rows per list entry: one TMA box
    descriptors = []
    for t, (shape, strides), rows in zip((q, dout, k, v), row_views, (unit, unit, CONSUMER_ROWS, CONSUMER_ROWS)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)
        descriptors.append(GluonTensorDescriptor(t, shape, strides, [rows, head_dim], layout))
    num_kv_heads = k.shape[1]
    num_k_tiles = -(-problem.max_seqlen_k // BLOCK_N)
    num_work = num_k_tiles * num_kv_heads * problem.num_seqs
    grid = (min(num_work, _num_sms(q.device)),)
    delta_strides = (0 if problem.is_varlen else delta.stride(0), delta.stride(1))
    s2_attention_bwd_dkdv_ws_kernel[grid](
        *descriptors, lse, delta, dk, dv, units, bits, counts, problem.cu_seqlens_k,
        *problem.strides(q)[:3], *problem.strides(dout)[:3], *problem.strides(k)[:3], *problem.strides(v)[:3],
        *problem.strides(dk)[:3], *problem.strides(dv)[:3], *problem.strides(lse), *delta_strides,
        *units.stride()[:2], *counts.stride()[:2],
        k.shape[2], qk_scale, scale, q.shape[1] // num_pattern_heads, q.shape[1] // num_kv_heads,
        num_k_tiles, num_kv_heads, num_work,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, IS_VARLEN=problem.is_varlen, NUM_BUFFERS=num_buffers,
        CONSUMER_REGISTERS=CONSUMER_REGISTERS, LOADER_REGISTERS=LOADER_REGISTERS, num_warps=4, maxnreg=MAXNREG,
    )
