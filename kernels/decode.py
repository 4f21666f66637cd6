"""Decode / chunked-prefill S2 attention over a *compact* KV cache that holds only the blocks S2 can still read.

Compact layout (``CompactLayout``), per (batch row, KV head), in slots of ``block_size`` tokens::

    keys/values [B, Hkv, num_slots * block_size, D]
    slot s < ring_slots:   ring (local window). Holds the newest block j <= last with j % ring_blocks == s,
                           unless j is a vertical block of this KV head (then the slot is empty).
    slot s >= ring_slots:  vertical blocks, never evicted. v = s - ring_slots is the ordinal of the block among
                           the KV head's vertical blocks: j = (v // nv) * vert_stride + residues[v % nv].

``last = (n - 1) // block_size`` for a row holding ``n`` tokens (positions counted from its first real token).
A KV head's vertical residues are the ``j % vert_stride`` of the vertical blocks of its pattern heads (one with
KV-head patterns, the union over the query group with ``per_query_head``; every residue for a dense head). A
non-vertical block is overwritten exactly when the window has slid past it (``ring_blocks >= local_blocks``), so
memory is the local window plus the vertical blocks: the kept fraction of the pattern. The slot -> block map is a
pure function of ``n``: no block table is stored; ``slot_blocks`` computes it (the Triton kernel inlines it).

The op: ``s2_decode_attention(q, k_cache, v_cache, seq_lens, layout)`` with q ``[B, Hq, Tq, D]`` the newest
``Tq`` tokens of every row (row ``b``'s query ``t`` at position ``seq_lens[b] - Tq + t``; negative positions are
left padding and return 0), already written into the cache. Mask: the pattern's block rule + causal + validity.

Only torch is imported here; Triton is imported on first use (``decode_triton.py``).
"""

from __future__ import annotations

import functools
import math

import torch

from .interface import OP_NAMESPACE, check_backend, check_scale, pattern_from_ints, pattern_to_ints, use_triton
from .layouts import CompactLayout
from .pattern import S2Pattern

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: PyTorch path only
# Upper bound on score elements materialized per chunk of queries by the PyTorch path (float32: 4 bytes each).
_MAX_SCORE_ELEMENTS = 1 << 25


