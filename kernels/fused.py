"""Fused RMSNorm, SwiGLU, rotary embeddings and decode-sized projections: one Triton kernel each, as custom ops.

The S2 model calls these where its attention runs Triton (``use_fused_kernels``) and transformers' Llama functions
elsewhere; the results agree with those functions to rounding (see ``fused_triton.py``)::

    y = rms_norm(x, weight, eps)                      # LlamaRMSNorm: x [..., N], weight [N]
    y, summed = add_rms_norm(x, residual, weight, eps)  # summed = residual + x; y = rms_norm(summed, weight, eps)
    h = swiglu(gate, up)                              # LlamaMLP's act_fn(gate) * up, act_fn = silu
    cos, sin = rotary_tables(position_ids, inv_freq, attention_scaling, dtype)  # LlamaRotaryEmbedding's tables
    q, k = rotary_embedding(q, k, cos, sin)           # apply_rotary_pos_emb: q [B, Hq, T, D], k [B, Hk, T, D],
                                                      # cos/sin [B or 1, T, D] (LlamaRotaryEmbedding's output)
    q, k, v = linear_group(x, [w_q, w_k, w_v])        # decode steps (<= 16 tokens, no gradient): x @ w.T each,
    h = linear_swiglu(x, w_gate, w_up)                # one launch; silu(x @ w_gate.T) * (x @ w_up.T)
    (y,) = linear_group(h, [w_down], residual=r)      # r + h @ w_down.T, the add in the product's store
    (o,) = linear_group(a, [w_o], after_decode_attention=True)  # o_proj behind the decode attention kernel

Each op is a ``torch.library.custom_op`` with a fake implementation (and, but for the inference-only projections,
registered autograd), so ``torch.compile(fullgraph=True)`` traces it as one node and a CUDA graph captures it. Only
torch is imported here; Triton is imported on first use.
"""

from __future__ import annotations

import torch
from torch import nn

from .interface import OP_NAMESPACE, check_backend, use_triton
from .layouts import empty_heads_last

# One Triton program holds a whole row of the norm: wider rows run transformers' RMSNorm.
MAX_NORM_WIDTH = 65536
# The decode-sized projections hold every token in one 16-row tile.
MAX_DECODE_TOKENS = 16


def use_fused_kernels(backend: str, x: torch.Tensor) -> bool:
    """Whether ``backend`` (an S2 backend name) runs the fused Triton kernels for activations like ``x``: where it
    runs the attention kernels (``interface.use_triton``). float64 always runs PyTorch (no Triton path; the
    references are float64)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        check_backend(backend)
        return False
    return use_triton(backend, x)


def rotary_embedding_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotary_embedding`` takes these shapes (transformers' rotary accepts more broadcasting)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, t, d = q.shape
    return (k.shape[0] == b and k.shape[2:] == (t, d) and d % 2 == 0 and cos.shape[0] in (1, b)
            and cos.shape[1:] == (t, d) and not (cos.requires_grad or sin.requires_grad))


def decode_projections_fit(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> bool:
    """Whether the ``linears`` that read ``x [..., K]`` can run as ``linear_group`` / ``linear_swiglu``: at most
    ``MAX_DECODE_TOKENS`` tokens, no gradient and no autocast (inference), and plain bias-free ``nn.Linear`` layers
    with local weights in x's dtype. Anything else (LoRA and quantized layers, hooks or a replaced ``forward``, as
    accelerate's offloading sets, sharded weights) runs its own ``forward``."""
    if torch.is_grad_enabled() or x.numel() > MAX_DECODE_TOKENS * x.shape[-1] or x.numel() == 0:
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    for linear in linears:
        if type(linear) is not nn.Linear or linear.bias is not None or "forward" in linear.__dict__:
            return False
        if linear._forward_hooks or linear._forward_pre_hooks:
            return False
        weight = linear.weight
        if type(weight.data) is not torch.Tensor or weight.dtype != x.dtype or weight.stride(-1) != 1:
            return False
    return True


