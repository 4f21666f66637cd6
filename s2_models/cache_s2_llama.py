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
maintains, or ``None`` (no padding). Rows are left padded; each row's positions count from its first real token,
where its pattern is anchored (so a batch generates what each prompt generates alone). A right-padded prompt can
be prefilled (its attention is exact) but not extended: generation needs left padding.

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


class S2CacheLayer(DynamicLayer):
    """Cache of one S2 layer (see the module docstring). Created empty; the first ``update_and_attend`` makes it
    compact and fixes its pattern, head counts, head dim and dtype, and later calls must agree (a cache belongs to
    one model). A first ``update`` instead makes it a plain ``DynamicLayer`` (full keys, for reference attention)."""

    _layer_type = S2_LAYER_TYPE  # registers the class in transformers' DYNAMIC_LAYER_TYPE_MAPPING
    is_sliding = False
    is_croppable = False  # evicted blocks cannot be restored

    def __init__(self, **kwargs):
        super().__init__()
        self._reset_state()

    is_sparse = True  # the layer of a sparse model layer (kv_cache_bytes counts it as "s2")

    @property
    def is_compact(self) -> bool:
        return self.layout is not None

    def _reset_state(self):
        self.keys = self.values = None
        self.is_initialized = False
        self.layout: CompactLayout | None = None  # fixed by the first update_and_attend
        self.num_ring = 0  # allocated ring slots
        self.seq_lens: torch.Tensor | None = None  # int64 [B] real tokens per row
        self.num_seen = 0  # tokens seen, padding included (what get_seq_length reports)
        self.right_padded = False

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
        if not self.is_compact:
            return super().crop(tokens_to_remove)
        if tokens_to_remove != 0:
            raise ValueError(
                "an S2 cache cannot be cropped: blocks no future query reads are already evicted (assisted or "
                "speculative generation needs DynamicCache() without config)"
            )

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
            if self.is_compact:
                self.seq_lens = self.seq_lens.repeat_interleave(repeats, dim=0)

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
        if self.is_compact:
            self.seq_lens = self.seq_lens.index_select(0, index)

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
        max_position_embeddings: int | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        """Store the new tokens' K/V and attend: ``query [B, Hq, Tq, D]``, ``key/value [B, Hkv, Tq, D]`` (the new
        tokens, RoPE applied) -> ``[B, Hq, Tq, D]``. ``attention_mask``: ``[B, past + Tq]`` key padding mask or
        ``None``. Positions beyond ``max_position_embeddings`` (when given) are a ``ValueError``."""
        num_seen = self._check_step(query, key, value, pattern, attention_mask, max_position_embeddings)
        if self.num_seen == 0:
            out = self._attend_prompt(query, key, value, pattern, scaling, attention_mask, backend)
            self._store_prompt(key, value, pattern, attention_mask, num_q_heads=query.shape[1])
            return out
        if query.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"the cache holds {self.keys.shape[0]} rows but the input has batch size {query.shape[0]}; a cache "
                "serves one batch (batch size x num_beams) from its first forward on"
            )
        if self.right_padded:
            raise ValueError(
                "this cache was prefilled from a right-padded batch, which cannot be extended: pad on the left "
                "(tokenizer.padding_side = 'left') to generate"
            )
        return self._attend_new_tokens(query, key, value, num_seen, scaling, attention_mask, backend)

    def _check_step(self, query, key, value, pattern, attention_mask, max_position_embeddings) -> int:
        """Validate one call; returns the tokens seen after it."""
        self._check_call(query, key, value, pattern)
        if not self.is_compact and self.is_initialized:
            raise ValueError(
                "this S2 cache layer keeps full keys (filled by a reference attention through update): it cannot "
                "switch to S2 attention. Use one attention implementation per cache."
            )
        batch, _, tq, _ = query.shape
        num_seen = self.num_seen + tq
        if max_position_embeddings is not None and num_seen > max_position_embeddings:
            raise ValueError(
                f"the sequence reaches {num_seen} tokens, beyond max_position_embeddings={max_position_embeddings} "
                "(the positions the model was built for); raise config.max_position_embeddings to go further"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, num_seen):
            raise ValueError(
                f"attention_mask must be the 2-D key padding mask [B, past + Tq] = {[batch, num_seen]}, got "
                f"{list(attention_mask.shape)}"
            )
        return num_seen

    def _attend_prompt(self, query, key, value, pattern, scaling, attention_mask, backend):
        """Attention of the prompt (the first call) over its own full K/V."""
        return s2_attention(query, key, value, pattern, scale=scaling, attention_mask=attention_mask, backend=backend)

    def _attend_new_tokens(self, query, key, value, num_seen, scaling, attention_mask, backend):
        """Write the new tokens into the compact storage (grown as needed) and attend over it."""
        pattern, tq = self.layout.pattern, query.shape[2]
        seq_lens = self._new_seq_lens(attention_mask, tq)
        self._relayout(ring_blocks_for(pattern, tq), num_seen, self.seq_lens)  # room for the chunk's new blocks
        s2_cache_append(self.keys, self.values, key, value, seq_lens, self.layout, num_ring_slots=self.num_ring,
                        backend=backend)
        self.num_seen, self.seq_lens = num_seen, seq_lens
        out = s2_decode_attention(query, self.keys, self.values, seq_lens, self.layout, num_ring_slots=self.num_ring,
                                  scale=scaling, backend=backend)
        self._relayout(pattern.local_blocks, num_seen, seq_lens)  # back to the window alone after a chunk
        return out

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

    def _new_seq_lens(self, attention_mask, tq):
        if attention_mask is None:
            return self.seq_lens + tq
        real = attention_mask.bool()
        seq_lens = real.sum(-1)
        if tq > 1:  # a chunk: check the padding (one host sync per chunk; decode steps trust the mask)
            columns = torch.arange(real.shape[1], device=real.device)
            if not torch.equal(real, columns >= (real.shape[1] - seq_lens)[:, None]):
                raise ValueError("attention_mask must be left padded (one run of real tokens up to the last column)")
        return seq_lens

    # ------------------------------------------------------------------ storage
    def _store_prompt(self, key, value, pattern, attention_mask, num_q_heads):
        batch, num_kv, tq, _ = key.shape
        if attention_mask is None:
            seq_lens = torch.full((batch,), tq, dtype=torch.long, device=key.device)
            first = torch.zeros_like(seq_lens)
        else:
            real = attention_mask.to(key.device).bool()
            seq_lens = real.sum(-1)
            first = torch.where(seq_lens > 0, real.int().argmax(-1), 0)
            self.right_padded = bool(((first + seq_lens) != tq).logical_and(seq_lens > 0).any())
        self.layout = CompactLayout(pattern, num_q_heads, num_kv, pattern.local_blocks)
        self.dtype, self.device = key.dtype, key.device
        self.num_ring, num_slots = self._prompt_slots(tq)
        self.keys = self._gather_prompt(key, first, seq_lens, num_slots)
        self.values = self._gather_prompt(value, first, seq_lens, num_slots)
        self.seq_lens, self.num_seen, self.is_initialized = seq_lens, tq, True

    def _prompt_slots(self, num_tokens: int) -> tuple[int, int]:
        """``(ring slots, all slots)`` to allocate for a prompt of ``num_tokens``: exactly what it fills."""
        num_ring = self.layout.num_ring_slots(num_tokens)
        return num_ring, num_ring + self.layout.num_vertical_slots(num_tokens)

    def _gather_prompt(self, states, first, seq_lens, num_slots):
        """The kept blocks of ``states [B, Hkv, T, D]`` (row b's position 0 at index ``first[b]``) in the layout."""
        batch, num_kv, length, dim = states.shape
        bs = self.layout.block_size
        blocks = slot_blocks(self.layout, seq_lens, self.num_ring, num_slots)  # [B, Hkv, S]
        pos = blocks[..., None] * bs + torch.arange(bs, device=states.device)  # [B, Hkv, S, bs]
        ok = (blocks[..., None] >= 0) & (pos < seq_lens[:, None, None, None])
        index = (first[:, None, None, None] + pos).clamp(0, max(0, length - 1))
        rows, heads = _row_head_index(batch, num_kv, states.device, 4)
        gathered = states[rows, heads, index] if length else states.new_zeros(*index.shape, dim)
        return gathered.masked_fill(~ok[..., None], 0).view(batch, num_kv, num_slots * bs, dim)

    def _relayout(self, ring_blocks, num_seen, seq_lens):
        """Move the storage to a ring of ``ring_blocks`` and the capacity ``num_seen`` needs (no-op if unchanged)."""
        old, old_ring = self.layout, self.num_ring
        same_ring = ring_blocks == old.ring_blocks  # every decode step: keep the instance and its cached tables
        new = old if same_ring else CompactLayout(old.pattern, old.num_q_heads, old.num_kv_heads, ring_blocks)
        num_ring = new.num_ring_slots(num_seen)
        num_slots = num_ring + new.num_vertical_slots(num_seen)
        old_slots = self.keys.shape[2] // old.block_size
        if new == old and num_ring == old_ring and num_slots == old_slots:
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

