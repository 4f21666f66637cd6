"""``s2-train`` as users run it: their own files and datasets, packed or padded batches, resuming, and clear errors.

Tiny models (3 layers of width 64, a sparse pattern that is sparse from 48 tokens) on CPU, a few steps each.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from s2_models import S2LlamaForCausalLM
from s2_models.training import train as train_script
from s2_models.training.data import iter_documents
from s2_models.training.tokenizer import load_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}
TINY_OVERRIDES = ("hidden_size=64,intermediate_size=128,num_hidden_layers=3,num_attention_heads=4,"
                  "num_key_value_heads=2,head_dim=16,max_position_embeddings=256")
BLOCK_SIZE = 128


@pytest.fixture(scope="module")
def documents():
    """80 documents of real prose (the tiny tokenizer is trained on the same bundled text)."""
    try:
        load_tiny_tokenizer()
        return [doc.text for _, doc in zip(range(80), iter_documents("train"))]
    except RuntimeError as e:  # no Debian archive reachable and nothing cached
        pytest.skip(f"local training text unavailable: {e}")


@pytest.fixture(scope="module")
def data_dir(documents, tmp_path_factory):
    """The same text as the users' files: train.txt (documents as blank-line-separated paragraphs), two jsonl
    files, and small validation files."""
    root = tmp_path_factory.mktemp("data")
    (root / "train.txt").write_text("\n\n".join(documents[:60]), encoding="utf-8")
    for name, docs in (("train_a.jsonl", documents[:30]), ("train_b.jsonl", documents[30:60])):
        (root / name).write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    validation = [p for d in documents[60:] for p in d.split("\n\n")][:12]
    (root / "validation.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in validation))
    (root / "validation.txt").write_text("\n\n".join(validation), encoding="utf-8")
    return root


def tiny_args(out, *extra, steps=3):
    return [
        "--tokenizer_name", "tiny", "--config_overrides", TINY_OVERRIDES,
        "--sparsity", "hybrid", "--dense_layers", "0", "--pattern", json.dumps(PATTERN),
        "--block_size", str(BLOCK_SIZE), "--output_dir", str(out), "--max_steps", str(steps),
        "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--use_cpu", "--seed", "0", "--disable_tqdm", "true", *extra,
    ]


def logged_losses(out) -> dict[int, float]:
    """Step -> training loss from the run's saved trainer state."""
    with open(out / "trainer_state.json") as f:
        history = json.load(f)["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def test_train_on_user_text_file_with_jsonl_validation(data_dir, tmp_path):
    out = tmp_path / "run"
    metrics = train_script.main(tiny_args(
        out, "--train_file", str(data_dir / "train.txt"), "--validation_file", str(data_dir / "validation.jsonl"),
        "--gradient_checkpointing", "--learning_rate", "1e-2", steps=10,
    ))
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 11))
    assert losses[1] == pytest.approx(math.log(2048), rel=0.1)  # starts near uniform over the tiny vocabulary
    assert sum(losses[s] for s in range(8, 11)) / 3 < losses[1] - 0.6, losses  # and learns
    assert metrics["held-out loss"] < losses[1] - 0.5, metrics
    with open(out / "eval_results.json") as f:
        assert json.load(f)["perplexity"] == pytest.approx(math.exp(metrics["held-out loss"]))
    card = (out / "README.md").read_text()
    assert "held-out perplexity" in card and "| 1 |" in card  # metrics and the per-layer sparsity table

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.sparsity[0] == "dense" and model.config.sparsity[1]["vert_stride"] == PATTERN["vert_stride"]
    inputs = AutoTokenizer.from_pretrained(out)("The kernel", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == inputs.input_ids.shape[1] + 4


def test_packed_and_padded_batches_give_the_same_loss(data_dir, tmp_path):
    """Several jsonl files, a named text column; the first step sees the same tokens packed into one row with
    cu_seqlens or padded to the longest: the loss must agree to float32 rounding."""
    files = ["--train_file", str(data_dir / "train_a.jsonl"), str(data_dir / "train_b.jsonl"),
             "--text_column_name", "body", "--validation_split_percentage", "0", "--do_train"]
    first = {}
    for packing in ("true", "false"):
        out = tmp_path / f"packing-{packing}"
        train_script.main(tiny_args(out, *files, "--packing", packing, steps=2))
        first[packing] = logged_losses(out)
    assert first["true"][1] == pytest.approx(first["false"][1], rel=1e-5, abs=1e-5)
    assert first["true"][2] == pytest.approx(first["false"][2], rel=1e-3)  # after one identical update


def test_resume_from_checkpoint_continues_exactly(data_dir, tmp_path):
    files = ["--train_file", str(data_dir / "train.txt"), "--validation_split_percentage", "0", "--do_train"]
    full = tmp_path / "full"
    train_script.main(tiny_args(full, *files, "--save_strategy", "steps", "--save_steps", "2", steps=4))
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    train_script.main(tiny_args(resumed, *files, "--resume_from_checkpoint", str(resumed / "checkpoint-2"), steps=4))
    uninterrupted, continued = logged_losses(full), logged_losses(resumed)
    assert uninterrupted[4] != uninterrupted[3]  # the steps differ, so matching them means the state was restored
    assert [continued[s] for s in (3, 4)] == pytest.approx([uninterrupted[s] for s in (3, 4)], rel=1e-6)


def test_dataset_from_save_to_disk_folder_streamed(documents, tmp_path):
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "saved"
    DatasetDict({
        "train": Dataset.from_dict({"content": documents[:20]}),
        "validation": Dataset.from_dict({"content": [d[:400] for d in documents[20:23]]}),
    }).save_to_disk(folder)
    out = tmp_path / "run"
    metrics = train_script.main(tiny_args(out, "--dataset_name", str(folder), "--streaming", steps=2))
    assert metrics["training steps"] == 2 and math.isfinite(metrics["held-out loss"])


def test_bundled_text_is_the_default(tmp_path):
    out = tmp_path / "run"
    metrics = train_script.main(tiny_args(out, "--max_train_samples", "8", "--max_eval_samples", "2", steps=1))
    assert metrics["training steps"] == 1 and math.isfinite(metrics["held-out loss"])


def test_converts_a_dense_llama_checkpoint(data_dir, tmp_path):
    """--model_name_or_path on a Llama folder: its weights under the requested sparsity, provenance in the config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tiny_tokenizer()
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    ))
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    out = tmp_path / "run"
    argv = tiny_args(out, "--model_name_or_path", str(tmp_path / "llama"), "--train_file", str(data_dir / "train.txt"),
                     "--do_train", "--learning_rate", "0", steps=1)
    del argv[argv.index("--config_overrides") : argv.index("--config_overrides") + 2]
    train_script.main(argv)
    converted = S2LlamaForCausalLM.from_pretrained(out)
    assert converted.config.converted_from == str(tmp_path / "llama")
    assert converted.config.sparsity[0] == "dense" and converted.config.sparsity[2]["local_blocks"] == 2
    for name, weight in llama.state_dict().items():  # learning rate 0: the dense weights, unchanged
        torch.testing.assert_close(converted.state_dict()[name], weight, msg=name)


def test_bf16_autocast_on_fp32_weights(data_dir, tmp_path):
    """--bf16 on the CPU: Trainer's autocast over float32 weights, as on a GPU."""
    out = tmp_path / "run"
    train_script.main(tiny_args(out, "--train_file", str(data_dir / "train.txt"), "--do_train", "--bf16", steps=2))
    assert all(math.isfinite(loss) for loss in logged_losses(out).values())


def test_callbacks_reach_the_trainer_and_cpu_metrics_hold_no_gpu_memory(data_dir, tmp_path):
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    recorder = StepRecorder()
    out = tmp_path / "run"
    train_script.main(tiny_args(out, "--train_file", str(data_dir / "train.txt"), "--do_train", steps=2),
                      callbacks=[recorder])
    assert recorder.steps == [1, 2]
    with open(out / "train_results.json") as f:
        assert "train_peak_memory_gib" not in json.load(f)


def test_packing_refuses_dataparallel(data_dir, tmp_path, monkeypatch):
    """Several GPUs in one process (Trainer's DataParallel) would cut the packed row's cu_seqlens apart."""
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match="--packing with 2 GPUs in one process.*accelerate launch.*--packing false"):
        train_script.main(tiny_args(tmp_path / "run", "--train_file", str(data_dir / "train.txt"), "--do_train"))


