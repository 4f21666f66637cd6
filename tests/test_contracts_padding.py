"""Any 2-D padding mask (issue 13, item 2): right padding and holes, in forward (with and without cache), training
and generate. A row's positions count its real tokens (``attention_mask.cumsum(-1) - 1``, the position_ids generate
computes), so a row with a hole computes what the row without the masked tokens computes."""


import pytest
import torch
from test_contracts_positions import same_weights

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity

PATTERN = {"block_size": 16, "local_blocks": 1, "vert_stride": 3}
IMPLEMENTATIONS = ("s2", "sdpa", "eager")
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def model_of(implementation="s2", sparsity=None):
    torch.manual_seed(0)
    config = S2LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sparsity=hybrid_sparsity(2, PATTERN, dense_layers=(0,)) if sparsity is None else sparsity)
    model = S2LlamaForCausalLM(config).eval()
    model.set_attn_implementation(implementation)
    return model


def holey_batch():
    """Row 0: holes at 20-22 and 40; row 1: 5 tokens of left padding, a hole at 30, right padding from 60."""
    ids = torch.randint(1, 100, (2, 66))
    mask = torch.ones_like(ids)
    mask[0, 20:23] = mask[0, 40] = 0
    mask[1, :5] = mask[1, 30] = mask[1, 60:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("use_cache", [True, False])
def test_holes_equal_the_rows_without_the_masked_tokens(implementation, use_cache):
    model = model_of(implementation)
    ids, mask = holey_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=use_cache).logits
        for row in range(2):
            real = mask[row].bool()
            alone = model(ids[row : row + 1, real]).logits[0]
            assert_close(out[row, real], alone)
        assert torch.isfinite(out).all()  # padding rows too
        # the holes matter: attending to the masked tokens changes the rows after them
        ignored = model(ids, position_ids=positions(mask), use_cache=use_cache).logits
        assert (ignored[0, 23:] - out[0, 23:]).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", ["s2", "sdpa"])
def test_cached_chunks_and_decode_steps_with_holes_equal_one_forward(implementation):
    """A prompt with holes, then a chunk with a hole inside (run token by token) and decode steps (one a padding
    token): the logits of real tokens equal one forward over everything."""
    model = model_of(implementation)
    ids, mask = holey_batch()
    mask[:, 50] = 0  # a hole inside the chunk 45:55 in both rows
    mask[0, 57] = 0  # a padding decode step in row 0
    mask[1, 60:] = 1
    full = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
    with torch.no_grad():
        out = model(ids[:, :45], attention_mask=mask[:, :45], position_ids=positions(mask)[:, :45])
        cache, pieces = out.past_key_values, [out.logits]
        for start, end in [(45, 55), *((t, t + 1) for t in range(55, 66))]:
            step = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions(mask)[:, start:end],
                         past_key_values=cache)
            pieces.append(step.logits)
    incremental = torch.cat(pieces, 1)
    real = mask.bool()
    assert_close(incremental[real], full[real])
    assert torch.isfinite(incremental).all()


def test_fully_masked_rows_are_finite_and_leave_other_rows_alone():
    for implementation in IMPLEMENTATIONS:
        model = model_of(implementation)
        ids = torch.randint(1, 100, (2, 40))
        mask = torch.ones_like(ids)
        mask[1] = 0
        with torch.no_grad():
            out = model(ids, attention_mask=mask).logits
            assert torch.isfinite(out).all(), implementation
            assert_close(out[0], model(ids[:1]).logits[0])


def test_training_batch_with_holes_and_right_padding_matches_the_reference():
    """Loss and gradients of a training batch with holes, right padding and a fully masked row: the S2 kernels
    equal the reference implementation, and everything is finite."""
    ids, mask = holey_batch()
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, torch.zeros_like(mask[:1])])
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # no prediction from a padding position
    results = []
    s2 = model_of("s2").train()
    for model in (s2, same_weights(s2, "sdpa").train()):
        loss = model(ids, attention_mask=mask, position_ids=positions(mask), labels=labels).loss
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = results
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_generate_from_right_padded_prompts_warns_and_continues_each_row(caplog):
    """transformers warns about right padding and generates, as for Llama. The first new token of a right-padded
    row is predicted at a padding position (what transformers warns about; S2 layers return 0 for padding queries);
    from then on the row continues exactly as the prompt without its padding, followed by that token."""
    short, long = torch.randint(1, 100, (1, 21)), torch.randint(1, 100, (1, 50))
    ids = torch.cat([torch.cat([short, torch.zeros(1, 29, dtype=torch.long)], 1), long])
    mask = (ids != 0).long()
    model = model_of()
    kwargs = dict(attention_mask=mask, max_new_tokens=20, output_logits=True, return_dict_in_generate=True, **GREEDY)
    with caplog.at_level("WARNING"):
        out = model.generate(ids, **kwargs)
    assert "right-padding was detected" in caplog.text
    first = out.sequences[:1, 50:51]
    alone = model.generate(torch.cat([short, first], 1), max_new_tokens=19, **GREEDY)
    assert torch.equal(out.sequences[0, 50:], alone[0, 21:])
    assert torch.equal(out.sequences[1:], model.generate(long, max_new_tokens=20, **GREEDY))
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static.sequences, out.sequences)
    assert_close(torch.stack(static.logits), torch.stack(out.logits))


def test_generate_with_a_hole_equals_the_prompt_without_it():
    """A pad token inside a prompt (its mask 0): the row generates what the prompt without that token generates."""
    model = model_of()
    ids = torch.randint(1, 100, (2, 45))
    mask = torch.ones_like(ids)
    ids[0, 17] = 0
    mask[0, 17] = 0
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=20, **GREEDY)
    without = torch.cat([ids[:1, :17], ids[:1, 18:]], 1)
    alone = model.generate(without, max_new_tokens=20, **GREEDY)
    assert torch.equal(batched[0, 45:], alone[0, 44:])
    assert torch.equal(batched[1:], model.generate(ids[1:], max_new_tokens=20, **GREEDY))
    reference = same_weights(model, "sdpa").generate(ids, attention_mask=mask, max_new_tokens=20, **GREEDY)
    assert torch.equal(reference, batched)


@pytest.mark.gpu
def test_holes_and_right_padding_on_gpu():
    """Triton prefill, append and decode kernels (fp32) with holes and right padding: cached chunks and padding
    decode steps equal one forward, and a batch with a hole and a right-padded row generates as the rows alone."""
    model = model_of().cuda()
    ids, mask = holey_batch()
    ids, mask = ids.cuda(), mask.cuda()
    mask[:, 50] = 0
    mask[1, 60:] = 1
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
        out = model(ids[:, :45], attention_mask=mask[:, :45], position_ids=positions(mask)[:, :45])
        pieces = [out.logits]
        for start, end in [(45, 55), *((t, t + 1) for t in range(55, 66))]:
            pieces.append(model(ids[:, start:end], attention_mask=mask[:, :end],
                                position_ids=positions(mask)[:, start:end], past_key_values=out.past_key_values).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], atol=2e-4, rtol=1e-4)

    prompts, prompt_mask = holey_batch()  # row 0 has holes, row 1 left and right padding and a hole
    generated = model.generate(prompts.cuda(), attention_mask=prompt_mask.cuda(), max_new_tokens=24, **GREEDY)
    hole_row = prompt_mask[0].bool()
    alone = model.generate(prompts[:1, hole_row].cuda(), max_new_tokens=24, **GREEDY)
    assert torch.equal(generated[0, 66:], alone[0, int(hole_row.sum()):])
