"""Naive reference: dense attention with the S2 token mask, in any precision (float64 for tests).

Quadratic in memory and time; for tests only.
"""

from __future__ import annotations

import math

import torch

from .interface import padding_to_varlen
from .layouts import BlockLayout, Varlen
from .pattern import S2Pattern, token_mask


def naive_s2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: S2Pattern | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_mask: torch.Tensor | None = None,
    block_size: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """Same arguments and alignment rules as ``s2_attention``; returns ``(out, lse)`` computed in ``dtype``.

    ``out`` is in ``dtype`` (not cast back), ``lse`` is ``[B, Hq, Tq]`` (``-inf`` and a zero output for rows that
    see no key). The computation is differentiable.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if pattern is not None:
        block_size = pattern.block_size
        tk = k.shape[2] if cu_seqlens_k is None else int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        n = max(1, -(-tk // block_size))
        num_heads = pattern.num_pattern_heads(q.shape[1], k.shape[1])
        block_mask = pattern.block_mask(num_heads, n, n, causal)
    elif block_mask.dim() == 2:
        block_mask = block_mask[None]
    layout = BlockLayout(block_mask.cpu(), block_size, causal, None)

    if attention_mask is not None:
        b, hq, tq, d = q.shape
        q_index, k_index, varlen = padding_to_varlen(attention_mask.cpu(), tq)
        flat = lambda x: x.transpose(1, 2).flatten(0, 1)  # noqa: E731  [B*T, H, D]
        out = q.new_zeros(b * tq, hq, d)
        lse = q.new_full((b * tq, hq), -math.inf)
        packed = [flat(x)[i].transpose(0, 1)[None] for x, i in ((q, q_index), (k, k_index), (v, k_index))]
        o, s = _naive_varlen(*packed, layout, scale, varlen)
        out = out.index_copy(0, q_index.to(q.device), o[0].transpose(0, 1))
        lse = lse.index_copy(0, q_index.to(q.device), s[0].transpose(0, 1))
        return out.view(b, tq, hq, d).transpose(1, 2), lse.view(b, tq, hq).transpose(1, 2)
    if cu_seqlens_q is not None:
        varlen = Varlen(cu_seqlens_q.cpu(), cu_seqlens_k.cpu(), 0, 0)
        return _naive_varlen(q, k, v, layout, scale, varlen)
    return _naive_dense(q, k, v, layout, scale)


def _naive_varlen(q, k, v, layout, scale, varlen):
    outs, lses = [], []
    cq, ck = varlen.cu_seqlens_q.tolist(), varlen.cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        keys = slice(ck[s], ck[s + 1])
        out, lse = _naive_dense(q[:, :, cq[s] : cq[s + 1]], k[:, :, keys], v[:, :, keys], layout, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _naive_dense(q, k, v, layout: BlockLayout, scale):
    # q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D]
    hq, tq, tk = q.shape[1], q.shape[2], k.shape[2]
    mask = token_mask(layout.block_mask, layout.block_size, tq, tk, layout.causal)  # [P, Tq, Tk]
    mask = mask.repeat_interleave(hq // mask.shape[0], dim=0).to(q.device)  # [Hq, Tq, Tk]
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Tq]
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, 0.0)[..., None])
    return probs @ v, lse
