"""The fused RMSNorm, SwiGLU, rotary and decode-projection kernels against transformers' Llama functions in float64.

Tolerance as for attention (``attention_checks.py``): within 2x (3x for gradients) of the error PyTorch's own
functions make in the input dtype. CPU runs use Triton's interpreter (float16/float32; its bfloat16 is unreliable),
the GPU test bfloat16 at the 1B model's sizes.
"""

from __future__ import annotations

import collections
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_checks import ABS_FLOOR
from test_modeling import tiny_config
from test_static_cache import left_padded
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, modeling_s2_llama
from s2_models.kernels.fused import (
    MAX_DECODE_TOKENS,
    add_rms_norm,
    add_rms_norm_op,
    decode_projections_fit,
    linear_group,
    linear_group_op,
    linear_swiglu,
    linear_swiglu_op,
    rms_norm,
    rms_norm_backward_op,
    rms_norm_op,
    rotary_backward_op,
    rotary_embedding,
    rotary_op,
    rotary_tables,
    rotary_tables_op,
    swiglu,
    swiglu_backward_op,
    swiglu_op,
    use_fused_kernels,
)
from s2_models.modeling_s2_llama import S2LlamaRotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER_DTYPES = (torch.float16, torch.float32)


def llama_rms_norm(x, weight, eps):
    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    return torch.func.functional_call(norm, {"weight": weight}, (x,))


def llama_swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def llama_rotary(q, k, cos, sin):
    return apply_rotary_pos_emb(q, k, cos, sin)


def assert_matches_llama(ours, reference, inputs, grad_dtypes=None):
    """``ours(*inputs)`` against ``reference`` in float64 (outputs and gradients of every input that requires one)
    within 2x / 3x of ``reference``'s error in the inputs' own dtypes. Checks output dtypes and strides too."""
    outs = _as_tuple(ours(*inputs))
    same = _as_tuple(reference(*inputs))
    exact_inputs = [x.detach().double().requires_grad_(x.requires_grad) for x in inputs]
    exact = _as_tuple(reference(*exact_inputs))
    grad_outs = [torch.randn(o.shape, dtype=torch.float64, device=o.device) for o in exact]
    for mine, baseline in zip(outs, same):
        assert mine.dtype == baseline.dtype, f"output dtype {mine.dtype}, transformers gives {baseline.dtype}"
        assert not mine.isnan().any(), "an output element was not written"
    differentiable = [i for i, x in enumerate(inputs) if x.requires_grad]

    def grads(outputs, xs):
        loss = sum((o.double() * g).sum() for o, g in zip(outputs, grad_outs))
        return torch.autograd.grad(loss, [xs[i] for i in differentiable])

    named = [(f"out{i}", o, e, s, 2) for i, (o, e, s) in enumerate(zip(outs, exact, same))]
    if differentiable:
        for i, mine, ex, sm in zip(differentiable, grads(outs, inputs), grads(exact, exact_inputs),
                                   grads(same, inputs)):
            assert mine.dtype == inputs[i].dtype
            named.append((f"grad{i}", mine, ex, sm, 3))
    for name, mine, ex, sm, factor in named:
        error = (mine.double() - ex).abs().max().item()
        allowed = factor * (sm.double() - ex).abs().max().item() + ABS_FLOOR[sm.dtype]
        assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# ---------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
def test_rms_norm_matches_llama(dtype, weight_dtype):
    # 37 rows (more than the backward's programs on the CPU), a width that is not a power of two, a row stride
    # that is not the width (a slice of a wider tensor), fp32 weights over 16-bit activations (autocast).
    wide = torch.randn(37, 107, dtype=dtype, device=DEVICE) * 3
    x = wide[:, :100].requires_grad_()
    weight = (1 + 0.1 * torch.randn(100, device=DEVICE)).to(dtype if weight_dtype == "same" else weight_dtype)
    assert_matches_llama(lambda x_, w_: rms_norm(x_, w_, 1e-5), lambda x_, w_: llama_rms_norm(x_, w_, 1e-5),
                         (x, weight.requires_grad_()))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("residual_dtype", ["same", torch.float32])
def test_add_rms_norm_matches_llamas_residual_add_and_norm(dtype, residual_dtype):
    # The decoder layer's `residual + x` then the norm, both outputs and the gradients of x, residual and weight;
    # a float32 residual (float32 embeddings under autocast) over 16-bit x promotes the sum as PyTorch does.
    x = (torch.randn(3, 13, 107, dtype=dtype, device=DEVICE) * 2)[:, :, :100].requires_grad_()
    residual = torch.randn(3, 13, 100, device=DEVICE).to(dtype if residual_dtype == "same" else residual_dtype)
    weight = (1 + 0.1 * torch.randn(100, device=DEVICE)).to(dtype)

    def llama(x_, residual_, weight_):
        summed = residual_ + x_
        return llama_rms_norm(summed, weight_, 1e-5), summed

    assert_matches_llama(lambda *args: add_rms_norm(*args, 1e-5), llama,
                         (x, residual.requires_grad_(), weight.requires_grad_()))


