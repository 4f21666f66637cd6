"""Triton S2-Attention: block-sparse FlashAttention-2 forward and a deterministic two-kernel backward.

Entry points: the launchers ``s2_attention_fwd`` and ``s2_attention_bwd``, per the backend contract in
``interface.py``. Call chain: ``s2_attention_fwd_kernel`` -> ``s2_attention_fwd`` -> the custom op ``s2::attention``
(``interface.attention_op``; ``interface.AttentionFunction``'s backward calls ``s2::attention_backward``) ->
``s2_attention``;
backward: ``s2_attention_bwd_dq_kernel`` (which also stores the rows' softmax statistics) and
``s2_attention_bwd_dkdv_kernel`` -> ``s2_attention_bwd``. On compute capability 9.0 the forward's tuner also times
the warp-specialized Gluon forward (``hopper_fwd.py``, ``TileConfig.gluon``), and the dq and dk/dv tuners the
warp-specialized Gluon dq and dk/dv (``hopper_bwd.py``); each runs where it wins.

Kernel tiles are decoupled from the sparsity granularity ``block_size``:

* Positions are absolute within a sequence (key ``s`` at ``s``, query ``t`` at ``Tk - Tq + t``). A *resident* tile
  (the query tile of the forward and dq kernels, the key tile of the dk/dv kernel) covers ``tile`` consecutive
  positions; it may span several sparse blocks (Merge-Q) or a part of one.
* The other side is visited in *units* of ``unit = min(block_size, tile of that side)`` consecutive positions.
  One iteration gathers ``tile // unit`` kept units (each unit's rows contiguous), so a vertical stripe of 16-token
  blocks fills a 64-wide tile instead of wasting 3/4 of it.
* Per (pattern head, resident tile) a list holds the kept units, first the *full* ones (kept by every sparse block
  of the resident tile and entirely on the visible side of the causal diagonal: no score masking at all), then the
  *partial* ones (per-entry keep bits + causal + length masks). The lists are built with torch ops from
  ``layout.block_mask`` and cached per ``layout.cache_key``; the dk/dv kernel uses the transposed lists.

Numerics: online softmax in base 2 (``log2(e)`` folded into the scale), fp32 accumulation. fp32 inputs use IEEE
fp32 dots (no TF32), so they are as exact as the PyTorch reference. The backward uses no atomics: dq and dk/dv are
separate kernels and dk/dv of a KV head reduce its whole query group in registers, so results are bitwise
reproducible (gradient checkpointing recomputes exactly).
"""

from __future__ import annotations

import functools
import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import hopper_bwd, hopper_fwd
from .layouts import BlockLayout, Varlen, empty_heads_last, row_view
from .sequence_bounds import sequence_bounds
from .triton_setup import TensorDescriptor, next_power_of_2, tl, triton

LOG2E = math.log2(math.e)




