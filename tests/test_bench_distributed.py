"""bench/bench_distributed.py on the CPU: ``--prepare`` and a ``--tiny`` run (one process vs torchrun DDP with gloo,
same global batch and data order), and the GPU arms' launch commands as accelerate reads them."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from s2_models.training import train as train_script

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import bench_distributed  # noqa: E402


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist")
    try:
        manifest = bench_distributed.prepare(folder, bench_distributed.TINY_RUN)
    except RuntimeError as e:  # no Debian archive reachable and nothing cached
        pytest.skip(f"local training text unavailable: {e}")
    return folder, manifest


def test_prepare_writes_enough_mostly_full_chunks(tiny_data):
    folder, manifest = tiny_data
    run = bench_distributed.TINY_RUN
    assert manifest["chunks"] >= run["steps"] * run["global_batch"] * (1 + bench_distributed.DATA_MARGIN)
    assert manifest["tokens"] > 0.8 * manifest["chunks"] * run["block_size"]  # rows of many chunks: few partial
    rows = [json.loads(line)["text"] for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) == manifest["rows"] and all(rows)
    assert (folder / "tokenizer" / "tokenizer.json").is_file()


def test_tiny_run_ddp_matches_one_process_and_profiles(tiny_data, tmp_path):
    folder, _ = tiny_data
    out = tmp_path / "tiny.json"
    command = [sys.executable, str(BENCH / "bench_distributed.py"), "--tiny", "--data", str(folder), "--out", str(out),
               "--profile"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    arms = json.loads(out.read_text())["arms"]
    steps = bench_distributed.TINY_RUN["steps"]
    single, ddp = arms["single"], arms["ddp"]
    for arm, world in ((single, 1), (ddp, 2)):
        assert "error" not in arm, arm.get("output_tail")
        assert arm["world_size"] == world and arm["hf_gradient_checkpointing"]
        assert len(arm["losses"]) == steps and all(math.isfinite(x) for x in arm["losses"])
        assert arm["tokens_per_s"] > 0 and arm["median_step_ms"] > 0
        assert arm["env"]["NCCL_NVLS_ENABLE"] == "0"
        # --profile: the last two steps, their wall time split (no GPU here: all of it idle), and left out of the
        # timed steps
        profile = arm["profile"]
        assert profile["steps"] == list(bench_distributed.profile_steps(bench_distributed.TINY_RUN))
        assert profile["ms_per_step"]["wall"] > 0 and profile["ms_per_step"]["gpu_busy"] == 0
        assert 0 < profile["ms_per_step"]["host_self"]
        assert arm["timed_steps"] == f"{bench_distributed.TINY_RUN['skip_steps'] + 1}-{profile['steps'][0] - 1}"
    assert ddp["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert ddp["steps"][-1]["tokens_seen"] == single["steps"][-1]["tokens_seen"]  # the same chunks
    # float32 on the CPU: the same global batch and order give the same losses up to summation order
    assert ddp["max_abs_loss_difference_to_single"] < 1e-4 * single["losses"][0]
    assert "skipped" in arms["fsdp2"]


@pytest.mark.parametrize("arm", bench_distributed.ARMS + bench_distributed.OPTIONAL_ARMS)
def test_gpu_arm_commands_launch_what_they_claim(arm, tmp_path):
    """The GPU arms' commands, parsed as accelerate launch and s2-train parse them (without running them)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    run = bench_distributed.GPU_RUN
    command, env = bench_distributed.arm_command(arm, run, tmp_path / "data", tmp_path, tiny=False)
    assert env.items() >= bench_distributed.NVLS_OFF.items()
    assert bench_distributed.PROFILE_ENV not in env
    script = command.index(str(Path(bench_distributed.__file__).resolve()))
    worker_args = command[script + 1 :]
    assert worker_args[:2] == ["--worker", str(tmp_path / "record.json")]
    s2_train_argv = worker_args[2:] + ["--use_cpu"]  # parsed here, on a machine without GPUs
    model_args, data_args, training_args = HfArgumentParser(
        (train_script.ModelArguments, train_script.DataTrainingArguments, train_script.TrainingArguments)
    ).parse_args_into_dataclasses(args=s2_train_argv)
    per_device = run["global_batch"] // (1 if arm == "single" else bench_distributed.NUM_PROCESSES)
    assert training_args.per_device_train_batch_size == per_device
    assert training_args.include_num_input_tokens_seen == "all" and training_args.bf16
    assert data_args.packing and data_args.block_size == run["block_size"]
    assert training_args.train_sampling_strategy == "sequential" and training_args.max_steps == run["steps"]
    # HF checkpointing for single/ddp; FSDP checkpoints itself (Trainer refuses both at once)
    assert ("--gradient_checkpointing" in worker_args) == (arm != "fsdp2")
    if arm in ("single", "single_half"):
        assert command[0] == sys.executable and command[1] == str(Path(bench_distributed.__file__).resolve())
        assert env["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        return
    launch = launch_command_parser().parse_args(command[3:])
    launch, _, _ = _validate_launch_command(launch)
    launch_env = prepare_multi_gpu_env(launch)
    assert launch.num_processes == bench_distributed.NUM_PROCESSES and launch.mixed_precision == "bf16"
    assert launch.training_script == command[script] and launch.training_script_args == worker_args
    if arm == "ddp":
        assert launch.multi_gpu and not launch.use_fsdp
    else:
        assert launch_env["ACCELERATE_USE_FSDP"] == "true" and launch_env["FSDP_VERSION"] == "2"
        assert launch_env["FSDP_ACTIVATION_CHECKPOINTING"] == "true"
        assert launch_env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "S2LlamaDecoderLayer"


def test_plot_redraws_the_loss_plot_of_a_results_json(tmp_path):
    """``--plot`` reads a results JSON and writes the PNG beside it (no PNG, and a note, without matplotlib)."""
    results = {"device": "a GPU", "arms": {"single": {"losses": [3.0, 2.5, 2.0]}, "ddp": {"losses": [3.0, 2.5, 2.1]},
                                          "fsdp2": {"skipped": "needs 2 GPUs, 1 visible"}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    plot = bench_distributed.main(["--plot", str(path)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot is None and not path.with_suffix(".png").exists()
        return
    assert plot == path.with_suffix(".png") and plot.stat().st_size > 0


def test_gpu_time_split_counts_overlaps_once_and_the_exchange_nothing_hid():
    """Two steps of 100 ms: kernels on two streams overlap (counted once), NCCL half hidden behind a kernel."""

    def event(name, start_ms, end_ms, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": 1e3 * start_ms, "dur": 1e3 * (end_ms - start_ms)}

    events = [
        event("gemm", 0, 50), event("softmax", 40, 60),  # overlapping: busy 0-60
        event("ncclDevKernel_AllReduce_Sum_f32", 50, 90),  # hidden 50-60, alone 60-90
        event("Memcpy HtoD", 120, 130, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 2e5},  # host work: not GPU time
    ]
    split = bench_distributed.gpu_time_split(events, wall_s=0.2, steps=2)
    assert split == {"wall": 100.0, "gpu_busy": 50.0, "nccl": 20.0, "nccl_exposed": 15.0, "gpu_idle": 50.0}
