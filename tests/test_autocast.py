"""Mixed precision as Trainer, accelerate and TRL run it: float32 weights under ``torch.autocast`` (bf16 and fp16).

The ``"s2"`` implementation must compute what the reference computes under the same autocast: ``"sdpa"`` with the
same sparse pattern (a 4-D mask), and ``LlamaForCausalLM`` for an all-dense config. Tolerances follow the project's
rule: against a float64 truth (the ``"sdpa"`` reference in float64, no autocast), the error of ``"s2"`` stays within 2x
(3x for gradients) of the reference's own error in the same autocast dtype.
"""

import copy

import pytest
import torch
from test_modeling import tiny_config, tokens
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import s2_models.modeling_s2_llama as modeling
from s2_models import S2LlamaForCausalLM
from s2_models.static_cache_s2_llama import S2StaticCache

DTYPES = [torch.bfloat16, torch.float16]


def models(sparsity=None, s2_backend="auto", device="cpu"):
    """``{"s2": ..., "sdpa": ...}`` float32 models with the same weights, and the float64 truth (SDPA, which keeps
    fully masked padding rows finite; eager's additive masks overflow to -inf there in float64, and NaN gradients)."""
    torch.manual_seed(0)
    s2 = S2LlamaForCausalLM(tiny_config(sparsity, s2_backend=s2_backend)).to(device).eval()
    reference = copy.deepcopy(s2)
    reference.set_attn_implementation("sdpa")
    truth = copy.deepcopy(reference).double()
    return {"s2": s2, "sdpa": reference}, truth


def autocast(dtype, device="cpu"):
    return torch.autocast(device, dtype=dtype)


def assert_within_reference_error(run, dtype, sparsity=None, factor=2.0, s2_backend="auto", device="cpu"):
    """``run(model) -> tensor`` under autocast for "s2" and "sdpa", and in float64 for the truth: the "s2" error is
    at most ``factor`` times the reference's (both are dominated by the same 16-bit matmuls; a wrong attention,
    e.g. 16-bit internals of the PyTorch path, or a failure, breaks it)."""
    candidates, truth = models(sparsity, s2_backend, device)
    expected = run(truth).double()
    errors = {}
    for name, model in candidates.items():
        with autocast(dtype, device):
            result = run(model)
        assert torch.isfinite(result).all(), name
        errors[name] = (result.double() - expected).abs().max().item()
    assert 0 < errors["sdpa"] < 0.5, errors  # the comparison means something: a 16-bit error, not a broken model
    assert errors["s2"] <= factor * errors["sdpa"], errors


