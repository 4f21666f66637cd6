"""Warp-specialized S2-Attention backward kernels for Hopper (sm_90), written in Gluon: dK/dV, then dQ.

Why a second dK/dV kernel: the Triton one (``triton_impl.s2_attention_bwd_dkdv_kernel``) is the largest kernel of the
backward. Triton 3.6 waits for every matrix product that is not a loop-carried accumulator right after issuing it
(``wgmma.wait_group 0``), so inside a program ``S^T``, its exponentials, ``dP^T`` and ``dS^T`` run in series, and the
same warps also compute every load's address and wait for it. Here the waits are placed by hand and a loader warp
issues the copies, so a consumer's step is its products and their elementwise work only (350 SASS instructions at
D = 128 against the Triton step's 460). Per step, in a consumer warp group:

    S^T = K Q^T and dP^T = V dO^T issued together        (tensor cores busy with dP^T ...
    wait for S^T only; P^T = exp2((S^T - lse) * scale)    ... while the exponentials run)
    dV += P^T dO issued                                   (busy with dV ...
    wait for dP^T only; dS^T = P^T (dP^T - delta)         ... while dS^T is computed)
    dK += dS^T Q issued, then wait for both; the slot is released

A program runs two neighbouring key tiles of ``BLOCK_N = 64`` keys of one KV head, one per consumer warp group (K and
V resident in shared memory), each reduced over the query heads of its GQA group and walking its own list
(``triton_impl.build_unit_lists`` with ``resident_is_query=False``: full query units first, from the sequence's end,
then the partial ones, masked with their keep bits and causality). A 128-key tile with one list would walk the union
of both blocks' lists (a vertical block is read by every later query, its neighbour only by its local window: the
fifth session's Gluon dK/dV lost 2x to that). Partitions:

* loader (1 warp): K and V of both tiles, then per step of each consumer Q and dO of one list entry (``BLOCK_M = 64``
  query rows, one TMA box each) and the rows' lse and delta into that consumer's ring of ``NUM_BUFFERS`` slots, the
  two rings' steps alternated;
* two consumers (4 warps each), as above.

Scope (``supported``): causal, queries and keys the same tokens (training: ``Tq == Tk``, or varlen with equal
lengths), so that a query unit's rows start where its keys do and a TMA box needs no mask; 16-bit inputs, head dim 64
or 128, ``block_size >= 64`` (a list entry is one contiguous box), compute capability 9.0, and tensors
``layouts.row_view`` can view as rows. Rows past a sequence's end inside its last unit read the next rows of the
tensor (finite) or TMA's zeros; their lse is read as ``+inf``, so their ``P`` and ``dS`` are 0. Keys past the end are
computed and not stored. Everything else stays on the Triton kernel, and the tuner runs this one where it is faster
(on an H100, forced: the backward 1.01-1.17x at every shape of issue 9 with blocks >= 64; in the tuner's short
timings dk/dv 1.03-1.26x at D = 128 and a tie with the register-capped Triton tile at D = 64: bench/NOTES.md).
Deterministic, as the Triton kernel: each key tile's sums run in one consumer, in list order.

dQ (``s2_attention_bwd_dq_ws_kernel``, launched before dK/dV): the Gluon forward's structure (``hopper_fwd``: one
persistent program per SM, work items of ``hopper_fwd.BLOCK_M = 128`` query rows claimed in order from a counter, the
same lists; its own loader, ``_dq_load_partition``, with a ring of joint K/V slots), with each item's Q, dO and
O copied beside each other, and a consumer step of

    S = Q K^T (lse as the initial accumulator) and dP = dO V^T issued together
    wait for S only; P = exp2(S * scale) (masked on partial steps)
    wait for dP; dS = P (dP - delta); dQ += dS K, then the slot is released

Each of the two consumers (64 rows) first stores its rows' lse (log2 units) and delta = rowsum(dO O) - dlse for the
dK/dV kernel, as ``triton_impl.s2_attention_bwd_dq_kernel`` does. Scope (``supported_dq``): the Gluon forward's. On an
H100 the kernel alone runs 1.16-1.50x the best Triton dq at D = 128 and ties or loses at D = 64 (bench/NOTES.md),
where the tuner keeps the Triton tile. Deterministic: each row's sums run in one consumer, in list order.
"""

from __future__ import annotations

import torch

from . import hopper_fwd
from .hopper_fwd import AVAILABLE, MAXNREG
from .sequence_bounds import sequence_bounds

if AVAILABLE:
    from .hopper_fwd import (
        consumer_rows,
        gl,
        gluon,
        head_origin,
        mbarrier,
        partial_visible,
        publish_work,
        published_work,
        tl,
        tma,
        warpgroup_layout,
        warpgroup_mma,
        warpgroup_mma_wait,
        work_item,
    )

BLOCK_N = 64  # keys per consumer warp group: wgmma's M (16 rows per warp, 4 warps)
BLOCK_M = 64  # query rows per step: one list unit
# Registers per thread, (consumer, loader), by head dim: 12 warps (the loader's warp padded to a warp group) share
# 64K registers, 168 each at launch. A consumer holds dK and dV (64 x D fp32 each: 128 registers at D = 128), a
# step's S^T and dP^T (32 each) and P^T or dS^T in 16 bits; the loader its two cursors. Offline (ptxas, sm_90): no
# spills in the consumers' step loops at either split, and none at all at D = 64 (the loader spills ~50 bytes at
# D = 128, outside the consumers' path).
REGISTERS = {64: (208, 80), 128: (240, 24)}
DQ_BLOCK_N = 64  # keys per dQ step: a step holds S and dP (32 registers each at 64 keys) beside dQ's accumulator
DQ_REGISTERS = {64: (232, 40), 128: (240, 24)}  # as REGISTERS, for the dQ kernel

