"""Warp-specialized S2-Attention forward for Hopper (sm_90), written in Gluon.

Why a second forward: on an H100 the Triton forward (``triton_impl``) runs FlashAttention-2's structure, in which
each warp group issues its loads, waits for its matrix products and computes its softmax in turn; on identical dense
work it reaches ~0.7 of cuDNN (bench/NOTES.md). cuDNN and FlashAttention-3 specialize warps: a producer issues the
tensor-memory-accelerator (TMA) copies, and two consumer warp groups each own half of the query tile, so that one's
softmax runs while the other's matrix products occupy the tensor cores. Triton 3.6's automatic warp specialization
compiles such kernels but they hang on an H100 (``bench/warp_specialization_repro.py``), so the partitions, their
barriers and the asynchronous ``wgmma`` are written out here in Gluon, Triton's explicit-layout dialect.

A work item = one query tile of ``BLOCK_M = 2 * CONSUMER_ROWS`` absolute positions of one head (Merge-Q, as the
Triton forward), over the same lists (``triton_impl.build_unit_lists``): entries ``[0, num_full)`` unmasked, then the
partial ones, masked with their keep bits, causality and the key length. At blocks of 32 and 64 a tile's list starts,
where it can, with a *split step* (``triton_impl.split_first_step``): half of it holds entries only the first
consumer's rows keep, half entries only the second's, and each consumer computes its own half (64 keys), not the
whole step (1.03-1.05x at 16 x 8192 and 4 x 32768 on an H100; bench/NOTES.md). The kernel is persistent: one program per
SM runs work items in turn, so one item's epilogue overlaps the next one's loads. After its first, a program claims
its next item from a counter, so the items in flight are always neighbours in the item order (the tiles of one or
two heads, whose K and V blocks they share in L2); with items assigned round-robin, programs drift apart, and at
16 x 8192 the L2 hit rate fell to 61% (bench/NOTES.md). Partitions:

* loader (1 warp, ``stream_load_partition``): claims the items; per item its index and list counts (for the
  consumers) and Q, into one of two Q buffers (item ``n`` in buffer ``n % 2``, copied while item ``n - 1`` runs),
  then per ring step the K and V of ``BLOCK_N // UNIT`` list entries (``UNIT = min(block_size, BLOCK_N)`` keys each,
  one TMA box each) into a K ring of ``NUM_V_BUFFERS - 1`` slots and a V ring of ``NUM_V_BUFFERS`` (the second Q
  buffer takes what a third K slot would: at D = 128 shared memory holds 7 tiles of 32 KB; at D = 64, 6 V slots);
* two consumers (4 warps each, 64 query rows each), in FlashAttention-3's order: a step issues the next step's
  ``S = Q K^T`` and this step's ``O += P V`` as asynchronous warp-group matrix products on the shared-memory tiles,
  then computes the next step's online softmax (base 2, fp32) while they run, and the other consumer's products.
  Both release each ring step once its ``P V`` is complete, which also frees the next step's K (its scores were
  issued first, and products complete in order). The ring steps run on across items: an item's last step issues,
  with its ``P V``, the next item's first scores from the other Q buffer, so that no item starts with an empty queue
  (1.016-1.045x at block 64 and D=64 on an H100, 0.99-1.01x at blocks 32 and 128; bench/NOTES.md).
  Each consumer's output rows leave through one TMA copy out of its half of the item's Q buffer, which no product
  reads any more (the buffer is released to the loader once the copy has read it): 1.02-1.05x over per-thread
  stores on an H100, 1.05x at 16 x 8192 (bench/NOTES.md, forty-fourth session).
  The consumers do not take turns (FlashAttention-3's ping-pong measured 1.00x here): the second one starts as far
  behind the first as the ring allows (``_start_second_consumer``, ``NUM_V_BUFFERS - 2`` ring steps), so that their
  item boundaries (the epilogue and the next item's first softmax, with little to issue to the tensor cores) fall
  at different times and each runs under the other's steps. With 6 slots at D = 64 that is 1.04-1.045x on an H100;
  with D = 128's 3 slots, one step, 0.99-1.03x (bench/NOTES.md).

Scope (``supported``): causal, 16-bit inputs, head dim 64 or 128, ``block_size >= 32``, compute capability 9.0, and
tensors ``layouts.row_view`` can view as rows. Everything else stays on the Triton forward, and the tuner picks
this kernel only where it is faster (on an H100: at D = 128, and at D = 64 only with long sequences; bench/NOTES.md).
"""

from __future__ import annotations

import functools

import torch

from .layouts import row_view
from .sequence_bounds import sequence_bounds
from .triton_setup import triton  # noqa: F401 (a clear error where Triton is missing)

try:  # Gluon is experimental: its absence (or a changed API) only removes this kernel from the candidates
    from triton import language as tl  # for int64 arguments (tl.int64; Gluon's annotations are Triton's)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the Triton build
    AVAILABLE = False

CONSUMER_ROWS = 64  # query rows per consumer warp group: wgmma's M of 16 rows per warp, 4 warps
BLOCK_M = 2 * CONSUMER_ROWS
# Registers: 12 warps (consumer 0 is the 4-warp default partition; the loader's warp is padded to a warp group) share
# the 64K registers of one program per SM: 168 each at launch (65536 / (12 * 32)), then the loader gives most of its
# share to the consumers, which hold a step's scores, the previous step's probabilities and 64 output rows:
# 2 * 4 * consumer + 4 * loader = 12 * 168. (consumer, loader) per keys a step: 128-key steps hold twice the scores,
# and at 232 / 40 ptxas spilled inside their step loop at D = 128; at 240 / 24 only outside it (bench/NOTES.md).
MAXNREG = 168
REGISTERS = {64: (232, 40), 128: (240, 24)}

