"""Beyond one process, on CPU with gloo: ``s2-train`` under ``torchrun`` (DDP) trains as the one-process run with the
same global batch, FSDP2's ``fully_shard`` gives the unwrapped model's gradients, and the accelerate configs under
``training/accelerate`` are the launcher's valid DDP / FSDP2 configs. The GPU runs are issue 12's."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import DataCollatorWithFlattening

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.training import train as train_script
from s2_models.training.data import iter_documents
from s2_models.training.tokenizer import load_tiny_tokenizer

ACCELERATE_CONFIGS = Path(train_script.__file__).parent / "accelerate"
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


def test_fsdp2_fully_shard_gradients_match_the_unwrapped_model(tmp_path):
    """FSDP2 on the CPU (gloo, world size 1): each decoder layer and the model sharded as the fsdp2 config does;
    a packed training step's loss and gradients equal the plain model's."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = S2LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sparsity=hybrid_sparsity(3, PATTERN, dense_layers=(0,)),
    )
    reference = S2LlamaForCausalLM(config)
    sharded = copy.deepcopy(reference)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": torch.randint(0, 300, (n,)).tolist()} for n in (100, 37, 64)]
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        loss = sharded(**batch).loss
        loss.backward()
        expected = reference(**batch).loss
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for (name, param), (_, sharded_param) in zip(reference.named_parameters(), sharded.named_parameters()):
            torch.testing.assert_close(sharded_param.grad.full_tensor(), param.grad, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name, distributed_type", [("ddp", "MULTI_GPU"), ("fsdp2", "FSDP")])
def test_accelerate_configs_load(name, distributed_type):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ACCELERATE_CONFIGS / f"{name}.yaml"))
    assert config.distributed_type == distributed_type and config.mixed_precision == "bf16"
    if name == "fsdp2":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "S2LlamaDecoderLayer"