# ---------------------------------------------------------------------------------------------- public ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm``: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim, in one kernel."""
    _check_norm_shapes(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    y, _ = rms_norm_op(_unit_stride(rows), weight, float(eps))
    return y.view(*x.shape[:-1], x.shape[-1])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = residual + x`` (PyTorch's dtype promotion) and ``rms_norm(summed, weight, eps)`` in one kernel:
    a decoder layer's residual add and the norm after it. Returns ``(normed, summed)``."""
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    _check_norm_shapes(x, weight)
    n = x.shape[-1]
    y, summed, _ = add_rms_norm_op(_unit_stride(x.reshape(-1, n)), _unit_stride(residual.reshape(-1, n)), weight,
                                   float(eps))
    return y.view(x.shape), summed.view(x.shape)


def _check_norm_shapes(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    if not 0 < x.shape[-1] <= MAX_NORM_WIDTH:
        raise ValueError(f"x's last dim must be in 1..{MAX_NORM_WIDTH}, got {x.shape[-1]}")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel (gate and up of one shape and dtype)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must share shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    return swiglu_op(gate.contiguous(), up.contiguous())


def rotary_embedding(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb(q, k, cos, sin)`` for q and k in one kernel; outputs laid out ``[B, T, H, D]``."""
    if not rotary_embedding_fits(q, k, cos, sin):
        raise ValueError(
            f"rotary_embedding takes q [B, Hq, T, D], k [B, Hk, T, D] with even D and cos/sin [B or 1, T, D] that need "
            f"no gradient; got q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}"
        )
    # cos and sin contiguous: the kernel indexes both with cos's strides (tables are small, usually already so)
    return rotary_op(_unit_stride(q), _unit_stride(k), cos.contiguous(), sin.contiguous())


def rotary_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaRotaryEmbedding``'s ``(cos, sin)`` ``[B, T, D]`` in ``dtype`` for ``position_ids [B, T]``, in one
    kernel (transformers launches ~9): angles ``position * inv_freq`` in float32 (``inv_freq`` read as float32, as
    transformers reads its buffer), cos and sin times ``attention_scaling``. On CUDA the same float32 functions as
    PyTorch's kernels, so the same bits (tests); in Triton's CPU interpreter NumPy's."""
    if position_ids.dim() != 2 or position_ids.is_floating_point() or inv_freq.dim() != 1:
        raise ValueError(f"rotary_tables takes integer position_ids [B, T] and inv_freq [D / 2]; got position_ids "
                         f"{tuple(position_ids.shape)} {position_ids.dtype}, inv_freq {tuple(inv_freq.shape)}")
    return rotary_tables_op(position_ids.contiguous(), inv_freq.contiguous(), float(attention_scaling), dtype)


def linear_group(x: torch.Tensor, weights: list[torch.Tensor], residual: torch.Tensor | None = None,
                 after_decode_attention: bool = False) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` in one launch, for 1 to 3 weights ``[N_i, K]`` and at most
    ``MAX_DECODE_TOKENS`` tokens in ``x [..., K]`` (no autograd: inference only). ``residual [..., N]`` (one weight
    ``[N, K]``, x's dtype): returns ``[residual + x @ w.T]``, rounded exactly as PyTorch computes that sum (a
    decoder layer's closing residual add, without a launch of its own). ``after_decode_attention``: ``x`` is the
    decode attention kernel's output (o_proj), which picks the launch that is fastest behind that kernel
    (``fused_triton.linear_group_fwd``)."""
    rows = _decode_rows(x, weights)
    if residual is not None:
        expected = (*x.shape[:-1], weights[0].shape[0])
        if len(weights) != 1 or tuple(residual.shape) != expected or residual.dtype != x.dtype:
            raise ValueError(f"residual must come with one weight and be {list(expected)} in {x.dtype}, got "
                             f"{len(weights)} weights and residual {list(residual.shape)} {residual.dtype}")
        residual = _unit_stride(residual.reshape(-1, expected[-1]))
    outs = linear_group_op(rows, list(weights), residual, after_decode_attention)
    return [out.view(*x.shape[:-1], out.shape[-1]) for out in outs]


def linear_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` in one launch (``LlamaMLP`` before ``down_proj``), for at most
    ``MAX_DECODE_TOKENS`` tokens (no autograd: inference only)."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up must share one shape, got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    out = linear_swiglu_op(_decode_rows(x, [w_gate, w_up]), w_gate, w_up)
    return out.view(*x.shape[:-1], out.shape[-1])


def _decode_rows(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """``x`` as ``[M, K]`` rows with unit column stride, after checking what the decode-sized kernels take."""
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"between 1 and 3 weights, got {len(weights)}")
    k = x.shape[-1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or w.stride(-1) != 1:
            raise ValueError(f"weights must be [N, {k}] in {x.dtype} with unit column stride, got "
                             f"{tuple(w.shape)} {w.dtype} strides {w.stride()}")
    if x.numel() > MAX_DECODE_TOKENS * k:
        raise ValueError(f"at most {MAX_DECODE_TOKENS} tokens, got {x.numel() // k}")
    return _unit_stride(x.reshape(-1, k))


# ---------------------------------------------------------------------------------------------- RMSNorm ops
@torch.library.custom_op(f"{OP_NAMESPACE}::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, N]`` -> ``(y [M, N], rstd [M] float32)``."""
    from .fused_triton import rms_norm_fwd

    y, rstd, _ = rms_norm_fwd(x, weight, eps)
    return y, rstd


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(x.shape[0],
                                                                                                dtype=torch.float32)


@torch.library.custom_op(f"{OP_NAMESPACE}::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x, residual [M, N]`` -> ``(y [M, N], summed [M, N], rstd [M] float32)``."""
    from .fused_triton import rms_norm_fwd

    y, rstd, summed = rms_norm_fwd(x, weight, eps, residual)
    return y, summed, rstd


@add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    summed = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    y = x.new_empty(x.shape, dtype=torch.promote_types(summed.dtype, weight.dtype))
    return y, summed, x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op(f"{OP_NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                         dsum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients for ``x`` and ``weight``; ``dsum``: the gradient of ``x`` itself when it is ``add_rms_norm``'s
    ``summed`` (added to dx)."""
    from .fused_triton import rms_norm_bwd

    return rms_norm_bwd(dy.contiguous(), x, weight, rstd, None if dsum is None else dsum.contiguous())


@rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(dy, x, weight, rstd, dsum=None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


def _add_rms_norm_setup_context(ctx, inputs, output):
    x, residual, weight, _ = inputs
    ctx.input_dtypes = x.dtype, residual.dtype
    ctx.save_for_backward(output[1], weight, output[2])


def _add_rms_norm_backward(ctx, dy, dsummed, _drstd):
    summed, weight, rstd = ctx.saved_tensors
    dsum, dweight = rms_norm_backward_op(dy, summed, weight, rstd, dsummed)
    x_dtype, residual_dtype = ctx.input_dtypes
    return dsum.to(x_dtype), dsum.to(residual_dtype), dweight, None


add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)


# ---------------------------------------------------------------------------------------------- SwiGLU op
@torch.library.custom_op(f"{OP_NAMESPACE}::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from .fused_triton import swiglu_fwd

    return swiglu_fwd(gate, up)


@swiglu_op.register_fake
def _swiglu_fake(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op(f"{OP_NAMESPACE}::swiglu_backward", mutates_args=())
def swiglu_backward_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .fused_triton import swiglu_bwd

    return swiglu_bwd(dout.contiguous(), gate, up)


@swiglu_backward_op.register_fake
def _swiglu_backward_fake(dout, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _swiglu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    return swiglu_backward_op(dout, gate, up)


swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


# ---------------------------------------------------------------------------------------------- decode linears
@torch.library.custom_op(f"{OP_NAMESPACE}::linear_group", mutates_args=())
def linear_group_op(x: torch.Tensor, weights: list[torch.Tensor], residual: torch.Tensor | None = None,
                    after_decode_attention: bool = False) -> list[torch.Tensor]:
    from .fused_triton import linear_group_fwd

    return linear_group_fwd(x, weights, residual, after_decode_attention=after_decode_attention)


@linear_group_op.register_fake
def _linear_group_fake(x, weights, residual=None, after_decode_attention=False):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


@torch.library.custom_op(f"{OP_NAMESPACE}::linear_swiglu", mutates_args=())
def linear_swiglu_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    from .fused_triton import linear_swiglu_fwd

    return linear_swiglu_fwd(x, w_gate, w_up)


@linear_swiglu_op.register_fake
def _linear_swiglu_fake(x, w_gate, w_up):
    return x.new_empty((x.shape[0], w_gate.shape[0]))


# ---------------------------------------------------------------------------------------------- rotary op
def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with unit stride (any other strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op(f"{OP_NAMESPACE}::rotary", mutates_args=())
def rotary_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .fused_triton import rotary_apply

    q_out = empty_heads_last(q, torch.promote_types(q.dtype, cos.dtype))
    k_out = empty_heads_last(k, torch.promote_types(k.dtype, cos.dtype))
    rotary_apply(q, k, cos, sin, q_out, k_out, backward=False)
    return q_out, k_out


@rotary_op.register_fake
def _rotary_fake(q, k, cos, sin):
    return (empty_heads_last(q, torch.promote_types(q.dtype, cos.dtype)),
            empty_heads_last(k, torch.promote_types(k.dtype, cos.dtype)))


@torch.library.custom_op(f"{OP_NAMESPACE}::rotary_tables", mutates_args=())
def rotary_tables_op(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from .fused_triton import rotary_tables_fwd

    return rotary_tables_fwd(position_ids, inv_freq, attention_scaling, dtype)


@rotary_tables_op.register_fake
def _rotary_tables_fake(position_ids, inv_freq, attention_scaling, dtype):
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return (position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype))


@torch.library.custom_op(f"{OP_NAMESPACE}::rotary_backward", mutates_args=())
def rotary_backward_op(dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_dtype: torch.dtype, k_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rotary_op`` for q and k, in their dtypes."""
    from .fused_triton import rotary_apply

    dq, dk = empty_heads_last(dq_out, q_dtype), empty_heads_last(dk_out, k_dtype)
    rotary_apply(_unit_stride(dq_out), _unit_stride(dk_out), cos, sin, dq, dk, backward=True)
    return dq, dk


@rotary_backward_op.register_fake
def _rotary_backward_fake(dq_out, dk_out, cos, sin, q_dtype, k_dtype):
    return empty_heads_last(dq_out, q_dtype), empty_heads_last(dk_out, k_dtype)


def _rotary_setup_context(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = q.dtype, k.dtype


def _rotary_backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    dq, dk = rotary_backward_op(dq_out, dk_out, cos, sin, *ctx.dtypes)
    return dq, dk, None, None


rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)
