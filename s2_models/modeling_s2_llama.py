"""S2Llama: Llama whose attention layers are, layer by layer, dense or S2-Attention (arXiv 2407.17678).

Attention implementations (``attn_implementation=``):

* ``"s2"`` (the default): sparse layers call ``s2_attention`` (Triton on CUDA, the exact sparse PyTorch path
  elsewhere) with native GQA; dense layers call PyTorch SDPA (FlashAttention kernels on CUDA when unmasked). Both
  take the ``[B, Tk]`` key padding mask and packed sequences (``cu_seq_lens_*`` kwargs, or ``position_ids`` that
  restart at 0) as they are: no ``T x T`` mask is ever built.
* ``"sdpa"`` / ``"eager"``: references. Sparse layers get their pattern as a 4-D per-head mask, anchored at each
  sequence's first token like the kernels, so every implementation computes the same function.

Self-contained on purpose (transformers + the flat kernel files only): it is copied next to the weights of every
saved checkpoint so that ``trust_remote_code`` loading works without this package installed.
"""

import os
import warnings

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, GenerationMixin
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMode
from transformers.generation import utils as generation_utils
from transformers.masking_utils import create_causal_mask, create_masks_for_generate
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, is_torchdynamo_compiling, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_s2_llama import S2CacheLayer, s2_cache_layer, set_default_rollback
from .configuration_s2_llama import DENSE, FULL_ATTENTION, S2_ATTENTION, S2LlamaConfig
from .kernels.fused import (
    MAX_NORM_WIDTH,
    add_rms_norm,
    decode_projections_fit,
    linear_group,
    linear_swiglu,
    rms_norm,
    rotary_embedding,
    rotary_embedding_fits,
    rotary_tables,
    swiglu,
    use_fused_kernels,
)
from .kernels.interface import AUTOCAST_DEVICE_TYPES, capturing_cuda_graph, dense_attention, s2_attention
from .kernels.pattern import S2Pattern, token_mask
from .static_cache_s2_llama import LENGTH_DEPENDENT_ROPE_TYPES, S2StaticCache

logger = logging.get_logger(__name__)

S2_IMPLEMENTATION = "s2"
# transformers 5.24 renamed the KV cache from ``past_key_values`` to ``cache`` in forward kwargs, in what ``generate``
# passes and keeps in its ``model_kwargs``, and in the output fields (the old field name still works there, with a
# deprecation warning). S2 models take either name (``resolve_cache``) and hand the cache on under this name, the one
# the installed transformers uses, so that its generation loop and output classes find it in every version.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# What generate() passes to prepare_inputs_for_generation at a decode step (with optional output requests), and which
# of those the model's forward does not get there (transformers' version drops the same ones).
_STATIC_DECODE_KWARGS = frozenset({CACHE_NAME, "attention_mask", "position_ids", "use_cache", "logits_to_keep",
                                   "output_attentions", "output_hidden_states", "inputs_embeds", "is_first_iteration"})
_DROPPED_AT_STATIC_DECODE = frozenset({"attention_mask", "position_ids", "inputs_embeds", "is_first_iteration"})
# Implementations that apply the sparse patterns; any implementation runs an all-dense model.
SPARSE_CAPABLE_IMPLEMENTATIONS = (S2_IMPLEMENTATION, "sdpa", "eager")


def resolve_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The KV cache passed as ``cache`` (transformers >= 5.24: ``generate``, the task heads) or as ``past_key_values``
    (earlier versions, and callers written for them). Without this, a name the forward does not list would land in
    ``**kwargs`` unread: the model would silently run without its cache."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError(
            "got both cache and past_key_values (its name before transformers 5.24), holding different caches: pass one"
        )
    return past_key_values


