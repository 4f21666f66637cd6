"""S2Pattern: the block mask against an independent, literal transcription of the rule, and validation."""

import random

import pytest
import torch

from s2_models.kernels import S2Pattern
from s2_models.kernels.pattern import token_mask


def rule(p: S2Pattern, num_heads: int, h: int, i: int, j: int, causal: bool) -> bool:
    """The pattern exactly as specified, one block at a time, written without tensors."""
    if causal and j > i:
        return False
    if h >= num_heads - p.num_dense_heads:
        return True
    step = 0 if p.homo_head else (p.head_sliding_step or max(1, p.vert_stride // num_heads))
    local = (i - j if causal else abs(i - j)) < p.local_blocks
    vertical = (j + h * step + p.head_sliding_offset) % p.vert_stride == 0
    return local or vertical


PATTERNS = [
    S2Pattern(block_size=16, local_blocks=2, vert_stride=4),
    S2Pattern(block_size=64, local_blocks=16, vert_stride=16),
    S2Pattern(block_size=32, local_blocks=1, vert_stride=3, homo_head=True),
    S2Pattern(block_size=128, local_blocks=3, vert_stride=8, head_sliding_step=3, head_sliding_offset=0),
    S2Pattern(block_size=16, local_blocks=1, vert_stride=5, num_dense_heads=2),
    S2Pattern(block_size=16, local_blocks=4, vert_stride=1),
]


@pytest.mark.parametrize("pattern", PATTERNS, ids=repr)
@pytest.mark.parametrize("causal", [True, False])
def test_block_mask_matches_the_rule(pattern, causal):
    rng = random.Random()
    num_heads = rng.choice([1, 2, 4, 8, 32])
    if pattern.num_dense_heads > num_heads:
        num_heads = pattern.num_dense_heads
    m, n = rng.randint(1, 40), rng.randint(1, 40)
    mask = pattern.block_mask(num_heads, m, n, causal=causal)
    assert mask.dtype == torch.bool and mask.shape == (num_heads, m, n)
    expected = torch.tensor(
        [[[rule(pattern, num_heads, h, i, j, causal) for j in range(n)] for i in range(m)] for h in range(num_heads)]
    )
    assert torch.equal(mask, expected)


def test_heads_shard_the_context():
    """Heterogeneous heads cover every causal block together, while each head reads only a fraction."""
    pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
    mask = pattern.block_mask(8, 64, 64)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    assert torch.equal(mask.any(0), causal)
    assert all(mask[h].sum() < 0.3 * causal.sum() for h in range(8))
    homo = S2Pattern(block_size=64, local_blocks=4, vert_stride=8, homo_head=True).block_mask(8, 64, 64)
    assert all(torch.equal(homo[h], homo[0]) for h in range(8))


def test_kept_fraction_of_the_headline_pattern():
    pattern = S2Pattern(block_size=64, local_blocks=16, vert_stride=16)
    density = pattern.kept_fraction(num_heads=32, seq_len=16384)
    # local window of 16 blocks plus 1/16 of the remaining causal blocks
    assert 0.08 < density < 0.2


def test_token_mask_alignment():
    """Queries are bottom-right aligned: with Tq < Tk the last query sits at position Tk - 1."""
    pattern = S2Pattern(block_size=16, local_blocks=1, vert_stride=1000, head_sliding_offset=0)
    blocks = pattern.block_mask(1, 4, 4)
    full = token_mask(blocks, 16, 64, 64)
    tail = token_mask(blocks, 16, 5, 64)
    assert torch.equal(tail, full[:, -5:])
    assert tail[0, -1, 48:].all() and tail[0, -1, 16:48].logical_not().all() and tail[0, -1, 0]  # block 0 vertical


def test_round_trip_through_a_dict():
    pattern = S2Pattern(block_size=32, local_blocks=3, vert_stride=7, num_dense_heads=1)
    assert S2Pattern.from_dict(pattern.to_dict()) == pattern


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"block_size": 48}, "block_size"),
        ({"block_size": 8}, "block_size"),
        ({"block_size": 256}, "block_size"),
        ({"local_blocks": 0}, "local_blocks"),
        ({"vert_stride": 0}, "vert_stride"),
        ({"head_sliding_step": 0}, "head_sliding_step"),
        ({"head_sliding_offset": -1}, "head_sliding_offset"),
        ({"num_dense_heads": -1}, "num_dense_heads"),
        ({"homo_head": 1}, "homo_head"),
        ({"local_blocks": 2.0}, "local_blocks"),
    ],
)
def test_bad_fields_are_refused(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        S2Pattern(**kwargs)


def test_bad_dicts_and_head_counts_are_refused():
    with pytest.raises(ValueError, match="unknown S2 pattern keys"):
        S2Pattern.from_dict({"block_size": 64, "stride": 4})
    with pytest.raises(ValueError, match="num_dense_heads"):
        S2Pattern(num_dense_heads=5).block_mask(4, 2, 2)
    with pytest.raises(ValueError, match="num_heads"):
        S2Pattern().block_mask(0, 2, 2)


def distant_offsets_read(pattern: S2Pattern, num_heads: int) -> set[int]:
    """Offsets ``j % vert_stride`` of the key blocks beyond the local window that some head keeps, from the mask."""
    n = pattern.local_blocks + 3 * pattern.vert_stride
    mask = pattern.block_mask(num_heads, n, n).any(0)
    return {j % pattern.vert_stride for i in range(n) for j in range(i - pattern.local_blocks + 1) if mask[i, j]}


@pytest.mark.parametrize(
    "pattern, num_heads, uncovered",
    [
        # the scratch study's hybrid: 4 KV heads, stride 8 -> step 2, stripes on 4 of the 8 offsets
        (S2Pattern(block_size=64, local_blocks=4, vert_stride=8), 4, (0, 2, 4, 6)),
        # per_query_head with its 12 query heads: step max(1, 8 // 12) = 1, every offset
        (S2Pattern(block_size=64, local_blocks=4, vert_stride=8, per_query_head=True), 12, ()),
        # SmolLM2's 3 KV heads: 5 of 8 offsets read by no head
        (S2Pattern(block_size=64, local_blocks=4, vert_stride=8), 3, (0, 1, 2, 4, 6)),
        # homo_head: every head on the same stripe, one offset
        (S2Pattern(block_size=16, local_blocks=2, vert_stride=4, homo_head=True), 4, (0, 1, 2)),
        # a step that folds the heads onto two stripes although there are enough heads
        (S2Pattern(block_size=16, local_blocks=2, vert_stride=4, head_sliding_step=2), 4, (0, 2)),
        # a dense head reads every block
        (S2Pattern(block_size=16, local_blocks=2, vert_stride=8, num_dense_heads=1), 2, ()),
        (S2Pattern(block_size=16, local_blocks=2, vert_stride=1), 1, ()),
    ],
)
def test_uncovered_offsets(pattern, num_heads, uncovered):
    assert pattern.uncovered_offsets(num_heads) == uncovered
    read = distant_offsets_read(pattern, num_heads)  # the same answer from the block mask itself
    assert read == set(range(pattern.vert_stride)) - set(uncovered)


def test_uncovered_offsets_checks_the_head_count():
    with pytest.raises(ValueError, match="num_dense_heads"):
        S2Pattern(num_dense_heads=3).uncovered_offsets(2)
    with pytest.raises(ValueError, match="num_heads"):
        S2Pattern().uncovered_offsets(0)
