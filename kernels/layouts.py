"""The types the public ops and their backends share: one module that both sides import (no import cycles).

* ``BlockLayout`` and ``Varlen``: what ``interface.s2_attention`` resolves and passes to a backend
  (``torch_impl``, ``triton_impl``; contract in ``interface.py``).
* ``CompactLayout`` (with its ``SlotTables``): where each kept block of a sparse layer lives in the compact KV cache,
  used by ``decode.py`` and ``decode_triton.py`` (layout described in ``decode.py``).
* ``empty_heads_last``: the memory layout of the ops' ``[B, H, T, D]`` outputs and gradients.
* ``row_view``: a ``[B, H, T, D]`` tensor seen as rows, for the kernels' TMA descriptors (``triton_impl`` computes
  the inputs' views, ``hopper_fwd`` its output's).

Only torch is imported here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .pattern import S2Pattern


@dataclass(frozen=True)
class BlockLayout:
    """The resolved sparsity of one call.

    ``block_mask`` is ``bool [P, M, N]`` over absolute blocks (row ``i`` = query block ``i`` counted from the
    sequence's first token), on the inputs' device, with ``M, N >= cdiv(max_seqlen_k, block_size)``. Query head
    ``hq`` reads pattern head ``hq // (Hq // P)`` and KV head ``hq // (Hq // Hkv)``. ``cache_key`` is a hashable
    identity when the mask was derived from an ``S2Pattern`` (backends may then cache block lists built from it);
    ``None`` for user-supplied masks, which are never cached.
    """

    block_mask: torch.Tensor
    block_size: int
    causal: bool
    cache_key: tuple | None

    @property
    def num_pattern_heads(self) -> int:
        return self.block_mask.shape[0]


@dataclass(frozen=True)
class Varlen:
    """Packed sequences: sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q (likewise k/v)."""

    cu_seqlens_q: torch.Tensor  # int32 [S + 1], on the inputs' device
    cu_seqlens_k: torch.Tensor  # int32 [S + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    equal_lengths: bool = False  # every sequence's query length equals its key length (queries are the keys' tokens)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.numel() - 1


@dataclass(frozen=True)
class CompactLayout:
    """Where each kept block of one sparse layer lives in its compact cache (see ``decode.py``'s docstring).

    ``ring_blocks`` (>= ``pattern.local_blocks``) is the ring's modulus: a write of ``Tq`` tokens before attending
    needs ``local_blocks + cdiv(Tq - 1, block_size)`` (see ``ring_blocks_for``) so that the new blocks do not
    overwrite blocks the chunk's first queries still read.
    """

    pattern: S2Pattern
    num_q_heads: int
    num_kv_heads: int
    ring_blocks: int

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "ring_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.ring_blocks < self.pattern.local_blocks:
            raise ValueError(f"ring_blocks must be >= local_blocks={self.pattern.local_blocks}, got {self.ring_blocks}")
        self.pattern.check_num_heads(self.num_pattern_heads)

    @property
    def block_size(self) -> int:
        return self.pattern.block_size

    @property
    def num_pattern_heads(self) -> int:
        return self.pattern.num_pattern_heads(self.num_q_heads, self.num_kv_heads)

    @property
    def q_heads_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_heads_per_pattern(self) -> int:
        return self.num_q_heads // self.num_pattern_heads

    def pattern_head_residue(self, head: int) -> int | None:
        """``j % vert_stride`` of pattern head ``head``'s vertical blocks; ``None`` for a dense head."""
        p = self.pattern
        num_heads = self.num_pattern_heads
        if head >= num_heads - p.num_dense_heads:
            return None
        return -(head * p.head_step(num_heads) + p.head_sliding_offset) % p.vert_stride

    @functools.cached_property
    def vertical_residues(self) -> tuple[tuple[int, ...], ...]:
        """Per KV head, the sorted residues ``j % vert_stride`` of its vertical (never evicted) blocks."""
        per_kv = []
        heads_per_kv = self.num_pattern_heads // self.num_kv_heads  # 1, or the query group with per_query_head
        for kv in range(self.num_kv_heads):
            residues = set()
            for head in range(kv * heads_per_kv, (kv + 1) * heads_per_kv):
                residue = self.pattern_head_residue(head)
                residues.update(range(self.pattern.vert_stride) if residue is None else (residue,))
            per_kv.append(tuple(sorted(residues)))
        return tuple(per_kv)

    def num_vertical_slots(self, num_tokens: int) -> int:
        """Vertical slots needed once a row holds ``num_tokens`` tokens (the maximum over KV heads)."""
        if num_tokens <= 0:
            return 0
        last = (num_tokens - 1) // self.block_size
        vs = self.pattern.vert_stride
        return max((last // vs) * len(r) + sum(x <= last % vs for x in r) for r in self.vertical_residues)

    def num_ring_slots(self, num_tokens: int) -> int:
        """Ring slots allocated once a row holds ``num_tokens`` tokens (the ring fills during its first lap)."""
        return min(self.ring_blocks, -(-num_tokens // self.block_size))

    def tables(self, device) -> SlotTables:
        """The ``SlotTables`` of this layout on ``device`` (built once per layout and device)."""
        return _tables(self, str(device))


class SlotTables(NamedTuple):
    """Per-KV-head tables of a layout's vertical residues (int32, on one device), read by the slot rules."""

    residues: torch.Tensor  # [Hkv, vs]: the sorted residues j % vert_stride of the vertical blocks, then zeros
    rank: torch.Tensor  # [Hkv, vs]: index of residue r among them, -1 if r is not vertical
    counts: torch.Tensor  # [Hkv]: how many residues
    vertical_upto: torch.Tensor  # [Hkv, vs]: how many residues are <= r



@functools.lru_cache(maxsize=256)
def _tables(layout: CompactLayout, device: str) -> SlotTables:
    vs = layout.pattern.vert_stride
    residues = torch.zeros(layout.num_kv_heads, vs, dtype=torch.int32)
    rank = torch.full((layout.num_kv_heads, vs), -1, dtype=torch.int32)
    counts = torch.zeros(layout.num_kv_heads, dtype=torch.int32)
    for kv, kept in enumerate(layout.vertical_residues):
        counts[kv] = len(kept)
        for i, r in enumerate(kept):
            residues[kv, i] = r
            rank[kv, r] = i
    vertical_upto = (rank >= 0).int().cumsum(-1, dtype=torch.int32)
    return SlotTables(*(t.to(device) for t in (residues, rank, counts, vertical_upto)))


def empty_heads_last(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor of ``x``'s ``[B, H, T, D]`` shape stored as ``[B, T, H, D]``.

    That is how a model's q, k and v arrive (views of a projection's ``[B, T, H * D]`` output), and how it reads
    the attention output back (``.transpose(1, 2)`` to ``[B, T, H, D]``): outputs and gradients laid out this way
    cost no copy on either side.
    """
    b, h, t, d = x.shape
    return x.new_empty((b, t, h, d), dtype=dtype or x.dtype).transpose(1, 2)


def as_heads_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if it is laid out as ``empty_heads_last`` makes it (strides equal), else a copy laid out so."""
    b, h, t, d = x.shape
    if x.stride() == (t * h * d, d, h * d, 1):
        return x
    return empty_heads_last(x).copy_(x)


def row_view(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``(shape, strides)`` of ``t [B, H, T, D]`` seen as ``[rows, t.stride(2)]``, or None where its layout does not
    allow that: every head's rows must lie inside rows of ``stride(2)`` elements, as in ``[B, H, T, D]`` contiguous or
    the ``[B, T, H, D]`` projection output seen through a transpose. TMA descriptors over this view give the kernels
    a head's rows from its offset (``triton_impl._descriptor_origin``, ``hopper_fwd.head_origin``), without copies.
    A launcher computes each tensor's view once a call (they are on its host path)."""
    batch, heads, seqlen, head_dim = t.shape
    stride_b, stride_h, row_stride, stride_d = t.stride()
    # (A broadcast tensor, e.g. the output gradient of a sum, has row stride 0: no view.)
    aligned = row_stride > 0 and stride_d == 1 and (row_stride * t.element_size()) % 16 == 0
    if not (aligned and t.data_ptr() % 16 == 0):
        return None
    heads_fit = stride_h % row_stride == 0 or stride_h * (heads - 1) + head_dim <= row_stride
    if not (heads_fit and (batch == 1 or stride_b % row_stride == 0)):
        return None
    extent = (batch - 1) * stride_b + (heads - 1) * stride_h + (seqlen - 1) * row_stride + head_dim
    return [-(-extent // row_stride), row_stride], [row_stride, 1]
