"""The compact S2 cache: incremental attention equals full attention, memory is the kept fraction, generate()."""

import random

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.cache_s2_llama import S2CacheLayer, kv_cache_bytes
from s2_models.kernels.naive import naive_s2_attention
from s2_models.kernels.pattern import S2Pattern
from s2_models.modeling_s2_llama import CACHE_NAME

PATTERN = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)


def run_chunks(layer, q, k, v, pattern, chunks, mask=None, backend="torch"):
    outs, t = [], 0
    for size in chunks:
        e = t + size
        m = None if mask is None else mask[:, :e]
        outs.append(layer.update_and_attend(q[:, :, t:e], k[:, :, t:e], v[:, :, t:e], pattern, attention_mask=m,
                                            backend=backend))
        t = e
    return torch.cat(outs, 2)


PER_QUERY_HEAD = S2Pattern(block_size=16, local_blocks=1, vert_stride=4, per_query_head=True)


@pytest.mark.parametrize("pattern", [PATTERN, PER_QUERY_HEAD])
def test_incremental_attention_equals_full_attention_left_padded(pattern):
    b, hq, hkv, d, t = 3, 4, 2, 16, 170
    q = torch.randn(b, hq, t, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, t, d, dtype=torch.float64) for _ in range(2))
    pads = torch.tensor([0, 37, 90])
    mask = torch.arange(t)[None, :] >= pads[:, None]
    prompt = random.randint(20, 60)
    chunks = [prompt, 1, 1, 23, 1, 40] + [1] * (t - prompt - 66)
    out = run_chunks(S2CacheLayer(), q, k, v, pattern, chunks, mask)
    ref, _ = naive_s2_attention(q, k, v, pattern, attention_mask=mask)
    torch.testing.assert_close(out, ref.masked_fill(~mask[:, None, :, None], 0), atol=1e-10, rtol=0)