if AVAILABLE:

    @gluon.jit
    def _member_list(member, kv_head, tile, has_keys, group_args):
        """Query head ``member`` of the KV head's group: its index, list, keep bits, ``num_full`` and ``num_entries``
        (both 0 for ``member`` past the group, or a tile past the sequence's end)."""
        (unit_lists, unit_bits, unit_counts, stride_up, stride_ut, stride_cp, stride_ct, q_heads_per_pattern,
         q_heads_per_kv) = group_args
        listed = (member < q_heads_per_kv) & has_keys
        q_head = kv_head * q_heads_per_kv + member
        pattern_head = q_head // q_heads_per_pattern
        list_offset = pattern_head.to(gl.int64) * stride_up + tile.to(gl.int64) * stride_ut
        counts = unit_counts + pattern_head.to(gl.int64) * stride_cp + tile.to(gl.int64) * stride_ct
        num_full = gl.load(counts, mask=listed, other=0)
        num_entries = gl.load(counts + 1, mask=listed, other=0)
        return q_head, unit_lists + list_offset, unit_bits + list_offset, num_full, num_entries

    @gluon.jit
    def _member_rows(member, kv_head, tile, has_keys, seq, q_start, group_args, row_strides, stats_args):
        """Where query head ``member``'s copies come from: its list length and list, the rows of its sequence's first
        query in the Q and dO row descriptors' views and their columns, and its rows of lse and delta."""
        stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt = row_strides
        lse_log2, delta, stride_sb, stride_sh = stats_args
        q_head, list_base, _, _, num_entries = _member_list(member, kv_head, tile, has_keys, group_args)
        q_row, q_col = head_origin(seq, q_head, stride_qb, stride_qh, stride_qt)
        do_row, do_col = head_origin(seq, q_head, stride_gb, stride_gh, stride_gt)
        stats_offset = seq.to(gl.int64) * stride_sb + q_head.to(gl.int64) * stride_sh + q_start
        return (num_entries, list_base, q_row + q_start, q_col, do_row + q_start, do_col, lse_log2 + stats_offset,
                delta + stats_offset)

    @gluon.jit
    def _skip_empty(cursor, kv_head, tile, has_keys, seq, q_start, group_args, row_strides, stats_args):
        """``cursor = (step, member, entry, *_member_rows(member))`` moved past the members whose list is done
        (``member == q_heads_per_kv`` once the whole group is)."""
        step, member, entry, num_entries, list_base, q_row, q_col, do_row, do_col, lse_base, delta_base = cursor
        q_heads_per_kv = group_args[-1]
        while (entry >= num_entries) & (member < q_heads_per_kv):
            member += 1
            entry = 0
            num_entries, list_base, q_row, q_col, do_row, do_col, lse_base, delta_base = _member_rows(
                member, kv_head, tile, has_keys, seq, q_start, group_args, row_strides, stats_args)
        return step, member, entry, num_entries, list_base, q_row, q_col, do_row, do_col, lse_base, delta_base

    @gluon.jit
    def _copy_step(cursor, q_desc, do_desc, q_bufs, do_bufs, stats_bufs, ready, free, ring, seqlen):
        """Copy the cursor's step into ring ``ring``'s next slot once its consumer has freed it: Q and dO by TMA,
        the rows' lse and delta (0 past the sequence's end) stored by this warp; ``ready`` completes after both
        (it counts two arrivals: the TMA's expectation and the stores'). Returns the cursor one entry on."""
        step, member, entry, num_entries, list_base, q_row, q_col, do_row, do_col, lse_base, delta_base = cursor
        ROWS: gl.constexpr = q_desc.block_type.shape[0]
        NUM_BUFFERS: gl.constexpr = q_bufs.type.shape[0] // 2
        slot = ring * NUM_BUFFERS + step % NUM_BUFFERS
        # A fresh mbarrier counts as having completed the phase before 0, so first passes do not wait.
        mbarrier.wait(free.index(slot), ((step // NUM_BUFFERS) & 1) ^ 1)
        unit_row = gl.load(list_base + entry) * ROWS  # the step's first query, counted in its sequence
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + unit_row, q_col], ready.index(slot), q_bufs.index(slot))
        tma.async_copy_global_to_shared(do_desc, [do_row + unit_row, do_col], ready.index(slot), do_bufs.index(slot))
        offs = gl.arange(0, 2 * ROWS, layout=gl.BlockedLayout([4], [32], [1], [0]))  # lse rows, then delta rows
        q_pos = unit_row + offs % ROWS
        stats = gl.load(gl.where(offs < ROWS, lse_base, delta_base) + q_pos, mask=q_pos < seqlen, other=0.0)
        stats_bufs.index(slot).store(stats)
        gl.thread_barrier()  # every lane's stores before the arrival
        mbarrier.arrive(ready.index(slot), count=1)
        return step + 1, member, entry + 1, num_entries, list_base, q_row, q_col, do_row, do_col, lse_base, delta_base

    @gluon.jit
    def _load_partition(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, stats_bufs, k_smem, v_smem, kv_ready,
                        ready, free, tile_args, group_args, row_strides, stats_args, kv_strides):
        """Issue every copy: each consumer's K and V, then its steps, the two rings' steps alternated."""
        pair, kv_head, seq, q_start, k_start, seqlen_k = tile_args
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt = kv_strides
        KEYS: gl.constexpr = k_desc.block_type.shape[0]
        k_row, k_col = head_origin(seq, kv_head, stride_kb, stride_kh, stride_kt)
        v_row, v_col = head_origin(seq, kv_head, stride_vb, stride_vh, stride_vt)
        for ring in gl.static_range(2):
            first_key = (2 * pair + ring) * KEYS
            if first_key < seqlen_k:
                mbarrier.expect(kv_ready.index(ring), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [k_row + k_start + first_key, k_col], kv_ready.index(ring),
                                                k_smem.index(ring))
                tma.async_copy_global_to_shared(v_desc, [v_row + k_start + first_key, v_col], kv_ready.index(ring),
                                                v_smem.index(ring))
        tile_0 = 2 * pair
        tile_1 = 2 * pair + 1
        keys_0 = tile_0 * KEYS < seqlen_k
        keys_1 = tile_1 * KEYS < seqlen_k
        rows_0 = _member_rows(0, kv_head, tile_0, keys_0, seq, q_start, group_args, row_strides, stats_args)
        rows_1 = _member_rows(0, kv_head, tile_1, keys_1, seq, q_start, group_args, row_strides, stats_args)
        cursor_0 = _skip_empty((0, 0, 0, rows_0[0], rows_0[1], rows_0[2], rows_0[3], rows_0[4], rows_0[5], rows_0[6],
                                rows_0[7]), kv_head, tile_0, keys_0, seq, q_start, group_args, row_strides, stats_args)
        cursor_1 = _skip_empty((0, 0, 0, rows_1[0], rows_1[1], rows_1[2], rows_1[3], rows_1[4], rows_1[5], rows_1[6],
                                rows_1[7]), kv_head, tile_1, keys_1, seq, q_start, group_args, row_strides, stats_args)
        q_heads_per_kv = group_args[-1]
        while (cursor_0[1] < q_heads_per_kv) | (cursor_1[1] < q_heads_per_kv):
            if cursor_0[1] < q_heads_per_kv:
                cursor_0 = _skip_empty(_copy_step(cursor_0, q_desc, do_desc, q_bufs, do_bufs, stats_bufs, ready, free,
                                                  0, seqlen_k), kv_head, tile_0, keys_0, seq, q_start, group_args,
                                       row_strides, stats_args)
            if cursor_1[1] < q_heads_per_kv:
                cursor_1 = _skip_empty(_copy_step(cursor_1, q_desc, do_desc, q_bufs, do_bufs, stats_bufs, ready, free,
                                                  1, seqlen_k), kv_head, tile_1, keys_1, seq, q_start, group_args,
                                       row_strides, stats_args)

    @gluon.jit
    def _dkdv_step(dk_acc, dv_acc, k_tile, v_tile, q_bufs, do_bufs, stats_bufs, ready, free, slot, phase, unit,
                   keep_bits, k_pos, block_in_tile, seqlen, qk_scale, inv_qk_scale, MASKED: gl.constexpr,
                   s_layout: gl.constexpr, a_layout: gl.constexpr):
        """Accumulate the step's ``dK`` (unscaled) and ``dV``: query unit ``unit`` against the key tile."""
        ROWS: gl.constexpr = q_bufs.type.shape[1]
        KEYS: gl.constexpr = k_tile.type.shape[0]
        q_pos = unit * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))  # [ROWS] positions
        mbarrier.wait(ready.index(slot), phase)
        stats = stats_bufs.index(slot)
        lse_row = gl.where(q_pos < seqlen, stats.slice(0, ROWS).load(q_pos.type.layout), float("inf"))  # p = 0
        delta_row = stats.slice(ROWS, ROWS).load(q_pos.type.layout)
        q_tile = q_bufs.index(slot)  # [ROWS, D]
        do_tile = do_bufs.index(slot)
        # lse enters as the initial accumulator (S^T - lse / qk_scale), so it occupies no registers of its own while
        # the products run. (dP^T starts from zero: an initial accumulator is copied into the product's registers
        # after its fence, and ptxas then waits for S^T before issuing it.)
        zeros = gl.zeros([KEYS, ROWS], gl.float32, s_layout)
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zeros - (lse_row * inv_qk_scale)[None, :], is_async=True)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zeros, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
        p_t = gl.exp2(s_t * qk_scale)  # [KEYS, ROWS]
        if MASKED:  # a partial entry: keep bits and causality
            kept = ((keep_bits >> block_in_tile) & 1) != 0
            p_t = gl.where(kept[:, None] & (k_pos[:, None] <= q_pos[None, :]), p_t, 0.0)
        dv_acc = warpgroup_mma(gl.convert_layout(p_t.to(do_tile.dtype), a_layout), do_tile, dv_acc, is_async=True)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
        ds_t = p_t * (dp_t - delta_row[None, :])
        dk_acc = warpgroup_mma(gl.convert_layout(ds_t.to(q_tile.dtype), a_layout), q_tile, dk_acc, is_async=True)
        dv_acc, dk_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dv_acc, dk_acc))
        mbarrier.arrive(free.index(slot), count=1)
        return dk_acc, dv_acc

    @gluon.jit
    def _compute_partition(ring: gl.constexpr, q_bufs, do_bufs, stats_bufs, k_smem, v_smem, kv_ready, ready, free,
                           tile_args, group_args, grad_args, qk_scale, scale, BLOCK_SIZE: gl.constexpr):
        """Consumer ``ring`` (0 or 1): key tile ``2 * pair + ring``."""
        pair, kv_head, seq, q_start, k_start, seqlen_k = tile_args
        dk, dv, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt = grad_args
        NUM_BUFFERS: gl.constexpr = q_bufs.type.shape[0] // 2
        ROWS: gl.constexpr = q_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = q_bufs.type.shape[2]
        KEYS: gl.constexpr = k_smem.type.shape[1]
        tile = 2 * pair + ring
        has_keys = tile * KEYS < seqlen_k
        if has_keys:
            s_layout: gl.constexpr = warpgroup_layout(ROWS)
            acc_layout: gl.constexpr = warpgroup_layout(HEAD_DIM)
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
            k_pos = tile * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))  # [KEYS] positions
            block_in_tile = k_pos // BLOCK_SIZE - (tile * KEYS) // BLOCK_SIZE  # bit index of each key's block
            inv_qk_scale = 1.0 / qk_scale
            dk_acc = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
            dv_acc = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
            k_tile = k_smem.index(ring)
            v_tile = v_smem.index(ring)
            mbarrier.wait(kv_ready.index(ring), 0)
            step = 0
            for member in range(group_args[-1]):
                list_base, bits_base, num_full, num_entries = _member_list(member, kv_head, tile, has_keys,
                                                                           group_args)[1:]
                for entry in range(num_full):
                    dk_acc, dv_acc = _dkdv_step(dk_acc, dv_acc, k_tile, v_tile, q_bufs, do_bufs, stats_bufs, ready,
                                                free, ring * NUM_BUFFERS + step % NUM_BUFFERS,
                                                (step // NUM_BUFFERS) & 1, gl.load(list_base + entry), 0, k_pos,
                                                block_in_tile, seqlen_k, qk_scale, inv_qk_scale, False, s_layout,
                                                a_layout)
                    step += 1
                for entry in range(num_full, num_entries):
                    dk_acc, dv_acc = _dkdv_step(dk_acc, dv_acc, k_tile, v_tile, q_bufs, do_bufs, stats_bufs, ready,
                                                free, ring * NUM_BUFFERS + step % NUM_BUFFERS,
                                                (step // NUM_BUFFERS) & 1, gl.load(list_base + entry),
                                                gl.load(bits_base + entry), k_pos, block_in_tile, seqlen_k, qk_scale,
                                                inv_qk_scale, True, s_layout, a_layout)
                    step += 1
            keys_acc: gl.constexpr = gl.SliceLayout(1, acc_layout)
            k_pos_acc = gl.convert_layout(k_pos, keys_acc)
            rows = (k_start + k_pos_acc).to(gl.int64)[:, None]
            key_real = (k_pos_acc < seqlen_k)[:, None]
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))[None, :]
            dk_head = dk + seq.to(gl.int64) * stride_dkb + kv_head.to(gl.int64) * stride_dkh
            dv_head = dv + seq.to(gl.int64) * stride_dvb + kv_head.to(gl.int64) * stride_dvh
            gl.store(dk_head + rows * stride_dkt + cols, (dk_acc * scale).to(dk.dtype.element_ty), mask=key_real)
            gl.store(dv_head + rows * stride_dvt + cols, dv_acc.to(dv.dtype.element_ty), mask=key_real)

    @gluon.jit
    def s2_attention_bwd_dkdv_ws_kernel(
        q_desc, do_desc, k_desc, v_desc,  # row descriptors (layouts.row_view), boxes [BLOCK_M, D], [BLOCK_N, D]
        lse_log2, delta, dk, dv,  # [B, Hq, T] float32 x 2 (stored by the dq kernel), [B, Hkv, T, D] x 2
        unit_lists, unit_bits, unit_counts,  # the dk/dv lists for BLOCK_N-key tiles (build_unit_lists)
        cu_seqlens_q, cu_seqlens_k,  # int32 [S + 1], read only when IS_VARLEN
        stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
        stride_sb, stride_sh, stride_up, stride_ut, stride_cp, stride_ct,
        seqlen_q, seqlen_k, scale, qk_scale, q_heads_per_pattern, q_heads_per_kv,
        BLOCK_SIZE: gl.constexpr, IS_VARLEN: gl.constexpr, NUM_BUFFERS: gl.constexpr,
        CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
    ):
        """Grid ``(ceil(num_k_tiles / 2), Hkv, B or S)``: dK, dV of two neighbouring ``BLOCK_N``-key tiles of one KV
        head, one per consumer warp group, each with its own list and ring, fed by one loader warp. ``qk_scale =
        scale * log2(e)``."""
        ROWS: gl.constexpr = q_desc.block_type.shape[0]
        KEYS: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        pair = gl.program_id(0)
        kv_head = gl.program_id(1)
        seq = gl.program_id(2)
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(cu_seqlens_q, cu_seqlens_k, seq, seqlen_q, seqlen_k,
                                                               IS_VARLEN)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, KEYS, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, KEYS, HEAD_DIM], v_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * NUM_BUFFERS, ROWS, HEAD_DIM], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2 * NUM_BUFFERS, ROWS, HEAD_DIM], do_desc.layout)
        stats_bufs = gl.allocate_shared_memory(gl.float32, [2 * NUM_BUFFERS, 2 * ROWS],
                                               gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        for ring in gl.static_range(2):
            mbarrier.init(kv_ready.index(ring), count=1)
        for slot in gl.static_range(2 * NUM_BUFFERS):
            mbarrier.init(ready.index(slot), count=2)  # the TMA's expectation and the statistics' stores
            mbarrier.init(free.index(slot), count=1)

        tile_args = (pair, kv_head, seq, q_start, k_start, seqlen_k)
        group_args = (unit_lists, unit_bits, unit_counts, stride_up, stride_ut, stride_cp, stride_ct,
                      q_heads_per_pattern, q_heads_per_kv)
        row_strides = (stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt)
        stats_args = (lse_log2, delta, stride_sb, stride_sh)
        kv_strides = (stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt)
        grad_args = (dk, dv, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt)
        gl.warp_specialize(
            [
                (_compute_partition, (0, q_bufs, do_bufs, stats_bufs, k_smem, v_smem, kv_ready, ready, free,
                                      tile_args, group_args, grad_args, qk_scale, scale, BLOCK_SIZE)),
                (_compute_partition, (1, q_bufs, do_bufs, stats_bufs, k_smem, v_smem, kv_ready, ready, free,
                                      tile_args, group_args, grad_args, qk_scale, scale, BLOCK_SIZE)),
                (_load_partition, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, stats_bufs, k_smem, v_smem,
                                   kv_ready, ready, free, tile_args, group_args, row_strides, stats_args,
                                   kv_strides)),
            ],
            [4, 1],
            [CONSUMER_REGISTERS, LOADER_REGISTERS],  # the default partition (consumer 0) gets what is left
        )

    # ------------------------------------------------------------------------------------------------------- dQ
    @gluon.jit
    def _copy_kv_steps(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_free, step, list_base, num_entries,
                       k_row, k_col, v_row, v_col):
        """Copy a query tile's K and V into the ring, a step of ``GROUP = BLOCK_N // UNIT`` list entries per slot
        (one box of ``UNIT`` rows each; a step's missing entries repeat the last one, which the consumers mask), each
        slot once its consumers have released it. ``k_row``, ``v_row``: the sequence's first key in the views.
        Returns ``step`` (ring steps loaded so far) past the tile's."""
        NUM_BUFFERS: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        UNIT: gl.constexpr = k_desc.block_type.shape[0]
        GROUP: gl.constexpr = BLOCK_N // UNIT
        for j in range(gl.cdiv(num_entries, GROUP)):
            slot = step % NUM_BUFFERS
            # A fresh mbarrier counts as having completed the phase before 0, so first passes do not wait.
            mbarrier.wait(kv_free.index(slot), ((step // NUM_BUFFERS) & 1) ^ 1)
            mbarrier.expect(k_ready.index(slot), GROUP * k_desc.block_type.nbytes)
            mbarrier.expect(v_ready.index(slot), GROUP * v_desc.block_type.nbytes)
            for member in gl.static_range(GROUP):
                first_key = gl.load(list_base + gl.minimum(j * GROUP + member, num_entries - 1)) * UNIT
                tma.async_copy_global_to_shared(k_desc, [k_row + first_key, k_col], k_ready.index(slot),
                                                k_bufs.index(slot).slice(member * UNIT, UNIT))
                tma.async_copy_global_to_shared(v_desc, [v_row + first_key, v_col], v_ready.index(slot),
                                                v_bufs.index(slot).slice(member * UNIT, UNIT))
            step += 1
        return step

    @gluon.jit
    def _dq_load_partition(row_descs, row_bufs, row_strides, k_desc, v_desc, k_bufs, v_bufs, q_ready, q_free,
                           k_ready, v_ready, kv_free, work_smem, work_counter, work_args, kv_strides,
                           TILE: gl.constexpr, IS_VARLEN: gl.constexpr):
        """The dq kernel's loader: claim the work items (as the forward's, ``hopper_fwd.stream_load_partition``) and
        issue every TMA copy: per item its index (``publish_work``, read by the consumers once the rows have arrived)
        and both consumers' halves of the query-side rows (``row_descs``, with ``row_bufs [2, ROWS, D]`` and
        ``(batch, head, row)`` strides each: Q, dO and O), then per step the K and V of ``GROUP = BLOCK_N // UNIT``
        list entries (``_copy_kv_steps``). After the last item, ``num_work`` as the index tells the consumers to
        stop."""
        num_work = work_args[0]
        q_heads_per_kv = work_args[-1]
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt = kv_strides
        ROWS: gl.constexpr = row_descs[0].block_type.shape[0]
        step = 0  # ring steps loaded so far: slot and phase
        iteration = 0
        work = gl.program_id(0)  # the first item; later ones are claimed from the counter, in order
        while work < num_work:
            # Claimed now, used after this item's loads: the atomic's round trip hides behind them.
            next_work = gl.num_programs(0) + gl.atomic_add(work_counter, 1, sem="relaxed")
            seq, q_head, q_start, k_start, _, first_pos, tile_first, list_base, _, _, num_entries, _ = work_item(
                work, work_args, TILE, IS_VARLEN, False)
            first_row = q_start + tile_first - first_pos  # the tile's first row in its sequence's rows
            # A fresh mbarrier counts as having completed the phase before 0, so first passes do not wait.
            mbarrier.wait(q_free, (iteration & 1) ^ 1)
            publish_work(work_smem, work)  # made visible to the consumers by q_ready's phase
            mbarrier.expect(q_ready, 2 * len(row_descs) * row_descs[0].block_type.nbytes)
            for t in gl.static_range(len(row_descs)):
                row, col = head_origin(seq, q_head, row_strides[t][0], row_strides[t][1], row_strides[t][2])
                for half in gl.static_range(2):
                    tma.async_copy_global_to_shared(row_descs[t], [row + first_row + half * ROWS, col], q_ready,
                                                    row_bufs[t].index(half))
            kv_head = q_head // q_heads_per_kv
            k_row, k_col = head_origin(seq, kv_head, stride_kb, stride_kh, stride_kt)
            v_row, v_col = head_origin(seq, kv_head, stride_vb, stride_vh, stride_vt)
            step = _copy_kv_steps(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_free, step, list_base,
                                  num_entries, k_row + k_start, k_col, v_row + k_start, v_col)
            iteration += 1
            work = next_work
        mbarrier.wait(q_free, (iteration & 1) ^ 1)  # no more items: tell the consumers
        publish_work(work_smem, num_work)
        mbarrier.arrive(q_ready, count=1)

    @gluon.jit
    def _dq_step(acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_free, step, lse_init, delta_row, j,
                 num_entries, list_base, bits_base, q_pos, block_in_tile, seqlen_k, qk_scale, MASKED: gl.constexpr,
                 UNIT: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr):
        """Accumulate ring step ``step``'s ``dS K`` (unscaled) into ``acc``: the tile's step ``j``, masked where
        ``MASKED`` (its partial entries). S and dP are issued together; the exponentials run while dP does."""
        NUM_BUFFERS: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        slot = step % NUM_BUFFERS
        phase = (step // NUM_BUFFERS) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q_tile, k_bufs.index(slot).permute((1, 0)), lse_init, is_async=True)  # S - lse / qk_scale
        mbarrier.wait(v_ready.index(slot), phase)
        dp = warpgroup_mma(do_tile, v_bufs.index(slot).permute((1, 0)), gl.zeros_like(lse_init), use_acc=False,
                           is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p = gl.exp2(s * qk_scale)  # [ROWS, BLOCK_N]
        if MASKED:
            p = gl.where(partial_visible(j, num_entries, list_base, bits_base, q_pos, block_in_tile, seqlen_k, UNIT,
                                         BLOCK_N, s_layout), p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - delta_row[:, None])
        acc = warpgroup_mma(gl.convert_layout(ds.to(k_bufs.dtype), a_layout), k_bufs.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_free.index(slot), count=1)
        return acc

    @gluon.jit
    def _dq_compute_partition(consumer: gl.constexpr, q_smem, do_smem, o_smem, k_bufs, v_bufs, q_ready, q_free,
                              k_ready, v_ready, kv_free, work_smem, work_args, out_args, scale, qk_scale,
                              TILE: gl.constexpr, BLOCK_SIZE: gl.constexpr, UNIT: gl.constexpr,
                              IS_VARLEN: gl.constexpr, HAS_DLSE: gl.constexpr):
        """Consumer ``consumer`` (0 or 1): dQ of rows ``consumer * ROWS ...`` of each work item's query tile, and
        those rows' statistics for the dK/dV kernel."""
        num_work = work_args[0]
        (dq, lse, dlse, lse_log2, delta, stride_dqb, stride_dqh, stride_dqt, stride_lb, stride_lh, stride_lt,
         stride_eb, stride_eh, stride_et, stride_sb, stride_sh) = out_args
        ROWS: gl.constexpr = q_smem.type.shape[1]
        HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        GROUP: gl.constexpr = BLOCK_N // UNIT
        s_layout: gl.constexpr = warpgroup_layout(BLOCK_N)
        acc_layout: gl.constexpr = warpgroup_layout(HEAD_DIM)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_acc: gl.constexpr = gl.SliceLayout(1, acc_layout)
        q_tile = q_smem.index(consumer)  # [ROWS, D] each
        do_tile = do_smem.index(consumer)
        o_tile = o_smem.index(consumer)
        inv_qk_scale = 1.0 / qk_scale
        step = 0  # ring steps consumed so far: slot and phase
        iteration = 0
        mbarrier.wait(q_ready, 0)
        work = published_work(work_smem)
        while work < num_work:
            (seq, q_head, q_start, _, seqlen_k_seq, first_pos, tile_first, list_base, bits_base, num_full,
             num_entries, _) = work_item(work, work_args, TILE, IS_VARLEN, False)
            q_pos, block_in_tile = consumer_rows(tile_first, consumer, ROWS, BLOCK_SIZE, rows_s)
            row_real = (q_pos >= first_pos) & (q_pos < seqlen_k_seq)
            rows = (q_start + q_pos - first_pos).to(gl.int64)  # [ROWS] in the sequence's rows
            # The rows' statistics (triton_impl._softmax_stats): lse in log2 units (+inf where the row is not real or
            # saw no key, so p = 0) and delta = rowsum(dO * O) - dlse; stored for the dK/dV kernel.
            lse_in = gl.load(lse + seq.to(gl.int64) * stride_lb + q_head.to(gl.int64) * stride_lh + rows * stride_lt,
                             mask=row_real, other=-float("inf"))
            lse_row = gl.where(lse_in == -float("inf"), float("inf"), lse_in * 1.4426950408889634)
            products = o_tile.load(acc_layout).to(gl.float32) * do_tile.load(acc_layout).to(gl.float32)
            delta_row = gl.convert_layout(gl.sum(products, 1), rows_s)
            if HAS_DLSE:
                dlse_head = dlse + seq.to(gl.int64) * stride_eb + q_head.to(gl.int64) * stride_eh
                delta_row -= gl.load(dlse_head + rows * stride_et, mask=row_real, other=0.0)
            stats_rows = seq.to(gl.int64) * stride_sb + q_head.to(gl.int64) * stride_sh + rows
            gl.store(lse_log2 + stats_rows, lse_row, mask=row_real)
            gl.store(delta + stats_rows, delta_row, mask=row_real)
            # S's initial accumulator: the products start from -lse / qk_scale, so a step's exponent is one multiply
            # (the tile stays live through the item's steps: 32 registers, which the step loop has to spare)
            lse_init = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout) - (lse_row * inv_qk_scale)[:, None]
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
            for j in range(num_full // GROUP):
                acc = _dq_step(acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_free, step, lse_init,
                               delta_row, j, num_entries, list_base, bits_base, q_pos, block_in_tile, seqlen_k_seq,
                               qk_scale, False, UNIT, s_layout, a_layout)
                step += 1
            for j in range(num_full // GROUP, gl.cdiv(num_entries, GROUP)):
                acc = _dq_step(acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_free, step, lse_init,
                               delta_row, j, num_entries, list_base, bits_base, q_pos, block_in_tile, seqlen_k_seq,
                               qk_scale, True, UNIT, s_layout, a_layout)
                step += 1
            mbarrier.arrive(q_free, count=1)  # the loader may bring the next work item's Q, dO and O

            dq_head = dq + seq.to(gl.int64) * stride_dqb + q_head.to(gl.int64) * stride_dqh
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
            gl.store(dq_head + gl.convert_layout(rows, rows_acc)[:, None] * stride_dqt + cols[None, :],
                     (acc * scale).to(dq.dtype.element_ty), mask=gl.convert_layout(row_real, rows_acc)[:, None])
            iteration += 1
            mbarrier.wait(q_ready, iteration & 1)
            work = published_work(work_smem)

    @gluon.jit
    def s2_attention_bwd_dq_ws_kernel(
        q_desc, do_desc, o_desc, k_desc, v_desc,  # row descriptors: boxes [ROWS, D] x 3, [UNIT, D] x 2
        lse, dlse, dq,  # [B, Hq, Tq] float32 (natural log; dlse read only when HAS_DLSE), [B, Hq, Tq, D]
        lse_log2, delta,  # outputs for the dK/dV kernel: float32 [B, Hq, Tq] contiguous
        unit_lists, unit_bits, unit_counts,  # the forward's lists for 2 * ROWS-row tiles and BLOCK_N-key steps
        cu_seqlens_q, cu_seqlens_k,  # int32 [S + 1], read only when IS_VARLEN
        work_counter,  # int32 [1], zero
        # int64 as in the forward (its kernel's comment): int32 strides' sign extensions were spilled and reloaded each
        # work item (132 / 192 bytes at D = 128; none with int64, bench/hopper_bwd_offline.py dq)
        stride_qb: tl.int64, stride_qh: tl.int64, stride_qt: tl.int64, stride_gb: tl.int64, stride_gh: tl.int64,
        stride_gt: tl.int64, stride_ob: tl.int64, stride_oh: tl.int64, stride_ot: tl.int64, stride_kb: tl.int64,
        stride_kh: tl.int64, stride_kt: tl.int64, stride_vb: tl.int64, stride_vh: tl.int64, stride_vt: tl.int64,
        stride_dqb: tl.int64, stride_dqh: tl.int64, stride_dqt: tl.int64, stride_lb: tl.int64, stride_lh: tl.int64,
        stride_lt: tl.int64, stride_eb: tl.int64, stride_eh: tl.int64, stride_et: tl.int64, stride_sb: tl.int64,
        stride_sh: tl.int64, stride_up: tl.int64, stride_ut: tl.int64, stride_cp: tl.int64, stride_ct: tl.int64,
        first_pos, seqlen_k, last_tile,  # hopper_fwd.item_args (ignored with varlen)
        scale, qk_scale, q_heads_per_pattern, q_heads_per_kv, num_q_tiles, num_q_heads, num_work,
        BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_DLSE: gl.constexpr,
        NUM_BUFFERS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
    ):
        """Persistent, with the forward's work items (``hopper_fwd.s2_attention_fwd_ws_kernel``): dQ of one query tile
        of ``2 * ROWS`` rows per item, two consumers of ``ROWS`` rows sharing its K/V steps. ``qk_scale = scale *
        log2(e)``."""
        ROWS: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        UNIT: gl.constexpr = k_desc.block_type.shape[0]
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, ROWS, HEAD_DIM], do_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, ROWS, HEAD_DIM], o_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], v_desc.layout)
        work_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_free, count=2)  # both consumers release Q, dO and O
        for slot in gl.static_range(NUM_BUFFERS):
            mbarrier.init(k_ready.index(slot), count=1)
            mbarrier.init(v_ready.index(slot), count=1)
            mbarrier.init(kv_free.index(slot), count=2)  # both consumers release a slot

        work_args = (num_work, num_q_tiles, num_q_heads, cu_seqlens_q, cu_seqlens_k, first_pos, seqlen_k, last_tile,
                     unit_lists, unit_bits, unit_counts, stride_up, stride_ut, stride_cp, stride_ct,
                     q_heads_per_pattern, q_heads_per_kv)
        out_args = (dq, lse, dlse, lse_log2, delta, stride_dqb, stride_dqh, stride_dqt, stride_lb, stride_lh,
                    stride_lt, stride_eb, stride_eh, stride_et, stride_sb, stride_sh)
        row_strides = ((stride_qb, stride_qh, stride_qt), (stride_gb, stride_gh, stride_gt),
                       (stride_ob, stride_oh, stride_ot))
        kv_strides = (stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt)
        gl.warp_specialize(
            [
                (_dq_compute_partition, (0, q_smem, do_smem, o_smem, k_bufs, v_bufs, q_ready, q_free, k_ready,
                                         v_ready, kv_free, work_smem, work_args, out_args, scale, qk_scale, 2 * ROWS,
                                         BLOCK_SIZE, UNIT, IS_VARLEN, HAS_DLSE)),
                (_dq_compute_partition, (1, q_smem, do_smem, o_smem, k_bufs, v_bufs, q_ready, q_free, k_ready,
                                         v_ready, kv_free, work_smem, work_args, out_args, scale, qk_scale, 2 * ROWS,
                                         BLOCK_SIZE, UNIT, IS_VARLEN, HAS_DLSE)),
                (_dq_load_partition, ((q_desc, do_desc, o_desc), (q_smem, do_smem, o_smem), row_strides, k_desc,
                                      v_desc, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, kv_free, work_smem,
                                      work_counter, work_args, kv_strides, 2 * ROWS, IS_VARLEN)),
            ],
            [4, 1],
            [CONSUMER_REGISTERS, LOADER_REGISTERS],
        )


def supported_dkdv(q: torch.Tensor, k: torch.Tensor, causal: bool, block_size: int, same_tokens: bool) -> bool:
    """Whether the dK/dV kernel can run the call, given row views of q, dout, k and v (``layouts.row_view``)."""
    return (
        AVAILABLE and q.is_cuda and causal and same_tokens and q.dtype in (torch.float16, torch.bfloat16)
        and q.dtype == k.dtype and q.shape[-1] in (64, 128) and block_size >= BLOCK_M and hopper_fwd.is_sm90(q.device)
    )


def launch_dkdv(q, dout, k, v, lse_log2, delta, dk, dv, row_views, lists, problem, scale: float, qk_scale: float,
                block_size: int, num_pattern_heads: int, num_buffers: int) -> None:
    """Run the kernel. ``row_views``: ``(shape, strides)`` of q, dout, k and v seen as rows
    (``layouts.row_view``); ``lists``: the dk/dv lists for ``BLOCK_N``-key tiles and ``BLOCK_M``-query units;
    ``problem``: ``triton_impl._Problem``; ``lse_log2``, ``delta``: contiguous ``[B, Hq, T]``."""
    units, bits, counts = lists
    head_dim = q.shape[-1]
    descriptors = hopper_fwd.row_descriptors((q, dout, k, v), row_views, (BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_N))
    num_kv_heads = k.shape[1]
    grid = (-(-problem.max_seqlen_k // (2 * BLOCK_N)), num_kv_heads, problem.num_seqs)
    stats_strides = (0 if problem.is_varlen else delta.stride(0), delta.stride(1))
    s2_attention_bwd_dkdv_ws_kernel[grid](
        *descriptors, lse_log2, delta, dk, dv, units, bits, counts, problem.cu_seqlens_q, problem.cu_seqlens_k,
        *problem.strides(q)[:3], *problem.strides(dout)[:3], *problem.strides(k)[:3], *problem.strides(v)[:3],
        *problem.strides(dk)[:3], *problem.strides(dv)[:3], *stats_strides, *units.stride()[:2],
        *counts.stride()[:2], q.shape[2], k.shape[2], scale, qk_scale, q.shape[1] // num_pattern_heads,
        q.shape[1] // num_kv_heads,
        BLOCK_SIZE=block_size, IS_VARLEN=problem.is_varlen, NUM_BUFFERS=num_buffers,
        CONSUMER_REGISTERS=REGISTERS[head_dim][0], LOADER_REGISTERS=REGISTERS[head_dim][1], num_warps=4,
        maxnreg=MAXNREG,
    )


def supported_dq(q: torch.Tensor, k: torch.Tensor, causal: bool, block_size: int) -> bool:
    """Whether the dQ kernel can run the call, given row views of q, dout, out, k and v: where the Gluon forward can
    (its work items and lists)."""
    return hopper_fwd.supported(q, k, causal, block_size)


def launch_dq(q, k, v, out, dout, lse, dlse, dq, lse_log2, delta, row_views, lists, problem, scale: float,
              qk_scale: float, block_size: int, num_pattern_heads: int, num_buffers: int) -> None:
    """Run the dQ kernel. ``row_views``: ``(shape, strides)`` of q, dout, out, k and v seen as rows; ``lists``: the
    forward's lists for ``hopper_fwd.BLOCK_M``-row query tiles and ``DQ_BLOCK_N``-key units; ``lse_log2``, ``delta``:
    contiguous ``[B, Hq, T]``, written."""
    units, bits, counts = lists
    head_dim = q.shape[-1]
    unit = min(block_size, DQ_BLOCK_N)  # keys per list entry: one TMA box
    descriptors = hopper_fwd.row_descriptors((q, dout, out, k, v), row_views,
                                             (hopper_fwd.CONSUMER_ROWS,) * 3 + (unit, unit))
    num_q_heads = q.shape[1]
    num_q_tiles = problem.num_q_tiles(hopper_fwd.BLOCK_M)
    num_work = num_q_tiles * num_q_heads * problem.num_seqs
    stats_strides = (0 if problem.is_varlen else delta.stride(0), delta.stride(1))
    s2_attention_bwd_dq_ws_kernel[(min(num_work, hopper_fwd._num_sms(q.device)),)](
        *descriptors, lse, lse if dlse is None else dlse, dq, lse_log2, delta, units, bits, counts,
        problem.cu_seqlens_q, problem.cu_seqlens_k, torch.zeros(1, dtype=torch.int32, device=q.device),
        *problem.strides(q)[:3], *problem.strides(dout)[:3], *problem.strides(out)[:3], *problem.strides(k)[:3],
        *problem.strides(v)[:3], *problem.strides(dq)[:3], *problem.strides(lse),
        *problem.strides(lse if dlse is None else dlse), *stats_strides, *units.stride()[:2], *counts.stride()[:2],
        *hopper_fwd.item_args(q, k), scale, qk_scale, num_q_heads // num_pattern_heads, num_q_heads // k.shape[1],
        num_q_tiles, num_q_heads, num_work,
        BLOCK_SIZE=block_size, BLOCK_N=DQ_BLOCK_N, IS_VARLEN=problem.is_varlen, HAS_DLSE=dlse is not None,
        NUM_BUFFERS=num_buffers, CONSUMER_REGISTERS=DQ_REGISTERS[head_dim][0],
        LOADER_REGISTERS=DQ_REGISTERS[head_dim][1], num_warps=4, maxnreg=MAXNREG,
    )
