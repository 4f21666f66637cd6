"""Triton decode / chunked-prefill S2 attention over the compact cache of ``decode.py`` (flash-decoding style).

Entry point ``decode_attention_triton(q, k_cache, v_cache, seq_lens, layout, num_ring, scale, num_splits)``.

* One program = one (batch row, KV head, tile of query rows, KV split). Its query rows are the KV head's whole
  query group times the ``Tq`` new tokens (row ``r`` = token ``r // G``, head ``r % G``), so each kept KV block
  is read once per query group (GQA without copies).
* Split-KV: the slots a row fills (found in-kernel from its length, so slots allocated ahead, as in a static
  cache, cost nothing) are cut into ``num_splits`` contiguous ranges of whole key tiles; each program writes its
  normalized partial output and log-sum-exp, counts itself done on an int32 counter of its (row, KV head, row
  tile), and the program that finishes last merges the splits and zeroes the counter again (no second launch: a
  one-token step has ~25 us of work per sparse layer, and a combine launch cost ~3 us of it). With one split the
  program writes the output directly. The grid depends only on shapes, so a CUDA graph can replay it.
* The slot -> block map is inlined (``_slot_blocks``, the same rule as ``decode.slot_blocks``): no block table.
  Its inputs, the KV head's rows of the layout's residue tables (``vert_stride`` entries each), are loaded once per
  program, beside the row length: the key loop loads nothing from global memory but K and V, so Triton's pipeliner
  issues their copies ``num_stages - 1`` tiles ahead at every launch shape (table loads inside the loop had left it
  one tile ahead, single-buffered, at most shapes). Up to 16 residues the rows are packed into the bits of two
  integers and looked up with shifts; wider rows are looked up with ``tl.gather``, which Triton lowers through
  shared memory, with barriers in every tile.
* One-token steps (and chunks of up to 8 query rows) run an 8-row tile with the products turned around: keys on
  their M axis (S^T = K Q^T, O^T = V^T P^T) and the query rows on N, so that a 4-head group does not compute 12
  padding rows of every 16 (``tl.dot``'s M is 16, its N may be 8). Each warp takes two groups of keys of every key
  tile (16 keys each at the default 128-key tile), each group with its own softmax state, merged once after the
  loop: no reduction crosses warps inside it, and each warp (one a scheduler at the default 4 warps) runs two
  independent chains, so that one's latencies overlap the other's. With the bit tables a tile has 2 barriers.
  (H100: 1.4-8% faster than one group a warp in the usual orientation at every launch measured; bench/NOTES.md.)
* Longer chunks keep the products' usual orientation: up to 32 rows in 16-row tiles whose warps each take their
  own keys (one group a warp), beyond that 64-row tiles whose warps share every key (as many accumulators of
  [64, D] as groups would spill).
* On Hopper and later GPUs the kernel (and the cache append before it) launches with programmatic dependent launch
  (``dependent_launch.py``): its programs load the layout's slot tables while the previous kernel finishes, then
  wait for it before reading anything else (the append lets it launch right after the append's own wait). A launch
  whose programs fit one to an SM reserves more than half an SM's shared memory, so that a kernel launched with PDL
  behind it cannot make the hardware place two of them on one SM (see ``decode_attention_triton``).
* A few compiled variants serve every chunk length and cache size: tile heights do not follow ``Tq`` (8, 16 or 64
  query rows), and the arguments that change from call to call (``Tq``, slot and split counts, strides that depend
  on ``Tq``) are not specialised on. Triton would otherwise compile a new variant whenever one of them became 1 or a
  multiple of 16 or a tile height changed: a JIT compile (~1 s on a GPU) in the middle of speculative decoding,
  whose verify chunks change length every forward.

Numerics: online softmax in base 2, fp32 accumulation, IEEE fp32 dots for fp32 inputs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from .dependent_launch import launch_options, wait_for_preceding_kernel
from .layouts import CompactLayout
from .triton_impl import row_mask
from .triton_setup import launch_within_shared_memory, next_power_of_2, reserve_shared_memory, tl, triton

LOG2E = math.log2(math.e)


@triton.jit
def _slot_blocks(slot, last, residue_row, rank_row, vertical_bits, packed_residues, num_vertical, num_ring,
                 RING_BLOCKS: tl.constexpr, VERT_STRIDE: tl.constexpr, TABLE_WIDTH: tl.constexpr):
    """Block held by each ``slot`` (``-1`` if empty) for a row whose newest block is ``last``. ``residue_row`` /
    ``rank_row``: the KV head's rows of the layout's tables, loaded before the key loop (no global loads in it, so
    the pipeliner can issue the K/V copies ``num_stages - 1`` tiles ahead). Up to 16 residues the same tables come as
    the bits of two integers (``vertical_bits``: bit r set if residue r is vertical; ``packed_residues``: the i-th
    residue in bits 4i..4i+3), looked up with shifts: a ``tl.gather`` goes through shared memory, with barriers."""
    ring_block = slot + ((last - slot) // RING_BLOCKS) * RING_BLOCKS  # used only where slot <= last (no negatives)
    v = tl.maximum(slot - num_ring, 0)
    if TABLE_WIDTH <= 16:
        ring_vertical = (vertical_bits >> (tl.maximum(ring_block, 0) % VERT_STRIDE).to(tl.int64)) & 1
        residue = ((packed_residues >> ((v % tl.maximum(num_vertical, 1)) * 4).to(tl.int64)) & 15).to(tl.int32)
    else:
        ring_vertical = tl.gather(rank_row, tl.maximum(ring_block, 0) % VERT_STRIDE, 0) >= 0
        residue = tl.gather(residue_row, v % tl.maximum(num_vertical, 1), 0)
    ring_ok = (slot < num_ring) & (slot <= last) & (ring_vertical == 0)
    vertical_block = (v // num_vertical) * VERT_STRIDE + residue
    vertical_ok = (slot >= num_ring) & (vertical_block <= last)
    block = tl.where(slot < num_ring, ring_block, vertical_block)
    return tl.where(ring_ok | vertical_ok, block, -1)


@triton.jit
def _grouped_keys(start, end, seq_len, last, residue_row, rank_row, vertical_bits, packed_residues, num_vertical,
                  num_ring, RING_BLOCKS: tl.constexpr, VERT_STRIDE: tl.constexpr, TABLE_WIDTH: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KEY_GROUPS: tl.constexpr):
    """The key tile at cache row ``start`` cut into ``KEY_GROUPS`` groups of consecutive keys, each
    ``[KEY_GROUPS, BLOCK_N // KEY_GROUPS]``: their cache rows, blocks (``_slot_blocks``), positions, and whether each is
    a real key of this split."""
    KEYS: tl.constexpr = BLOCK_N // KEY_GROUPS
    block = _slot_blocks((start + tl.arange(0, BLOCK_N)) // BLOCK_SIZE, last, residue_row, rank_row, vertical_bits,
                         packed_residues, num_vertical, num_ring, RING_BLOCKS, VERT_STRIDE, TABLE_WIDTH)
    block = tl.reshape(block, [KEY_GROUPS, KEYS])
    key_rows = start + tl.arange(0, KEY_GROUPS)[:, None] * KEYS + tl.arange(0, KEYS)[None, :]
    k_pos = block * BLOCK_SIZE + key_rows % BLOCK_SIZE
    return key_rows, block, k_pos, (key_rows < end) & (block >= 0) & (k_pos < seq_len)


@triton.jit
def _visible(q_block, q_pos, dense_row, vertical_residue, row_real, block, k_pos, key_ok,
             LOCAL_BLOCKS: tl.constexpr, VERT_STRIDE: tl.constexpr):
    """Which (query row, key) pairs the pattern keeps and causality allows. The row-side arguments come expanded over
    the key axis and the key-side ones over the row axis, so one rule serves [M, N] and [G, M, N] tiles. Key block
    ``j`` is vertical for a row when ``j % VERT_STRIDE == vertical_residue``: one remainder per key, not per pair."""
    kept = (q_block - block < LOCAL_BLOCKS) | dense_row | (block % VERT_STRIDE == vertical_residue)
    return kept & key_ok & row_real & (k_pos <= q_pos)


@triton.jit
def _online_softmax_step(s, visible, v_ptrs, v_mask, m_i, l_i, acc, KEY_AXIS: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax (base 2; ``s`` already scaled by log2(e) / sqrt(D)) over ``KEY_AXIS``. V is
    loaded here, after P: its pipelined copy is waited for only where the product needs it (waiting before the
    softmax cost ~5% at one-token steps, bench/NOTES.md)."""
    s = tl.where(visible, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, KEY_AXIS))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows that saw nothing yet: avoid inf - inf
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - tl.expand_dims(m_safe, KEY_AXIS))
    l_i = l_i * alpha + tl.sum(p, KEY_AXIS)
    v_tile = tl.load(v_ptrs, mask=v_mask, other=0.0)
    acc = acc * tl.expand_dims(alpha, KEY_AXIS) + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_key_groups(m_groups, l_groups, acc_groups):
    """The key groups' softmax states merged once, after the key loop: [KEY_GROUPS, BLOCK_M(, BLOCK_D)] ->
    [BLOCK_M(, BLOCK_D)]."""
    m_i = tl.max(m_groups, 0)
    weight = tl.math.exp2(m_groups - tl.where(m_i == -float("inf"), 0.0, m_i)[None, :])  # 0: the group saw nothing
    return m_i, tl.sum(l_groups * weight, 0), tl.sum(acc_groups * weight[:, :, None], 0)


