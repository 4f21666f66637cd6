"""S2Llama forward semantics: sparsity, equivalence of the implementations, padding, packing, caching, training."""

import copy
import os
import warnings

import pytest
import torch

from s2_models import S2CoverageWarning, S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.modeling_s2_llama import uncovered_offsets_by_layer

# Small blocks so that a few dozen tokens span several blocks: 16-token blocks, each query block reads its own block
# (local_blocks=1) and every third key block.
PATTERN = {"block_size": 16, "local_blocks": 1, "vert_stride": 3}
IMPLEMENTATIONS = ("s2", "sdpa", "eager")


def tiny_config(sparsity=None, **overrides) -> S2LlamaConfig:
    fields = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    sparsity = hybrid_sparsity(4, PATTERN, dense_layers=(0,)) if sparsity is None else sparsity
    return S2LlamaConfig(**{**fields, **overrides}, sparsity=sparsity)


def tiny_model(sparsity=None, attn_implementation=None, **overrides) -> S2LlamaForCausalLM:
    model = S2LlamaForCausalLM(tiny_config(sparsity, **overrides)).eval()
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


def with_sparsity(model, sparsity, attn_implementation="s2"):
    """The same weights under another sparsity."""
    other = S2LlamaForCausalLM(tiny_config(sparsity)).eval()
    other.load_state_dict(model.state_dict())
    other.set_attn_implementation(attn_implementation)
    return other


def logits(model, input_ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=input_ids, **kwargs).logits


def tokens(*shape):
    return torch.randint(1, 100, shape)  # 0 is the padding token


def assert_close(actual, expected, atol=2e-5):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ coverage
def test_a_model_whose_heads_leave_offsets_to_no_head_warns_once_with_the_fix():
    # 2 KV heads with stride 8: step 4, stripes on offsets 7 and 3 only; the config itself is legal
    config = tiny_config(hybrid_sparsity(4, {"block_size": 16, "local_blocks": 2, "vert_stride": 8}, dense_layers=(0,)))
    assert uncovered_offsets_by_layer(config) == {i: (0, 1, 2, 4, 5, 6) for i in (1, 2, 3)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # Python's own filter: a message once per process
        S2LlamaForCausalLM(config)
        S2LlamaForCausalLM(S2LlamaConfig.from_dict(config.to_dict()))  # the same config again: not repeated
    assert [w.category for w in record] == [S2CoverageWarning]
    message = str(record[0].message)
    assert "S2 layers 1-3 (vert_stride 8, 2 pattern heads: the KV heads)" in message
    assert "6 of the 8 vertical offsets" in message and "[0, 1, 2, 4, 5, 6]" in message
    assert "per_query_head=True (4 pattern heads)" in message and "vert_stride <= 2" in message


def test_layers_with_different_uncovered_patterns_share_one_warning():
    narrow = {"block_size": 16, "local_blocks": 2, "vert_stride": 4, "homo_head": True}
    folded = {"block_size": 16, "local_blocks": 2, "vert_stride": 4, "per_query_head": True, "head_sliding_step": 2}
    with pytest.warns(S2CoverageWarning) as record:
        S2LlamaForCausalLM(tiny_config(["dense", narrow, folded, narrow]))
    assert len(record) == 1
    message = str(record[0].message)
    assert "S2 layers 1, 3 (vert_stride 4, 2 pattern heads: the KV heads)" in message and "homo_head=False" in message
    assert "S2 layers 2 (vert_stride 4, 4 pattern heads: the query heads)" in message
    assert "head_sliding_step=None" in message


@pytest.mark.parametrize("pattern", [
    {"block_size": 16, "local_blocks": 2, "vert_stride": 4, "per_query_head": True},  # 4 query heads, step 1
    {"block_size": 16, "local_blocks": 2, "vert_stride": 2},  # 2 KV heads, stride 2
    {"block_size": 16, "local_blocks": 2, "vert_stride": 8, "num_dense_heads": 1},
    "dense",
])
def test_models_whose_heads_cover_every_offset_do_not_warn(pattern):
    with warnings.catch_warnings():
        warnings.simplefilter("error", S2CoverageWarning)
        S2LlamaForCausalLM(tiny_config(pattern))


# ------------------------------------------------------------------------------------------------ sparsity
def test_s2_is_the_default_implementation():
    assert tiny_model().config._attn_implementation == "s2"


def test_sparse_layers_equal_dense_within_the_first_block_and_differ_beyond():
    model = tiny_model(PATTERN)
    dense = with_sparsity(model, "dense")
    ids = tokens(2, 80)
    sparse_logits, dense_logits = logits(model, ids), logits(dense, ids)
    block = PATTERN["block_size"]
    assert_close(sparse_logits[:, :block], dense_logits[:, :block])
    # from the third block on, the pattern skips the second block for some heads
    assert (sparse_logits[:, 2 * block :] - dense_logits[:, 2 * block :]).abs().max() > 1e-3


def test_vert_stride_one_equals_dense():
    model = tiny_model({**PATTERN, "vert_stride": 1})
    ids = tokens(2, 70)
    for implementation in IMPLEMENTATIONS:
        assert_close(logits(with_sparsity(model, "dense", implementation), ids), logits(model, ids))


@pytest.mark.parametrize("sparsity", [None, {**PATTERN, "per_query_head": True, "num_dense_heads": 1}])
def test_every_implementation_computes_the_same_function(sparsity):
    model = tiny_model(sparsity)
    ids = tokens(2, 75)
    expected = logits(model, ids)
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        assert_close(logits(model, ids), expected)


def test_sparse_models_refuse_implementations_that_cannot_apply_the_pattern():
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        S2LlamaForCausalLM._from_config(tiny_config(), attn_implementation="flex_attention")
    dense = S2LlamaForCausalLM._from_config(tiny_config("dense"), attn_implementation="sdpa")
    assert dense.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------------------ padding
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_equal_single_sequence_runs(implementation, side):
    model = tiny_model(attn_implementation=implementation)
    lengths = [70, 37, 5]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    sequences = [tokens(1, n) for n in lengths]
    for row, seq in enumerate(sequences):
        n = seq.shape[1]
        where = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, where], mask[row, where] = seq[0], 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    batched = logits(model, ids, attention_mask=mask, position_ids=position_ids)
    for row, seq in enumerate(sequences):
        real = mask[row].bool()
        assert_close(batched[row, real], logits(model, seq)[0])


