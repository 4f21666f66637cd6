"""A small byte-level BPE tokenizer trained on the local documentation text, for tiny models in tests and smoke runs.

Training 2k merges on ~4 MB of text takes a few seconds; the result is cached under the cache directory
(``tiny-bpe-<vocab_size>``) and loads as an ordinary ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from s2_models.downloads import build_once, cache_dir

SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "unk_token": "<|unk|>"}


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization) on ``texts``.

    Returns a ``PreTrainedTokenizerFast`` that adds no BOS/EOS by itself (models see documents separated by the
    collator, not by special tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (256 bytes + special tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def tiny_tokenizer_dir(vocab_size: int = 2048, max_documents: int = 400) -> Path:
    """A cached tokenizer directory trained on the first ``max_documents`` training documents."""
    from .data import iter_documents

    def build(out: Path) -> None:
        docs = (doc.text for _, doc in zip(range(max_documents), iter_documents("train")))
        train_byte_level_bpe(docs, vocab_size).save_pretrained(out)

    return build_once(cache_dir() / f"tiny-bpe-{vocab_size}-{max_documents}docs", build)


def load_tiny_tokenizer(vocab_size: int = 2048, max_documents: int = 400):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir(vocab_size, max_documents))
