"""Decode-sized projections for Hopper (sm_90), written in Gluon: ``[x @ w.T for w in weights]`` for a few tokens.

Why a second kernel beside ``fused_triton.linear_group_fwd``: a decode step's projections read a whole weight for up
to 8 token rows, so they are bound by the weights' bytes, and Triton's pipelined loop of pointer loads reads them at
0.47-0.58 of the copy bandwidth on an H200 (down 13.4 us for 33.5 MB at 8 tokens). A producer warp keeping the
tensor-memory-accelerator (TMA) copies of the next steps in flight reads them at 0.55-0.74 (``bench/projection_ab.py``:
down 10.6 us, q/k/v 5.4 against 5.8-6.2, o_proj 4.4 against cuBLAS's 6.7; the 1B hybrid's decode step at batch 8,
32k 1.326 -> 1.241 ms with q/k/v and down, 1.202 ms with o_proj too; bench/NOTES.md, fifty-ninth and sixtieth
sessions). ``linear_group_fwd`` runs it only while a CUDA graph is captured: a launch costs ~0.1 ms of host time
(Triton's binding of the call and its TMA descriptors; not profiled on a GPU), which a graph pays once and an eager
step at every call.

One program = ``BLOCK_N`` rows of one weight (programs ``[0, tiles0)`` the first weight, as ``linear_group_fwd``).
Partitions:

* loader (1 warp): per step of ``BLOCK_K`` columns, the weight's ``[BLOCK_N, BLOCK_K]`` box and x's ``[8, BLOCK_K]``
  box (TMA fills rows past ``M``, rows past ``N`` and columns past ``K`` with zeros, so nothing downstream masks) into
  a ring of ``STAGES`` slots. The weight boxes of the first ``STAGES`` steps go out before the wait for the preceding
  kernel (programmatic dependent launch, ``dependent_launch.py``): no kernel writes the weights. x's go out after it.
* ``CONSUMERS`` consumers (1 warp each): each takes ``BLOCK_K / CONSUMERS`` columns of every step,
  ``out^T [BLOCK_N, 8] += w x^T`` as ``mma.sync`` products from shared memory, and frees the slot once its operands
  are in registers. Their float32 sums meet in shared memory at the end.
* the default partition (4 warps, as Gluon requires a multiple of 4) adds the consumers' sums, rounds to the output
  dtype (then, with a residual, adds it in float32 and rounds again: PyTorch's ``residual + x @ w.T``) and stores.

Scope (``supported``): CUDA sm_90, Gluon importable, 16-bit x and weights of one dtype, 1 to 8 tokens, ``K`` a
multiple of 8 and at least 64, rows 16-byte aligned (TMA). ``fused_triton.linear_group_fwd`` takes every other call.
"""

from __future__ import annotations

import functools

import torch

from .dependent_launch import launch_options
from .hopper_fwd import is_sm90
from .triton_setup import next_power_of_2, triton

try:  # Gluon is experimental: its absence (or a changed API) only removes this kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # Triton 3.6 (the GPU machines) names the copy async_copy_global_to_shared, later versions async_load
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the Triton build
    AVAILABLE = False