@pytest.mark.parametrize("case", [
    "missing file", "empty file", "absent column", "sparsity layers", "dense layer index", "block size",
    "no sparse layer", "missing model",
    "tokenizer vocabulary", "dataset not cached", "streaming without max_steps", "nothing held out",
])
def test_bad_input_gets_a_value_error_naming_the_argument(case, data_dir, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    train = ["--train_file", str(data_dir / "train.txt")]
    args, message = {
        "missing file": (["--train_file", str(tmp_path / "nope.txt")], "--train_file .*no such file"),
        "empty file": (train + ["--validation_file", str(tmp_path / "empty.txt")], "--validation_file .*is empty"),
        "absent column": (["--train_file", str(data_dir / "train_a.jsonl"), "--text_column_name", "txt"],
                          r"--text_column_name 'txt' is not a column .*\['id', 'body'\]"),
        "missing model": (train + ["--model_name_or_path", str(tmp_path / "nope")],
                          "--model_name_or_path .*nope.* is not a local model folder"),
        "no sparse layer": (train + ["--dense_layers", "0,1,2"], "--dense_layers '0,1,2' makes every layer .* dense"),
        "sparsity layers": (train + ["--sparsity", '["dense", "dense"]'],
                            "--sparsity .* does not fit the model .*3 layers.*one entry per layer"),
        "dense layer index": (train + ["--dense_layers", "0,5"], "--dense_layers '0,5'.*does not fit.*3 layers"),
        "block size": (train + ["--block_size", "512"], r"--block_size must be in \[2, 256\].*got 512"),
        "tokenizer vocabulary": (train + ["--config_overrides", TINY_OVERRIDES + ",vocab_size=1000"],
                                 "--tokenizer_name 'tiny' has 2048 tokens, more than the model's vocab_size 1000"),
        "dataset not cached": (["--dataset_name", "no-such-user/no-such-dataset"],
                               "--dataset_name 'no-such-user/no-such-dataset' was not found locally .*--allow_down"),
        "streaming without max_steps": (train + ["--streaming", "--max_steps", "-1"], "--streaming needs --max_steps"),
        "nothing held out": (["--train_file", str(data_dir / "train_a.jsonl"), "--validation_split_percentage", "1"],
                             r"--validation_split_percentage 1 of .*\(30 rows\) holds no rows"),
    }[case]
    argv = tiny_args(tmp_path / "out")
    for i in range(0, len(args), 2):  # later flags win in argparse; drop the defaults they replace
        if args[i] in argv and args[i] in ("--config_overrides", "--max_steps", "--block_size"):
            del argv[argv.index(args[i]) : argv.index(args[i]) + 2]
    with pytest.raises(ValueError, match=message):
        train_script.main(argv + args)


def test_installed_commands_are_the_module_mains():
    from importlib.metadata import entry_points

    from s2_models.eval import lm_eval_harness, needle, perplexity

    commands = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name.startswith("s2-")}
    expected = {"s2-train": train_script.cli, "s2-eval": lm_eval_harness.main, "s2-niah": needle.main,
                "s2-ppl": perplexity.main}
    for name, function in expected.items():
        assert commands[name].load() is function, name
    path = shutil.which("s2-train", path=os.path.dirname(sys.executable))
    result = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "--train_file" in result.stdout and "--sparsity" in result.stdout, result.stderr


def test_parse_arguments_reject_bad_input():
    with pytest.raises(ValueError, match="--sparsity must be one of"):
        train_script.parse_sparsity("sparse-ish", 2, None, "0")
    with pytest.raises(ValueError, match="--pattern"):
        train_script.parse_sparsity("hybrid", 2, "{not json", "0")
    with pytest.raises(ValueError, match="key=value"):
        train_script.parse_overrides("hidden_size64")


def test_padded_collator_masks_padding_not_the_pad_id():
    collator = train_script.PaddedCausalLMCollator(pad_token_id=7)
    batch = collator([{"input_ids": [5, 7, 9]}, {"input_ids": [3]}])  # 7 is real in row 0 (a pad that is also EOS)
    torch.testing.assert_close(batch["input_ids"], torch.tensor([[5, 7, 9], [3, 7, 7]]))
    torch.testing.assert_close(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    torch.testing.assert_close(batch["labels"], torch.tensor([[5, 7, 9], [3, -100, -100]]))
