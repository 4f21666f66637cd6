"""Evaluation tooling: sliding-window perplexity (exact token accounting), the needle grid and the lm-eval plumbing,
on a tiny random S2 model (plumbing only; real numbers come from SmolLM2 in test_checkpoint_smollm2.py)."""

import json
import math
import os

import pytest
import torch

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.eval import needle
from s2_models.eval.perplexity import sliding_window_perplexity
from s2_models.training.tokenizer import load_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return load_tiny_tokenizer()
    except RuntimeError as e:
        pytest.skip(f"local text unavailable: {e}")


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = S2LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        sparsity=hybrid_sparsity(2, PATTERN, dense_layers=(0,)),
    )
    return S2LlamaForCausalLM(config).eval()


def reference_nll(model, ids, window, stride):
    """Token by token: each scored token's loss with the context the strided scheme gives it."""
    total, count = 0.0, 0
    starts = list(range(0, ids.numel() - window + 1, stride))
    for start in starts:
        with torch.no_grad():
            logp = model(ids[None, start : start + window]).logits[0].log_softmax(-1)
        first = 1 if start == 0 else window - min(stride, window - 1)
        for t in range(first, window):
            total -= logp[t - 1, ids[start + t]].item()
            count += 1
    return total, count


@pytest.mark.parametrize("window,stride", [(32, 32), (32, 16), (48, 8)])
def test_sliding_window_perplexity_matches_token_by_token_accounting(model, window, stride):
    ids = torch.randint(0, model.config.vocab_size, (120,), generator=torch.Generator().manual_seed(1))
    result = sliding_window_perplexity(model, ids, window, stride, batch_size=3)
    total, count = reference_nll(model, ids, window, stride)
    assert result.scored_tokens == count
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_sliding_window_perplexity_rejects_bad_arguments(model):
    ids = torch.arange(64)
    for kwargs, message in [({"window": 1}, "window must be"), ({"window": 16, "stride": 17}, "stride must be"),
                            ({"window": 128}, "need at least"), ({"window": 16, "batch_size": 0}, "batch_size")]:
        with pytest.raises(ValueError, match=message):
            sliding_window_perplexity(model, ids, **kwargs)


def test_needle_grid_plumbing(model, tokenizer, tmp_path, monkeypatch):
    haystack = " ".join(f"Sentence {i} talks about the kernel scheduler." for i in range(400))
    prompt = needle.build_prompt(tokenizer, haystack, 200, 0.5, 12345)
    assert "The magic number is 12345." in prompt and prompt.endswith(needle.QUESTION)
    assert abs(len(tokenizer(prompt).input_ids) - 200) <= 4
    grid = needle.run_needle_grid(model, tokenizer, haystack, [96, 160], [0.0, 1.0], max_new_tokens=3)
    assert [(c["context_length"], c["depth"]) for c in grid["cells"]] == [(96, 0.0), (96, 1.0), (160, 0.0), (160, 1.0)]
    assert 0.0 <= grid["accuracy"] <= 1.0 and all(isinstance(c["retrieved"], bool) for c in grid["cells"])
    json.dumps(grid)  # JSON-ready
    with pytest.raises(ValueError, match="depth must be in"):
        needle.build_prompt(tokenizer, haystack, 200, 1.5, 1)


def test_lm_eval_runs_the_local_tasks_offline(model, tokenizer):
    pytest.importorskip("lm_eval", reason="lm-eval is in the `eval` extra")
    from s2_models.eval.lm_eval_harness import LOCAL_TASKS, evaluate

    results = evaluate(model, tokenizer, limit=3, max_length=256)
    assert set(results) == set(LOCAL_TASKS)
    assert results["s2_docs_rolling"]["byte_perplexity"] > 1.0
    assert 0.0 <= results["s2_docs_last_word"]["acc"] <= 1.0


def test_clis_evaluate_a_saved_checkpoint(model, tokenizer, tmp_path):
    """The ``--model`` path of the CLIs: a saved S2 folder, loaded with trust_remote_code, reported as JSON."""
    from s2_models.eval import perplexity

    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    report_path = tmp_path / "needle.json"
    needle.main(["--model", str(checkpoint), "--lengths", "96", "--depths", "0.5", "--max-new-tokens", "2",
                 "--device", "cpu", "--output", str(report_path)])
    report = json.loads(report_path.read_text())
    assert list(report["models"]) == [str(checkpoint)] and len(report["models"][str(checkpoint)]["cells"]) == 1
    perplexity_path = tmp_path / "ppl.json"
    perplexity.main(["--model", str(checkpoint), "--tokens", "256", "--window", "64", "--device", "cpu",
                     "--output", str(perplexity_path)])
    assert json.loads(perplexity_path.read_text())["perplexity"] > 1.0