MAX_TOKENS = 8  # x's box rows: mma.sync's N
CONSUMERS = 4
_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def supported(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether this kernel can run ``linear_group_fwd(x, weights)`` (x ``[M, K]``, weights ``[N_i, K]``, unit column
    strides, as ``fused._decode_rows`` leaves them)."""
    m, k = x.shape
    return (
        AVAILABLE and x.is_cuda and x.dtype in _GL_DTYPES and 1 <= m <= MAX_TOKENS and k >= 64 and k % 8 == 0
        and all(w.dtype == x.dtype for w in weights)
        and all(t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 for t in (x, *weights))  # 16-byte rows
        and is_sm90(x.device)
    )


def launch_shape(k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, STAGES)`` for input width ``k`` (H200 sweep, fifty-ninth session): 32 weight rows with 4
    steps in flight up to K = 4096; beyond, 16 rows with 8 (down's 8192 columns in 128 programs, one an SM). 256
    columns a step (TMA's largest box), fewer for narrower inputs."""
    block_k = min(256, next_power_of_2(k))
    return (32, block_k, 4) if k <= 4096 else (16, block_k, 8)


if AVAILABLE:
    _CONSUMERS = gl.constexpr(CONSUMERS)
    _TOKENS = gl.constexpr(MAX_TOKENS)

    @gluon.jit
    def _grid_dependency(PDL: gl.constexpr):
        """``dependent_launch.wait_for_preceding_kernel`` in Gluon: wait for the kernel before (its writes visible),
        then let the next one launch."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _weight_box(w0_desc, w1_desc, w2_desc, weight, row, col, bar, buf):
        if weight == 0:
            _tma_load(w0_desc, [row, col], bar, buf)
        elif weight == 1:
            _tma_load(w1_desc, [row, col], bar, buf)
        else:
            _tma_load(w2_desc, [row, col], bar, buf)

    @gluon.jit
    def _load_partition(x_desc, w0_desc, w1_desc, w2_desc, x_bufs, w_bufs, ready, free, weight, row, K,
                        PDL: gl.constexpr, STAGES: gl.constexpr):
        BLOCK_K: gl.constexpr = w0_desc.block_type.shape[1]
        STEP_BYTES: gl.constexpr = w0_desc.block_type.nbytes + x_desc.block_type.nbytes
        steps = gl.cdiv(K, BLOCK_K)
        for s in gl.static_range(STAGES):  # the weight's first boxes before the wait: no kernel writes weights
            if s < steps:
                mbarrier.expect(ready.index(s), STEP_BYTES)
                _weight_box(w0_desc, w1_desc, w2_desc, weight, row, s * BLOCK_K, ready.index(s), w_bufs.index(s))
        _grid_dependency(PDL)
        for s in gl.static_range(STAGES):
            if s < steps:
                _tma_load(x_desc, [0, s * BLOCK_K], ready.index(s), x_bufs.index(s))
        for i in range(STAGES, steps):
            slot = i % STAGES
            mbarrier.wait(free.index(slot), ((i // STAGES) & 1) ^ 1)  # the consumers' release of step i - STAGES
            mbarrier.expect(ready.index(slot), STEP_BYTES)
            _weight_box(w0_desc, w1_desc, w2_desc, weight, row, i * BLOCK_K, ready.index(slot), w_bufs.index(slot))
            _tma_load(x_desc, [0, i * BLOCK_K], ready.index(slot), x_bufs.index(slot))

    @gluon.jit
    def _product_partition(x_bufs, w_bufs, ready, free, sums, K, part: gl.constexpr, STAGES: gl.constexpr):
        """Consumer ``part``: its columns of every step, ``[BLOCK_N, 8]`` float32, written to ``sums``' rows
        ``[part * BLOCK_N, (part + 1) * BLOCK_N)``."""
        BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = w_bufs.type.shape[2]
        COLS: gl.constexpr = BLOCK_K // _CONSUMERS
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        acc = gl.zeros([BLOCK_N, _TOKENS], gl.float32, mma)
        for i in range(gl.cdiv(K, BLOCK_K)):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            w = w_bufs.index(slot).slice(part * COLS, COLS, dim=1).load(w_layout)  # [BLOCK_N, COLS]
            x_t = x_bufs.index(slot).slice(part * COLS, COLS, dim=1).permute((1, 0)).load(x_layout)  # [COLS, 8]
            mbarrier.arrive(free.index(slot), count=1)
            acc = mma_v2(w, x_t, acc)
        sums.slice(part * BLOCK_N, BLOCK_N, dim=0).store(acc)

    @gluon.jit
    def _idle_default_partition():
        """The kernel's own 4 warps have nothing to do until the partitions join (then they add the sums)."""

    @gluon.jit
    def skinny_linear_ws_kernel(x_desc, w0_desc, w1_desc, w2_desc, o0, o1, o2, r0, M, N0, N1, N2, K, tiles0, tiles01,
                                stride_o0, stride_o1, stride_o2, stride_r0, ADD_RESIDUAL: gl.constexpr,
                                STAGES: gl.constexpr, PDL: gl.constexpr):
        """Grid ``(tiles of all weights,)``; outputs ``o_i [M, N_i]`` (``r0 [M, N0]`` added to ``o0`` with
        ``ADD_RESIDUAL``). Unused weight slots repeat the first weight's descriptor; no program reads them."""
        BLOCK_N: gl.constexpr = w0_desc.block_type.shape[0]
        pid = gl.program_id(0)
        weight = gl.where(pid < tiles0, 0, gl.where(pid < tiles01, 1, 2))
        tile = pid - gl.where(pid < tiles0, 0, gl.where(pid < tiles01, tiles0, tiles01))
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w0_desc.dtype, [STAGES] + w0_desc.block_type.shape, w0_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        sums = gl.allocate_shared_memory(gl.float32, [_CONSUMERS * BLOCK_N, _TOKENS],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(free.index(s), count=_CONSUMERS)
        gl.warp_specialize(
            [
                (_idle_default_partition, ()),
                (_load_partition, (x_desc, w0_desc, w1_desc, w2_desc, x_bufs, w_bufs, ready, free, weight,
                                   tile * BLOCK_N, K, PDL, STAGES)),
                (_product_partition, (x_bufs, w_bufs, ready, free, sums, K, 0, STAGES)),
                (_product_partition, (x_bufs, w_bufs, ready, free, sums, K, 1, STAGES)),
                (_product_partition, (x_bufs, w_bufs, ready, free, sums, K, 2, STAGES)),
                (_product_partition, (x_bufs, w_bufs, ready, free, sums, K, 3, STAGES)),
            ],
            [1, 1, 1, 1, 1],
            [40, 160, 160, 160, 160],
        )
        # the partitions have joined: every consumer's sums are in shared memory
        layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])
        acc = gl.zeros([BLOCK_N, _TOKENS], gl.float32, layout)
        for c in gl.static_range(_CONSUMERS):
            acc += sums.slice(c * BLOCK_N, BLOCK_N, dim=0).load(layout)
        _grid_dependency(PDL)  # returns at once (the loader waited before any x came): this partition's own
        # wait, so that its stores follow the preceding kernel's end in its own program order too
        cols = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))  # [BLOCK_N] output columns
        tokens = gl.arange(0, _TOKENS, layout=gl.SliceLayout(0, layout))
        if weight == 0:
            inside = (cols[:, None] < N0) & (tokens[None, :] < M)
            out = acc.to(o0.dtype.element_ty)
            if ADD_RESIDUAL:
                residual = gl.load(r0 + tokens[None, :] * stride_r0 + cols[:, None], mask=inside, other=0.0)
                out = (out.to(gl.float32) + residual.to(gl.float32)).to(o0.dtype.element_ty)
            gl.store(o0 + tokens[None, :] * stride_o0 + cols[:, None], out, mask=inside)
        elif weight == 1:
            inside = (cols[:, None] < N1) & (tokens[None, :] < M)
            gl.store(o1 + tokens[None, :] * stride_o1 + cols[:, None], acc.to(o1.dtype.element_ty), mask=inside)
        else:
            inside = (cols[:, None] < N2) & (tokens[None, :] < M)
            gl.store(o2 + tokens[None, :] * stride_o2 + cols[:, None], acc.to(o2.dtype.element_ty), mask=inside)


