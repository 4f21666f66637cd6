"""Configuration of the S2Llama family: Llama with S2-Attention (Sparsely-Sharded attention, arXiv 2407.17678).

Self-contained on purpose (transformers + the flat kernel files only): it is copied next to the weights of every
saved checkpoint so that ``trust_remote_code`` loading works without this package installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .cache_s2_llama import DEFAULT_ROLLBACK_TOKENS, check_rollback_tokens
from .kernels.interface import BACKENDS
from .kernels.pattern import S2Pattern
from .remote_code import export_remote_code

DENSE = "dense"
FULL_ATTENTION = "full_attention"
S2_ATTENTION = "s2_attention"
LAYER_TYPES = (FULL_ATTENTION, S2_ATTENTION)
# Fields derived from, or validated against, ``sparsity``: they must reach ``__post_init__`` together.
_STRUCTURAL_FIELDS = ("sparsity", "layer_types", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "hidden_size", "head_dim", "attention_dropout")


def hybrid_sparsity(
    num_layers: int,
    pattern: S2Pattern | dict | None = None,
    *,
    dense_layers: Iterable[int] | None = None,
    dense_every: int | None = None,
) -> list[str | dict]:
    """Per-layer ``sparsity`` of a hybrid model: a few dense layers, all others sparse with ``pattern``.

    The S2-Attention paper finds that a handful of dense layers recovers dense quality at a fraction of its cost
    (the "HHST" recipe: heterogeneous heads, hybrid sparse and dense layers). Dense layers are chosen by index,
    by period, or both (their union)::

        hybrid_sparsity(8)                                  # layers 0 and 1 dense (the default), 2..7 sparse
        hybrid_sparsity(8, dense_layers=(0, 1, 7))          # the first two and the last layer dense
        hybrid_sparsity(8, dense_every=4)                   # layers 0 and 4 dense
        hybrid_sparsity(32, {"block_size": 64, "local_blocks": 16, "vert_stride": 16}, dense_layers=(0, 1))

    Args:
        num_layers: number of decoder layers (``num_hidden_layers``), >= 1.
        pattern: the ``S2Pattern`` (or a dict of its fields) of every sparse layer; default ``S2Pattern()``
            (``block_size=64, local_blocks=16, vert_stride=16``).
        dense_layers: indices in ``[0, num_layers)`` of the dense layers. Default ``(0, 1)`` when ``dense_every``
            is not given either.
        dense_every: ``k >= 1``: layers ``0, k, 2k, ...`` are dense.

    Returns:
        A normalized ``sparsity`` list for ``S2LlamaConfig``: ``"dense"`` or a full dict of ``S2Pattern`` fields.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    pattern_dict = _pattern_from_spec(S2Pattern() if pattern is None else pattern, "pattern").to_dict()
    if dense_layers is None and dense_every is None:
        dense_layers = (0, 1)
    dense = set()
    for index in dense_layers or ():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_layers:
            raise ValueError(f"dense_layers entries must be layer indices in [0, {num_layers}), got {index!r}")
        dense.add(index)
    if dense_every is not None:
        if isinstance(dense_every, bool) or not isinstance(dense_every, int) or dense_every < 1:
            raise ValueError(f"dense_every must be an integer >= 1, got {dense_every!r}")
        dense.update(range(0, num_layers, dense_every))
    return [DENSE if i in dense else dict(pattern_dict) for i in range(num_layers)]


