"""Training: the S2 kernels train like the SDPA reference (Liger-Kernel style convergence test) on packed real text
with a tiny model and tokenizer. ``s2-train`` itself: tests/test_training_script.py."""

import math
import os

import pytest
import torch
from transformers import DataCollatorWithFlattening

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.training import train as train_script
from s2_models.training.data import text_dataset
from s2_models.training.tokenizer import load_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}  # sparse already at 48+ tokens
SEQ_LEN, BATCH, STEPS = 128, 2, 30


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return load_tiny_tokenizer()
    except RuntimeError as e:  # no Debian archive reachable and nothing cached
        pytest.skip(f"local training text unavailable: {e}")


@pytest.fixture(scope="module")
def packed_batches(tokenizer):
    """STEPS packed batches (one row each, cu_seqlens from the collator) of real text; the same for every run."""
    docs = text_dataset("train", max_documents=60)
    chunks = train_script.tokenize_documents(docs, tokenizer, SEQ_LEN)["input_ids"]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    assert len(chunks) >= STEPS * BATCH
    return [collator([{"input_ids": c} for c in chunks[i * BATCH : (i + 1) * BATCH]]) for i in range(STEPS)]


def train_losses(attn_implementation, batches, vocab_size):
    torch.manual_seed(0)
    config = S2LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ_LEN,
        sparsity=hybrid_sparsity(3, PATTERN, dense_layers=(0,)),
    )
    model = S2LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_s2_kernels_train_like_the_sdpa_reference(packed_batches, tokenizer):
    s2 = train_losses("s2", packed_batches, len(tokenizer))
    sdpa = train_losses("sdpa", packed_batches, len(tokenizer))
    # Same function, different summation order: curves agree to float32 noise amplified over 30 Adam steps.
    torch.testing.assert_close(torch.tensor(s2), torch.tensor(sdpa), rtol=2e-3, atol=2e-3)
    assert s2[0] == pytest.approx(math.log(len(tokenizer)), rel=0.1)  # starts near uniform
    assert sum(s2[-5:]) / 5 < s2[0] - 0.8, s2  # and learns