# Tile heights independent of the chunk length (see the module docstring): query rows of a decode program, and new
# tokens per program of the append kernel. A one-token step's query group (up to 8 heads) fits the 8-row tile with
# keys on the products' M axis; chunks of up to 32 rows take one or two 16-row tiles (a 6-token verify chunk of
# 4-head groups reads the keys twice, the second time likely from L2, and still beats one large tile: H100, 8 x 32k,
# 26.4 against 31.2 us; turned around, its 16-row tiles took 31-35 us); longer chunks take the large tile.
KEYS_ON_M_ROWS, SMALL_ROW_TILE, LARGE_ROW_TILE = 8, 16, 64
MAX_SPLITS = 8  # see _choose_num_splits
TOKENS_PER_PROGRAM = 16
# Arguments that change between calls of one layer, which Triton must not specialise on (see the module docstring):
# the chunk length, the slot and split counts, and the strides of the [splits, B, Hq, Tq] log-sum-exp buffer.
_LSE_STRIDES = ("stride_ls", "stride_lb", "stride_lh")


def launch_specialisation(kernel, args: tuple, kwargs: dict) -> tuple:
    """The variant Triton compiles for a launch ``kernel[grid](*args, **kwargs)``: the constexpr values and, per other
    integer or pointer argument not in the kernel's ``do_not_specialize``, whether it is 1 / divisible by 16
    (pointers: 16-byte aligned). Diagnostics: a new value is a JIT compile on a GPU (tests and
    ``bench/profile_speculative.py`` count them)."""
    options = getattr(kernel, "kwargs", None) or {}  # the interpreter keeps jit's options here
    unspecialised = set(getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ())
    key = []
    for name, value in {**dict(zip(kernel.arg_names, args)), **kwargs}.items():
        if isinstance(value, torch.Tensor):
            key.append((name, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool) and name in kernel.arg_names:
            if "constexpr" in str(kernel.fn.__annotations__.get(name)):
                key.append((name, value))
            elif name not in unspecialised:
                key.append((name, value == 1, value % 16 == 0))
        elif not isinstance(value, float):
            key.append((name, value))
    return tuple(key)


@triton.jit(do_not_specialize=("seqlen_q", "num_ring", "num_slots", "num_splits", *_LSE_STRIDES))
def s2_decode_fwd_kernel(
    q, k_cache, v_cache, seq_lens, residues, ranks, counts, out, partial, lse, split_counters,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,  # out [B, Hq, Tq, D]
    stride_ps, stride_pb, stride_ph, stride_pt,  # partial [splits, B, Hq, Tq, D] float32, unit stride on D
    stride_ls, stride_lb, stride_lh, stride_lt,  # lse [splits, B, Hq, Tq] float32 (log2 units)
    stride_rh,  # residues/ranks/vertical_upto [Hkv, vert_stride]
    vertical_upto,  # int32 [Hkv, vert_stride]: how many of the KV head's residues are <= r
    num_kv_heads, seqlen_q, num_ring, num_slots, num_splits, qk_scale,
    q_heads_per_kv, q_heads_per_pattern, num_pattern_heads, num_dense_heads, head_step, head_offset,
    LOCAL_BLOCKS: tl.constexpr, RING_BLOCKS: tl.constexpr, VERT_STRIDE: tl.constexpr, KEYS_ON_M: tl.constexpr,
    KEY_GROUPS: tl.constexpr, TABLE_WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, ONE_PROGRAM_AN_SM: tl.constexpr,
):
    """Grid ``(num_splits, num_row_tiles, B * Hkv)``. The pattern's sizes are compile-time constants: the slot map
    and the mask divide by them for every key of every tile, and a constant (a power of two in practice) turns
    those integer divisions into shifts (one compilation per pattern; a model has one or two). ``ONE_PROGRAM_AN_SM``
    changes no code: it gives the launches whose programs fit one to an SM a compiled variant of their own, whose
    launches ``decode_attention_triton`` makes reserve more than half an SM's shared memory."""
    split = tl.program_id(0)
    row_tile = tl.program_id(1)
    batch = tl.program_id(2) // num_kv_heads
    kv_head = tl.program_id(2) % num_kv_heads
    # The KV head's rows of the layout's tables, loaded once. They are copied to the GPU when the layout is first used,
    # never written by a kernel, so they are read before the wait for the preceding kernel (dependent_launch.py).
    table_column = tl.arange(0, TABLE_WIDTH)  # [TABLE_WIDTH]: VERT_STRIDE rounded up to a power of two
    table_row = kv_head.to(tl.int64) * stride_rh + table_column
    in_table = table_column < VERT_STRIDE
    residue_row = tl.load(residues + table_row, mask=in_table, other=0)
    rank_row = tl.load(ranks + table_row, mask=in_table, other=-1)
    upto_row = tl.load(vertical_upto + table_row, mask=in_table, other=0)
    num_vertical = tl.load(counts + kv_head)
    wait_for_preceding_kernel(PDL)
    seq_len = tl.load(seq_lens + batch).to(tl.int32)
    last = (seq_len - 1) // BLOCK_SIZE

    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] = token * G + head in group
    t = rows // q_heads_per_kv
    q_head = kv_head * q_heads_per_kv + rows % q_heads_per_kv
    q_pos = seq_len - seqlen_q + t
    row_real = (t < seqlen_q) & (q_pos >= 0)
    q_block = tl.maximum(q_pos, 0) // BLOCK_SIZE
    pattern_head = q_head // q_heads_per_pattern
    dense_row = pattern_head >= num_pattern_heads - num_dense_heads
    # key block j is vertical for this row when (j + shift) % VERT_STRIDE == 0, i.e. j % VERT_STRIDE == residue
    vertical_residue = (VERT_STRIDE - (pattern_head * head_step + head_offset) % VERT_STRIDE) % VERT_STRIDE

    d = tl.arange(0, BLOCK_D)
    q_ptrs = q + batch.to(tl.int64) * stride_qb + q_head.to(tl.int64)[:, None] * stride_qh
    q_ptrs += t.to(tl.int64)[:, None] * stride_qt + d[None, :] * stride_qd
    q_tile = tl.load(q_ptrs, mask=row_mask(row_real, HEAD_DIM, BLOCK_D), other=0.0)  # [BLOCK_M, BLOCK_D]
    k_head = k_cache + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    shift = table_column.to(tl.int64)
    vertical_bits = tl.sum(tl.where(rank_row >= 0, tl.full([TABLE_WIDTH], 1, tl.int64) << shift, 0), 0)
    packed_residues = tl.sum(residue_row.to(tl.int64) << (shift * 4), 0)  # (used up to 16 residues)

    # The slots this row fills: the ring, then its vertical blocks up to ``last`` (a static cache allocates more;
    # the rest stays unread). Splits share them in whole key tiles.
    num_full_strides = last // VERT_STRIDE
    vertical_slots = num_full_strides * num_vertical + tl.sum(tl.where(table_column == last % VERT_STRIDE, upto_row,
                                                                       0))
    used = tl.minimum(num_slots, num_ring + vertical_slots) * BLOCK_SIZE
    tiles_per_split = tl.cdiv(tl.cdiv(used, BLOCK_N), num_splits)
    first = split * tiles_per_split * BLOCK_N
    end = tl.minimum(used, first + tiles_per_split * BLOCK_N)
    if KEY_GROUPS == 1:
        # A chunk's large row tile: the warps share every key tile (S [BLOCK_M, BLOCK_N]).
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(first, end, BLOCK_N):
            key_rows = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of the cache
            block = _slot_blocks(key_rows // BLOCK_SIZE, last, residue_row, rank_row, vertical_bits, packed_residues,
                                 num_vertical, num_ring, RING_BLOCKS, VERT_STRIDE, TABLE_WIDTH)
            k_pos = block * BLOCK_SIZE + key_rows % BLOCK_SIZE
            key_ok = (key_rows < end) & (block >= 0) & (k_pos < seq_len)
            kv_mask = row_mask(key_ok, HEAD_DIM, BLOCK_D)
            k_tile = tl.load(k_head + key_rows.to(tl.int64)[:, None] * stride_kt + d[None, :] * stride_kd,
                             mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = _visible(q_block[:, None], q_pos[:, None], dense_row[:, None], vertical_residue[:, None],
                               row_real[:, None], block[None, :], k_pos[None, :], key_ok[None, :], LOCAL_BLOCKS,
                               VERT_STRIDE)
            v_ptrs = v_head + key_rows.to(tl.int64)[:, None] * stride_vt + d[None, :] * stride_vd
            m_i, l_i, acc = _online_softmax_step(s, visible, v_ptrs, kv_mask, m_i, l_i, acc, 1, DOT_PRECISION)
    elif KEYS_ON_M:
        # The 8-row tile (one-token steps): keys on the products' M axis, two key groups a warp, each with its own
        # softmax state (S^T [KEY_GROUPS, KEYS, BLOCK_M]; see the module docstring).
        KEYS_PER_GROUP: tl.constexpr = BLOCK_N // KEY_GROUPS
        q_t = tl.broadcast_to(tl.trans(q_tile)[None, :, :], [KEY_GROUPS, BLOCK_D, BLOCK_M])
        m_groups = tl.full([KEY_GROUPS, BLOCK_M], -float("inf"), dtype=tl.float32)
        l_parts = tl.zeros([KEY_GROUPS, KEYS_PER_GROUP, BLOCK_M], dtype=tl.float32)  # per key slot, summed after
        acc_t = tl.zeros([KEY_GROUPS, BLOCK_D, BLOCK_M], dtype=tl.float32)  # O^T
        for start in range(first, end, BLOCK_N):
            key_rows, block, k_pos, key_ok = _grouped_keys(  # [KEY_GROUPS, KEYS] each
                start, end, seq_len, last, residue_row, rank_row, vertical_bits, packed_residues, num_vertical,
                num_ring, RING_BLOCKS, VERT_STRIDE, TABLE_WIDTH, BLOCK_SIZE, BLOCK_N, KEY_GROUPS)
            kv_rows = key_rows.to(tl.int64)
            k_tile = tl.load(k_head + kv_rows[:, :, None] * stride_kt + d[None, None, :] * stride_kd,
                             mask=key_ok[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)  # [G, KEYS, D]
            s = tl.dot(k_tile, q_t, input_precision=DOT_PRECISION) * qk_scale  # [KEY_GROUPS, KEYS, BLOCK_M]
            visible = _visible(q_block[None, None, :], q_pos[None, None, :], dense_row[None, None, :],
                               vertical_residue[None, None, :], row_real[None, None, :], block[:, :, None],
                               k_pos[:, :, None], key_ok[:, :, None], LOCAL_BLOCKS, VERT_STRIDE)
            s = tl.where(visible, s, -float("inf"))
            m_new = tl.maximum(m_groups, tl.max(s, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows that saw nothing yet: avoid inf - inf
            alpha = tl.math.exp2(m_groups - m_safe)[:, None, :]
            p = tl.math.exp2(s - m_safe[:, None, :])
            l_parts = l_parts * alpha + p
            # V^T [KEY_GROUPS, D, KEYS] loaded as such (a transpose of a loaded tile goes through registers, outside
            # the pipeline) and after P, as in _online_softmax_step
            v_t = tl.load(v_head + kv_rows[:, None, :] * stride_vt + d[None, :, None] * stride_vd,
                          mask=key_ok[:, None, :] & (d < HEAD_DIM)[None, :, None], other=0.0)
            acc_t = acc_t * alpha + tl.dot(v_t, p.to(v_t.dtype), input_precision=DOT_PRECISION)
            m_groups = m_new
        m_i, l_i, acc = _merge_key_groups(m_groups, tl.sum(l_parts, 1), tl.trans(acc_t, (0, 2, 1)))
    else:
        # Chunks of 9 to 32 query rows, in 16-row tiles: each of the KEY_GROUPS warps takes its own share of every
        # key tile, with its own softmax state, so no reduction crosses warps inside the loop
        # (S [KEY_GROUPS, BLOCK_M, KEYS]).
        q_groups = tl.broadcast_to(q_tile[None, :, :], [KEY_GROUPS, BLOCK_M, BLOCK_D])
        m_groups = tl.full([KEY_GROUPS, BLOCK_M], -float("inf"), dtype=tl.float32)
        l_groups = tl.zeros([KEY_GROUPS, BLOCK_M], dtype=tl.float32)
        acc_groups = tl.zeros([KEY_GROUPS, BLOCK_M, BLOCK_D], dtype=tl.float32)
        d_mask = (d < HEAD_DIM)[None, None, :]
        for start in range(first, end, BLOCK_N):
            key_rows, block, k_pos, key_ok = _grouped_keys(  # [KEY_GROUPS, KEYS] each
                start, end, seq_len, last, residue_row, rank_row, vertical_bits, packed_residues, num_vertical,
                num_ring, RING_BLOCKS, VERT_STRIDE, TABLE_WIDTH, BLOCK_SIZE, BLOCK_N, KEY_GROUPS)
            kv_rows = key_rows.to(tl.int64)[:, :, None]
            kv_mask = key_ok[:, :, None] & d_mask
            k_tile = tl.load(k_head + kv_rows * stride_kt + d[None, None, :] * stride_kd, mask=kv_mask,
                             other=0.0)  # [KEY_GROUPS, KEYS, BLOCK_D]
            s = tl.dot(q_groups, tl.trans(k_tile, (0, 2, 1)), input_precision=DOT_PRECISION) * qk_scale
            visible = _visible(q_block[None, :, None], q_pos[None, :, None], dense_row[None, :, None],
                               vertical_residue[None, :, None], row_real[None, :, None], block[:, None, :],
                               k_pos[:, None, :], key_ok[:, None, :], LOCAL_BLOCKS, VERT_STRIDE)
            v_ptrs = v_head + kv_rows * stride_vt + d[None, None, :] * stride_vd
            m_groups, l_groups, acc_groups = _online_softmax_step(s, visible, v_ptrs, kv_mask, m_groups, l_groups,
                                                                  acc_groups, 2, DOT_PRECISION)
        m_i, l_i, acc = _merge_key_groups(m_groups, l_groups, acc_groups)

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    row_ok = t < seqlen_q
    o_mask = row_mask(row_ok, HEAD_DIM, BLOCK_D)
    o_ptrs = out + batch.to(tl.int64) * stride_ob + q_head.to(tl.int64)[:, None] * stride_oh
    o_ptrs += t.to(tl.int64)[:, None] * stride_ot + d[None, :] * stride_od
    if num_splits == 1:
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(out.dtype.element_ty), mask=o_mask)
    else:
        # [BLOCK_M] / [BLOCK_M, BLOCK_D] offsets of this program's rows in split 0 of lse / partial
        l_rows = batch.to(tl.int64) * stride_lb + q_head.to(tl.int64) * stride_lh + t.to(tl.int64) * stride_lt
        p_rows = batch.to(tl.int64) * stride_pb + q_head.to(tl.int64) * stride_ph + t.to(tl.int64) * stride_pt
        p_rows = p_rows[:, None] + d[None, :]
        tl.store(partial + split.to(tl.int64) * stride_ps + p_rows, acc / l_safe[:, None], mask=o_mask)
        tl.store(lse + split.to(tl.int64) * stride_ls + l_rows, tl.where(seen, m_i + tl.math.log2(l_safe),
                                                                         -float("inf")), mask=row_ok)
        # Every thread's stores precede the counter's release (barrier, then the acq_rel atomic); the last
        # program's acquire makes the other splits' stores visible to it, and its loads skip L1 (.cg).
        tl.debug_barrier()
        counter = split_counters + tl.program_id(2) * tl.num_programs(1) + row_tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # every split has counted: zero for the next launch (a replayed graph's too)
            m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
            total = tl.zeros([BLOCK_M], dtype=tl.float32)
            merged = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for s in range(0, num_splits):
                lse_s = tl.load(lse + s * stride_ls + l_rows, mask=row_ok, other=-float("inf"), cache_modifier=".cg")
                m_new = tl.maximum(m, lse_s)
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                alpha = tl.math.exp2(m - m_safe)
                w = tl.math.exp2(lse_s - m_safe)
                o_s = tl.load(partial + s * stride_ps + p_rows, mask=o_mask, other=0.0, cache_modifier=".cg")
                merged = merged * alpha[:, None] + w[:, None] * o_s
                total = total * alpha + w
                m = m_new
            result = merged / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=o_mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=8)
def _gpu_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


# GPUs whose launches of one program an SM over more than half the SMs were measured faster with a fourth pipeline
# stage (the name's words, so that "H200" does not match "GH200")
FOUR_STAGE_GPUS = frozenset({"H200"})


def _default_num_stages(programs: int, num_sms: int, gpu_name: str) -> int:
    """Pipeline stages of a launch whose shape the caller left to the launcher. On an H200 (fifty-eighth session,
    bench/NOTES.md), with each program alone on its SM: a fourth stage at batch 8 from 16k to 128k (128 programs)
    1.8-2.6% faster (8 x 32k 18.21 -> 17.73 us), at batch 1 (64 programs) 1.7-2.4% slower. On an H100 three were
    the fastest at batch 8 (thirty-second session), so other GPUs keep ``DecodeTiles``' three."""
    fits_one_an_sm = num_sms // 2 < programs <= num_sms
    if fits_one_an_sm and FOUR_STAGE_GPUS & set(gpu_name.split()):
        return 4
    return DecodeTiles.num_stages


@functools.lru_cache(maxsize=8)
def _shared_memory_of_one_program_an_sm(device_index: int) -> int:
    """Bytes of shared memory a program must reserve so that no SM can hold two: over half an SM's."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor // 2 + 1


def _choose_num_splits(programs: int, num_tiles: int, device: torch.device) -> int:
    """Up to one program per multiprocessor and 8 splits, each split keeping >= 4 key tiles of work. One program an
    SM, not two: with a warp's own share of every tile, a program streams fast enough alone, and a second one only
    adds splits to merge (H100, batch 8, 32k: 25.0 us at 2 splits, 27.3 at 4; batch 32 needs no split). At most 8:
    the last split merges the others one by one (batch 1, 128k: 17.3 us at 8 splits, 18.0-18.4 at 16;
    bench/NOTES.md)."""
    if device.type != "cuda":
        return 1
    target = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(target // programs, num_tiles // 4, MAX_SPLITS))


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of ``s2_decode_fwd_kernel``: keys per iteration, warps, software-pipelining depth. The default
    is the fastest of ``bench/decode_ab.py``'s sweep on an H100 at every shape measured but 32 x 32k, where a fourth
    stage is 0.6% faster; at batch 8, 32k it reads 0.749 of the copy bandwidth. On an H200 a fourth stage is faster
    where the programs run one an SM over more than half the SMs, and the launcher then takes it when it is given
    no shape (``_default_num_stages``; bench/NOTES.md, thirty-second, forty-sixth and fifty-eighth sessions)."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3


def decode_attention_triton(q, k_cache, v_cache, seq_lens, layout: CompactLayout, num_ring: int, scale: float,
                            num_splits: int | None, tiles: DecodeTiles | None = None,
                            split_counters: torch.Tensor | None = None):
    """Backend of ``decode.s2_decode_attention`` (inputs validated there). Returns ``[B, Hq, Tq, D]``.

    ``tiles`` overrides the default launch shape (``bench/bench_generation.py`` sweeps it). ``split_counters``:
    zeroed int32 counters that the kernel leaves zeroed, used when there are enough (one per (row, KV head, row
    tile)); otherwise a zeroed buffer is allocated for the call."""
    b, hq, tq, d = q.shape
    hkv, bs = layout.num_kv_heads, layout.block_size
    num_slots = k_cache.shape[2] // bs
    pattern = layout.pattern
    tables = layout.tables(q.device)
    stages_follow_launch = tiles is None
    tiles = tiles or DecodeTiles()
    block_d = max(16, next_power_of_2(d))
    block_n = max(bs, tiles.block_n)
    rows = tq * layout.q_heads_per_kv
    if rows <= KEYS_ON_M_ROWS:
        block_m = KEYS_ON_M_ROWS
    else:
        block_m = SMALL_ROW_TILE if rows <= 2 * SMALL_ROW_TILE else LARGE_ROW_TILE
    num_row_tiles = triton.cdiv(rows, block_m)
    num_tiles = triton.cdiv(num_slots, block_n // bs)  # of the allocated slots; the kernel reads the used ones
    # Key groups: two a warp in the 8-row tile, one a warp in the 16-row tile; the large tile would hold KEY_GROUPS
    # accumulators of [64, D] (spilling), so its warps share each key (one group).
    key_groups = {KEYS_ON_M_ROWS: 2 * tiles.num_warps, SMALL_ROW_TILE: tiles.num_warps}.get(block_m, 1)
    if key_groups > 1 and block_n // key_groups < 16:
        raise ValueError(f"tiles.block_n must give each key group >= 16 keys (they feed tl.dot): {block_n} keys over "
                         f"{key_groups} groups ({key_groups // tiles.num_warps} a warp of tiles.num_warps)")
    if num_splits is None:
        num_splits = _choose_num_splits(b * hkv * num_row_tiles, num_tiles, q.device)
    num_splits = max(1, min(num_splits, num_tiles))

    out = torch.empty_like(q)
    # Split outputs, their log-sum-exps and the counters exist only with splits; with one, empty stand-ins of the
    # same dtypes keep the compiled variant the same (the strides passed are those of the full shapes either way).
    partial_shape = (num_splits, b, hq, tq, d)
    if num_splits > 1:
        partial = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(partial_shape[:-1], dtype=torch.float32, device=q.device)
        programs = num_row_tiles * b * hkv
        if split_counters is None or split_counters.numel() < programs:
            split_counters = torch.zeros(programs, dtype=torch.int32, device=q.device)
    else:
        partial = lse = torch.empty(0, dtype=torch.float32, device=q.device)
        split_counters = torch.empty(0, dtype=torch.int32, device=q.device)
    num_heads = layout.num_pattern_heads
    grid = (num_splits, num_row_tiles, b * hkv)
    # When the programs fit one to an SM, their launch reserves more than half an SM's shared memory, so that none
    # runs beside another while an SM idles. The kernel's registers and shared memory (186 and 64 KB at head dim 64)
    # allow two an SM, and an H200 placed two on 13-60 SMs whenever a kernel launched with PDL followed (+4 us a
    # launch at 8 x 32k, none with the reservation; alone it changes nothing measurable, 18.2 against 18.3 us;
    # bench/NOTES.md, fifty-sixth and fifty-seventh sessions). More programs than SMs run faster two an SM (32 x 32k:
    # 50.7 against 54.9 us reserved). The first launch of each compiled variant runs before the reservation is made.
    num_programs, on_gpu = math.prod(grid), q.device.type == "cuda"
    num_sms = _num_sms(q.device.index) if on_gpu else 0
    one_program_an_sm = on_gpu and num_programs <= num_sms
    if stages_follow_launch and on_gpu:
        tiles = replace(tiles, num_stages=_default_num_stages(num_programs, num_sms, _gpu_name(q.device.index)))
    launch = functools.partial(
        s2_decode_fwd_kernel[grid],
        q, k_cache, v_cache, seq_lens, tables.residues, tables.rank, tables.counts, out, partial, lse, split_counters,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *_contiguous_strides(partial_shape)[:-1], *_contiguous_strides(partial_shape[:-1]),
        tables.residues.stride(0), tables.vertical_upto,
        hkv, tq, num_ring, num_slots, num_splits, scale * LOG2E,
        layout.q_heads_per_kv, layout.q_heads_per_pattern, num_heads, pattern.num_dense_heads,
        pattern.head_step(num_heads), pattern.head_sliding_offset,
        pattern.local_blocks, layout.ring_blocks, pattern.vert_stride, block_m == KEYS_ON_M_ROWS, key_groups,
        next_power_of_2(pattern.vert_stride),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ONE_PROGRAM_AN_SM=one_program_an_sm, num_warps=tiles.num_warps, **launch_options(q.device),
    )
    variant = ("decode", q.device, q.dtype, d, block_m, block_n, tiles.num_warps, tiles.num_stages)
    compiled = launch_within_shared_memory(launch, tiles.num_stages, key=variant)
    if one_program_an_sm and compiled is not None:  # (None: Triton's interpreter)
        reserve_shared_memory(compiled, _shared_memory_of_one_program_an_sm(q.device.index))
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@triton.jit(do_not_specialize=("seqlen_q", "num_ring"))
def s2_cache_append_kernel(
    key, value, k_cache, v_cache, seq_lens, ranks, counts,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_cb, stride_ch, stride_ct, stride_cd,
    stride_db, stride_dh, stride_dt, stride_dd,
    stride_rh,
    num_kv_heads, seqlen_q, num_ring, RING_BLOCKS: tl.constexpr, VERT_STRIDE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    ADVANCE_LENGTHS: tl.constexpr, PDL: tl.constexpr,
):
    """Copy new K/V rows to their slots (``decode.block_slots``' rule). A program copies the (KV head, token) pairs
    ``[first, end)`` of one batch row, numbered ``head * Tq + token``, ``BLOCK_T`` pairs at a time. Grid
    ``(cdiv(Tq, BLOCK_T), B * Hkv)``: up to ``BLOCK_T`` tokens of one KV head. With ``ADVANCE_LENGTHS``, grid
    ``(1, B)``: every pair of the row, then the row's length advanced by ``Tq``. The one program that reads a row's
    length is then the one that writes it, so no other program can read the advanced length by mistake."""
    wait_for_preceding_kernel(PDL)
    if ADVANCE_LENGTHS:
        batch = tl.program_id(1)
        first, end = 0, num_kv_heads * seqlen_q
        length = tl.load(seq_lens + batch)
        first_pos = length.to(tl.int32)  # the new tokens follow the stored ones
    else:
        batch = tl.program_id(1) // num_kv_heads
        head_start = (tl.program_id(1) % num_kv_heads) * seqlen_q
        first = head_start + tl.program_id(0) * BLOCK_T
        end = tl.minimum(first + BLOCK_T, head_start + seqlen_q)
        first_pos = tl.load(seq_lens + batch).to(tl.int32) - seqlen_q  # the row's length counts the new tokens
    d = tl.arange(0, BLOCK_D)
    for pair_start in range(first, end, BLOCK_T):
        pair = pair_start + tl.arange(0, BLOCK_T)
        kv_head, t = (pair // seqlen_q).to(tl.int64), pair % seqlen_q
        pos = first_pos + t
        real = (pair < end) & (pos >= 0)  # negative positions: left padding of a row that is still empty
        block = tl.maximum(pos, 0) // BLOCK_SIZE
        rank = tl.load(ranks + kv_head * stride_rh + block % VERT_STRIDE, mask=real, other=-1)
        num_vertical = tl.load(counts + kv_head, mask=real, other=0)
        slot = tl.where(rank >= 0, num_ring + (block // VERT_STRIDE) * num_vertical + rank, block % RING_BLOCKS)
        cache_row = (slot * BLOCK_SIZE + tl.maximum(pos, 0) % BLOCK_SIZE).to(tl.int64)
        t = t.to(tl.int64)
        mask = row_mask(real, HEAD_DIM, BLOCK_D)
        src_k = key + batch.to(tl.int64) * stride_kb + kv_head * stride_kh + t * stride_kt
        src_v = value + batch.to(tl.int64) * stride_vb + kv_head * stride_vh + t * stride_vt
        dst_k = k_cache + batch.to(tl.int64) * stride_cb + kv_head * stride_ch + cache_row * stride_ct
        dst_v = v_cache + batch.to(tl.int64) * stride_db + kv_head * stride_dh + cache_row * stride_dt
        k_rows = tl.load(src_k[:, None] + d[None, :] * stride_kd, mask=mask)
        v_rows = tl.load(src_v[:, None] + d[None, :] * stride_vd, mask=mask)
        tl.store(dst_k[:, None] + d[None, :] * stride_cd, k_rows, mask=mask)
        tl.store(dst_v[:, None] + d[None, :] * stride_dd, v_rows, mask=mask)
    if ADVANCE_LENGTHS:
        tl.store(seq_lens + batch, length + seqlen_q)


def cache_append_triton(k_cache, v_cache, key, value, seq_lens, layout: CompactLayout, num_ring: int,
                        advance_lengths: bool) -> None:
    """Backend of ``decode.s2_cache_append``: one launch for every row, KV head and new token (and, with
    ``advance_lengths``, the rows' lengths)."""
    b, hkv, tq, d = key.shape
    tables = layout.tables(key.device)
    block_d = max(16, next_power_of_2(d))
    grid = (1, b) if advance_lengths else (triton.cdiv(tq, TOKENS_PER_PROGRAM), b * hkv)
    s2_cache_append_kernel[grid](
        key, value, k_cache, v_cache, seq_lens, tables.rank, tables.counts,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(), tables.rank.stride(0),
        hkv, tq, num_ring, layout.ring_blocks, layout.pattern.vert_stride,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=layout.block_size, BLOCK_T=TOKENS_PER_PROGRAM,
        ADVANCE_LENGTHS=advance_lengths, **launch_options(key.device),
    )