def _pattern_from_spec(spec, where: str) -> S2Pattern:
    if isinstance(spec, S2Pattern):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(
            f'{where} must be "dense" or a dict of S2Pattern fields {S2Pattern.field_names()}, got {spec!r}'
        )
    try:
        return S2Pattern.from_dict(spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


@strict
class S2LlamaConfig(LlamaConfig):
    r"""Configuration of an S2Llama model: a ``LlamaConfig`` plus the per-layer S2-Attention sparsity.

    sparsity (`list`, `dict` or `"dense"`, *optional*):
        One entry per layer: ``"dense"`` or a dict of ``S2Pattern`` fields (``block_size``, ``local_blocks``,
        ``vert_stride``, ``homo_head``, ``head_sliding_step``, ``head_sliding_offset``, ``num_dense_heads``,
        ``per_query_head``). A single dict (or ``"dense"``) applies to every layer. Stored normalized: a list with
        one ``"dense"`` or full dict per layer. Default: ``hybrid_sparsity(num_hidden_layers)``, the paper's hybrid
        with layers 0 and 1 dense and the others ``S2Pattern()`` (``block_size=64, local_blocks=16,
        vert_stride=16``). Build hybrids with ``s2_models.hybrid_sparsity``.
    layer_types (`list[str]`, *optional*):
        ``"full_attention"`` (dense) or ``"s2_attention"`` (sparse) per layer, what caches and masks read. Derived
        from ``sparsity``; when given it must agree with it. Given alone, its ``"s2_attention"`` layers get the
        default ``S2Pattern()``.
    s2_backend (`str`, *optional*, defaults to `"auto"`):
        Backend of the sparse layers under ``attn_implementation="s2"``: ``"auto"`` (Triton on CUDA, the exact
        PyTorch path elsewhere), ``"triton"`` or ``"torch"``. Where it runs Triton, every layer's RMSNorms, rotary
        embedding and ``silu(gate) * up`` also run as one fused kernel each (the same function as Llama's, to
        rounding); ``"torch"`` keeps transformers' Llama code for them.
    s2_rollback_tokens (`int`, *optional*, defaults to 64):
        How many of the newest tokens the compact KV cache of a sparse layer can drop again with ``crop`` (assisted
        and prompt-lookup decoding): eviction runs this many tokens behind, at a cost of ``cdiv(s2_rollback_tokens,
        block_size)`` extra blocks per KV head and sparse layer. ``generate`` raises it to the drafts it makes.

    Example:

    ```python
    >>> from s2_models import S2LlamaConfig, hybrid_sparsity
    >>> pattern = {"block_size": 64, "local_blocks": 16, "vert_stride": 16}
    >>> config = S2LlamaConfig(num_hidden_layers=4, sparsity=hybrid_sparsity(4, pattern, dense_layers=(0, 3)))
    >>> config.layer_types
    ['full_attention', 's2_attention', 's2_attention', 'full_attention']
    ```
    """

    model_type = "s2_llama"

    sparsity: list[str | dict] | dict | str | None = None
    layer_types: list[str] | None = None
    s2_backend: str = "auto"
    s2_rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of num_key_value_heads="
                f"{self.num_key_value_heads} (each KV head serves a group of query heads)"
            )
        check_rollback_tokens(self.s2_rollback_tokens)
        self.sparsity = self._normalized_sparsity()
        derived = [FULL_ATTENTION if spec == DENSE else S2_ATTENTION for spec in self.sparsity]
        if self.layer_types is not None and list(self.layer_types) != derived:
            raise ValueError(
                f"layer_types {list(self.layer_types)} contradicts sparsity (which gives {derived}); pass only "
                "sparsity, layer_types is derived from it"
            )
        self.layer_types = derived
        self._check_kernel_constraints()

    # ------------------------------------------------------------------ validation
    def _normalized_sparsity(self) -> list[str | dict]:
        n = self.num_hidden_layers
        spec = self.sparsity
        if spec is None and self.layer_types is not None:
            self._check_layer_types()
            return [DENSE if t == FULL_ATTENTION else S2Pattern().to_dict() for t in self.layer_types]
        if spec is None:
            return hybrid_sparsity(n)
        if isinstance(spec, (str, dict)):
            spec = [spec] * n
        if len(spec) != n:
            raise ValueError(f"sparsity must have one entry per layer (num_hidden_layers={n}), got {len(spec)} entries")
        normalized = []
        for i, entry in enumerate(spec):
            if entry == DENSE:
                normalized.append(DENSE)
            elif isinstance(entry, str):
                raise ValueError(f'sparsity[{i}] must be "dense" or a dict of S2Pattern fields, got {entry!r}')
            else:
                normalized.append(_pattern_from_spec(entry, f"sparsity[{i}]").to_dict())
        return normalized

    def _check_layer_types(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must have num_hidden_layers={self.num_hidden_layers} entries, got {len(self.layer_types)}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {unknown}")

    def _check_kernel_constraints(self) -> None:
        if self.s2_backend not in BACKENDS:
            raise ValueError(f"s2_backend must be one of {BACKENDS}, got {self.s2_backend!r}")
        patterns = self.layer_patterns()
        if not any(patterns):
            return
        d = self.head_dim
        if d < 16 or d > 256 or d % 16:
            raise ValueError(
                f"head_dim must be a multiple of 16 in [16, 256] when a layer is sparse (the S2 kernels' tiles), "
                f"got {d}"
            )
        if self.attention_dropout:
            raise ValueError(
                f"attention_dropout must be 0 when a layer is sparse (the S2 kernels have no dropout), got "
                f"{self.attention_dropout}"
            )
        hq, hkv = self.num_attention_heads, self.num_key_value_heads
        for i, pattern in enumerate(patterns):
            if pattern is None:
                continue
            num_heads = pattern.num_pattern_heads(hq, hkv)
            if pattern.num_dense_heads > num_heads:
                which = "query heads" if pattern.per_query_head else "KV heads (pattern heads are KV heads)"
                raise ValueError(
                    f"sparsity[{i}]: num_dense_heads must be in [0, {num_heads}] (the {which}), "
                    f"got {pattern.num_dense_heads}"
                )

    def validate_layer_type(self):
        """Part of ``@strict`` validation: ``layer_types`` holds this family's own types, checked against
        ``sparsity`` (transformers' generic check would refuse ``"s2_attention"``)."""
        self._check_layer_types()
        if [t == S2_ATTENTION for t in self.layer_types] != [s != DENSE for s in self.sparsity]:
            raise ValueError(f"layer_types {self.layer_types} contradicts sparsity")

    # ------------------------------------------------------------------ accessors
    def layer_patterns(self) -> list[S2Pattern | None]:
        """The ``S2Pattern`` of every layer, ``None`` for dense layers."""
        return [None if spec == DENSE else S2Pattern.from_dict(spec) for spec in self.sparsity]

    # ------------------------------------------------------------------ construction, serialization
    @classmethod
    def from_llama(cls, llama_config: LlamaConfig, sparsity=None, **kwargs) -> S2LlamaConfig:
        """The S2Llama config of a (dense) Llama model, for continual pretraining with sparse layers.

        ``sparsity`` as in the constructor (default: the hybrid recipe); other ``kwargs`` override config fields.
        """
        if not isinstance(llama_config, LlamaConfig):
            raise ValueError(f"llama_config must be a LlamaConfig, got {type(llama_config).__name__}")
        config_dict = llama_config.to_dict()
        for key in ("model_type", "architectures", "auto_map", "layer_types", "transformers_version"):
            config_dict.pop(key, None)
        return cls.from_dict(config_dict, sparsity=sparsity, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> S2LlamaConfig:
        # transformers sets kwargs with setattr *after* construction; sparsity and the fields it is derived from or
        # checked against must instead go through __post_init__ together.
        config_dict = dict(config_dict)
        if "sparsity" in kwargs and "layer_types" not in kwargs:
            config_dict.pop("layer_types", None)  # derived from the old sparsity
        for key in _STRUCTURAL_FIELDS:
            if key in kwargs:
                config_dict[key] = kwargs.pop(key)
        return super().from_dict(config_dict, **kwargs)

    def to_diff_dict(self) -> dict[str, Any]:
        # Always spell the sparsity out in config.json, even where it equals the default. layer_types is derived
        # from it and left out: transformers reads a checkpoint's config.json with its generic config class in places
        # (Trainer's resume_from_checkpoint), whose layer-type check refuses "s2_attention".
        diff = super().to_diff_dict()
        diff.pop("layer_types", None)
        diff.update(sparsity=self.sparsity)
        return diff

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """Save ``config.json`` and the remote code (``auto_map``) so ``trust_remote_code`` loading works."""
        export_remote_code(self, save_directory)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)


__all__ = ["S2LlamaConfig", "hybrid_sparsity"]
