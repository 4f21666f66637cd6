"""Training: the S2 kernels train like the SDPA reference (Liger-Kernel style convergence test), and train.py runs
end to end on packed real text with a tiny model and tokenizer."""

import json
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
TINY_OVERRIDES = ("hidden_size=64,intermediate_size=128,num_hidden_layers=3,num_attention_heads=4,"
                  "num_key_value_heads=2,head_dim=16")


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


def test_train_script_end_to_end(tokenizer, tmp_path):
    out = tmp_path / "run"
    metrics = train_script.main([
        "--tokenizer_name_or_path", "tiny", "--config_overrides", TINY_OVERRIDES,
        "--sparsity", "hybrid", "--dense_layers", "0", "--pattern", json.dumps(PATTERN),
        "--max_seq_length", str(SEQ_LEN), "--max_train_documents", "20", "--max_eval_documents", "2",
        "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--gradient_checkpointing", "--save_strategy", "no", "--report_to", "none",
        "--logging_steps", "1", "--use_cpu",
    ])
    assert metrics["training steps"] == 3 and math.isfinite(metrics["held-out loss"])
    for name in ("config.json", "model.safetensors", "modeling_s2_llama.py", "tokenizer.json", "README.md"):
        assert (out / name).is_file(), name
    assert "held-out perplexity" in (out / "README.md").read_text()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.sparsity[0] == "dense" and model.config.sparsity[1]["vert_stride"] == PATTERN["vert_stride"]
    inputs = AutoTokenizer.from_pretrained(out)("The kernel", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == inputs.input_ids.shape[1] + 4


def test_parse_arguments_reject_bad_input():
    with pytest.raises(ValueError, match="--sparsity must be one of"):
        train_script.parse_sparsity("sparse-ish", 2, None, "0")
    with pytest.raises(ValueError, match="key=value"):
        train_script.parse_overrides("hidden_size64")
    with pytest.raises(ValueError, match="--precision"):
        train_script.resolve_precision("fp8", None)