def test_add_and_norm_of_a_hooked_norm_runs_its_forward():
    """A norm module with a hook is called as transformers' Llama calls it (the hook sees the summed tensor); a
    plain one runs the fused add."""
    model = _tiny_model("triton")
    norm = model.model.layers[0].post_attention_layernorm
    x, residual = torch.randn(2, 5, 64, device=DEVICE), torch.randn(2, 5, 64, device=DEVICE)
    with _RecordOps() as recorded:
        plain = norm.add_and_norm(x, residual)
    assert "s2::add_rms_norm" in recorded.names
    seen = []
    norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with _RecordOps() as recorded:
        hooked = norm.add_and_norm(x, residual)
    assert "s2::add_rms_norm" not in recorded.names
    torch.testing.assert_close(seen[0], residual + x)
    for a, b in zip(plain, hooked):
        torch.testing.assert_close(a, b)


def test_mlp_add_to_of_a_hooked_mlp_runs_its_forward():
    """A decoder layer's closing residual add runs in the down projection's launch at decode sizes, giving what
    ``residual + mlp(x)`` gives; an MLP with a hook is called as Llama calls it (the hook's output is what is added),
    and training sizes keep the separate add."""
    model = _tiny_model("triton").eval()
    mlp = model.model.layers[0].mlp
    x, residual = torch.randn(2, 1, 64, device=DEVICE), torch.randn(2, 1, 64, device=DEVICE)
    with torch.no_grad(), _RecordOps() as recorded:
        plain = mlp.add_to(residual, x)
    assert "aten::add.Tensor" not in recorded.names and "s2::linear_group" in recorded.names
    with torch.no_grad():
        assert torch.equal(plain, residual + mlp(x))
    with _RecordOps() as recorded:  # gradients enabled: nn.Linear and a separate add
        trained = mlp.add_to(residual, x)
    assert "aten::add.Tensor" in recorded.names and "s2::linear_group" not in recorded.names
    torch.testing.assert_close(trained, plain)
    mlp.register_forward_hook(lambda module, args, out: out * 0)
    with torch.no_grad():
        assert torch.equal(mlp.add_to(residual, x), residual)


