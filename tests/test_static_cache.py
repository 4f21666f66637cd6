"""The static S2 cache: generate(cache_implementation="static") equals the dynamic cache, memory, CUDA graphs."""

import pytest
import torch
from test_cache import PATTERN, tiny_model
from test_modeling import tiny_model as dense_model_of
from transformers import GenerationMixin, StaticCache, StoppingCriteriaList
from transformers.generation import utils as generation_utils

from s2_models import modeling_s2_llama
from s2_models.cache_s2_llama import kv_cache_bytes
from s2_models.kernels.pattern import S2Pattern
from s2_models.modeling_s2_llama import CACHE_NAME
from s2_models.static_cache_s2_llama import DENSE_LAYER_PATTERN, S2StaticCache, S2StaticLayer

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def left_padded(batch=3, length=150, pads=(0, 37, 90), device="cpu"):
    ids = torch.randint(3, 100, (batch, length), device=device)
    mask = (torch.arange(length, device=device)[None, :] >= torch.tensor(pads, device=device)[:, None]).long()
    return ids, mask


def test_static_generation_equals_dynamic_generation_left_padded():
    """Greedy tokens and every step's logits match the dynamic compact cache; the cache is the static one."""
    model = tiny_model()
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=25, output_logits=True, return_dict_in_generate=True, **GREEDY)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    dynamic = model.generate(ids, **kwargs)
    assert isinstance(static.past_key_values, S2StaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=1e-5)
    assert static.past_key_values.get_seq_length() == ids.shape[1] + 24  # the last token is not fed back
    alone = model.generate(ids[2:, 90:], max_new_tokens=25, cache_implementation="static", **GREEDY)
    assert torch.equal(static.sequences[2:, 90:], alone)


def test_create_masks_for_generate_takes_the_cache_under_either_name():
    """generate calls it with ``cache=`` from transformers 5.24 on, with ``past_key_values=`` before."""
    model = tiny_model()
    embeds, mask = torch.empty(2, 7, 0), torch.ones(2, 7, dtype=torch.long)
    for name in ("cache", "past_key_values"):
        cache = S2StaticCache(model.config, 64, cuda_graphs=False)
        assert model.create_masks_for_generate(model.config, embeds, mask, **{name: cache}) is mask  # the prompt's
    assert model.create_masks_for_generate(model.config, embeds, mask, S2StaticCache(model.config, 64)) is mask


def test_decode_step_inputs_equal_transformers_preparation():
    """At a static-cache decode step S2's prepare_inputs_for_generation returns what transformers' version returns
    (views instead of copies; the cache's own create_masks_for_generate drops the mask in both); other steps and
    caches go to transformers' version, and a right-padded generate still equals the dynamic cache."""
    model = tiny_model()
    ids, mask = left_padded(batch=2, length=40, pads=(0, 9))
    cache = S2StaticCache(model.config, max_cache_len=64)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    grown = torch.cat([ids, ids[:, :1]], 1)
    positions = torch.cat([mask.cumsum(-1) - 1, mask.sum(-1, keepdim=True)], 1).clamp(min=0)
    step = dict(attention_mask=torch.cat([mask, mask[:, :1] * 0 + 1], 1), position_ids=positions, use_cache=True,
                logits_to_keep=0, output_hidden_states=False, **{CACHE_NAME: cache})
    ours = model.prepare_inputs_for_generation(grown, next_sequence_length=1, **step)
    theirs = GenerationMixin.prepare_inputs_for_generation(model, grown, next_sequence_length=1, **step)
    assert ours.keys() == theirs.keys() and "attention_mask" not in ours
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] is value
    assert ours["input_ids"].data_ptr() == grown[:, -1:].data_ptr()  # a view: no copy launched
    prompt = model.prepare_inputs_for_generation(grown, next_sequence_length=41, is_first_iteration=True, **step)
    assert prompt["input_ids"].shape == (2, 41) and prompt["input_ids"].is_contiguous()  # transformers' path
    right = torch.randint(3, 100, (2, 30))
    right_mask = torch.ones_like(right)
    right_mask[1, 22:] = 0
    kwargs = dict(attention_mask=right_mask, max_new_tokens=12, **GREEDY)
    assert torch.equal(model.generate(right, cache_implementation="static", **kwargs), model.generate(right, **kwargs))


