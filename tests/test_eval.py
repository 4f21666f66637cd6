"""Evaluation tooling: sliding-window perplexity (exact token accounting), the needle grid and the lm-eval plumbing,
on a tiny random S2 model (plumbing only; real numbers come from SmolLM2 in test_checkpoint_smollm2.py)."""

import importlib.util
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


def test_needle_grid_plumbing(model, tokenizer):
    haystack = " ".join(f"Sentence {i} talks about the kernel scheduler." for i in range(400))
    prompt = needle.build_prompt(tokenizer, haystack, 200, 0.5, 12345)
    assert "The magic number is 12345." in prompt and prompt.endswith(needle.QUESTION)
    assert abs(len(tokenizer(prompt).input_ids) - 200) <= 4
    grid = needle.run_grid(model, tokenizer, [96, 160], [0.0, 1.0], "needle", haystack, samples=2, max_new_tokens=3,
                           progress=False)
    cells = [(c["context_length"], c["depth"], c["sample"]) for c in grid["cells"]]
    assert cells == [(n, d, s) for n in (96, 160) for d in (0.0, 1.0) for s in (0, 1)]
    assert all(isinstance(c["retrieved"], bool) and c["prompt_tokens"] <= c["context_length"] + 4
               for c in grid["cells"])
    # the samples of a cell read different parts of the haystack and hide different numbers
    first, second = (c for c in grid["cells"] if c["context_length"] == 160 and c["depth"] == 1.0)
    assert first["number"] != second["number"]
    assert len(grid["accuracy"]) == 2 and len(grid["accuracy"][0]) == 2
    assert all(0.0 <= a <= 1.0 for row in grid["accuracy"] for a in row)
    json.dumps(grid)  # JSON-ready
    with pytest.raises(ValueError, match="depth must be in"):
        needle.build_prompt(tokenizer, haystack, 200, 1.5, 1)
    with pytest.raises(ValueError, match="task must be one of"):
        needle.run_grid(model, tokenizer, [96], [0.5], "haystack", haystack)
    with pytest.raises(ValueError, match="needs a haystack"):
        needle.run_grid(model, tokenizer, [96], [0.5], "needle", None)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_places_the_key_at_its_depth(tokenizer, depth):
    prompt = needle.build_passkey_prompt(tokenizer, 400, depth, 51234)
    assert prompt.startswith(needle.PASSKEY_INTRO) and prompt.endswith(needle.PASSKEY_QUESTION)
    assert 400 - 2 * len(tokenizer(needle.PASSKEY_FILLER).input_ids) <= len(tokenizer(prompt).input_ids) <= 404
    body = prompt[len(needle.PASSKEY_INTRO) : -len(needle.PASSKEY_QUESTION)]
    position = body.index(needle.passkey_sentence(51234)) / (len(body) - len(needle.passkey_sentence(51234)))
    assert abs(position - depth) < 0.1, position
    with pytest.raises(ValueError, match="no room"):
        needle.build_passkey_prompt(tokenizer, 20, 0.5, 51234)


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

    checkpoint, other = tmp_path / "ckpt", tmp_path / "other"
    for folder in (checkpoint, other):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    report_path = tmp_path / "passkey.json"
    report = needle.main(["--model", str(checkpoint), "--compare", str(other), "--task", "passkey",
                          "--lengths", "160,224", "--depths", "0,1", "--samples", "1", "--max-new-tokens", "2",
                          "--device", "cpu", "--output", str(report_path)])
    assert json.loads(report_path.read_text()) == json.loads(json.dumps(report))
    assert list(report["models"]) == [str(checkpoint), str(other)]
    rows = [json.loads(line) for line in report_path.with_suffix(".jsonl").read_text().splitlines()]
    assert [(r["model"], r["context_length"], r["depth"], r["samples"]) for r in rows] == [
        (str(m), n, d, 1) for m in (checkpoint, other) for d in (0.0, 1.0) for n in (160, 224)]
    assert {r["task"] for r in rows} == {"passkey"}
    with pytest.raises(ValueError, match="--compare"):
        needle.main(["--model", str(checkpoint), "--compare", str(checkpoint)])
    if importlib.util.find_spec("matplotlib") is not None:  # the heat map needs the `eval` extra
        assert report_path.with_suffix(".png").stat().st_size > 1000
    perplexity_path = tmp_path / "ppl.json"
    perplexity.main(["--model", str(checkpoint), "--tokens", "256", "--window", "64", "--device", "cpu",
                     "--output", str(perplexity_path)])
    assert json.loads(perplexity_path.read_text())["perplexity"] > 1.0