def ring_blocks_for(pattern: S2Pattern, num_new_tokens: int) -> int:
    """The ring modulus that lets a write of ``num_new_tokens`` tokens precede the chunk's attention."""
    return pattern.local_blocks + -(-max(0, num_new_tokens - 1) // pattern.block_size)


# ---------------------------------------------------------------------------------------------- slot <-> block
def slot_blocks(layout: CompactLayout, seq_lens: torch.Tensor, num_ring: int, num_slots: int) -> torch.Tensor:
    """The block each slot holds: int64 ``[B, Hkv, num_slots]``, -1 for an empty slot.

    ``seq_lens`` int ``[B]``: tokens per row; ``num_ring`` ring slots are allocated, then the vertical slots.
    """
    residues, rank, counts, _ = (t.long() for t in layout.tables(seq_lens.device))
    vs = layout.pattern.vert_stride
    last = ((seq_lens.long() - 1).div(layout.block_size, rounding_mode="floor"))[:, None, None]  # [B, 1, 1]
    slot = torch.arange(num_slots, device=seq_lens.device)[None, None, :]  # [1, 1, S]
    # ring: newest j <= last with j = slot (mod ring_blocks), empty if that block is vertical (stored below)
    ring_block = slot + (last - slot).div(layout.ring_blocks, rounding_mode="floor") * layout.ring_blocks
    kv = torch.arange(layout.num_kv_heads, device=seq_lens.device)[None, :, None]  # [1, Hkv, 1]
    ring_vertical = rank[kv, ring_block.clamp(min=0) % vs] >= 0
    ring_ok = (slot < num_ring) & (slot <= last) & ~ring_vertical
    # vertical: ordinal v among the KV head's vertical blocks
    v = (slot - num_ring).clamp(min=0)
    nv = counts[kv]
    vertical_block = v.div(nv, rounding_mode="floor") * vs + residues[kv, v % nv]
    vertical_ok = (slot >= num_ring) & (vertical_block <= last)
    block = torch.where(slot < num_ring, ring_block, vertical_block)
    return torch.where(ring_ok | vertical_ok, block, -1)


def block_slots(layout: CompactLayout, blocks: torch.Tensor, num_ring: int) -> torch.Tensor:
    """The slot of each block ``blocks`` int64 ``[B, Hkv, N]`` (>= 0) in a layout with ``num_ring`` ring slots:
    vertical blocks have a fixed slot, the others ``j % ring_blocks``. The caller ensures the block is current."""
    _, rank, counts, _ = (t.long() for t in layout.tables(blocks.device))
    vs = layout.pattern.vert_stride
    kv = torch.arange(layout.num_kv_heads, device=blocks.device)[None, :, None]
    r = rank[kv, blocks % vs]
    vertical_slot = num_ring + blocks.div(vs, rounding_mode="floor") * counts[kv] + r
    return torch.where(r >= 0, vertical_slot, blocks % layout.ring_blocks)


def s2_cache_append(k_cache, v_cache, key, value, seq_lens, layout: CompactLayout, *, num_ring_slots: int,
                    advance_lengths: bool = False, backend: str = "auto") -> None:
    """Write the ``Tq`` newest tokens of every row into their slots of the compact cache, in place.

    ``key/value [B, Hkv, Tq, D]``: row ``b``'s token ``t`` sits at position ``seq_lens[b] - Tq + t``; negative
    positions (left padding of a row that is still empty) are skipped. ``k_cache/v_cache [B, Hkv, S * bs, D]`` in
    ``layout`` with ``num_ring_slots`` ring slots, with room for the new blocks (see ``ring_blocks_for``).
    On CUDA one Triton launch does it; decoding calls this once per layer and step.

    ``advance_lengths=True``: ``seq_lens`` holds the lengths before the new tokens (all real: row ``b``'s token
    ``t`` at ``seq_lens[b] + t``), and the call adds ``Tq`` to them in place, on CUDA inside the same launch, so
    that a decode step runs no separate kernel for it (``S2StaticLayer``'s steps). Runs as the custom op
    ``s2::cache_append`` (mutating the caches and the lengths), so ``torch.compile`` traces it without a graph
    break.
    """
    check_backend(backend)
    if not isinstance(advance_lengths, bool):
        raise ValueError(f"advance_lengths must be a bool, got {advance_lengths!r}")
    cache_append_op(k_cache, v_cache, key, value, seq_lens, pattern_to_ints(layout.pattern), layout.num_q_heads,
                    layout.ring_blocks, num_ring_slots, advance_lengths, backend)


@torch.library.custom_op(f"{OP_NAMESPACE}::cache_append", mutates_args=("k_cache", "v_cache", "seq_lens"))
def cache_append_op(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    seq_lens: torch.Tensor, pattern: list[int], num_q_heads: int, ring_blocks: int,
                    num_ring_slots: int, advance_lengths: bool, backend: str) -> None:
    """``s2_cache_append`` with the layout as ``(pattern_to_ints(pattern), num_q_heads, ring_blocks)``."""
    layout = _layout_from_ints(tuple(pattern), num_q_heads, key.shape[1], ring_blocks)
    if not use_triton(backend, key):
        if advance_lengths:
            seq_lens.add_(key.shape[2])
        return _cache_append_torch(k_cache, v_cache, key, value, seq_lens, layout, num_ring_slots)
    from .decode_triton import cache_append_triton

    cache_append_triton(k_cache, v_cache, key, value, seq_lens, layout, num_ring_slots, advance_lengths)


@cache_append_op.register_fake
def _cache_append_fake(*args) -> None:
    return None


@functools.lru_cache(maxsize=256)
def _layout_from_ints(pattern: tuple[int, ...], num_q_heads: int, num_kv_heads: int, ring_blocks: int):
    """The ``CompactLayout`` an op's arguments describe (one instance per layout, so its tables stay cached)."""
    return CompactLayout(pattern_from_ints(pattern), num_q_heads, num_kv_heads, ring_blocks)


def _cache_append_torch(k_cache, v_cache, key, value, seq_lens, layout, num_ring):
    batch, num_kv, tq, _ = key.shape
    bs = layout.block_size
    pos = seq_lens[:, None] - tq + torch.arange(tq, device=key.device)  # [B, Tq]
    blocks = pos.clamp(min=0).div(bs, rounding_mode="floor")[:, None, :].expand(batch, num_kv, tq)
    cache_rows = block_slots(layout, blocks, num_ring) * bs + (pos.clamp(min=0) % bs)[:, None, :]  # [B, Hkv, Tq]
    rows = torch.arange(batch, device=key.device)[:, None, None].expand_as(cache_rows)
    heads = torch.arange(num_kv, device=key.device)[None, :, None].expand_as(cache_rows)
    real = (pos >= 0)[:, None, :].expand_as(cache_rows)
    k_cache[rows[real], heads[real], cache_rows[real]] = key[real]
    v_cache[rows[real], heads[real], cache_rows[real]] = value[real]


def visible_blocks(layout: CompactLayout, q_blocks: torch.Tensor, k_blocks: torch.Tensor) -> torch.Tensor:
    """The pattern's block rule (causal) for query block ``q_blocks`` [..., M, 1] of pattern heads given by the
    leading dim ``[P, ...]`` against key blocks ``k_blocks`` [..., 1, N]: ``bool`` broadcast of the two."""
    p = layout.pattern
    num_heads = layout.num_pattern_heads
    head = torch.arange(num_heads, device=q_blocks.device).view(-1, *([1] * (q_blocks.dim() - 1)))
    vertical = (k_blocks + head * p.head_step(num_heads) + p.head_sliding_offset) % p.vert_stride == 0
    keep = (q_blocks - k_blocks < p.local_blocks) | vertical | (head >= num_heads - p.num_dense_heads)
    return keep & (k_blocks <= q_blocks)


# ---------------------------------------------------------------------------------------------- the op
def s2_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: CompactLayout,
    *,
    num_ring_slots: int,
    scale: float | None = None,
    backend: str = "auto",
    num_splits: int | None = None,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """S2 attention of the newest ``Tq`` tokens of every row over a compact cache.

    Args:
        q: ``[B, Hq, Tq, D]`` fp16/bf16/fp32 (float64 on the PyTorch path). Row ``b``'s query ``t`` sits at
            position ``seq_lens[b] - Tq + t`` (counted from the row's first real token); negative = padding.
        k_cache, v_cache: ``[B, Hkv, S * block_size, D]`` in ``layout`` with ``num_ring_slots`` ring slots; the
            queries' own tokens already written.
        seq_lens: int ``[B]`` tokens per row (including the ``Tq`` new ones), on q's device.
        layout: the ``CompactLayout``.
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` (on CPU only with
            ``TRITON_INTERPRET=1``) or ``"torch"``.
        num_splits: split-KV factor of the Triton kernel (default: enough programs to fill the GPU).
        split_counters: int32 ``[>= B * Hkv]`` on q's device, all zero, which the Triton kernel uses to find the
            last split of each (row, KV head) and leaves zero again: a caller that decodes step after step keeps one
            (the cache layers do) and saves a fill per call. ``None``, or too few for the call (long chunks), and
            the call allocates its own.

    Returns:
        ``[B, Hq, Tq, D]`` in q's dtype (contiguous); rows of padding queries (or that see no key) are 0.

    Runs as the custom op ``s2::decode_attention``, so ``torch.compile`` traces it without a graph break.
    """
    _check_inputs(q, k_cache, v_cache, seq_lens, layout, num_ring_slots)
    scale = check_scale(scale, q.shape[-1])
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be an integer >= 1, got {num_splits!r}")
    check_backend(backend)
    if split_counters is not None and (not isinstance(split_counters, torch.Tensor) or split_counters.dtype !=
                                       torch.int32 or split_counters.dim() != 1 or split_counters.device != q.device):
        raise ValueError(
            f"split_counters must be a 1-D int32 tensor on q's device ({q.device}), got {split_counters!r}"
        )
    return decode_attention_op(q, k_cache, v_cache, seq_lens, pattern_to_ints(layout.pattern), layout.ring_blocks,
                               num_ring_slots, scale, backend, num_splits, split_counters)


# split_counters is declared mutated although the kernel leaves it as it found it (zero): its values change while
# the kernel runs.
@torch.library.custom_op(f"{OP_NAMESPACE}::decode_attention", mutates_args=("split_counters",))
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                        pattern: list[int], ring_blocks: int, num_ring_slots: int, scale: float, backend: str,
                        num_splits: int | None, split_counters: torch.Tensor | None) -> torch.Tensor:
    """``s2_decode_attention`` with the layout as ``(pattern_to_ints(pattern), ring_blocks)`` (heads from shapes)."""
    layout = _layout_from_ints(tuple(pattern), q.shape[1], k_cache.shape[1], ring_blocks)
    if not use_triton(backend, q):
        return decode_attention_torch(q, k_cache, v_cache, seq_lens, layout, num_ring_slots, scale)
    try:
        from .decode_triton import decode_attention_triton
    except ImportError as e:  # no Triton on this machine
        raise ValueError(f'backend="triton" needs Triton, which failed to import: {e}') from e
    return decode_attention_triton(q, k_cache, v_cache, seq_lens, layout, num_ring_slots, scale, num_splits,
                                   split_counters=split_counters).contiguous()


