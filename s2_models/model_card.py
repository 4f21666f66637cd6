"""The README.md (Hub model card) of a saved S2Llama checkpoint.

``render_model_card(config, metrics)`` fills ``model_cards/s2_llama.md`` (installed as ``s2_models.model_cards``)
with what the config knows: the per-layer sparsity table and its density, the model shape and where the weights
came from. ``save_pretrained`` writes it, so ``push_to_hub`` uploads it in the same commit as the weights.
"""

from __future__ import annotations

import importlib.resources
import string
from collections.abc import Mapping
from functools import lru_cache

from .kernels.pattern import S2Pattern

TEMPLATE_NAME = "s2_llama.md"
DENSITY_LENGTHS = (512, 2048)  # the context lengths at which the card reports each layer's kept fraction
_PATTERN_COLUMNS = S2Pattern.field_names()


def render_model_card(config, metrics: Mapping[str, object] | None = None) -> str:
    """Markdown model card of an ``S2LlamaConfig`` checkpoint.

    Args:
        config: the model's ``S2LlamaConfig`` (reads ``sparsity``, head counts, sizes, ``converted_from`` or
            ``_name_or_path``).
        metrics: optional measurements of this checkpoint, ``{"name": value}`` (e.g.
            ``{"held-out perplexity (512 tokens)": 21.3}``); numbers are shown with 4 significant digits.
    """
    if metrics is not None and not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a mapping of name -> value or None, got {type(metrics).__name__}")
    sparsity = list(config.sparsity)
    if len(sparsity) != config.num_hidden_layers:
        raise ValueError(f"config.sparsity has {len(sparsity)} entries, num_hidden_layers={config.num_hidden_layers}")
    base_model = getattr(config, "converted_from", None)  # set by the converting loaders; absent when trained as S2
    fields = {
        "model_name": _model_name(config),
        "base_model_front_matter": f"base_model: {base_model}\n" if _is_hub_id(base_model) else "",
        "derivation": _derivation(config, base_model),
        "sparsity_summary": _sparsity_summary(config),
        "sparsity_table": _sparsity_table(config),
        "shape": (
            f"{config.num_hidden_layers} layers, hidden size {config.hidden_size}, {config.num_attention_heads} "
            f"query heads and {config.num_key_value_heads} KV heads of dim {config.head_dim}, vocabulary "
            f"{config.vocab_size}, {config.max_position_embeddings} positions"
        ),
        "metrics_section": _metrics_section(metrics),
    }
    return string.Template(_template()).substitute(fields)


@lru_cache(maxsize=1)
def _template() -> str:
    return importlib.resources.files("s2_models.model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")


def layer_density(spec, config, seq_len: int) -> float:
    """Fraction of the causal query-key pairs one layer computes at ``seq_len`` tokens (1.0 for dense)."""
    if spec == "dense":
        return 1.0
    return _kept_fraction(tuple(sorted(spec.items())), config.num_attention_heads, config.num_key_value_heads, seq_len)


def model_density(config, seq_len: int) -> float:
    """Mean over layers of ``layer_density``: the share of dense attention work the model does."""
    return sum(layer_density(spec, config, seq_len) for spec in config.sparsity) / config.num_hidden_layers


@lru_cache(maxsize=64)
def _kept_fraction(items: tuple, num_q_heads: int, num_kv_heads: int, seq_len: int) -> float:
    pattern = S2Pattern.from_dict(dict(items))
    return pattern.kept_fraction(pattern.num_pattern_heads(num_q_heads, num_kv_heads), seq_len)


def _model_name(config) -> str:
    name = str(getattr(config, "_name_or_path", "") or "").rstrip("/").split("/")[-1]
    return name or "S2Llama model"


def _is_hub_id(name) -> bool:
    return isinstance(name, str) and name.count("/") == 1 and " " not in name and not name.startswith((".", "/"))


def _derivation(config, base_model) -> str:
    if base_model:
        return (
            f"Converted from the dense Llama checkpoint {base_model} with "
            "`S2LlamaForCausalLM.from_pretrained(llama_checkpoint, sparsity=...)`: every weight is copied unchanged "
            "and only the attention of the sparse layers below is restricted to its S2 pattern. Unless this card's "
            "evaluation says otherwise, the converted model was not retrained after the conversion."
        )
    return (
        "Trained as an S2Llama model (no dense source checkpoint is recorded in its config: `converted_from` is "
        "unset)."
    )


def _sparsity_summary(config) -> str:
    n = config.num_hidden_layers
    dense = [i for i, spec in enumerate(config.sparsity) if spec == "dense"]
    densities = ", ".join(f"{model_density(config, length):.2f} at {length} tokens" for length in DENSITY_LENGTHS)
    dense_text = f"layers {', '.join(map(str, dense))} dense" if dense else "no dense layer"
    return (
        f"{n} layers: {n - len(dense)} S2-sparse, {dense_text}. Attention work relative to dense (mean over "
        f"layers): {densities}. Sparse layers run with `attn_implementation=\"s2\"` (backend "
        f"`{getattr(config, 's2_backend', 'auto')}`)."
    )


def _sparsity_table(config) -> str:
    columns = ["layer", "attention", *_PATTERN_COLUMNS, f"kept at {' / '.join(map(str, DENSITY_LENGTHS))} tokens"]
    header = "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"
    return "\n".join([header] + [_layer_row(i, spec, config) for i, spec in enumerate(config.sparsity)])


def _layer_row(index: int, spec, config) -> str:
    kept = " / ".join(f"{layer_density(spec, config, length):.2f}" for length in DENSITY_LENGTHS)
    if spec == "dense":
        cells = ["dense"] + ["-"] * len(_PATTERN_COLUMNS)
    else:
        cells = ["S2"] + [_cell(spec.get(name)) for name in _PATTERN_COLUMNS]
    return f"| {index} | " + " | ".join(cells) + f" | {kept} |"


def _cell(value) -> str:
    return "-" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _metrics_section(metrics) -> str:
    if not metrics:
        return "No measurements are recorded for this checkpoint itself; see the family's reference numbers below."
    rows = "\n".join(f"| {name} | {_format(value)} |" for name, value in metrics.items())
    return f"Measured on this checkpoint:\n\n| metric | value |\n|---|---|\n{rows}"


def _format(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
