"""Speculative decoding on the compact cache (issue 13, item 4): ``crop`` rolls rejected drafts back exactly, and
``assistant_model=`` / ``prompt_lookup_num_tokens=`` give the greedy tokens of plain decoding."""

import random

import pytest
import torch

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.cache_s2_llama import S2CacheLayer, kv_cache_bytes
from s2_models.kernels.naive import naive_s2_attention
from s2_models.kernels.pattern import S2Pattern

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
PATTERN = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)


# ------------------------------------------------------------------------------------------------ the layer
@pytest.mark.parametrize("rollback_tokens", [0, 5, 40])
def test_crop_then_continue_equals_attention_over_the_kept_sequence(rollback_tokens):
    """Drafts are written (a chunk or decode steps), some are cropped and replaced by other tokens: every output
    equals full attention over the sequence that is kept. With eviction not held back (or a block evicted too
    early), the window of the cropped length would be gone and the outputs would differ."""
    random.seed(rollback_tokens)
    b, hq, hkv, d = 2, 4, 2, 16
    mask = torch.ones(b, 400, dtype=torch.bool)
    mask[1, :23] = False  # left padding
    layer = S2CacheLayer(rollback_tokens=rollback_tokens)
    kept_q, kept_k, kept_v, outs = [], [], [], []

    def step(n, keep):
        q = torch.randn(b, hq, n, d, dtype=torch.float64)
        k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
        t = sum(x.shape[2] for x in kept_k)
        out = layer.update_and_attend(q, k, v, PATTERN, attention_mask=mask[:, : t + n], backend="torch")
        if keep < n:
            limit = layer.max_crop()
            # the promised room: a prompt rollback_tokens (while its 2-block window stays), later forwards their drafts
            assert limit >= (min(rollback_tokens, n - 33) if t == 0 else n - 1), limit
            layer.crop(-(n - keep))
        kept_q.append(q[:, :, :keep]), kept_k.append(k[:, :, :keep]), kept_v.append(v[:, :, :keep])
        outs.append(out[:, :, :keep])

    step(60, 60 - min(rollback_tokens, 27))  # a prompt whose last tokens are dropped again
    for _ in range(12):
        drafts = random.randint(1, 40)
        step(drafts + 1, random.randint(1, drafts + 1))  # verify drafts in one forward, keep the accepted ones
        for _ in range(random.randint(0, 3)):
            step(1, 1)
    if rollback_tokens:
        for _ in range(rollback_tokens):
            step(1, 1)
        layer.crop(-rollback_tokens)  # decode steps rolled back up to rollback_tokens
        for _ in range(rollback_tokens):
            kept_q[-1:], kept_k[-1:], kept_v[-1:], outs[-1:] = [], [], [], []
        step(3, 3)
    q, k, v = (torch.cat(x, 2) for x in (kept_q, kept_k, kept_v))
    real = mask[:, : k.shape[2]]
    ref, _ = naive_s2_attention(q, k, v, PATTERN, attention_mask=real)
    torch.testing.assert_close(torch.cat(outs, 2), ref.masked_fill(~real[:, None, :, None], 0), atol=1e-10, rtol=0)
    assert layer.get_seq_length() == k.shape[2]


def test_a_crop_deeper_than_the_limit_is_refused_and_names_it():
    layer = S2CacheLayer(rollback_tokens=20)
    x = torch.randn(1, 2, 100, 16)
    layer.update_and_attend(x, x, x, PATTERN)  # ring of 2 window + 2 rollback blocks: blocks 3-6 are held
    limit = layer.max_crop()
    assert limit == 100 - 65  # a row of 65 tokens reads blocks 3-4 (and its vertical blocks); of 64, block 2
    with pytest.raises(ValueError, match=f"at most {limit}.*s2_rollback_tokens"):
        layer.crop(-(limit + 1))
    layer.crop(-limit)
    assert layer.get_seq_length() == 65



