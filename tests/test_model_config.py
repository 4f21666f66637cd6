"""S2LlamaConfig: normalization, the hybrid recipe, layer_types, and every refused configuration."""

import pytest
from transformers import LlamaConfig

from s2_models import S2LlamaConfig, S2Pattern, hybrid_sparsity

PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)


def test_default_config_constructs_with_the_hybrid_recipe():
    config = S2LlamaConfig()
    assert config.model_type == "s2_llama"
    assert config.sparsity == hybrid_sparsity(config.num_hidden_layers)
    assert config.layer_types[:3] == ["full_attention", "full_attention", "s2_attention"]
    assert config.sparsity[2] == S2Pattern().to_dict()


def test_single_entry_is_normalized_to_one_full_dict_per_layer():
    config = S2LlamaConfig(**TINY, sparsity=PATTERN)
    assert config.sparsity == [S2Pattern(**PATTERN).to_dict()] * 4
    assert config.layer_types == ["s2_attention"] * 4
    dense = S2LlamaConfig(**TINY, sparsity="dense")
    assert dense.sparsity == ["dense"] * 4 and dense.layer_types == ["full_attention"] * 4
    assert config.layer_patterns()[0] == S2Pattern(**PATTERN) and dense.layer_patterns() == [None] * 4


def test_hybrid_sparsity_recipes():
    dense_of = lambda spec: [i for i, s in enumerate(spec) if s == "dense"]
    assert dense_of(hybrid_sparsity(8)) == [0, 1]
    assert dense_of(hybrid_sparsity(8, PATTERN, dense_layers=(0, 1, 7))) == [0, 1, 7]
    assert dense_of(hybrid_sparsity(8, PATTERN, dense_every=4)) == [0, 4]
    assert dense_of(hybrid_sparsity(8, S2Pattern(**PATTERN), dense_layers=(7,), dense_every=3)) == [0, 3, 6, 7]
    assert hybrid_sparsity(3, PATTERN, dense_layers=())[0] == S2Pattern(**PATTERN).to_dict()
    for bad in (dict(dense_layers=(8,)), dict(dense_every=0), dict(dense_layers=(-1,))):
        with pytest.raises(ValueError, match="dense_layers|dense_every"):
            hybrid_sparsity(8, PATTERN, **bad)
    with pytest.raises(ValueError, match="num_layers"):
        hybrid_sparsity(0)


def test_layer_types_alone_or_consistent_are_accepted():
    types = ["full_attention", "s2_attention", "s2_attention", "full_attention"]
    config = S2LlamaConfig(**TINY, layer_types=types)
    assert config.sparsity[0] == "dense" and config.sparsity[1] == S2Pattern().to_dict()
    again = S2LlamaConfig(**TINY, layer_types=types, sparsity=hybrid_sparsity(4, PATTERN, dense_layers=(0, 3)))
    assert again.layer_types == types


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(sparsity=[PATTERN] * 3), "one entry per layer"),
        (dict(sparsity=[PATTERN, "dense", "sparse", "dense"]), r"sparsity\[2\]"),
        (dict(sparsity=[{**PATTERN, "stride": 2}] * 4), "unknown S2 pattern keys"),
        (dict(sparsity=[{**PATTERN, "block_size": 48}] * 4), "block_size"),
        (dict(sparsity=[{**PATTERN, "local_blocks": 0}] * 4), "local_blocks"),
        (dict(sparsity=[{**PATTERN, "vert_stride": -1}] * 4), "vert_stride"),
        (dict(sparsity=[{**PATTERN, "num_dense_heads": 3}] * 4), "num_dense_heads must be in \\[0, 2\\]"),
        (dict(sparsity=[{**PATTERN, "num_dense_heads": 5, "per_query_head": True}] * 4), "query heads"),
        (dict(sparsity=PATTERN, hidden_size=32), "head_dim must be a multiple of 16"),
        (dict(sparsity=PATTERN, head_dim=24), "head_dim must be a multiple of 16"),
        (dict(sparsity=PATTERN, head_dim=272, hidden_size=64), "head_dim must be a multiple of 16"),
        (dict(sparsity=PATTERN, attention_dropout=0.1), "attention_dropout"),
        (dict(sparsity="dense", layer_types=["s2_attention"] * 4), "contradicts"),
        (dict(layer_types=["sliding_attention"] * 4), "layer_types entries"),
        (dict(layer_types=["full_attention"] * 3), "layer_types must have"),
        (dict(sparsity=PATTERN, s2_backend="cuda"), "s2_backend"),
    ],
)
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        S2LlamaConfig(**{**TINY, **overrides})


def test_all_dense_models_need_no_kernel_constraints():
    config = S2LlamaConfig(**{**TINY, "hidden_size": 32}, sparsity="dense", attention_dropout=0.1)
    assert config.head_dim == 8


def test_from_llama_keeps_the_llama_fields():
    llama = LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    config = S2LlamaConfig.from_llama(llama, sparsity=hybrid_sparsity(4, PATTERN))
    assert isinstance(config, S2LlamaConfig) and config.model_type == "s2_llama"
    for key in ("vocab_size", "hidden_size", "num_key_value_heads", "tie_word_embeddings", "rope_parameters"):
        assert getattr(config, key) == getattr(llama, key)
    assert config.layer_types == ["full_attention"] * 2 + ["s2_attention"] * 2
    with pytest.raises(ValueError, match="LlamaConfig"):
        S2LlamaConfig.from_llama(config.to_dict())


def test_sparsity_override_on_load_replaces_the_stored_layer_types(tmp_path):
    S2LlamaConfig(**TINY, sparsity=PATTERN).save_pretrained(tmp_path)
    config = S2LlamaConfig.from_pretrained(tmp_path, sparsity="dense")
    assert config.layer_types == ["full_attention"] * 4
    with pytest.raises(ValueError, match="one entry per layer"):
        S2LlamaConfig.from_pretrained(tmp_path, num_hidden_layers=2)


def test_config_json_spells_out_the_architecture(tmp_path):
    S2LlamaConfig().save_pretrained(tmp_path)  # equal to the defaults, still written
    text = (tmp_path / "config.json").read_text()
    assert '"sparsity"' in text and '"auto_map"' in text and '"layer_types"' not in text  # derived from sparsity
    assert S2LlamaConfig.from_pretrained(tmp_path).sparsity == S2LlamaConfig().sparsity