def _rows_stopping_early(model, ids, mask) -> dict:
    """generate's greedy arguments for 20 new tokens of 3 rows that all stop before: row 0 at its 7th token (the EOS),
    rows 1 and 2 after 4 and 10 tokens (a per-row criterion) or at that EOS."""
    length = ids.shape[1]
    free_run = model.generate(ids, attention_mask=mask, max_new_tokens=20, **GREEDY)
    limits = torch.tensor([2 * length, length + 4, length + 10], device=ids.device)
    stop_rows = StoppingCriteriaList([lambda input_ids, scores: input_ids.shape[1] >= limits])
    return dict(GREEDY, attention_mask=mask, max_new_tokens=20, eos_token_id=int(free_run[0, length + 6]),
                stopping_criteria=stop_rows)


def _deferred_stop_checks(monkeypatch) -> list:
    """The ``steps_to_undo`` of every deferred stop check that S2's generate finishes from now on."""
    undone = []
    finish = modeling_s2_llama._S2DeferredStopCheck.finish
    monkeypatch.setattr(modeling_s2_llama._S2DeferredStopCheck, "finish",
                        lambda self: undone.append(finish(self)) or undone[-1])
    return undone


def test_static_cache_generate_reads_the_stop_flag_one_step_late(monkeypatch):
    """Over an S2StaticCache on CUDA generate defers its stop check by a step (the host queues the next step while
    the GPU runs this one; bench/NOTES.md). Enabled here for the CPU: with rows stopped at different steps (an EOS,
    a per-row criterion), the tokens equal the per-step check's and the dynamic cache's, the extra step is undone,
    and transformers' class is back in place afterwards. A cache that outlives generate is not croppable: per-step
    check."""
    class HostEvent:  # the check's copy-done event; on the CPU every copy is done when issued
        def __init__(self, device, blocking):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch, "Event", HostEvent)
    model = tiny_model()
    ids, mask = left_padded(batch=3, length=60, pads=(0, 11, 30))
    kwargs = _rows_stopping_early(model, ids, mask)
    per_step = model.generate(ids, cache_implementation="static", **kwargs)
    undone = _deferred_stop_checks(monkeypatch)
    monkeypatch.setattr(modeling_s2_llama, "_DEFERRED_STOP_CHECK_DEVICES", frozenset({"cpu"}))
    deferred = model.generate(ids, cache_implementation="static", **kwargs)
    assert undone == [1]  # every row stopped before the length limit: the extra step was undone
    assert ids.shape[1] + 4 <= per_step.shape[1] <= ids.shape[1] + 10
    assert torch.equal(deferred, per_step)
    assert torch.equal(deferred, model.generate(ids, **kwargs))  # the dynamic cache: transformers' own check
    assert undone == [1]
    assert generation_utils.DeferredStopCheck is modeling_s2_llama._TransformersDeferredStopCheck
    returned = model.generate(ids, cache_implementation="static", return_dict_in_generate=True, **kwargs)
    assert undone == [1] and torch.equal(returned.sequences, per_step)


def test_beam_search_and_sampling_equal_the_dynamic_cache():
    model = tiny_model()
    ids = torch.randint(3, 100, (2, 70))
    for kwargs in ({"num_beams": 3, "num_return_sequences": 2}, {"do_sample": True, "top_k": 5}):
        results = []
        for cache_implementation in ("static", None):
            torch.manual_seed(0)
            results.append(model.generate(ids, max_new_tokens=20, pad_token_id=0, eos_token_id=None,
                                          cache_implementation=cache_implementation, **kwargs))
        assert torch.equal(*results)


