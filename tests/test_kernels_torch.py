"""The exact sparse PyTorch path against the float64 reference: outputs, lse and gradients."""

import random

import pytest
import torch
from attention_checks import assert_excluded_blocks_are_unread, assert_matches_reference, random_qkv

from s2_models.kernels import S2Pattern, s2_attention

BACKEND = "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "b, hq, hkv, tq, tk",
    [(1, 2, 2, 1, 1), (2, 4, 2, 17, 17), (1, 4, 1, 127, 127), (2, 8, 2, 33, 200), (1, 2, 1, 1, 129)],
)
def test_pattern_heads_and_sizes(dtype, b, hq, hkv, tq, tk):
    block_size = random.choice([16, 32])
    pattern = S2Pattern(block_size=block_size, local_blocks=random.randint(1, 3), vert_stride=random.randint(2, 5))
    assert_matches_reference(*random_qkv(b, hq, hkv, tq, tk, 16, dtype), BACKEND, pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        S2Pattern(block_size=16, local_blocks=1, vert_stride=3, homo_head=True),
        S2Pattern(block_size=16, local_blocks=2, vert_stride=4, num_dense_heads=1),
        S2Pattern(block_size=32, local_blocks=1, vert_stride=2, head_sliding_step=1, head_sliding_offset=0),
        S2Pattern(block_size=16, local_blocks=1, vert_stride=5, per_query_head=True),
        S2Pattern(block_size=64, local_blocks=1, vert_stride=2),
        S2Pattern(block_size=128, local_blocks=1, vert_stride=2),
    ],
    ids=repr,
)
@pytest.mark.parametrize("causal", [True, False])
def test_every_pattern_feature(pattern, causal):
    d = random.choice([16, 32, 64])
    assert_matches_reference(*random_qkv(2, 4, 2, 150, 270, d, torch.float32), BACKEND, pattern, causal=causal)


def test_varlen_restarts_the_pattern_per_sequence():
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    lens_k = [37, 0, 100, 16, 1]
    lens_q = [37, 0, 60, 16, 1]
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    qkv = random_qkv(1, 4, 2, sum(lens_q), sum(lens_k), 32, torch.float16)
    assert_matches_reference(*qkv, BACKEND, pattern, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    # the same thing, one sequence at a time
    q, k, v = (t.detach() for t in qkv)
    packed = s2_attention(q, k, v, pattern, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=60, max_seqlen_k=100)
    for s in range(len(lens_k)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        alone = s2_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], pattern)
        torch.testing.assert_close(packed[:, :, rows], alone, rtol=0, atol=0)


@pytest.mark.parametrize("tq", [50, 1, 7])
def test_padding_anchors_the_pattern_at_the_first_real_token(tq):
    pattern = S2Pattern(block_size=16, local_blocks=1, vert_stride=3)
    b, t = 3, 50
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, :9] = 0  # left padding
    mask[1, 41:] = 0  # right padding
    qkv = random_qkv(b, 4, 2, tq, t, 16, torch.float32)
    assert_matches_reference(*qkv, BACKEND, pattern, attention_mask=mask)
    q, k, v = (x.detach() for x in qkv)
    padded = s2_attention(q, k, v, pattern, attention_mask=mask)
    alone = s2_attention(q[:1, :, max(0, tq - 41) :], k[:1, :, 9:], v[:1, :, 9:], pattern)
    torch.testing.assert_close(padded[:1, :, max(0, tq - 41) :], alone, rtol=0, atol=1e-6)


def test_user_block_mask():
    hq, t = 4, 90
    block_mask = torch.rand(2, 6, 6) < 0.5
    block_mask[:, 1, :] = False  # query block 1 sees nothing: zero output, lse -inf
    qkv = random_qkv(1, hq, 2, t, t, 16, torch.float32)
    assert_matches_reference(*qkv, BACKEND, block_mask=block_mask, block_size=16)
    out, lse = s2_attention(*(x.detach() for x in qkv), block_mask=block_mask, block_size=16, return_lse=True)
    assert (out[:, :, 16:32] == 0).all() and torch.isinf(lse[:, :, 16:32]).all()


def test_excluded_blocks_are_unread():
    assert_excluded_blocks_are_unread(BACKEND, torch.float32)


def test_vert_stride_one_is_dense_causal_attention():
    q, k, v = (x.detach() for x in random_qkv(2, 4, 2, 70, 70, 32, torch.float32))
    out = s2_attention(q, k, v, S2Pattern(block_size=16, local_blocks=1, vert_stride=1))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_memory_grows_with_kept_blocks_not_t_squared(monkeypatch):
    """The PyTorch path materializes scores only for kept blocks: its largest score tensor is far below T^2."""
    import s2_models.kernels.torch_impl as torch_impl

    largest = []
    original = torch.Tensor.masked_fill

    def spy(self, mask, value):
        largest.append(self.numel())
        return original(self, mask, value)

    monkeypatch.setattr(torch.Tensor, "masked_fill", spy)
    t = 2048
    q, k, v = (x.detach() for x in random_qkv(1, 2, 2, t, t, 16, torch.float32))
    s2_attention(q, k, v, S2Pattern(block_size=16, local_blocks=2, vert_stride=16), backend="torch")
    assert torch_impl._MAX_SCORE_ELEMENTS > 0 and max(largest) < 0.25 * 2 * t * t