def _row_head_index(batch: int, num_kv: int, device, ndim: int):
    """Broadcastable batch-row and KV-head index tensors of ``ndim`` dims for advanced indexing."""
    shape = [1] * ndim
    rows = torch.arange(batch, device=device).view(batch, *shape[1:])
    heads = torch.arange(num_kv, device=device).view(1, num_kv, *shape[2:])
    return rows, heads


def s2_cache_layer(past_key_values, layer_idx: int) -> S2CacheLayer | None:
    """The compact S2 layer of ``past_key_values`` at ``layer_idx``, or ``None`` (no cache, or a dense layer)."""
    if past_key_values is None:
        return None
    layers = getattr(past_key_values, "layers", None)
    if layers is None:  # e.g. an EncoderDecoderCache: S2Llama is decoder-only
        return None
    if layer_idx < len(layers) and isinstance(layers[layer_idx], S2CacheLayer):
        return layers[layer_idx]
    return None


def kv_cache_bytes(cache: DynamicCache) -> dict[str, int]:
    """Bytes held by the cache's dense and S2 layers (``keys`` and ``values`` of every layer)."""
    sizes = {"dense": 0, "s2": 0}
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        kind = "s2" if getattr(layer, "is_sparse", False) else "dense"
        sizes[kind] += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return sizes


__all__ = ["S2CacheLayer", "kv_cache_bytes", "s2_cache_layer"]