def test_triton_incremental_fp32():
    """Prefill, append and decode through Triton: compiled on a GPU, interpreted (TRITON_INTERPRET=1) without one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, hq, hkv, d, t = 2, 4, 2, 32, 120
    q = torch.randn(b, hq, t, d)
    k, v = (torch.randn(b, hkv, t, d) for _ in range(2))
    out = run_chunks(S2CacheLayer(), q.to(device), k.to(device), v.to(device), PATTERN, [50, 1, 9, 1, 1],
                     backend="triton")
    ref, _ = naive_s2_attention(q, k, v, PATTERN)
    torch.testing.assert_close(out.double().cpu(), ref[:, :, :62], atol=1e-5, rtol=0)


def test_memory_is_the_kept_fraction():
    pattern = S2Pattern(block_size=16, local_blocks=4, vert_stride=8)
    layer, hkv, d, n = S2CacheLayer(), 4, 16, 4096
    k = torch.randn(1, hkv, n, d)
    layer.update_and_attend(torch.randn(1, hkv, n, d), k, k, pattern)
    for _ in range(40):  # decode keeps the size bounded
        x = torch.randn(1, hkv, 1, d)
        layer.update_and_attend(x, x, x, pattern)
    blocks = (n + 40 + 15) // 16
    kept = pattern.local_blocks + blocks // pattern.vert_stride  # window + vertical blocks, per head
    assert layer.keys.shape[2] // 16 <= 1.1 * kept
    assert layer.get_seq_length() == n + 40


def test_reorder_select_and_errors():
    layer = S2CacheLayer()
    x = torch.randn(2, 2, 40, 16)
    layer.update_and_attend(x, x, x, PATTERN)
    with pytest.raises(ValueError, match="beam_idx"):
        layer.reorder_cache(torch.tensor([0, 1, 1]))
    layer.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(layer.keys[0], layer.keys[1])
    y = torch.randn(3, 2, 1, 16)
    with pytest.raises(ValueError, match="batch size"):
        layer.update_and_attend(y, y, y, PATTERN)
    y = torch.randn(2, 2, 1, 16)
    with pytest.raises(ValueError, match="another model"):
        layer.update_and_attend(y, y, y, S2Pattern(block_size=16, local_blocks=3, vert_stride=3))
    with pytest.raises(ValueError, match="compact"):
        layer.update(y, y)
    # no rollback: the window (2 blocks of 16) of 40 tokens starts at token 16, so 7 tokens can go (33 keep it whole)
    with pytest.raises(ValueError, match="can drop at most 7"):
        layer.crop(-8)


# ------------------------------------------------------------------------------------------------ generate()
def tiny_model(**overrides):
    config = S2LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           sparsity=hybrid_sparsity(3, PATTERN.to_dict(), dense_layers=(0,)), **overrides)
    return S2LlamaForCausalLM(config).eval()


def test_generate_uses_the_compact_cache_and_equals_recomputation():
    model = tiny_model()
    ids = torch.randint(3, 100, (1, 150))
    out = model.generate(ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=None)
    cache = out.past_key_values
    assert isinstance(cache.layers[0], DynamicLayer) and not isinstance(cache.layers[0], S2CacheLayer)
    assert all(isinstance(layer, S2CacheLayer) and layer.is_compact for layer in cache.layers[1:])
    sizes = kv_cache_bytes(cache)
    # beyond the rollback room, two sparse layers hold less than one dense layer's 60%
    assert sizes["s2"] - sizes["s2_rollback"] < sizes["dense"] * 2 * 0.6
    rollback_blocks = -(-model.config.s2_rollback_tokens // PATTERN.block_size)  # 4 ring blocks per KV head
    token_bytes = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # K and V, float32
    assert sizes["s2_rollback"] == 2 * rollback_blocks * PATTERN.block_size * token_bytes
    recomputed = model.generate(ids, max_new_tokens=30, do_sample=False, use_cache=False, pad_token_id=0,
                                eos_token_id=None)
    assert torch.equal(out.sequences, recomputed)


def test_generate_hands_its_cache_to_every_forward():
    """transformers 5.24 renamed the cache kwarg from past_key_values to cache; a forward that missed the new name got
    it in **kwargs unread and ran every step without its cache (slow, and wrong: each step saw one token). The cache
    generate returns must hold the prompt and all but the last generated token, its sparse layers compact."""
    model = tiny_model()
    ids = torch.randint(3, 100, (1, 150))
    new_lengths, caches = [], []

    def record(module, args, kwargs):
        new_lengths.append(kwargs["input_ids"].shape[1])
        caches.append(kwargs[CACHE_NAME])

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, pad_token_id=0,
                             eos_token_id=None)
    finally:
        hook.remove()
    cache = getattr(out, CACHE_NAME)
    assert new_lengths == [150, 1, 1, 1, 1] and all(c is cache for c in caches)
    assert cache.get_seq_length() == 150 + 5 - 1
    assert all(isinstance(layer, S2CacheLayer) and layer.is_compact and layer.get_seq_length() == 154
               for layer in cache.layers[1:])


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_forwards_take_the_cache_under_either_name(name):
    """``cache`` (transformers >= 5.24) and ``past_key_values`` (earlier, and callers written for it) are one input."""
    model = tiny_model()
    ids = torch.randint(3, 100, (1, 40))
    for forward in (model, model.model):
        cache = DynamicCache(config=model.config)
        out = forward(ids, use_cache=True, **{name: cache})
        assert getattr(out, CACHE_NAME) is cache and cache.get_seq_length() == 40
    same = DynamicCache(config=model.config)
    model(ids, cache=same, past_key_values=same)
    with pytest.raises(ValueError, match="both cache and past_key_values"):
        model(ids, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))


def test_generate_beam_search_and_sampling_match_full_cache():
    model = tiny_model()
    ids = torch.randint(3, 100, (2, 70))
    for kwargs in ({"num_beams": 3, "num_return_sequences": 2}, {"do_sample": True, "top_k": 5}):
        torch.manual_seed(0)
        compact = model.generate(ids, max_new_tokens=20, pad_token_id=0, eos_token_id=None, **kwargs)
        torch.manual_seed(0)
        full = model.generate(ids, max_new_tokens=20, pad_token_id=0, eos_token_id=None,
                              past_key_values=DynamicCache(), **kwargs)
        assert torch.equal(compact, full)


@pytest.mark.gpu
def test_generate_on_gpu_with_triton_kernels_left_padded():
    """On CUDA the prefill runs the Triton S2 kernel and decoding the Triton decode kernel over the compact cache:
    incremental logits equal full-forward logits, and cached greedy generation equals full recomputation."""
    torch.manual_seed(0)
    model = tiny_model().cuda()
    ids = torch.randint(3, 100, (2, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :45] = 0  # left padding
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    assert all(layer.is_compact for layer in out.past_key_values.layers[1:])
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], 1)
    with torch.no_grad():
        full = model(out.sequences, attention_mask=full_mask, use_cache=False).logits
    incremental = torch.stack(out.logits, 1)  # [B, new, V]
    torch.testing.assert_close(incremental, full[:, ids.shape[1] - 1 : -1], atol=2e-4, rtol=1e-4)
    recomputed = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, use_cache=False,
                                pad_token_id=0, eos_token_id=None)
    assert torch.equal(out.sequences, recomputed)
    alone = model.generate(ids[1:, 45:], max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out.sequences[1:, 45:], alone)
