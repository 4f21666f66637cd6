"""torch.compile: the kernels as custom ops (fake implementations, autograd), a fullgraph training step equal to eager,
compiled static-cache generation equal to eager, and custom 4-D masks refused clearly.

CPU tests trace with the ``aot_eager`` backend (no C++ code generation); the GPU tests use Inductor.
"""

import pytest
import torch
from test_cache import tiny_model as cached_model
from test_modeling import tiny_model, tokens
from test_static_cache import GREEDY, left_padded
from torch._dynamo.utils import counters
from transformers import CompileConfig

from s2_models.kernels import interface, s2_attention
from s2_models.kernels.decode import (
    CompactLayout,
    cache_append_op,
    decode_attention_op,
    s2_cache_append,
    s2_decode_attention,
    slot_blocks,
)
from s2_models.kernels.interface import attention_backward_op, attention_op, pattern_from_ints, pattern_to_ints
from s2_models.kernels.pattern import S2Pattern
from s2_models.static_cache_s2_llama import S2StaticCache

PATTERN = S2Pattern(block_size=16, local_blocks=1, vert_stride=3)


# ------------------------------------------------------------------------------------------------ the ops
def attention_args(q, k, pattern=PATTERN, backend="torch", cu_seqlens=None, attention_mask=None):
    """``attention_op``'s arguments after q, k, v (see ``s2_attention``)."""
    return (pattern_to_ints(pattern), None, None, True, q.shape[-1] ** -0.5, backend, cu_seqlens, cu_seqlens, None,
            None, attention_mask)


