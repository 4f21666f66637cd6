"""Long positions and rope scaling (issue 13, item 1): any length Llama accepts, with the cache on, for every rope type.

The model's ``max_position_embeddings`` is 32 and the inputs run to ~90 tokens, so every check is past it. The
all-dense S2 model is compared with ``LlamaForCausalLM`` (same weights): a rope position clamped or wrapped anywhere
would change its logits. The sparse model is compared with the reference implementation (``"sdpa"``, the same
pattern through a mask) and with itself without the cache.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.static_cache_s2_llama import S2StaticCache

MAX_POSITIONS = 32
ORIGINAL = 16  # original_max_position_embeddings of the scaling types that take one
PATTERN = {"block_size": 16, "local_blocks": 1, "vert_stride": 3}
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "factor": MAX_POSITIONS / ORIGINAL, "short_factor": [1.0] * 8,
                 "long_factor": [1.0 + i / 2 for i in range(8)], "original_max_position_embeddings": ORIGINAL},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def s2_model(rope, sparsity=None, attn_implementation=None):
    torch.manual_seed(0)
    config = S2LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_theta": 10000.0, **ROPES[rope]},
        sparsity=hybrid_sparsity(2, PATTERN, dense_layers=(0,)) if sparsity is None else sparsity,
    )
    model = S2LlamaForCausalLM(config).eval()
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


def same_weights(model, attn_implementation):
    other = S2LlamaForCausalLM(copy.deepcopy(model.config)).eval()
    other.load_state_dict(model.state_dict())
    other.set_attn_implementation(attn_implementation)
    return other


def llama_of(model):
    s2_only = ("sparsity", "layer_types", "s2_backend", "s2_rollback_tokens", "model_type", "architectures")
    fields = {k: v for k, v in model.config.to_dict().items() if k not in s2_only}
    llama = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    llama.load_state_dict(model.state_dict())
    return llama


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rope", ROPES)
def test_forward_past_max_positions_equals_llama_and_the_reference(rope):
    ids = torch.randint(1, 100, (2, 3 * MAX_POSITIONS - 7))
    dense = s2_model(rope, sparsity="dense")
    with torch.no_grad():
        assert_close(dense(ids).logits, llama_of(dense)(ids).logits)  # the cache is on (forward's default)
        sparse = s2_model(rope)
        cached = sparse(ids).logits
        assert_close(cached, sparse(ids, use_cache=False).logits)
        assert_close(cached, same_weights(sparse, "sdpa")(ids).logits)
        # prefill + chunk + decode steps past the limit equal the single forward
        out = sparse(ids[:, :20])
        pieces = [out.logits, sparse(ids[:, 20:61], past_key_values=out.past_key_values).logits]
        pieces += [sparse(ids[:, t : t + 1], past_key_values=out.past_key_values).logits for t in range(61, 89)]
        assert out.past_key_values.get_seq_length() == 89
    if rope != "dynamic":  # dynamic rope changes its frequencies with the length seen so far (Llama's too)
        assert_close(torch.cat(pieces, 1), cached)


@pytest.mark.parametrize("rope", ROPES)
def test_generate_past_max_positions(rope):
    """Cached generation runs to ~2x max_position_embeddings: the same logits as the reference implementation (the
    same pattern), as the static cache (sized by generate's max_length), and, except for `dynamic`, as no cache."""
    ids = torch.randint(1, 100, (1, 40))
    kwargs = dict(max_new_tokens=30, output_logits=True, return_dict_in_generate=True, **GREEDY)
    sparse = s2_model(rope)
    # fresh copies: dynamic rope keeps the longest length seen in the model (as Llama's does)
    out = same_weights(sparse, "s2").generate(ids, **kwargs)
    assert out.sequences.shape[1] == 70 and out.past_key_values.get_seq_length() == 69
    reference = same_weights(sparse, "sdpa").generate(ids, **kwargs)
    static = same_weights(sparse, "s2").generate(ids, cache_implementation="static", **kwargs)
    assert isinstance(static.past_key_values, S2StaticCache)
    for other in (reference, static):
        assert torch.equal(other.sequences, out.sequences)
        assert_close(torch.stack(other.logits), torch.stack(out.logits))
    if rope != "dynamic":
        assert torch.equal(sparse.generate(ids, use_cache=False, **kwargs).sequences, out.sequences)


def test_dynamic_rope_recomputes_its_frequencies_as_transformers_does():
    dense = s2_model("dynamic", sparsity="dense")
    llama = llama_of(dense)
    original = dense.model.rotary_emb.inv_freq.clone()
    ids = torch.randint(1, 100, (1, 40))
    kwargs = dict(max_new_tokens=40, output_logits=True, return_dict_in_generate=True, **GREEDY)
    out, expected = dense.generate(ids, **kwargs), llama.generate(ids, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert_close(torch.stack(out.logits), torch.stack(expected.logits))
    assert not torch.equal(dense.model.rotary_emb.inv_freq, original)  # rescaled past max_position_embeddings
    torch.testing.assert_close(dense.model.rotary_emb.inv_freq, llama.model.rotary_emb.inv_freq)


def test_static_cache_takes_any_max_cache_len_and_refuses_overflow():
    model = s2_model("linear")
    cache = S2StaticCache(model.config, max_cache_len=4 * MAX_POSITIONS)
    ids = torch.randint(1, 100, (1, 3 * MAX_POSITIONS))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="max_cache_len=128"):
            for t in range(MAX_POSITIONS + 1):
                model(ids[:, t : t + 1], past_key_values=cache)


@pytest.mark.gpu
@pytest.mark.parametrize("rope", ["linear", "dynamic"])
def test_static_cache_with_cuda_graphs_past_max_positions_on_gpu(rope):
    """On CUDA, fp32: the static cache past max_position_embeddings (decode steps replayed as CUDA graphs; eager for
    `dynamic`, whose frequencies change with the length) gives the dynamic cache's tokens and logits."""
    sparse = s2_model(rope)
    ids = torch.randint(1, 100, (2, 40), device="cuda")
    kwargs = dict(max_new_tokens=40, output_logits=True, return_dict_in_generate=True, **GREEDY)
    dynamic = same_weights(sparse, "s2").cuda().generate(ids, **kwargs)
    static = same_weights(sparse, "s2").cuda().generate(ids, cache_implementation="static", **kwargs)
    assert static.past_key_values.cuda_graphs == (rope == "linear")
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=2e-4, rtol=1e-4)
