"""Fine-tune or continually pretrain an S2Llama model with the Hugging Face ``Trainer`` on the local text.

The model comes from a dense Llama checkpoint (converted with ``--sparsity``), an S2Llama checkpoint (continued
as saved, unless ``--sparsity`` is given) or a fresh config (``--config_overrides``). Documents are tokenized,
cut into ``--max_seq_length`` chunks and packed without padding by
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: every batch is one row whose sequence boundaries
reach the S2 kernels as ``cu_seqlens``. bf16 mixed precision is on by default on GPUs that support it. The model
(with its remote code and model card) and tokenizer are saved to ``--output_dir`` at the end.

Examples::

    # SmolLM2-135M converted to the short-context S2 hybrid, 200 steps on a GPU
    python -m s2_models.training.train --model_name_or_path smollm2 --sparsity hybrid --dense_layers 0,1 \\
        --pattern '{"block_size": 16, "local_blocks": 4, "vert_stride": 8}' --max_seq_length 1024 \\
        --output_dir outputs/smollm2-s2 --max_steps 200 --per_device_train_batch_size 8 --learning_rate 2e-5

    # a tiny fresh model with the cached tiny tokenizer (CPU smoke test)
    python -m s2_models.training.train --tokenizer_name_or_path tiny \\
        --config_overrides hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,\\
    num_key_value_heads=2,head_dim=16 --output_dir outputs/tiny --max_steps 5 --max_seq_length 128
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch

SPARSITY_CHOICES = ("hybrid", "dense", "keep")  # or a JSON list / dict; "keep": an S2Llama checkpoint's own


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Llama or S2Llama checkpoint (dir or Hub id), 'smollm2' for the cached SmolLM2-135M, "
                          "or unset for a fresh model built from --config_overrides"},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "comma-separated key=value config fields, e.g. hidden_size=64,num_hidden_layers=2"},
    )
    sparsity: str = field(
        default="keep",
        metadata={"help": "'hybrid' (--dense_layers dense, the others --pattern), 'dense', a JSON list/dict of "
                          "per-layer specs, or 'keep' (an S2Llama checkpoint's own; 'hybrid' for other models)"},
    )
    pattern: str | None = field(default=None, metadata={"help": "JSON dict of S2Pattern fields for 'hybrid'"})
    dense_layers: str = field(default="0,1", metadata={"help": "comma-separated dense layer indices for 'hybrid'"})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "default: the model's; 'tiny': a cached byte-level BPE trained on the text"}
    )
    attn_implementation: str = field(default="s2", metadata={"help": "'s2', or the references 'sdpa' / 'eager'"})
    precision: str = field(default="auto", metadata={"help": "'auto' (bf16 on a GPU that has it), 'bf16' or 'fp32'"})


@dataclass
class DataArguments:
    max_seq_length: int = field(default=1024, metadata={"help": "tokens per packed sequence chunk"})
    max_train_documents: int | None = field(default=None, metadata={"help": "cap on training documents"})
    max_eval_documents: int | None = field(default=16, metadata={"help": "held-out documents for evaluation"})


def parse_sparsity(spec: str, num_layers: int, pattern: str | None, dense_layers: str):
    """``--sparsity`` as a config value (``None`` for ``"keep"``)."""
    from s2_models import hybrid_sparsity

    if spec == "keep":
        return None
    if spec == "dense":
        return "dense"
    if spec == "hybrid":
        layers = [int(i) for i in dense_layers.split(",") if i.strip()]
        return hybrid_sparsity(num_layers, json.loads(pattern) if pattern else None, dense_layers=layers)
    try:
        return json.loads(spec)
    except json.JSONDecodeError:
        raise ValueError(f"--sparsity must be one of {SPARSITY_CHOICES} or JSON, got {spec!r}") from None


def parse_overrides(overrides: str | None) -> dict:
    """``"a=1,b=x"`` -> ``{"a": 1, "b": "x"}`` (values parsed as JSON when they are JSON)."""
    parsed = {}
    for item in (overrides or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config_overrides entries must be key=value, got {item!r}")
        try:
            parsed[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key.strip()] = value
    return parsed


def load_tokenizer(model_args: ModelArguments):
    from transformers import AutoTokenizer

    from s2_models import smollm2
    from s2_models.training.tokenizer import load_tiny_tokenizer

    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if name is None:
        raise ValueError("a fresh model needs --tokenizer_name_or_path (a tokenizer dir or 'tiny')")
    if name == "tiny":
        return load_tiny_tokenizer()
    if name == "smollm2":
        return smollm2.load_tokenizer()
    return AutoTokenizer.from_pretrained(name)


def build_model(model_args: ModelArguments, vocab_size: int, dtype: torch.dtype):
    """The S2Llama model to train: converted, continued or fresh (see the module docstring)."""
    from transformers import AutoConfig

    from s2_models import S2LlamaConfig, S2LlamaForCausalLM
    from s2_models.smollm2 import SOURCE_NAME, smollm2_llama_dir

    overrides = parse_overrides(model_args.config_overrides)
    common = {"attn_implementation": model_args.attn_implementation, "dtype": dtype}
    if model_args.model_name_or_path is None:
        num_layers = overrides.get("num_hidden_layers", S2LlamaConfig().num_hidden_layers)
        sparsity = parse_sparsity(model_args.sparsity, num_layers, model_args.pattern, model_args.dense_layers)
        config = S2LlamaConfig(vocab_size=vocab_size, sparsity=sparsity, **overrides)
        return S2LlamaForCausalLM._from_config(config, **common)

    path = smollm2_llama_dir() if model_args.model_name_or_path == "smollm2" else model_args.model_name_or_path
    source = AutoConfig.from_pretrained(path, trust_remote_code=True)
    num_layers = overrides.get("num_hidden_layers", source.num_hidden_layers)
    spec = model_args.sparsity
    if spec == "keep" and getattr(source, "model_type", None) != S2LlamaConfig.model_type:
        spec = "hybrid"  # a dense checkpoint has no sparsity to keep
    sparsity = parse_sparsity(spec, num_layers, model_args.pattern, model_args.dense_layers)
    if sparsity is not None:
        overrides["sparsity"] = sparsity
    model = S2LlamaForCausalLM.from_pretrained(path, **overrides, **common)
    if source.model_type != S2LlamaConfig.model_type:  # provenance for the model card (saved in config.json)
        model.config.converted_from = SOURCE_NAME if model_args.model_name_or_path == "smollm2" else str(path)
    return model


def tokenize_documents(dataset, tokenizer, max_seq_length: int):
    """Documents -> ``input_ids`` chunks of at most ``max_seq_length`` tokens (each document ends with EOS)."""
    if max_seq_length < 2:
        raise ValueError(f"--max_seq_length must be >= 2, got {max_seq_length}")
    eos = tokenizer.eos_token_id

    def chunk(batch):
        chunks = []
        for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]:
            ids = ids + ([eos] if eos is not None else [])
            chunks.extend(ids[i : i + max_seq_length] for i in range(0, len(ids), max_seq_length))
        return {"input_ids": [c for c in chunks if len(c) >= 2]}

    return dataset.map(chunk, batched=True, remove_columns=dataset.column_names)


def resolve_precision(precision: str, training_args):
    """Set bf16 mixed precision on the training arguments; returns the dtype to load master weights in."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"--precision must be one of ('auto', 'bf16', 'fp32'), got {precision!r}")
    use_bf16 = precision == "bf16" or (
        precision == "auto" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    )
    if use_bf16 != training_args.bf16:
        training_args = dataclasses.replace(training_args, bf16=use_bf16)
    return training_args, torch.float32  # fp32 master weights; autocast computes in bf16


def main(argv=None):
    from transformers import DataCollatorWithFlattening, HfArgumentParser, Trainer, TrainingArguments

    from s2_models.model_card import render_model_card
    from s2_models.training.data import text_dataset

    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    training_args, dtype = resolve_precision(model_args.precision, training_args)

    tokenizer = load_tokenizer(model_args)
    model = build_model(model_args, len(tokenizer), dtype)
    length = data_args.max_seq_length
    train = tokenize_documents(text_dataset("train", data_args.max_train_documents), tokenizer, length)
    held_out = tokenize_documents(text_dataset("heldout", data_args.max_eval_documents), tokenizer, length)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
        processing_class=tokenizer,
    )
    train_result = trainer.train()
    eval_metrics = trainer.evaluate()
    metrics = {
        "training steps": train_result.global_step,
        "final training loss": train_result.training_loss,
        "held-out loss": eval_metrics["eval_loss"],
        "held-out perplexity": math.exp(eval_metrics["eval_loss"]),
    }
    trainer.log_metrics("final", metrics)
    if trainer.is_world_process_zero():
        # Written before save_model so that the card carries the metrics (save_pretrained keeps an existing README).
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write(render_model_card(model.config, metrics))
    trainer.save_model(training_args.output_dir)
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
