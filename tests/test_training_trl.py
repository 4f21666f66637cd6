"""TRL's ``SFTTrainer`` fine-tunes a saved S2 checkpoint with its defaults: padded batches, ``packing=True`` (BFD
bins, padding-free) and ``padding_free=True``. Each mode must see the attention the model defines: padded and
padding-free batches of the same examples give the same loss, and packed bins the loss of the SDPA reference."""

import math
import os

import pytest

trl = pytest.importorskip("trl")

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity  # noqa: E402
from s2_models.training.data import iter_documents  # noqa: E402
from s2_models.training.tokenizer import load_tiny_tokenizer  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny S2 hybrid saved with its tokenizer, as a user's fine-tuning starting point."""
    try:
        tokenizer = load_tiny_tokenizer()
    except RuntimeError as e:
        pytest.skip(f"local training text unavailable: {e}")
    config = S2LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        sparsity=hybrid_sparsity(3, PATTERN, dense_layers=(0,)),
    )
    path = tmp_path_factory.mktemp("s2-checkpoint")
    S2LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset():
    from datasets import Dataset

    paragraphs = [p for _, doc in zip(range(10), iter_documents("train")) for p in doc.text.split("\n\n")]
    return Dataset.from_dict({"text": [p[:400] for p in paragraphs[:48]]})  # < 256 tokens: no truncation needed


def sft_losses(checkpoint, dataset, out, steps=2, attn_implementation="s2", s2_backend="auto", **options):
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    defaults = dict(per_device_train_batch_size=4, bf16=False)
    args = SFTConfig(
        output_dir=str(out), max_steps=steps, learning_rate=1e-2, logging_steps=1, use_cpu=True, report_to="none",
        save_strategy="no", seed=0, disable_tqdm=True,
        model_init_kwargs={"attn_implementation": attn_implementation, "s2_backend": s2_backend},
        **{**defaults, **options},
    )
    trainer = SFTTrainer(
        model=str(checkpoint), args=args, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(checkpoint),
    )
    assert isinstance(trainer.model, S2LlamaForCausalLM) and trainer.model.config.s2_backend == s2_backend
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses), losses
    return losses


def test_sft_padded_and_padding_free_batches_match(checkpoint, dataset, tmp_path):
    # max_length=None: TRL does not truncate padding-free batches without packing (the examples are short)
    padded = sft_losses(checkpoint, dataset, tmp_path / "padded", max_length=None)
    padding_free = sft_losses(checkpoint, dataset, tmp_path / "padding-free", padding_free=True, max_length=None)
    assert padded[0] == pytest.approx(math.log(2048), rel=0.1)
    assert padding_free[0] == pytest.approx(padded[0], rel=1e-5)  # same examples, boundaries from position_ids
    assert padding_free[1] == pytest.approx(padded[1], rel=1e-3)  # after one identical update


def test_sft_packing_matches_the_sdpa_reference(checkpoint, dataset, tmp_path):
    s2 = sft_losses(checkpoint, dataset, tmp_path / "s2", packing=True, max_length=128)
    reference = sft_losses(checkpoint, dataset, tmp_path / "sdpa", packing=True, max_length=128,
                           attn_implementation="sdpa")
    assert s2 == pytest.approx(reference, rel=1e-4)


def test_sft_bf16_autocast_on_fp32_weights(checkpoint, dataset, tmp_path):
    """SFTTrainer's default precision: fp32 weights under bf16 autocast (here on the CPU)."""
    losses = sft_losses(checkpoint, dataset, tmp_path / "bf16", bf16=True, max_length=128)
    assert losses[0] == pytest.approx(math.log(2048), rel=0.1)


def test_sft_with_the_triton_kernels_matches_transformers_code(checkpoint, dataset, tmp_path):
    """``s2_backend="triton"`` (the interpreter here; what runs on CUDA): the attention kernels and the fused norms,
    rotary and SwiGLU train with SFTTrainer's padded batches to the losses of the PyTorch path and Llama's code."""
    # Two rows of up to 40 tokens a step: the interpreter runs every kernel program one by one.
    small = dict(max_length=40, per_device_train_batch_size=2)
    triton = sft_losses(checkpoint, dataset, tmp_path / "triton", s2_backend="triton", **small)
    torch_path = sft_losses(checkpoint, dataset, tmp_path / "torch", s2_backend="torch", **small)
    assert triton == pytest.approx(torch_path, rel=1e-4)
