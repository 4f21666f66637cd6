"""Exact, sparse PyTorch path of ``s2_attention`` (CPU, or any device without Triton).

Memory is proportional to the kept blocks, not to T^2: for every query block it gathers only the key blocks its
pattern keeps (padded to the longest list of the chunk), in chunks of query blocks. Autograd-capable through
plain torch ops. Math in float32 (float64 inputs stay float64). Self-contained: copied flat into checkpoints.
"""

from __future__ import annotations

import math

import torch

from .layouts import BlockLayout, Varlen

# Upper bound on score elements materialized per chunk of query blocks (float32: 4 bytes each).
_MAX_SCORE_ELEMENTS = 1 << 25


def s2_attention_torch(q, k, v, layout: BlockLayout, scale: float, varlen: Varlen | None):
    """Backend contract of ``interface.py``: returns ``(out [B, Hq, Tq, D], lse [B, Hq, Tq] float32)``."""
    if varlen is None:
        return _attend(q, k, v, layout, scale)
    outs, lses = [], []
    cu_q, cu_k = varlen.cu_seqlens_q.tolist(), varlen.cu_seqlens_k.tolist()
    for s in range(varlen.num_seqs):
        keys = slice(cu_k[s], cu_k[s + 1])
        out, lse = _attend(q[:, :, cu_q[s] : cu_q[s + 1]], k[:, :, keys], v[:, :, keys], layout, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _attend(q, k, v, layout: BlockLayout, scale: float):
    # q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D]
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if tq == 0 or tk == 0:
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_zeros(b, hq, tq, d), q.new_full((b, hq, tq), -math.inf, dtype=lse_dtype)
    bs, p = layout.block_size, layout.num_pattern_heads
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # Units: the finest grouping of query heads that share one KV head and one pattern head.
    units = math.lcm(p, hkv)
    group = hq // units
    kv_head_of_unit = torch.arange(units, device=q.device) // (units // hkv)
    pattern_head_of_unit = torch.arange(units, device=q.device) // (units // p)

    num_kv_blocks = -(-tk // bs)
    first_q_block = (tk - tq) // bs
    num_q_blocks = num_kv_blocks - first_q_block
    q_offset = tk - tq - first_q_block * bs  # rows of padding before the first real query row

    # [B, U, N, bs, D]: key blocks of every unit's KV head (a view when no padding is needed)
    def blocks(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, num_kv_blocks * bs - tk)).to(compute_dtype)
        return x.view(b, hkv, num_kv_blocks, bs, d)[:, kv_head_of_unit]

    k_blocks, v_blocks = blocks(k), blocks(v)
    # [B, U, Mq, G * bs, D]: query rows of each query block, the unit's group stacked along rows
    q_rows = torch.nn.functional.pad(q, (0, 0, q_offset, num_q_blocks * bs - tq - q_offset)).to(compute_dtype)
    q_rows = q_rows.view(b, units, group, num_q_blocks, bs, d).transpose(2, 3)
    q_rows = q_rows.reshape(b, units, num_q_blocks, group * bs, d)

    kept = layout.block_mask[pattern_head_of_unit][:, first_q_block:num_kv_blocks, :num_kv_blocks]  # [U, Mq, N]
    row_pos = (first_q_block * bs + torch.arange(num_q_blocks * bs, device=q.device)).view(num_q_blocks, 1, bs)
    row_pos = row_pos.expand(num_q_blocks, group, bs).reshape(num_q_blocks, group * bs)  # [Mq, G * bs]
    unit_index = torch.arange(units, device=q.device)[:, None, None]

    rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, b * units * group * bs * num_kv_blocks * bs))
    outs, lses = [], []
    for start in range(0, num_q_blocks, rows_per_chunk):
        chunk = slice(start, min(start + rows_per_chunk, num_q_blocks))
        kept_chunk = kept[:, chunk]  # [U, c, N]
        width = max(1, int(kept_chunk.sum(-1).max()))
        # kept block indices first, in ascending order; padding entries are masked below
        order = torch.sort((~kept_chunk).to(torch.int8), dim=-1, stable=True).indices[..., :width]  # [U, c, W]
        valid = kept_chunk.gather(-1, order)  # [U, c, W]
        keys = k_blocks[:, unit_index, order].flatten(3, 4)  # [B, U, c, W * bs, D]
        values = v_blocks[:, unit_index, order].flatten(3, 4)
        key_pos = (order[..., None] * bs + torch.arange(bs, device=q.device)).flatten(-2)  # [U, c, W * bs]
        allowed = valid.repeat_interleave(bs, dim=-1) & (key_pos < tk)  # [U, c, W * bs]
        allowed = allowed[:, :, None, :]  # [U, c, 1, W * bs]
        if layout.causal:
            allowed = allowed & (key_pos[:, :, None, :] <= row_pos[chunk][None, :, :, None])  # [U, c, G*bs, W*bs]
        scores = (q_rows[:, :, chunk] @ keys.transpose(-1, -2)) * scale  # [B, U, c, G * bs, W * bs]
        scores = scores.masked_fill(~allowed, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # [B, U, c, G * bs]
        probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        outs.append(probs @ values)
        lses.append(lse)

    out = torch.cat(outs, dim=2).view(b, units, num_q_blocks, group, bs, d).transpose(2, 3)
    out = out.reshape(b, hq, num_q_blocks * bs, d)[:, :, q_offset : q_offset + tq]
    lse = torch.cat(lses, dim=2).view(b, units, num_q_blocks, group, bs).transpose(2, 3)
    lse = lse.reshape(b, hq, num_q_blocks * bs)[:, :, q_offset : q_offset + tq]
    return out.to(q.dtype), lse.to(compute_dtype)