def test_the_crop_limit_never_rises_after_a_deep_crop():
    """After a chunk, a deep crop and a decode step, blocks evicted while the sequence was longer stay evicted: the
    limit must not grow back with the shorter length (a crop to 49 tokens would attend without evicted keys, silently
    wrong). The deepest crop still allowed then attends exactly."""
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 16, dtype=torch.float64) for _ in range(3))
    layer = S2CacheLayer(rollback_tokens=16)
    layer.update_and_attend(q[:, :, :64], k[:, :, :64], v[:, :, :64], pattern, backend="torch")
    layer.update_and_attend(q[:, :, 64:97], k[:, :, 64:97], v[:, :, 64:97], pattern, backend="torch")
    layer.crop(-32)  # back to 65 tokens
    layer.update_and_attend(q[:, :, 65:66], k[:, :, 65:66], v[:, :, 65:66], pattern, backend="torch")
    with pytest.raises(ValueError, match="at most"):
        layer.crop(-17)  # to 49 tokens: block 2 went when the sequence held 97
    length = layer.get_seq_length() - layer.max_crop()
    layer.crop(-layer.max_crop())
    out = layer.update_and_attend(q[:, :, length:length + 1], k[:, :, length:length + 1],
                                  v[:, :, length:length + 1], pattern, backend="torch")
    expected, _ = naive_s2_attention(q[:, :, :length + 1], k[:, :, :length + 1], v[:, :, :length + 1], pattern)
    torch.testing.assert_close(out, expected[:, :, length:], atol=1e-12, rtol=0)

# ------------------------------------------------------------------------------------------------ generate()
def tiny_model(seed, layers=3, hidden=64):
    torch.manual_seed(seed)
    config = S2LlamaConfig(vocab_size=100, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                           sparsity=hybrid_sparsity(layers, PATTERN.to_dict(), dense_layers=(0,)))
    return S2LlamaForCausalLM(config).eval()