# ============================================================================================== kernels
@triton.jit
def _gather_positions(list_base, entry, num_entries, BLOCK: tl.constexpr, UNIT: tl.constexpr):
    """Absolute positions ``[BLOCK]`` of the ``BLOCK // UNIT`` list entries from ``entry`` on, and which are listed.

    The entries are read as ``BLOCK // UNIT`` scalar loads, as a plain block-sparse FlashAttention loop reads its block
    index, never as a ``[BLOCK]`` tensor load: Triton 3.6's software pipeliner turned that tensor load into an
    asynchronous copy into a single-slot shared buffer (beside a second, synchronous load of the same entries for the
    K/V addresses), and the kernels gave wrong 16-bit results at ``num_stages >= 2`` (the likely cause: bench/NOTES.md).
    With scalar reads and
    ``num_stages=2`` only K and V are copied asynchronously (double-buffered), as in a dense kernel. The masked loops'
    keep bits are scalar loads too (``_entry_bits``), and those loops pipeline at ``_MASKED_LOOP_STAGES`` (exact at 2
    on an H100, ``bench/kernel_variants.py``). With one unit per tile the positions are one contiguous run.
    """
    offs = tl.arange(0, BLOCK)
    listed = entry + offs // UNIT < num_entries
    if BLOCK == UNIT:
        return tl.load(list_base + entry, mask=entry < num_entries, other=0) * UNIT + offs, listed
    positions = offs % UNIT
    for member in tl.static_range(BLOCK // UNIT):
        unit = tl.load(list_base + entry + member, mask=entry + member < num_entries, other=0)
        positions += tl.where(offs // UNIT == member, unit * UNIT, 0)
    return positions, listed


@triton.jit
def _tile_list(unit_lists, unit_bits, unit_counts, pattern_head, tile, stride_up, stride_ut, stride_cp, stride_ct):
    """The list of one (pattern head, resident tile): entries, their keep bits, and the (full, total) counts."""
    offset = pattern_head.to(tl.int64) * stride_up + tile.to(tl.int64) * stride_ut
    count_base = unit_counts + pattern_head.to(tl.int64) * stride_cp + tile.to(tl.int64) * stride_ct
    return unit_lists + offset, unit_bits + offset, tl.load(count_base), tl.load(count_base + 1)


@triton.jit
def _entry_bits(bits_base, entry, num_entries, BLOCK: tl.constexpr, UNIT: tl.constexpr):
    """Per position ``[BLOCK]``: the keep bits of its list entry (bit b: block b of the resident tile keeps it).
    Scalar loads, as in ``_gather_positions``."""
    offs = tl.arange(0, BLOCK)
    bits = tl.zeros([BLOCK], dtype=tl.int32)
    for member in tl.static_range(BLOCK // UNIT):
        entry_bits = tl.load(bits_base + entry + member, mask=entry + member < num_entries, other=0)
        bits = tl.where(offs // UNIT == member, entry_bits, bits)
    return bits


@triton.jit
def _visible(keep_bits, block_in_tile, q_pos, k_pos, valid, CAUSAL: tl.constexpr):
    """Token visibility (broadcastable 2-D operands): the entry's keep bit for the resident block & causal & valid."""
    visible = valid & (((keep_bits >> block_in_tile) & 1) != 0)
    if CAUSAL:
        visible = visible & (k_pos <= q_pos)
    return visible


@triton.jit
def row_mask(row_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """``[rows, BLOCK_D]`` mask. Without D padding it is constant along D, which keeps the loads vectorized (and
    eligible for cp.async pipelining); a per-column ``d < HEAD_DIM`` term would force element-wise accesses."""
    if HEAD_DIM == BLOCK_D:
        return row_ok[:, None]
    else:
        return row_ok[:, None] & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :]


@triton.jit
def _descriptor_origin(seq, head, stride_b, stride_h, stride_t, TMA: tl.constexpr):
    """``(row, column)`` where the rows of (sequence or batch row ``seq``, ``head``) start in a ``_row_descriptors``
    view ``[rows, stride_t]`` of the tensor; ``(0, 0)`` when TMA is off."""
    if TMA:
        offset = seq.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
        return (offset // stride_t).to(tl.int32), (offset % stride_t).to(tl.int32)
    else:
        return 0, 0


@triton.jit
def _load_rows(base, rows, row_ok, stride_t, stride_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load ``[len(rows), BLOCK_D]`` (zero for rows not ok and for the D padding)."""
    d = tl.arange(0, BLOCK_D)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_t + d[None, :] * stride_d
    return tl.load(ptrs, mask=row_mask(row_ok, HEAD_DIM, BLOCK_D), other=0.0)


@triton.jit
def _store_rows(base, value, rows, row_ok, stride_t, stride_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_t + d[None, :] * stride_d
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=row_mask(row_ok, HEAD_DIM, BLOCK_D))


@triton.jit
def _fwd_step(
    acc, m_i, l_i, q_tile, q_pos, block_in_tile, k_head, v_head, k_desc, v_desc, k_origin, v_origin, list_base,
    bits_base, entry, num_entries, k_start, seqlen_k, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UNIT: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update of the query tile with a gathered tile of ``BLOCK_N`` keys.

    With ``TMA`` (unmasked causal steps whose key tile is one contiguous unit) K and V come through the tensor memory
    accelerator: ``k_desc`` / ``v_desc`` view them as rows (``_row_descriptors``), the head's rows starting at
    ``k_origin`` / ``v_origin`` (``_descriptor_origin``). Every key of such a step is real, so nothing is masked.
    """
    if TMA:
        first_row = k_start + tl.load(list_base + entry) * UNIT
        k_tile = k_desc.load([k_origin[0] + first_row, k_origin[1]])  # [BLOCK_N, BLOCK_D]
    else:
        k_pos, listed = _gather_positions(list_base, entry, num_entries, BLOCK_N, UNIT)
        key_real = listed & (k_pos < seqlen_k)
        # [BLOCK_N, BLOCK_D]
        k_tile = _load_rows(k_head, k_start + k_pos, key_real, stride_kt, stride_kd, HEAD_DIM, BLOCK_D)
    s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], raw scores
    if MASKED:
        keep_bits = _entry_bits(bits_base, entry, num_entries, BLOCK_N, UNIT)
        valid = (q_pos[:, None] < seqlen_k) & key_real[None, :]
        visible = _visible(keep_bits[None, :], block_in_tile[:, None], q_pos[:, None], k_pos[None, :], valid, CAUSAL)
        s = tl.where(visible, s, -float("inf"))
    elif not CAUSAL:
        # A full entry of a bidirectional pattern may run past the end of a short (varlen) sequence.
        s = tl.where(key_real[None, :], s, -float("inf"))
    # The maximum is kept in raw score units (qk_scale > 0, as interface.check_scale requires, keeps the order), so
    # that each score's scale and shift are one fused multiply-add: a multiply per score fewer than scaling first.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_scaled = tl.where(m_new == -float("inf"), 0.0, m_new * qk_scale)  # rows that saw nothing yet: no inf - inf
    alpha = tl.math.exp2(m_i * qk_scale - m_scaled)
    p = tl.math.exp2(s * qk_scale - m_scaled[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        v_tile = v_desc.load([v_origin[0] + first_row, v_origin[1]])
    else:
        v_tile = _load_rows(v_head, k_start + k_pos, key_real, stride_vt, stride_vd, HEAD_DIM, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def s2_attention_fwd_kernel(
    q, k, v, out, lse,  # [B, Hq, Tq, D], [B, Hkv, Tk, D], [B, Hkv, Tk, D], [B, Hq, Tq, D], [B, Hq, Tq] float32
    k_desc, v_desc,  # TMA descriptors of k and v (_row_descriptors), None unless TMA
    unit_lists, unit_bits, unit_counts,  # int32 [P, num_q_tiles, L] kept key units and their keep bits (see
    # build_unit_lists); int32 [P, num_q_tiles, 2] (full, total)
    cu_seqlens_q, cu_seqlens_k,  # int32 [S + 1], read only when IS_VARLEN
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh, stride_lt,
    stride_up, stride_ut, stride_cp, stride_ct,
    seqlen_q, seqlen_k, qk_scale, q_heads_per_pattern, q_heads_per_kv,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, UNIT: tl.constexpr, CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    TMA: tl.constexpr, MASKED_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(num_q_tiles, Hq, B or S)``; program = one query tile of ``BLOCK_M`` absolute positions of one head.

    ``qk_scale = scale * log2(e)``. Batch strides are 0 when IS_VARLEN (B == 1; rows start at ``cu_seqlens``).
    ``TMA``: the unmasked steps load K and V through ``k_desc`` / ``v_desc``; ``MASKED_STAGES``: the pipelining
    depth of the masked (partial-entry) loop.
    """
    q_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        cu_seqlens_q, cu_seqlens_k, seq, seqlen_q, seqlen_k, IS_VARLEN
    )
    first_pos = seqlen_k - seqlen_q  # bottom-right alignment: absolute position of query row 0
    # Heaviest (latest) tiles first: they are scheduled first, which shortens the tail of the launch.
    tile = first_pos // BLOCK_M + tl.num_programs(0) - 1 - tl.program_id(0)
    if (seqlen_q == 0) | (tile * BLOCK_M >= seqlen_k):
        return
    pattern_head = q_head // q_heads_per_pattern
    kv_head = q_head // q_heads_per_kv

    q_pos = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] absolute positions
    row_real = (q_pos >= first_pos) & (q_pos < seqlen_k)
    rows = q_start + q_pos - first_pos
    q_head_base = q + seq.to(tl.int64) * stride_qb + q_head.to(tl.int64) * stride_qh
    q_tile = _load_rows(q_head_base, rows, row_real, stride_qt, stride_qd, HEAD_DIM, BLOCK_D)  # [BLOCK_M, BLOCK_D]
    k_head = k + seq.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_head = v + seq.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    list_base, bits_base, num_full, num_entries = _tile_list(
        unit_lists, unit_bits, unit_counts, pattern_head, tile, stride_up, stride_ut, stride_cp, stride_ct
    )
    block_in_tile = q_pos // BLOCK_SIZE - (tile * BLOCK_M) // BLOCK_SIZE  # [BLOCK_M] bit index of each row's block
    k_origin = _descriptor_origin(seq, kv_head, stride_kb, stride_kh, stride_kt, TMA)
    v_origin = _descriptor_origin(seq, kv_head, stride_vb, stride_vh, stride_vt, TMA)

    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    GROUP: tl.constexpr = BLOCK_N // UNIT
    for entry in range(0, num_full, GROUP):
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, q_tile, q_pos, block_in_tile, k_head, v_head, k_desc, v_desc, k_origin, v_origin,
            list_base, bits_base, entry, num_entries, k_start, seqlen_k, stride_kt, stride_kd, stride_vt, stride_vd,
            qk_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UNIT, CAUSAL, False, TMA, DOT_PRECISION,
        )
    for entry in tl.range(num_full, num_entries, GROUP, num_stages=MASKED_STAGES):  # see _gather_positions
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, q_tile, q_pos, block_in_tile, k_head, v_head, k_desc, v_desc, k_origin, v_origin,
            list_base, bits_base, entry, num_entries, k_start, seqlen_k, stride_kt, stride_kd, stride_vt, stride_vd,
            qk_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UNIT, CAUSAL, True, False, DOT_PRECISION,
        )

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out_head = out + seq.to(tl.int64) * stride_ob + q_head.to(tl.int64) * stride_oh
    out_tile = acc * (1.0 / l_safe)[:, None]  # a division a row, not an element
    _store_rows(out_head, out_tile, rows, row_real, stride_ot, stride_od, HEAD_DIM, BLOCK_D)
    lse_row = tl.where(seen, (m_i * qk_scale + tl.math.log2(l_safe)) / 1.4426950408889634, -float("inf"))  # ln
    lse_head = lse + seq.to(tl.int64) * stride_lb + q_head.to(tl.int64) * stride_lh
    tl.store(lse_head + rows.to(tl.int64) * stride_lt, lse_row, mask=row_real)


@triton.jit
def _softmax_stats(
    out, lse, dlse, do_tile, seq, q_head, rows, row_ok, stride_ob, stride_oh, stride_ot, stride_od, stride_lb,
    stride_lh, stride_lt, stride_eb, stride_eh, stride_et,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """The backward's per-row softmax statistics of ``rows`` (``do_tile``: their output gradient): ``lse`` in log2
    units (``+inf`` for rows that are not real or see no key, so that ``exp2(s - lse_log2) = 0`` there) and
    ``delta = rowsum(dO * O) - dlse`` (the lse gradient enters the softmax backward exactly like -delta)."""
    out_head = out + seq.to(tl.int64) * stride_ob + q_head.to(tl.int64) * stride_oh
    o_tile = _load_rows(out_head, rows, row_ok, stride_ot, stride_od, HEAD_DIM, BLOCK_D)
    delta_row = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)
    if HAS_DLSE:
        dlse_head = dlse + seq.to(tl.int64) * stride_eb + q_head.to(tl.int64) * stride_eh
        delta_row -= tl.load(dlse_head + rows.to(tl.int64) * stride_et, mask=row_ok, other=0.0)
    lse_head = lse + seq.to(tl.int64) * stride_lb + q_head.to(tl.int64) * stride_lh
    lse_row = tl.load(lse_head + rows.to(tl.int64) * stride_lt, mask=row_ok, other=-float("inf"))
    return tl.where(lse_row == -float("inf"), float("inf"), lse_row * 1.4426950408889634), delta_row


@triton.jit
def _load_softmax_stats(lse_head, delta_head, rows, row_ok):
    """Per query row, as ``_softmax_stats`` made them: lse in log2 units (``+inf`` for rows that are not real or
    see no key, so p = 0) and delta."""
    lse_row = tl.load(lse_head + rows, mask=row_ok, other=float("inf"))
    delta_row = tl.load(delta_head + rows, mask=row_ok, other=0.0)
    return lse_row, delta_row


@triton.jit
def _bwd_dq_step(
    dq, q_tile, do_tile, lse_row, delta_row, q_pos, block_in_tile, k_head, v_head, k_desc, v_desc, k_origin,
    v_origin, list_base, bits_base, entry, num_entries, k_start, seqlen_k, stride_kt, stride_kd, stride_vt,
    stride_vd, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UNIT: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate ``dS @ K`` (unscaled) of the query tile against a gathered tile of ``BLOCK_N`` keys (``TMA``: as in
    ``_fwd_step``)."""
    if TMA:
        first_row = k_start + tl.load(list_base + entry) * UNIT
        k_tile = k_desc.load([k_origin[0] + first_row, k_origin[1]])  # [BLOCK_N, BLOCK_D]
        v_tile = v_desc.load([v_origin[0] + first_row, v_origin[1]])
    else:
        k_pos, listed = _gather_positions(list_base, entry, num_entries, BLOCK_N, UNIT)
        key_real = listed & (k_pos < seqlen_k)
        # [BLOCK_N, BLOCK_D]
        k_tile = _load_rows(k_head, k_start + k_pos, key_real, stride_kt, stride_kd, HEAD_DIM, BLOCK_D)
        v_tile = _load_rows(v_head, k_start + k_pos, key_real, stride_vt, stride_vd, HEAD_DIM, BLOCK_D)
    s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    p = tl.math.exp2(s - lse_row[:, None])
    if MASKED:
        keep_bits = _entry_bits(bits_base, entry, num_entries, BLOCK_N, UNIT)
        valid = (q_pos[:, None] < seqlen_k) & key_real[None, :]
        visible = _visible(keep_bits[None, :], block_in_tile[:, None], q_pos[:, None], k_pos[None, :], valid, CAUSAL)
        p = tl.where(visible, p, 0.0)
    elif not CAUSAL:
        p = tl.where(key_real[None, :], p, 0.0)
    dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
    ds = p * (dp - delta_row[:, None])
    return dq + tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=DOT_PRECISION)


@triton.jit
def s2_attention_bwd_dq_kernel(
    q, k, v, out, dout, lse, dlse, dq,  # q/out/dout/dq [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], lse/dlse [B, Hq, Tq]
    # float32 (dlse read only when HAS_DLSE)
    lse_log2, delta,  # outputs for the dk/dv kernel: float32 [B, Hq, Tq] contiguous (_softmax_stats)
    k_desc, v_desc,  # as in s2_attention_fwd_kernel
    unit_lists, unit_bits, unit_counts, cu_seqlens_q, cu_seqlens_k,  # as in s2_attention_fwd_kernel
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_gb, stride_gh, stride_gt, stride_gd,  # dout
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh, stride_lt,
    stride_eb, stride_eh, stride_et,  # dlse
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_up, stride_ut, stride_cp, stride_ct,
    seqlen_q, seqlen_k, stride_sb, stride_sh, scale, qk_scale, q_heads_per_pattern, q_heads_per_kv,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, UNIT: tl.constexpr, CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    TMA: tl.constexpr, MASKED_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """Grid ``(num_q_tiles, Hq, B or S)``: dq of one query tile over its kept keys (same lists as the forward). Every
    real query row lies in exactly one program's tile, which also stores the row's softmax statistics for the dk/dv
    kernel, launched after this one."""
    q_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        cu_seqlens_q, cu_seqlens_k, seq, seqlen_q, seqlen_k, IS_VARLEN
    )
    first_pos = seqlen_k - seqlen_q
    tile = first_pos // BLOCK_M + tl.num_programs(0) - 1 - tl.program_id(0)
    if (seqlen_q == 0) | (tile * BLOCK_M >= seqlen_k):
        return
    pattern_head = q_head // q_heads_per_pattern
    kv_head = q_head // q_heads_per_kv

    q_pos = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_real = (q_pos >= first_pos) & (q_pos < seqlen_k)
    rows = q_start + q_pos - first_pos
    q_head_base = q + seq.to(tl.int64) * stride_qb + q_head.to(tl.int64) * stride_qh
    do_head_base = dout + seq.to(tl.int64) * stride_gb + q_head.to(tl.int64) * stride_gh
    q_tile = _load_rows(q_head_base, rows, row_real, stride_qt, stride_qd, HEAD_DIM, BLOCK_D)  # [BLOCK_M, BLOCK_D]
    do_tile = _load_rows(do_head_base, rows, row_real, stride_gt, stride_gd, HEAD_DIM, BLOCK_D)
    lse_row, delta_row = _softmax_stats(
        out, lse, dlse, do_tile, seq, q_head, rows, row_real, stride_ob, stride_oh, stride_ot, stride_od, stride_lb,
        stride_lh, stride_lt, stride_eb, stride_eh, stride_et, HEAD_DIM, BLOCK_D, HAS_DLSE,
    )
    stats_rows = seq.to(tl.int64) * stride_sb + q_head.to(tl.int64) * stride_sh + rows
    tl.store(lse_log2 + stats_rows, lse_row, mask=row_real)
    tl.store(delta + stats_rows, delta_row, mask=row_real)
    k_head = k + seq.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_head = v + seq.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    list_base, bits_base, num_full, num_entries = _tile_list(
        unit_lists, unit_bits, unit_counts, pattern_head, tile, stride_up, stride_ut, stride_cp, stride_ct
    )
    block_in_tile = q_pos // BLOCK_SIZE - (tile * BLOCK_M) // BLOCK_SIZE  # [BLOCK_M] bit index of each row's block
    k_origin = _descriptor_origin(seq, kv_head, stride_kb, stride_kh, stride_kt, TMA)
    v_origin = _descriptor_origin(seq, kv_head, stride_vb, stride_vh, stride_vt, TMA)

    dq_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    GROUP: tl.constexpr = BLOCK_N // UNIT
    for entry in range(0, num_full, GROUP):
        dq_acc = _bwd_dq_step(
            dq_acc, q_tile, do_tile, lse_row, delta_row, q_pos, block_in_tile, k_head, v_head, k_desc, v_desc,
            k_origin, v_origin, list_base, bits_base, entry, num_entries, k_start, seqlen_k, stride_kt, stride_kd,
            stride_vt, stride_vd, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UNIT, CAUSAL, False, TMA,
            DOT_PRECISION,
        )
    for entry in tl.range(num_full, num_entries, GROUP, num_stages=MASKED_STAGES):  # see _gather_positions
        dq_acc = _bwd_dq_step(
            dq_acc, q_tile, do_tile, lse_row, delta_row, q_pos, block_in_tile, k_head, v_head, k_desc, v_desc,
            k_origin, v_origin, list_base, bits_base, entry, num_entries, k_start, seqlen_k, stride_kt, stride_kd,
            stride_vt, stride_vd, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UNIT, CAUSAL, True, False,
            DOT_PRECISION,
        )
    dq_head = dq + seq.to(tl.int64) * stride_dqb + q_head.to(tl.int64) * stride_dqh
    _store_rows(dq_head, dq_acc * scale, rows, row_real, stride_dqt, stride_dqd, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_dkdv_step(
    dk, dv, k_tile, v_tile, k_pos, block_in_tile, key_real, q_head_base, do_head_base, lse_head, delta_head,
    q_desc, do_desc, q_origin, do_origin, list_base, bits_base, entry, num_entries, q_start, first_pos, seqlen_k,
    stride_qt, stride_qd, stride_gt, stride_gd, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    UNIT: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate dV and dK (unscaled) of the key tile against a gathered tile of ``BLOCK_M`` queries of one head.

    With ``TMA`` (unmasked causal steps whose query tile is one contiguous unit, queries and keys the same tokens) Q
    and dO come through ``q_desc`` / ``do_desc`` as K and V do in ``_fwd_step``. Such a step's rows are one run,
    all real except, in a sequence's last unit, those past its end (their statistics load as p = 0)."""
    if TMA:
        unit_start = tl.load(list_base + entry) * UNIT
        first_row = q_start + unit_start - first_pos
        q_tile = q_desc.load([q_origin[0] + first_row, q_origin[1]])  # [BLOCK_M, BLOCK_D]
        do_tile = do_desc.load([do_origin[0] + first_row, do_origin[1]])
        rows = first_row + tl.arange(0, BLOCK_M)
        lse_row, delta_row = _load_softmax_stats(
            lse_head, delta_head, rows, unit_start + tl.arange(0, BLOCK_M) < seqlen_k
        )
    else:
        q_pos, listed = _gather_positions(list_base, entry, num_entries, BLOCK_M, UNIT)
        row_real = listed & (q_pos >= first_pos) & (q_pos < seqlen_k)
        rows = q_start + q_pos - first_pos
        q_tile = _load_rows(q_head_base, rows, row_real, stride_qt, stride_qd, HEAD_DIM, BLOCK_D)  # [BLOCK_M, BLOCK_D]
        do_tile = _load_rows(do_head_base, rows, row_real, stride_gt, stride_gd, HEAD_DIM, BLOCK_D)
        lse_row, delta_row = _load_softmax_stats(lse_head, delta_head, rows, row_real)
    s_t = tl.dot(k_tile, tl.trans(q_tile), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    p_t = tl.math.exp2(s_t - lse_row[None, :])  # rows that are not real have lse = +inf: p = 0
    if MASKED:
        keep_bits = _entry_bits(bits_base, entry, num_entries, BLOCK_M, UNIT)
        valid = key_real[:, None] & row_real[None, :]
        visible = _visible(keep_bits[None, :], block_in_tile[:, None], q_pos[None, :], k_pos[:, None], valid, CAUSAL)
        p_t = tl.where(visible, p_t, 0.0)
    # (Keys past a short sequence need no mask here: their dk/dv rows are never stored.)
    dv += tl.dot(p_t.to(do_tile.dtype), do_tile, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v_tile, tl.trans(do_tile), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    ds_t = p_t * (dp_t - delta_row[None, :])
    dk += tl.dot(ds_t.to(q_tile.dtype), q_tile, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def s2_attention_bwd_dkdv_kernel(
    q, k, v, dout, lse_log2, delta, dk, dv,  # q/dout [B, Hq, Tq, D], k/v/dk/dv [B, Hkv, Tk, D], lse_log2/delta
    # [B, Hq, Tq] (stored by s2_attention_bwd_dq_kernel)
    q_desc, do_desc,  # TMA descriptors of q and dout (_row_descriptors), None unless TMA
    unit_lists, unit_bits, unit_counts,  # int32 [P, num_k_tiles, L] query units reading each key tile, their keep
    # bits; int32 [P, num_k_tiles, 2]
    cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_gb, stride_gh, stride_gt, stride_gd,  # dout
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    stride_up, stride_ut, stride_cp, stride_ct,
    seqlen_q, seqlen_k, stride_sb, stride_sh, scale, qk_scale, q_heads_per_pattern, q_heads_per_kv,
    stride_split,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, UNIT: tl.constexpr, CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    TMA: tl.constexpr, MASKED_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_SPLIT: tl.constexpr,
):
    """Grid ``(num_k_tiles, GROUP_SPLIT * Hkv, B or S)``: dK, dV of ``BLOCK_N`` keys of one KV head, reduced over its
    query group (or ``1 / GROUP_SPLIT`` of it) in registers, GQA without copies or atomics.

    With ``GROUP_SPLIT > 1`` the query heads of a group are shared out among that many programs, each storing its
    partial sums (float32) at ``dk/dv + split * stride_split`` for the launcher to add up: the longest lists (a
    group's G heads over an early vertical block, read by every later query) then no longer run end to end in one
    program. Key tiles stay the fastest grid dimension: neighbouring programs read the same heads' Q and dO from L2
    (launching every head's early tiles first instead, longest first, was 1.2x slower; in chunks of 4096 or 16384
    keys, 0.97-1.01x: bench/NOTES.md)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // GROUP_SPLIT
    split = tl.program_id(1) % GROUP_SPLIT
    seq = tl.program_id(2)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        cu_seqlens_q, cu_seqlens_k, seq, seqlen_q, seqlen_k, IS_VARLEN
    )
    if tile * BLOCK_N >= seqlen_k:
        return
    first_pos = seqlen_k - seqlen_q
    k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_real = k_pos < seqlen_k
    k_rows = k_start + k_pos
    block_in_tile = k_pos // BLOCK_SIZE - (tile * BLOCK_N) // BLOCK_SIZE  # [BLOCK_N] bit index of each key's block
    k_head = k + seq.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_head = v + seq.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    k_tile = _load_rows(k_head, k_rows, key_real, stride_kt, stride_kd, HEAD_DIM, BLOCK_D)  # [BLOCK_N, BLOCK_D]
    v_tile = _load_rows(v_head, k_rows, key_real, stride_vt, stride_vd, HEAD_DIM, BLOCK_D)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    GROUP: tl.constexpr = BLOCK_M // UNIT
    members_per_split = q_heads_per_kv // GROUP_SPLIT
    for group_member in range(split * members_per_split, (split + 1) * members_per_split):
        q_head = kv_head * q_heads_per_kv + group_member
        pattern_head = q_head // q_heads_per_pattern
        q_head_base = q + seq.to(tl.int64) * stride_qb + q_head.to(tl.int64) * stride_qh
        do_head_base = dout + seq.to(tl.int64) * stride_gb + q_head.to(tl.int64) * stride_gh
        stats_offset = seq.to(tl.int64) * stride_sb + q_head.to(tl.int64) * stride_sh
        lse_head = lse_log2 + stats_offset
        delta_head = delta + stats_offset
        list_base, bits_base, num_full, num_entries = _tile_list(
            unit_lists, unit_bits, unit_counts, pattern_head, tile, stride_up, stride_ut, stride_cp, stride_ct
        )
        q_origin = _descriptor_origin(seq, q_head, stride_qb, stride_qh, stride_qt, TMA)
        do_origin = _descriptor_origin(seq, q_head, stride_gb, stride_gh, stride_gt, TMA)
        for entry in range(0, num_full, GROUP):
            dk_acc, dv_acc = _bwd_dkdv_step(
                dk_acc, dv_acc, k_tile, v_tile, k_pos, block_in_tile, key_real, q_head_base, do_head_base, lse_head,
                delta_head, q_desc, do_desc, q_origin, do_origin, list_base, bits_base, entry, num_entries, q_start,
                first_pos, seqlen_k, stride_qt, stride_qd, stride_gt, stride_gd, qk_scale,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_M, UNIT, CAUSAL, False, TMA, DOT_PRECISION,
            )
        for entry in tl.range(num_full, num_entries, GROUP, num_stages=MASKED_STAGES):  # see _gather_positions
            dk_acc, dv_acc = _bwd_dkdv_step(
                dk_acc, dv_acc, k_tile, v_tile, k_pos, block_in_tile, key_real, q_head_base, do_head_base, lse_head,
                delta_head, q_desc, do_desc, q_origin, do_origin, list_base, bits_base, entry, num_entries, q_start,
                first_pos, seqlen_k, stride_qt, stride_qd, stride_gt, stride_gd, qk_scale,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_M, UNIT, CAUSAL, True, False, DOT_PRECISION,
            )
    dk_head = dk + split.to(tl.int64) * stride_split + seq.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
    dv_head = dv + split.to(tl.int64) * stride_split + seq.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh
    _store_rows(dk_head, dk_acc * scale, k_rows, key_real, stride_dkt, stride_dkd, HEAD_DIM, BLOCK_D)
    _store_rows(dv_head, dv_acc, k_rows, key_real, stride_dvt, stride_dvd, HEAD_DIM, BLOCK_D)


# ============================================================================================== block lists
# Least-recently-used block lists on the GPU: lengths are bucketed (interface.bucket_num_blocks), and each size needs
# lists for the forward, dq and dk/dv tiles (more while tuning).
_UNIT_LIST_CACHE: OrderedDict = OrderedDict()
_UNIT_LIST_CACHE_SIZE = 64


def build_unit_lists(
    block_mask: torch.Tensor, block_size: int, causal: bool, tile: int, unit: int, group: int, resident_is_query: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (pattern head, resident tile) the kept units of the other side, full ones first.

    Args:
        block_mask: bool ``[P, M, N]`` over absolute query blocks x key blocks.
        tile: positions per resident tile (queries when ``resident_is_query``, else keys).
        unit: positions per unit of the other side, ``min(block_size, its kernel tile)``.
        group: units gathered per kernel iteration, ``its kernel tile // unit``.

    Returns:
        ``units`` int32 ``[P, num_tiles, L]``: unit indices (unit ``u`` covers positions ``u*unit .. u*unit+unit-1``),
        entries ``[0, num_full)`` need no masking (ascending; descending in the dk/dv lists, where the resident
        side is keys), ``[num_full, num_total)`` are partial (ascending), the rest is padding;
        ``bits`` int32 ``[P, num_tiles, L]``: per entry, bit ``b`` set iff block ``b`` of the resident tile (counted
        from the tile's first block) keeps the unit, so the kernels mask partial entries without a block-mask gather;
        ``counts`` int32 ``[P, num_tiles, 2]`` = ``(num_full, num_total)``, with ``num_full`` rounded down to a
        multiple of ``group`` (the remainder is processed with the masked entries).
    """
    mask = block_mask if resident_is_query else block_mask.transpose(1, 2)  # [P, resident blocks, other blocks]
    num_heads, num_blocks, _ = mask.shape
    if tile >= block_size:  # a tile spans several blocks: union (kept by some) and intersection (kept by all)
        per_tile = tile // block_size
        num_tiles = -(-num_blocks // per_tile)
        pad = num_tiles * per_tile - num_blocks
        pad_shape = (num_heads, pad, mask.shape[2])
        per_block = torch.cat([mask, mask.new_zeros(pad_shape)], 1).reshape(num_heads, num_tiles, per_tile, -1)
        kept_some = per_block.any(2)
        # Padding blocks lie past every sequence (their rows are never real), so they must not veto "kept by all".
        kept_all = torch.cat([mask, mask.new_ones(pad_shape)], 1).reshape(num_heads, num_tiles, per_tile, -1).all(2)
        block_bits = 1 << torch.arange(per_tile, device=mask.device, dtype=torch.int32)[:, None]  # [per_tile, 1]
        keep_bits = (per_block.to(torch.int32) * block_bits).sum(2, dtype=torch.int32)
    else:  # a tile is a part of one block
        kept_some = kept_all = mask.repeat_interleave(block_size // tile, dim=1)
        keep_bits = kept_some.to(torch.int32)
    if unit < block_size:
        kept_some = kept_some.repeat_interleave(block_size // unit, dim=2)
        kept_all = kept_all.repeat_interleave(block_size // unit, dim=2)
        keep_bits = keep_bits.repeat_interleave(block_size // unit, dim=2)
    num_tiles, num_units = kept_some.shape[1:]
    device = mask.device

    tile_first = torch.arange(num_tiles, device=device)[:, None] * tile  # [num_tiles, 1]
    tile_last = tile_first + tile - 1
    unit_first = torch.arange(num_units, device=device)[None, :] * unit  # [1, num_units]
    unit_last = unit_first + unit - 1
    if not causal:
        some_visible = all_visible = torch.ones(num_tiles, num_units, dtype=torch.bool, device=device)
    elif resident_is_query:  # key unit vs query tile: key <= query
        some_visible, all_visible = unit_first <= tile_last, unit_last <= tile_first
    else:  # query unit vs key tile
        some_visible, all_visible = unit_last >= tile_first, unit_first >= tile_last
    kept = kept_some & some_visible
    full = kept_all & all_visible & kept

    # Sort key: full units first, then partial, then skipped ones; ascending unit index inside each class, except
    # for the dk/dv lists' full units, which run from the sequence's end backwards. A vertical key block is read by
    # every later query unit, and ascending walks start at each block's own position, so the blocks running at
    # the same time read Q and dO far apart; walked from the end, they read the same units together and hit in
    # L2 (dk/dv 1.07-1.10x faster at block 64, D=128, T >= 32768 on an H100; bench/NOTES.md).
    category = torch.where(full, 0, torch.where(kept, 1, 2)).to(torch.int32)
    unit_index = torch.arange(num_units, device=device, dtype=torch.int32).expand(num_tiles, num_units)
    if not resident_is_query:
        unit_index = torch.where(full, num_units - 1 - unit_index, unit_index)
    order_key = category * num_units + unit_index
    num_total = kept.sum(-1, dtype=torch.int32)
    width = max(1, int(num_total.max()))
    units = torch.empty(num_heads, num_tiles, width, dtype=torch.int32, device=device)
    bits = torch.empty(num_heads, num_tiles, width, dtype=torch.int32, device=device)
    heads_per_chunk = max(1, (1 << 26) // max(1, num_tiles * num_units))  # bounds the sort's temporary memory
    for h in range(0, num_heads, heads_per_chunk):
        chunk = slice(h, h + heads_per_chunk)
        units[chunk] = order_key[chunk].sort(-1).indices[..., :width]
        bits[chunk] = keep_bits[chunk].gather(-1, units[chunk].long())
    num_full = full.sum(-1, dtype=torch.int32)
    num_full -= num_full % group
    return units, bits, torch.stack([num_full, num_total], -1)


def split_first_step(
    units: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor, group: int, blocks_per_tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query-tile lists (``build_unit_lists``) for the warp-specialized forward, whose two consumers each own half of
    a tile's blocks and read every step of its list: where a tile has ``group // 2`` partial entries that only the
    first half's blocks keep and as many that only the second half's keep (block 2i's window start and block
    2i+1's diagonal, at blocks of 64), they form a *split step*, moved to the list's front, of which each consumer
    computes only its own half: the products computed go from 1.10x to 1.06x the kept pairs at 16 x 8192, block 64
    (1.06x -> 1.03x at 4 x 32768; bench/NOTES.md).

    Returns ``units``, ``bits`` reordered (the split step's ``group`` entries first, then the others in their
    order: full ones, then partial) and ``counts [P, T, 3]`` = ``(num_full, num_total, split)`` where ``split`` is 1
    for a tile that starts with a split step and the first two count the entries after it. A split is made only
    where entries remain after it.
    """
    num_full, num_total = counts[..., 0], counts[..., 1]
    half = group // 2
    if blocks_per_tile < 2 or half < 1:  # one block a tile, or one entry a step: no entry is one half's alone
        return units, bits, torch.cat([counts, torch.zeros_like(counts[..., :1])], -1)
    listed = torch.arange(units.shape[-1], device=units.device) < num_total[..., None]
    first_half_bits = (1 << (blocks_per_tile // 2)) - 1
    only_first = listed & ((bits & ~first_half_bits) == 0)
    only_second = listed & ((bits & first_half_bits) == 0)
    split = (only_first.sum(-1) >= half) & (only_second.sum(-1) >= half) & (num_total > group)  # [P, T]
    chosen_first = only_first & (only_first.cumsum(-1) <= half) & split[..., None]
    chosen_second = only_second & (only_second.cumsum(-1) <= half) & split[..., None]
    rank = torch.where(chosen_first, 0, torch.where(chosen_second, 1, torch.where(listed, 2, 3)))
    order = torch.sort(rank, dim=-1, stable=True).indices
    split = split.to(counts.dtype)
    return (units.gather(-1, order), bits.gather(-1, order),
            torch.stack([num_full, num_total - group * split, split], -1))


def _unit_lists(layout: BlockLayout, tile: int, other_tile: int, resident_is_query: bool, split_first: bool = False,
                first_query_block: int = 0):
    """``build_unit_lists`` for this layout and kernel tiles (through ``split_first_step`` where ``split_first``),
    cached when the layout has a ``cache_key``. Query blocks before ``first_query_block`` are left out: with Tq < Tk
    (bottom-right aligned queries) no query sits there, and the dk/dv lists would otherwise walk them, masked, for
    every key tile that a later query reads (at 4096 queries of 32768 keys: up to 8x a vertical stripe's real work,
    5-5.5x the lists' entries in all)."""
    unit = min(layout.block_size, other_tile)
    args = (layout.block_size, layout.causal, tile, unit, other_tile // unit, resident_is_query)

    def build():
        mask = layout.block_mask
        if first_query_block > 0:
            mask = mask.clone()
            mask[:, :first_query_block] = False
        lists = build_unit_lists(mask, *args)
        return split_first_step(*lists, other_tile // unit, tile // layout.block_size) if split_first else lists

    if layout.cache_key is None:
        return build()
    key = (layout.cache_key, *args, split_first, first_query_block)
    if key in _UNIT_LIST_CACHE:
        _UNIT_LIST_CACHE.move_to_end(key)
    else:
        _UNIT_LIST_CACHE[key] = build()
        if len(_UNIT_LIST_CACHE) > _UNIT_LIST_CACHE_SIZE:
            _UNIT_LIST_CACHE.popitem(last=False)  # least recently used
    return _UNIT_LIST_CACHE[key]


# ============================================================================================== configs
@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query positions per tile (resident in fwd/dq, gathered in dk/dv)
    block_n: int  # key positions per tile (gathered in fwd/dq, resident in dk/dv)
    num_warps: int
    num_stages: int  # software-pipelining depth
    # Hopper's warp-specialized Gluon kernel of this kind: the forward (hopper_fwd.py; block_m must be its BLOCK_M), dq
    # (hopper_bwd.py; the forward's BLOCK_M, DQ_BLOCK_N keys a step) or dk/dv (hopper_bwd.py; 64 x 64 tiles, two key
    # tiles a program). num_stages is then its ring of buffers.
    gluon: bool = False
    group_split: int = 1  # dk/dv: programs sharing a GQA group's query heads (s2_attention_bwd_dkdv_kernel)
    max_registers: int | None = None  # per-thread register cap (ptxas maxnreg), so that more programs fit an SM


# Used where nothing can be timed (TRITON_INTERPRET=1 / CPU tensors). Tests may swap in other tiles.
INTERPRETER_CONFIGS = {
    "fwd": TileConfig(64, 64, 4, 1),
    "dq": TileConfig(64, 64, 4, 1),
    "dkdv": TileConfig(64, 64, 4, 1),
}

# Software-pipelining depths (num_stages) the tuner tries for every tile. The loops are written to pipeline (scalar
# list reads, masked loops unpipelined: see _gather_positions). bench/pipelining_check.py on an H200 (2026-11-23):
# 2 and 3 stages give exactly depth 1's errors on every case (block 16-128, GQA, odd T), and the headline (block 64,
# T=131072) runs 35.1 -> 29.6 ms forward and 134.7 -> 114.8 ms forward+backward at 2 stages; 3 stages adds
# nothing (29.9 / 117.4 ms) and costs shared memory, so it is not tried.
_PIPELINE_DEPTHS = (2, 1)
# Masked (partial-entry) loops pipeline at 2 stages (their keep bits are scalar loads, like the list entries), and
# unmasked steps whose gathered tile is one contiguous unit load it through TMA descriptors (_use_tma).
# bench/kernel_variants.py on an H100 (2026-11-24, forced tiles, bench/results/kernel_variants_*.json): errors equal
# to the pointer / unpipelined variant's on every case; forward 128x64 tile 29.2 -> 26.4 ms at T=131072 (TMA) and
# forward+backward 1.03-1.14x faster (GQA D=64: 21.4 -> 18.7 ms; block 128: 33.6 -> 31.9 ms).
_MASKED_LOOP_STAGES = 2
_USE_TMA = True


def _configs(*tiles: tuple[int, int, int]) -> list[TileConfig]:
    """``(block_m, block_n, num_warps)`` triples at every depth of ``_PIPELINE_DEPTHS``, deepest first."""
    return [TileConfig(*tile, stages) for stages in _PIPELINE_DEPTHS for tile in tiles]


# GPU candidates per kernel and head-dim class (small: D <= 64, medium: D <= 128, large: D <= 256).
# The GPU tests (tests/test_kernels_triton.py -m gpu) check every candidate against the reference.
# The warp-specialized forward (hopper_fwd.py) per head-dim class: 128-key steps, a V ring of 3 slots at D = 128 (its
# K ring has 2; num_stages counts V's: what shared memory holds) and of 6 at D = 64, whose slack lets the second
# consumer run 4 ring steps behind the first. On an H200, 128-key steps with 3 joint K/V slots were 1.05-1.14x faster
# than 64-key steps at every shape of issue 9; with 2 joint slots they took 1.08-1.24x the time; on an H100 the
# 6-slot ring with the lag 1.04-1.045x the 3-slot one at both D = 64 shapes (bench/NOTES.md).
# Where hopper_fwd.supported; last in each list, so that S2_ATTENTION_AUTOTUNE=0 keeps the Triton forward.
_WARP_SPECIALIZED_FWD = {
    "small": [TileConfig(hopper_fwd.BLOCK_M, 128, 4, 6, gluon=True)],
    "medium": [TileConfig(hopper_fwd.BLOCK_M, 128, 4, 3, gluon=True)],
}
# dk/dv with a GQA group's query heads shared out among 2 or 4 programs (s2_attention_bwd_dkdv_kernel), where the group
# size allows: shortens the longest lists, those of early vertical blocks, at the cost of float32 partial sums.
_GROUP_SPLIT_DKDV = [TileConfig(64, 64, 4, 2, group_split=split) for split in (2, 4)]
# The warp-specialized Gluon dk/dv (hopper_bwd.py), where hopper_bwd.supported_dkdv; a ring of 2 Q/dO slots per consumer
# (3 were no faster at D = 64 and do not fit D = 128's shared memory). H100, 2026-11-26: the backward 1.01-1.17x
# faster than with the Triton 64 x 64 dk/dv tile at every shape of issue 9 with blocks >= 64 (bench/NOTES.md).
_GLUON_DKDV = [TileConfig(64, 64, 4, 2, gluon=True)]
# The warp-specialized Gluon dq (hopper_bwd.py), where hopper_bwd.supported_dq: the forward's work items (128-row query
# tiles), 64-key steps, a ring of 3 K/V slots. H100, 2026-11-26 (kernel times in the backward, five alternated
# rounds): 1.16-1.50x the tuner's best Triton dq at D = 128 (the backward 1.06-1.12x), a tie at D = 64 and slower
# with D = 64 GQA (which keeps the Triton tile); 2 slots were never faster (bench/NOTES.md).
_GLUON_DQ = [TileConfig(hopper_fwd.BLOCK_M, hopper_bwd.DQ_BLOCK_N, 4, 3, gluon=True)]
# At D <= 64 the 4-warp forward and dq tiles need ~135 registers a thread, so 3 programs share an SM; capped at 128
# (a few spills) 4 do, which hides more of each program's latency (softmax, loads) behind the others'. Likewise the
# dk/dv tile: ~230-250 registers, 2 programs per SM; capped at 168 (~200 bytes of spills), 3. H100, 2026-11-25
# (bench/NOTES.md, tuner timings at four D=64 shapes): the capped forward 1.04-1.13x at all four, dq 1.03-1.14x at
# three, dk/dv 1.05x at two and slower at the others: candidates, not rules.
_REGISTER_CAPPED_SMALL = [TileConfig(64, 64, 4, 2, max_registers=128)]
_REGISTER_CAPPED_DKDV_SMALL = [TileConfig(64, 64, 4, 2, group_split=split, max_registers=168) for split in (1, 4)]
_CANDIDATES = {
    ("fwd", "small"): (
        _configs((128, 64, 4), (128, 128, 8), (64, 64, 4)) + _REGISTER_CAPPED_SMALL + _WARP_SPECIALIZED_FWD["small"]
    ),
    ("fwd", "medium"): (
        _configs((128, 64, 8), (128, 64, 4), (128, 128, 8), (64, 64, 4)) + _WARP_SPECIALIZED_FWD["medium"]
    ),
    ("fwd", "large"): _configs((64, 64, 4), (128, 64, 8), (64, 32, 4), (128, 32, 8)),
    ("dq", "small"): _configs((128, 64, 8), (64, 64, 4), (128, 128, 8)) + _REGISTER_CAPPED_SMALL + _GLUON_DQ,
    ("dq", "medium"): _configs((128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4)) + _GLUON_DQ,
    ("dq", "large"): _configs((64, 32, 4), (64, 64, 8), (32, 64, 4)),
    ("dkdv", "small"): (
        _configs((64, 128, 8), (64, 64, 4), (32, 128, 4)) + _GROUP_SPLIT_DKDV + _REGISTER_CAPPED_DKDV_SMALL
        + _GLUON_DKDV
    ),
    ("dkdv", "medium"): (
        _configs((64, 128, 8), (32, 128, 8), (64, 64, 4), (32, 64, 4)) + _GROUP_SPLIT_DKDV + _GLUON_DKDV
    ),
    ("dkdv", "large"): _configs((32, 64, 4), (16, 64, 4), (32, 32, 4), (64, 64, 8)),
}

_TUNED_CONFIGS: dict = {}  # (kernel, *shape key) -> winning TileConfig
TUNING_TIMINGS: dict = {}  # (kernel, *shape key) -> {TileConfig: median ms}, for bench/NOTES.md


def _interpreting(device: torch.device) -> bool:
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _pick_config(kind: str, key: tuple, head_dim: int, device: torch.device, launch, usable=None) -> TileConfig:
    """The fastest candidate for ``key`` (timed once with ``do_bench``, then cached); fixed under the interpreter.

    ``launch(config)`` must run the kernel with that config (outputs are overwritten by the final launch);
    ``usable(config)``, where given, drops the candidates this call cannot run (the key must tell such calls apart).
    ``S2_ATTENTION_AUTOTUNE=0`` skips the timing and takes the first usable candidate (fast start-up, e.g. in tests).
    """
    if _interpreting(device):
        return INTERPRETER_CONFIGS[kind]
    full_key = (kind, *key)
    autotune = os.environ.get("S2_ATTENTION_AUTOTUNE", "1") != "0"
    if autotune and full_key in _TUNED_CONFIGS:  # every call after the first of a shape: nothing else to do
        return _TUNED_CONFIGS[full_key]
    size = "small" if head_dim <= 64 else "medium" if head_dim <= 128 else "large"
    candidates = [c for c in _CANDIDATES[(kind, size)] if usable is None or usable(c)]
    if not autotune and candidates:
        return candidates[0]
    timings = {}
    for config in candidates:
        try:
            timings[config] = triton.testing.do_bench(
                lambda c=config: launch(c), warmup=5, rep=30, return_mode="median"
            )
        except triton.runtime.errors.OutOfResources:  # e.g. too much shared memory for this head dim
            continue
    if not timings:
        raise RuntimeError(f"no {kind} tile config fits head_dim={head_dim} on this GPU")
    TUNING_TIMINGS[full_key] = timings
    _TUNED_CONFIGS[full_key] = min(timings, key=timings.get)
    return _TUNED_CONFIGS[full_key]


# ============================================================================================== launchers
@dataclass(frozen=True)
class _Problem:
    """Sizes and sequence bookkeeping shared by the launchers."""

    num_seqs: int  # grid z: batch rows, or packed sequences when varlen
    max_seqlen_q: int
    max_seqlen_k: int
    is_varlen: bool
    cu_seqlens_q: torch.Tensor  # int32 [S + 1] (a dummy when not varlen: the kernels do not read it)
    cu_seqlens_k: torch.Tensor
    tune_key: tuple

    def strides(self, t: torch.Tensor) -> tuple[int, ...]:
        """Strides with the batch stride zeroed in varlen mode (B == 1, the grid's z indexes sequences)."""
        return (0 if self.is_varlen else t.stride(0), *t.stride()[1:])

    def num_q_tiles(self, block_m: int) -> int:
        if self.is_varlen:  # one extra tile when a sequence's first query is not tile-aligned
            return -(-self.max_seqlen_q // block_m) + 1
        first_tile = (self.max_seqlen_k - self.max_seqlen_q) // block_m
        return (self.max_seqlen_k - 1) // block_m - first_tile + 1


def _problem(q: torch.Tensor, k: torch.Tensor, layout: BlockLayout, varlen: Varlen | None) -> _Problem:
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    if varlen is not None:
        num_seqs, max_q, max_k = varlen.num_seqs, varlen.max_seqlen_q, varlen.max_seqlen_k
        cu_q, cu_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
    else:
        num_seqs, max_q, max_k = batch, seqlen_q, k.shape[2]
        cu_q = cu_k = _unused_offsets(q.device)
    # Lengths are bucketed to powers of two so that varying batches reuse one tuned config.
    tune_key = (
        batch, num_q_heads, k.shape[1], layout.num_pattern_heads, next_power_of_2(max_q), next_power_of_2(max_k),
        head_dim, q.dtype, layout.block_size, layout.causal,
        varlen is not None, str(q.device),
    )
    return _Problem(num_seqs, max_q, max_k, varlen is not None, cu_q, cu_k, tune_key)


@functools.cache
def _unused_offsets(device: torch.device) -> torch.Tensor:
    """The offsets arguments of a call that is not varlen (the kernels do not read them): one tensor per device, not
    an allocation and a fill kernel every call."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Hopper and later GPUs have the tensor memory accelerator; the interpreter emulates it."""
    return device.type != "cuda" or _interpreting(device) or torch.cuda.get_device_capability(device)[0] >= 9


def _use_tma(layout: BlockLayout, gathered_tile: int, head_dim: int, device: torch.device) -> bool:
    """Whether the unmasked steps load their gathered tiles through TMA descriptors: when such a tile is one
    contiguous unit of rows (``block_size >= gathered_tile``), causal (so every row of an unmasked step is real, and
    a box never needs a mask), ``D`` a power of two (a box is exactly one head's row) and the GPU has TMA."""
    return (_USE_TMA and layout.causal and layout.block_size >= gathered_tile
            and head_dim == next_power_of_2(head_dim) and _has_tma(device))


def _row_descriptors(use_tma: bool, block_rows: int, tensors: tuple, row_views: tuple) -> tuple:
    """TMA descriptors of ``tensors`` over their ``row_views`` (``layouts.row_view``'s), boxes of ``[block_rows, D]``,
    when ``use_tma`` and every tensor has a view; else Nones."""
    if not use_tma or None in row_views:
        return (None,) * len(tensors)
    return tuple(TensorDescriptor(t, *view, [block_rows, t.shape[-1]]) for t, view in zip(tensors, row_views))


def _common_constexprs(q: torch.Tensor, layout: BlockLayout, problem: _Problem) -> dict:
    head_dim = q.shape[-1]
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),  # D = 80, 96, ... are padded to a power of two and masked
        BLOCK_SIZE=layout.block_size,
        CAUSAL=layout.causal,
        IS_VARLEN=problem.is_varlen,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # "tf32" is ignored for 16-bit inputs
    )


def s2_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float, varlen: Varlen | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher.

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hkv, Tk, D]`` (any strides); ``Hq % Hkv == 0``, ``Hq % P == 0``.
    Returns:
        ``out [B, Hq, Tq, D]`` in q's dtype and ``lse [B, Hq, Tq]`` float32 (natural log, ``-inf`` for empty rows).
    """
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    out = empty_heads_last(q)  # [B, Hq, Tq, D], stored [B, Tq, Hq, D] (interface.py's output layout)
    lse = torch.empty(batch, num_q_heads, seqlen_q, dtype=torch.float32, device=q.device)  # [B, Hq, Tq]
    if q.numel() == 0:
        return out, lse.fill_(-math.inf)
    problem = _problem(q, k, layout, varlen)
    row_views = tuple(row_view(t) for t in (q, k, v))
    warp_specialized_ok = hopper_fwd.supported(q, k, layout.causal, layout.block_size) and None not in row_views

    def usable(config: TileConfig) -> bool:
        return not config.gluon or warp_specialized_ok

    def launch(config: TileConfig):
        units, bits, counts = _unit_lists(layout, config.block_m, config.block_n, resident_is_query=True,
                                          split_first=config.gluon)
        if config.gluon:
            hopper_fwd.launch(q, k, v, out, lse, row_views, (units, bits, counts), problem, scale * LOG2E,
                              layout.block_size, config.block_n, layout.num_pattern_heads, config.num_stages)
            return
        grid = (problem.num_q_tiles(config.block_m), num_q_heads, problem.num_seqs)
        k_desc, v_desc = _row_descriptors(_use_tma(layout, config.block_n, head_dim, q.device), config.block_n,
                                          (k, v), row_views[1:])
        s2_attention_fwd_kernel[grid](
            q, k, v, out, lse, k_desc, v_desc, units, bits, counts, problem.cu_seqlens_q, problem.cu_seqlens_k,
            *problem.strides(q), *problem.strides(k), *problem.strides(v), *problem.strides(out),
            *problem.strides(lse), *units.stride()[:2], *counts.stride()[:2],
            seqlen_q, k.shape[2], scale * LOG2E, num_q_heads // layout.num_pattern_heads, num_q_heads // k.shape[1],
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, UNIT=min(layout.block_size, config.block_n),
            TMA=k_desc is not None, MASKED_STAGES=_MASKED_LOOP_STAGES, num_warps=config.num_warps,
            num_stages=config.num_stages, maxnreg=config.max_registers, **_common_constexprs(q, layout, problem),
        )

    launch(_pick_config("fwd", (*problem.tune_key, warp_specialized_ok), head_dim, q.device, launch, usable))
    return out, lse


def s2_attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, dlse: torch.Tensor | None, layout: BlockLayout, scale: float, varlen: Varlen | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: ``dq [B, Hq, Tq, D]``, ``dk``/``dv [B, Hkv, Tk, D]`` in the inputs' dtype.

    ``dout`` is ``[B, Hq, Tq, D]`` (any strides), ``dlse`` ``[B, Hq, Tq]`` or None (lse unused).
    """
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    num_kv_heads = k.shape[1]
    dq, dk, dv = empty_heads_last(q), empty_heads_last(k), empty_heads_last(v)  # interface.py's output layout
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    problem = _problem(q, k, layout, varlen)
    constexprs = _common_constexprs(q, layout, problem)

    # [B, Hq, Tq] float32 each: the rows' lse in log2 units and delta, stored by the dq kernel for the dk/dv kernel
    lse_log2, delta = (torch.empty(batch, num_q_heads, seqlen_q, dtype=torch.float32, device=q.device) for _ in "ld")
    stats_strides = (0 if problem.is_varlen else delta.stride(0), delta.stride(1))
    shared_args = (
        *problem.strides(q), *problem.strides(k), *problem.strides(v), *problem.strides(dout),
    )
    tail_args = (seqlen_q, k.shape[2], *stats_strides, scale, scale * LOG2E,
                 num_q_heads // layout.num_pattern_heads, num_q_heads // num_kv_heads)

    q_view, dout_view, out_view, k_view, v_view = (row_view(t) for t in (q, dout, out, k, v))
    dq_row_views = (q_view, dout_view, out_view, k_view, v_view)
    gluon_dq_ok = hopper_bwd.supported_dq(q, k, layout.causal, layout.block_size) and None not in dq_row_views

    def usable_dq(config: TileConfig) -> bool:
        return not config.gluon or gluon_dq_ok

    def launch_dq(config: TileConfig):
        units, bits, counts = _unit_lists(layout, config.block_m, config.block_n, resident_is_query=True)
        if config.gluon:
            hopper_bwd.launch_dq(q, k, v, out, dout, lse, dlse, dq, lse_log2, delta, dq_row_views,
                                 (units, bits, counts), problem, scale, scale * LOG2E, layout.block_size,
                                 layout.num_pattern_heads, config.num_stages)
            return
        grid = (problem.num_q_tiles(config.block_m), num_q_heads, problem.num_seqs)
        k_desc, v_desc = _row_descriptors(_use_tma(layout, config.block_n, head_dim, q.device), config.block_n,
                                          (k, v), (k_view, v_view))
        s2_attention_bwd_dq_kernel[grid](
            q, k, v, out, dout, lse, dlse, dq, lse_log2, delta, k_desc, v_desc, units, bits, counts,
            problem.cu_seqlens_q, problem.cu_seqlens_k,
            *shared_args, *problem.strides(out), *problem.strides(lse), *problem.strides(lse if dlse is None else dlse),
            *problem.strides(dq), *units.stride()[:2], *counts.stride()[:2], *tail_args,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, UNIT=min(layout.block_size, config.block_n),
            TMA=k_desc is not None, MASKED_STAGES=_MASKED_LOOP_STAGES, num_warps=config.num_warps,
            num_stages=config.num_stages, maxnreg=config.max_registers, HAS_DLSE=dlse is not None, **constexprs,
        )

    # TMA boxes are not masked: only where queries and keys are the same tokens (training), so that no full query
    # unit starts before a sequence's first query. Rows past a sequence's end (in its last unit) read the next rows
    # of the tensor, or zeros past it, and their lse (+inf) gives them p = 0.
    same_tokens = varlen.equal_lengths if varlen is not None else seqlen_q == k.shape[2]

    # Queries start at block (Tk - Tq) // block_size of every row (packed sequences each have their own start).
    first_query_block = 0 if problem.is_varlen else (problem.max_seqlen_k - problem.max_seqlen_q) // layout.block_size
    dkdv_row_views = (q_view, dout_view, k_view, v_view)
    gluon_dkdv_ok = (hopper_bwd.supported_dkdv(q, k, layout.causal, layout.block_size, same_tokens)
                     and None not in dkdv_row_views)

    def usable_dkdv(config: TileConfig) -> bool:  # (the group size is part of the tune key)
        return (num_q_heads // num_kv_heads) % config.group_split == 0 and (not config.gluon or gluon_dkdv_ok)

    def launch_dkdv(config: TileConfig):
        units, bits, counts = _unit_lists(layout, config.block_n, config.block_m, resident_is_query=False,
                                          first_query_block=first_query_block)
        if config.gluon:
            hopper_bwd.launch_dkdv(q, dout, k, v, lse_log2, delta, dk, dv, dkdv_row_views, (units, bits, counts),
                                   problem, scale, scale * LOG2E, layout.block_size, layout.num_pattern_heads,
                                   config.num_stages)
            return
        split = config.group_split
        dk_out, dv_out = dk[None], dv[None]  # [split, *k.shape]: float32 partial sums when split, added up below
        if split > 1:
            dk_out, dv_out = (torch.empty(split, *k.shape, dtype=torch.float32, device=k.device) for _ in "kv")
        grid = (triton.cdiv(problem.max_seqlen_k, config.block_n), split * num_kv_heads, problem.num_seqs)
        q_desc, do_desc = _row_descriptors(
            same_tokens and _use_tma(layout, config.block_m, head_dim, q.device), config.block_m, (q, dout),
            (q_view, dout_view),
        )
        s2_attention_bwd_dkdv_kernel[grid](
            q, k, v, dout, lse_log2, delta, dk_out, dv_out, q_desc, do_desc, units, bits, counts,
            problem.cu_seqlens_q, problem.cu_seqlens_k,
            *shared_args, *problem.strides(dk_out[0]), *problem.strides(dv_out[0]),
            *units.stride()[:2], *counts.stride()[:2], *tail_args, dk_out.stride(0),  # dv_out's is the same
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, UNIT=min(layout.block_size, config.block_m),
            TMA=q_desc is not None, MASKED_STAGES=_MASKED_LOOP_STAGES, num_warps=config.num_warps,
            num_stages=config.num_stages, maxnreg=config.max_registers, GROUP_SPLIT=split, **constexprs,
        )
        if split > 1:
            dk.copy_(dk_out.sum(0))
            dv.copy_(dv_out.sum(0))

    launch_dq(_pick_config("dq", (*problem.tune_key, gluon_dq_ok), head_dim, q.device, launch_dq, usable_dq))
    launch_dkdv(_pick_config("dkdv", (*problem.tune_key, gluon_dkdv_ok), head_dim, q.device, launch_dkdv,
                             usable_dkdv))
    return dq, dk, dv