def loss_and_gradients(**inputs):
    def run(model):
        model.zero_grad(set_to_none=True)
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        return torch.cat([loss.detach().view(1)] + [
            p.grad.flatten() for p in model.parameters() if p.grad is not None
        ])

    return run


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_step_matches_the_reference(dtype):
    ids = tokens(2, 75)
    assert_within_reference_error(loss_and_gradients(input_ids=ids, labels=ids), dtype, factor=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_batch_matches_the_reference(dtype):
    ids = tokens(2, 70)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    assert_within_reference_error(loss_and_gradients(input_ids=ids, attention_mask=mask, labels=labels), dtype,
                                  factor=3.0)

    def real_logits(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]

    assert_within_reference_error(real_logits, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_sequences_match_the_reference(dtype):
    lengths = (30, 45, 20)
    ids = tokens(1, sum(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    assert_within_reference_error(
        loss_and_gradients(input_ids=ids, position_ids=position_ids, labels=ids), dtype, factor=3.0
    )


def test_fp16_triton_kernels_match_the_reference():
    """The Triton path (interpreted on CPU; fp16 only: the interpreter's bf16 dot is wrong) under fp16 autocast."""
    ids = tokens(1, 40)
    assert_within_reference_error(loss_and_gradients(input_ids=ids, labels=ids), torch.float16, factor=3.0,
                                  s2_backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_see_the_dtypes_sdpa_sees(dtype, monkeypatch):
    """What autocast does to SDPA's inputs: q, k, v all in the autocast dtype (q and k leave RoPE in float32), and
    the op itself runs with autocast off (the PyTorch path keeps float32 math inside)."""
    seen = []

    def spy(attention):
        def wrapped(q, k, v, *args, **kwargs):
            seen.append((attention.__name__, q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
            return attention(q, k, v, *args, **kwargs)

        return wrapped

    for name in ("s2_attention", "dense_attention"):
        monkeypatch.setattr(modeling, name, spy(getattr(modeling, name)))
    model = models()[0]["s2"]
    ids = tokens(2, 40)
    with autocast(dtype):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert {entry[0] for entry in seen} == {"s2_attention", "dense_attention"}
    assert all(entry[1:] == (dtype, dtype, dtype, False) for entry in seen), seen


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_decoding_matches_the_reference(dtype, cache):
    """Prompt, then token-by-token decoding over the compact cache (dynamic or static), left-padded batch."""
    assert_decoding_within_reference_error(dtype, cache, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_bf16_autocast_on_gpu_matches_the_reference(cache):
    """The Triton kernels under bf16 autocast (the interpreter cannot check bf16): a training step, and decoding
    (with the static cache, its decode steps replay CUDA graphs captured under autocast)."""
    ids = tokens(2, 75).cuda()
    assert_within_reference_error(loss_and_gradients(input_ids=ids, labels=ids), torch.bfloat16, factor=3.0,
                                  device="cuda")
    assert_decoding_within_reference_error(torch.bfloat16, cache, "cuda")


def assert_decoding_within_reference_error(dtype, cache, device):
    ids = tokens(2, 58).to(device)
    mask = torch.ones_like(ids)
    mask[1, :19] = 0
    prompt = 50

    def run(model):
        static = cache == "static" and model.config._attn_implementation == "s2"
        past = S2StaticCache(model.config, max_cache_len=64) if static else DynamicCache(config=model.config)
        with torch.no_grad():
            steps = [model(input_ids=ids[:, :prompt], attention_mask=mask[:, :prompt], past_key_values=past,
                           use_cache=True).logits]
            for t in range(prompt, ids.shape[1]):
                steps.append(model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1],
                                   past_key_values=past, use_cache=True).logits)
        if static:
            assert isinstance(past, S2StaticCache)
        return torch.cat(steps, dim=1)[mask.bool()]

    assert_within_reference_error(run, dtype, device=device)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_under_autocast(cache_implementation):
    model = models()[0]["s2"]
    ids = tokens(2, 40)
    with autocast(torch.bfloat16):
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None,
                             cache_implementation=cache_implementation)
    assert out.shape == (2, 48)


# ------------------------------------------------------------------------------------------------ Llama control
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_dense_model_matches_llama(dtype):
    """An all-dense S2Llama ("s2": SDPA through dense_attention) equals transformers' Llama (SDPA) under autocast."""
    torch.manual_seed(0)
    config = tiny_config("dense")
    llama = LlamaForCausalLM(LlamaConfig(**{k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")}, attn_implementation="sdpa"))
    s2 = S2LlamaForCausalLM(config)
    s2.load_state_dict(llama.state_dict())
    ids = tokens(2, 60)
    results = []
    for model in (llama, s2):
        with autocast(dtype):
            results.append(loss_and_gradients(input_ids=ids, labels=ids)(model))
    torch.testing.assert_close(results[1], results[0], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ Trainer
class _Repeated(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return 64

    def __getitem__(self, i):
        row = self.ids[i % len(self.ids)]
        return {"input_ids": row, "labels": row}


def test_trainer_bf16_on_cpu_trains(tmp_path, monkeypatch):
    """``Trainer(bf16=True, use_cpu=True)``: float32 weights under bf16 autocast, sparse layers included."""
    dtypes = []
    attention = modeling.s2_attention

    def spy(q, k, v, *args, **kwargs):
        dtypes.append(q.dtype)
        return attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(modeling, "s2_attention", spy)
    torch.manual_seed(0)
    model = S2LlamaForCausalLM(tiny_config())
    args = TrainingArguments(
        output_dir=str(tmp_path), bf16=True, use_cpu=True, per_device_train_batch_size=4, max_steps=16,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Repeated(tokens(4, 48)))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 16 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses  # from ~4.6 (ln 100)
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
