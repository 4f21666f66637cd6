"""Static S2 KV cache: storage allocated once for ``max_cache_len`` tokens, and decode steps replayed as CUDA graphs.

``S2StaticCache(config, max_cache_len)`` is what ``generate(..., cache_implementation="static")`` builds for an
S2Llama model; it can also be passed as ``cache`` or ``past_key_values`` (its name before transformers 5.24).
Why it exists: an eager decode step launches a few hundred small kernels from Python, and at long context that host
time, not the GPU, bounds the step. Here every tensor address stays fixed and every kernel reads each row's length
from the GPU (the cache append and the split-KV decode kernel size their work in-kernel), so on CUDA the whole step
(embedding, every layer, the LM head) is captured once per input shape and then replayed.

Storage: sparse layers keep the compact layout of ``S2CacheLayer`` (a ring of ``local_blocks`` blocks plus the KV
head's vertical blocks), allocated for ``max_cache_len`` tokens: the same kept fraction as the dynamic cache.
Dense layers use the same storage with ``DENSE_LAYER_PATTERN`` (every block vertical, nothing evicted), so one
append kernel and one decode kernel serve both layer kinds; they hold what a dense static cache would.

Use: the first forward is the prompt (any length, left padding allowed, the pattern anchored at each row's first
real token as with ``S2CacheLayer``); after it, one new token per row per forward, which is what ``generate()``
does. Those tokens are all real: a decode step does not read the padding mask. CUDA graphs are used for decode
steps without gradients (``torch.no_grad``/``inference_mode``, as in ``generate``) when ``cuda_graphs=True``
(default); everywhere else the same code runs eagerly. ``generate(..., compile_config=CompileConfig(...))`` runs
transformers' ``torch.compile``d decode step instead of these graphs (the layers then trace only their device work).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache
from transformers.utils import is_torchdynamo_compiling

from .cache_s2_llama import S2CacheLayer
from .configuration_s2_llama import DENSE
from .kernels.decode import s2_cache_append, s2_decode_attention
from .kernels.interface import dense_attention
from .kernels.pattern import DENSE_PATTERN, S2Pattern

# Every block is vertical (one residue, stride 1) and nothing is local: all blocks kept, in position order.
DENSE_LAYER_PATTERN = DENSE_PATTERN
# Rope types whose frequencies transformers recomputes on the host from the length seen: a replayed graph would keep
# the captured ones (and capture cannot read the length), so their decode steps run eagerly.
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


class S2StaticLayer(S2CacheLayer):
    """One layer of ``S2StaticCache``: a compact layout with the whole ring and every vertical slot ``max_cache_len``
    tokens need, allocated by the prompt and written in place afterwards (see the module docstring)."""

    _layer_type = None  # built by S2StaticCache, not through transformers' layer-type mappings
    # Decode steps compile (fixed storage, lengths on the device); generate() compiles them only when given a
    # compile_config, and replays S2StaticCache's own CUDA graphs otherwise (S2LlamaForCausalLM decides).
    is_compileable = True
    is_croppable = False  # one token per step: assisted generation (which crops) needs the dynamic cache

    def __init__(self, pattern: S2Pattern | None, max_cache_len: int):
        super().__init__(rollback_tokens=0)
        self.model_pattern = pattern  # the layer's pattern; None for a dense layer
        self.max_cache_len = max_cache_len

    def __repr__(self):
        return f"{type(self).__name__}(pattern={self.model_pattern}, max_cache_len={self.max_cache_len})"

    @property
    def is_sparse(self) -> bool:
        return self.model_pattern is not None

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length  # the name before transformers 5.2x

    def update(self, key_states, value_states, *args, **kwargs):
        raise ValueError(
            'a static S2 cache serves attn_implementation="s2" only; the reference implementations ("sdpa", '
            '"eager") need the default dynamic cache'
        )

    def update_and_attend(self, query, key, value, pattern, *, scaling=None, backend="auto", **kwargs) -> torch.Tensor:
        """``S2CacheLayer.update_and_attend`` with ``pattern=None`` for dense layers. While compiling (a decode step
        after the eager prompt, see ``S2StaticCache.counted_outside_layers``) only the device work is traced."""
        if pattern != self.model_pattern:
            raise ValueError(
                f"this static cache layer was built for the pattern {self.model_pattern} (None: dense), but the "
                f"model's layer has {pattern}: build the cache from the model's config"
            )
        if is_torchdynamo_compiling():
            return self._append_and_attend(query, key, value, scaling, backend)
        return super().update_and_attend(query, key, value, pattern or DENSE_LAYER_PATTERN, scaling=scaling,
                                         backend=backend, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                "a static S2 cache cannot be cropped (it takes one token per step after the prompt): assisted and "
                "prompt-lookup generation need the default dynamic cache"
            )

    def max_crop(self) -> int:
        return 0  # it cannot be cropped (see crop)

    def _remember_real(self, new_real, batch, tq) -> None:
        """Nothing to remember: the layer cannot be cropped (and a replayed graph would not run this)."""

    def check_room(self, num_new_tokens: int) -> None:
        """A ``ValueError`` unless ``num_new_tokens`` more tokens fit."""
        if self.num_seen + num_new_tokens > self.max_cache_len:
            raise ValueError(
                f"the static cache holds at most max_cache_len={self.max_cache_len} tokens; {self.num_seen} are "
                f"stored and {num_new_tokens} more were given (build it with a larger max_cache_len)"
            )

    def _prompt_slots(self, num_tokens: int) -> tuple[int, int]:
        self.check_room(num_tokens)
        ring = self.layout.ring_blocks
        return ring, ring + self.layout.num_vertical_slots(self.max_cache_len)

    def _attend_prompt(self, query, key, value, pattern, scaling, attention_mask, backend):
        if self.model_pattern is None:
            return dense_attention(query, key, value, scaling, key_padding_mask=attention_mask)
        return super()._attend_prompt(query, key, value, pattern, scaling, attention_mask, backend)

    def _attend_new_tokens(self, query, key, value, num_seen, scaling, new_real, backend):
        tq = query.shape[2]
        if tq != 1:
            raise ValueError(
                f"after the prompt, a static S2 cache takes one token per row per forward (got {tq}); prefill in "
                "chunks with the default dynamic cache"
            )
        self.check_room(tq)
        out = self._append_and_attend(query, key, value, scaling, backend)
        self.num_seen = num_seen
        return out

    def _append_and_attend(self, query, key, value, scaling, backend):
        """The device work of a decode step: no host reads, so CUDA graphs and torch.compile capture it."""
        # The lengths advance in place (a captured graph keeps reading this tensor), inside the append's launch: a
        # separate add would be the one kernel of the layer launched the ordinary way (bench/NOTES.md).
        s2_cache_append(self.keys, self.values, key, value, self.seq_lens, self.layout, num_ring_slots=self.num_ring,
                        advance_lengths=True, backend=backend)
        return s2_decode_attention(query, self.keys, self.values, self.seq_lens, self.layout,
                                   num_ring_slots=self.num_ring, scale=scaling, backend=backend,
                                   split_counters=self.split_counters)

    def _store_prompt(self, *args, **kwargs):
        super()._store_prompt(*args, **kwargs)
        # Fixed addresses: compiled steps need no copies.
        for storage in (self.keys, self.values, self.seq_lens, self.split_counters):
            torch._dynamo.mark_static_address(storage)

    def _select_rows(self, index: torch.Tensor, name: str, allow_resize: bool = False) -> None:
        """Rows reordered in place (captured graphs keep their addresses); the batch size cannot change."""
        if self.keys is None:
            return
        storage = (self.keys, self.values, self.seq_lens)
        super()._select_rows(index, name)
        for kept, selected in zip(storage, (self.keys, self.values, self.seq_lens)):
            kept.copy_(selected)
        self.keys, self.values, self.seq_lens = storage

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.keys is not None and repeats != 1:
            raise ValueError("a static S2 cache keeps its batch size: expand the inputs before the prompt's forward")


class S2StaticCache(Cache):
    """Static KV cache of an S2Llama model (see the module docstring).

    Args:
        config: the model's ``S2LlamaConfig`` (its ``sparsity`` decides each layer's layout).
        max_cache_len: tokens per row the cache can hold, prompt included (``generate`` passes its
            ``max_length``); any length the model's positions accept, beyond ``max_position_embeddings`` too
            (rope scaling). The memory is allocated by the prompt's forward.
        cuda_graphs: replay decode steps on CUDA as CUDA graphs (default ``True``; always off for the rope types
            in ``LENGTH_DEPENDENT_ROPE_TYPES``).
    """

    def __init__(self, config, max_cache_len: int, cuda_graphs: bool = True):
        sparsity = getattr(config, "sparsity", None)
        if not isinstance(sparsity, list | tuple):
            raise ValueError(f"config must be an S2LlamaConfig (per-layer sparsity), got {type(config).__name__}")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be an integer >= 1, got {max_cache_len!r}")
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        patterns = [None if spec == DENSE else S2Pattern.from_dict(spec) for spec in sparsity]
        super().__init__(layers=[S2StaticLayer(pattern, max_cache_len) for pattern in patterns])
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        self.cuda_graphs = cuda_graphs and rope_type not in LENGTH_DEPENDENT_ROPE_TYPES
        self._graphs: dict[tuple, _CapturedStep] = {}
        self._warmed_up: set[tuple] = set()
        self._pool = None
        # Set while transformers' compiled decode step (generate's compile_config) drives the cache: dynamo may run
        # some frames of that step eagerly, and those must not start a capture of this cache's own graphs inside it.
        self.in_compiled_step = False

    def reset(self) -> None:
        """Empty every layer; the next forward is a new prompt (captured graphs point at freed storage: dropped)."""
        super().reset()
        self._graphs.clear()
        self._warmed_up.clear()
        self._pool = None  # a pool whose graphs are all freed cannot take new captures

    def graphs_apply(self, input_ids, *other_inputs) -> bool:
        """Whether a decode step with these inputs runs as a CUDA graph: graphs enabled, ``input_ids [B, 1]`` on
        CUDA after the prompt, no gradients, and every other input (``inputs_embeds``, labels, output requests)
        absent or false."""
        return (
            self.cuda_graphs
            and not self.in_compiled_step
            and isinstance(input_ids, torch.Tensor)
            and input_ids.is_cuda
            and input_ids.dim() == 2
            and input_ids.shape[1] == 1
            and self.get_seq_length() > 0
            and not torch.is_grad_enabled()
            and not any(x is not None and x is not False for x in other_inputs)
        )

    def graphed_step(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                     position_ids: torch.Tensor) -> torch.Tensor:
        """``step(input_ids, position_ids) -> logits`` (one decode step of the model over this cache), replayed as
        a CUDA graph: the first step of a shape runs eagerly (Triton compiles, cuBLAS picks its kernels), the
        second captures the graph, every step from then on replays it. Returns a copy of the logits."""
        shape = (tuple(input_ids.shape), tuple(position_ids.shape))
        if shape not in self._graphs and shape not in self._warmed_up:
            self._warmed_up.add(shape)
            return step(input_ids, position_ids)
        with self.counted_outside_layers(input_ids.shape[1]):  # replays skip the layers' Python bookkeeping
            if shape not in self._graphs:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                self._graphs[shape] = _CapturedStep(step, input_ids, position_ids, self._pool)
            return self._graphs[shape].replay(input_ids, position_ids)

    @contextlib.contextmanager
    def compiled_step(self, num_new_tokens: int):
        """Around one call of transformers' compiled forward: no graphs of this cache's own inside it, and the
        layers' bookkeeping done outside (``counted_outside_layers``)."""
        self.in_compiled_step = True
        try:
            with self.counted_outside_layers(num_new_tokens):
                yield
        finally:
            self.in_compiled_step = False

    @contextlib.contextmanager
    def counted_outside_layers(self, num_new_tokens: int):
        """Around a decode step whose layers do no Python bookkeeping (a replayed CUDA graph, a compiled step):
        checks the room before (a ``ValueError`` when full) and counts the step's tokens after."""
        for layer in self.layers:
            layer.check_room(num_new_tokens)
        seen = [layer.num_seen for layer in self.layers]
        yield
        for layer, count in zip(self.layers, seen):
            layer.num_seen = count + num_new_tokens


class _CapturedStep:
    """One decode step captured as a CUDA graph, with its static input and output tensors."""

    def __init__(self, step, input_ids, position_ids, pool):
        self.input_ids, self.position_ids = input_ids.clone(), position_ids.clone()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(self.input_ids, self.position_ids)

    def replay(self, input_ids, position_ids) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        self.graph.replay()
        return self.logits.clone()


__all__ = ["DENSE_LAYER_PATTERN", "LENGTH_DEPENDENT_ROPE_TYPES", "S2StaticCache", "S2StaticLayer"]
