"""transformers' messages and conventions (issue 13, item 5): its own error texts with the S2 hint, and clear
``ValueError``s where Llama fails late or not at all."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity

TRANSFORMERS_TEXT = 'Specified `attn_implementation="foo"` is not supported'
PATTERN = {"block_size": 16, "local_blocks": 1, "vert_stride": 3}


def tiny_config(**overrides):
    fields = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256,
                  sparsity=hybrid_sparsity(2, PATTERN, dense_layers=(0,)))
    return S2LlamaConfig(**{**fields, **overrides})


def test_unknown_attn_implementation_raises_transformers_text_with_the_s2_hint(tmp_path):
    model = S2LlamaForCausalLM(tiny_config())
    with pytest.raises(ValueError) as error:
        model.set_attn_implementation("foo")
    message = str(error.value)
    assert message.startswith(TRANSFORMERS_TEXT)
    assert 'S2 models: "s2" is the default' in message and "('s2', 'sdpa', 'eager')" in message
    assert model.config._attn_implementation == "s2"  # unchanged

    model.save_pretrained(tmp_path)
    for load in (S2LlamaForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=f"^{TRANSFORMERS_TEXT}.*S2 models"):
            load(tmp_path, attn_implementation="foo")
    dense = S2LlamaForCausalLM(tiny_config(sparsity="dense"))
    with pytest.raises(ValueError, match=f"^{TRANSFORMERS_TEXT}.*all-dense S2 model takes any implementation"):
        dense.set_attn_implementation("foo")


def test_config_refuses_query_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match="num_attention_heads=6 must be a multiple of num_key_value_heads=4"):
        tiny_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=4, sparsity="dense")
    with pytest.raises(ValueError, match="s2_rollback_tokens"):
        tiny_config(s2_rollback_tokens=-1)


def test_forward_refuses_bad_inputs_naming_the_argument():
    model = S2LlamaForCausalLM(tiny_config()).eval()
    ids = torch.randint(1, 100, (2, 20))
    with pytest.raises(ValueError, match=r"attention_mask must be the \[batch, past \+ seq_len\] .* = \[2, 20\]"):
        model(ids, attention_mask=torch.ones(2, 19, dtype=torch.long))
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match=r"= \[2, 21\] \(past = 20 cached tokens\)"):
        model(ids[:, :1], attention_mask=torch.ones(2, 1, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="input_ids must be integer token ids"):
        model(ids.float())
    with pytest.raises(ValueError, match=r"input_ids must hold at least one token per row .* got shape \(2, 0\)"):
        model(ids[:, :0])
    with pytest.raises(ValueError, match="inputs_embeds must hold at least one token"):
        model(inputs_embeds=torch.randn(2, 0, 64))