def repetitive_prompt(length=120, period=11):
    """A document whose continuation repeats parts of it, so that prompt lookup finds n-gram matches."""
    torch.manual_seed(1)
    unit = torch.randint(3, 100, (1, period))
    return unit.repeat(1, -(-length // period))[:, :length]


def count_crops(monkeypatch):
    crops = []
    original = S2CacheLayer.crop

    def counting(self, tokens_to_remove):
        if self.is_compact and tokens_to_remove:
            crops.append(tokens_to_remove)
        return original(self, tokens_to_remove)

    monkeypatch.setattr(S2CacheLayer, "crop", counting)
    return crops


def test_prompt_lookup_decoding_gives_the_greedy_tokens(monkeypatch):
    model = tiny_model(0)
    ids = repetitive_prompt()
    plain = model.generate(ids, max_new_tokens=60, **GREEDY)
    crops = count_crops(monkeypatch)
    looked_up = model.generate(ids, max_new_tokens=60, prompt_lookup_num_tokens=10, **GREEDY)
    assert torch.equal(looked_up, plain)
    assert crops  # drafts were rejected and rolled back in the compact cache


def test_assisted_decoding_with_an_s2_assistant_gives_the_greedy_tokens(monkeypatch):
    """Both caches are compact: the target crops its rejected drafts, the assistant the drafts it made one by one
    (up to num_assistant_tokens=20 < s2_rollback_tokens)."""
    model, assistant = tiny_model(0), tiny_model(1, layers=2, hidden=32)
    # Full drafts every round (a random assistant's confidence would stop them after one token): deep crops.
    assistant.generation_config.assistant_confidence_threshold = 0.0
    ids = torch.randint(3, 100, (1, 50))
    plain = model.generate(ids, max_new_tokens=25, **GREEDY)
    crops = count_crops(monkeypatch)
    out = model.generate(ids, max_new_tokens=25, assistant_model=assistant, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, plain)
    assert crops and min(crops) <= -10, crops  # rejected drafts of a long round rolled back
    sizes = kv_cache_bytes(out.past_key_values)
    assert 0 < sizes["s2_rollback"] < sizes["s2"]


def test_generate_raises_the_rollback_to_the_drafts_it_makes():
    model = tiny_model(0)
    model.config.s2_rollback_tokens = 0
    ids = repetitive_prompt()
    plain = model.generate(ids, max_new_tokens=30, **GREEDY)
    out = model.generate(ids, max_new_tokens=30, prompt_lookup_num_tokens=40, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, plain)
    assert all(layer.rollback_tokens == 40 for layer in out.past_key_values.layers[1:])


@pytest.mark.gpu
def test_speculative_decoding_on_gpu_gives_the_greedy_tokens():
    """On CUDA (Triton prefill, append and decode kernels over the compact cache), fp32: prompt lookup and an S2
    assistant give plain greedy decoding's tokens."""
    model, assistant = tiny_model(0).cuda(), tiny_model(1, layers=2, hidden=32).cuda()
    ids = repetitive_prompt(300).cuda()
    plain = model.generate(ids, max_new_tokens=80, **GREEDY)
    assert torch.equal(model.generate(ids, max_new_tokens=80, prompt_lookup_num_tokens=10, **GREEDY), plain)
    assert torch.equal(model.generate(ids, max_new_tokens=80, assistant_model=assistant, **GREEDY), plain)


# ------------------------------------------------------------------------------------------------ host-side cost
# A verify forward must cost the host about what a decode step costs (bench/NOTES.md: it cost 10x on an H200): no
# JIT compile per new chunk length, no cuDNN plan per new shape, no tile tuning or mask building per forward, no
# storage moved back and forth around crops. Counted here, never timed (bench/bench_speculative.py times them).
def record_specialisations(monkeypatch) -> dict:
    """Kernel name -> the specialisations its launches asked for, for the decode and append kernels."""
    from s2_models.kernels import decode_triton

    seen = {}
    for kernel in (decode_triton.s2_decode_fwd_kernel, decode_triton.s2_cache_append_kernel):
        def run(*args, grid, warmup, _kernel=kernel, _run=kernel.run, **kwargs):
            seen.setdefault(_kernel.fn.__name__, set()).add(decode_triton.launch_specialisation(_kernel, args, kwargs))
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return seen


def test_verify_forwards_of_any_length_reuse_the_compiled_kernels(monkeypatch):
    """Forwards of 1 to 17 tokens with crops in between, as speculative decoding makes them, over a growing cache
    (Triton kernels, split-KV on): the decode kernel is specialised for two tile heights only, append for one, so a
    GPU compiles nothing after the first verify forward; no tile tuning and no block mask either."""
    from s2_models.kernels import decode_triton, pattern, triton_impl

    model = tiny_model(0)
    model.config.s2_backend = "triton"
    monkeypatch.setattr(decode_triton, "_choose_num_splits", lambda programs, num_tiles, device: 2)
    ids = repetitive_prompt(100)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        specialisations = record_specialisations(monkeypatch)
        tuned, masks_built = [], pattern._block_mask.cache_info().misses
        pick_config = triton_impl._pick_config
        monkeypatch.setattr(triton_impl, "_pick_config", lambda *args: tuned.append(args) or pick_config(*args))
        seen = ids.shape[1]
        for tq, rejected in [(1, 0), (11, 4), (2, 1), (5, 0), (8, 7), (16, 3), (17, 9), (3, 2), (1, 0), (11, 0)]:
            tokens = torch.randint(3, 100, (1, tq))
            mask = torch.ones(1, seen + tq, dtype=torch.long)
            model(tokens, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache.crop(-rejected)
            seen += tq - rejected
    assert len(specialisations["s2_decode_fwd_kernel"]) == 3  # the 8-, 16- and 64-row tiles
    assert len(specialisations["s2_cache_append_kernel"]) == 1
    assert not tuned and pattern._block_mask.cache_info().misses == masks_built


def test_a_crop_leaves_the_storage_where_the_next_forwards_write():
    """A verify chunk grows the storage, a crop drops most of it again, decode steps refill it: the storage is not
    shrunk by the crop only to be grown back (each move copies the whole cache), and the outputs stay exact."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 120, 16, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    layer = S2CacheLayer(rollback_tokens=16)
    layer.update_and_attend(q[:, :, :50], k[:, :, :50], v[:, :, :50], PATTERN, backend="torch")
    grown_from = layer.keys.shape[2]
    layer.update_and_attend(q[:, :, 50:67], k[:, :, 50:67], v[:, :, 50:67], PATTERN, backend="torch")
    storage, size = layer.keys.data_ptr(), layer.keys.shape[2]
    assert size > grown_from  # block 4 is vertical for a KV head: one more slot
    layer.crop(-14)  # back to 53 tokens: the new slot is not needed until the row reaches block 4 again
    outs = [layer.update_and_attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], PATTERN,
                                    backend="torch") for t in range(53, 67)]
    assert (layer.keys.data_ptr(), layer.keys.shape[2]) == (storage, size)
    expected, _ = naive_s2_attention(q[:, :, :67], k[:, :, :67], v[:, :, :67], PATTERN)
    torch.testing.assert_close(torch.cat(outs, 2), expected[:, :, 53:], atol=1e-12, rtol=0)


def test_dense_layers_over_the_cache_keep_cudnn_out(monkeypatch):
    """cuDNN builds an execution plan per new shape (tens of ms), and over a cache every forward brings a new key
    length: decode steps and verify chunks (masked SDPA) alike must run SDPA without it."""
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, *args, **kwargs):
        calls.append((query.shape[-2], key.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        return original(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    tiny_model(0).generate(repetitive_prompt(), max_new_tokens=30, prompt_lookup_num_tokens=10, **GREEDY)
    over_cache = [(tq, cudnn) for tq, tk, cudnn in calls if tq != tk]
    assert any(tq > 1 for tq, _ in over_cache) and any(tq == 1 for tq, _ in over_cache)
    assert not any(cudnn for _, cudnn in over_cache)
