"""Exact, sparse PyTorch path of ``s2_attention`` (CPU, or any device without Triton).

Memory is proportional to the kept blocks, not to T^2: for every query block it gathers only the key blocks its
pattern keeps (padded to the longest list of the chunk), in chunks of query blocks. The backward is explicit
(FlashAttention's: it recomputes each chunk's probabilities from the forward's lse), so the op layer
(``interface.py``'s custom ops) runs it without autograd tracing the forward. Math in float32 (float64 inputs stay
float64). Self-contained: copied flat into checkpoints.
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
    for queries, keys in _sequences(varlen):
        out, lse = _attend(q[:, :, queries], k[:, :, keys], v[:, :, keys], layout, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def s2_attention_torch_bwd(q, k, v, out, lse, dout, dlse, layout: BlockLayout, scale: float, varlen: Varlen | None):
    """Backward of ``s2_attention_torch``: ``dq [B, Hq, Tq, D]``, ``dk``/``dv [B, Hkv, Tk, D]`` in the inputs' dtype.

    ``dout [B, Hq, Tq, D]``; ``dlse [B, Hq, Tq]`` or ``None`` (lse unused).
    """
    if varlen is None:
        return _attend_bwd(q, k, v, out, lse, dout, dlse, layout, scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for queries, keys in _sequences(varlen):
        grads = _attend_bwd(
            q[:, :, queries], k[:, :, keys], v[:, :, keys], out[:, :, queries], lse[:, :, queries],
            dout[:, :, queries], None if dlse is None else dlse[:, :, queries], layout, scale,
        )
        for grad, piece, rows in zip((dq, dk, dv), grads, (queries, keys, keys)):
            grad[:, :, rows] = piece
    return dq, dk, dv


def _sequences(varlen: Varlen):
    """``(query rows, key rows)`` slices of every packed sequence."""
    cu_q, cu_k = varlen.cu_seqlens_q.tolist(), varlen.cu_seqlens_k.tolist()
    for s in range(varlen.num_seqs):
        yield slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])


class _Blocks:
    """One sequence batch laid out by blocks, and the chunks of query blocks with the key blocks each keeps.

    Query heads are grouped in units: the finest grouping of query heads that share one KV head and one pattern head.
    A unit's query rows of one query block are stacked (``G * bs`` rows), so they read its kept key blocks together.
    """

    def __init__(self, q, k, layout: BlockLayout):
        b, hq, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        bs, p = layout.block_size, layout.num_pattern_heads
        self.dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.units = math.lcm(p, hkv)
        self.group = hq // self.units
        device = q.device
        self.kv_head_of_unit = torch.arange(self.units, device=device) // (self.units // hkv)
        pattern_head_of_unit = torch.arange(self.units, device=device) // (self.units // p)
        self.num_kv_blocks = -(-tk // bs)
        first_q_block = (tk - tq) // bs
        self.num_q_blocks = self.num_kv_blocks - first_q_block
        self.q_offset = tk - tq - first_q_block * bs  # rows of padding before the first real query row
        self.shape, self.tk, self.bs, self.causal = (b, hq, tq, d), tk, bs, layout.causal
        self.kept = layout.block_mask[pattern_head_of_unit][:, first_q_block : self.num_kv_blocks, : self.num_kv_blocks]
        row_pos = (first_q_block * bs + torch.arange(self.num_q_blocks * bs, device=device)).view(-1, 1, bs)
        self.row_pos = row_pos.expand(-1, self.group, bs).reshape(self.num_q_blocks, self.group * bs)  # [Mq, G * bs]
        self.unit_index = torch.arange(self.units, device=device)[:, None, None]
        per_chunk = b * self.units * self.group * bs * self.num_kv_blocks * bs
        self.rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, per_chunk))

    def key_blocks(self, x):  # [B, Hkv, Tk, D] -> [B, U, N, bs, D]: the key blocks of every unit's KV head
        b, _, _, d = self.shape
        x = torch.nn.functional.pad(x, (0, 0, 0, self.num_kv_blocks * self.bs - self.tk)).to(self.dtype)
        return x.view(b, -1, self.num_kv_blocks, self.bs, d)[:, self.kv_head_of_unit]

    def query_rows(self, x):  # [B, Hq, Tq, *E] -> [B, U, Mq, G * bs, *E]: rows of each query block, group stacked
        b, _, tq, _ = self.shape
        extra = x.shape[3:]
        pad = self.num_q_blocks * self.bs - tq - self.q_offset
        x = torch.nn.functional.pad(x, (0, 0) * len(extra) + (self.q_offset, pad)).to(self.dtype)
        x = x.view(b, self.units, self.group, self.num_q_blocks, self.bs, *extra).transpose(2, 3)
        return x.reshape(b, self.units, self.num_q_blocks, self.group * self.bs, *extra)

    def from_query_rows(self, x, dtype):  # inverse of query_rows
        b, hq, tq, _ = self.shape
        extra = x.shape[4:]
        x = x.view(b, self.units, self.num_q_blocks, self.group, self.bs, *extra).transpose(2, 3)
        return x.reshape(b, hq, self.num_q_blocks * self.bs, *extra)[:, :, self.q_offset : self.q_offset + tq].to(dtype)

    def chunks(self):
        """Per chunk of query blocks: ``(chunk, order [U, c, W], allowed [U, c, G*bs or 1, W*bs])``: the kept key
        blocks (ascending, padded to the chunk's longest list) and which of their keys each query row may read."""
        device = self.kept.device
        for start in range(0, self.num_q_blocks, self.rows_per_chunk):
            chunk = slice(start, min(start + self.rows_per_chunk, self.num_q_blocks))
            kept_chunk = self.kept[:, chunk]  # [U, c, N]
            width = max(1, int(kept_chunk.sum(-1).max()))
            # kept block indices first, in ascending order; padding entries are masked below
            order = torch.sort((~kept_chunk).to(torch.int8), dim=-1, stable=True).indices[..., :width]  # [U, c, W]
            valid = kept_chunk.gather(-1, order)  # [U, c, W]
            key_pos = (order[..., None] * self.bs + torch.arange(self.bs, device=device)).flatten(-2)  # [U, c, W*bs]
            allowed = (valid.repeat_interleave(self.bs, dim=-1) & (key_pos < self.tk))[:, :, None, :]
            if self.causal:
                allowed = allowed & (key_pos[:, :, None, :] <= self.row_pos[chunk][None, :, :, None])
            yield chunk, order, allowed

    def gather(self, blocks, order):  # [B, U, N, bs, D] -> [B, U, c, W * bs, D]
        return blocks[:, self.unit_index, order].flatten(3, 4)

    def scores(self, q_rows, keys, allowed, scale):
        scores = (q_rows @ keys.transpose(-1, -2)) * scale  # [B, U, c, G * bs, W * bs]
        return scores.masked_fill(~allowed, -math.inf)


def _empty_lse(q):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_full(q.shape[:3], -math.inf, dtype=lse_dtype)


def _attend(q, k, v, layout: BlockLayout, scale: float):
    # q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D]
    if q.shape[2] == 0 or k.shape[2] == 0:
        return torch.zeros_like(q), _empty_lse(q)
    blocks = _Blocks(q, k, layout)
    k_blocks, v_blocks, q_rows = blocks.key_blocks(k), blocks.key_blocks(v), blocks.query_rows(q)
    outs, lses = [], []
    for chunk, order, allowed in blocks.chunks():
        scores = blocks.scores(q_rows[:, :, chunk], blocks.gather(k_blocks, order), allowed, scale)
        lse = torch.logsumexp(scores, dim=-1)  # [B, U, c, G * bs]
        probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        outs.append(probs @ blocks.gather(v_blocks, order))
        lses.append(lse)
    out = blocks.from_query_rows(torch.cat(outs, dim=2), q.dtype)
    return out, blocks.from_query_rows(torch.cat(lses, dim=2), blocks.dtype)


def _attend_bwd(q, k, v, out, lse, dout, dlse, layout: BlockLayout, scale: float):
    """Gradients of ``_attend`` (FlashAttention's backward, chunk by chunk): with ``P = exp(S - lse)``,
    ``dV = P^T dO``, ``dS = P * (dO V^T - delta)`` where ``delta = rowsum(dO * O) - dlse``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``. Key-block gradients are summed over every query row and unit that read the block."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    blocks = _Blocks(q, k, layout)
    b, _, _, d = q.shape
    k_blocks, v_blocks, q_rows = blocks.key_blocks(k), blocks.key_blocks(v), blocks.query_rows(q)
    dout_rows = blocks.query_rows(dout)
    delta = (dout.to(blocks.dtype) * out.to(blocks.dtype)).sum(-1)  # [B, Hq, Tq]
    if dlse is not None:
        delta = delta - dlse.to(blocks.dtype)
    seen = torch.isfinite(lse)  # rows that see no key have P = 0: their gradients are 0 whatever dlse holds
    delta_rows = blocks.query_rows(torch.where(seen, delta, 0.0))
    lse_rows = blocks.query_rows(torch.where(seen, lse, 0.0))
    dq_rows = torch.zeros_like(q_rows)
    # [U, N, B, bs, D]: units first, so the per-chunk key-block gradients are added with one index_put_
    dk_units = q_rows.new_zeros(blocks.units, blocks.num_kv_blocks, b, blocks.bs, d)
    dv_units = torch.zeros_like(dk_units)
    for chunk, order, allowed in blocks.chunks():
        keys, values = blocks.gather(k_blocks, order), blocks.gather(v_blocks, order)  # [B, U, c, W * bs, D]
        scores = blocks.scores(q_rows[:, :, chunk], keys, allowed, scale)
        probs = torch.exp(scores - lse_rows[:, :, chunk, :, None])  # [B, U, c, G * bs, W * bs]
        dp = dout_rows[:, :, chunk] @ values.transpose(-1, -2)
        ds = probs * (dp - delta_rows[:, :, chunk, :, None])
        dq_rows[:, :, chunk] = (ds @ keys) * scale
        index = (blocks.unit_index.expand_as(order), order)
        for grads, value in ((dk_units, (ds.transpose(-1, -2) @ q_rows[:, :, chunk]) * scale),
                             (dv_units, probs.transpose(-1, -2) @ dout_rows[:, :, chunk])):
            value = value.view(b, blocks.units, *order.shape[1:], blocks.bs, d).permute(1, 2, 3, 0, 4, 5)
            grads.index_put_(index, value, accumulate=True)  # padding entries of order add zeros

    def per_kv_head(units):  # [U, N, B, bs, D] -> [B, Hkv, Tk, D], summing the units of each KV head
        hkv = k.shape[1]
        x = units.permute(2, 0, 1, 3, 4).reshape(b, hkv, blocks.units // hkv, -1, d).sum(2)
        return x[:, :, : blocks.tk].to(k.dtype)

    return blocks.from_query_rows(dq_rows, q.dtype), per_kv_head(dk_units), per_kv_head(dv_units)