def qkv(b, t, hq=4, hkv=2, d=16, dtype=torch.float32):
    return tuple(torch.randn(b, h, t, d, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("pattern", [
    PATTERN,
    S2Pattern(block_size=32, local_blocks=3, vert_stride=5, homo_head=True, head_sliding_offset=0),
    S2Pattern(block_size=64, local_blocks=2, vert_stride=8, head_sliding_step=3, num_dense_heads=1,
              per_query_head=True),
], ids=repr)
def test_patterns_pass_through_the_ops_unchanged(pattern):
    """The ops take the pattern as ``int[]`` (their schema has no dataclass type): every field survives."""
    assert pattern_from_ints(tuple(pattern_to_ints(pattern))) == pattern


@pytest.mark.parametrize("case", ["plain", "padded", "packed", "triton"])
def test_attention_ops_pass_opcheck(case):
    """Schema, fake (meta) implementation and AOT dispatch with dynamic shapes. The forward op has no autograd of its
    own (``AttentionFunction`` differentiates it, tested by the fullgraph training steps below), so it is checked
    without grad."""
    q, k, v = qkv(1 if case == "packed" else 2, 45)
    kwargs = {}
    if case == "padded":
        kwargs["attention_mask"] = torch.arange(45)[None, :] >= torch.tensor([0, 20])[:, None]
    if case == "packed":
        kwargs["cu_seqlens"] = torch.tensor([0, 17, 17, 45], dtype=torch.int32)
    args = (q, k, v, *attention_args(q, k, backend="triton" if case == "triton" else "torch", **kwargs))
    detached = [x.detach() for x in (q, k, v)]
    torch.library.opcheck(attention_op, (*detached, *args[3:]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    out, lse = attention_op(*detached, *args[3:])
    dout, dlse = torch.randn_like(out), torch.randn_like(lse).masked_fill(~torch.isfinite(lse), 0)
    torch.library.opcheck(attention_backward_op, (dout, dlse, *detached, out, lse, *args[3:]))


def test_repeated_inputs_and_shared_offsets_trace_and_match_eager():
    """One tensor as q, k and v, and one offsets tensor as cu_seqlens_q and cu_seqlens_k (what a packed batch's model
    passes): Dynamo refuses an autograd.Function given one tensor twice, so ``s2_attention`` passes them apart;
    output and gradient equal eager's."""
    x = torch.randn(1, 2, 45, 16, requires_grad=True)
    cu = torch.tensor([0, 17, 45], dtype=torch.int32)

    def attend(x):
        return s2_attention(x, x, x, PATTERN, cu_seqlens_q=cu, cu_seqlens_k=cu).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(x)
    (compiled_grad,) = torch.autograd.grad(compiled, x)
    eager = attend(x)
    (eager_grad,) = torch.autograd.grad(eager, x)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-6, rtol=1e-6)
    # Both paths pass x apart as views: the gradient must be dq + dk + dv of three separate leaves.
    leaves = [x.detach().clone().requires_grad_() for _ in range(3)]
    separate = s2_attention(*leaves, PATTERN, cu_seqlens_q=cu, cu_seqlens_k=cu.clone()).square().sum()
    torch.testing.assert_close(eager_grad, sum(torch.autograd.grad(separate, leaves)), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("return_lse", [False, True])
def test_the_backward_gets_an_lse_gradient_only_when_lse_is_returned(return_lse, monkeypatch):
    """Without ``return_lse`` the backward op gets ``dlse=None`` (the kernels then read no lse gradient); with it, the
    lse gradient (zeros where lse is unused: autograd materializes it)."""
    seen = []
    backward_op = interface.attention_backward_op
    monkeypatch.setattr(interface, "attention_backward_op", lambda dout, dlse, *rest: seen.append(dlse) or
                        backward_op(dout, dlse, *rest))
    q, k, v = qkv(2, 45)
    result = s2_attention(q, k, v, PATTERN, return_lse=return_lse)
    (result[0] if return_lse else result).sum().backward()
    assert (seen[0] is None) == (not return_lse)
    if return_lse:
        assert not seen[0].any()


def decode_problem(backend="torch"):
    layout = CompactLayout(PATTERN, num_q_heads=4, num_kv_heads=2, ring_blocks=PATTERN.local_blocks)
    seq_lens = torch.tensor([70, 33])
    num_ring, num_slots = layout.ring_blocks, layout.ring_blocks + layout.num_vertical_slots(80)
    k_cache, v_cache = (torch.randn(2, 2, num_slots * PATTERN.block_size, 16) for _ in range(2))
    assert (slot_blocks(layout, seq_lens, num_ring, num_slots) >= 0).any()
    return layout, seq_lens, num_ring, k_cache, v_cache


def test_decode_and_cache_append_ops_pass_opcheck():
    layout, seq_lens, num_ring, k_cache, v_cache = decode_problem()
    pattern = pattern_to_ints(layout.pattern)
    q = torch.randn(2, 4, 1, 16)
    for split_counters in (None, torch.zeros(4, dtype=torch.int32)):
        torch.library.opcheck(decode_attention_op, (q, k_cache, v_cache, seq_lens, pattern, layout.ring_blocks,
                                                    num_ring, 0.25, "torch", None, split_counters))
    key, value = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    for lengths, advance_lengths in ((seq_lens + 1, False), (seq_lens, True)):
        torch.library.opcheck(cache_append_op, (k_cache, v_cache, key, value, lengths.clone(), pattern, 4,
                                                layout.ring_blocks, num_ring, advance_lengths, "torch"))


@pytest.mark.parametrize("advance_lengths", [False, True])
def test_cache_append_op_mutates_the_cache_under_compile(advance_lengths):
    """The append op is declared as mutating the caches and the lengths, so a compiled graph keeps the writes (and
    a decode read after it sees the advanced lengths)."""
    layout, seq_lens, num_ring, k_cache, v_cache = decode_problem()
    lengths = seq_lens if advance_lengths else seq_lens + 1
    key, value = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    q = torch.randn(2, 4, 1, 16)
    expected_k, expected_v, expected_lengths = k_cache.clone(), v_cache.clone(), lengths.clone()
    s2_cache_append(expected_k, expected_v, key, value, expected_lengths, layout, num_ring_slots=num_ring,
                    advance_lengths=advance_lengths, backend="torch")
    expected_out = s2_decode_attention(q, expected_k, expected_v, expected_lengths, layout, num_ring_slots=num_ring,
                                       backend="torch")
    assert not torch.equal(expected_k, k_cache)  # the append writes something, so the check below can fail
    assert torch.equal(expected_lengths, seq_lens + 1)

    def step(k_cache, v_cache, key, value, lengths):
        s2_cache_append(k_cache, v_cache, key, value, lengths, layout, num_ring_slots=num_ring,
                        advance_lengths=advance_lengths, backend="torch")
        return s2_decode_attention(q, k_cache, v_cache, lengths, layout, num_ring_slots=num_ring, backend="torch")

    out = torch.compile(step, backend="aot_eager", fullgraph=True)(k_cache, v_cache, key, value, lengths)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(lengths, expected_lengths)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ the model
PACKED_POSITIONS = torch.cat([torch.arange(15), torch.arange(25)])[None].expand(2, -1)
PADDING_MASK = (torch.arange(40)[None, :] >= torch.tensor([0, 9])[:, None]).long()


def loss_and_grads(model, step, ids):
    loss = step(ids)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("inputs, backend", [
    ({}, "torch"), ({"attention_mask": PADDING_MASK}, "torch"), ({"position_ids": PACKED_POSITIONS}, "torch"),
    ({}, "triton"),
], ids=["plain", "padded", "packed", "triton"])
def test_fullgraph_training_step_equals_eager(inputs, backend):
    """Forward and backward of a hybrid model (a dense and a sparse layer) trace as one graph (fullgraph=True: a graph
    break would raise) and give eager's loss and gradients; the model's default use_cache stays on. With the Triton
    backend (the interpreter here) the attention, norms, rotary and SwiGLU are the kernels' custom ops."""
    torch.manual_seed(0)
    model = tiny_model(num_hidden_layers=2, sparsity=["dense", {"block_size": 16, "local_blocks": 1,
                                                                "vert_stride": 3}], s2_backend=backend).train()
    assert model.supports_gradient_checkpointing and type(model)._can_compile_fullgraph
    ids = tokens(2, 40)

    def step(ids):
        return model(input_ids=ids, labels=ids, **inputs).loss

    torch._dynamo.reset()
    compiled_loss, compiled_grads = loss_and_grads(model, torch.compile(step, backend="aot_eager", fullgraph=True),
                                                   ids)
    eager_loss, eager_grads = loss_and_grads(model, step, ids)
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(compiled_grads, eager_grads, atol=1e-6, rtol=1e-6)
    if "attention_mask" in inputs:  # the padding is applied: the padded row's real tokens do not see its pads
        unmasked_loss, _ = loss_and_grads(model, lambda ids: model(input_ids=ids, labels=ids).loss, ids)
        assert not torch.allclose(unmasked_loss, eager_loss)



def test_fullgraph_training_step_under_autocast_equals_eager():
    """What Trainer(bf16=True, torch_compile=True) runs: fp32 weights under bf16 autocast, loss.backward() inside the
    autocast region; no graph break (the autocast checks trace), and eager's loss and gradients."""
    torch.manual_seed(0)
    model = tiny_model(num_hidden_layers=2, sparsity=["dense", {"block_size": 16, "local_blocks": 1,
                                                                "vert_stride": 3}]).train()
    ids = tokens(2, 40)

    def step(ids):
        return model(input_ids=ids, labels=ids).loss

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled_loss, compiled_grads = loss_and_grads(
            model, torch.compile(step, backend="aot_eager", fullgraph=True), ids
        )
        eager_loss, eager_grads = loss_and_grads(model, step, ids)
    torch.testing.assert_close(compiled_loss, eager_loss, atol=0, rtol=0)
    torch.testing.assert_close(compiled_grads, eager_grads, atol=0, rtol=0)

def compile_config_for_cpu(**kwargs):
    config = CompileConfig(backend="aot_eager", fullgraph=True, **kwargs)
    config._compile_all_devices = True  # transformers compiles on CPU only when told to
    return config


def test_compiled_static_cache_generation_equals_eager():
    """generate(cache_implementation="static", compile_config=...) runs the decode steps through one compiled graph
    (no recompilation as the cache fills) and gives the eager static cache's tokens and logits; without compile_config
    nothing is compiled."""
    torch.manual_seed(0)
    model = cached_model()
    ids, mask = left_padded(length=60, pads=(0, 17, 40))
    kwargs = dict(attention_mask=mask, max_new_tokens=10, output_logits=True, return_dict_in_generate=True, **GREEDY)
    torch._dynamo.reset()
    counters.clear()
    eager = model.generate(ids, cache_implementation="static", **kwargs)
    assert not counters["stats"]["unique_graphs"] and not hasattr(model, "_compiled_call")
    config = compile_config_for_cpu()
    compiled = model.generate(ids, cache_implementation="static", compile_config=config, **kwargs)
    again = model.generate(ids, cache_implementation="static", compile_config=config, **kwargs)  # a fresh cache
    assert counters["stats"]["unique_graphs"] == 1  # every decode step of both calls ran the one graph
    assert torch.equal(again.sequences, compiled.sequences)
    assert isinstance(compiled.past_key_values, S2StaticCache)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), atol=1e-5, rtol=1e-5)
    assert compiled.past_key_values.get_seq_length() == eager.past_key_values.get_seq_length() == 60 + 9


# ------------------------------------------------------------------------------------------------ custom 4-D masks
def test_custom_4d_masks_are_refused_with_a_clear_error():
    """transformers' "custom 4D attention mask" convention: the S2 patterns are built from a [B, T] padding mask, so a
    4-D mask is refused (before any layer runs); an all-dense model takes it with the sdpa implementation."""
    ids = tokens(2, 40)
    mask_4d = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()
    for implementation in ("s2", "sdpa"):
        with pytest.raises(ValueError, match=r"custom 4-D masks are not supported"):
            tiny_model(attn_implementation=implementation)(ids, attention_mask=mask_4d)
    with pytest.raises(ValueError, match=r'attn_implementation="s2" takes a \[B, T\] padding mask'):
        tiny_model(sparsity="dense")(ids, attention_mask=mask_4d)
    dense = tiny_model(sparsity="dense", attn_implementation="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(dense(ids, attention_mask=mask_4d).logits, dense(ids).logits)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_step_on_cuda_equals_eager(dtype):
    """Inductor around the Triton kernels: loss and gradients of a hybrid model equal eager (plain and padded)."""
    torch.manual_seed(0)
    model = tiny_model().to("cuda", dtype).train()
    ids = tokens(2, 200).cuda()
    mask = (torch.arange(200)[None, :] >= torch.tensor([0, 37])[:, None]).long().cuda()
    for inputs in ({}, {"attention_mask": mask}):
        def step(ids, inputs=inputs):
            return model(input_ids=ids, labels=ids, **inputs).loss

        torch._dynamo.reset()
        compiled_loss, compiled_grads = loss_and_grads(model, torch.compile(step, fullgraph=True), ids)
        eager_loss, eager_grads = loss_and_grads(model, step, ids)
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # Inductor fuses and rounds differently in bfloat16
        torch.testing.assert_close(compiled_loss, eager_loss, atol=tol, rtol=tol)
        for name, grad in eager_grads.items():
            error = (compiled_grads[name].float() - grad.float()).norm() / grad.float().norm().clamp(min=1e-12)
            assert error < tol, (name, float(error))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_static_generation_on_cuda_equals_cuda_graphs(dtype):
    """transformers' default CompileConfig (Inductor, reduce-overhead) over the S2 static cache gives the tokens of the
    cache's own CUDA graphs and of the dynamic cache, also when the cache is not returned (then generate reads the
    stop flag a step late)."""
    from test_static_cache import assert_same_steps

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = cached_model().to("cuda", dtype)
    ids, mask = left_padded(length=300, device="cuda")
    kwargs = dict(attention_mask=mask, max_new_tokens=40, output_logits=True, return_dict_in_generate=True, **GREEDY)
    graphed = model.generate(ids, cache_implementation="static", **kwargs)
    compiled = model.generate(ids, cache_implementation="static", compile_config=CompileConfig(), **kwargs)
    assert hasattr(model, "_compiled_call")
    tol, min_steps = (1e-4, 40) if dtype == torch.float32 else (2e-2, 10)
    assert_same_steps(compiled, graphed, ids.shape[1], tol, min_steps)
    kwargs = dict(attention_mask=mask, max_new_tokens=40, **GREEDY)
    not_returned = model.generate(ids, cache_implementation="static", compile_config=CompileConfig(), **kwargs)
    assert torch.equal(not_returned, compiled.sequences)
