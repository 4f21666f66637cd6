"""Bad input to ``s2_attention`` gets a ValueError that names the argument."""

import pytest
import torch

from s2_models.kernels import S2Pattern, s2_attention

PATTERN = S2Pattern(block_size=16, local_blocks=2, vert_stride=4)


def qkv(b=1, hq=4, hkv=2, tq=32, tk=32, d=16, dtype=torch.float32):
    q = torch.randn(b, hq, tq, d, dtype=dtype)
    return q, torch.randn(b, hkv, tk, d, dtype=dtype), torch.randn(b, hkv, tk, d, dtype=dtype)


def test_gqa_head_counts():
    with pytest.raises(ValueError, match="Hq=6 must be a multiple of the KV heads Hkv=4"):
        s2_attention(*qkv(hq=6, hkv=4), PATTERN)


@pytest.mark.parametrize("d", [8, 24, 272])
def test_unsupported_head_dims(d):
    with pytest.raises(ValueError, match="head dim D must be a multiple of 16 in \\[16, 256\\]"):
        s2_attention(*qkv(d=d), PATTERN)


def test_head_dims_that_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="head dims of q, k, v must be equal"):
        s2_attention(q, k, torch.randn(1, 2, 32, 32), PATTERN)


def test_mixed_dtypes_and_unsupported_dtypes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one dtype"):
        s2_attention(q.half(), k, v, PATTERN)
    with pytest.raises(ValueError, match="dtype must be one of"):
        s2_attention(q.int(), k.int(), v.int(), PATTERN)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_devices_that_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        s2_attention(q.cuda(), k, v, PATTERN)


def test_longer_queries_than_keys():
    with pytest.raises(ValueError, match="Tq=33 must be <= the key length Tk=32"):
        s2_attention(*qkv(tq=33), PATTERN)
    with pytest.raises(ValueError, match="Tq=33"):
        s2_attention(*qkv(tq=33), PATTERN, causal=False)


def test_shapes_and_batch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="4-D"):
        s2_attention(q[0], k, v, PATTERN)
    with pytest.raises(ValueError, match="same batch size"):
        s2_attention(torch.randn(2, 4, 32, 16), k, v, PATTERN)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        s2_attention(q, k, v[:, :, :16], PATTERN)


def test_pattern_and_mask_arguments():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="exactly one of pattern"):
        s2_attention(q, k, v)
    with pytest.raises(ValueError, match="exactly one of pattern"):
        s2_attention(q, k, v, PATTERN, block_mask=torch.ones(2, 2, 2, dtype=torch.bool), block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        s2_attention(q, k, v, block_mask=torch.ones(2, 2, 2, dtype=torch.bool), block_size=24)
    with pytest.raises(ValueError, match="block_mask must be a bool tensor"):
        s2_attention(q, k, v, block_mask=torch.ones(2, 2, 2), block_size=16)
    with pytest.raises(ValueError, match="does not fit"):
        s2_attention(q, k, v, block_mask=torch.ones(2, 1, 2, dtype=torch.bool), block_size=16)
    with pytest.raises(ValueError, match="P=3 pattern heads"):
        s2_attention(q, k, v, block_mask=torch.ones(3, 2, 2, dtype=torch.bool), block_size=16)
    with pytest.raises(ValueError, match="num_dense_heads"):
        s2_attention(q, k, v, S2Pattern(block_size=16, num_dense_heads=3))
    with pytest.raises(ValueError, match="contradicts"):
        s2_attention(q, k, v, PATTERN, block_size=32)


def test_scale_backend_and_causal():
    q, k, v = qkv()
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            s2_attention(q, k, v, PATTERN, scale=scale)
    with pytest.raises(ValueError, match="backend must be one of"):
        s2_attention(q, k, v, PATTERN, backend="cuda")
    with pytest.raises(ValueError, match="causal must be a bool"):
        s2_attention(q, k, v, PATTERN, causal="yes")
    with pytest.raises(ValueError, match="float64 runs on backend=\"torch\""):
        s2_attention(q.double(), k.double(), v.double(), PATTERN, backend="triton")


@pytest.mark.parametrize(
    "cu_q, cu_k, match",
    [
        ([0, 10, 32], [0, 32], "same length"),
        ([1, 10, 32], [0, 10, 32], "start at 0"),
        ([0, 20, 10, 32], [0, 20, 10, 32], "never decrease"),
        ([0, 10, 30], [0, 10, 32], "end at the packed length 32"),
        ([0, 20, 32], [0, 10, 32], "query length 20 must be <= key length 10"),
    ],
)
def test_malformed_cu_seqlens(cu_q, cu_k, match):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=match):
        s2_attention(q, k, v, PATTERN, cu_seqlens_q=torch.tensor(cu_q), cu_seqlens_k=torch.tensor(cu_k))


