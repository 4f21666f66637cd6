"""bench/quality_study.py on CPU: tiny models, tiny token files, a few Trainer steps per arm.

Checks the memory-mapped chunking across pieces, that an interrupted and resumed arm ends exactly where an
uninterrupted one does (same data order, optimizer and schedule), the convert path from a dense Llama checkpoint
with the per-head shifted pattern, the final evaluation records and the exported summary.
"""

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quality_study  # noqa: E402

VOCAB = 96
SEQ = 32


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Two training pieces of odd sizes and a held-out file; a Markov-ish stream so the loss can fall."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    stream = (np.cumsum(rng.integers(0, 3, 3 * 1000)) % VOCAB).astype("<u2")
    stream[:1037].tofile(folder / "train_000.bin")
    stream[1037:2500].tofile(folder / "train_001.bin")
    stream[2500:].tofile(folder / "heldout.bin")
    manifest = {"vocab_size": VOCAB, "files": {"train": [{"file": "train_000.bin"}, {"file": "train_001.bin"}]}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_token_chunks_read_across_pieces(data_dir):
    files = [data_dir / "train_000.bin", data_dir / "train_001.bin"]
    chunks = quality_study.TokenChunks(files, SEQ)
    stream = np.concatenate([np.fromfile(f, dtype="<u2") for f in files])
    assert len(chunks) == stream.size // SEQ
    for index in (0, 1037 // SEQ, len(chunks) - 1):  # the middle one spans the two files
        item = chunks[index]
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"] is item["labels"]
        np.testing.assert_array_equal(item["input_ids"].numpy(), stream[index * SEQ : (index + 1) * SEQ])
    with pytest.raises(IndexError):
        chunks[len(chunks)]
    assert len(quality_study.TokenChunks(files, SEQ, max_chunks=3)) == 3
    with pytest.raises(ValueError, match="fewer than one chunk"):
        quality_study.TokenChunks(files, 10**6)
    with pytest.raises(ValueError, match="seq_len must be"):
        quality_study.TokenChunks(files, 1)


def test_missing_piece_is_refused(data_dir, tmp_path):
    (tmp_path / "train_000.bin").write_bytes((data_dir / "train_000.bin").read_bytes())
    (tmp_path / "manifest.json").write_text((data_dir / "manifest.json").read_text())
    with pytest.raises(FileNotFoundError, match="train_001.bin"):
        quality_study.train_files(tmp_path)


def run(data_dir, work_dir, *extra):
    return quality_study.main([
        "--data_dir", str(data_dir), "--work_dir", str(work_dir), "--export_dir", str(work_dir / "export"),
        "--tiny", "--max_steps", "3", "--block_size", str(SEQ), "--per_device_train_batch_size", "2",
        "--warmup_steps", "1", "--learning_rate", "3e-3", "--logging_steps", "1", "--eval_steps", "2",
        "--eval_chunks", "2", "--save_steps", "100", "--dataloader_num_workers", "0", "--final_lengths", "32,64",
        "--final_eval_tokens", "256", "--grid_lengths", "", "--no_progress", *extra,
    ])


def losses(work_dir, arm):
    records = quality_study.MetricsLog(work_dir / quality_study.METRICS).records()
    return {r["step"]: r["loss"] for r in records if r["arm"] == arm and r["kind"] == "train" and "loss" in r}


def test_scratch_arms_resume_exactly_and_export_a_summary(data_dir, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run(data_dir, straight, "--study", "scratch", "--arm", "dense")
    # a budget that runs out after the first step: the run saves a checkpoint and stops; the same command resumes
    first = run(data_dir, interrupted, "--study", "scratch", "--arm", "dense", "--max_minutes", "0.002",
                "--save_reserve_minutes", "0.001")
    assert not first["arms"]["dense"]["final_ppl"]
    assert sorted(p.name for p in (interrupted / "dense").glob("checkpoint-*")) == ["checkpoint-1"]
    run(data_dir, interrupted, "--study", "scratch", "--arm", "dense")
    expected, resumed = losses(straight, "dense"), losses(interrupted, "dense")
    assert sorted(expected) == sorted(resumed) == [1, 2, 3]
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-4), step

    summary = run(data_dir, straight, "--study", "scratch", "--arm", "sparse")
    assert summary["device"] == "cpu"  # where the arms ran, from their config records
    assert set(summary["arms"]) == {"dense", "sparse"}
    dense, sparse = summary["arms"]["dense"], summary["arms"]["sparse"]
    assert set(dense["final_ppl"]) == {"32", "64"} and all(math.isfinite(v) for v in dense["final_ppl"].values())
    assert set(dense["initial_ppl"]) == {"32", "64"}  # before training, on the same held-out tokens
    assert [e[0] for e in dense["eval"]] == [0, 2, 3]  # the starting point, every --eval_steps, the end
    assert dense["config"]["densities"]["64"]["model"] == 1.0
    assert all(spec != "dense" for spec in sparse["config"]["sparsity"])  # the ablation: no dense layer
    assert sparse["config"]["densities"]["64"]["model"] < 1.0
    assert set(sparse["ppl_ratio_to_dense"]) == {"32", "64"}
    assert dense["config"]["parameters"] == sparse["config"]["parameters"]
    assert dense["curve"][0][1] == 2 * SEQ  # tokens seen after the first step
    exported = json.loads((straight / "export" / "quality_study_scratch.json").read_text())
    assert exported["arms"]["sparse"]["final_ppl"] == sparse["final_ppl"]
    # arms run on different machines: their exported metrics, concatenated, fold into the same summary
    merged = tmp_path / "merged"
    merged.mkdir()
    exported_metrics = straight / "export" / "quality_study_scratch_metrics.jsonl"
    (merged / quality_study.METRICS).write_text(exported_metrics.read_text())
    again = quality_study.main(["--study", "scratch", "--arm", "summary", "--work_dir", str(merged),
                                "--export_dir", str(merged / "export")])
    assert again["arms"] == json.loads(json.dumps(summary["arms"]))
    if importlib.util.find_spec("matplotlib") is not None:
        assert (straight / "export" / "quality_study_scratch_loss.png").stat().st_size > 1000


def test_demo_prints_committed_results_or_a_note(tmp_path, capsys):
    from s2_models import demo

    summary = {"study": "scratch", "device": "NVIDIA H100 80GB HBM3", "arms": {
        "dense": {"config": {"densities": {"2048": {"model": 1.0}}}, "finished_tokens": 65_536_000,
                  "final_ppl": {"2048": 20.0}, "retrieval": {"passkey": {"mean_accuracy": 1.0}},
                  "commands": ["python bench/quality_study.py --study scratch --arm dense"]},
        "hybrid": {"config": {"densities": {"2048": {"model": 0.31}}}, "finished_tokens": 65_536_000,
                   "initial_ppl": {"2048": 38.4}, "final_ppl": {"2048": 20.5}, "ppl_ratio_to_dense": {"2048": 1.025},
                   "retrieval": {"passkey": {"mean_accuracy": 0.96}},
                   "commands": ["python bench/quality_study.py --study scratch --arm hybrid"]}}}
    (tmp_path / "quality_study_scratch.json").write_text(json.dumps(summary))
    demo.print_trained_results(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    convert_note = [line for line in lines if "SmolLM2" in line]
    assert len(convert_note) == 1 and "no measured results" in convert_note[0]  # one line where nothing is committed
    text = "\n".join(lines)
    assert "measured on NVIDIA H100 80GB HBM3" in text
    assert "ppl@2048 38.40 -> 20.50" in text and "x1.025@2048" in text and "passkey 96%" in text
    assert "reproduce (hybrid): python bench/quality_study.py --study scratch --arm hybrid" in text


def test_convert_arm_from_a_dense_llama_checkpoint(data_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=256)).save_pretrained(base)
    summary = run(data_dir, tmp_path / "work", "--study", "convert", "--arm", "hybrid", "--base_model", str(base),
                  "--dense_layers", "0")
    hybrid = summary["arms"]["hybrid"]
    sparsity = hybrid["config"]["sparsity"]
    assert sparsity[0] == "dense" and sparsity[1]["homo_head"] is False and sparsity[1]["block_size"] == 16
    assert hybrid["finished_tokens"] == 3 * 2 * SEQ and set(hybrid["final_ppl"]) == {"32", "64"}
    # the same command once the arm is done: nothing is trained or evaluated again
    again = run(data_dir, tmp_path / "work", "--study", "convert", "--arm", "hybrid", "--base_model", str(base),
                "--dense_layers", "0")
    assert again["arms"]["hybrid"] == hybrid
    with pytest.raises(ValueError, match="--arm must be one of"):
        run(data_dir, tmp_path / "bad", "--study", "convert", "--arm", "sparse", "--base_model", str(base))


# study 2's first run (one pattern per KV head), committed under its own name
COMMITTED = (Path(__file__).resolve().parents[1] / "bench" / "results"
             / "quality_study_scratch_kv-head-patterns_metrics.jsonl")


def test_a_second_pattern_is_its_own_arm_merged_with_the_committed_metrics(data_dir, tmp_path, capsys):
    pqh = json.dumps({**quality_study.TINY_PATTERN, "per_query_head": True})
    run(data_dir, tmp_path / "new", "--study", "scratch", "--arm", "hybrid", "--arm_name", "hybrid_pqh",
        "--pattern", pqh)
    assert (tmp_path / "new" / "hybrid_pqh" / "final").is_dir()
    # the committed dense and hybrid arms of study 2 plus the new arm's exported metrics, folded into one summary
    merged = tmp_path / "merged"
    merged.mkdir()
    new_metrics = (tmp_path / "new" / "export" / "quality_study_scratch_metrics.jsonl").read_text()
    # an export merged twice (each run exports the whole log) counts once
    (merged / quality_study.METRICS).write_text(COMMITTED.read_text() + new_metrics + new_metrics)
    summary = quality_study.main(["--study", "scratch", "--arm", "summary", "--work_dir", str(merged),
                                  "--export_dir", str(merged / "export")])
    arms = summary["arms"]
    assert list(arms) == ["dense", "hybrid", "hybrid_pqh"]
    hybrid, new = arms["hybrid"], arms["hybrid_pqh"]
    # the committed hybrid: 4 KV heads at stride 8 (head counts from the default scratch config) leave half
    assert hybrid["coverage"] == {"pattern_heads": 4, "vert_stride": 8, "uncovered_offsets": [0, 2, 4, 6],
                                  "covered_fraction": 0.5}
    assert hybrid["pattern"]["dense_layers"] == [0, 1] and hybrid["pattern"]["sparse"]["vert_stride"] == 8
    assert hybrid["attention_density"] == {"2048": 0.4192, "8192": 0.3095}
    assert hybrid["ppl_ratio_to_dense"]["2048"] == pytest.approx(8.58 / 8.15, abs=2e-3)
    assert hybrid["heldout_loss_ratio_to_dense"] == pytest.approx(2.217 / 2.120, abs=2e-3)  # README: +4.6%
    assert 200_000 < hybrid["median_tokens_per_second"] < 260_000 and hybrid["median_step_seconds"] > 0.1
    assert arms["dense"]["pattern"] == {"dense_layers": list(range(12)), "sparse": None}
    assert "coverage" not in arms["dense"]
    # the new arm: its own pattern (4 query heads at stride 4: every offset) and density
    assert [c[0] for c in new["curve"]] == [1, 2, 3]
    assert new["pattern"]["sparse"]["per_query_head"] is True
    assert new["coverage"]["uncovered_offsets"] == [] and new["coverage"]["covered_fraction"] == 1.0
    assert 0 < new["attention_density"]["64"] < 1 and "ppl_ratio_to_dense" in new
    exported = json.loads((merged / "export" / "quality_study_scratch.json").read_text())
    assert list(exported["arms"]) == ["dense", "hybrid", "hybrid_pqh"]

    from s2_models import demo  # the committed-results printer reads the merged summary

    demo.print_trained_results(merged / "export")
    text = capsys.readouterr().out
    assert "hybrid_pqh" in text and "x1.052@2048" in text

    # the same name for another pattern would mix two arms: refused
    clash = new_metrics.replace('"arm": "hybrid_pqh"', '"arm": "hybrid"')
    (merged / quality_study.METRICS).write_text(COMMITTED.read_text() + clash)
    with pytest.raises(ValueError, match="two arms named 'hybrid'"):
        quality_study.main(["--study", "scratch", "--arm", "summary", "--work_dir", str(merged)])


def test_arm_names_are_checked(data_dir, tmp_path):
    with pytest.raises(ValueError, match="--arm_name dense is the dense arm's"):
        run(data_dir, tmp_path, "--study", "scratch", "--arm", "sparse", "--arm_name", "dense")
    with pytest.raises(ValueError, match="--arm_name must be"):
        run(data_dir, tmp_path, "--study", "scratch", "--arm", "sparse", "--arm_name", "a/b")
    # a paused arm resumes only with the pattern it started with
    run(data_dir, tmp_path, "--study", "scratch", "--arm", "sparse", "--max_minutes", "0.002",
        "--save_reserve_minutes", "0.001")
    with pytest.raises(ValueError, match="its own --arm_name"):
        run(data_dir, tmp_path, "--study", "scratch", "--arm", "sparse", "--pattern",
            json.dumps({**quality_study.TINY_PATTERN, "vert_stride": 2}))


def test_long_context_phase_from_a_finished_arm_resumes_exactly(data_dir, tmp_path):
    from s2_models import S2LlamaConfig

    run(data_dir, tmp_path / "study2", "--study", "scratch", "--arm", "dense")
    final = tmp_path / "study2" / "dense" / "final"
    long = ["--study", "longctx", "--arm", "dense", "--init_from", str(final), "--rope_theta", "50000",
            "--block_size", "64", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2",
            "--gradient_checkpointing"]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    summary = run(data_dir, straight, *long)
    run(data_dir, interrupted, *long, "--max_minutes", "0.002", "--save_reserve_minutes", "0.001")
    run(data_dir, interrupted, *long)
    expected, resumed = losses(straight, "dense"), losses(interrupted, "dense")
    assert sorted(expected) == sorted(resumed) == [1, 2, 3]
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-4), step

    dense = summary["arms"]["dense"]
    assert dense["config"]["rope_theta"] == 50000 and dense["config"]["init_from"] == str(final)
    assert dense["config"]["tokens_per_step"] == 2 * 64 and dense["curve"][0][1] == 128
    assert set(dense["final_ppl"]) == {"32", "64"} and set(dense["initial_ppl"]) == {"32", "64"}
    assert dense["median_step_seconds"] > 0 and dense["median_tokens_per_second"] > 0
    trained = S2LlamaConfig.from_pretrained(straight / "dense" / "final")
    assert trained.rope_parameters["rope_theta"] == 50000 and trained.max_position_embeddings >= 64
    assert S2LlamaConfig.from_pretrained(final).rope_parameters["rope_theta"] == 10000  # the start is untouched
    with pytest.raises(ValueError, match="holds a dense model"):
        run(data_dir, tmp_path / "bad", *[a if a != "dense" else "hybrid" for a in long])
    with pytest.raises(ValueError, match="--init_from"):
        run(data_dir, tmp_path / "bad", "--study", "longctx", "--arm", "dense")
