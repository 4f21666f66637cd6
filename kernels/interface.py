"""``s2_attention``: the one public entry point. Validates, resolves the sparsity, unpads, and dispatches.

``s2_attention`` checks what the shapes tell, then calls the custom op ``s2::attention`` through ``AttentionFunction``
(an ``autograd.Function`` whose backward calls the custom op ``s2::attention_backward``), so that
``torch.compile(fullgraph=True)`` traces each op as one opaque node with a fake (meta) implementation. Everything that
reads data on the host (the ``cu_seqlens``, the padding mask, the block lists the kernels build and cache) happens
inside the ops.

Backends (``torch_impl``: ``s2_attention_torch`` / ``s2_attention_torch_bwd``; ``triton_impl``: the launchers
``s2_attention_fwd`` / ``s2_attention_bwd``) share one contract::

    out, lse = forward(q, k, v, layout, scale, varlen)
    dq, dk, dv = backward(q, k, v, out, lse, dout, dlse, layout, scale, varlen)   # dlse may be None
    # q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (any strides); varlen: B == 1 and ``varlen`` holds cu_seqlens
    # out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] float32 (float64 for float64 inputs; natural log, -inf
    # for rows that see nothing)

Queries are bottom-right aligned per sequence.
Only torch is imported here: Triton is imported on first use, so this file also runs where Triton is absent.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .layouts import BlockLayout, Varlen, as_heads_last, empty_heads_last
from .pattern import DENSE_PATTERN, S2Pattern, check_block_size

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: PyTorch path only
BACKENDS = ("auto", "triton", "torch")
# Device types with an autocast mode, looked up once: torch.amp.is_autocast_available is a graph break for dynamo
# (torch 2.11).
AUTOCAST_DEVICE_TYPES = tuple(t for t in ("cpu", "cuda", "xpu", "mps", "hpu") if torch.amp.is_autocast_available(t))


def s2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: S2Pattern | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    block_mask: torch.Tensor | None = None,
    block_size: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    attention_mask: torch.Tensor | None = None,
):
    """Block-sparse S2 attention.

    Args:
        q: ``[B, Hq, Tq, D]``. k, v: ``[B, Hkv, Tk, D]`` with ``Hq % Hkv == 0`` (GQA is native: no copies).
            fp16, bf16 or fp32 (float64 on the PyTorch path), one dtype and device for all three; ``D`` in 16..256,
            a multiple of 16. Any strides.
        pattern: an ``S2Pattern``; pattern heads are KV heads (``per_query_head=False``) or query heads.
        causal: causal (default) or bidirectional. Queries are bottom-right aligned: query ``t`` sits at absolute
            position ``Tk - Tq + t`` (decode, chunked prefill), so ``Tq <= Tk`` is required.
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` (on CPU only with ``TRITON_INTERPRET=1``)
            or ``"torch"`` (exact, sparse, autograd-capable PyTorch path).
        return_lse: also return the row log-sum-exp ``[B, Hq, Tq]`` (float32, float64 for float64; natural log).
        block_mask: instead of ``pattern``, any per-head mask ``bool [P, M, N]`` (or ``[M, N]``) over absolute
            blocks of ``block_size`` tokens; ``P`` divides ``Hq``; ``M, N >= cdiv(Tk, block_size)``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: packed variable-length batch as in flash-attn's
            varlen API, with ``B == 1``: q ``[1, Hq, total_q, D]``. The pattern restarts at each sequence's start.
        attention_mask: ``[B, Tk]`` key padding mask (1/True = real token), padding anywhere (left, right, holes);
            a row's real tokens are one sequence: positions count real tokens only, the pattern is anchored at the
            first. Rows of padded queries return 0 (and lse ``-inf``).

    Returns:
        ``out [B, Hq, Tq, D]``, or ``(out, lse)`` with ``return_lse=True``.

    The kept blocks of pattern head ``h``, query block ``i``, key block ``j`` (see ``S2Pattern``)::

        causal:      j <= i  and  (i - j < local_blocks  or  (j + h * step + head_sliding_offset) % vert_stride == 0)
        bidirectional:        |i - j| < local_blocks  or  (j + h * step + head_sliding_offset) % vert_stride == 0
    """
    _check_tensors(q, k, v)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    scale = check_scale(scale, q.shape[-1])

    if attention_mask is not None and cu_seqlens_q is not None:
        raise ValueError("pass either attention_mask (padded batch) or cu_seqlens_q/cu_seqlens_k (packed), not both")
    if cu_seqlens_q is None and cu_seqlens_k is None and q.shape[2] > k.shape[2]:
        raise ValueError(
            f"the query length Tq={q.shape[2]} must be <= the key length Tk={k.shape[2]} (queries are bottom-right "
            "aligned to the keys)"
        )
    if (pattern is None) == (block_mask is None):
        raise ValueError("pass exactly one of pattern (an S2Pattern) or block_mask (with block_size)")
    if pattern is not None and not isinstance(pattern, S2Pattern):
        raise ValueError(f"pattern must be an S2Pattern, got {type(pattern).__name__}")
    check_backend(backend)  # the rest of the backend's checks (device, Triton) run inside the op
    _check_op_argument_types(block_mask, block_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             attention_mask)
    # Dynamo cannot trace an autograd.Function given one tensor in two inputs: a repeated q/k/v is passed as a view
    # (autograd adds the gradients up in the base), shared offsets once (a new view of them would defeat the
    # host-read memo, which knows tensors by identity).
    if k is q:
        k = k.view_as(k)
    if v is q or v is k:
        v = v.view_as(v)
    offsets_shared = cu_seqlens_k is cu_seqlens_q is not None
    return AttentionFunction.apply(
        q, k, v, return_lse, None if pattern is None else pattern_to_ints(pattern), block_mask, block_size, causal,
        scale, backend, cu_seqlens_q, None if offsets_shared else cu_seqlens_k, offsets_shared, max_seqlen_q,
        max_seqlen_k, attention_mask,
    )


# ---------------------------------------------------------------------------------------------- dense layers
# Over a KV cache (Tq != Tk: decode steps, speculative verify chunks) the key length changes every call, and cuDNN
# builds a new execution plan for every new shape (~20 ms on an H100, more than the whole step); FlashAttention and
# the memory-efficient kernel have no such cost. Masked or not: a verify chunk's mask gives cuDNN a new shape too.
_CACHED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def dense_attention(query, key, value, scale, dropout=0.0, key_padding_mask=None, cu_seqlens_q=None,
                    cu_seqlens_k=None):
    """Causal dense attention through SDPA, queries bottom-right aligned; same inputs as ``s2_attention``.

    ``query [B, Hq, Tq, D]``, ``key/value [B, Hkv, Tk, D]`` -> ``[B, Hq, Tq, D]``. Rows of padded queries are 0.
    Packed sequences (``cu_seqlens_*``, ``B == 1``) run the S2 op with a pattern that keeps every block: a varlen
    FlashAttention, with no block-diagonal mask and no host sync outside the op (it has no dropout).
    """
    if cu_seqlens_q is not None:
        if dropout:
            raise ValueError(f"packed sequences run without attention dropout, got dropout={dropout}")
        return s2_attention(query, key, value, DENSE_PATTERN, scale=scale, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_k=cu_seqlens_k)
    over_cache = query.shape[2] != key.shape[2]
    with sdpa_kernel(_CACHED_SDPA_BACKENDS) if over_cache else contextlib.nullcontext():
        return _dense_sdpa(query, key, value, scale, dropout, key_padding_mask)


def _dense_sdpa(query, key, value, scale, dropout, key_padding_mask):
    tq, tk = query.shape[2], key.shape[2]
    if key_padding_mask is None and (tq == tk or tq == 1):
        # Unmasked: FlashAttention-class kernels on CUDA (a single query sees every key).
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scale, is_causal=tq > 1,
            enable_gqa=query.shape[1] != key.shape[1]
        )
    q_pos = torch.arange(tk - tq, tk, device=query.device)
    mask = (torch.arange(tk, device=query.device) <= q_pos[:, None])[None, None]  # [1, 1, Tq, Tk]
    real_q = None
    if key_padding_mask is not None:
        real_k = key_padding_mask.to(device=query.device, dtype=torch.bool)
        real_q = real_k[:, tk - tq :, None, None].transpose(1, 2)  # [B, 1, Tq, 1]
        # A padded query sees no key; let it see all (its row is zeroed below) so no softmax row is empty.
        mask = (mask & real_k[:, None, None, :]) | ~real_q
    groups = query.shape[1] // key.shape[1]  # masked SDPA with enable_gqa falls back to the math kernel on CUDA
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out if real_q is None else out.masked_fill(~real_q, 0.0)


# ---------------------------------------------------------------------------------------------- validation
def _check_tensors(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, T, D], got {getattr(t, 'shape', type(t))}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"head dims of q, k, v must be equal, got {d}, {k.shape[-1]}, {v.shape[-1]}")
    if d < 16 or d > 256 or d % 16:
        raise ValueError(f"head dim D must be a multiple of 16 in [16, 256], got {d}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"the query heads Hq={hq} must be a multiple of the KV heads Hkv={hkv}")


def _check_op_argument_types(block_mask, block_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             attention_mask) -> None:
    """The types the op's schema takes (its values are checked inside it): a ValueError naming the argument rather
    than PyTorch's schema error, or a bool silently read as an int."""
    for name, value in (("block_mask", block_mask), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                        ("attention_mask", attention_mask)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor or None, got {type(value).__name__}")
    for name, value in (("block_size", block_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an int or None, got {value!r}")


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``head_dim ** -0.5`` for ``None``, else a finite positive number."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return float(scale)


class HostReadMemo:
    """A one-entry memo of what a call reads from device tensors to the host (a device sync each time).

    A model hands the same offset or padding-mask tensors to every layer, in the forward, the recomputed
    (checkpointed) forward and the backward: 36 calls a training step at 12 layers. Each read waits for the GPU to
    drain its queue, and the GPU then idles while the host launches what follows. The same tensor objects, alive and
    not written in place since (their version counters; PyTorch bumps them at every in-place operation), hold the
    same values, so their result is reused. Inference tensors have no version counter and are read every time; a
    write that bypasses PyTorch (a custom kernel writing through the tensor's pointer) is not seen.
    """

    def __init__(self):
        self._entry = None  # (weak references to the tensors, their versions and the call's key, the result)

    def get(self, tensors: tuple[torch.Tensor, ...], key: tuple, read):
        """``read()``, or its result for the last call with these tensor objects (unchanged) and ``key``."""
        if any(t.is_inference() for t in tensors):
            return read()
        stamp = (tuple((t._version, t.data_ptr()) for t in tensors), key)
        entry = self._entry
        if entry is not None and entry[1] == stamp and all(ref() is t for ref, t in zip(entry[0], tensors)):
            return entry[2]
        result = read()  # raises on bad values: nothing is kept
        self._entry = (tuple(weakref.ref(t) for t in tensors), stamp, result)
        return result


_VARLEN_READS = HostReadMemo()
_PADDING_READS = HostReadMemo()


def _check_varlen(q, k, cu_q, cu_k, max_q, max_k) -> Varlen:
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if q.shape[0] != 1:
        raise ValueError(f"packed (cu_seqlens) inputs must have batch size 1, got B={q.shape[0]}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        is_offsets = isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.dtype in (torch.int32, torch.int64)
        if not is_offsets or cu.numel() < 2:
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor of S + 1 >= 2 offsets, got {cu!r}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_q.numel()} and {cu_k.numel()}"
        )
    key = (q.shape[2], k.shape[2], str(q.device))
    varlen = _VARLEN_READS.get((cu_q, cu_k), key, lambda: _read_varlen(cu_q, cu_k, q.shape[2], k.shape[2], q.device))
    for name, given, actual in (("max_seqlen_q", max_q, varlen.max_seqlen_q),
                                ("max_seqlen_k", max_k, varlen.max_seqlen_k)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < actual):
            raise ValueError(f"{name} must be an int >= the longest sequence ({actual}), got {given!r}")
    return varlen


def _read_varlen(cu_q, cu_k, total_q: int, total_k: int, device) -> Varlen:
    """The offsets read to the host and checked; the ``Varlen`` of their non-empty sequences."""
    # Sequences empty in both q and k (a compiled model's fixed-size offsets are mostly those) are dropped on the
    # device, so only the real offsets reach the host (all empty: one empty sequence stays).
    real = (cu_q[1:] != cu_q[:-1]) | (cu_k[1:] != cu_k[:-1])
    real[-1] |= ~real.any()
    keep = torch.cat([real.new_ones(1), real])
    cu_q, cu_k = cu_q[keep], cu_k[keep]
    checked = []
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        host = cu.tolist()
        if host[0] != 0 or host[-1] != total or any(b < a for a, b in zip(host, host[1:])):
            raise ValueError(
                f"{name} must start at 0, never decrease, and end at the packed length {total}; got {host}"
            )
        checked.append(host)
    host_q, host_k = checked
    lens_q = [b - a for a, b in zip(host_q, host_q[1:])]
    lens_k = [b - a for a, b in zip(host_k, host_k[1:])]
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq > lk:
            raise ValueError(f"sequence {s}: query length {lq} must be <= key length {lk} (bottom-right aligned)")
    return Varlen(
        cu_seqlens_q=cu_q.to(device=device, dtype=torch.int32),
        cu_seqlens_k=cu_k.to(device=device, dtype=torch.int32),
        max_seqlen_q=max(lens_q),
        max_seqlen_k=max(lens_k),
        equal_lengths=lens_q == lens_k,
    )


def bucket_num_blocks(num_blocks: int) -> int:
    """Round a block count up to one of ~8 sizes per doubling (at most 12.5% more; powers of two stay exact).

    Masks and the block lists built from them are cached per size: with lengths that change every call (packed
    training batches, prompts of any length) exact sizes would fill the caches without bound. Blocks past a
    sequence's end are masked like the tail of a shorter sequence in a packed batch.
    """
    num_blocks = max(1, num_blocks)
    step = 1 << max(0, num_blocks.bit_length() - 4)
    return -(-num_blocks // step) * step


def _resolve_layout(q, k, pattern, block_mask, block_size, causal, max_seqlen_k) -> BlockLayout:
    hq, hkv = q.shape[1], k.shape[1]
    if pattern is not None:
        if block_size is not None and block_size != pattern.block_size:
            raise ValueError(f"block_size={block_size} contradicts pattern.block_size={pattern.block_size}")
        num_heads = pattern.num_pattern_heads(hq, hkv)
        n = bucket_num_blocks(-(-max_seqlen_k // pattern.block_size))
        mask = pattern.shared_block_mask(num_heads, n, n, causal, device=q.device)
        return BlockLayout(mask, pattern.block_size, causal, (pattern, num_heads, n, causal, str(q.device)))

    check_block_size(block_size)
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool or block_mask.dim() not in (2, 3):
        got = getattr(block_mask, "shape", block_mask)
        raise ValueError(f"block_mask must be a bool tensor [P, M, N] or [M, N], got {got!r}")
    if block_mask.dim() == 2:
        block_mask = block_mask[None]
    p, m, n = block_mask.shape
    need = -(-max_seqlen_k // block_size)
    if p < 1 or hq % p:
        raise ValueError(f"block_mask has P={p} pattern heads; P must divide the query heads Hq={hq}")
    if m < need or n < need:
        raise ValueError(
            f"block_mask of shape {tuple(block_mask.shape)} does not fit: "
            f"M and N must be >= cdiv(Tk, block_size) = {need}"
        )
    if block_mask.device != q.device:
        raise ValueError(f"block_mask must be on the device of q ({q.device}), got {block_mask.device}")
    return BlockLayout(block_mask, block_size, causal, None)


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def use_triton(backend: str, q: torch.Tensor) -> bool:
    """Whether ``backend`` runs Triton for inputs like ``q`` (``"auto"``: on CUDA); refuses what Triton can't run."""
    check_backend(backend)
    if not (backend == "triton" or (backend == "auto" and q.is_cuda)):
        return False
    if q.dtype == torch.float64:
        raise ValueError('backend="triton" supports float16, bfloat16 and float32; float64 runs on backend="torch"')
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('backend="triton" needs CUDA tensors (or TRITON_INTERPRET=1 to interpret on the CPU)')
    return True


def capturing_cuda_graph(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CUDA tensor and the current stream is capturing a CUDA graph (a static cache's decode
    step): the launches made now are replayed, so their host time is paid once."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _select_backend(backend: str, q: torch.Tensor):
    """The ``(forward, backward)`` functions of the backend that runs inputs like ``q``."""
    if not use_triton(backend, q):
        from .torch_impl import s2_attention_torch, s2_attention_torch_bwd

        return s2_attention_torch, s2_attention_torch_bwd
    try:
        from .triton_impl import s2_attention_bwd, s2_attention_fwd
    except ImportError as e:  # no Triton on this machine
        raise ValueError(f'backend="triton" needs Triton, which failed to import: {e}') from e
    return s2_attention_fwd, s2_attention_bwd


# ---------------------------------------------------------------------------------------------- padding
def padding_to_varlen(attention_mask: torch.Tensor, q_len: int):
    """Turn a ``[B, Tk]`` padding mask (padding anywhere: left, right, holes) into packing indices.

    Returns ``(q_index, k_index, varlen)``: flat indices into ``[B * Tq]`` / ``[B * Tk]`` of the real query and key
    rows, and the ``Varlen`` of the packed batch. Query ``t`` of row ``b`` is the token at index ``Tk - Tq + t``;
    it is real iff that key is. A row's real tokens form one packed sequence, so a token's position is the number of
    real tokens before it (padding in a hole is skipped, as if it were not there).
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        got = getattr(attention_mask, "shape", attention_mask)
        raise ValueError(f"attention_mask must be a [B, Tk] tensor, got {got!r}")
    real = attention_mask.bool()
    tk = real.shape[1]
    counts = real.sum(-1)
    real_q = real[:, tk - q_len :]
    k_index = real.flatten().nonzero().squeeze(-1)
    q_index = real_q.flatten().nonzero().squeeze(-1)
    zero = torch.zeros(1, dtype=torch.int32, device=real.device)
    lens_q, lens_k = real_q.sum(-1), counts
    varlen = Varlen(
        cu_seqlens_q=torch.cat([zero, lens_q.cumsum(0).int()]),
        cu_seqlens_k=torch.cat([zero, lens_k.cumsum(0).int()]),
        max_seqlen_q=int(lens_q.max()),
        max_seqlen_k=int(lens_k.max()),
        equal_lengths=q_len == tk,
    )
    return q_index, k_index, varlen


def _pack_rows(x, index):
    """``[B, H, T, *E] -> [1, H, n, *E]``: the rows ``index`` of the flattened ``B * T`` rows (``None`` stays)."""
    return None if x is None else x.transpose(1, 2).flatten(0, 1)[index].transpose(0, 1).unsqueeze(0)


def _unpack_rows(x, index, batch, length, fill):
    """Inverse of ``_pack_rows``: ``[1, H, n, *E] -> [B, H, T, *E]``, every other row ``fill``."""
    rows = x[0].transpose(0, 1)  # [n, H, *E]
    full = rows.new_full((batch * length, *rows.shape[1:]), fill).index_copy(0, index, rows)
    return full.view(batch, length, *rows.shape[1:]).transpose(1, 2)


def _padding_plan(q, k, attention_mask):
    """``None`` if every key is real, else ``padding_to_varlen``'s ``(q_index, k_index, varlen)`` (memoized)."""
    b, tk = k.shape[0], k.shape[2]
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (b, tk):
        got = list(getattr(attention_mask, "shape", [attention_mask]))
        raise ValueError(f"attention_mask must have shape [B, Tk] = {[b, tk]}, got {got}")

    def read():
        return None if bool(attention_mask.all()) else padding_to_varlen(attention_mask.to(q.device), q.shape[2])

    return _PADDING_READS.get((attention_mask,), (q.shape[2], str(q.device)), read)


def _run_padded(run, q, k, v, layout, scale, padding):
    """``run`` (a backend's forward) on the real tokens of a padded batch (``padding``: ``_padding_plan``'s);
    padded query rows give 0 (lse -inf)."""
    q_index, k_index, varlen = padding
    out, lse = run(_pack_rows(q, q_index), _pack_rows(k, k_index), _pack_rows(v, k_index), layout, scale, varlen)
    b, tq = q.shape[0], q.shape[2]
    return _unpack_rows(out, q_index, b, tq, 0.0), _unpack_rows(lse, q_index, b, tq, -math.inf)


def _run_padded_backward(run_backward, q, k, v, out, lse, dout, dlse, layout, scale, padding):
    """``run_backward`` (a backend's backward) on the real tokens; padding gets zero gradients."""
    q_index, k_index, varlen = padding
    at_q, at_k = (lambda x: _pack_rows(x, q_index)), (lambda x: _pack_rows(x, k_index))
    dq, dk, dv = run_backward(at_q(q), at_k(k), at_k(v), at_q(out), at_q(lse), at_q(dout), at_q(dlse), layout, scale,
                              varlen)
    b, tq, tk = q.shape[0], q.shape[2], k.shape[2]
    return _unpack_rows(dq, q_index, b, tq, 0.0), _unpack_rows(dk, k_index, b, tk, 0.0), _unpack_rows(dv, k_index, b,
                                                                                                   tk, 0.0)


# ---------------------------------------------------------------------------------------------- custom ops
# The package's ops live in the namespace "s2"; a checkpoint's flat copy of these files (trust_remote_code) gets a
# namespace of its own, so loading one never replaces the installed package's ops (and re-loading one redefines
# only its own).
OP_NAMESPACE = "s2" if __package__ == "s2_models.kernels" else "s2_" + re.sub(r"\W", "_", __package__ or "flat")
_PATTERN_FIELDS = S2Pattern.field_names()


def pattern_to_ints(pattern: S2Pattern) -> list[int]:
    """An ``S2Pattern`` as the op argument ``int[]``: its fields in order, ``None`` as 0, bools as 0/1."""
    return [int(getattr(pattern, name) or 0) for name in _PATTERN_FIELDS]


@functools.lru_cache(maxsize=64)
def pattern_from_ints(values: tuple[int, ...]) -> S2Pattern:
    """Inverse of ``pattern_to_ints``."""
    fields = dict(zip(_PATTERN_FIELDS, values))
    fields["homo_head"], fields["per_query_head"] = bool(fields["homo_head"]), bool(fields["per_query_head"])
    fields["head_sliding_step"] = fields["head_sliding_step"] or None
    return S2Pattern(**fields)


def _resolve_call(q, k, pattern, block_mask, block_size, causal, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, attention_mask):
    """The host-side part of a call (inside the ops): ``(layout, varlen, padding, (forward, backward))``, where
    ``padding`` is ``_padding_plan``'s (``None``: nothing padded, no packing)."""
    varlen = padding = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        varlen = _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if attention_mask is not None:
        padding = _padding_plan(q, k, attention_mask)
    max_seqlen_k = varlen.max_seqlen_k if varlen is not None else k.shape[2]
    pattern = None if pattern is None else pattern_from_ints(tuple(pattern))
    layout = _resolve_layout(q, k, pattern, block_mask, block_size, causal, max_seqlen_k)
    return layout, varlen, padding, _select_backend(backend, q)


@torch.library.custom_op(f"{OP_NAMESPACE}::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: list[int] | None, block_mask: torch.Tensor | None,
    block_size: int | None, causal: bool, scale: float, backend: str, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s2_attention``'s arguments (pattern as ``pattern_to_ints``) -> ``(out [B, Hq, Tq, D], lse [B, Hq, Tq])``;
    out stored ``[B, Tq, Hq, D]`` (``empty_heads_last``: what a model reads back without a copy), lse contiguous.
    Differentiable through ``AttentionFunction`` (``s2_attention``), not on its own."""
    layout, varlen, padding, (forward, _) = _resolve_call(
        q, k, pattern, block_mask, block_size, causal, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, attention_mask,
    )
    if padding is not None:
        out, lse = _run_padded(forward, q, k, v, layout, scale, padding)
    else:
        out, lse = forward(q, k, v, layout, scale, varlen)
    return as_heads_last(out), lse.contiguous()


@attention_op.register_fake
def _attention_fake(q, k, v, *args):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return empty_heads_last(q), q.new_empty(q.shape[:3], dtype=lse_dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, pattern: list[int] | None, block_mask: torch.Tensor | None,
    block_size: int | None, causal: bool, scale: float, backend: str, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``attention_op`` with respect to q, k, v (stored ``[B, T, H, D]``, as q, k, v usually are);
    ``dlse`` ``None`` when lse is unused."""
    layout, varlen, padding, (_, backward) = _resolve_call(
        q, k, pattern, block_mask, block_size, causal, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, attention_mask,
    )
    if padding is not None:
        grads = _run_padded_backward(backward, q, k, v, out, lse, dout, dlse, layout, scale, padding)
    else:
        grads = backward(q, k, v, out, lse, dout, dlse, layout, scale, varlen)
    return tuple(as_heads_last(grad) for grad in grads)


@attention_backward_op.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, *args):
    return empty_heads_last(q), empty_heads_last(k), empty_heads_last(v)


class AttentionFunction(torch.autograd.Function):
    """``attention_op`` with its gradient from ``attention_backward_op``: ``apply(q, k, v, return_lse, *arguments)``,
    ``arguments`` those of ``attention_op`` after q, k, v, but for ``cu_seqlens_k``: ``None, True`` where it is
    ``cu_seqlens_q`` itself, else ``cu_seqlens_k, False``. Returns ``out``, or ``(out, lse)`` with ``return_lse``.

    Why not ``attention_op.register_autograd``: torch's generated autograd path rebuilds the op's 14 arguments from
    its schema on every call with grad (``torch._library.utils.fill_defaults``, quadratic in the argument count):
    ~55 us a call on the CPU machine, a tenth of a whole forward and backward's host path there with the kernels
    stubbed out (bench/NOTES.md, forty-third session).
    Dynamo traces this function (its forward and backward hold the two opaque ops). Without ``return_lse`` the backward
    gets no lse gradient, so the kernels skip reading one; ``set_materialize_grads`` (which would give ``None`` for an
    unused lse in the other case too) does not trace.
    """

    @staticmethod
    def forward(ctx, q, k, v, return_lse, pattern, block_mask, block_size, causal, scale, backend, cu_seqlens_q,
                cu_seqlens_k, offsets_shared, max_seqlen_q, max_seqlen_k, attention_mask):
        out, lse = attention_op(q, k, v, pattern, block_mask, block_size, causal, scale, backend, cu_seqlens_q,
                                cu_seqlens_q if offsets_shared else cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                attention_mask)
        ctx.save_for_backward(q, k, v, out, lse, block_mask, cu_seqlens_q, cu_seqlens_k, attention_mask)
        ctx.options = (pattern, block_size, causal, scale, backend, offsets_shared, max_seqlen_q, max_seqlen_k)
        return (out, lse) if return_lse else out

    @staticmethod
    def backward(ctx, dout, *dlse):
        q, k, v, out, lse, block_mask, cu_seqlens_q, cu_seqlens_k, attention_mask = ctx.saved_tensors
        pattern, block_size, causal, scale, backend, offsets_shared, max_seqlen_q, max_seqlen_k = ctx.options
        # The backward runs in the forward's dtypes: an autocast region around loss.backward() (common in training
        # loops) must not turn the PyTorch path's float32 math into 16-bit matmuls.
        with torch.autocast(q.device.type, enabled=False) if q.device.type in AUTOCAST_DEVICE_TYPES else (
            contextlib.nullcontext()
        ):
            dq, dk, dv = attention_backward_op(
                dout, dlse[0] if dlse else None, q, k, v, out, lse, pattern, block_mask, block_size, causal, scale,
                backend, cu_seqlens_q, cu_seqlens_q if offsets_shared else cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                attention_mask,
            )
        return dq, dk, dv, *(None for _ in range(13))
