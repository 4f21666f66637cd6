"""Train an S2Llama causal LM with the Hugging Face ``Trainer``: ``s2-train`` or ``python -m s2_models.training.train``.

The arguments are those of transformers' ``examples/pytorch/language-modeling/run_clm.py`` (model, data and every
``TrainingArguments`` flag) plus the S2 ones (``--sparsity``, ``--pattern``, ``--dense_layers``) and ``--packing``.

Model: a dense Llama checkpoint (converted with ``--sparsity``, the hybrid recipe by default), an S2Llama checkpoint
(continued as saved unless ``--sparsity`` is given), or a fresh model from ``--config_name`` or the default
``S2LlamaConfig``, changed by ``--config_overrides``. Weights stay float32; ``--bf16`` / ``--fp16`` train under
autocast as ``Trainer`` does.

Data: ``--train_file`` / ``--validation_file`` (text, json, jsonl or csv; several files of one format each),
``--dataset_name`` (a ``save_to_disk`` folder, a local dataset folder or a dataset in the local ``datasets`` cache),
or by default the bundled documentation text (``s2_models.training.data``). Nothing is fetched from the Hub unless
``--allow_download`` is given. Without a validation set, ``--validation_split_percentage`` of the training rows are
held out. Each document (a text file's blank-line-separated paragraph, a json/csv row) ends with EOS and is cut into
chunks of ``--block_size`` tokens; chunks never span two documents.

Batches: ``--packing`` (default) concatenates a batch's chunks into one row without padding
(``DataCollatorWithFlattening``); the sequence boundaries reach the S2 kernels as ``cu_seqlens``. ``--packing false``
pads the chunks of a batch to the longest on the right instead. Both see the same tokens and give the same loss.

At the end the model (with its remote code and a model card carrying the metrics), the tokenizer, the metrics and the
trainer state are saved to ``--output_dir``. On GPUs the train metrics include ``train_peak_memory_gib``: the peak of
``torch.cuda.max_memory_allocated`` during training on the fullest GPU of all processes (GiB; tensors only, without
the allocator's cached blocks). ``--do_train`` / ``--do_eval`` select the phases as in run_clm; with
neither, the script trains, then evaluates when there is validation data.

Examples::

    # SmolLM2-135M converted to the short-context S2 hybrid, on the user's jsonl files, one GPU
    s2-train --model_name_or_path smollm2 --sparsity hybrid --dense_layers 0,1 \\
        --pattern '{"block_size": 16, "local_blocks": 4, "vert_stride": 8}' --block_size 1024 \\
        --train_file data/train.jsonl --validation_file data/val.jsonl --bf16 \\
        --output_dir outputs/smollm2-s2 --max_steps 200 --per_device_train_batch_size 8 --learning_rate 2e-5

    # a tiny fresh model with the cached tiny tokenizer on the bundled text (CPU smoke test)
    s2-train --tokenizer_name tiny --config_overrides hidden_size=64,intermediate_size=128,num_hidden_layers=3,\\
    num_attention_heads=4,num_key_value_heads=2,head_dim=16 --output_dir outputs/tiny --max_steps 5 --block_size 128
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DataCollatorWithFlattening,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity, smollm2
from s2_models.model_card import render_model_card
from s2_models.training.data import load_text_splits
from s2_models.training.tokenizer import load_tiny_tokenizer

SPARSITY_CHOICES = ("hybrid", "dense", "keep")  # or a JSON list / dict; "keep": an S2Llama checkpoint's own
DEFAULT_BLOCK_SIZE = 1024  # run_clm's cap when --block_size is not given


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Llama or S2Llama checkpoint (folder or Hub id), 'smollm2' for the cached SmolLM2-135M, "
                          "or unset to train a fresh model from --config_name / --config_overrides"},
    )
    config_name: str | None = field(
        default=None, metadata={"help": "config (folder or Hub id, Llama or S2Llama) of a fresh model"}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "comma-separated key=value config fields, e.g. hidden_size=64,num_hidden_layers=2"},
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "tokenizer folder or Hub id (default: the model's); 'tiny': a cached byte-level BPE "
                          "trained on the bundled text; 'smollm2': SmolLM2's"},
    )
    sparsity: str = field(
        default="keep",
        metadata={"help": "'hybrid' (--dense_layers dense, the others --pattern), 'dense', a JSON list/dict of "
                          "per-layer specs, or 'keep' (an S2Llama checkpoint's own; 'hybrid' for other models)"},
    )
    pattern: str | None = field(default=None, metadata={"help": "JSON dict of S2Pattern fields for 'hybrid'"})
    dense_layers: str = field(default="0,1", metadata={"help": "comma-separated dense layer indices for 'hybrid'"})
    attn_implementation: str = field(default="s2", metadata={"help": "'s2', or the references 'sdpa' / 'eager'"})
    allow_download: bool = field(
        default=False,
        metadata={"help": "fetch a model, config, tokenizer or --dataset_name from the Hub when it is not cached "
                          "(default: local folders and caches only)"},
    )


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "a save_to_disk folder, a local dataset folder, or a dataset name in the local datasets "
                          "cache (fetched only with --allow_download)"},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "the dataset's configuration name"})
    train_file: list[str] | None = field(
        default=None, metadata={"help": "training data files: .txt, .json, .jsonl or .csv (several of one format)"}
    )
    validation_file: list[str] | None = field(
        default=None, metadata={"help": "validation data files: .txt, .json, .jsonl or .csv (several of one format)"}
    )
    text_column_name: str | None = field(
        default=None, metadata={"help": "column holding the text (default: 'text' if present, else the first column)"}
    )
    validation_split_percentage: int = field(
        default=5,
        metadata={"help": "percentage of training rows held out when there is no validation split (0: none)"},
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": f"tokens per training sequence (default: the smaller of {DEFAULT_BLOCK_SIZE} and the "
                          "model's max_position_embeddings)"},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "use only this many training rows"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use only this many validation rows"})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "processes for tokenization"})
    streaming: bool = field(default=False, metadata={"help": "read the data as a stream (needs --max_steps)"})
    packing: bool = field(
        default=True,
        metadata={"help": "concatenate each batch's sequences into one row without padding (cu_seqlens); "
                          "--packing false pads them instead"},
    )


@dataclass
class PaddedCausalLMCollator:
    """Right-padded batches: ``input_ids``, ``attention_mask`` and ``labels`` (the input ids, -100 on padding).

    Padding is found from the lengths, not from the pad id, so a tokenizer whose pad token is its EOS keeps the loss
    on real EOS tokens (``DataCollatorForLanguageModeling`` would drop it).
    """

    pad_token_id: int

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
        for row, feature in enumerate(features):
            ids = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class S2Trainer(Trainer):
    """``Trainer`` whose model card is the S2 one (per-layer sparsity table, shape, ``card_metrics``): written to the
    output folder at the end and in what ``--push_to_hub`` uploads (``Trainer``'s generic card would replace it)."""

    card_metrics: dict | None = None

    def create_model_card(self, **kwargs):
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        card = render_model_card(self.accelerator.unwrap_model(self.model).config, self.card_metrics)
        with open(os.path.join(self.args.output_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write(card)


def parse_sparsity(spec: str, num_layers: int, pattern: str | None, dense_layers: str):
    """``--sparsity`` as a config value (``None`` for ``"keep"``)."""
    if spec == "keep":
        return None
    if spec == "dense":
        return "dense"
    if spec == "hybrid":
        try:
            layers = [int(i) for i in dense_layers.split(",") if i.strip()]
            sparse_pattern = json.loads(pattern) if pattern else None
            sparsity = hybrid_sparsity(num_layers, sparse_pattern, dense_layers=layers)
        except ValueError as e:  # json.JSONDecodeError is one too
            raise ValueError(
                f"--sparsity hybrid with --dense_layers {dense_layers!r} and --pattern {pattern!r} does not fit the "
                f"model ({num_layers} layers): {e}"
            ) from None
        if all(layer == "dense" for layer in sparsity):
            raise ValueError(
                f"--dense_layers {dense_layers!r} makes every layer of the {num_layers}-layer model dense, so "
                "--sparsity hybrid (the default for a dense or fresh model) would train no S2 layer: name fewer "
                "--dense_layers, or pass --sparsity dense for a dense model"
            )
        return sparsity
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
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        raise ValueError("a fresh model needs --tokenizer_name (a tokenizer folder, a Hub id, 'tiny' or 'smollm2')")
    if name == "tiny":
        return load_tiny_tokenizer()
    if name == "smollm2":
        return smollm2.load_tokenizer()
    argument = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    with _named_load_errors(argument, name, model_args.allow_download):
        return AutoTokenizer.from_pretrained(name, local_files_only=not model_args.allow_download)


@contextlib.contextmanager
def _named_load_errors(argument: str, name: str, allow_download: bool):
    """transformers' OSError for a folder or Hub id that cannot be read, as a ValueError naming the argument."""
    try:
        yield
    except OSError as e:
        hint = "" if allow_download else " (nothing is downloaded without --allow_download)"
        raise ValueError(f"{argument} {name!r} is not a local model folder nor a cached Hub id{hint}: {e}") from e


def _source_path(model_args: ModelArguments) -> str | None:
    if model_args.model_name_or_path == "smollm2":
        return str(smollm2.smollm2_llama_dir())
    return model_args.model_name_or_path or model_args.config_name


def build_config(model_args: ModelArguments, vocab_size: int):
    """The ``S2LlamaConfig`` to train: the source's (or the default) config, ``--config_overrides``, ``--sparsity``.

    Built in two steps so that an error names the argument at fault: first the config with the overrides (and the
    source's own sparsity, or dense), then with the requested sparsity.
    """
    overrides = parse_overrides(model_args.config_overrides)
    source = _source_path(model_args)
    loaded = None
    if source is not None:
        argument = "--model_name_or_path" if model_args.model_name_or_path else "--config_name"
        with _named_load_errors(argument, source, model_args.allow_download):
            loaded = AutoConfig.from_pretrained(
                source, trust_remote_code=True, local_files_only=not model_args.allow_download
            )
    try:
        if loaded is None:
            config = S2LlamaConfig(**{"vocab_size": vocab_size, "sparsity": "dense", **overrides})
        elif loaded.model_type == S2LlamaConfig.model_type:
            config = S2LlamaConfig.from_dict(loaded.to_dict(), **overrides)
        else:
            config = S2LlamaConfig.from_llama(loaded, sparsity="dense", **overrides)
    except ValueError as e:
        raise ValueError(f"--config_overrides {model_args.config_overrides!r} do not fit the model: {e}") from e

    spec = model_args.sparsity
    if spec == "keep" and (source is None or loaded.model_type != S2LlamaConfig.model_type):
        spec = "hybrid"  # a dense or fresh model has no sparsity to keep
    sparsity = parse_sparsity(spec, config.num_hidden_layers, model_args.pattern, model_args.dense_layers)
    if sparsity is None:
        return config
    try:
        return S2LlamaConfig.from_dict(config.to_dict(), sparsity=sparsity)
    except ValueError as e:
        raise ValueError(
            f"--sparsity {model_args.sparsity!r} does not fit the model ({config.num_hidden_layers} layers, "
            f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads, head_dim "
            f"{config.head_dim}): {e}"
        ) from None


def build_model(model_args: ModelArguments, config):
    """The S2Llama model to train, float32: from the checkpoint (converted or continued) or freshly initialized."""
    common = {"attn_implementation": model_args.attn_implementation, "dtype": torch.float32}
    if model_args.model_name_or_path is None:
        return S2LlamaForCausalLM._from_config(config, **common)
    path = _source_path(model_args)
    local_only = not model_args.allow_download
    model = S2LlamaForCausalLM.from_pretrained(path, config=config, local_files_only=local_only, **common)
    source_type = AutoConfig.from_pretrained(path, trust_remote_code=True, local_files_only=local_only).model_type
    if source_type != S2LlamaConfig.model_type:  # provenance for the model card (saved in config.json)
        model.config.converted_from = smollm2.SOURCE_NAME if model_args.model_name_or_path == "smollm2" else str(path)
    return model


def check_fit(model_args: ModelArguments, data_args: DataTrainingArguments, tokenizer, config) -> int:
    """Refuse a tokenizer larger than the model's vocabulary or a block size beyond its positions; returns the
    block size."""
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"--tokenizer_name {model_args.tokenizer_name or model_args.model_name_or_path!r} has {len(tokenizer)} "
            f"tokens, more than the model's vocab_size {config.vocab_size}: its ids would index past the embeddings"
        )
    block_size = data_args.block_size or min(DEFAULT_BLOCK_SIZE, config.max_position_embeddings)
    if not 2 <= block_size <= config.max_position_embeddings:
        raise ValueError(
            f"--block_size must be in [2, {config.max_position_embeddings}] (the model's max_position_embeddings), "
            f"got {block_size}"
        )
    return block_size


def tokenize_documents(dataset, tokenizer, block_size: int, num_proc: int | None = None):
    """Documents (column ``text``) -> ``input_ids`` chunks of at most ``block_size`` tokens, each document ending
    with EOS; a chunk never spans two documents."""
    if block_size < 2:
        raise ValueError(f"--block_size must be >= 2, got {block_size}")
    eos = tokenizer.eos_token_id

    def chunk(batch):
        chunks = []
        for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]:
            ids = ids + ([eos] if eos is not None else [])
            chunks.extend(ids[i : i + block_size] for i in range(0, len(ids), block_size))
        return {"input_ids": [c for c in chunks if len(c) >= 2]}

    parallel = {"num_proc": num_proc} if num_proc and hasattr(dataset, "__len__") else {}  # streams map lazily
    return dataset.map(chunk, batched=True, remove_columns=dataset.column_names or ["text"], **parallel)


def pad_token_id(tokenizer) -> int:
    """The id padded positions hold (masked out of attention and loss, so any valid id works)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


def peak_memory_gib(trainer) -> float:
    """The largest ``torch.cuda.max_memory_allocated()`` of all processes in GiB (a collective: every rank calls it)."""
    peak = torch.tensor([torch.cuda.max_memory_allocated(trainer.args.device)], device=trainer.args.device)
    return trainer.accelerator.gather(peak).max().item() / 2**30


def main(argv=None, callbacks=None):
    """Run ``s2-train`` with the arguments ``argv`` (default: the command line); ``callbacks`` (``TrainerCallback``
    instances or classes) are handed to the ``Trainer``. Returns the model card's metrics."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    do_train, do_eval = training_args.do_train, training_args.do_eval
    if not (do_train or do_eval):
        do_train = do_eval = True  # neither asked for: train, then evaluate when there is validation data
    if do_train and data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming needs --max_steps (a stream has no length to count epochs by)")
    if data_args.packing and training_args.n_gpu > 1:  # one process, several GPUs: DataParallel splits every tensor
        raise ValueError(
            f"--packing with {training_args.n_gpu} GPUs in one process: Trainer's DataParallel would split the "
            "packed row's sequence offsets (cu_seqlens) across the GPUs. Launch one process per GPU "
            "(accelerate launch --config_file training/accelerate/ddp.yaml, or torchrun), make one GPU visible "
            "(CUDA_VISIBLE_DEVICES=0), or pass --packing false"
        )

    if training_args.ddp_find_unused_parameters is None:
        training_args.ddp_find_unused_parameters = False  # every parameter gets a gradient; spare DDP the search
    set_seed(training_args.seed)  # before the model is initialized, so that a run is reproducible (as run_clm)
    tokenizer = load_tokenizer(model_args)
    config = build_config(model_args, len(tokenizer))
    block_size = check_fit(model_args, data_args, tokenizer, config)
    with training_args.main_process_first(desc="loading and tokenizing the data"):
        train_text, validation_text = load_text_splits(
            train_files=data_args.train_file,
            validation_files=data_args.validation_file,
            dataset_name=data_args.dataset_name,
            dataset_config_name=data_args.dataset_config_name,
            text_column_name=data_args.text_column_name,
            validation_split_percentage=data_args.validation_split_percentage,
            max_train_samples=data_args.max_train_samples,
            max_eval_samples=data_args.max_eval_samples,
            streaming=data_args.streaming,
            allow_download=model_args.allow_download,
        )
        workers = data_args.preprocessing_num_workers
        train, held_out = (
            None if text is None else tokenize_documents(text, tokenizer, block_size, workers)
            for text in (train_text if do_train else None, validation_text)
        )
    if do_eval and held_out is None and not do_train:
        raise ValueError("--do_eval needs validation data: --validation_file, a dataset with a 'validation' split, "
                         "or --validation_split_percentage > 0")
    model = build_model(model_args, config)

    if data_args.packing:
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        if data_args.streaming:
            # accelerate would read a stream on the main process and slice every batch tensor along dim 0 for the
            # others, cutting cu_seqlens; each process reads its own share of the stream instead.
            if training_args.accelerator_config.dispatch_batches:
                raise ValueError("--streaming with --packing needs accelerator_config dispatch_batches false")
            training_args.accelerator_config.dispatch_batches = False
    else:
        collator = PaddedCausalLMCollator(pad_token_id(tokenizer))
    trainer = S2Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    metrics = {}
    if do_train:
        on_gpu = trainer.args.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(trainer.args.device)  # the model already sits there: it counts
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        if on_gpu:
            train_result.metrics["train_peak_memory_gib"] = peak_memory_gib(trainer)
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()
        metrics.update({"training steps": train_result.global_step, "final training loss": train_result.training_loss})
    if do_eval and held_out is not None:
        eval_metrics = trainer.evaluate()
        try:
            eval_metrics["perplexity"] = math.exp(eval_metrics["eval_loss"])  # run_clm's key
        except OverflowError:
            eval_metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update({"held-out loss": eval_metrics["eval_loss"], "held-out perplexity": eval_metrics["perplexity"]})
    trainer.card_metrics = metrics
    trainer.create_model_card()
    trainer.save_model(training_args.output_dir)  # with --push_to_hub, also uploads the folder with this card
    return metrics


def cli() -> None:
    """The ``s2-train`` command. Launched by torchrun or accelerate, the process owns its process group and tears it
    down before exiting: a gloo group left to the interpreter's shutdown can abort the process (SIGABRT, "terminate
    called without an active exception"; pytorch/pytorch#190489), after training succeeded."""
    try:
        main(sys.argv[1:])
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    cli()
