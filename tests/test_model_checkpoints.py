"""Checkpoints: save/load round trips, Auto classes, remote code without this package, Llama conversion."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, S2LlamaModel, hybrid_sparsity

PATTERN = {"block_size": 16, "local_blocks": 1, "vert_stride": 3}
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def tiny_model(**overrides):
    config = S2LlamaConfig(**{**TINY, **overrides, "sparsity": hybrid_sparsity(4, PATTERN, dense_layers=(0,))})
    return S2LlamaForCausalLM(config).eval()


def logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny hybrid checkpoint, its model, and input ids."""
    path = tmp_path_factory.mktemp("s2_checkpoint")
    model = tiny_model()
    model.save_pretrained(path)
    return path, model, torch.randint(0, 100, (2, 60))


def test_save_load_round_trip_is_exact(saved):
    path, model, ids = saved
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "s2_llama" and config["sparsity"] == model.config.sparsity
    # layer_types is derived from sparsity and not saved: transformers' generic config class (which Trainer uses to
    # read a checkpoint it resumes from) refuses "s2_attention".
    assert "layer_types" not in config
    transformers.PreTrainedConfig.from_json_file(path / "config.json")
    assert "attn_implementation" not in json.dumps(config)
    assert (path / "model.safetensors").is_file()
    loaded, info = S2LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.config._attn_implementation == "s2"
    assert loaded.config.sparsity == model.config.sparsity
    assert torch.equal(logits(loaded.eval(), ids), logits(model, ids))


def test_model_card_is_written_when_the_renderer_is_installed(saved):
    pytest.importorskip("s2_models.model_card")
    assert (saved[0] / "README.md").read_text().strip()


def test_device_map_loading(saved):
    path, model, ids = saved
    loaded = S2LlamaForCausalLM.from_pretrained(path, device_map="auto", dtype=torch.float32)
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert torch.equal(logits(loaded.eval(), ids), logits(model, ids))


def test_auto_classes_load_the_s2_family(saved):
    path, model, ids = saved
    assert isinstance(AutoConfig.from_pretrained(path), S2LlamaConfig)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded) is S2LlamaForCausalLM and loaded.config._attn_implementation == "s2"
    assert torch.equal(logits(loaded.eval(), ids), logits(model, ids))
    from transformers import AutoModel

    assert type(AutoModel.from_pretrained(path)) is S2LlamaModel


def test_reference_implementation_survives_reload(saved):
    path, model, ids = saved
    loaded = S2LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
    assert loaded.config._attn_implementation == "eager"
    torch.testing.assert_close(logits(loaded.eval(), ids), logits(model, ids), atol=2e-5, rtol=1e-4)


def test_remote_code_files_are_flat_and_self_contained(saved):
    path = saved[0]
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_s2_llama.S2LlamaConfig",
        "AutoModel": "modeling_s2_llama.S2LlamaModel",
        "AutoModelForCausalLM": "modeling_s2_llama.S2LlamaForCausalLM",
        "AutoModelForSequenceClassification": "modeling_s2_llama.S2LlamaForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_s2_llama.S2LlamaForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_s2_llama.S2LlamaForQuestionAnswering",
    }
    for name in ("configuration_s2_llama.py", "modeling_s2_llama.py", "remote_code.py", "interface.py",
                 "pattern.py", "torch_impl.py", "cache_s2_llama.py", "static_cache_s2_llama.py", "decode.py"):
        imports = re.findall(r"^\s*(?:from|import)\s+(\S+)", (path / name).read_text(), flags=re.MULTILINE)
        package_imports = [m for m in imports if m.startswith((".kernels", "s2_models"))]
        assert set(package_imports) <= {"s2_models.model_card", "s2_models.hub"}, name  # guarded imports


# Scripts run in a fresh interpreter from a temporary working directory, with this package's editable finder removed.
WITHOUT_PACKAGE = textwrap.dedent(
    """
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
    sys.path[:] = [p for p in sys.path if p not in ("", ".", {repo!r})]
    try:
        import s2_models
    except ImportError:
        pass
    else:
        raise SystemExit("s2_models is importable: the test would not prove anything")
    """
)
REMOTE_LOAD = textwrap.dedent(
    """
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint, out, resave = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert model.config._attn_implementation == "s2", model.config._attn_implementation
    ids = torch.load(out + ".ids")
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, out)
    static = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                            pad_token_id=0, cache_implementation="static", return_dict_in_generate=True)
    assert type(static.past_key_values).__name__ == "S2StaticCache", type(static.past_key_values)
    model.save_pretrained(resave)
    """
)


def run_without_package(tmp_path, *args, script=REMOTE_LOAD):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script_path = tmp_path / "remote_load.py"
    script_path.write_text(WITHOUT_PACKAGE.format(repo=repo) + textwrap.dedent(script))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and repo not in p)
    result = subprocess.run([sys.executable, str(script_path), *map(str, args)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_remote_code_loads_without_the_package_and_gives_identical_logits(saved, tmp_path):
    path, model, ids = saved
    out = tmp_path / "logits.pt"
    torch.save(ids, str(out) + ".ids")
    run_without_package(tmp_path, path, out, tmp_path / "resaved")
    assert torch.equal(torch.load(out), logits(model, ids))
    # A remote-loaded model re-saves a checkpoint that loads again, here with the package.
    resaved = S2LlamaForCausalLM.from_pretrained(tmp_path / "resaved").eval()
    assert torch.equal(logits(resaved, ids), logits(model, ids))
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]


# ------------------------------------------------------------------------------------------------ Llama conversion
@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_llama_checkpoints_convert_and_all_dense_matches_llama(tmp_path, tie_word_embeddings):
    llama = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie_word_embeddings)).eval()
    llama.save_pretrained(tmp_path)
    ids = torch.randint(0, 100, (2, 50))

    dense, info = S2LlamaForCausalLM.from_pretrained(tmp_path, sparsity="dense", output_loading_info=True)
    assert not any(info.values()), info
    assert dense.config.tie_word_embeddings == tie_word_embeddings
    assert (dense.lm_head.weight is dense.model.embed_tokens.weight) == tie_word_embeddings
    torch.testing.assert_close(logits(dense.eval(), ids), logits(llama, ids), atol=1e-5, rtol=1e-5)

    hybrid = S2LlamaForCausalLM.from_pretrained(tmp_path, sparsity=hybrid_sparsity(4, PATTERN)).eval()
    assert hybrid.config.layer_types == ["full_attention"] * 2 + ["s2_attention"] * 2
    torch.testing.assert_close(hybrid.state_dict(), dense.state_dict())
    hybrid_logits = logits(hybrid, ids)
    torch.testing.assert_close(hybrid_logits[:, :16], logits(llama, ids)[:, :16], atol=1e-5, rtol=1e-5)

    # Saved as S2Llama, it reloads as S2Llama with the chosen sparsity.
    hybrid.save_pretrained(tmp_path / "s2")
    again = S2LlamaForCausalLM.from_pretrained(tmp_path / "s2").eval()
    assert again.config.sparsity == hybrid.config.sparsity
    assert torch.equal(logits(again, ids), hybrid_logits)


def test_from_llama_config_builds_the_same_architecture():
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    s2 = S2LlamaForCausalLM(S2LlamaConfig.from_llama(llama.config, sparsity="dense")).eval()
    s2.load_state_dict(llama.state_dict())
    ids = torch.randint(0, 100, (1, 40))
    torch.testing.assert_close(logits(s2, ids), logits(llama, ids), atol=1e-5, rtol=1e-5)
