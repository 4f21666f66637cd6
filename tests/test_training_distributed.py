"""Beyond one process: ``s2-train`` under ``torchrun`` (DDP, CPU with gloo) trains as the one-process run with the
same global batch; FSDP2's ``fully_shard`` over two processes gives the unsharded model's gradients
(tests/fsdp2_worker.py: on the CPU with gloo, and on 2 GPUs with NCCL and the Triton kernels); the accelerate configs
under ``training/accelerate`` are the launcher's valid DDP / FSDP2 configs. The 2-GPU training runs are
bench/bench_distributed.py's (issue 12)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from s2_models.training import train as train_script
from s2_models.training.data import iter_documents
from s2_models.training.tokenizer import load_tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_distributed import NVLS_OFF  # noqa: E402

ACCELERATE_CONFIGS = Path(train_script.__file__).parent / "accelerate"
FSDP2_WORKER = Path(__file__).with_name("fsdp2_worker.py")
PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}
TINY_OVERRIDES = ("hidden_size=64,intermediate_size=128,num_hidden_layers=3,num_attention_heads=4,"
                  "num_key_value_heads=2,head_dim=16,max_position_embeddings=256")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    try:
        load_tiny_tokenizer()
        documents = [doc.text for _, doc in zip(range(20), iter_documents("train"))]
    except RuntimeError as e:
        pytest.skip(f"local training text unavailable: {e}")
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


def s2_train_args(train_file, out, per_device_batch):
    return [
        "--tokenizer_name", "tiny", "--config_overrides", TINY_OVERRIDES, "--sparsity", "hybrid",
        "--dense_layers", "0", "--pattern", json.dumps(PATTERN), "--block_size", "128",
        "--train_file", str(train_file), "--validation_split_percentage", "0", "--do_train",
        "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", str(per_device_batch),
        "--learning_rate", "3e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--use_cpu", "--seed", "0", "--disable_tqdm", "true", "--train_sampling_strategy", "sequential",
    ]


def logged_losses(out):
    with open(out / "trainer_state.json") as f:
        return [entry["loss"] for entry in json.load(f)["log_history"] if "loss" in entry]


def test_torchrun_two_processes_match_one_process_with_the_same_global_batch(train_file, tmp_path):
    two = tmp_path / "two-processes"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "s2_models.training.train", *s2_train_args(train_file, two, 2), "--ddp_backend", "gloo"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    one = tmp_path / "one-process"
    train_script.main(s2_train_args(train_file, one, 4))
    # Same 4 sequences per step (sequential order, split 2 + 2 across the ranks); the losses are token-weighted over
    # both ranks, so they agree up to float32 summation order.
    assert logged_losses(two) == pytest.approx(logged_losses(one), rel=1e-4)
    assert len(logged_losses(one)) == 3


@pytest.mark.gpu
def test_train_metrics_hold_the_fullest_gpus_peak_memory(train_file, tmp_path):
    """On GPUs, s2-train's train metrics hold the peak memory of the fullest GPU of all processes."""
    processes = min(2, torch.cuda.device_count())
    env = {**os.environ, **NVLS_OFF, "HF_HUB_OFFLINE": "1"}
    argv = [arg for arg in s2_train_args(train_file, tmp_path, 2) if arg != "--use_cpu"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               "-m", "s2_models.training.train", *argv]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    with open(tmp_path / "train_results.json") as f:
        peak = json.load(f)["train_peak_memory_gib"]
    assert 0 < peak < torch.cuda.get_device_properties(0).total_memory / 2**30


def run_fsdp2_worker(device: str) -> None:
    """tests/fsdp2_worker.py on two processes (it exits non-zero on a mismatch)."""
    # Untuned kernels (each kernel's first usable tile): the check is of gradients, and tuning would time every tile
    # candidate at each rank's packed lengths, in two precisions, for the sharded and the unsharded model.
    env = {**os.environ, **NVLS_OFF, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "S2_ATTENTION_AUTOTUNE": "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(FSDP2_WORKER), "--device", device]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    # both precisions reached every check: both steps' gradients, and the sharded AdamW update between them
    for line in ("step 1 gradients", "step 1 AdamW updates", "step 2 gradients"):
        for precision in ("fp32", "bf16"):
            assert f"[{precision}] {line}" in result.stdout, result.stdout


def test_fsdp2_two_processes_give_the_unsharded_gradients():
    """FSDP2 on the CPU (gloo, 2 processes, the PyTorch attention path): two steps on packed batches split unevenly
    across the ranks; the loss and every gradient as the unsharded model's, and the sharded AdamW step as AdamW's on
    the unsharded model, in fp32 and under accelerate's bf16 policy."""
    run_fsdp2_worker("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_two_gpus_give_the_unsharded_gradients():
    """The same on 2 GPUs: NCCL, and the sparse and packed dense layers run the Triton kernels."""
    run_fsdp2_worker("cuda")


@pytest.mark.parametrize("name, distributed_type", [("ddp", "MULTI_GPU"), ("fsdp2", "FSDP")])
def test_accelerate_configs_load(name, distributed_type):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ACCELERATE_CONFIGS / f"{name}.yaml"))
    assert config.distributed_type == distributed_type and config.mixed_precision == "bf16"
    if name == "fsdp2":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "S2LlamaDecoderLayer"
