"""KV cache of S2 layers that keeps, per KV head, only the blocks a future query can still read.

``S2CacheLayer`` registers itself as the transformers cache layer of ``layer_types == "s2_attention"``, so
``DynamicCache(config=s2_llama_config)`` (what ``generate()`` and the model's forward create by default) holds
compact S2 layers next to the ``DynamicLayer`` of the dense layers. Storage is ``decode.CompactLayout``: a ring
of ``local_blocks`` blocks for the local window and one slot per vertical block; a block leaves memory exactly when
the window has slid past it and it is not vertical. ``keys``/``values`` ``[B, Hkv, num_slots * block_size, D]``
are that storage, so their sizes are the layer's memory.

How the attention uses it (``update_and_attend``): the first call (prefill from an empty cache) runs
``s2_attention`` over the prompt's full K/V, then keeps only the kept blocks: the full K/V of a sparse layer live
only during that layer's step. Later calls (decode, ``Tq >= 1``, or chunked prefill ``Tq < Tk``) write the new
tokens into the compact storage and run ``s2_decode_attention`` over it.

Padding: ``attention_mask`` is the 2-D ``[B, past + Tq]`` key padding mask (1 = real token) that ``generate()``
maintains, or ``None`` (no padding). Padding may sit anywhere: left, right (generation then appends after it, as
transformers does) or holes inside a row. A row's positions count its real tokens only: a token's position is the
number of real tokens before it (``attention_mask.cumsum(-1) - 1``, the ``position_ids`` generate computes), and
the pattern is anchored there, so a row with a hole computes what the row without the masked tokens computes, and a
batch generates what each prompt generates alone. Padded queries return 0.

Rollback (speculative decoding): ``crop`` removes the newest tokens again. Eviction runs behind: the ring keeps
``rollback_tokens`` more tokens (``cdiv(rollback_tokens, block_size)`` blocks per KV head; default
``config.s2_rollback_tokens``) than the window needs, and after a forward of ``Tq`` tokens it keeps room to drop
those ``Tq - 1`` tokens too (assisted decoding verifies its drafts in one forward and then crops the rejected ones),
until the next forward. A deeper crop is a ``ValueError`` naming the limit.

The reference implementations (``attn_implementation="sdpa"``/``"eager"``) read every past key: they call the
standard ``update``, and the layer then keeps everything like a ``DynamicLayer``. The first call decides the mode.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .kernels.decode import (
    CompactLayout,
    block_slots,
    ring_blocks_for,
    s2_cache_append,
    s2_decode_attention,
    slot_blocks,
)
from .kernels.interface import s2_attention
from .kernels.pattern import S2Pattern

S2_LAYER_TYPE = "s2_attention"
# Tokens a compact cache can roll back by default (config.s2_rollback_tokens): above the 20 drafts per step that
# transformers' assisted generation makes by default (num_assistant_tokens); one 64-token block of memory per KV head.
DEFAULT_ROLLBACK_TOKENS = 64


def check_rollback_tokens(rollback_tokens) -> None:
    if isinstance(rollback_tokens, bool) or not isinstance(rollback_tokens, int) or rollback_tokens < 0:
        raise ValueError(f"s2_rollback_tokens (rollback_tokens) must be an integer >= 0, got {rollback_tokens!r}")


class S2CacheLayer(DynamicLayer):
    """Cache of one S2 layer (see the module docstring). Created empty; the first ``update_and_attend`` makes it
    compact and fixes its pattern, head counts, head dim and dtype, and later calls must agree (a cache belongs to
    one model). A first ``update`` instead makes it a plain ``DynamicLayer`` (full keys, for reference attention)."""

    _layer_type = S2_LAYER_TYPE  # registers the class in transformers' DYNAMIC_LAYER_TYPE_MAPPING
    is_sliding = False
    is_croppable = True  # up to the rollback limit (see the module docstring)
    is_sparse = True  # the layer of a sparse model layer (kv_cache_bytes counts it as "s2")

    def __init__(self, rollback_tokens: int | None = None, **kwargs):
        """``rollback_tokens``: how far behind eviction runs (``None``: the model sets ``config.s2_rollback_tokens``
        at its first forward; 0 for a layer used without a model)."""
        super().__init__()
        if rollback_tokens is not None:
            check_rollback_tokens(rollback_tokens)
        self.rollback_tokens = rollback_tokens
        self._reset_state()

    @property
    def is_compact(self) -> bool:
        return self.layout is not None

    def _reset_state(self):
        self.keys = self.values = None
        self.is_initialized = False
        self.layout: CompactLayout | None = None  # fixed by the first update_and_attend
        self.num_ring = 0  # allocated ring slots
        self.seq_lens: torch.Tensor | None = None  # int64 [B] real tokens per row
        self.split_counters: torch.Tensor | None = None  # int32 [B * Hkv], zero between calls (decode kernel's)
        self.num_seen = 0  # tokens seen, padding included (what get_seq_length reports)
        self.crop_floor: torch.Tensor | None = None  # int64 [B]: the fewest real tokens a crop may leave per row
        self.recent_real: torch.Tensor | None = None  # bool [B, m]: which of the newest m columns are real tokens

    def __repr__(self):
        return f"{type(self).__name__}(layout={self.layout}, num_seen={self.num_seen})"

    # ------------------------------------------------------------------ transformers' layer API
    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' contract (return every past key): the full-keeping mode of the reference attentions."""
        if self.is_compact:
            raise ValueError(
                "this S2 cache layer is compact (filled by S2 attention): it keeps only the KV blocks S2 can still "
                "read and cannot return all past keys. Use one attention implementation per cache."
            )
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.num_seen if self.is_compact else super().get_seq_length()

    def reset(self) -> None:
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens: ``crop(-n)`` removes ``n`` columns (transformers' convention); a positive value
        is the length to keep (its legacy form). A compact layer goes back at most ``max_crop()`` columns."""
        if not self.is_compact:
            return super().crop(tokens_to_remove)
        if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.numel() == 1 and not (
            tokens_to_remove.is_floating_point() or tokens_to_remove.dtype == torch.bool
        ):  # transformers 5.17's assisted decoding passes the count of rejected drafts as a tensor
            tokens_to_remove = int(tokens_to_remove)
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(f"tokens_to_remove must be an integer, got {tokens_to_remove!r}")
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, self.num_seen - tokens_to_remove)
        if remove == 0:
            return
        limit = self.max_crop()
        if remove > limit:
            raise ValueError(
                f"crop: {remove} tokens to remove, but this S2 cache layer can drop at most {limit} now (those of its "
                f"last forward or up to rollback_tokens={self.rollback_tokens}; older KV blocks are evicted). Raise "
                "config.s2_rollback_tokens to crop deeper."
            )
        self.seq_lens = self.seq_lens - self.recent_real[:, -remove:].sum(-1)
        self.recent_real = self.recent_real[:, :-remove]
        self.num_seen -= remove

    def max_crop(self) -> int:
        """How many of the newest columns ``crop`` can remove: each row must keep at least ``crop_floor`` real
        tokens (below it, its local window has been evicted)."""
        if not self.is_compact:
            return self.get_seq_length()
        real_removed = self.recent_real.flip(-1).long().cumsum(-1)  # [B, m]: real tokens in the newest 1..m columns
        fits = ((self.seq_lens[:, None] - real_removed) >= self.crop_floor[:, None]).all(0)
        return int(fits.long().cumprod(0).sum())

    def _raise_crop_floor(self) -> None:
        """After storage was written or moved: a block ``ring_blocks`` behind the newest block of a row may have
        been overwritten, so the row cannot be cropped to a length whose window reaches back to it."""
        bs, spare = self.layout.block_size, self.layout.ring_blocks - self.layout.pattern.local_blocks
        last = (self.seq_lens - 1).clamp(min=0).div(bs, rounding_mode="floor")
        floor = torch.where(last > spare, (last - spare) * bs + 1, 0)
        self.crop_floor = floor if self.crop_floor is None else torch.maximum(self.crop_floor, floor)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx, "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices, "indices", allow_resize=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        if self.keys is not None and self.keys.numel():
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)
            self._map_row_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def _select_rows(self, index: torch.Tensor, name: str, allow_resize: bool = False) -> None:
        if self.keys is None or not self.keys.numel():
            return
        batch = self.keys.shape[0]
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor of batch rows, got {index!r}")
        if not allow_resize and index.numel() != batch:
            raise ValueError(
                f"{name} has {index.numel()} entries but the cache holds {batch} rows (batch size x num_beams)"
            )
        index = index.to(self.keys.device)
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self._map_row_state(lambda t: t.index_select(0, index))

    def _map_row_state(self, function) -> None:
        """Apply ``function`` to the per-row state of a compact layer (rows selected, reordered or repeated)."""
        for name in ("seq_lens", "crop_floor", "recent_real"):
            if getattr(self, name) is not None:
                setattr(self, name, function(getattr(self, name)))

    # ------------------------------------------------------------------ S2 attention with the cache
    def update_and_attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        pattern: S2Pattern,
        *,
        scaling: float | None = None,
        attention_mask: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        """Store the new tokens' K/V and attend: ``query [B, Hq, Tq, D]``, ``key/value [B, Hkv, Tq, D]`` (the new
        tokens, RoPE applied) -> ``[B, Hq, Tq, D]``. ``attention_mask``: ``[B, past + Tq]`` key padding mask or
        ``None``. The storage grows with the sequence: any length fits while memory lasts."""
        num_seen = self._check_step(query, key, value, pattern, attention_mask)
        new_real = None if attention_mask is None else attention_mask[:, -query.shape[2]:].to(query.device).bool()
        if self.num_seen == 0:
            out = self._attend_prompt(query, key, value, pattern, scaling, attention_mask, backend)
            self._store_prompt(key, value, pattern, attention_mask, num_q_heads=query.shape[1])
            self._remember_real(new_real, query.shape[0], query.shape[2])
            return out
        if query.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"the cache holds {self.keys.shape[0]} rows but the input has batch size {query.shape[0]}; a cache "
                "serves one batch (batch size x num_beams) from its first forward on"
            )
        out = self._attend_new_tokens(query, key, value, num_seen, scaling, new_real, backend)
        self._remember_real(new_real, query.shape[0], query.shape[2])
        return out

    def _check_step(self, query, key, value, pattern, attention_mask) -> int:
        """Validate one call; returns the tokens seen after it."""
        self._check_call(query, key, value, pattern)
        if not self.is_compact and self.is_initialized:
            raise ValueError(
                "this S2 cache layer keeps full keys (filled by a reference attention through update): it cannot "
                "switch to S2 attention. Use one attention implementation per cache."
            )
        batch, _, tq, _ = query.shape
        num_seen = self.num_seen + tq
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, num_seen):
            raise ValueError(
                f"attention_mask must be the 2-D key padding mask [B, past + Tq] = {[batch, num_seen]}, got "
                f"{list(attention_mask.shape)}"
            )
        return num_seen

    def _attend_prompt(self, query, key, value, pattern, scaling, attention_mask, backend):
        """Attention of the prompt (the first call) over its own full K/V."""
        return s2_attention(query, key, value, pattern, scale=scaling, attention_mask=attention_mask, backend=backend)

    def _attend_new_tokens(self, query, key, value, num_seen, scaling, new_real, backend):
        """Write the new tokens into the compact storage (grown as needed) and attend over it.

        ``new_real``: bool ``[B, Tq]``, which new tokens are real (``None``: all). A real token's position is the
        row's real-token count before it. One decode token (``Tq == 1``) needs no host sync: a padding token is
        written nowhere and its output is 0. A chunk whose padding only precedes a row's first token (left padding)
        runs at once; any other padding inside a chunk (a rare input) runs token by token."""
        tq = query.shape[2]
        if new_real is not None and tq > 1:
            count = new_real.sum(-1)
            left_padded = new_real == (torch.arange(tq, device=count.device) >= tq - count[:, None])
            if not bool((left_padded.all(-1) & ((count == tq) | (self.seq_lens == 0))).all()):
                outs = [
                    self._attend_new_tokens(query[:, :, t : t + 1], key[:, :, t : t + 1], value[:, :, t : t + 1],
                                            self.num_seen + 1, scaling, new_real[:, t : t + 1], backend)
                    for t in range(tq)
                ]
                return torch.cat(outs, dim=2)
        pattern = self.layout.pattern
        added = tq if new_real is None else new_real.sum(-1)
        seq_lens = self.seq_lens + added
        # Room for the chunk's new blocks and for rolling them back (crop); kept until the next call.
        self._relayout(max(ring_blocks_for(pattern, tq), self._steady_ring_blocks(pattern)), num_seen, self.seq_lens)
        # A padding decode token is written at position -1, i.e. nowhere (the append skips negative positions).
        write_lens = seq_lens if new_real is None or tq > 1 else torch.where(new_real[:, 0], seq_lens, 0)
        s2_cache_append(self.keys, self.values, key, value, write_lens, self.layout, num_ring_slots=self.num_ring,
                        backend=backend)
        self.num_seen, self.seq_lens = num_seen, seq_lens
        self._raise_crop_floor()
        out = s2_decode_attention(query, self.keys, self.values, seq_lens, self.layout, num_ring_slots=self.num_ring,
                                  scale=scaling, backend=backend, split_counters=self.split_counters)
        return out if new_real is None else out.masked_fill(~new_real[:, None, :, None], 0)

    def _steady_ring_blocks(self, pattern: S2Pattern) -> int:
        """The ring between calls: the local window plus ``rollback_tokens``."""
        return ring_blocks_for(pattern, (self.rollback_tokens or 0) + 1)

    def _remember_real(self, new_real, batch, tq):
        """Keep which of the newest columns are real (as many as a crop may remove), so that ``crop`` knows how
        many real tokens each row loses."""
        if new_real is None:
            new_real = torch.ones(batch, tq, dtype=torch.bool, device=self.seq_lens.device)
        spare = self.layout.ring_blocks - self.layout.pattern.local_blocks
        keep = max(tq, (spare + 1) * self.layout.block_size)
        recent = new_real if self.recent_real is None else torch.cat([self.recent_real, new_real], dim=1)
        self.recent_real = recent[:, -keep:]

    def _check_call(self, query, key, value, pattern):
        if not isinstance(pattern, S2Pattern):
            raise ValueError(f"pattern must be an S2Pattern, got {type(pattern).__name__}")
        if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape or key.shape[2] != query.shape[2]:
            raise ValueError(
                f"query [B, Hq, Tq, D] and key/value [B, Hkv, Tq, D] of the new tokens expected, got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if self.layout is None:
            return
        layout = self.layout
        expected = (layout.pattern, layout.num_q_heads, layout.num_kv_heads, self.keys.shape[-1], self.keys.dtype)
        got = (pattern, query.shape[1], key.shape[1], key.shape[-1], key.dtype)
        if expected != got:
            raise ValueError(
                "this S2 cache layer was filled by another model or layer: it holds (pattern, Hq, Hkv, head_dim, "
                f"dtype) = {expected}, the call has {got}"
            )

    # ------------------------------------------------------------------ storage
    def _store_prompt(self, key, value, pattern, attention_mask, num_q_heads):
        batch, num_kv, tq, _ = key.shape
        if attention_mask is None:
            seq_lens = torch.full((batch,), tq, dtype=torch.long, device=key.device)
            columns = torch.arange(tq, device=key.device).expand(batch, tq)
        else:  # the columns of each row's real tokens, in order (padding anywhere)
            real = attention_mask.to(key.device).bool()
            seq_lens = real.sum(-1)
            columns = torch.sort((~real).int(), dim=-1, stable=True).indices
        self.layout = CompactLayout(pattern, num_q_heads, num_kv, self._steady_ring_blocks(pattern))
        self.dtype, self.device = key.dtype, key.device
        self.num_ring, num_slots = self._prompt_slots(tq)
        self.keys = self._gather_prompt(key, columns, seq_lens, num_slots)
        self.values = self._gather_prompt(value, columns, seq_lens, num_slots)
        self.seq_lens, self.num_seen, self.is_initialized = seq_lens, tq, True
        self.split_counters = torch.zeros(batch * num_kv, dtype=torch.int32, device=key.device)
        self._raise_crop_floor()

    def _prompt_slots(self, num_tokens: int) -> tuple[int, int]:
        """``(ring slots, all slots)`` to allocate for a prompt of ``num_tokens``: exactly what it fills."""
        num_ring = self.layout.num_ring_slots(num_tokens)
        return num_ring, num_ring + self.layout.num_vertical_slots(num_tokens)

    def _gather_prompt(self, states, columns, seq_lens, num_slots):
        """The kept blocks of ``states [B, Hkv, T, D]`` in the layout; row b's position p is column ``columns[b, p]``
        (its p-th real token)."""
        batch, num_kv, length, dim = states.shape
        bs = self.layout.block_size
        blocks = slot_blocks(self.layout, seq_lens, self.num_ring, num_slots)  # [B, Hkv, S]
        pos = blocks[..., None] * bs + torch.arange(bs, device=states.device)  # [B, Hkv, S, bs]
        ok = (blocks[..., None] >= 0) & (pos < seq_lens[:, None, None, None])
        if not length:
            return states.new_zeros(batch, num_kv, num_slots * bs, dim)
        index = columns.gather(1, pos.clamp(0, length - 1).flatten(1)).view(pos.shape)
        rows, heads = _row_head_index(batch, num_kv, states.device, 4)
        return states[rows, heads, index].masked_fill(~ok[..., None], 0).view(batch, num_kv, num_slots * bs, dim)

    def _relayout(self, ring_blocks, num_seen, seq_lens):
        """Move the storage to a ring of ``ring_blocks`` and the capacity ``num_seen`` needs (no-op if unchanged).

        Under the same ring the capacity never shrinks: after a crop (speculative decoding's rejected drafts) the
        next forwards refill the freed slots, and the kernels read only the slots a row's length fills."""
        old, old_ring = self.layout, self.num_ring
        old_slots = self.keys.shape[2] // old.block_size
        same_ring = ring_blocks == old.ring_blocks  # every decode step: keep the instance and its cached tables
        new = old if same_ring else CompactLayout(old.pattern, old.num_q_heads, old.num_kv_heads, ring_blocks)
        num_ring, num_vertical = new.num_ring_slots(num_seen), new.num_vertical_slots(num_seen)
        if same_ring:
            num_ring, num_vertical = max(num_ring, old_ring), max(num_vertical, old_slots - old_ring)
        num_slots = num_ring + num_vertical
        if same_ring and num_ring == old_ring and num_slots == old_slots:
            return
        # The blocks the new slots should hold, found where the old layout holds them (as of ``self.seq_lens``).
        blocks = slot_blocks(new, seq_lens, num_ring, num_slots)  # [B, Hkv, S_new]
        source = block_slots(old, blocks.clamp(min=0), old_ring).clamp(max=old_slots - 1)
        held = slot_blocks(old, self.seq_lens, old_ring, old_slots).gather(-1, source)
        ok = ((blocks >= 0) & (held == blocks))[..., None, None]
        batch, num_kv = blocks.shape[:2]
        rows, heads = _row_head_index(batch, num_kv, blocks.device, 3)

        def move(states):
            by_slot = states.view(batch, num_kv, old_slots, old.block_size, -1)
            return by_slot[rows, heads, source].masked_fill(~ok, 0).flatten(2, 3)

        self.keys, self.values = move(self.keys), move(self.values)
        self.layout, self.num_ring = new, num_ring
        self._raise_crop_floor()  # a smaller ring keeps fewer blocks behind the newest

def _row_head_index(batch: int, num_kv: int, device, ndim: int):
    """Broadcastable batch-row and KV-head index tensors of ``ndim`` dims for advanced indexing."""
    shape = [1] * ndim
    rows = torch.arange(batch, device=device).view(batch, *shape[1:])
    heads = torch.arange(num_kv, device=device).view(1, num_kv, *shape[2:])
    return rows, heads


def s2_cache_layer(cache, layer_idx: int) -> S2CacheLayer | None:
    """The compact S2 layer of ``cache`` at ``layer_idx``, or ``None`` (no cache, or a dense layer)."""
    if cache is None:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None:  # e.g. an EncoderDecoderCache: S2Llama is decoder-only
        return None
    if layer_idx < len(layers) and isinstance(layers[layer_idx], S2CacheLayer):
        return layers[layer_idx]
    return None


def set_default_rollback(cache, rollback_tokens: int) -> None:
    """Give the S2 layers of ``cache`` that have no ``rollback_tokens`` yet (built by ``DynamicCache(config=...)``,
    which passes no arguments to its layers) this one; a layer's value is fixed once it holds tokens."""
    check_rollback_tokens(rollback_tokens)  # config.s2_rollback_tokens may have been set after construction
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, S2CacheLayer) and layer.rollback_tokens is None and not layer.is_compact:
            layer.rollback_tokens = rollback_tokens


def kv_cache_bytes(cache: DynamicCache) -> dict[str, int]:
    """Bytes held by the cache's dense and S2 layers (``keys`` and ``values`` of every layer), and
    ``"s2_rollback"``: the part of ``"s2"`` that only serves ``crop`` (the ring slots beyond the local window,
    ``config.s2_rollback_tokens``; after a multi-token forward also room to crop those tokens, until the next one)."""
    sizes = {"dense": 0, "s2": 0, "s2_rollback": 0}
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        kind = "s2" if getattr(layer, "is_sparse", False) else "dense"
        layer_bytes = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        sizes[kind] += layer_bytes
        if kind == "s2" and getattr(layer, "is_compact", False):
            extra_slots = max(0, layer.num_ring - layer.layout.pattern.local_blocks)
            sizes["s2_rollback"] += layer_bytes * extra_slots * layer.layout.block_size // layer.keys.shape[2]
    return sizes


__all__ = ["S2CacheLayer", "kv_cache_bytes", "s2_cache_layer", "set_default_rollback"]