@functools.cache
def _box_layout(rows: int, cols: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], getattr(gl, _GL_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    return GluonTensorDescriptor(t, list(t.shape), list(t.stride()), [rows, cols], _box_layout(rows, cols, t.dtype))


def linear_group(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor],
                 residual: torch.Tensor | None) -> None:
    """``outs[i] = x @ weights[i].T`` (``outs[0] = residual + x @ weights[0].T`` with ``residual``), for calls
    ``supported`` accepts; ``outs`` as ``linear_group_fwd`` allocates them."""
    m, k = x.shape
    block_n, block_k, stages = launch_shape(k)
    num_tiles = [triton.cdiv(w.shape[0], block_n) for w in weights]
    w_descs = [_descriptor(w, block_n, block_k) for w in weights]
    slot_descs = [*w_descs, *[w_descs[0]] * (3 - len(weights))]
    slot_outs = [*outs, *[outs[0]] * (3 - len(outs))]
    n = [w.shape[0] for w in weights] + [0] * (3 - len(weights))
    options = launch_options(x.device)
    skinny_linear_ws_kernel[(sum(num_tiles),)](
        _descriptor(x, MAX_TOKENS, block_k), *slot_descs, *slot_outs, outs[0] if residual is None else residual,
        m, *n, k, num_tiles[0], sum(num_tiles[:2]), *(o.stride(0) for o in slot_outs),
        0 if residual is None else residual.stride(0), ADD_RESIDUAL=residual is not None, STAGES=stages,
        num_warps=4, **options,
    )