@decode_attention_op.register_fake
def _decode_attention_fake(q, *args):
    return q.new_empty(q.shape)


def _check_inputs(q, k_cache, v_cache, seq_lens, layout, num_ring_slots):
    if not isinstance(layout, CompactLayout):
        raise ValueError(f"layout must be a CompactLayout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t))}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in DTYPES:
        raise ValueError(
            f"q, k_cache, v_cache must share one dtype of {DTYPES}, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    b, hq, _, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if hq != layout.num_q_heads or k_cache.shape[1] != layout.num_kv_heads:
        raise ValueError(
            f"q has {hq} heads and the cache {k_cache.shape[1]}; the layout expects Hq={layout.num_q_heads}, "
            f"Hkv={layout.num_kv_heads}"
        )
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not match q {tuple(q.shape)} (batch, head dim)")
    if d < 16 or d > 256 or d % 16:
        raise ValueError(f"head dim D must be a multiple of 16 in [16, 256], got {d}")
    if k_cache.shape[2] % layout.block_size:
        raise ValueError(f"the cache length {k_cache.shape[2]} must be a multiple of block_size={layout.block_size}")
    num_slots = k_cache.shape[2] // layout.block_size
    max_ring = min(num_slots, layout.ring_blocks)
    if isinstance(num_ring_slots, bool) or not isinstance(num_ring_slots, int) or not 0 <= num_ring_slots <= max_ring:
        raise ValueError(
            f"num_ring_slots must be an integer in [0, min(num_slots={num_slots}, ring_blocks={layout.ring_blocks})], "
            f"got {num_ring_slots!r}"
        )
    int_dtypes = (torch.int32, torch.int64)
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != (b,) or seq_lens.dtype not in int_dtypes:
        raise ValueError(f"seq_lens must be an int32/int64 tensor of shape [B]={[b]}, got {seq_lens!r}")
    if not (q.device == k_cache.device == v_cache.device == seq_lens.device):
        raise ValueError("q, k_cache, v_cache and seq_lens must be on one device")



def decode_attention_torch(q, k_cache, v_cache, seq_lens, layout: CompactLayout, num_ring: int, scale: float):
    """Exact PyTorch path (math in float32, float64 stays float64): gathers nothing, masks the compact cache."""
    b, hq, tq, d = q.shape
    hkv, bs, group = layout.num_kv_heads, layout.block_size, layout.q_heads_per_kv
    num_slots = k_cache.shape[2] // bs
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = q.device
    blocks = slot_blocks(layout, seq_lens, num_ring, num_slots)  # [B, Hkv, S]
    key_pos = (blocks[..., None] * bs + torch.arange(bs, device=device)).flatten(-2)  # [B, Hkv, S * bs]
    key_ok = (blocks >= 0).repeat_interleave(bs, dim=-1) & (key_pos < seq_lens.long()[:, None, None])
    keys, values = k_cache.to(compute_dtype), v_cache.to(compute_dtype)  # [B, Hkv, S * bs, D]
    # per query head: its pattern head's rule, evaluated on blocks
    pattern_head = torch.arange(hq, device=device) // layout.q_heads_per_pattern  # [Hq]

    out = torch.zeros(b, hq, tq, d, dtype=compute_dtype, device=device)
    rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, b * hq * keys.shape[2]))
    for start in range(0, tq, rows_per_chunk):
        t = torch.arange(start, min(tq, start + rows_per_chunk), device=device)
        q_pos = seq_lens.long()[:, None] - tq + t  # [B, c]
        q_blk = q_pos.clamp(min=0).div(bs, rounding_mode="floor")
        rule = visible_blocks(layout, q_blk[None, :, None, :, None], blocks[None, :, :, None, :])  # [P, B, Hkv, c, S]
        rule = rule[pattern_head, :, torch.arange(hq, device=device) // group]  # [Hq, B, c, S]
        rule = rule.permute(1, 0, 2, 3).repeat_interleave(bs, dim=-1)  # [B, Hq, c, S * bs]
        kv_of_q = torch.arange(hq, device=device) // group
        ok = key_ok[:, kv_of_q][:, :, None, :] & (key_pos[:, kv_of_q][:, :, None, :] <= q_pos[:, None, :, None])
        ok = ok & rule & (q_pos >= 0)[:, None, :, None]  # [B, Hq, c, S * bs]
        qc = q[:, :, start : start + len(t)].to(compute_dtype).view(b, hkv, group, len(t), d)
        scores = (qc @ keys[:, :, None].transpose(-1, -2)).view(b, hq, len(t), -1) * scale
        scores = scores.masked_fill(~ok, -math.inf)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0))
        probs = probs.view(b, hkv, group, len(t), -1)
        out[:, :, start : start + len(t)] = (probs @ values[:, :, None]).view(b, hq, len(t), d)
    return out.to(q.dtype)
