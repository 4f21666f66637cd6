"""push_to_hub, offline: the Hub client's calls are intercepted and the one commit's files are inspected."""

import json
import os

import pytest
import torch
from huggingface_hub import HfApi

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.hub import push_s2_model
from s2_models.model_card import render_model_card

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}
EXPECTED_FILES = {"README.md", "config.json", "model.safetensors", "configuration_s2_llama.py", "modeling_s2_llama.py",
                  "interface.py", "pattern.py", "torch_impl.py", "fused.py", "fused_triton.py"}


def tiny_config(**overrides):
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  sparsity=hybrid_sparsity(3, PATTERN, dense_layers=(0,)))
    return S2LlamaConfig(**(fields | overrides))


class FakeHub:
    """Records ``create_repo`` / ``create_branch`` / ``create_commit`` instead of calling the Hub."""

    def __init__(self, monkeypatch):
        self.commits, self.repos = [], []
        monkeypatch.setattr(HfApi, "create_repo", self.create_repo)
        monkeypatch.setattr(HfApi, "create_branch", lambda api, **kwargs: None)  # a function: gets HfApi's self
        monkeypatch.setattr(HfApi, "create_commit", self.create_commit)

    def create_repo(self, repo_id, **kwargs):  # bound to FakeHub: HfApi's self is not passed
        self.repos.append(repo_id)
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            with open(op.path_or_fileobj, "rb") as f:  # the temp folder is gone after the call returns
                files[op.path_in_repo] = f.read()
        self.commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return "commit-info"


@pytest.fixture
def hub(monkeypatch):
    return FakeHub(monkeypatch)


def committed_files(hub):
    assert len(hub.commits) == 1, "everything must land in one commit"
    return hub.commits[0]["files"]


def check_upload(files):
    assert EXPECTED_FILES <= set(files), sorted(files)
    config = json.loads(files["config.json"])
    assert config["sparsity"][0] == "dense"
    assert config["sparsity"][1]["vert_stride"] == PATTERN["vert_stride"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_s2_llama.S2LlamaForCausalLM"
    card = files["README.md"].decode()
    assert "| 0 | dense |" in card and "| 1 | S2 | 16 | 2 | 4 |" in card, card
    assert "s2-attention" in card
    return card


def test_push_s2_model_uploads_everything_in_one_commit(hub):
    torch.manual_seed(0)
    model = S2LlamaForCausalLM(tiny_config())
    result = push_s2_model(model, "me/tiny-s2", metrics={"held-out perplexity": 12.3456}, tags=["demo"],
                           commit_message="Add tiny S2 model")
    assert result == "commit-info" and hub.repos == ["me/tiny-s2"]
    card = check_upload(committed_files(hub))
    assert "| held-out perplexity | 12.35 |" in card
    assert "- demo" in card
    assert hub.commits[0]["commit_message"] == "Add tiny S2 model"


def test_model_push_to_hub_keeps_the_s2_card(hub):
    model = S2LlamaForCausalLM(tiny_config())
    model.push_to_hub("me/tiny-s2")
    assert len(hub.commits) == 1
    check_upload(committed_files(hub))


def test_pushed_files_load_back_with_remote_code(hub, tmp_path):
    torch.manual_seed(0)
    model = S2LlamaForCausalLM(tiny_config()).eval()
    push_s2_model(model, "me/tiny-s2")
    for name, data in committed_files(hub).items():
        (tmp_path / name).write_bytes(data)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    x = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)


def test_model_card_states_density_derivation_and_rejects_bad_metrics():
    config = tiny_config()
    card = render_model_card(config)
    assert "3 layers: 2 S2-sparse, layers 0 dense" in card
    assert "Trained as an S2Llama model" in card
    config.converted_from = "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = render_model_card(config)
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "Converted from the dense Llama checkpoint HuggingFaceTB/SmolLM2-135M-Instruct with" in card
    with pytest.raises(ValueError, match="metrics must be a mapping"):
        render_model_card(config, metrics=[("ppl", 3.0)])


def test_model_card_reference_numbers_match_the_measurements():
    from pathlib import Path

    results = json.loads((Path(__file__).parents[1] / "bench/results/smollm2_perplexity.json").read_text())
    card = render_model_card(tiny_config())
    dense = results["results"]["dense (LlamaForCausalLM)"]["perplexity"]
    for entry in results["results"].values():
        assert f"| {entry['perplexity']:.2f} | {entry['perplexity'] / dense:.2f} |" in card, entry