def test_memory_sparse_layers_hold_the_kept_fraction_dense_layers_everything():
    model = tiny_model()
    n = 1000
    cache = S2StaticCache(model.config, max_cache_len=n)
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 400)), past_key_values=cache, use_cache=True)
    token_bytes = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # K and V, float32
    dense_bs = DENSE_LAYER_PATTERN.block_size
    dense_tokens = (-(-n // dense_bs) + 1) * dense_bs  # every block of n tokens and one (empty) ring block
    blocks = -(-n // PATTERN.block_size)
    kept_tokens = (PATTERN.local_blocks + -(-blocks // PATTERN.vert_stride)) * PATTERN.block_size
    assert kv_cache_bytes(cache) == {"dense": dense_tokens * token_bytes, "s2": 2 * kept_tokens * token_bytes,
                                     "s2_rollback": 0}  # a static cache cannot be cropped: no rollback room


def test_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_cache_len"):
        S2StaticCache(model.config, max_cache_len=0)
    with pytest.raises(ValueError, match="S2LlamaConfig"):
        S2StaticCache(object(), max_cache_len=10)
    cache = S2StaticCache(model.config, max_cache_len=60)
    ids = torch.randint(3, 100, (2, 50))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="one token per row"):
            model(ids[:, :3], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="batch size"):
            model(ids[:1, :1], past_key_values=cache, use_cache=True)
        for _ in range(10):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="max_cache_len=60"):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="batch size"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(ValueError, match="cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="static S2 cache serves"):
        cache.layers[0].update(ids, ids)
    with pytest.raises(ValueError, match="built for the pattern"):
        S2StaticLayer(PATTERN, 10).update_and_attend(*(torch.randn(1, 2, 4, 16),) * 3, S2Pattern(block_size=32))
    with pytest.raises(ValueError, match="offloaded_static"):
        model.generate(ids, max_new_tokens=2, cache_implementation="offloaded_static", **GREEDY)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static", prefill_chunk_size=16, **GREEDY)
    dense = dense_model_of(sparsity="dense")  # transformers builds StaticCache layers for dense models only
    with pytest.raises(ValueError, match="StaticCache is not supported"):
        dense.generate(ids, max_new_tokens=2, past_key_values=StaticCache(config=dense.config, max_cache_len=60),
                       **GREEDY)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match='needs attn_implementation="s2"'):
        model.generate(ids, max_new_tokens=2, cache_implementation="static", **GREEDY)


def test_reset_makes_room_for_a_new_prompt():
    model = tiny_model()
    cache = S2StaticCache(model.config, max_cache_len=100)
    ids = torch.randint(3, 100, (1, 60))
    with torch.no_grad():
        first = model(ids, past_key_values=cache, use_cache=True).logits
        cache.reset()
        again = model(ids, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(first, again)


def assert_same_steps(run, reference, prompt_length, tol, min_steps):
    """Logits of every step up to the first differing token (in half precision a near-tie may pick another token;
    from there on the two runs continue different sequences); at least ``min_steps`` steps must agree."""
    new_tokens = run.sequences[:, prompt_length:] != reference.sequences[:, prompt_length:]
    differing = new_tokens.any(0).nonzero()
    agree = int(differing[0]) if len(differing) else new_tokens.shape[1]
    assert agree >= min_steps
    steps = min(agree + 1, new_tokens.shape[1])  # the first differing token still comes from the same prefix
    torch.testing.assert_close(torch.stack(run.logits[:steps]), torch.stack(reference.logits[:steps]), atol=tol,
                               rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decoding_equals_eager_decoding(dtype):
    """Replayed CUDA graphs give the eager step's logits at every step (left padding, GQA, dense + sparse layers),
    as does the dynamic cache, and a reset cache captures new graphs for its new storage."""
    torch.manual_seed(0)
    model = tiny_model().to("cuda", dtype)
    ids, mask = left_padded(length=300, device="cuda")
    kwargs = dict(attention_mask=mask, max_new_tokens=40, output_logits=True, return_dict_in_generate=True, **GREEDY)
    cache = S2StaticCache(model.config, max_cache_len=400)
    graphed = model.generate(ids, past_key_values=cache, **kwargs)
    assert len(cache._graphs) == 1
    eager = model.generate(ids, past_key_values=S2StaticCache(model.config, 400, cuda_graphs=False), **kwargs)
    dynamic = model.generate(ids, **kwargs)
    tol, min_steps = (1e-4, 40) if dtype == torch.float32 else (2e-2, 10)
    assert_same_steps(graphed, eager, ids.shape[1], tol, min_steps=40)
    assert_same_steps(graphed, dynamic, ids.shape[1], tol, min_steps)
    cache.reset()
    again = model.generate(ids, past_key_values=cache, **kwargs)
    assert torch.equal(again.sequences, graphed.sequences)


@pytest.mark.gpu
def test_cuda_static_generate_defers_its_stop_check(monkeypatch):
    """On CUDA, generate over an S2StaticCache (replayed CUDA graphs) reads the stop flag one step late, undoes the
    extra step, and gives the per-step check's tokens."""
    torch.manual_seed(0)
    model = tiny_model().to("cuda")
    ids, mask = left_padded(length=300, device="cuda")
    kwargs = _rows_stopping_early(model, ids, mask)
    undone = _deferred_stop_checks(monkeypatch)
    deferred = model.generate(ids, cache_implementation="static", **kwargs)
    assert undone == [1]
    monkeypatch.setattr(modeling_s2_llama, "_DEFERRED_STOP_CHECK_DEVICES", frozenset())
    per_step = model.generate(ids, cache_implementation="static", **kwargs)
    assert undone == [1] and torch.equal(deferred, per_step)
    assert ids.shape[1] + 4 <= per_step.shape[1] <= ids.shape[1] + 10