def test_rms_norm_keeps_leading_dims_and_rejects_bad_weights():
    x = torch.randn(2, 3, 48, device=DEVICE)
    assert rms_norm(x, torch.ones(48, device=DEVICE), 1e-6).shape == (2, 3, 48)
    with pytest.raises(ValueError, match=r"weight must be \[48\]"):
        rms_norm(x, torch.ones(47, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rms_norm(x, x[:1], torch.ones(48, device=DEVICE), 1e-6)


# ---------------------------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_swiglu_matches_llama(dtype):
    # 3 x 1031 x 2 elements: several programs of 1024 and a masked tail; large |gate| saturates the sigmoid.
    gate = (torch.randn(3, 1031, 2, dtype=dtype, device=DEVICE) * 4).requires_grad_()
    up = torch.randn(3, 1031, 2, dtype=dtype, device=DEVICE).requires_grad_()
    assert_matches_llama(swiglu, llama_swiglu, (gate, up))


def test_swiglu_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="gate and up must share shape and dtype"):
        swiglu(torch.randn(4, 8, device=DEVICE), torch.randn(4, 9, device=DEVICE))


# ---------------------------------------------------------------------------------------------- rotary
def _projection_heads(b, t, h, d, dtype):
    """q or k as the attention layer has it: the projection's ``[B, T, H, D]`` output viewed as ``[B, H, T, D]``."""
    return torch.randn(b, t, h, d, dtype=dtype, device=DEVICE).transpose(1, 2).requires_grad_()


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("cos_batch", [1, 3])
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: half a head (12) is not a power of two
def test_rotary_matches_llama(dtype, cos_batch, head_dim):
    b, t = 3, 13
    q, k = _projection_heads(b, t, 6, head_dim, dtype), _projection_heads(b, t, 2, head_dim, dtype)  # GQA
    angles = torch.randn(cos_batch, t, head_dim // 2, device=DEVICE, dtype=torch.float64) * 3
    angles = torch.cat([angles, angles], dim=-1)  # LlamaRotaryEmbedding's layout; the kernel does not assume it
    cos, sin = angles.cos().to(dtype), (angles.sin() * 1.1).to(dtype)  # attention_scaling-like factor on sin
    assert_matches_llama(rotary_embedding, llama_rotary, (q, k, cos, sin))
    q_out, _ = rotary_embedding(q, k, cos, sin)
    assert q_out.stride() == q.stride(), "outputs keep the projections' [B, T, H, D] layout"


def test_rotary_promotes_like_pytorch():
    """Under autocast with float32 weights, q/k are 16-bit and cos/sin float32: the outputs are float32 as in
    transformers, the gradients in q's and k's dtype."""
    q, k = _projection_heads(2, 5, 4, 16, torch.float16), _projection_heads(2, 5, 2, 16, torch.float16)
    angles = torch.randn(2, 5, 16, device=DEVICE)
    assert_matches_llama(rotary_embedding, llama_rotary, (q, k, angles.cos(), angles.sin()))


def test_rotary_takes_cos_and_sin_of_different_strides():
    """The kernel indexes both tables with one set of strides: a sin viewed out of a larger tensor (its own strides)
    once gave wrong outputs without an error."""
    q, k = _projection_heads(1, 3, 2, 8, torch.float32), _projection_heads(1, 3, 2, 8, torch.float32)
    angles = torch.randn(1, 6, 8, device=DEVICE)
    cos, sin = angles[:, :3].cos(), angles.sin()[:, ::2]
    assert cos.stride() != sin.stride()
    assert_matches_llama(rotary_embedding, llama_rotary, (q, k, cos, sin))


def _rope_config(rope_type: str, head_dim: int = 64):
    parameters = {"rope_type": rope_type, "rope_theta": 500000.0}
    if rope_type == "llama3":  # Llama 3.2's
        parameters.update(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    elif rope_type in ("linear", "yarn"):
        parameters.update(factor=4.0, original_max_position_embeddings=8192)
    return S2LlamaConfig(vocab_size=64, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=140_000,
                         rope_parameters=parameters, sparsity="dense")


def _transformers_tables(config, positions, dtype, buffer_dtype=torch.float32):
    """transformers' own rotary module (its buffers cast as ``model.to(buffer_dtype)`` casts them)."""
    module = LlamaRotaryEmbedding(config).to(positions.device).to(buffer_dtype)
    return module, module(torch.empty(1, dtype=dtype, device=positions.device), positions)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("rope_type", ["default", "llama3", "yarn"])
def test_rotary_tables_match_transformers(dtype, rope_type):
    """The tables kernel computes LlamaRotaryEmbedding's tables (yarn: an attention scaling != 1) at positions up to
    140k, with the frequencies buffer in float32 or cast to bfloat16 by a model's ``.to``. Here NumPy's cos and sin
    (the interpreter): within 2 ulp of the table dtype; on the GPU (``test_rotary_tables_on_the_gpu``) bit for bit."""
    positions = torch.randint(0, 140_000, (3, 37), device=DEVICE)
    positions[0, :5] = torch.tensor([0, 1, 8191, 8192, 139_999])
    for buffer_dtype in (torch.float32, torch.bfloat16):
        module, (cos, sin) = _transformers_tables(_rope_config(rope_type), positions, dtype, buffer_dtype)
        ours = rotary_tables(positions, module.inv_freq, module.attention_scaling, dtype)
        for expected, got in zip((cos, sin), ours):
            assert got.dtype == dtype and got.shape == expected.shape == (3, 37, 64)
            torch.testing.assert_close(got, expected, atol=2 * torch.finfo(dtype).eps, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_tables_on_the_gpu(dtype):
    """On CUDA the S2 model's rotary module gives transformers' tables bit for bit (prompt- and decode-shaped
    positions, three rope types, frequencies in float32 or bfloat16), through the tables kernel."""
    for rope_type in ("default", "llama3", "yarn"):
        config = _rope_config(rope_type)
        for positions in (torch.randint(0, 140_000, (2, 333), device="cuda"),
                          torch.tensor([[0], [1], [8191], [8192], [65535], [100_003], [131_071], [139_999]],
                                       device="cuda")):
            for buffer_dtype in (torch.float32, torch.bfloat16):
                _, expected = _transformers_tables(config, positions, dtype, buffer_dtype)
                ours = S2LlamaRotaryEmbedding(config).cuda().to(buffer_dtype)
                with _RecordOps() as recorded:
                    got = ours(torch.empty(1, dtype=dtype, device="cuda"), positions)
                assert "s2::rotary_tables" in recorded.names
                assert all(torch.equal(a, b) for a, b in zip(got, expected)), (rope_type, buffer_dtype)


def test_rotary_tables_trace_under_compile():
    """The tables op traces as one node (the compiled decode step of ``generate(compile_config=...)`` runs it)."""
    positions, inv_freq = torch.randint(0, 9999, (2, 7), device=DEVICE), torch.rand(32, device=DEVICE)
    tables = lambda p: rotary_tables(p, inv_freq, 0.9, torch.float16)  # noqa: E731
    compiled = torch.compile(tables, backend="aot_eager", fullgraph=True)(positions)
    assert all(torch.equal(a, b) for a, b in zip(compiled, tables(positions)))


def test_rotary_tables_bad_input():
    with pytest.raises(ValueError, match=r"rotary_tables takes integer position_ids \[B, T\]"):
        rotary_tables(torch.arange(5.0)[None], torch.rand(8), 1.0, torch.float32)
    with pytest.raises(ValueError, match="rotary_tables takes"):
        rotary_tables(torch.arange(5), torch.rand(8), 1.0, torch.float32)


def test_rotary_rejects_shapes_it_does_not_take():
    q, k = torch.randn(1, 2, 5, 16, device=DEVICE), torch.randn(1, 2, 5, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rotary_embedding takes"):
        rotary_embedding(q, k, torch.randn(1, 5, 8, device=DEVICE), torch.randn(1, 5, 8, device=DEVICE))


# ---------------------------------------------------------------------------------------------- decode projections
def _no_grad(fn):
    def run(*inputs):
        with torch.no_grad():
            return fn(*inputs)
    return run


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("tokens, num_weights", [(1, 3), (5, 2), (MAX_DECODE_TOKENS, 1)])
def test_linear_group_matches_torch(dtype, tokens, num_weights):
    # K = 300 (not a multiple of the 256-wide steps), output widths that are not multiples of the 32-row tiles.
    x = torch.randn(tokens, 1, 300, dtype=dtype, device=DEVICE)
    weights = [torch.randn(n, 300, dtype=dtype, device=DEVICE) / 17 for n in (50, 33, 70)[:num_weights]]

    def reference(x_, *ws):
        return tuple(torch.nn.functional.linear(x_, w) for w in ws)

    assert_matches_llama(_no_grad(lambda x_, *ws: tuple(linear_group(x_, list(ws)))), reference, (x, *weights))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, MAX_DECODE_TOKENS])
def test_linear_group_residual_is_pytorchs_sum(dtype, tokens):
    """``linear_group(x, [w], residual=r)`` is bit for bit ``r + linear_group(x, [w])``: the product rounded to the
    dtype, then the sum as PyTorch computes it (so a decoder layer's output does not change with the fusion), and
    within tolerance of ``r + x @ w.T`` in float64. A residual strided as the model's (a view) and a width that is
    not a multiple of the 32-row tiles."""
    x = torch.randn(tokens, 1, 300, dtype=dtype, device=DEVICE)
    w = torch.randn(70, 300, dtype=dtype, device=DEVICE) / 17
    residual = torch.randn(tokens, 1, 140, dtype=dtype, device=DEVICE)[..., ::2] * 3
    with torch.no_grad():
        fused = linear_group(x, [w], residual=residual)[0]
        assert torch.equal(fused, residual + linear_group(x, [w])[0])
    assert_matches_llama(_no_grad(lambda x_, w_, r_: linear_group(x_, [w_], residual=r_)[0]),
                         lambda x_, w_, r_: r_ + torch.nn.functional.linear(x_, w_), (x, w, residual))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_linear_group_after_decode_attention_is_nn_linear(dtype):
    """o_proj's call (``after_decode_attention``) outside CUDA graph captures is ``nn.Linear``'s, bit for bit: behind
    the decode attention kernel only the Gluon kernel inside captures beats cuBLAS (bench/NOTES.md, sixtieth
    session)."""
    x = torch.randn(5, 1, 300, dtype=dtype, device=DEVICE)
    w = torch.randn(70, 300, dtype=dtype, device=DEVICE) / 17
    residual = torch.randn(5, 1, 70, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(linear_group(x, [w], after_decode_attention=True)[0], torch.nn.functional.linear(x, w))
        assert torch.equal(linear_group(x, [w], residual=residual, after_decode_attention=True)[0],
                           residual + torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_linear_swiglu_matches_llama_mlp(dtype):
    x = torch.randn(3, 2, 300, dtype=dtype, device=DEVICE)
    w_gate, w_up = (torch.randn(70, 300, dtype=dtype, device=DEVICE) / 17 for _ in "gu")

    def reference(x_, wg, wu):
        return torch.nn.functional.silu(torch.nn.functional.linear(x_, wg)) * torch.nn.functional.linear(x_, wu)

    assert_matches_llama(_no_grad(linear_swiglu), reference, (x, w_gate, w_up))


def test_decode_projections_fit_only_plain_inference_linears():
    """LoRA or quantized layers, hooks (accelerate's offloading), biases, training, autocast and long inputs keep
    their own forward: the fused launch reads the weight matrices directly."""
    linear = torch.nn.Linear(32, 48, bias=False, device=DEVICE)
    x = torch.randn(2, 1, 32, device=DEVICE)

    class LoraLike(torch.nn.Linear):
        pass

    with torch.no_grad():
        assert decode_projections_fit(x, (linear,))
        assert not decode_projections_fit(torch.randn(1, MAX_DECODE_TOKENS + 1, 32, device=DEVICE), (linear,))
        assert not decode_projections_fit(x, (torch.nn.Linear(32, 48, device=DEVICE),))  # bias
        assert not decode_projections_fit(x, (LoraLike(32, 48, bias=False, device=DEVICE),))
        assert not decode_projections_fit(x.half(), (linear,))  # weights in another dtype
        hooked = torch.nn.Linear(32, 48, bias=False, device=DEVICE)
        hooked.register_forward_hook(lambda *args: None)
        assert not decode_projections_fit(x, (hooked,))
        replaced = torch.nn.Linear(32, 48, bias=False, device=DEVICE)
        replaced.forward = lambda x_: x_
        assert not decode_projections_fit(x, (replaced,))
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            assert not decode_projections_fit(x, (linear,))
    assert not decode_projections_fit(x, (linear,))  # gradients enabled: training runs nn.Linear


def test_decode_projections_reject_what_they_cannot_take():
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weights must be"):
        linear_group(x, [torch.randn(8, 31, device=DEVICE)])
    with pytest.raises(ValueError, match=f"at most {MAX_DECODE_TOKENS} tokens"):
        linear_group(torch.randn(MAX_DECODE_TOKENS + 1, 32, device=DEVICE), [torch.randn(8, 32, device=DEVICE)])
    with pytest.raises(ValueError, match="between 1 and 3 weights"):
        linear_group(x, [torch.randn(8, 32, device=DEVICE)] * 4)
    w = torch.randn(8, 32, device=DEVICE)
    for weights, residual in (([w, w], torch.randn(2, 8, device=DEVICE)), ([w], torch.randn(2, 9, device=DEVICE)),
                              ([w], torch.randn(2, 8, device=DEVICE).double())):
        with pytest.raises(ValueError, match=r"residual must come with one weight and be \[2, 8\]"):
            linear_group(x, weights, residual=residual)


_COMPILE_DEFAULT_PROJECTIONS = """
import sys
import torch
sys.path.insert(0, "bench")
from hopper_fwd_offline import _CompileOnlyDriver
from triton.runtime import driver
driver.set_active(_CompileOnlyDriver())
from s2_models.kernels import fused_triton
fused_triton.launch_options = lambda device: {"PDL": True, "launch_pdl": True}
shared = []
for name in ("_linear_group_kernel", "_linear_swiglu_kernel"):
    kernel = getattr(fused_triton, name)
    class Warmup:
        def __getitem__(self, grid, kernel=kernel, name=name):
            return lambda *a, **kw: shared.append((name, kw.get("NUM_WEIGHTS"), str(a[0].dtype), kw["BLOCK_N"],
                                                   kw["BLOCK_K"], kw["STAGES"],
                                                   kernel.warmup(*a, grid=grid, **kw).metadata.shared))
    setattr(fused_triton, name, Warmup())
for dtype in (torch.bfloat16, torch.float32):
    for k in (2048, 8192):
        x = torch.empty(8, k, dtype=dtype)
        for n in (1, 2, 3):
            fused_triton.linear_group_fwd(x, [torch.empty(64, k, dtype=dtype)] * n)
        fused_triton.linear_swiglu_fwd(x, torch.empty(64, k, dtype=dtype), torch.empty(64, k, dtype=dtype))
print(repr(shared))
"""


def test_default_projection_shapes_fit_hopper_shared_memory():
    """The decode projections' default launch shapes, compiled for sm_90 by the installed Triton (offline, no GPU):
    each fits the 227 KB a Hopper program may use. Triton 3.9 gives each of ``linear_group``'s weight branches its own
    pipeline buffers, so q/k/v at 5 stages of 32 x 256 asked 288 KB there and could not launch (fifty-third
    session); ``pipeline_bytes`` now counts them."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_DEFAULT_PROJECTIONS], capture_output=True, text=True,
                            env=env, cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    launches = eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 (our own subprocess's repr)
    assert len(launches) == 16
    assert all(shared <= 232448 for *_, shared in launches), launches


_COMPILE_HOPPER_PROJECTIONS = """
import sys
import torch
sys.path.insert(0, "bench")
from hopper_fwd_offline import _CompileOnlyDriver
from triton.runtime import driver
driver.set_active(_CompileOnlyDriver())
from s2_models.kernels import hopper_linear
kernel, launches = hopper_linear.skinny_linear_ws_kernel, []
class Warmup:
    def __getitem__(self, grid):
        return lambda *a, **kw: launches.append((kw["STAGES"], kernel.warmup(*a, grid=grid, **kw).metadata.shared))
hopper_linear.skinny_linear_ws_kernel = Warmup()
hopper_linear.launch_options = lambda device: {"PDL": True, "launch_pdl": True}
for k, widths in ((2048, (2048, 512, 512)), (8192, (2048,)), (64, (40,))):
    x = torch.empty(8, k, dtype=torch.bfloat16)
    weights = [torch.empty(n, k, dtype=torch.bfloat16) for n in widths]
    outs = [torch.empty(8, n, dtype=torch.bfloat16) for n in widths]
    residual = torch.empty(8, widths[0], dtype=torch.bfloat16) if len(widths) == 1 else None
    hopper_linear.linear_group(x, weights, outs, residual)
print(repr(launches))
"""


def test_hopper_projections_compile_for_sm90():
    """The Gluon projections at the 1B model's q/k/v and down and at a narrow width, compiled for sm_90 by the
    installed Triton (offline, no GPU): they compile, and fit the 227 KB a Hopper program may use."""
    from s2_models.kernels import hopper_linear

    if not hopper_linear.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_HOPPER_PROJECTIONS], capture_output=True, text=True,
                            env=env, cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    launches = eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 (our own subprocess's repr)
    assert [stages for stages, _ in launches] == [4, 8, 4]
    assert all(shared <= 232448 for _, shared in launches), launches


# ---------------------------------------------------------------------------------------------- the ops
def test_custom_ops_pass_opcheck():
    """Schemas, fake (meta) implementations and registered autograd agree with the kernels (torch.compile needs
    all three)."""
    x, w = torch.randn(5, 48, device=DEVICE), torch.randn(48, device=DEVICE)
    gate, up = torch.randn(4, 40, device=DEVICE), torch.randn(4, 40, device=DEVICE)
    q = torch.randn(2, 3, 6, 2, 16, device=DEVICE)[:, :, :, 0].transpose(1, 2)  # [B, H, T, D] = [2, 6, 3, 16]
    k = torch.randn(2, 3, 1, 16, device=DEVICE).transpose(1, 2)
    cos, sin = torch.randn(2, 3, 16, device=DEVICE), torch.randn(2, 3, 16, device=DEVICE)
    y, rstd = rms_norm_op(x, w, 1e-6)
    grad = lambda t: torch.randn(t.shape, device=DEVICE)  # noqa: E731
    for op, args in (
        (rms_norm_op, (x.requires_grad_(), w.requires_grad_(), 1e-6)),
        (rms_norm_backward_op, (grad(y), x.detach(), w.detach(), rstd)),
        (add_rms_norm_op, (x.detach().requires_grad_(), torch.randn(5, 48, device=DEVICE).requires_grad_(),
                           w.detach().requires_grad_(), 1e-6)),
        (rms_norm_backward_op, (grad(y), x.detach(), w.detach(), rstd, grad(y))),
        (swiglu_op, (gate.requires_grad_(), up.requires_grad_())),
        (swiglu_backward_op, (grad(gate), gate.detach(), up.detach())),
        (rotary_op, (q.requires_grad_(), k.requires_grad_(), cos, sin)),
        (rotary_backward_op, (grad(q), grad(k), cos, sin, torch.float32, torch.float32)),
        (linear_group_op, (torch.randn(3, 48, device=DEVICE), [torch.randn(n, 48, device=DEVICE) for n in (40, 8)])),
        (linear_group_op, (torch.randn(3, 48, device=DEVICE), [torch.randn(40, 48, device=DEVICE)],
                           torch.randn(3, 40, device=DEVICE))),
        (linear_swiglu_op, (torch.randn(3, 48, device=DEVICE), torch.randn(40, 48, device=DEVICE),
                            torch.randn(40, 48, device=DEVICE))),
        (rotary_tables_op, (torch.randint(0, 999, (2, 5), device=DEVICE), torch.rand(8, device=DEVICE), 1.0,
                            torch.float16)),
    ):
        torch.library.opcheck(op, args)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def names(self) -> set[str]:
        return set(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func.name())
        return func(*args, **(kwargs or {}))


def _tiny_model(backend):
    torch.manual_seed(0)
    config = S2LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sparsity={"block_size": 16, "local_blocks": 2, "vert_stride": 2}, s2_backend=backend)
    return S2LlamaForCausalLM(config).to(DEVICE)


def test_model_runs_the_fused_kernels_only_where_triton_runs():
    """With ``s2_backend="triton"`` (the interpreter here; "auto" on CUDA) every norm, rotary and MLP activation of
    the model is the fused op, and the result matches transformers' Llama code (``s2_backend="torch"``), gradients
    included."""
    ids = torch.randint(0, 64, (2, 40), device=DEVICE)
    results = {}
    for backend in ("triton", "torch"):
        model = _tiny_model(backend)
        with _RecordOps() as recorded:
            out = model(ids, labels=ids)
            out.loss.backward()
        fused = {name.split("::")[1] for name in recorded.names if name.split("::")[1] in
                 ("rms_norm", "add_rms_norm", "rms_norm_backward", "swiglu", "swiglu_backward", "rotary",
                  "rotary_backward")}
        results[backend] = out.logits, {n: p.grad for n, p in model.named_parameters()}, fused
    assert results["triton"][2] == {"rms_norm", "add_rms_norm", "rms_norm_backward", "swiglu", "swiglu_backward",
                                    "rotary", "rotary_backward"}
    assert results["torch"][2] == set()
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-4, rtol=1e-4)
    for name, grad in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_generation_runs_the_decode_projections(captured, monkeypatch):
    """Greedy generation with the Triton backend runs the projections of every decode step as the fused launches
    (per layer: q/k/v, gate/up with SwiGLU, down with the residual, and o_proj where the step is being captured as
    a CUDA graph, faked here) and gives the tokens of transformers' Llama code. The 20-token prompt is longer than
    ``MAX_DECODE_TOKENS``: its forward keeps ``nn.Linear``."""
    monkeypatch.setattr(modeling_s2_llama, "capturing_cuda_graph", lambda x: captured)
    ids = torch.randint(0, 64, (2, 20), device=DEVICE)
    tokens, recorded_ops = {}, {}
    for backend in ("triton", "torch"):
        model = _tiny_model(backend).eval()
        with _RecordOps() as recorded:
            tokens[backend] = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        recorded_ops[backend] = collections.Counter(name.split("::")[1] for name in recorded.calls
                                                    if "linear_" in name)
    decode_layer_steps = 5 * 2  # the 5 one-token forwards after the prompt's, 2 layers
    launches_a_layer = 3 if captured else 2
    assert recorded_ops["triton"] == {"linear_group": launches_a_layer * decode_layer_steps,
                                      "linear_swiglu": decode_layer_steps}
    assert recorded_ops["torch"] == {}
    assert torch.equal(tokens["triton"], tokens["torch"])


# ---------------------------------------------------------------------------------------------- users' paths
def _dense_s2_and_llama():
    """An all-dense S2 model that runs the fused kernels (dense attention is SDPA, so nothing else changes) and
    transformers' Llama with the same weights: the control."""
    torch.manual_seed(0)
    config = tiny_config("dense", s2_backend="triton")
    llama = LlamaForCausalLM(LlamaConfig(**{k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")}, attn_implementation="sdpa")).to(DEVICE)
    s2 = S2LlamaForCausalLM(config).to(DEVICE)
    s2.load_state_dict(llama.state_dict())
    return s2, llama


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_model_trains_like_llama_under_autocast(dtype):
    """What ``Trainer(bf16=True)`` runs: float32 weights under autocast, a left-padded batch. Against Llama in
    float64, the fused model's loss and gradients stay within 3x of Llama's own error under the same autocast."""
    s2, llama = _dense_s2_and_llama()
    truth = copy.deepcopy(llama).double()
    ids, mask = left_padded(batch=2, length=48, pads=(0, 13), device=DEVICE)

    def loss_and_gradients(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        return torch.cat([loss.detach().view(1)] + [p.grad.flatten() for p in model.parameters()]).double()

    expected = loss_and_gradients(truth)
    errors = {}
    for name, model in (("s2", s2), ("llama", llama)):
        with torch.autocast(DEVICE, dtype=dtype):
            errors[name] = (loss_and_gradients(model) - expected).abs().max().item()
    assert 0 < errors["llama"] < 0.5, errors
    assert errors["s2"] <= 3 * errors["llama"], errors


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_fused_generation_gives_llamas_tokens_for_padded_prompts(cache_implementation):
    """Greedy ``generate`` over a left-padded batch (prompts of 19 and 40 real tokens): every decode step runs the
    fused norms, rotary and decode projections, and the tokens are Llama's."""
    s2, llama = _dense_s2_and_llama()
    ids, mask = left_padded(batch=2, length=40, pads=(0, 21), device=DEVICE)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    with _RecordOps() as recorded:
        ours = s2.generate(ids, cache_implementation=cache_implementation, **kwargs)
    assert {"s2::linear_group", "s2::linear_swiglu", "s2::rms_norm", "s2::rotary"} <= {
        "s2::" + name.split("::")[1] for name in recorded.names if "::" in name
    }
    assert torch.equal(ours, llama.generate(ids, **kwargs))


@pytest.mark.gpu
def test_graphed_bf16_generation_is_as_close_to_llama_as_llama_itself():
    """What serving with the static cache runs: bf16 weights, a left-padded batch of 4 with prompts of 400 to 100
    real tokens, greedy ``generate(cache_implementation="static")``, whose decode steps are CUDA graphs (on Hopper
    with the Gluon projections, o_proj's included: a recording wrapper sees its launches). Every step's logits of the
    all-dense S2 model against transformers' Llama with the same weights in float64 (one forward over the generated
    sequences): within 2x of Llama's own bf16 error over those sequences."""
    from s2_models.kernels import hopper_linear

    s2, llama = _dense_s2_and_llama()
    s2, llama_bf16 = s2.to(torch.bfloat16), copy.deepcopy(llama).to(torch.bfloat16)
    truth = llama.double()
    ids, mask = left_padded(batch=4, length=400, pads=(0, 37, 150, 300), device="cuda")
    launches = []

    def recording(x, weights, *args, **kwargs):
        launches.append([tuple(w.shape) for w in weights])
        return launch_gluon(x, weights, *args, **kwargs)

    launch_gluon, hopper_linear.linear_group = hopper_linear.linear_group, recording
    try:
        out = s2.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=30,
                          output_logits=True, return_dict_in_generate=True, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    finally:
        hopper_linear.linear_group = launch_gluon
    assert len(out.past_key_values._graphs) == 1  # the decode steps were captured and replayed
    if hopper_linear.is_sm90(torch.device("cuda")):
        assert [tuple(s2.model.layers[0].self_attn.o_proj.weight.shape)] in launches
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    steps = slice(ids.shape[1] - 1, out.sequences.shape[1] - 1)  # the positions whose logits chose each new token
    with torch.no_grad():
        exact = truth(out.sequences, attention_mask=full_mask, position_ids=positions).logits[:, steps]
        own = llama_bf16(out.sequences, attention_mask=full_mask, position_ids=positions).logits[:, steps]
    ours = torch.stack(out.logits, dim=1)
    error, allowed = (ours.double() - exact).abs().max().item(), 2 * (own.double() - exact).abs().max().item()
    assert error <= allowed + ABS_FLOOR[torch.bfloat16], f"error {error:.3e} > allowed {allowed:.3e}"


def test_float64_and_the_torch_backend_never_fuse():
    x = torch.randn(2, 8, device=DEVICE)
    assert not use_fused_kernels("torch", x)
    assert not use_fused_kernels("triton", x.double())
    with pytest.raises(ValueError, match="backend must be one of"):
        use_fused_kernels("cuda", x)


# ---------------------------------------------------------------------------------------------- GPU, bfloat16
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernels_on_the_gpu_at_model_sizes(dtype):
    """The 1B model's sizes (hidden 2048, MLP 8192, 32 / 8 heads of 64), odd token counts, bf16 and fp16 weights,
    bf16 activations over float32 weights (autocast), and the decode-sized projections at batch 8."""
    tokens = 333
    x = (torch.randn(tokens, 2048, device="cuda", dtype=dtype) * 2).requires_grad_()
    for weight_dtype in (dtype, torch.float32):
        weight = (1 + 0.1 * torch.randn(2048, device="cuda")).to(weight_dtype).requires_grad_()
        assert_matches_llama(lambda x_, w_: rms_norm(x_, w_, 1e-5), lambda x_, w_: llama_rms_norm(x_, w_, 1e-5),
                             (x, weight))
    gate = (torch.randn(tokens, 8192, device="cuda", dtype=dtype) * 4).requires_grad_()
    up = torch.randn(tokens, 8192, device="cuda", dtype=dtype).requires_grad_()
    assert_matches_llama(swiglu, llama_swiglu, (gate, up))
    for cos_dtype in (dtype, torch.float32):
        q = torch.randn(2, tokens, 32, 64, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(2, tokens, 8, 64, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        angles = torch.randn(2, tokens, 32, device="cuda", dtype=torch.float64) * 100
        angles = torch.cat([angles, angles], dim=-1)
        assert_matches_llama(rotary_embedding, llama_rotary, (q, k, angles.cos().to(cos_dtype),
                                                              angles.sin().to(cos_dtype)))
    # Decode-sized projections: q/k/v (K = 2048, 32-row tiles), gate/up with SwiGLU, down (K = 8192, 16-row tiles).
    x = torch.randn(8, 1, 2048, device="cuda", dtype=dtype)
    qkv = [torch.randn(n, 2048, device="cuda", dtype=dtype) / 45 for n in (2048, 512, 512)]
    assert_matches_llama(_no_grad(lambda x_, *ws: tuple(linear_group(x_, list(ws)))),
                         lambda x_, *ws: tuple(torch.nn.functional.linear(x_, w) for w in ws), (x, *qkv))
    gate_up = [torch.randn(8192, 2048, device="cuda", dtype=dtype) / 45 for _ in "gu"]
    assert_matches_llama(_no_grad(linear_swiglu), lambda x_, wg, wu: llama_swiglu(torch.nn.functional.linear(
        x_, wg), torch.nn.functional.linear(x_, wu)), (x, *gate_up))
    hidden = torch.randn(8, 1, 8192, device="cuda", dtype=dtype)
    down = torch.randn(2048, 8192, device="cuda", dtype=dtype) / 90
    assert_matches_llama(_no_grad(lambda x_, w: linear_group(x_, [w])[0]), torch.nn.functional.linear,
                         (hidden, down))
    residual = torch.randn(8, 1, 2048, device="cuda", dtype=dtype)
    with torch.no_grad():  # the decoder layer's closing add in down's launch: PyTorch's sum, bit for bit
        assert torch.equal(linear_group(hidden, [down], residual=residual)[0],
                           residual + linear_group(hidden, [down])[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hopper_projections_on_the_gpu(dtype):
    """The Gluon projections (``hopper_linear``, which ``linear_group`` runs on sm_90 for up to 8 tokens inside CUDA
    graphs): odd output widths (tiles the weight's rows end inside), widths K that end inside a step or take one
    narrow step, 1 to 3 weights, 1 to 8 tokens, the residual add; within tolerance of PyTorch in float64, every output
    written (they start as NaN); inside a CUDA graph capture ``linear_group`` launches this kernel (q/k/v's call and
    o_proj's, seen by a recording wrapper) and the graph replays its outputs bit for bit."""
    from s2_models.kernels import hopper_linear

    if not hopper_linear.is_sm90(torch.device("cuda")):
        pytest.skip("the Gluon projections are written for compute capability 9.0")

    def gluon_projections(x_, *ws, residual=None):
        outs = [torch.full((x_.shape[0], w.shape[0]), float("nan"), device="cuda", dtype=dtype) for w in ws]
        hopper_linear.linear_group(x_, list(ws), outs, residual)
        return tuple(outs)

    for width in (64, 200, 2056, 8192):
        weights = [torch.randn(n, width, device="cuda", dtype=dtype) / width**0.5 for n in (333, 40, 72)]
        for tokens in (1, 5, hopper_linear.MAX_TOKENS):
            x = torch.randn(tokens, width, device="cuda", dtype=dtype)
            assert hopper_linear.supported(x, weights)
            for count in (1, 3):
                assert_matches_llama(gluon_projections, lambda x_, *ws: tuple(torch.nn.functional.linear(x_, w)
                                                                              for w in ws), (x, *weights[:count]))
            residual = torch.randn(tokens, 333, device="cuda", dtype=dtype)
            assert_matches_llama(lambda x_, w_, r_: gluon_projections(x_, w_, residual=r_)[0],
                                 lambda x_, w_, r_: r_ + torch.nn.functional.linear(x_, w_), (x, weights[0], residual))
            assert torch.equal(gluon_projections(x, weights[0], residual=residual)[0],
                               residual + gluon_projections(x, weights[0])[0])
    # Inside a capture linear_group launches this kernel, for o_proj's call behind the decode attention kernel too
    # (the one replacing cuBLAS there): a recording wrapper sees each launch.
    launches = []

    def recording(*args, **kwargs):
        launches.append(len(args[1]))
        return launch_gluon(*args, **kwargs)

    launch_gluon, hopper_linear.linear_group = hopper_linear.linear_group, recording
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            captured = linear_group(x, weights)
            after_attention = linear_group(x, weights[:1], after_decode_attention=True)
    finally:
        hopper_linear.linear_group = launch_gluon
    assert launches == [3, 1]
    graph.replay()
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(captured, gluon_projections(x, *weights)))
    assert torch.equal(after_attention[0], captured[0])
    nine = torch.randn(hopper_linear.MAX_TOKENS + 1, 2048, device="cuda", dtype=dtype)
    assert not hopper_linear.supported(nine, [torch.randn(64, 2048, device="cuda", dtype=dtype)])


@pytest.mark.gpu
def test_decode_projection_launch_shapes_on_the_gpu():
    """Every launch shape ``bench/projection_ab.py`` sweeps, with odd output widths and K, 1 to 16 tokens: within
    tolerance of PyTorch in float64."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from projection_ab import sweep_tiles

    from s2_models.kernels.fused_triton import linear_group_fwd, linear_swiglu_fwd

    width = 2049
    weights = [torch.randn(n, width, device="cuda", dtype=torch.bfloat16) / 45 for n in (333, 40, 72)]

    def reference_swiglu(x_, wg, wu):
        return llama_swiglu(torch.nn.functional.linear(x_, wg), torch.nn.functional.linear(x_, wu))

    for tokens in (1, 8, MAX_DECODE_TOKENS):
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        for tiles in sweep_tiles(width, loops=3, weights_per_loop=1):
            assert_matches_llama(lambda x_, *ws, t=tiles: tuple(linear_group_fwd(x_, list(ws), tiles=t)),
                                 lambda x_, *ws: tuple(torch.nn.functional.linear(x_, w) for w in ws), (x, *weights))
        for tiles in sweep_tiles(width, loops=1, weights_per_loop=2):
            assert_matches_llama(lambda x_, wg, wu, t=tiles: linear_swiglu_fwd(x_, wg, wu, tiles=t), reference_swiglu,
                                 (x, weights[0], weights[0].flip(0)))