# ------------------------------------------------------------------------------------------------ packing
def packed(lengths):
    sequences = [tokens(1, n) for n in lengths]
    ids = torch.cat(sequences, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    return sequences, ids, position_ids, flash_kwargs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("inputs", ["flash_kwargs", "position_ids"])
def test_packed_sequences_equal_separate_runs(implementation, inputs):
    model = tiny_model(attn_implementation=implementation)
    lengths = [40, 7, 50]
    sequences, ids, position_ids, flash_kwargs = packed(lengths)
    kwargs = dict(position_ids=position_ids, **(flash_kwargs if inputs == "flash_kwargs" else {}))
    out = logits(model, ids, **kwargs)
    for seq, piece in zip(sequences, out[0].split(lengths)):
        assert_close(piece, logits(model, seq)[0])


def test_packed_sequences_refuse_a_cache_or_a_padding_mask():
    """The sequence boundaries replace both: combining them would silently attend across sequences."""
    from transformers import DynamicCache

    model = tiny_model()
    _, ids, position_ids, flash_kwargs = packed([20, 30])
    with pytest.raises(ValueError, match="packed sequences"):
        model(ids, position_ids=position_ids, past_key_values=DynamicCache(config=model.config), **flash_kwargs)
    with pytest.raises(ValueError, match="packed sequences"):
        model(ids, position_ids=position_ids, attention_mask=torch.ones_like(ids), **flash_kwargs)


def test_packed_rows_of_a_batch_equal_separate_runs():
    model = tiny_model()
    rows = [packed([20, 30]), packed([33, 17])]
    ids = torch.cat([row[1] for row in rows])
    position_ids = torch.cat([row[2] for row in rows])
    out = logits(model, ids, position_ids=position_ids)
    for row, (sequences, *_) in enumerate(rows):
        for seq, piece in zip(sequences, out[row].split([s.shape[1] for s in sequences])):
            assert_close(piece, logits(model, seq)[0])


def test_flattening_collator_batches_train():
    from transformers import DataCollatorWithFlattening

    model = tiny_model()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": tokens(n).tolist()} for n in (30, 45)])
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[2].self_attn.q_proj.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_cached_decoding_equals_full_forward(implementation):
    model = tiny_model(attn_implementation=implementation)
    ids = tokens(1, 30)
    generated = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    full = logits(model, generated)
    assert torch.equal(full[:, ids.shape[1] - 1 : -1].argmax(-1), generated[:, ids.shape[1] :])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_left_padded_generation_equals_single_sequence_generation(implementation):
    model = tiny_model(attn_implementation=implementation)
    short, long = tokens(1, 12), tokens(1, 35)
    ids = torch.cat([torch.cat([torch.zeros(1, 23, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 23), torch.ones(1, 12)], 1), torch.ones(1, 35)]).long()
    # no EOS: a random model may emit it early, and the batch then pads that row while the single run stops
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    for row, seq in enumerate((short, long)):
        single = model.generate(seq, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(batched[row, 35:], single[0, seq.shape[1] :])


# ------------------------------------------------------------------------------------------------ training
def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model().train()
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = tokens(2, 50)
    for m in (model, checkpointed):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_backward(dtype):
    model = tiny_model().to(dtype).train()
    ids = tokens(2, 40)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.dtype == torch.float32 or loss.dtype == dtype
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_triton_kernels_match_the_torch_path_on_a_100m_model():
    """bf16 forward and backward of a ~100M-parameter hybrid model: Triton kernels vs the exact PyTorch path."""
    torch.manual_seed(0)
    config = S2LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=4096,
        sparsity=hybrid_sparsity(12, {"block_size": 64, "local_blocks": 4, "vert_stride": 8}),
    )
    model = S2LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    assert 90e6 < model.num_parameters() < 150e6
    ids = torch.randint(0, config.vocab_size, (2, 2048), device="cuda")
    results = {}
    for backend in ("triton", "torch"):
        model.config.s2_backend = backend
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        results[backend] = (out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters()})
    (triton_logits, triton_grads), (torch_logits, torch_grads) = results["triton"], results["torch"]
    torch.testing.assert_close(triton_logits, torch_logits, atol=5e-2, rtol=5e-2)
    for name, grad in torch_grads.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert (triton_grads[name] - grad).abs().max() / scale < 5e-2, name


def test_gpu_test_backend_switch_is_a_config_field():
    # The GPU test switches backends through config.s2_backend; keep that contract checked on CPU too.
    model = tiny_model(PATTERN)
    ids = tokens(1, 40)
    expected = logits(model, ids)
    model.config.s2_backend = "torch"
    assert_close(logits(model, ids), expected)
    if os.environ.get("TRITON_INTERPRET") == "1":
        model.config.s2_backend = "triton"
        assert_close(logits(model, ids), expected, atol=1e-4)
