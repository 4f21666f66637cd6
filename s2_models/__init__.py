"""S2-Attention models for Hugging Face Transformers.

Importing this package registers the S2Llama family with the Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForCausalLM``, ``AutoModelForSequenceClassification``, ``AutoModelForTokenClassification``,
``AutoModelForQuestionAnswering``), so saved checkpoints load by ``model_type`` without ``trust_remote_code``.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_s2_llama import S2LlamaConfig, hybrid_sparsity
from .kernels import S2Pattern, s2_attention
from .modeling_s2_llama import (
    S2CoverageWarning,
    S2LlamaForCausalLM,
    S2LlamaForQuestionAnswering,
    S2LlamaForSequenceClassification,
    S2LlamaForTokenClassification,
    S2LlamaModel,
    S2LlamaPreTrainedModel,
)

AutoConfig.register(S2LlamaConfig.model_type, S2LlamaConfig)
AutoModel.register(S2LlamaConfig, S2LlamaModel)
AutoModelForCausalLM.register(S2LlamaConfig, S2LlamaForCausalLM)
AutoModelForSequenceClassification.register(S2LlamaConfig, S2LlamaForSequenceClassification)
AutoModelForTokenClassification.register(S2LlamaConfig, S2LlamaForTokenClassification)
AutoModelForQuestionAnswering.register(S2LlamaConfig, S2LlamaForQuestionAnswering)

__all__ = [
    "S2CoverageWarning",
    "S2LlamaConfig",
    "S2LlamaForCausalLM",
    "S2LlamaForQuestionAnswering",
    "S2LlamaForSequenceClassification",
    "S2LlamaForTokenClassification",
    "S2LlamaModel",
    "S2LlamaPreTrainedModel",
    "S2Pattern",
    "hybrid_sparsity",
    "s2_attention",
]