# ---------------------------------------------------------------------------------------------- "s2" attention
def s2_padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                    attention_mask=None, **kwargs):
    """Mask function of the ``"s2"`` implementation: the ``[B, Tk]`` bool key padding mask, ``None`` without padding.

    Both layer kinds take it as is (causality and the sparse pattern are implicit), so no ``T x T`` mask is made.
    Registered so that transformers hands the padding mask to the attention function at all. While compiling, the
    mask is passed on unread (checking it for padding is a host sync; the S2 op skips an all-real mask itself).
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if is_torchdynamo_compiling():
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask


def attend_as_autocast_op(attend, query, key, value):
    """``attend(query, key, value)`` as autocast runs SDPA, the reference: under ``torch.autocast`` the floating
    inputs (float64 aside) are cast to the autocast dtype and the op runs with autocast off, in that dtype.

    Fp32 weights under autocast hand on q and k in float32 (RoPE's cos/sin are float32) and v in the autocast dtype;
    SDPA casts all three, so the S2 kernels must see the same dtypes to compute what the reference computes. Autocast
    is off inside so that the PyTorch path keeps its float32 math (its matmuls would otherwise run in 16 bits).
    """
    device_type = query.device.type
    if device_type not in AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return attend(query, key, value)
    dtype = torch.get_autocast_dtype(device_type)
    query, key, value = (x.to(dtype) if x.dtype != torch.float64 else x for x in (query, key, value))
    with torch.autocast(device_type, enabled=False):
        return attend(query, key, value)


def s2_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"s2"`` attention function: the layer's S2 pattern, or dense SDPA for dense layers.

    Args:
        module: the attention layer; ``module.s2_pattern`` is its ``S2Pattern`` (``None``: dense).
        query: ``[B, Hq, Tq, D]``; key, value: ``[B, Hkv, Tk, D]`` (GQA native), queries bottom-right aligned.
        attention_mask: ``None`` or the ``[B, Tk]`` key padding mask (padding anywhere; positions count real tokens).
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k: packed sequences (flash-attn varlen kwargs, as
            from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): the ``B * T`` tokens, flattened
            row after row, are split at these offsets.

    Returns:
        ``(out [B, Tq, Hq, D], None)``: no attention weights are materialized.
    """
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f'attn_implementation="s2" takes a [B, Tk] key padding mask, got shape {tuple(attention_mask.shape)}; '
            'use attn_implementation="sdpa" or "eager" for custom 4-D masks'
        )
    packed = cu_seq_lens_q is not None or cu_seq_lens_k is not None
    b, hq, tq, d = query.shape
    if packed:  # one row of all tokens: sequences never cross rows, so flattening keeps them intact
        query, key, value = (x.transpose(0, 1).flatten(1, 2).unsqueeze(0) for x in (query, key, value))
    varlen = {"cu_seqlens_q": cu_seq_lens_q, "cu_seqlens_k": cu_seq_lens_k} if packed else {}
    if module.s2_pattern is not None and dropout:
        raise ValueError(f"the S2 kernels have no attention dropout, got dropout={dropout}")

    def attend(query, key, value):
        if module.s2_pattern is None:
            return dense_attention(query, key, value, scaling, dropout, key_padding_mask=attention_mask, **varlen)
        return s2_attention(
            query, key, value, module.s2_pattern, scale=scaling, backend=module.config.s2_backend,
            attention_mask=attention_mask, max_seqlen_q=max_length_q, max_seqlen_k=max_length_k, **varlen
        )

    out = attend_as_autocast_op(attend, query, key, value)
    if packed:
        out = out.squeeze(0).unflatten(1, (b, tq)).transpose(0, 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(S2_IMPLEMENTATION, s2_attention_forward)
AttentionMaskInterface.register(S2_IMPLEMENTATION, s2_padding_mask)


# ---------------------------------------------------------------------------------------------- reference masks
def sequence_layout(batch_size, kv_length, key_padding_mask=None, cu_seqlens=None, device=None):
    """Which sequence each key belongs to, and its position in it: ``(segment, position)``, both ``long [B, Tk]``.

    ``segment`` is -1 for padding. With a padding mask a row's real tokens are one sequence and a token's position
    is the number of real tokens before it (padding anywhere, holes included, is skipped: ``mask.cumsum(-1) - 1``,
    the ``position_ids`` generate computes); with ``cu_seqlens`` sequences start at those offsets into the flattened
    ``B * Tk`` tokens (packing). Exactly where ``s2_attention`` anchors its pattern.
    """
    index = torch.arange(kv_length, device=device).expand(batch_size, kv_length)
    if cu_seqlens is not None:
        flat = torch.arange(batch_size * kv_length, device=device)
        starts = cu_seqlens.to(device=device, dtype=torch.long)[:-1]
        segment = torch.searchsorted(starts, flat, right=True) - 1
        return segment.view(batch_size, kv_length), (flat - starts[segment]).view(batch_size, kv_length)
    if key_padding_mask is None:
        return torch.zeros_like(index), index
    real = key_padding_mask.to(device=device, dtype=torch.bool)
    return torch.where(real, 0, -1), torch.where(real, real.long().cumsum(-1) - 1, -1)


def s2_reference_mask(pattern: S2Pattern, num_q_heads, num_kv_heads, q_length, segment, position, dtype=None):
    """The token-level mask of an S2 layer for the reference implementations: ``[B, Hq, Tq, Tk]``.

    Bool (SDPA), or additive in ``dtype`` (eager: 0 kept, dtype's minimum masked). Queries are the last
    ``q_length`` keys (bottom-right alignment, as with a KV cache); ``segment``/``position`` from
    ``sequence_layout``.
    """
    num_heads = pattern.num_pattern_heads(num_q_heads, num_kv_heads)
    length = max(1, int(position.max()) + 1)
    num_blocks = -(-length // pattern.block_size)
    blocks = pattern.block_mask(num_heads, num_blocks, num_blocks, device=position.device)
    within_sequence = token_mask(blocks, pattern.block_size, length, length)  # [P, L, L], by position in sequence
    q_segment, q_position = segment[:, -q_length:], position[:, -q_length:]
    keep = within_sequence[:, q_position.clamp(min=0)[:, :, None], position.clamp(min=0)[:, None, :]]
    same_sequence = (q_segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0)  # [B, Tq, Tk]
    mask = (keep.transpose(0, 1) & same_sequence[:, None]).repeat_interleave(num_q_heads // num_heads, dim=1)
    if dtype is None:  # SDPA gives a query that sees no key (padding) a zero output, as the "s2" kernels do
        return mask
    # Eager's softmax has no such rule: a padding query sees every key instead of none (finite, never NaN).
    mask = mask | ~mask.any(-1, keepdim=True)
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def packed_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``int32`` offsets of the sequences packed in ``position_ids [B, T]`` (rows flattened), where a position that
    does not follow its predecessor starts a new sequence; ``None`` if every row holds one sequence.

    While compiling (no host syncs) the offsets have a fixed size, ``B * T + 1``: the unused ones repeat the end
    (empty sequences, which ``s2_attention`` skips), and rows without restarts come out as one sequence each."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if is_torchdynamo_compiling():
        starts = starts.flatten()
        index = torch.arange(starts.numel(), device=starts.device)
        offsets = torch.where(starts, index, starts.numel()).sort().values
        return torch.cat([offsets, offsets.new_full((1,), starts.numel())]).to(torch.int32)
    if not bool(starts[:, 1:].any()):
        return None
    offsets = starts.flatten().nonzero().squeeze(-1)
    end = torch.tensor([position_ids.numel()], device=position_ids.device)
    return torch.cat([offsets, end]).to(torch.int32)


# ---------------------------------------------------------------------------------------------- cache
# ``DynamicCache(config=...)`` (generate's and the forward's default cache) builds an ``S2CacheLayer`` for every
# ``"s2_attention"`` layer: compact under the "s2" implementation, full keys under the reference ones.
assert S2CacheLayer._layer_type == S2_ATTENTION


# ---------------------------------------------------------------------------------------------- coverage
class S2CoverageWarning(UserWarning):
    """A sparse layer whose pattern heads leave vertical offsets to no head (``S2Pattern.uncovered_offsets``)."""


def uncovered_offsets_by_layer(config: S2LlamaConfig) -> dict[int, tuple[int, ...]]:
    """``{layer: offsets}`` for the sparse layers whose pattern heads read no distant key block at those offsets."""
    result = {}
    for index, spec in enumerate(config.sparsity):
        if spec == DENSE:
            continue
        pattern = S2Pattern.from_dict(spec)
        uncovered = pattern.uncovered_offsets(
            pattern.num_pattern_heads(config.num_attention_heads, config.num_key_value_heads)
        )
        if uncovered:
            result[index] = uncovered
    return result


def coverage_warning(config: S2LlamaConfig) -> str | None:
    """One message for every sparse layer that leaves vertical offsets uncovered (grouped by pattern), or None."""
    groups: dict[str, list[int]] = {}
    for index in uncovered_offsets_by_layer(config):
        groups.setdefault(repr(config.sparsity[index]), []).append(index)
    parts = []
    for layers in groups.values():
        pattern = S2Pattern.from_dict(config.sparsity[layers[0]])
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        num_heads = pattern.num_pattern_heads(hq, hkv)
        uncovered = pattern.uncovered_offsets(num_heads)
        stride = pattern.vert_stride
        heads = "query heads" if pattern.per_query_head else "KV heads"
        parts.append(
            f"S2 layers {_ranges(layers)} (vert_stride {stride}, {num_heads} pattern heads: the {heads}) read no key "
            f"block beyond their local window at {len(uncovered)} of the {stride} vertical offsets "
            f"(blocks j with j % {stride} in {list(uncovered)}); to cover them: {' or '.join(_fixes(pattern, hq, hkv))}"
        )
    if not parts:
        return None
    return ("; ".join(parts) + ". S2's heads are meant to read the whole context together (see "
            "S2Pattern.uncovered_offsets): in this package's from-scratch study, covering every offset cut the "
            "hybrid's held-out loss gap to dense from +2.4% to +1.5%. per_query_head=True keeps, per KV head, the "
            "stripes of its whole query group in the compact KV cache.")


def _fixes(pattern: S2Pattern, num_q_heads: int, num_kv_heads: int) -> list[str]:
    """The pattern changes that would cover more offsets, as config text."""
    num_heads = pattern.num_pattern_heads(num_q_heads, num_kv_heads)
    fixes = []
    if pattern.homo_head:
        fixes.append("homo_head=False")
    if pattern.head_sliding_step is not None:  # a step sharing a factor with vert_stride folds stripes together
        fixes.append("head_sliding_step=None (or one coprime with vert_stride)")
    if num_heads < pattern.vert_stride:  # fewer stripes than offsets: more pattern heads or a smaller stride
        if not pattern.per_query_head and num_q_heads > num_kv_heads:
            fixes.append(f"per_query_head=True ({num_q_heads} pattern heads)")
        fixes.append(f"vert_stride <= {num_heads}")
        fixes.append("num_dense_heads >= 1")
    return fixes


def _ranges(indices: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``."""
    runs = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def warn_uncovered_offsets(config: S2LlamaConfig) -> None:
    """Warn (``S2CoverageWarning``) when building a model whose sparse layers leave offsets uncovered.

    At model construction rather than in the config: configs are built, copied and reloaded many times (every
    ``from_pretrained``, every ``Trainer`` resume), a model once. Python's default filter shows a given message once
    per process, so a second model of the same config is not warned about again.
    """
    message = coverage_warning(config)
    if message:
        warnings.warn(message, S2CoverageWarning, stacklevel=2)


# ---------------------------------------------------------------------------------------------- modules
class S2LlamaAttention(nn.Module):
    """Llama attention whose core is dense or the layer's S2 pattern, per ``config.sparsity[layer_idx]``."""

    def __init__(self, config: S2LlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        # Built here, not by config.layer_patterns(): a remote-code config may come from another copy of pattern.py
        # (transformers loads each remote module with its own file set), and the kernels check isinstance.
        spec = config.sparsity[layer_idx]
        self.s2_pattern: S2Pattern | None = None if spec == DENSE else S2Pattern.from_dict(spec)
        # The layer's key in S2LlamaModel's masks: a string, since torch.compile (torch 2.11) cannot hash a frozen
        # dataclass such as S2Pattern inside a traced forward.
        self.mask_key = FULL_ATTENTION if self.s2_pattern is None else repr(self.s2_pattern)

        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        implementation = self.config._attn_implementation
        if implementation != "eager" and kwargs.get("output_attentions", self.config.output_attentions):
            # transformers' SDPA warns and returns an empty tuple here; a silent empty answer is worse than an error.
            raise ValueError(
                f"output_attentions=True needs attention weights, which attn_implementation={implementation!r} never "
                'materializes; use attn_implementation="eager" (from_pretrained(..., attn_implementation="eager") or '
                'model.set_attn_implementation("eager")): it applies the same sparse patterns and returns the weights '
                "[B, num_heads, Tq, Tk], zero outside each head's pattern"
            )
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        projections = (self.q_proj, self.k_proj, self.v_proj)
        if use_fused_kernels(self.config.s2_backend, hidden_states) and decode_projections_fit(hidden_states,
                                                                                                projections):
            projected = linear_group(hidden_states, [projection.weight for projection in projections])
        else:
            projected = [projection(hidden_states) for projection in projections]
        query_states, key_states, value_states = (x.view(hidden_shape).transpose(1, 2) for x in projected)

        query_states, key_states = apply_rotary(query_states, key_states, *position_embeddings,
                                                backend=self.config.s2_backend)

        # ---- compact S2 cache (cache_s2_llama.py): keep only the blocks a future query reads, attend over them
        cache_layer = s2_cache_layer(cache, self.layer_idx)
        if cache_layer is not None and implementation == S2_IMPLEMENTATION:
            attn_output = attend_as_autocast_op(
                lambda query, key, value: cache_layer.update_and_attend(
                    query, key, value, self.s2_pattern, scaling=self.scaling, attention_mask=attention_mask,
                    backend=self.config.s2_backend,
                ),
                query_states, key_states, value_states,
            )
            attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1)
            if self._graphed_decode_step(attn_output):
                return linear_group(attn_output, [self.o_proj.weight], after_decode_attention=True)[0], None
            return self.o_proj(attn_output), None
        # ---- end of the compact S2 cache branch

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def _graphed_decode_step(self, attn_output: torch.Tensor) -> bool:
        """Whether o_proj runs as ``linear_group`` behind the decode attention kernel: in a decode step captured as a
        CUDA graph (the static cache's), where it runs the Gluon projection on Hopper (the step at 8 x 32k on an H200
        1.241 -> 1.202 ms; bench/NOTES.md, sixtieth session). Elsewhere it would run ``nn.Linear``'s call (see
        ``fused_triton.linear_group_fwd``), so ``nn.Linear`` is called directly: the custom op would only add its
        host time to every eager step. Under ``torch.compile`` the capture comes after tracing: ``nn.Linear``."""
        return (
            not is_torchdynamo_compiling() and capturing_cuda_graph(attn_output)
            and use_fused_kernels(self.config.s2_backend, attn_output)
            and decode_projections_fit(attn_output, (self.o_proj,))
        )


def apply_rotary(query, key, cos, sin, backend: str):
    """``apply_rotary_pos_emb``, in one fused kernel for q and k where the S2 kernels run Triton."""
    if use_fused_kernels(backend, query) and rotary_embedding_fits(query, key, cos, sin):
        return rotary_embedding(query, key, cos, sin)
    return apply_rotary_pos_emb(query, key, cos, sin)


def called_plainly(module: nn.Module) -> bool:
    """Whether calling ``module`` runs only its class's ``forward``: no hooks of its own and no ``forward`` replaced
    on the instance (as accelerate's offloading does). Only then may a fused path take over its call."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


class S2LlamaRotaryEmbedding(LlamaRotaryEmbedding):
    """``LlamaRotaryEmbedding`` (same buffers, same tables bit for bit), the tables in one kernel on CUDA where the S2
    kernels run Triton: transformers computes them with ~9 small kernels, ~15 us of a CUDA-graph decode step of the
    1B hybrid on an H200 (bench/NOTES.md, fifty-second session). The rope types whose frequencies follow the length
    (``LENGTH_DEPENDENT_ROPE_TYPES``) keep transformers' forward, which updates them."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.is_cuda and position_ids.dim() == 2 and self.rope_type not in LENGTH_DEPENDENT_ROPE_TYPES
                and use_fused_kernels(self.config.s2_backend, x)):
            return rotary_tables(position_ids, self.inv_freq, self.attention_scaling, x.dtype)
        return super().forward(x, position_ids)


class S2LlamaRMSNorm(LlamaRMSNorm):
    """``LlamaRMSNorm`` (same weight, same function), one fused kernel where the S2 kernels run Triton."""

    def __init__(self, config: S2LlamaConfig):
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)
        self.config = config

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._fused(hidden_states):
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)

    def add_and_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + hidden_states), residual + hidden_states)``: a decoder layer's residual add and this
        norm, in one kernel where the norm is fused. A module with hooks or a replaced ``forward`` is called as
        usual, so it sees what it would see in Llama."""
        if called_plainly(self) and self._fused(hidden_states) and residual.shape == hidden_states.shape:
            return add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon)
        summed = residual + hidden_states
        return self(summed), summed

    def _fused(self, hidden_states: torch.Tensor) -> bool:
        return use_fused_kernels(self.config.s2_backend, hidden_states) and hidden_states.shape[-1] <= MAX_NORM_WIDTH


class S2LlamaMLP(LlamaMLP):
    """``LlamaMLP`` (same weights), with ``silu(gate) * up`` in one fused kernel where the S2 kernels run Triton,
    and at decode sizes gate, up and SwiGLU in one launch (``decode_projections_fit``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._decode_sized(x):
            return self._decode_forward(x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self._fused(x) and gate.dtype == up.dtype:
            return self.down_proj(swiglu(gate, up))
        return self.down_proj(self.act_fn(gate) * up)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, a decoder layer's closing residual add: at decode sizes inside the down
        projection's launch (a launch of its own is ~1.5-3 us of a ~1.5 ms decode step, per layer; bench/NOTES.md),
        with the same rounding. A module with hooks or a replaced ``forward`` is called as usual, so it sees what it
        would see in Llama."""
        if called_plainly(self) and self._decode_sized(x) and residual.shape == x.shape and residual.dtype == x.dtype:
            return self._decode_forward(x, residual)
        return residual + self(x)

    def _decode_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Two launches: gate, up and SwiGLU in one, down (plus ``residual``, when given) in the other."""
        hidden = linear_swiglu(x, self.gate_proj.weight, self.up_proj.weight)
        return linear_group(hidden, [self.down_proj.weight], residual=residual)[0]

    def _fused(self, x: torch.Tensor) -> bool:
        return self.config.hidden_act in ("silu", "swish") and use_fused_kernels(self.config.s2_backend, x)

    def _decode_sized(self, x: torch.Tensor) -> bool:
        # decode_projections_fit first: while training it returns at its first check, and forward asks _fused again
        return decode_projections_fit(x, (self.gate_proj, self.up_proj, self.down_proj)) and self._fused(x)


class S2LlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: S2LlamaConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = S2LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = S2LlamaMLP(config)
        self.input_layernorm = S2LlamaRMSNorm(config)
        self.post_attention_layernorm = S2LlamaRMSNorm(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,  # the cache as S2LlamaModel passes it before transformers 5.24
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        cache = resolve_cache(cache, past_key_values)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(hidden_states, residual)
        return self.mlp.add_to(residual, hidden_states)


class S2LlamaPreTrainedModel(PreTrainedModel):
    config: S2LlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["S2LlamaDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]  # the forward kwargs that hold the cache
    _supports_flash_attn = True  # all-dense models only: sparse layers need "s2", "sdpa" or "eager"
    _supports_sdpa = True
    _supports_flex_attn = False
    _can_compile_fullgraph = True  # the kernels are custom ops; host-side work happens inside them
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": S2LlamaDecoderLayer,
        "attentions": S2LlamaAttention,
    }

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """``"s2"`` is the default (transformers picks SDPA when none is requested, and the choice is not saved in
        ``config.json``); implementations that cannot apply the sparse patterns are refused for sparse models.
        transformers' own errors (e.g. an unknown name) keep their text, with the S2 choices added after it."""
        requested = S2_IMPLEMENTATION if requested_attention is None else requested_attention
        num_sparse = self.config.layer_types.count(S2_ATTENTION)
        sparse_choices = (
            f"attn_implementation must be one of {SPARSE_CAPABLE_IMPLEMENTATIONS} for a model with sparse layers "
            f"(sparsity of {num_sparse} layers)"
        )
        hint = (
            f'S2 models: "s2" is the default (the S2 kernels); "sdpa" and "eager" apply the same sparse patterns as '
            f"references; {sparse_choices if num_sparse else 'an all-dense S2 model takes any implementation'}."
        )
        try:
            implementation = super().get_correct_attn_implementation(requested, is_init_check)
        except (ValueError, ImportError) as e:
            raise type(e)(f"{e} {hint}") from e
        if num_sparse and implementation not in SPARSE_CAPABLE_IMPLEMENTATIONS:
            raise ValueError(f"{sparse_choices}, got {requested!r}")
        return implementation

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``save_pretrained`` that also writes the remote code (through the config) and, when
        ``s2_models.model_card`` is importable and no README exists yet, a model card."""
        _write_model_card(self.config, save_directory)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload weights, config, remote code and the S2 model card in one commit (``s2_models.hub``); a
        remote-loaded copy without this package falls back to transformers' ``push_to_hub``."""
        try:
            from s2_models.hub import push_s2_model
        except ImportError:
            return super().push_to_hub(repo_id, **kwargs)
        return push_s2_model(self, repo_id, **kwargs)


def _write_model_card(config, save_directory) -> None:
    try:  # only with the package installed; the remote copy does not carry the card renderer
        from s2_models.model_card import render_model_card
    except ImportError:
        return
    path = os.path.join(save_directory, "README.md")
    if os.path.exists(path):
        return
    os.makedirs(save_directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_model_card(config))


class S2LlamaModel(S2LlamaPreTrainedModel):
    def __init__(self, config: S2LlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [S2LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = S2LlamaRMSNorm(config)
        self.rotary_emb = S2LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        warn_uncovered_offsets(config)

        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""Llama's forward. Packed sequences: pass ``position_ids`` restarting at 0 per sequence, or the flash-attn
        kwargs ``cu_seq_lens_q/k`` and ``max_length_q/k`` (``DataCollatorWithFlattening``), with no attention mask.
        The cache is ``cache`` or ``past_key_values`` (its name before transformers 5.24)."""
        cache = resolve_cache(cache, past_key_values)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None and (input_ids.is_floating_point() or input_ids.is_complex()):
            raise ValueError(f"input_ids must be integer token ids (torch.long), got dtype {input_ids.dtype}")

        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[1] == 0:
            name = "input_ids" if input_ids is not None else "inputs_embeds"
            raise ValueError(
                f"{name} must hold at least one token per row ([batch, seq_len >= 1]), got shape "
                f"{tuple((input_ids if input_ids is not None else inputs_embeds).shape)}"
            )

        # Packed sequences, read like transformers does: only without a padding mask and without a past. They get no
        # cache: its keys could not be continued as one sequence.
        cu_seqlens = None
        packed_kwargs = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
        if packed_kwargs and (cache is not None or attention_mask is not None):
            raise ValueError(
                "packed sequences (cu_seq_lens_q/cu_seq_lens_k) take neither a cache nor an attention_mask: "
                "the sequence boundaries replace both"
            )
        if attention_mask is None and cache is None:
            cu_seqlens = kwargs.get("cu_seq_lens_k")
            if cu_seqlens is None and position_ids is not None:
                cu_seqlens = packed_cu_seqlens(position_ids.expand(inputs_embeds.shape[0], -1))
                if cu_seqlens is not None and self.config._attn_implementation == S2_IMPLEMENTATION:
                    kwargs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens)  # the kernels find the lengths

        # While compiling no default cache is built: the compact cache's bookkeeping runs on the host (to compile
        # decoding, pass an S2StaticCache, as generate(cache_implementation="static") does).
        if use_cache and cache is None and cu_seqlens is None and not is_torchdynamo_compiling():
            cache = DynamicCache(config=self.config)
        if not is_torchdynamo_compiling():  # host-side checks and cache set-up (none of it is device work)
            self._check_padding_mask(attention_mask, inputs_embeds, cache)
            if cache is not None:
                set_default_rollback(cache, self.config.s2_rollback_tokens)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        masks = self._attention_masks(inputs_embeds, attention_mask, cache, position_ids, cu_seqlens)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[decoder_layer.self_attn.mask_key],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                # under transformers' name: GradientCheckpointingLayer drops the cache by that name while checkpointing
                **{CACHE_NAME: cache},
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_NAME: cache})

    @staticmethod
    def _check_padding_mask(attention_mask, inputs_embeds, cache) -> None:
        """A ``[B, T]`` padding mask must cover the cached tokens and the new ones (Llama would fail deep inside)."""
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            return
        past_seen = cache.get_seq_length() if cache is not None else 0
        expected = (inputs_embeds.shape[0], past_seen + inputs_embeds.shape[1])
        if tuple(attention_mask.shape) != expected:
            raise ValueError(
                f"attention_mask must be the [batch, past + seq_len] padding mask = {list(expected)} (past = "
                f"{past_seen} cached tokens), got {list(attention_mask.shape)}"
            )

    def _attention_masks(self, inputs_embeds, attention_mask, cache, position_ids, cu_seqlens) -> dict:
        """The mask of every layer, keyed by its ``mask_key`` (``"full_attention"`` for dense layers, one key per
        ``S2Pattern`` for sparse ones)."""
        if isinstance(attention_mask, dict):  # what generate() precomputes for transformers' compileable caches
            raise ValueError(
                "S2 models build their own masks from the [B, T] padding mask: transformers' StaticCache is not "
                'supported; use cache_implementation="static" (an S2StaticCache) or the default dynamic cache'
            )
        patterns = {  # mask key -> S2Pattern of the sparse layers
            layer.self_attn.mask_key: layer.self_attn.s2_pattern
            for layer in self.layers
            if layer.self_attn.s2_pattern is not None
        }
        if attention_mask is not None and attention_mask.dim() != 2:  # a custom 4-D mask (transformers' convention)
            if patterns:
                raise ValueError(
                    f"attention_mask of shape {tuple(attention_mask.shape)}: sparse layers build their own masks from "
                    "a [B, T] padding mask (or position_ids / cu_seq_lens for packed sequences); custom 4-D masks are "
                    "not supported"
                )
            if self.config._attn_implementation == S2_IMPLEMENTATION:
                raise ValueError(
                    f'attention_mask of shape {tuple(attention_mask.shape)}: attn_implementation="s2" takes a [B, T] '
                    'padding mask; for a custom 4-D mask use attn_implementation="sdpa" or "eager"'
                )
        if attention_mask is None and self.config._attn_implementation == S2_IMPLEMENTATION:
            return dict.fromkeys([FULL_ATTENTION, *patterns], None)  # what the "s2" mask function gives, unbuilt
        # the cache positionally: its keyword is `cache` from transformers 5.24 on, `past_key_values` before
        full_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids=position_ids)
        masks = {FULL_ATTENTION: full_mask}
        if self.config._attn_implementation == S2_IMPLEMENTATION:
            masks.update(dict.fromkeys(patterns, full_mask))  # the padding mask; the kernels apply the pattern
            return masks
        if not patterns:
            return masks

        batch_size, q_length = inputs_embeds.shape[:2]
        past_seen = cache.get_seq_length() if cache is not None else 0
        segment, position = sequence_layout(
            batch_size, past_seen + q_length, attention_mask, cu_seqlens, device=inputs_embeds.device
        )
        dtype = inputs_embeds.dtype if self.config._attn_implementation == "eager" else None
        for key, pattern in patterns.items():
            masks[key] = s2_reference_mask(
                pattern, self.config.num_attention_heads, self.config.num_key_value_heads, q_length, segment,
                position, dtype,
            )
        return masks


# Devices on which generate reads the stop flag one step late over an S2StaticCache (below). On the CPU nothing runs
# ahead of the host, so there the extra forward a late stop costs would buy nothing.
_DEFERRED_STOP_CHECK_DEVICES = frozenset({"cuda"})
_TransformersDeferredStopCheck = generation_utils.DeferredStopCheck


class _S2DeferredStopCheck(_TransformersDeferredStopCheck):
    """transformers' stop check that reads whether to stop one step late, so that the host queues the next decode
    step while the GPU runs this one; transformers uses it on MPS only. S2's generate also uses it on CUDA over an
    ``S2StaticCache``: there each step is one replayed CUDA graph, and with transformers' per-step check the GPU
    idles through the host's Python between the check's sync and the next replay (bench/NOTES.md). transformers'
    conditions still hold: never for an assistant model, and a cache that outlives ``generate`` (passed in, or
    returned) must be croppable to undo the extra step. A static cache is not, so with one of those ``generate``
    keeps the per-step check."""

    @staticmethod
    def is_supported(device: torch.device, cache: Cache | None, cache_is_returned: bool, is_assistant: bool) -> bool:
        if isinstance(cache, S2StaticCache) and device.type in _DEFERRED_STOP_CHECK_DEVICES and not is_assistant:
            return cache.is_croppable or not cache_is_returned
        return _TransformersDeferredStopCheck.is_supported(device, cache, cache_is_returned, is_assistant)


class S2LlamaForCausalLM(S2LlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: S2LlamaConfig):
        super().__init__(config)
        self.model = S2LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""Llama's causal-LM forward; see ``S2LlamaModel.forward`` for packed sequences and the cache's two names.

        Example:

        ```python
        >>> from s2_models import S2LlamaForCausalLM
        >>> model = S2LlamaForCausalLM.from_pretrained(path_to_llama_checkpoint, sparsity=hybrid_sparsity(32))
        ```

        With an ``S2StaticCache`` (``generate(..., cache_implementation="static")``), decode steps on CUDA without
        gradients replay a captured CUDA graph of this forward, unless ``generate`` is given a ``compile_config``:
        then transformers' ``torch.compile``d forward runs them."""
        cache = resolve_cache(cache, past_key_values)
        if isinstance(cache, S2StaticCache) and not is_torchdynamo_compiling() and cache.graphs_apply(
            input_ids, inputs_embeds, labels, kwargs.get("output_attentions"), kwargs.get("output_hidden_states")
        ):
            if position_ids is None:  # what S2LlamaModel would compute: the next position of every row
                position_ids = torch.full_like(input_ids, cache.get_seq_length())

            def decode_step(ids, positions):
                hidden = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
                return self.lm_head(hidden.last_hidden_state)

            logits = cache.graphed_step(decode_step, input_ids, position_ids)
            return CausalLMOutputWithPast(logits=logits, **{CACHE_NAME: cache})

        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )


    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, **kwargs):
        """transformers' input preparation, except for a decode step over an ``S2StaticCache`` (one new token per row
        after the prompt): the step's ``input_ids`` and ``position_ids`` are views of the last column, and no mask
        (S2's ``create_masks_for_generate`` drops it there: the cache holds each row's length). transformers' version
        clones both and builds a mask; with CUDA graphs those launches run between the previous step's stop check,
        which waits for the GPU, and the replay, so the GPU idles through them. The replay copies the views into its
        graph's buffers; transformers' compiled step gets contiguous copies (``get_compiled_call``). Other steps,
        caches and inputs go to transformers' version."""
        cache = kwargs.get(CACHE_NAME)
        if not (
            next_sequence_length == 1
            and not kwargs.get("is_first_iteration")
            and kwargs.keys() <= _STATIC_DECODE_KWARGS
            and isinstance(cache, S2StaticCache)
            and cache.get_seq_length() > 0
            and input_ids.get_device() == cache.layers[0].keys.get_device()  # else transformers' moves them
        ):
            return super().prepare_inputs_for_generation(input_ids, next_sequence_length, **kwargs)
        model_inputs = {key: value for key, value in kwargs.items() if key not in _DROPPED_AT_STATIC_DECODE}
        model_inputs["input_ids"] = input_ids[:, -1:]
        if (position_ids := kwargs.get("position_ids")) is not None:
            model_inputs["position_ids"] = position_ids[..., -1:]
        return model_inputs

    def _sample(self, *args, **kwargs):
        """transformers' greedy and sampling loop, which picks its stop check after the prompt; for S2 models it picks
        ``_S2DeferredStopCheck`` (which also defers over an ``S2StaticCache`` on CUDA) in place of transformers'.
        The swap is undone on return; another model's ``generate`` meanwhile would get the same decisions as with
        transformers' class, since S2's only adds cases for S2's cache."""
        generation_utils.DeferredStopCheck = _S2DeferredStopCheck
        try:
            return super()._sample(*args, **kwargs)
        finally:
            generation_utils.DeferredStopCheck = _TransformersDeferredStopCheck

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        """transformers' cache preparation; for assisted and prompt-lookup decoding the compact S2 layers of a new
        cache also keep room to roll back the drafts of the first forward (prompt plus drafts), which are then
        cropped. Later forwards keep room to crop their own tokens."""
        result = super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, *args, **kwargs
        )
        cache = model_kwargs.get(CACHE_NAME)
        if generation_mode == GenerationMode.ASSISTED_GENERATION:
            drafts = max(generation_config.prompt_lookup_num_tokens or 0, generation_config.num_assistant_tokens or 0)
            set_default_rollback(cache, max(self.config.s2_rollback_tokens, int(drafts)))
        return result

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers compiles the decode steps over any compileable cache on CUDA; over an ``S2StaticCache`` only
        when ``compile_config`` is given: by default the cache replays its own CUDA graphs."""
        if isinstance(model_kwargs.get(CACHE_NAME), S2StaticCache) and generation_config.compile_config is None:
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def get_compiled_call(self, compile_config):
        """transformers' compiled forward; over an ``S2StaticCache`` the layers' Python bookkeeping (room, token
        counts), which the compiled step skips, runs around it."""
        compiled_call = super().get_compiled_call(compile_config)

        def call(*args, **kwargs):
            cache = kwargs.get(CACHE_NAME)
            if not isinstance(cache, S2StaticCache):
                return compiled_call(*args, **kwargs)
            new_tokens = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
            for name in ("input_ids", "position_ids"):  # views from prepare_inputs_for_generation: fixed strides
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name].clone(memory_format=torch.contiguous_format)
            with cache.compiled_step(new_tokens.shape[1]):
                return compiled_call(*args, **kwargs)

        return call

    def create_masks_for_generate(
        self, config, inputs_embeds, attention_mask, cache=None, *args, past_key_values=None, **kwargs
    ):
        """What ``generate`` passes as the mask over a compileable cache. Over an ``S2StaticCache``: the ``[B, T]``
        padding mask for the prompt, nothing for decode steps (one real token per row; the cache holds each row's
        length), so that compiled steps take inputs of one shape. Other caches get transformers' masks. The cache
        comes as ``cache`` (transformers >= 5.24) or ``past_key_values``, by keyword or 4th positionally."""
        cache = resolve_cache(cache, past_key_values)
        if not isinstance(cache, S2StaticCache):
            return create_masks_for_generate(config, inputs_embeds, attention_mask, cache, *args, **kwargs)
        return None if cache.get_seq_length() > 0 else attention_mask

    def _prepare_static_cache(self, cache_implementation, batch_size, max_cache_len, prefill_chunk_size, model_kwargs):
        """``generate(..., cache_implementation="static")`` gets an ``S2StaticCache`` (transformers' ``StaticCache``
        would keep every key of the sparse layers)."""
        if cache_implementation != "static":
            raise ValueError(
                f'S2 models support cache_implementation="static" (an S2StaticCache) or the default dynamic cache, '
                f"got {cache_implementation!r}"
            )
        if self.config._attn_implementation != S2_IMPLEMENTATION:
            raise ValueError(
                'cache_implementation="static" needs attn_implementation="s2" (its decode kernel reads the static '
                f'cache); the reference implementation {self.config._attn_implementation!r} needs the dynamic cache'
            )
        if prefill_chunk_size is not None:
            raise ValueError(
                "prefill_chunk_size needs the default dynamic cache: a static S2 cache takes one token per step after "
                "the prompt"
            )
        return S2StaticCache(self.config.get_text_config(decoder=True), max_cache_len=max_cache_len)


# ---------------------------------------------------------------------------------------------- task heads
# Llama's heads: transformers' generic ones (pooling, losses, outputs: the same forward in transformers 5.17 to 5.24;
# from 5.24 on they pass the cache to the body as ``cache``, which S2LlamaModel takes as it takes ``past_key_values``).
# Their __init__ is replaced only to build the body as S2LlamaModel(config): the generic one goes through
# AutoModel.from_config, which in a remote-code checkpoint (loaded without this package) never finds the body as local
# code (transformers loads the config and the modeling file with separate copies of the config class) and asks for
# trust_remote_code again. The head layers are the generic ones'.
class S2LlamaForSequenceClassification(GenericForSequenceClassification, S2LlamaPreTrainedModel):
    def __init__(self, config: S2LlamaConfig):
        S2LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = S2LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class S2LlamaForTokenClassification(GenericForTokenClassification, S2LlamaPreTrainedModel):
    def __init__(self, config: S2LlamaConfig):
        S2LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = S2LlamaModel(config)
        dropout = getattr(config, "classifier_dropout", None)
        dropout = getattr(config, "hidden_dropout", None) if dropout is None else dropout
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels,
                               bias=getattr(config, "token_classification_bias", True))
        self.post_init()


class S2LlamaForQuestionAnswering(GenericForQuestionAnswering, S2LlamaPreTrainedModel):
    def __init__(self, config: S2LlamaConfig):
        S2LlamaPreTrainedModel.__init__(self, config)
        self.model = S2LlamaModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


__all__ = [
    "S2CoverageWarning",
    "S2LlamaForCausalLM",
    "S2LlamaForQuestionAnswering",
    "S2LlamaForSequenceClassification",
    "S2LlamaForTokenClassification",
    "S2LlamaModel",
    "S2LlamaPreTrainedModel",
]
