"""``output_attentions``: the weights from the eager reference (the sparse pattern applied), a clear error elsewhere.

Control: transformers' Llama with eager attention. (Llama with SDPA warns and returns an empty tuple; S2 refuses.)
"""

import pytest
import torch
from test_modeling import tiny_config, tiny_model, tokens
from transformers import LlamaConfig, LlamaForCausalLM

from s2_models import S2LlamaForCausalLM
from s2_models.kernels.pattern import S2Pattern, token_mask


@pytest.mark.parametrize("implementation", ["s2", "sdpa"])
def test_implementations_without_weights_refuse_instead_of_returning_nothing(implementation):
    model = tiny_model(attn_implementation=implementation)
    ids = tokens(1, 20)
    with pytest.raises(ValueError, match='output_attentions=True.*attn_implementation="eager"'):
        model(input_ids=ids, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions"):
        model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True, pad_token_id=0)
    assert model(input_ids=ids, output_attentions=False).attentions is None


def test_output_attentions_requested_through_the_config_is_refused_too():
    model = S2LlamaForCausalLM(tiny_config(output_attentions=True)).eval()
    assert model.config._attn_implementation == "s2"
    ids = tokens(1, 20)
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids)
    assert model(input_ids=ids, output_attentions=False).attentions is None  # the call's False wins, as in transformers


def test_eager_returns_the_weights_of_the_sparse_pattern():
    model = tiny_model(attn_implementation="eager")
    t = 70
    attentions = model(input_ids=tokens(2, t), output_attentions=True).attentions
    config = model.config
    assert len(attentions) == config.num_hidden_layers
    for layer, weights in zip(model.model.layers, attentions):
        assert weights.shape == (2, config.num_attention_heads, t, t)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, config.num_attention_heads, t))
        pattern: S2Pattern | None = layer.self_attn.s2_pattern
        if pattern is None:
            allowed = torch.ones(t, t, dtype=torch.bool).tril().expand(config.num_key_value_heads, t, t)
        else:
            blocks = -(-t // pattern.block_size)
            blocks = pattern.block_mask(config.num_key_value_heads, blocks, blocks)
            allowed = token_mask(blocks, pattern.block_size, t, t)
        allowed = allowed.repeat_interleave(config.num_attention_heads // config.num_key_value_heads, dim=0)
        assert (weights[:, ~allowed] == 0).all()  # zero outside each head's pattern
        assert (weights[:, allowed] > 0).all()  # and every kept key gets weight


def test_all_dense_eager_weights_equal_llama():
    torch.manual_seed(0)
    config = tiny_config("dense")
    llama = LlamaForCausalLM(LlamaConfig(**{k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")}, attn_implementation="eager")).eval()
    s2 = S2LlamaForCausalLM(config).eval()
    s2.load_state_dict(llama.state_dict())
    s2.set_attn_implementation("eager")
    ids = tokens(2, 33)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        expected = llama(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        actual = s2(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(actual) == len(expected) == config.num_hidden_layers
    real = mask.bool()
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a[1], e[1])
        torch.testing.assert_close(a[0][:, real[0]], e[0][:, real[0]])  # padded query rows: no meaning in either


def test_eager_generation_returns_the_attentions_of_every_step():
    model = tiny_model(attn_implementation="eager")
    ids = tokens(1, 40)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None,
                         output_attentions=True, return_dict_in_generate=True)
    heads = model.config.num_attention_heads
    assert [step[0].shape for step in out.attentions] == [(1, heads, 40, 40), (1, heads, 1, 41), (1, heads, 1, 42)]
    assert all(len(step) == model.config.num_hidden_layers for step in out.attentions)
