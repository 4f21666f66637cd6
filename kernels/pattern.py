"""The S2 sparsity pattern: which key blocks each head's query blocks may read.

This file is self-contained (torch only) on purpose: it is copied flat next to the modeling files of a saved
checkpoint, so that ``trust_remote_code`` loading works without this package installed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size must be a power of two in [16, 128] (one of {SUPPORTED_BLOCK_SIZES}), got {block_size!r}"
        )


@dataclass(frozen=True)
class S2Pattern:
    """A Sparsely-Sharded attention pattern (arXiv 2407.17678).

    For pattern head ``h`` of ``num_heads``, query block ``i`` and key block ``j`` (absolute block indices counted
    from the sequence's first token), the block is kept iff (causal) ``j <= i`` and::

        i - j < local_blocks  or  (j + h * step + head_sliding_offset) % vert_stride == 0

    with ``step = 0`` if ``homo_head`` else ``head_sliding_step or max(1, vert_stride // num_heads)``. The last
    ``num_dense_heads`` heads keep every (causal) block. In non-causal mode the local window is symmetric
    (``|i - j| < local_blocks``) and the vertical rule applies to every key block. Inside kept blocks the usual
    token-level causal mask applies.

    Pattern heads are KV heads by default (query head ``hq`` uses pattern head ``hq // (Hq // Hkv)``), so one KV
    head's query group shares a pattern and its KV cache can be evicted per KV head. ``per_query_head=True`` gives
    every query head its own pattern (``num_heads = Hq``) at the price of that eviction.

    Example, ``block_size=16, local_blocks=2, vert_stride=4`` with 4 pattern heads (``step = 1``); ``#`` kept,
    ``.`` skipped. Head 0 keeps the vertical blocks 3, 7, ...; head 1 is shifted by one block (2, 6, ...)::

        head 0             head 1
        i\\j 0 1 2 3 4 5 6 7   i\\j 0 1 2 3 4 5 6 7
        0    #                 0    #
        1    # #               1    # #
        2    . # #             2    . # #
        3    . . # #           3    . . # #
        4    . . . # #         4    . . # # #
        5    . . . # # #       5    . . # . # #
        6    . . . # . # #     6    . . # . . # #
        7    . . . # . . # #   7    . . # . . . # #
    """

    block_size: int = 64
    local_blocks: int = 16
    vert_stride: int = 16
    homo_head: bool = False
    head_sliding_step: int | None = None
    head_sliding_offset: int = 1
    num_dense_heads: int = 0
    per_query_head: bool = False

    def __post_init__(self):
        check_block_size(self.block_size)
        _check_int("local_blocks", self.local_blocks, 1)
        _check_int("vert_stride", self.vert_stride, 1)
        if self.head_sliding_step is not None:
            _check_int("head_sliding_step", self.head_sliding_step, 1)
        _check_int("head_sliding_offset", self.head_sliding_offset, 0)
        _check_int("num_dense_heads", self.num_dense_heads, 0)
        for name in ("homo_head", "per_query_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    # ------------------------------------------------------------------ serialization
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, spec: dict) -> S2Pattern:
        """Build from a dict of fields (as stored in ``config.json``); unknown keys are a ``ValueError``."""
        if not isinstance(spec, dict):
            raise ValueError(f"an S2 pattern spec must be a dict of {cls.field_names()}, got {spec!r}")
        unknown = set(spec) - set(cls.field_names())
        if unknown:
            raise ValueError(f"unknown S2 pattern keys {sorted(unknown)}; allowed keys are {list(cls.field_names())}")
        return cls(**spec)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ the pattern
    def num_pattern_heads(self, num_q_heads: int, num_kv_heads: int) -> int:
        """How many distinct pattern heads a layer with these head counts uses."""
        return num_q_heads if self.per_query_head else num_kv_heads

    def check_num_heads(self, num_heads: int) -> None:
        _check_int("num_heads", num_heads, 1)
        if self.num_dense_heads > num_heads:
            raise ValueError(
                f"num_dense_heads must be in [0, num_heads={num_heads}] (the pattern heads), got {self.num_dense_heads}"
            )

    def head_step(self, num_heads: int) -> int:
        """The per-head shift of the vertical stripes."""
        if self.homo_head:
            return 0
        return self.head_sliding_step or max(1, self.vert_stride // num_heads)

    def uncovered_offsets(self, num_heads: int) -> tuple[int, ...]:
        """The vertical offsets that no one of ``num_heads`` pattern heads reads; ``()`` when the heads cover all.

        An offset is a residue ``r`` in ``[0, vert_stride)``: key blocks ``j`` with ``j % vert_stride == r`` beyond a
        query's local window are kept only by the heads whose stripe sits on ``r``. S2 shards the context: each head
        reads a ``1 / vert_stride`` share of the distant blocks and the heads together read them all. That takes at
        least ``vert_stride`` pattern heads on distinct stripes, or a dense head (``num_dense_heads >= 1``): 4 pattern
        heads with ``vert_stride=8`` leave half of the offsets, ``(0, 2, 4, 6)``, to no head, and ``homo_head=True``
        covers a single offset.
        """
        self.check_num_heads(num_heads)
        if self.num_dense_heads:
            return ()
        step = self.head_step(num_heads)
        covered = {-(h * step + self.head_sliding_offset) % self.vert_stride for h in range(num_heads)}
        return tuple(r for r in range(self.vert_stride) if r not in covered)

    def block_mask(
        self, num_heads: int, num_q_blocks: int, num_kv_blocks: int, causal: bool = True, device=None
    ) -> torch.Tensor:
        """The kept blocks as ``torch.bool [num_heads, num_q_blocks, num_kv_blocks]`` (absolute block indices)."""
        return self.shared_block_mask(num_heads, num_q_blocks, num_kv_blocks, causal, device).clone()

    def shared_block_mask(
        self, num_heads: int, num_q_blocks: int, num_kv_blocks: int, causal: bool = True, device=None
    ) -> torch.Tensor:
        """``block_mask`` without the copy: a cached tensor shared by every caller, which must not modify it."""
        self.check_num_heads(num_heads)
        _check_int("num_q_blocks", num_q_blocks, 0)
        _check_int("num_kv_blocks", num_kv_blocks, 0)
        return _block_mask(self, num_heads, num_q_blocks, num_kv_blocks, bool(causal), str(device or "cpu"))

    def kept_fraction(self, num_heads: int, seq_len: int, causal: bool = True) -> float:
        """Fraction of the (causal) token pairs of a ``seq_len`` sequence that the pattern computes."""
        n = -(-seq_len // self.block_size)
        sizes = torch.full((n,), self.block_size, dtype=torch.float64)
        sizes[-1] = seq_len - (n - 1) * self.block_size
        pairs = sizes[:, None] * sizes[None, :]  # [M, N] token pairs of each block pair
        if causal:
            pairs = pairs.tril(-1) + torch.diag(sizes * (sizes + 1) / 2)
        kept = (self.block_mask(num_heads, n, n, causal).double() * pairs).sum()
        return (kept / (pairs.sum() * num_heads)).item()


# Every block kept: one vertical residue (stride 1) and no local window. Dense attention through the S2 kernels.
DENSE_PATTERN = S2Pattern(block_size=128, local_blocks=1, vert_stride=1)


@functools.lru_cache(maxsize=16)  # masks are [P, N, N] on the device: keep few
def _block_mask(pattern: S2Pattern, num_heads: int, m: int, n: int, causal: bool, device: str) -> torch.Tensor:
    i = torch.arange(m, device=device)[None, :, None]  # [1, M, 1]
    j = torch.arange(n, device=device)[None, None, :]  # [1, 1, N]
    h = torch.arange(num_heads, device=device)[:, None, None]  # [H, 1, 1]
    distance = i - j if causal else (i - j).abs()
    local = distance < pattern.local_blocks
    vertical = (j + h * pattern.head_step(num_heads) + pattern.head_sliding_offset) % pattern.vert_stride == 0
    dense_head = h >= num_heads - pattern.num_dense_heads
    keep = local | vertical | dense_head
    if causal:
        keep = keep & (j <= i)
    return keep.expand(num_heads, m, n).contiguous()


def token_mask(
    block_mask: torch.Tensor, block_size: int, q_len: int, kv_len: int, causal: bool = True
) -> torch.Tensor:
    """Expand a block mask to tokens: ``bool [H, q_len, kv_len]``, queries bottom-right aligned.

    Query ``t`` sits at absolute position ``kv_len - q_len + t``; key ``s`` at position ``s``. Used by the reference
    implementations (naive, eager/SDPA) only: the kernels never materialize it.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=block_mask.device)
    k_pos = torch.arange(kv_len, device=block_mask.device)
    mask = block_mask[:, q_pos // block_size][:, :, k_pos // block_size]
    if causal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    return mask
