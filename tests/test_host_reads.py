"""What ``s2_attention`` reads back to the host (a device sync on a GPU) is read once per tensor, not once per call:
the packed offsets and the padding mask a model hands to every layer, in the forward, a checkpointed recompute and the
backward (``kernels/interface.py``'s ``HostReadMemo``). A tensor written in place, or a new one, is read again."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.kernels import S2Pattern, interface, s2_attention

PATTERN = S2Pattern(block_size=16, local_blocks=2, vert_stride=4)


@pytest.fixture
def reads(monkeypatch):
    """Counts of the host reads: ``varlen`` (packed offsets) and ``padding`` (padding masks with padding)."""
    counts = {"varlen": 0, "padding": 0}

    def counted(name, read):
        def wrapper(*args):
            counts[name] += 1
            return read(*args)

        return wrapper

    monkeypatch.setattr(interface, "_read_varlen", counted("varlen", interface._read_varlen))
    monkeypatch.setattr(interface, "padding_to_varlen", counted("padding", interface.padding_to_varlen))
    return counts


def packed_inputs(lengths=(37, 16, 50)):
    total = sum(lengths)
    q, k, v = (torch.randn(1, 4, total, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def attend_packed(q, k, v, cu_q, cu_k, **kwargs):
    return s2_attention(q, k, v, PATTERN, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch", **kwargs)


def test_the_same_offsets_are_read_once_for_every_forward_and_backward(reads):
    q, k, v, cu = packed_inputs()
    outs = [attend_packed(q, k, v, cu, cu, max_seqlen_q=50, max_seqlen_k=50) for _ in range(3)]
    sum(out.sum() for out in outs).backward()
    assert reads["varlen"] == 1
    # the given maxima are still checked on every call, against the offsets read once
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence \\(50\\), got 49"):
        attend_packed(q, k, v, cu, cu, max_seqlen_q=49)
    assert reads["varlen"] == 1


def test_offsets_written_in_place_are_read_again(reads):
    q, k, v, cu = packed_inputs()
    attend_packed(q, k, v, cu, cu)
    cu[1] += 5  # a valid change: sequences of 42, 11, 50
    moved = attend_packed(q, k, v, cu, cu)
    assert reads["varlen"] == 2
    fresh = attend_packed(q, k, v, cu.clone(), cu.clone())  # new tensors, same values
    assert reads["varlen"] == 3 and torch.equal(moved, fresh)
    cu[-1] -= 1  # no longer ends at the packed length: refused, not answered from the memo
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, never decrease, and end at the packed"):
        attend_packed(q, k, v, cu, cu)


def test_inference_tensors_are_read_on_every_call(reads):
    with torch.inference_mode():
        q, k, v, cu = packed_inputs()
        for _ in range(2):
            attend_packed(q, k, v, cu, cu)
    assert reads["varlen"] == 2


def test_a_padding_mask_is_read_once_and_again_after_an_in_place_write(reads):
    q, k, v = (torch.randn(2, 4, 40, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :7] = False
    outs = [s2_attention(q, k, v, PATTERN, attention_mask=mask, backend="torch") for _ in range(2)]
    sum(out.sum() for out in outs).backward()
    assert reads["padding"] == 1
    mask[1, :3] = False
    again = s2_attention(q, k, v, PATTERN, attention_mask=mask, backend="torch")
    assert reads["padding"] == 2
    assert torch.equal(again, s2_attention(q, k, v, PATTERN, attention_mask=mask.clone(), backend="torch"))
    assert again[1, :, :3].abs().sum() == 0  # the newly padded queries: zero rows, as read after the write


def packed_training_step(device: str, head_dim: int, pattern: dict):
    """Loss and gradients of one checkpointed training step of a hybrid model (a dense layer, sparse ones) on a
    collated packed batch, under bf16 autocast on a GPU."""
    torch.manual_seed(0)
    config = S2LlamaConfig(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=head_dim, max_position_embeddings=1024,
                           sparsity=hybrid_sparsity(3, pattern, dense_layers=(0,)))
    model = S2LlamaForCausalLM(config).to(device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lengths = (45, 9, 70) if device == "cpu" else (300, 45, 700)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": torch.randint(0, 128, (n,)).tolist()} for n in lengths])
    batch = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()}
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_a_checkpointed_packed_training_step_reads_its_offsets_once(reads):
    """Every layer's forward, recompute and backward use the batch's offsets, read from the device once."""
    packed_training_step("cpu", 16, {"block_size": 16, "local_blocks": 2, "vert_stride": 2})
    assert reads["varlen"] == 1


@pytest.mark.gpu
def test_a_packed_training_step_on_the_gpu_reads_once_and_computes_what_reading_every_call_does(reads, monkeypatch):
    """On the Triton kernels (deterministic backward): the step with the memo equals, bit for bit, the step that
    reads the offsets in every call."""
    pattern = {"block_size": 64, "local_blocks": 2, "vert_stride": 4}
    loss, grads = packed_training_step("cuda", 64, pattern)
    assert reads["varlen"] == 1
    monkeypatch.setattr(interface.HostReadMemo, "get", lambda self, tensors, key, read: read())
    unmemoized_loss, unmemoized_grads = packed_training_step("cuda", 64, pattern)
    assert reads["varlen"] > 3
    assert torch.isfinite(loss) and torch.equal(loss, unmemoized_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, unmemoized_grads))