if AVAILABLE:
    # The loader reads its claim of the next work item, and decodes that item, after this many ring steps of the
    # current one (stream_load_partition).
    CLAIM_AFTER = gl.constexpr(1)

    @gluon.constexpr_function
    def warpgroup_layout(columns):
        """Registers of a warp-group matrix product's ``[64, columns]`` result (4 warps, 16 rows each)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])

    @gluon.jit
    def item_fields(work, work_args, TILE: gl.constexpr, IS_VARLEN: gl.constexpr):
        """Work item ``work`` (tiles fastest, then heads, then sequences; the latest, heaviest tile of a head first):
        its sequence, query head, where its sequence starts and ends, where its list starts, and where its list's
        counts are (``list_counts``). ``work_args``: the kernel's
        ``(num_work, num_q_tiles, num_q_heads, cu_seqlens_q, cu_seqlens_k, first_pos, seqlen_k, last_tile, unit_lists,
        unit_bits, unit_counts, stride_up, stride_ut, stride_cp, stride_ct, q_heads_per_pattern, q_heads_per_kv)``."""
        (_, num_q_tiles, num_q_heads, cu_seqlens_q, cu_seqlens_k, first_pos, seqlen_k, last_tile, unit_lists,
         unit_bits, unit_counts, stride_up, stride_ut, stride_cp, stride_ct, q_heads_per_pattern, _) = work_args
        tile_rank = work % num_q_tiles
        head_rank = work // num_q_tiles
        q_head = head_rank % num_q_heads
        seq = head_rank // num_q_heads
        # first_pos: bottom-right alignment, the absolute position of query row 0. Without varlen it and the last
        # tile come from the launch (item_args): computed here from the kernel's arguments, they were hoisted above
        # the partitions and lived through the consumers' loops in spilled registers, reloaded at every item (as was
        # num_q_tiles * num_q_heads, hence two divisions for seq; bench/NOTES.md, thirty-fifth session).
        if IS_VARLEN:
            q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(cu_seqlens_q, cu_seqlens_k, seq, 0, 0, IS_VARLEN)
            first_pos = seqlen_k - seqlen_q
            tile = first_pos // TILE + num_q_tiles - 1 - tile_rank
            has_rows = (seqlen_q > 0) & (tile * TILE < seqlen_k)  # a tile past a sequence's end: no step, no store
        else:
            q_start = 0
            k_start = 0
            tile = last_tile - tile_rank
            has_rows = tile >= 0  # always: the launch's tiles are [0, last_tile]
        pattern_head = q_head // q_heads_per_pattern
        list_offset = pattern_head.to(gl.int64) * stride_up + tile.to(gl.int64) * stride_ut
        counts = unit_counts + pattern_head.to(gl.int64) * stride_cp + tile.to(gl.int64) * stride_ct
        return (seq, q_head, q_start, k_start, seqlen_k, first_pos, tile * TILE, unit_lists + list_offset,
                unit_bits + list_offset, counts, has_rows)

    @gluon.jit
    def list_counts(counts, has_rows, SPLIT_STEPS: gl.constexpr):
        """A work item's list counts (``item_fields``): ``(num_full, num_entries, split)``, with ``SPLIT_STEPS`` lists
        from ``triton_impl.split_first_step``, whose third count says whether a split step comes first (else 0)."""
        num_full = gl.load(counts, mask=has_rows, other=0)
        num_entries = gl.load(counts + 1, mask=has_rows, other=0)
        split = 0
        if SPLIT_STEPS:
            split = gl.load(counts + 2, mask=has_rows, other=0)
        return num_full, num_entries, split

    @gluon.jit
    def work_item(work, work_args, TILE: gl.constexpr, IS_VARLEN: gl.constexpr, SPLIT_STEPS: gl.constexpr):
        """``item_fields`` with the counts loaded: ``(seq, q_head, q_start, k_start, seqlen_k, first_pos, tile_first,
        list_base, bits_base, num_full, num_entries, split)``."""
        (seq, q_head, q_start, k_start, seqlen_k, first_pos, tile_first, list_base, bits_base, counts,
         has_rows) = item_fields(work, work_args, TILE, IS_VARLEN)
        num_full, num_entries, split = list_counts(counts, has_rows, SPLIT_STEPS)
        return (seq, q_head, q_start, k_start, seqlen_k, first_pos, tile_first, list_base, bits_base, num_full,
                num_entries, split)

    @gluon.jit
    def head_origin(seq, head, stride_b, stride_h, stride_t):
        """Where head ``head`` of batch row (or packed sequence) ``seq`` starts in a row descriptor's
        ``[rows, stride_t]`` view (``layouts.row_view``): ``(row, column)``."""
        offset = seq.to(gl.int64) * stride_b + head.to(gl.int64) * stride_h
        return (offset // stride_t).to(gl.int32), (offset % stride_t).to(gl.int32)

    @gluon.jit
    def publish_work(work_smem, work):
        """Store work item index ``work`` for the consumers (all lanes of the loader's warp store the same value)."""
        work_smem.store(gl.full([1], work, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))

    @gluon.jit
    def published_work(work_smem):
        """The work item index the loader published (read by a 4-warp consumer after waiting for ``q_ready``)."""
        return gl.max(work_smem.load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)

    @gluon.jit
    def publish_item(record, work, num_full, num_entries, split, tile_first, seq, q_head, q_start, first_pos):
        """Store work item ``work`` and its list counts (fields 0-3), and where its output goes (fields 8-12), in
        ``record`` (``[16]`` int32 of shared memory) for the consumers, which then do not load the counts (an L2 round
        trip, on their path from one item to the next; ``published_item``), and whose epilogue reads the output's
        fields there (``published_output``) rather than keep them through the item's steps."""
        fields = gl.arange(0, 16, layout=gl.BlockedLayout([16], [32], [1], [0]))
        values = gl.where(fields == 0, work, 0)
        values = gl.where(fields == 1, num_full, values)
        values = gl.where(fields == 2, num_entries, values)
        values = gl.where(fields == 3, split, values)
        values = gl.where(fields == 8, tile_first, values)
        values = gl.where(fields == 9, seq, values)
        values = gl.where(fields == 10, q_head, values)
        values = gl.where(fields == 11, q_start, values)
        values = gl.where(fields == 12, first_pos, values)
        record.store(values)

    @gluon.jit
    def published_item(record):
        """What ``publish_item`` stored (read by a 4-warp consumer after waiting for the item's ``q_ready``):
        ``(work, num_full, num_entries, split)``."""
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        values = record.slice(0, 4).load(layout)
        fields = gl.arange(0, 4, layout=layout)
        return (gl.sum(gl.where(fields == 0, values, 0), axis=0), gl.sum(gl.where(fields == 1, values, 0), axis=0),
                gl.sum(gl.where(fields == 2, values, 0), axis=0), gl.sum(gl.where(fields == 3, values, 0), axis=0))

    @gluon.jit
    def published_output(record):
        """The output's fields that ``publish_item`` stored (read by a 4-warp consumer's epilogue): ``(tile_first,
        seq, q_head, q_start, first_pos)``. Kept in registers from the item's decode to its epilogue, they lived
        through the step loop in spilled registers, reloaded at every item (offline, block 64: 36 / 44 bytes of
        spills against 16 / 24; bench/NOTES.md, forty-fifth session)."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
        values = record.slice(8, 8).load(layout)
        fields = gl.arange(8, 16, layout=layout)
        return (gl.sum(gl.where(fields == 8, values, 0), axis=0), gl.sum(gl.where(fields == 9, values, 0), axis=0),
                gl.sum(gl.where(fields == 10, values, 0), axis=0), gl.sum(gl.where(fields == 11, values, 0), axis=0),
                gl.sum(gl.where(fields == 12, values, 0), axis=0))

    @gluon.jit
    def consumer_rows(tile_first, consumer: gl.constexpr, ROWS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                      layout: gl.constexpr):
        """Consumer ``consumer``'s rows of the work item whose tile starts at ``tile_first``: their absolute positions
        and each row's block in the tile (its bit in the lists' keep bits), ``[ROWS]`` each in ``layout``."""
        q_pos = tile_first + consumer * ROWS + gl.arange(0, ROWS, layout=layout)
        return q_pos, q_pos // BLOCK_SIZE - tile_first // BLOCK_SIZE

    @gluon.jit
    def partial_visible(j, num_entries, list_base, bits_base, q_pos, block_in_tile, seqlen_k, UNIT: gl.constexpr,
                         BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Which scores of step ``j`` (``[ROWS, BLOCK_N]``, rows at positions ``q_pos``) a partial step keeps: the
        entries' keep bits for each row's block, causality, the key length; nothing of a missing entry."""
        GROUP: gl.constexpr = BLOCK_N // UNIT
        offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        k_pos = offs % UNIT
        bits = gl.zeros([BLOCK_N], gl.int32, gl.SliceLayout(0, s_layout))
        for member in gl.static_range(GROUP):
            entry = j * GROUP + member
            listed = entry < num_entries
            unit = gl.load(list_base + entry, mask=listed, other=0)
            entry_bits = gl.load(bits_base + entry, mask=listed, other=0)  # 0: an unlisted member sees nothing
            k_pos += gl.where(offs // UNIT == member, unit * UNIT, 0)
            bits = gl.where(offs // UNIT == member, entry_bits, bits)
        kept = ((bits[None, :] >> block_in_tile[:, None]) & 1) != 0
        return kept & (k_pos[None, :] <= q_pos[:, None]) & (k_pos < seqlen_k)[None, :]

    @gluon.jit
    def _softmax_step(s, m_i, l_i, j, num_full, num_entries, list_base, bits_base, q_pos, block_in_tile, seqlen_k,
                      qk_scale, UNIT: gl.constexpr, s_layout: gl.constexpr):
        """Online softmax of step ``j``'s raw scores ``s [ROWS, BLOCK_N]``: ``(p, alpha, m, l)``, the maximum kept in
        raw score units (``qk_scale > 0`` folds into one fused multiply-add per score, in base 2)."""
        BLOCK_N: gl.constexpr = s.type.shape[1]
        GROUP: gl.constexpr = BLOCK_N // UNIT
        if j * GROUP >= num_full:  # partial entries: keep bits, causality, key length, listed
            s = gl.where(partial_visible(j, num_entries, list_base, bits_base, q_pos, block_in_tile, seqlen_k, UNIT,
                                          BLOCK_N, s_layout), s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_scaled = gl.where(m_new == -float("inf"), 0.0, m_new * qk_scale)  # rows that saw nothing yet: no inf - inf
        alpha = gl.exp2(m_i * qk_scale - m_scaled)
        p = gl.exp2(s * qk_scale - m_scaled[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _kv_slot(step, IS_V: gl.constexpr, NUM_K: gl.constexpr, NUM_V: gl.constexpr):
        """Ring step ``step``'s K (or V) slot in the joint buffers (K's ring first, then V's: one index chooses either
        as a product's operand) and the phase of its ``k_ready`` (``v_ready``) barrier."""
        if IS_V:
            return NUM_K + step % NUM_V, (step // NUM_V) & 1
        return step % NUM_K, (step // NUM_K) & 1

    @gluon.jit
    def _release(free, ring_step, NUM_V: gl.constexpr, pred=True):
        """A consumer releases ring step ``ring_step`` (its V, and the next step's K): barrier ``(ring_step + 1) %
        NUM_V``, so that step -1 (the program's first K read, which the loader's step ``NUM_V - 1`` waits for) has
        one too."""
        mbarrier.arrive(free.index((ring_step + 1) % NUM_V), count=1, pred=pred)

    @gluon.jit
    def _copy_kv_rings(k_desc, v_desc, kv_bufs, k_ready, v_ready, free, step, first, last, list_base, num_entries,
                       k_row, k_col, v_row, v_col, NUM_K: gl.constexpr, NUM_V: gl.constexpr):
        """Copy ring steps ``[first, last)`` of a query tile's K and V, a step of ``GROUP = BLOCK_N // UNIT`` list
        entries (one box of ``UNIT`` rows each; a step's missing entries repeat the last one, which the consumers
        mask), into a K ring of ``NUM_K = NUM_V - 1`` slots and a V ring of ``NUM_V``, ring step ``t`` once the
        consumers have released step ``t - NUM_V`` (``free``). ``k_row``, ``v_row``: the sequence's first key in the
        views. Returns ``step`` (ring steps loaded so far) past the copied ones."""
        BLOCK_N: gl.constexpr = kv_bufs.type.shape[1]
        UNIT: gl.constexpr = k_desc.block_type.shape[0]
        GROUP: gl.constexpr = BLOCK_N // UNIT
        gl.static_assert(NUM_K == NUM_V - 1, "a step's release frees its V and the next step's K")
        for j in range(first, last):
            # Ring step t's K reuses step t - NUM_K's slot, its V step t - NUM_V's: both free once the consumers
            # release ring step t - NUM_V (``_release``).
            mbarrier.wait(free.index((step + 1) % NUM_V), (((step + 1) // NUM_V) & 1) ^ 1)
            for is_v in gl.static_range(2):
                slot, phase = _kv_slot(step, is_v == 1, NUM_K, NUM_V)
                ready = v_ready.index(slot - NUM_K) if is_v == 1 else k_ready.index(slot)
                mbarrier.expect(ready, GROUP * k_desc.block_type.nbytes)
                for member in gl.static_range(GROUP):
                    first_key = gl.load(list_base + gl.minimum(j * GROUP + member, num_entries - 1)) * UNIT
                    if is_v == 1:
                        tma.async_copy_global_to_shared(v_desc, [v_row + first_key, v_col], ready,
                                                        kv_bufs.index(slot).slice(member * UNIT, UNIT))
                    else:
                        tma.async_copy_global_to_shared(k_desc, [k_row + first_key, k_col], ready,
                                                        kv_bufs.index(slot).slice(member * UNIT, UNIT))
            step += 1
        return step

    @gluon.jit
    def _claim_issue(work_counter):
        """Issue the claim of the next work item: an atomic add on ``work_counter`` by lane 0 of the loader's warp,
        whose result ``_claimed`` reads later, so that its L2 round trip overlaps the copies issued meanwhile.
        ``gl.atomic_add`` cannot: ptxas compiles an atomic whose address is the same in every lane as one aggregated
        atomic whose result is shuffled to the warp right after it, a wait for the round trip where it is issued.
        Hence the lane-dependent address ``work_counter + lane``: only lane 0's add executes (the predicate), the
        others' addresses are never accessed. Relaxed: with acq_rel, a ``MEMBAR.ALL.GPU`` would precede it."""
        lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.eq.s32 p, $2, 0; mov.u32 $0, 0; @p atom.relaxed.gpu.global.add.u32 $0, [$1], 1; }",
            "=r,l,r", [work_counter + lanes, lanes], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _claimed(claim):
        """The claim counter's value before ``_claim_issue``'s add (lane 0's result, the others' are 0)."""
        return gl.sum(claim, axis=0)

    @gluon.jit
    def stream_load_partition(q_desc, q_smem, q_strides, k_desc, v_desc, kv_bufs, q_ready, q_free, k_ready, v_ready,
                              free, work_smem, work_counter, work_args, kv_strides, TILE: gl.constexpr,
                              IS_VARLEN: gl.constexpr, NUM_K: gl.constexpr, NUM_V: gl.constexpr):
        """The forward's loader: claim the work items; per item publish its index and list counts
        (``publish_item``) and copy its Q into buffer ``n % 2`` (once item ``n - 2`` has released it), then its ring
        steps (``_copy_kv_rings``, a split step's first where the list has one), numbered on across items. The next
        item's claim is issued at each item's start and read after its first ``CLAIM_AFTER`` ring steps, where that
        item is decoded too: both L2 round trips (the atomic's, the counts') then pass while the consumers run this
        item, not at its end, where they delayed the next item's Q and first K (1.03x at 16 x 8192 and D=64 on an
        H100; bench/NOTES.md). After the last item, ``num_work`` as the index tells the consumers to stop."""
        num_work = work_args[0]
        q_heads_per_kv = work_args[-1]
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt = kv_strides
        ROWS: gl.constexpr = q_desc.block_type.shape[0]
        GROUP: gl.constexpr = kv_bufs.type.shape[1] // k_desc.block_type.shape[0]
        step = 0
        iteration = 0
        work = gl.program_id(0)
        # Past the last item (the stop), the fields of item 0, which are valid: not num_work - 1's, a value computed
        # from an argument, which would live in a spilled register (item_fields).
        seq, q_head, q_start, k_start, _, first_pos, tile_first, list_base, _, num_full, num_entries, split = work_item(
            gl.where(work < num_work, work, 0), work_args, TILE, IS_VARLEN, True)
        while work < num_work:
            claim = _claim_issue(work_counter)
            first_row = q_start + tile_first - first_pos
            qb = iteration % 2
            mbarrier.wait(q_free.index(qb), ((iteration // 2) & 1) ^ 1)
            publish_item(work_smem.index(qb), work, num_full, num_entries, split, tile_first, seq, q_head, q_start,
                         first_pos)
            mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
            row, col = head_origin(seq, q_head, q_strides[0], q_strides[1], q_strides[2])
            for half in gl.static_range(2):
                tma.async_copy_global_to_shared(q_desc, [row + first_row + half * ROWS, col], q_ready.index(qb),
                                                q_smem.index(qb * 2 + half))
            kv_head = q_head // q_heads_per_kv
            k_row, k_col = head_origin(seq, kv_head, stride_kb, stride_kh, stride_kt)
            v_row, v_col = head_origin(seq, kv_head, stride_vb, stride_vh, stride_vt)
            entries = split * GROUP + num_entries
            num_steps = gl.cdiv(entries, GROUP)
            claim_after = gl.minimum(num_steps, CLAIM_AFTER)
            step = _copy_kv_rings(k_desc, v_desc, kv_bufs, k_ready, v_ready, free, step, 0, claim_after, list_base,
                                  entries, k_row + k_start, k_col, v_row + k_start, v_col, NUM_K, NUM_V)
            # The next item, claimed at this one's start, is decoded while the consumers run this item's steps.
            work = gl.num_programs(0) + _claimed(claim)
            (n_seq, n_q_head, n_q_start, n_k_start, _, n_first_pos, n_tile_first, n_list_base, _, n_num_full,
             n_num_entries, n_split) = work_item(gl.where(work < num_work, work, 0), work_args, TILE, IS_VARLEN, True)
            step = _copy_kv_rings(k_desc, v_desc, kv_bufs, k_ready, v_ready, free, step, claim_after, num_steps,
                                  list_base, entries, k_row + k_start, k_col, v_row + k_start, v_col, NUM_K, NUM_V)
            iteration += 1
            seq = n_seq
            q_head = n_q_head
            q_start = n_q_start
            k_start = n_k_start
            first_pos = n_first_pos
            tile_first = n_tile_first
            list_base = n_list_base
            num_full = n_num_full
            num_entries = n_num_entries
            split = n_split
        qb = iteration % 2
        mbarrier.wait(q_free.index(qb), ((iteration // 2) & 1) ^ 1)
        publish_item(work_smem.index(qb), num_work, 0, 0, 0, 0, 0, 0, 0, 0)  # the stop: an item without entries
        mbarrier.arrive(q_ready.index(qb), count=1)

    @gluon.jit
    def _fast_reciprocal(x):
        """``1 / x`` to about an ulp (``rcp.approx``): the epilogue's per-row divisions, where the IEEE division's
        Newton steps and special cases added a dependent chain to every item's boundary."""
        return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _fast_log2(x):
        """``log2(x)`` to ~2^-22 absolute (``lg2.approx``, one MUFU instruction); ``gl.log2`` compiles to a
        polynomial of ~20 dependent instructions."""
        return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _store_item(acc, m_i, l_i, q_pos, consumer: gl.constexpr, record, seqlen_k_seq, qk_scale,
                    out_desc, stage, out_args, work_args, IS_VARLEN: gl.constexpr, o_layout: gl.constexpr):
        """The epilogue of consumer ``consumer``'s half of a work item (rows at positions ``q_pos``; the item's output
        fields from its ``record``, ``published_output``): its normalized output rows and their lse (natural log). A
        half whose rows are all real leaves through one TMA copy from ``stage``, the half's Q buffer, which no product
        reads any more: the caller waits for it (``tma.store_wait``) before it releases that buffer. As 32 four-byte
        stores a thread, each covering half a sector, the output held the consumer's registers and issue slots at
        every item's boundary (bench/NOTES.md, forty-fourth session). A half with rows outside its sequence (a
        sequence's last tile; the first where Tq < Tk) uses masked stores, which a TMA copy of the row view cannot
        mask."""
        out, lse, stride_ot, out_rows_b, out_rows_h, out_cols_h, stride_lb, stride_lh, stride_lt = out_args
        ROWS: gl.constexpr = acc.type.shape[0]
        HEAD_DIM: gl.constexpr = acc.type.shape[1]
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        tile_first, seq, q_head, q_start, first_pos = published_output(record)
        if not IS_VARLEN:  # the launch's, as item_fields takes them: one sequence start, one alignment
            q_start = 0
            first_pos = work_args[5]
        half_first = tile_first + consumer * ROWS
        seen = l_i > 0
        l_safe = gl.where(seen, l_i, 1.0)
        row_real = (q_pos >= first_pos) & (q_pos < seqlen_k_seq)
        lse_head = lse + seq.to(gl.int64) * stride_lb + q_head.to(gl.int64) * stride_lh
        lse_row = gl.where(seen, (m_i * qk_scale + _fast_log2(l_safe)) * 0.6931471805599453, -float("inf"))  # ln
        gl.store(lse_head + (q_start + q_pos - first_pos).to(gl.int64) * stride_lt, lse_row, mask=row_real)
        out_tile = (acc * gl.convert_layout(_fast_reciprocal(l_safe), rows_o)[:, None]).to(out.dtype.element_ty)
        # The half's first row and its head's column in the output's row view (launch: out_rows_b, ...).
        row = seq * out_rows_b + q_head * out_rows_h + q_start + half_first - first_pos
        col = q_head * out_cols_h
        if (half_first >= first_pos) & (half_first + ROWS <= seqlen_k_seq):
            stage.store(out_tile)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [row, col], stage)
        else:
            rows = (row + gl.arange(0, ROWS, layout=rows_o)).to(gl.int64)
            cols = col + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            gl.store(out + rows[:, None] * stride_ot + cols[None, :], out_tile,
                     mask=gl.convert_layout(row_real, rows_o)[:, None])

    @gluon.jit
    def _values(acc, alpha, p, kv_bufs, v_ready, v_slot, v_phase, NUM_K: gl.constexpr):
        """Issue ``O = alpha O + P V`` with the V in slot ``v_slot`` (asynchronous: wait with
        ``warpgroup_mma_wait``)."""
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(v_slot - NUM_K), v_phase)
        return warpgroup_mma(gl.convert_layout(p.to(kv_bufs.dtype), p_layout), kv_bufs.index(v_slot), acc,
                             is_async=True)

    @gluon.jit
    def _item_start(consumer: gl.constexpr, q_tile, kv_bufs, k_ready, v_ready, free, s_first, prefetched, pending,
                    step, split_base, split_bits, num_full, num_entries, split, q_pos, block_in_tile, seqlen_k_seq,
                    qk_scale, UNIT: gl.constexpr, NUM_K: gl.constexpr, NUM_V: gl.constexpr):
        """A work item's start, from ring step ``step``: its split step where it has one, and its first regular
        step's softmax, whose scores ``s_first`` the last item's last step computed where ``prefetched`` (else they
        are computed here). ``pending``: ring step ``step - 1``'s release is owed, paid once this item's first K has
        been read. Returns ``(p, alpha, m_i, l_i, acc, step)`` for the item's step loop."""
        ROWS: gl.constexpr = q_tile.type.shape[0]
        HEAD_DIM: gl.constexpr = q_tile.type.shape[1]
        BLOCK_N: gl.constexpr = kv_bufs.type.shape[1]
        GROUP: gl.constexpr = BLOCK_N // UNIT
        HALF: gl.constexpr = BLOCK_N // 2
        s_layout: gl.constexpr = warpgroup_layout(BLOCK_N)
        o_layout: gl.constexpr = warpgroup_layout(HEAD_DIM)
        half_layout: gl.constexpr = warpgroup_layout(HALF)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_half: gl.constexpr = gl.SliceLayout(1, half_layout)
        list_base = split_base + split * GROUP
        bits_base = split_bits + split * GROUP
        num_steps = gl.cdiv(num_entries, GROUP)
        m_i = gl.full([ROWS], -float("inf"), gl.float32, rows_s)
        l_i = gl.zeros([ROWS], gl.float32, rows_s)
        alpha = gl.zeros([ROWS], gl.float32, rows_s)
        p = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        if (prefetched == 0) & (num_steps > 0):  # a program's first item, or one after an item without steps
            slot, phase = _kv_slot(step + split, False, NUM_K, NUM_V)
            mbarrier.wait(k_ready.index(slot), phase)
            s_first = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(
                q_tile, kv_bufs.index(slot).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                use_acc=False, is_async=True),))
            _release(free, step - 1, NUM_V, pred=(pending != 0) & (split == 0))
        if num_steps > 0:
            if split != 0:
                # The split step: this consumer's half of the slot holds the entries only its rows keep.
                k_slot, k_phase = _kv_slot(step, False, NUM_K, NUM_V)
                v_slot, v_phase = _kv_slot(step, True, NUM_K, NUM_V)
                mbarrier.wait(k_ready.index(k_slot), k_phase)
                s_half = warpgroup_mma(q_tile, kv_bufs.index(k_slot).slice(consumer * HALF, HALF).permute((1, 0)),
                                       gl.zeros([ROWS, HALF], gl.float32, half_layout), use_acc=False, is_async=True)
                s_half = warpgroup_mma_wait(num_outstanding=0, deps=(s_half,))
                _release(free, step - 1, NUM_V, pred=pending != 0)
                q_pos_half = gl.convert_layout(q_pos, rows_half)
                visible = partial_visible(consumer, GROUP, split_base, split_bits, q_pos_half,
                                          gl.convert_layout(block_in_tile, rows_half), seqlen_k_seq, UNIT, HALF,
                                          half_layout)
                s_half = gl.where(visible, s_half, -float("inf"))
                m_half = gl.max(s_half, 1)
                m_scaled = gl.where(m_half == -float("inf"), 0.0, m_half * qk_scale)
                p_half = gl.exp2(s_half * qk_scale - m_scaled[:, None])
                m_i = gl.convert_layout(m_half, rows_s)
                l_i = gl.convert_layout(gl.sum(p_half, 1), rows_s)
                mbarrier.wait(v_ready.index(v_slot - NUM_K), v_phase)
                acc = warpgroup_mma(gl.convert_layout(p_half.to(kv_bufs.dtype), p_layout),
                                    kv_bufs.index(v_slot).slice(consumer * HALF, HALF), acc, use_acc=False,
                                    is_async=True)
                p, alpha, m_i, l_i = _softmax_step(s_first, m_i, l_i, 0, num_full, num_entries, list_base, bits_base,
                                                   q_pos, block_in_tile, seqlen_k_seq, qk_scale, UNIT, s_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _release(free, step, NUM_V)
                step += 1
            else:
                p, alpha, m_i, l_i = _softmax_step(s_first, m_i, l_i, 0, num_full, num_entries, list_base, bits_base,
                                                   q_pos, block_in_tile, seqlen_k_seq, qk_scale, UNIT, s_layout)
        return p, alpha, m_i, l_i, acc, step

    @gluon.jit
    def _start_second_consumer(second_start, started, needed):
        """Consumer 0 lets consumer 1 start (``second_start``) right before its first wait that may depend on consumer
        1 (``needed``): for a ring step's K ``NUM_V - 1`` or more steps on (the loader copies ring step ``t`` once both
        consumers have released step ``t - NUM_V``), or for the Q of the program's third item or later (copied once
        both have released the first's). Consumer 1 then runs up to ``NUM_V - 2`` ring steps behind, as far as the
        ring allows. ``started``: whether it has (0 or 1); returns it."""
        start = (started == 0) & needed
        # A branch, not the arrive's predicate: a consumer's arrive compiles to warp-group barriers around it, which
        # as a predicated arrive ran at every step of consumer 0's loop (3 a step instead of 1; bench/NOTES.md).
        if start:
            mbarrier.arrive(second_start, count=1)
        return started | start.to(gl.int32)

    @gluon.jit
    def _compute_partition(consumer: gl.constexpr, q_smem, kv_bufs, q_ready, q_free, k_ready, v_ready, free,
                           second_start, work_smem, work_args, out_desc, out_args, qk_scale, TILE: gl.constexpr,
                           BLOCK_SIZE: gl.constexpr, UNIT: gl.constexpr, IS_VARLEN: gl.constexpr, NUM_K: gl.constexpr,
                           NUM_V: gl.constexpr):
        """Consumer ``consumer`` (0 or 1): rows ``consumer * ROWS ...`` of each work item's query tile.

        Consumer 1 starts when consumer 0 lets it (``_start_second_consumer``). Per item: ``_item_start`` (split
        step, first softmax), the step loop over all regular steps but the last (FlashAttention-3's order), then the
        last step, which issues with its ``P V`` the next item's first regular ``Q K^T`` from the other Q buffer.
        Where there is none (no next item, or one without steps), that product reads the last step's V instead and is
        discarded, so that the code has one path. Then the epilogue, while the other consumer's steps run."""
        num_work = work_args[0]
        ROWS: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = kv_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
        GROUP: gl.constexpr = BLOCK_N // UNIT
        s_layout: gl.constexpr = warpgroup_layout(BLOCK_N)
        o_layout: gl.constexpr = warpgroup_layout(HEAD_DIM)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        step = 0
        iteration = 0
        pending = 1  # whether the release of ring step step - 1 is owed (see the boundary; at first, step -1's)
        started = 0  # consumer 0: whether it has let consumer 1 start
        if consumer == 1:
            mbarrier.wait(second_start, 0)
        mbarrier.wait(q_ready.index(0), 0)
        work, num_full, num_entries, split = published_item(work_smem.index(0))
        (_, _, _, _, seqlen_k_seq, _, tile_first, split_base, split_bits, _, _) = item_fields(
            gl.where(work < num_work, work, 0), work_args, TILE, IS_VARLEN)
        q_pos, block_in_tile = consumer_rows(tile_first, consumer, ROWS, BLOCK_SIZE, rows_s)
        p, alpha, m_i, l_i, acc, step = _item_start(
            consumer, q_smem.index(consumer), kv_bufs, k_ready, v_ready, free,
            gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), 0, pending, step, split_base, split_bits, num_full,
            num_entries * (work < num_work), split, q_pos, block_in_tile, seqlen_k_seq, qk_scale, UNIT, NUM_K, NUM_V)
        pending = pending * (num_entries * (work < num_work) == 0)
        while work < num_work:
            qb = iteration % 2
            q_tile = q_smem.index(qb * 2 + consumer)
            list_base = split_base + split * GROUP
            bits_base = split_bits + split * GROUP
            num_steps = gl.cdiv(num_entries, GROUP)
            for j in range(num_steps - 1):
                if consumer == 0:
                    started = _start_second_consumer(second_start, started, step + 1 >= NUM_V - 1)
                k_slot, k_phase = _kv_slot(step + 1, False, NUM_K, NUM_V)
                mbarrier.wait(k_ready.index(k_slot), k_phase)
                s = warpgroup_mma(q_tile, kv_bufs.index(k_slot).permute((1, 0)),
                                  gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
                v_slot, v_phase = _kv_slot(step, True, NUM_K, NUM_V)
                acc = _values(acc, alpha, p, kv_bufs, v_ready, v_slot, v_phase, NUM_K)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                if num_full >= 0:  # always: the branch keeps ptxas from moving the wait for P V above the softmax
                    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j + 1, num_full, num_entries, list_base,
                                                       bits_base, q_pos, block_in_tile, seqlen_k_seq, qk_scale, UNIT,
                                                       s_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _release(free, step, NUM_V)
                step += 1
            # The next item (its Q was copied while this one ran).
            next_qb = (iteration + 1) % 2
            if consumer == 0:
                started = _start_second_consumer(second_start, started, iteration + 1 >= 2)
            mbarrier.wait(q_ready.index(next_qb), ((iteration + 1) // 2) & 1)
            next_work, n_num_full, n_num_entries, n_split = published_item(work_smem.index(next_qb))
            (_, _, _, _, n_seqlen_k_seq, _, n_tile_first, n_split_base, n_split_bits, _, _) = item_fields(
                gl.where(next_work < num_work, next_work, 0), work_args, TILE, IS_VARLEN)
            n_num_entries = n_num_entries * (next_work < num_work)
            has_first = n_num_entries > 0
            s_first = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
            prefetched = 0
            if num_steps > 0:
                # The last step: its P V, with the next item's first regular scores (or a discarded product).
                v_slot, v_phase = _kv_slot(step, True, NUM_K, NUM_V)
                first_slot, first_phase = _kv_slot(step + 1 + n_split, False, NUM_K, NUM_V)
                if consumer == 0:
                    started = _start_second_consumer(second_start, started, step + 1 + n_split >= NUM_V - 1)
                mbarrier.wait(k_ready.index(first_slot), first_phase, pred=has_first)
                first_slot = gl.where(has_first, first_slot, v_slot)  # else a discarded product on the last V
                s_next = warpgroup_mma(q_smem.index(next_qb * 2 + consumer),
                                       kv_bufs.index(first_slot).permute((1, 0)),
                                       gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
                acc = _values(acc, alpha, p, kv_bufs, v_ready, v_slot, v_phase, NUM_K)
                s_first = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                # The next ring step's K was read by s_next only where it is a plain first step; else the release
                # waits for the item that reads it.
                released = has_first & (n_split == 0)
                _release(free, step, NUM_V, pred=released)
                pending = 1 - released.to(gl.int32)
                step += 1
                prefetched = has_first.to(gl.int32)
            _store_item(acc, m_i, l_i, q_pos, consumer, work_smem.index(qb), seqlen_k_seq, qk_scale, out_desc,
                        q_smem.index(qb * 2 + consumer), out_args, work_args, IS_VARLEN, o_layout)
            iteration += 1
            work = next_work
            seqlen_k_seq = n_seqlen_k_seq
            tile_first = n_tile_first
            split_base = n_split_base
            split_bits = n_split_bits
            num_full = n_num_full
            num_entries = n_num_entries
            split = n_split
            q_pos, block_in_tile = consumer_rows(tile_first, consumer, ROWS, BLOCK_SIZE, rows_s)
            if consumer == 0:  # (where the last step prefetched nothing, _item_start reads the first K)
                started = _start_second_consumer(second_start, started, step + split >= NUM_V - 1)
            p, alpha, m_i, l_i, acc, step = _item_start(
                consumer, q_smem.index(next_qb * 2 + consumer), kv_bufs, k_ready, v_ready, free, s_first, prefetched,
                pending, step, split_base, split_bits, num_full, num_entries, split, q_pos, block_in_tile,
                seqlen_k_seq, qk_scale, UNIT, NUM_K, NUM_V)
            pending = pending * (num_entries == 0)  # paid by _item_start unless the item has no steps
            # The output's copy out of this item's Q buffer (issued before _item_start) has been read by now: the
            # loader may bring the item after next's Q and record into it (the epilogue read this item's record).
            tma.store_wait(0)
            mbarrier.arrive(q_free.index(qb), count=1)
        if consumer == 0:
            started = _start_second_consumer(second_start, started, True)  # a program with too few steps to wait

    @gluon.jit
    def s2_attention_fwd_ws_kernel(
        # row descriptors (layouts.row_view): boxes [ROWS, D], [UNIT, D] x 2, [ROWS, D]
        q_desc, k_desc, v_desc, out_desc,
        out, lse,  # [B, Hq, Tq, D], [B, Hq, Tq] float32
        unit_lists, unit_bits, unit_counts,  # the forward's lists for 2 * ROWS-row tiles (split_first_step)
        cu_seqlens_q, cu_seqlens_k,  # int32 [S + 1], read only when IS_VARLEN
        work_counter,  # int32 [1], zero: work items claimed after each program's first
        # int64, as the offsets they scale: an int32 argument's sign extension, hoisted above the partitions, lived in
        # a spilled register (item_fields).
        stride_qb: tl.int64, stride_qh: tl.int64, stride_qt: tl.int64, stride_kb: tl.int64, stride_kh: tl.int64,
        stride_kt: tl.int64, stride_vb: tl.int64, stride_vh: tl.int64, stride_vt: tl.int64, stride_ot: tl.int64,
        stride_lb: tl.int64, stride_lh: tl.int64, stride_lt: tl.int64, stride_up: tl.int64, stride_ut: tl.int64,
        stride_cp: tl.int64, stride_ct: tl.int64,
        out_rows_b, out_rows_h, out_cols_h,  # a head's first row and column in out's row view (output_origin)
        first_pos, seqlen_k, last_tile,  # Tk - Tq and the last query tile (ignored with varlen)
        qk_scale, q_heads_per_pattern, q_heads_per_kv, num_q_tiles, num_q_heads, num_work,
        BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr, NUM_K_BUFFERS: gl.constexpr,
        NUM_V_BUFFERS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
    ):
        """Persistent: program ``p`` runs work item ``p`` of ``num_work = num_q_tiles * Hq * (B or S)``
        (``work_item``), then the items it claims from ``work_counter`` (``P, P + 1, ...`` in claim order), so that
        one item's epilogue overlaps the next one's loads and first scores. ``qk_scale = scale * log2(e)``; launched
        with 4 warps (consumer 0) plus the two worker partitions."""
        ROWS: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        UNIT: gl.constexpr = k_desc.block_type.shape[0]
        TILE: gl.constexpr = 2 * ROWS
        # Q: [2 buffers x 2 consumers' halves, ROWS, D]; K's ring (slots [0, NUM_K_BUFFERS)), then V's, in one
        # allocation so that either can be a product's operand by index. K's and V's barriers are separate
        # allocations (with one for both, Triton put a warp-group barrier before each step's V wait).
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [4] + q_desc.block_type.shape, q_desc.layout)
        kv_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_K_BUFFERS + NUM_V_BUFFERS, BLOCK_N, HEAD_DIM],
                                            k_desc.layout)
        # Per Q buffer, its item's index, list counts and output fields (publish_item).
        work_smem = gl.allocate_shared_memory(gl.int32, [2, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        second_start = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_K_BUFFERS, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_V_BUFFERS, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [NUM_V_BUFFERS, 1], mbarrier.MBarrierLayout())  # ``_release``
        for b in gl.static_range(2):
            mbarrier.init(q_ready.index(b), count=1)
            mbarrier.init(q_free.index(b), count=2)  # both consumers release Q
        mbarrier.init(second_start, count=1)
        for slot in gl.static_range(NUM_K_BUFFERS):
            mbarrier.init(k_ready.index(slot), count=1)
        for slot in gl.static_range(NUM_V_BUFFERS):
            mbarrier.init(v_ready.index(slot), count=1)
        for slot in gl.static_range(NUM_V_BUFFERS):
            mbarrier.init(free.index(slot), count=2)  # both consumers release a ring step

        work_args = (num_work, num_q_tiles, num_q_heads, cu_seqlens_q, cu_seqlens_k, first_pos, seqlen_k, last_tile,
                     unit_lists, unit_bits, unit_counts, stride_up, stride_ut, stride_cp, stride_ct,
                     q_heads_per_pattern, q_heads_per_kv)
        out_args = (out, lse, stride_ot, out_rows_b, out_rows_h, out_cols_h, stride_lb, stride_lh, stride_lt)
        kv_strides = (stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt)
        gl.warp_specialize(
            [
                (_compute_partition, (0, q_smem, kv_bufs, q_ready, q_free, k_ready, v_ready, free, second_start,
                                      work_smem, work_args, out_desc, out_args, qk_scale, TILE, BLOCK_SIZE, UNIT,
                                      IS_VARLEN,
                                      NUM_K_BUFFERS, NUM_V_BUFFERS)),
                (_compute_partition, (1, q_smem, kv_bufs, q_ready, q_free, k_ready, v_ready, free, second_start,
                                      work_smem, work_args, out_desc, out_args, qk_scale, TILE, BLOCK_SIZE, UNIT,
                                      IS_VARLEN,
                                      NUM_K_BUFFERS, NUM_V_BUFFERS)),
                (stream_load_partition, (q_desc, q_smem, (stride_qb, stride_qh, stride_qt), k_desc, v_desc, kv_bufs,
                                         q_ready, q_free, k_ready, v_ready, free, work_smem, work_counter, work_args,
                                         kv_strides, TILE, IS_VARLEN, NUM_K_BUFFERS, NUM_V_BUFFERS)),
            ],
            [4, 1],
            [CONSUMER_REGISTERS, LOADER_REGISTERS],
        )


def supported(q: torch.Tensor, k: torch.Tensor, causal: bool, block_size: int) -> bool:
    """Whether this kernel can run the call, given row views of q, k and v (``layouts.row_view``)."""
    return (
        AVAILABLE and q.is_cuda and causal and q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype
        and q.shape[-1] in (64, 128) and block_size >= 32 and is_sm90(q.device)
    )


@functools.cache
def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` has compute capability 9.0, the one these kernels are written for (asked once a device:
    the query is on every call's host path)."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def launch(q, k, v, out, lse, row_views, lists, problem, qk_scale: float, block_size: int, block_n: int,
           num_pattern_heads: int, num_buffers: int) -> None:
    """Run the kernel. ``row_views``: ``(shape, strides)`` of q, k and v seen as rows (``layouts.row_view``; ``out``,
    from ``layouts.empty_heads_last``, always has one);
    ``lists``: the forward's lists for ``BLOCK_M``-row query tiles and ``block_n``-key units, through
    ``triton_impl.split_first_step``; ``problem``: ``triton_impl._Problem``; ``num_buffers``: the V ring's slots
    (K's ring has one fewer)."""
    units, bits, counts = lists
    unit = min(block_size, block_n)  # keys per list entry: one TMA box
    out_view = row_view(out)
    descriptors = row_descriptors((q, k, v, out), (*row_views, out_view), (CONSUMER_ROWS, unit, unit, CONSUMER_ROWS))
    num_q_heads = q.shape[1]
    num_q_tiles = problem.num_q_tiles(BLOCK_M)
    num_work = num_q_tiles * num_q_heads * problem.num_seqs
    grid = (min(num_work, _num_sms(q.device)),)
    consumer_registers, loader_registers = REGISTERS[block_n]
    s2_attention_fwd_ws_kernel[grid](
        *descriptors, out, lse, units, bits, counts, problem.cu_seqlens_q, problem.cu_seqlens_k,
        torch.zeros(1, dtype=torch.int32, device=q.device),  # the work counter: a fresh zero for every launch
        *problem.strides(q)[:3], *problem.strides(k)[:3], *problem.strides(v)[:3], out.stride(2),
        *problem.strides(lse), *units.stride()[:2], *counts.stride()[:2], *output_origin(problem.strides(out)),
        *item_args(q, k), qk_scale, num_q_heads // num_pattern_heads, num_q_heads // k.shape[1],
        num_q_tiles, num_q_heads, num_work,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, IS_VARLEN=problem.is_varlen, NUM_K_BUFFERS=num_buffers - 1,
        NUM_V_BUFFERS=num_buffers, CONSUMER_REGISTERS=consumer_registers, LOADER_REGISTERS=loader_registers,
        num_warps=4, maxnreg=MAXNREG,
    )


def output_origin(out_strides: tuple[int, ...]) -> tuple[int, int, int]:
    """``out_rows_b, out_rows_h, out_cols_h``: batch row (or packed sequence) ``b`` and head ``h`` start at row
    ``b * out_rows_b + h * out_rows_h`` and column ``h * out_cols_h`` of the output's row view (``layouts.row_view``
    of ``[B, H, T, D]`` with ``out_strides``, the batch stride zeroed with varlen). Where the view exists, a head's
    offset splits so: the batch stride is a whole number of rows (or there is one batch row) and the head stride
    either is too or stays inside one row. Computed here, the consumers' epilogue needs no 64-bit division
    (``head_origin``'s)."""
    stride_b, stride_h, row_stride = out_strides[:3]
    return stride_b // row_stride, stride_h // row_stride, stride_h % row_stride


def item_args(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    """The kernels' ``first_pos, seqlen_k, last_tile`` for ``item_fields`` (ignored with varlen): where query row 0 sits
    among the keys (``Tk - Tq``, bottom-right alignment), the key length, and the last ``BLOCK_M``-row query tile."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    return seqlen_k - seqlen_q, seqlen_k, (seqlen_k - 1) // BLOCK_M


def row_descriptors(tensors, row_views, box_rows) -> list:
    """TMA descriptors of 16-bit ``tensors`` seen as rows (``row_views``: their ``(shape, strides)``,
    ``layouts.row_view``), boxes of ``box_rows`` rows each by the head dim, in wgmma's shared-memory layout."""
    gl_dtype = gl.float16 if tensors[0].dtype == torch.float16 else gl.bfloat16
    head_dim = tensors[0].shape[-1]
    descriptors = []
    for t, (shape, strides), rows in zip(tensors, row_views, box_rows, strict=True):
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)
        descriptors.append(GluonTensorDescriptor(t, shape, strides, [rows, head_dim], layout))
    return descriptors


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
