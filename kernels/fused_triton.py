"""Triton kernels for the non-attention parts of a decoder layer: RMSNorm, SwiGLU, rotary embeddings, and the
projections of decode steps.

Each replaces a chain of PyTorch kernels with one pass over memory (transformers' ``LlamaRMSNorm`` runs ~8 kernels
forward, rotary ~10 for q and k, ``silu(gate) * up`` 2); the decode-sized projections read q, k and v's weights in one
launch, and gate and up's with SwiGLU applied. Entry points (launchers, called by ``fused.py``):

    y, rstd, _ = rms_norm_fwd(x, weight, eps)       # x [M, N]; y [M, N] in promote(x, weight); rstd [M] float32
    y, rstd, summed = rms_norm_fwd(x, weight, eps, residual)   # the norm of summed = residual + x
    dx, dweight = rms_norm_bwd(dy, x, weight, rstd[, dsum])
    out = swiglu_fwd(gate, up)                        # silu(gate) * up, any shape (contiguous), one dtype
    dgate, dup = swiglu_bwd(dout, gate, up)
    rotary_apply(q, k, cos, sin, q_out, k_out, backward)   # q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B|1, T, D]
    cos, sin = rotary_tables_fwd(position_ids, inv_freq, scaling, dtype)   # LlamaRotaryEmbedding's [B, T, D] tables
    outs = linear_group_fwd(x, [w_q, w_k, w_v])       # x [M <= 16, K] @ each w.T, one launch (decode steps)
    h = linear_swiglu_fwd(x, w_gate, w_up)            # silu(x @ w_gate.T) * (x @ w_up.T)

On Hopper and later GPUs the RMSNorm forward, rotary (tables and both directions) and the decode-sized projections
launch with programmatic dependent launch (``dependent_launch.py``), waiting for the kernel before them at their
start.

Numerics follow transformers' functions: float32 math, the normalized activations rounded to the input's dtype
before the weight multiplies them (as ``LlamaRMSNorm`` does), outputs in the dtype PyTorch's type promotion gives.
Intermediate roundings of the PyTorch chain that are not part of the function (``silu`` rounded before the product,
``q * cos`` rounded before the sum) are not repeated: the result is the float32 value rounded once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import hopper_linear
from .dependent_launch import launch_options, wait_for_preceding_kernel
from .interface import capturing_cuda_graph
from .triton_setup import launch_within_shared_memory, next_power_of_2, tl, triton


def _row_warps(block: int) -> int:
    """Warps for one program over ``block`` elements: ~8 elements per thread, 4 to 16 warps."""
    return min(max(block // 256, 4), 16)


# ---------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_fwd_kernel(x_ptr, residual_ptr, w_ptr, y_ptr, sum_ptr, rstd_ptr, N, stride_x, stride_r, stride_y,
                         stride_s, eps, BLOCK_N: tl.constexpr, ADD_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    wait_for_preceding_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0)
    if ADD_RESIDUAL:  # the decoder layer's `residual + x`, rounded as PyTorch rounds it, then normalized
        r = tl.load(residual_ptr + row * stride_r + cols, mask=in_row, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=in_row)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # LlamaRMSNorm rounds to the input dtype before the weight
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=in_row)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dsum_ptr, dx_ptr, dw_partial_ptr, M, N, stride_dy,
                         stride_x, stride_ds, stride_dx, BLOCK_N: tl.constexpr, ADD_DSUM: tl.constexpr):
    # Program p handles rows p, p + P, p + 2P, ... and writes its share of dweight to row p of dw_partial [P, N].
    # ADD_DSUM: x was `residual + x'`, also used on its own, whose gradient dsum adds to dx.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Row pointers advance by `programs` rows (64-bit pointer arithmetic: no int32 overflow on long inputs).
    first, step = pid.to(tl.int64), programs.to(tl.int64)
    dy_row, x_row, dx_row, rstd_row = (dy_ptr + first * stride_dy, x_ptr + first * stride_x,
                                       dx_ptr + first * stride_dx, rstd_ptr + first)
    dsum_row = dsum_ptr + first * stride_ds
    for _ in tl.range(pid, M, programs):
        x = tl.load(x_row + cols, mask=in_row, other=0.0)
        xf = x.to(tl.float32)
        dy = tl.load(dy_row + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_row)
        normed = xf * rstd
        dw += dy * normed.to(x.dtype).to(tl.float32)
        dnormed = dy * w
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (dn - n * mean(dn * n))
        dx = rstd * (dnormed - normed * (tl.sum(dnormed * normed, axis=0) / N))
        if ADD_DSUM:
            dx += tl.load(dsum_row + cols, mask=in_row, other=0.0).to(tl.float32)
            dsum_row += step * stride_ds
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)
        dy_row += step * stride_dy
        x_row += step * stride_x
        dx_row += step * stride_dx
        rstd_row += step
    tl.store(dw_partial_ptr + pid.to(tl.int64) * N + cols, dw, mask=in_row)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [M, N]`` (unit column stride) -> ``(y [M, N], rstd [M] float32, summed)``. With ``residual [M, N]`` the
    norm is of ``summed = residual + x`` (in ``promote(residual, x)``), returned too; else ``summed`` is None."""
    m, n = x.shape
    summed = None
    if residual is not None:
        summed = torch.empty((m, n), device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    normed_dtype = x.dtype if summed is None else summed.dtype
    y = torch.empty((m, n), device=x.device, dtype=torch.promote_types(normed_dtype, weight.dtype))
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    block = next_power_of_2(n)
    if m:
        r, s = (x, x) if summed is None else (residual, summed)  # stand-ins, unread without a residual
        _rms_norm_fwd_kernel[(m,)](x, r, weight, y, s, rstd, n, x.stride(0), r.stride(0), y.stride(0), s.stride(0),
                                   eps, BLOCK_N=block, ADD_RESIDUAL=summed is not None, num_warps=_row_warps(block),
                                   **launch_options(x.device))
    return y, rstd, summed


def rms_norm_bwd(dy, x, weight, rstd, dsum=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rms_norm_fwd`` for ``x`` (in x's dtype; plus ``dsum`` when x was a sum also used on its own)
    and ``weight`` (in weight's dtype)."""
    m, n = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    programs = max(1, min(m, _parallel_programs(x.device)))
    dw_partial = torch.empty((programs, n), device=x.device, dtype=torch.float32)
    block = next_power_of_2(n)
    if m:
        ds = dy if dsum is None else dsum  # a stand-in, unread without dsum
        _rms_norm_bwd_kernel[(programs,)](dy, x, weight, rstd, ds, dx, dw_partial, m, n, dy.stride(0), x.stride(0),
                                          ds.stride(0), dx.stride(0), BLOCK_N=block, ADD_DSUM=dsum is not None,
                                          num_warps=_row_warps(block))
    else:
        dw_partial.zero_()
    return dx, dw_partial.sum(0).to(weight.dtype)


def _parallel_programs(device: torch.device) -> int:
    """Programs that keep every SM busy with rows (the interpreter runs them one by one: a few)."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------- SwiGLU
SWIGLU_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    gate = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_bwd_kernel(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    dout = tl.load(dout_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    tl.store(dup_ptr + offsets, (dout * silu).to(dup_ptr.dtype.element_ty), mask=inside)
    dsilu = sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(dgate_ptr + offsets, (dout * up * dsilu).to(dgate_ptr.dtype.element_ty), mask=inside)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous tensors of one shape and dtype."""
    out = torch.empty_like(gate)
    numel = gate.numel()
    if numel:
        _swiglu_fwd_kernel[(triton.cdiv(numel, SWIGLU_BLOCK),)](gate, up, out, numel, BLOCK=SWIGLU_BLOCK)
    return out


def swiglu_bwd(dout, gate, up) -> tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    numel = gate.numel()
    if numel:
        _swiglu_bwd_kernel[(triton.cdiv(numel, SWIGLU_BLOCK),)](dout, gate, up, dgate, dup, numel,
                                                                BLOCK=SWIGLU_BLOCK)
    return dgate, dup


# ---------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rotate_heads(x_ptr, out_ptr, c1, c2, s1, s2, b, t, H, stride_xb, stride_xh, stride_xt, stride_ob, stride_oh,
                  stride_ot, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BACKWARD: tl.constexpr):
    """Rotate every head of token ``(b, t)``. Forward: ``x * cos + rotate_half(x) * sin``; backward: its transpose."""
    d = tl.arange(0, BLOCK_HALF)[None, :]
    x_row = x_ptr + b * stride_xb + t * stride_xt
    out_row = out_ptr + b * stride_ob + t * stride_ot
    for h0 in range(0, H, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H))[:, None]
        inside = (heads < H) & (d < HALF)
        x1 = tl.load(x_row + heads * stride_xh + d, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + heads * stride_xh + HALF + d, mask=inside, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(out_row + heads * stride_oh + d, y1.to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(out_row + heads * stride_oh + HALF + d, y2.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, T, Hq, Hk,
                   stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                   stride_qob, stride_qoh, stride_qot, stride_kob, stride_koh, stride_kot, stride_cb, stride_ct,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr,
                   PDL: tl.constexpr):
    # Program (token, 0) rotates the token's query heads, (token, 1) its key heads; cos/sin are read once each.
    wait_for_preceding_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    b, t = token // T, token % T
    d = tl.arange(0, BLOCK_HALF)[None, :]
    table = b * stride_cb + t * stride_ct + d
    c1 = tl.load(cos_ptr + table, mask=d < HALF, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=d < HALF, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr, q_out_ptr, c1, c2, s1, s2, b, t, Hq, stride_qb, stride_qh, stride_qt, stride_qob,
                      stride_qoh, stride_qot, HALF, BLOCK_HALF, BLOCK_H, BACKWARD)
    else:
        _rotate_heads(k_ptr, k_out_ptr, c1, c2, s1, s2, b, t, Hk, stride_kb, stride_kh, stride_kt, stride_kob,
                      stride_koh, stride_kot, HALF, BLOCK_HALF, BLOCK_H, BACKWARD)


def rotary_apply(q, k, cos, sin, q_out, k_out, backward: bool) -> None:
    """Write ``q_out``, ``k_out`` (``[B, H, T, D]``, any strides): the rotation of q and k (its transpose with
    ``backward``). Every tensor has unit stride in D; cos/sin ``[B or 1, T, D]``."""
    b, hq, t, d = q.shape
    hk = k.shape[1]
    half = d // 2
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(max(hq, hk)), max(1, 4096 // block_half))
    cos_batch_stride = 0 if cos.shape[0] == 1 else cos.stride(0)  # position ids shared by the batch
    if b * t:
        _rotary_kernel[(b * t, 2)](
            q, k, q_out, k_out, cos, sin, t, hq, hk, *_bht(q), *_bht(k), *_bht(q_out), *_bht(k_out),
            cos_batch_stride, cos.stride(1), HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, BACKWARD=backward,
            num_warps=4, **launch_options(q.device),
        )


def _bht(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


@triton.jit
def _rotary_tables_kernel(position_ids, inv_freq, cos_out, sin_out, num_tokens, scaling, HALF: tl.constexpr,
                          BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """``BLOCK_T`` rows of ``LlamaRotaryEmbedding``'s tables: angle = position * inv_freq in float32, cos and sin
    (libdevice's, as PyTorch's CUDA kernels compute them) times the attention scaling, rounded to the output dtype;
    the ``HALF`` frequencies fill both halves of a row (transformers' ``cat((freqs, freqs))``)."""
    wait_for_preceding_kernel(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_HALF)
    inside = (tokens < num_tokens)[:, None] & (h < HALF)[None, :]
    position = tl.load(position_ids + tokens, mask=tokens < num_tokens, other=0).to(tl.float32)
    angle = position[:, None] * tl.load(inv_freq + h, mask=h < HALF, other=0.0).to(tl.float32)[None, :]
    rows = tokens.to(tl.int64)[:, None] * (2 * HALF) + h[None, :]
    _store_table(cos_out + rows, tl.cos(angle) * scaling, inside, HALF)
    _store_table(sin_out + rows, tl.sin(angle) * scaling, inside, HALF)


@triton.jit
def _store_table(row_ptrs, value, inside, HALF: tl.constexpr):
    """Both halves of the table rows at ``row_ptrs`` get ``value`` in the table's dtype."""
    value = value.to(row_ptrs.dtype.element_ty)
    tl.store(row_ptrs, value, mask=inside)
    tl.store(row_ptrs + HALF, value, mask=inside)


ROTARY_TABLE_TOKENS = 16


def rotary_tables_fwd(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """``position_ids`` int ``[B, T]`` (contiguous), ``inv_freq [D / 2]`` (contiguous, any float dtype: read as
    float32) -> cos, sin ``[B, T, D]`` in ``dtype``."""
    half = inv_freq.shape[0]
    cos, sin = (torch.empty(*position_ids.shape, 2 * half, dtype=dtype, device=position_ids.device)
                for _ in range(2))
    num_tokens = position_ids.numel()
    if num_tokens:
        _rotary_tables_kernel[(triton.cdiv(num_tokens, ROTARY_TABLE_TOKENS),)](
            position_ids, inv_freq, cos, sin, num_tokens, scaling, HALF=half, BLOCK_HALF=next_power_of_2(half),
            BLOCK_T=ROTARY_TABLE_TOKENS, num_warps=4, **launch_options(position_ids.device),
        )
    return cos, sin


# ---------------------------------------------------------------------------------------------- decode-sized linears
# Projections of a decode step (a few tokens) read a whole weight matrix for a handful of rows: memory-bound, and at
# this size cuBLAS's kernels reach ~1.5 TB/s on an H100 for the 8 MB projections. One launch for q, k and v together,
# one for gate and up with SwiGLU fused, and down's adds the decoder layer's residual (bench/NOTES.md has the
# measurements). A program holds all tokens in one 16-row tile (the smallest tl.dot tile): up to 16 tokens
# (``fused.MAX_DECODE_TOKENS``). On Hopper, inside CUDA graph captures, ``linear_group_fwd`` runs the Gluon kernel of
# ``hopper_linear.py`` instead (a TMA producer warp; up to 8 tokens).


@dataclass(frozen=True)
class SkinnyTiles:
    """Launch shape of the decode-sized projections: weight rows and columns per step, pipeline depth."""

    block_n: int
    block_k: int
    stages: int


@triton.jit
def _skinny_tile(x_ptr, w_ptr, w2_ptr, tile, M, N, K, stride_xm, stride_wn, stride_w2n, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIR: tl.constexpr):
    """``x [M, K] @ w[cols, :]^T`` for the ``tile``-th ``BLOCK_N`` rows of ``w [N, K]``: ``[16, BLOCK_N]`` float32;
    with ``PAIR`` also ``x @ w2[cols, :]^T`` from the same loop (one pipeline for both weights)."""
    rows = tl.arange(0, 16)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    acc2 = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_in = (k0 + ks)[None, :] < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=(rows[:, None] < M) & k_in,
                    other=0.0)
        w_mask = (cols[:, None] < N) & k_in
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if PAIR:
            w2 = tl.load(w2_ptr + cols[:, None].to(tl.int64) * stride_w2n + (k0 + ks)[None, :], mask=w_mask,
                         other=0.0)
            acc2 = tl.dot(x, tl.trans(w2), acc2, input_precision=DOT_PRECISION)
    return acc, acc2


@triton.jit
def _store_tile(o_ptr, acc, tile, M, N, stride_om, BLOCK_N: tl.constexpr, r_ptr=None, stride_rm=0,
                ADD_RESIDUAL: tl.constexpr = False):
    """Store the ``[16, BLOCK_N]`` product tile in o's dtype; with ``ADD_RESIDUAL``, ``residual + product`` rounded as
    PyTorch rounds ``residual + (x @ w.T)``: the product to o's dtype first, then the sum computed in float32."""
    rows = tl.arange(0, 16)[:, None]
    cols = (tile * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    in_bounds = (rows < M) & (cols < N)
    out = acc.to(o_ptr.dtype.element_ty)
    if ADD_RESIDUAL:
        residual = tl.load(r_ptr + rows * stride_rm + cols, mask=in_bounds, other=0.0)
        out = (out.to(tl.float32) + residual.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + rows * stride_om + cols, out, mask=in_bounds)


@triton.jit
def _linear_group_kernel(x_ptr, w0, w1, w2, o0, o1, o2, r0, M, N0, N1, N2, K, tiles0, tiles01, stride_xm, stride_w0,
                         stride_w1, stride_w2, stride_o0, stride_o1, stride_o2, stride_r0, NUM_WEIGHTS: tl.constexpr,
                         ADD_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    # Programs [0, tiles0) compute o0 = x @ w0^T (+ r0 with ADD_RESIDUAL), [tiles0, tiles01) o1, the rest o2. Only
    # NUM_WEIGHTS branches are compiled: each holds its own pipeline buffers in shared memory. (One loop over a weight
    # selected per program was 3-5% slower for q/k/v on an H200: bench/NOTES.md, fifty-third session.)
    wait_for_preceding_kernel(PDL)
    pid = tl.program_id(0)
    if pid < tiles0:
        acc, _ = _skinny_tile(x_ptr, w0, w0, pid, M, N0, K, stride_xm, stride_w0, stride_w0, BLOCK_N, BLOCK_K, STAGES,
                              DOT_PRECISION, False)
        _store_tile(o0, acc, pid, M, N0, stride_o0, BLOCK_N, r0, stride_r0, ADD_RESIDUAL)
    elif NUM_WEIGHTS == 2 or (NUM_WEIGHTS == 3 and pid < tiles01):
        tile = pid - tiles0
        acc, _ = _skinny_tile(x_ptr, w1, w1, tile, M, N1, K, stride_xm, stride_w1, stride_w1, BLOCK_N, BLOCK_K,
                              STAGES, DOT_PRECISION, False)
        _store_tile(o1, acc, tile, M, N1, stride_o1, BLOCK_N)
    elif NUM_WEIGHTS == 3:
        tile = pid - tiles01
        acc, _ = _skinny_tile(x_ptr, w2, w2, tile, M, N2, K, stride_xm, stride_w2, stride_w2, BLOCK_N, BLOCK_K,
                              STAGES, DOT_PRECISION, False)
        _store_tile(o2, acc, tile, M, N2, stride_o2, BLOCK_N)


@triton.jit
def _linear_swiglu_kernel(x_ptr, w_gate, w_up, out_ptr, M, N, K, stride_xm, stride_wg, stride_wu, stride_om,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    # gate and up from one pipelined loop: two loops one after the other drained and refilled the pipeline between
    # them (H200: 19.5 -> 18.4 us a layer at 8 tokens; bench/NOTES.md, fifty-third session)
    wait_for_preceding_kernel(PDL)
    tile = tl.program_id(0)
    gate, up = _skinny_tile(x_ptr, w_gate, w_up, tile, M, N, K, stride_xm, stride_wg, stride_wu, BLOCK_N, BLOCK_K,
                            STAGES, DOT_PRECISION, True)
    _store_tile(out_ptr, gate * tl.sigmoid(gate) * up, tile, M, N, stride_om, BLOCK_N)


def pipeline_bytes(tiles: SkinnyTiles, loops: int, weights_per_loop: int, element_size: int) -> int:
    """Shared memory a launch shape needs: ``stages - 1`` buffers of 16 rows of x and ``weights_per_loop`` weight
    tiles for each of ``loops`` pipelined loops (``linear_group``'s compiled branches, one a weight, or
    ``linear_swiglu``'s one loop over two weights). Triton 3.9 gives each branch its own buffers; Triton 3.6 shared
    them between the second and third (bench/NOTES.md, fifty-third session), so this is what every version fits."""
    return (tiles.stages - 1) * loops * (16 + weights_per_loop * tiles.block_n) * tiles.block_k * element_size


def _default_skinny_tiles(x: torch.Tensor, loops: int, weights_per_loop: int, max_stages: int) -> SkinnyTiles:
    """Tile and pipeline depth of the decode-sized kernels (H100 sweep, checked on an H200; bench/NOTES.md): 32
    weight rows x 256 columns per step up to K = 4096, 16 x 512 beyond, or half as many columns where that fits more
    stages (up to ``max_stages``) in ~200 KB of shared memory (``pipeline_bytes``)."""
    return _skinny_tiles_for(x.shape[1], x.element_size(), loops, weights_per_loop, max_stages)


@functools.lru_cache(maxsize=64)
def _skinny_tiles_for(width: int, element_size: int, loops: int, weights_per_loop: int,
                      max_stages: int) -> SkinnyTiles:
    """``_default_skinny_tiles`` by its inputs' sizes, computed once: every projection of every eager decode step
    asks (~3 us of Python a call, ~48 calls a step of the 1B hybrid)."""
    block_n, block_k = (32, 256) if width <= 4096 else (16, 512)

    def deepest(tiles: SkinnyTiles) -> SkinnyTiles:
        while tiles.stages > 2 and pipeline_bytes(tiles, loops, weights_per_loop, element_size) > 200 * 1024:
            tiles = SkinnyTiles(tiles.block_n, tiles.block_k, tiles.stages - 1)
        return tiles

    wide, narrow = (deepest(SkinnyTiles(block_n, k_step, max_stages)) for k_step in (block_k, block_k // 2))
    return narrow if narrow.stages > wide.stages else wide


def _launch_config(x: torch.Tensor, tiles: SkinnyTiles) -> dict:
    """The kernels' keywords but ``STAGES``, which ``_launch_fitted`` passes."""
    return dict(BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=_dot_precision(x), num_warps=4,
                **launch_options(x.device))


def _launch_fitted(launch, x: torch.Tensor, tiles: SkinnyTiles, kernel: tuple) -> None:
    """``launch`` at ``tiles.stages``, or fewer where a GPU's shared memory holds fewer than ``pipeline_bytes``
    budgets (less than Hopper's 227 KB a program, or another Triton's allocation)."""
    key = (*kernel, x.device, x.dtype, tiles)
    launch_within_shared_memory(lambda num_stages: launch(STAGES=num_stages), tiles.stages, key)


def _dot_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


def linear_group_fwd(x: torch.Tensor, weights: list[torch.Tensor], residual: torch.Tensor | None = None,
                     tiles: SkinnyTiles | None = None, after_decode_attention: bool = False) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` (1 to 3 weights ``[N_i, K]``, unit column stride; x ``[M <= 16, K]``); with
    ``residual [M, N_0]`` (unit column stride, one weight), the output is ``residual + x @ w_0.T`` (``_store_tile``).
    ``tiles`` overrides the default launch shape (``bench/projection_ab.py`` sweeps it). ``after_decode_attention``
    (o_proj): x comes from the decode attention kernel; see below."""
    m, k = x.shape
    # On Hopper, while a CUDA graph is captured (a static cache's decode steps), the Gluon kernel: its producer warp
    # reads the weights 1.1-1.3x faster. Its launch costs ~0.1 ms of host time (Triton binding its arguments and TMA
    # descriptors), which a graph pays once and an eager step at every call (bench/NOTES.md, fifty-ninth session), so
    # eager calls stay here. Behind the decode attention kernel (o_proj) only the Gluon kernel beats cuBLAS: this
    # file's kernel there made the batch-8 step slower, the Gluon kernel faster (bench/NOTES.md, fifty-third,
    # fifty-seventh and sixtieth sessions), so that call is otherwise nn.Linear's.
    gluon = tiles is None and capturing_cuda_graph(x) and hopper_linear.supported(x, weights)
    if after_decode_attention and not gluon:
        outs = [torch.nn.functional.linear(x, w) for w in weights]  # nn.Linear's call
        return outs if residual is None else [residual + outs[0]]
    outs = [x.new_empty((m, w.shape[0])) for w in weights]
    if gluon:
        hopper_linear.linear_group(x, weights, outs, residual)
        return outs
    tiles = tiles or _default_skinny_tiles(x, loops=len(weights), weights_per_loop=1, max_stages=5)
    num_tiles = [triton.cdiv(w.shape[0], tiles.block_n) for w in weights]
    # Three slots: unused ones repeat the first weight (their branches are not compiled).
    slot_weights = [*weights, *[weights[0]] * (3 - len(weights))]
    slot_outs = [*outs, *[outs[0]] * (3 - len(outs))]
    if m:
        launch = functools.partial(
            _linear_group_kernel[(sum(num_tiles),)],
            x, *slot_weights, *slot_outs, outs[0] if residual is None else residual, m,  # (unread without one)
            *(w.shape[0] for w in slot_weights), k, num_tiles[0], sum(num_tiles[:2]), x.stride(0),
            *(w.stride(0) for w in slot_weights), *(o.stride(0) for o in slot_outs),
            0 if residual is None else residual.stride(0), NUM_WEIGHTS=len(weights),
            ADD_RESIDUAL=residual is not None, **_launch_config(x, tiles),
        )
        _launch_fitted(launch, x, tiles, ("linear_group", len(weights)))
    return outs


def linear_swiglu_fwd(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` (x ``[M <= 16, K]``, weights ``[N, K]``); ``tiles`` as in
    ``linear_group_fwd``."""
    m, k = x.shape
    n = w_gate.shape[0]
    out = x.new_empty((m, n))
    tiles = tiles or _default_skinny_tiles(x, loops=1, weights_per_loop=2, max_stages=3)
    if m:
        launch = functools.partial(
            _linear_swiglu_kernel[(triton.cdiv(n, tiles.block_n),)],
            x, w_gate, w_up, out, m, n, k, x.stride(0), w_gate.stride(0), w_up.stride(0), out.stride(0),
            **_launch_config(x, tiles),
        )
        _launch_fitted(launch, x, tiles, ("linear_swiglu",))
    return out