def test_varlen_argument_combinations():
    q, k, v = qkv()
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="given together"):
        s2_attention(q, k, v, PATTERN, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        s2_attention(q, k, v, PATTERN, cu_seqlens_q=cu.float(), cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="batch size 1"):
        s2_attention(*qkv(b=2), PATTERN, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int >= the longest sequence"):
        s2_attention(q, k, v, PATTERN, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=8)
    with pytest.raises(ValueError, match="not both"):
        s2_attention(q, k, v, PATTERN, cu_seqlens_q=cu, cu_seqlens_k=cu, attention_mask=torch.ones(1, 32))


def test_bad_padding_masks():
    q, k, v = qkv(b=2)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        s2_attention(q, k, v, PATTERN, attention_mask=torch.ones(2, 31))


def test_layouts_are_shared_and_bucketed():
    """Lengths that change every call (packed batches, prompts) reuse a few cached masks instead of one per length,
    and no call copies the mask."""
    from s2_models.kernels.interface import _resolve_layout, bucket_num_blocks

    shapes = set()
    for tk in range(1, 3000, 7):
        q, k, _ = qkv(tq=1, tk=tk)
        layout = _resolve_layout(q, k, PATTERN, None, None, True, tk)
        need = -(-tk // PATTERN.block_size)
        assert need <= layout.block_mask.shape[1] <= 1.125 * need + 1
        assert layout.block_mask is _resolve_layout(q, k, PATTERN, None, None, True, tk).block_mask
        shapes.add(layout.block_mask.shape)
    assert len(shapes) <= 16 + 8 * 4  # exact up to 16 blocks, then 8 sizes per doubling up to 188 blocks (of 429)
    assert [bucket_num_blocks(n) for n in (1, 8, 16, 17, 2048)] == [1, 8, 16, 18, 2048]


@pytest.mark.parametrize("kwargs, match", [
    ({"block_mask": [[True, True], [True, True]], "block_size": 16}, "block_mask must be a tensor"),
    ({"block_mask": torch.ones(2, 2, dtype=torch.bool), "block_size": 16.0}, "block_size must be an int"),
    ({"cu_seqlens_q": [0, 32], "cu_seqlens_k": [0, 32]}, "cu_seqlens_q must be a tensor"),
    ({"cu_seqlens_q": torch.tensor([0, 32]), "cu_seqlens_k": torch.tensor([0, 32]), "max_seqlen_q": True},
     "max_seqlen_q must be an int"),
    ({"cu_seqlens_q": torch.tensor([0, 32]), "cu_seqlens_k": torch.tensor([0, 32]), "max_seqlen_k": 32.0},
     "max_seqlen_k must be an int"),
    ({"attention_mask": [[1] * 32]}, "attention_mask must be a tensor"),
])
def test_argument_types_name_the_argument(kwargs, match):
    """Arguments of the wrong type get a ValueError naming them, not the custom op's schema error (a bool is no
    sequence length)."""
    q, k, v = qkv()
    pattern = None if "block_mask" in kwargs else PATTERN
    with pytest.raises(ValueError, match=match):
        s2_attention(q, k, v, pattern, **kwargs)
