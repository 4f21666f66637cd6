"""Sequence classification, token classification and question answering heads, as Llama has them.

Control: transformers' Llama heads with the same weights (all-dense config). Then padding, the hybrid's sparse layers,
the Auto classes, save/reload with this package and through remote code without it.
"""

import json

import pytest
import torch
from test_model_checkpoints import run_without_package
from test_modeling import tiny_config, tokens
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

from s2_models import S2LlamaForQuestionAnswering, S2LlamaForSequenceClassification, S2LlamaForTokenClassification
from s2_models.remote_code import AUTO_MAP

HEADS = {  # S2 head: (Auto class, Llama head, labels for a batch of real lengths [B])
    S2LlamaForSequenceClassification: (
        AutoModelForSequenceClassification, LlamaForSequenceClassification,
        lambda lengths: {"labels": tokens(len(lengths)) % 3},
    ),
    S2LlamaForTokenClassification: (
        AutoModelForTokenClassification, LlamaForTokenClassification,
        lambda lengths: {"labels": (tokens(len(lengths), max(lengths)) % 3).masked_fill(  # -100: padding
            torch.arange(max(lengths))[None] >= torch.tensor(lengths)[:, None], -100)},
    ),
    S2LlamaForQuestionAnswering: (
        AutoModelForQuestionAnswering, LlamaForQuestionAnswering,
        lambda lengths: {"start_positions": tokens(len(lengths)) % torch.tensor(lengths),
                         "end_positions": tokens(len(lengths)) % torch.tensor(lengths)},
    ),
}
LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "pad_token_id", "num_labels")


def head_model(head, sparsity=None):
    torch.manual_seed(0)
    return head(tiny_config(sparsity, num_labels=3, pad_token_id=0)).eval()


def outputs(model, **inputs):
    """The head's outputs (logits, or start and end logits) and its loss."""
    with torch.no_grad():
        out = model(**inputs)
    logits = (out.start_logits, out.end_logits) if hasattr(out, "start_logits") else (out.logits,)
    return logits, out.loss


LENGTHS = (50, 31, 17)


def right_padded(lengths=LENGTHS):
    ids = tokens(len(lengths), max(lengths))
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("head", HEADS, ids=lambda h: h.__name__)
def test_all_dense_head_equals_llama(head):
    s2 = head_model(head, "dense")
    llama_head = HEADS[head][1]
    config = s2.config
    llama = llama_head(LlamaConfig(**{k: getattr(config, k) for k in LLAMA_FIELDS}, attn_implementation="sdpa"))
    llama.eval().load_state_dict(
        {k.replace("model.", f"{llama.base_model_prefix}.", 1): v for k, v in s2.state_dict().items()}
    )
    ids, mask = right_padded()
    inputs = dict(input_ids=ids, attention_mask=mask, **HEADS[head][2](LENGTHS))
    (actual, actual_loss), (expected, expected_loss) = outputs(s2, **inputs), outputs(llama, **inputs)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape
        if a.shape[:2] == mask.shape:  # per-token logits: padded positions mean nothing in either
            a, e = a[mask.bool()], e[mask.bool()]
        torch.testing.assert_close(a, e)
    if head is not S2LlamaForQuestionAnswering:  # its loss takes a softmax over padded positions too
        torch.testing.assert_close(actual_loss, expected_loss)
    unpadded = dict(input_ids=tokens(2, 40), **HEADS[head][2]((40, 40)))
    torch.testing.assert_close(outputs(s2, **unpadded)[1], outputs(llama, **unpadded)[1])


@pytest.mark.parametrize("head", HEADS, ids=lambda h: h.__name__)
def test_shapes_and_loss_of_the_hybrid(head):
    model = head_model(head).train()
    ids = tokens(2, 45)
    out = model(input_ids=ids, **HEADS[head][2]((45, 45)))
    if head is S2LlamaForSequenceClassification:
        assert out.logits.shape == (2, 3)
    elif head is S2LlamaForTokenClassification:
        assert out.logits.shape == (2, 45, 3)
    else:
        assert out.start_logits.shape == out.end_logits.shape == (2, 45)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.layers[-1].self_attn.q_proj.weight.grad.abs().sum() > 0  # through a sparse layer


@pytest.mark.parametrize("side", ["right", "left"])
def test_sequence_classification_pools_the_last_real_token(side):
    model = head_model(S2LlamaForSequenceClassification)  # hybrid: sparse layers beyond the first block
    ids, mask = right_padded()
    if side == "left":
        ids, mask = ids.flip(-1), mask.flip(-1)
        ids = torch.where(mask.bool(), tokens(*ids.shape), 0)
    (batched,), _ = outputs(model, input_ids=ids, attention_mask=mask)
    for row in range(ids.shape[0]):
        (alone,), _ = outputs(model, input_ids=ids[row : row + 1][mask[row : row + 1].bool()][None])
        torch.testing.assert_close(batched[row], alone[0], atol=2e-5, rtol=1e-4)


def test_sequence_classification_problem_types():
    model = head_model(S2LlamaForSequenceClassification)
    ids = tokens(4, 20)
    model.config.problem_type = "regression"
    model.config.num_labels = 3
    assert torch.isfinite(model(input_ids=ids, labels=torch.randn(4, 3)).loss)
    model.config.problem_type = "multi_label_classification"
    assert torch.isfinite(model(input_ids=ids, labels=(torch.rand(4, 3) > 0.5).float()).loss)


@pytest.mark.parametrize("head", HEADS, ids=lambda h: h.__name__)
def test_save_and_reload_through_the_auto_class(head, tmp_path):
    model = head_model(head)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == AUTO_MAP
    auto_class = HEADS[head][0]
    reloaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(reloaded) is head and reloaded.config._attn_implementation == "s2"
    ids = tokens(2, 40)
    for a, e in zip(outputs(reloaded, input_ids=ids)[0], outputs(model, input_ids=ids)[0]):
        assert torch.equal(a, e)


# Fresh interpreter without this package (test_model_checkpoints.run_without_package): every head through its Auto
# class and trust_remote_code.
REMOTE_HEADS = """
import sys
import torch
import transformers

for path, auto_name in zip(sys.argv[1::2], sys.argv[2::2]):
    model = getattr(transformers, auto_name).from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert type(model.model).__name__ == "S2LlamaModel"
    with torch.no_grad():
        out = model(input_ids=torch.load(path + "/ids.pt"))
    torch.save(tuple(v for k, v in out.items() if k.endswith("logits")), path + "/remote.pt")
"""


def test_remote_code_loads_every_head_without_the_package(tmp_path):
    args, expected = [], {}
    ids = tokens(2, 40)
    for head, (auto_class, _, _) in HEADS.items():
        path = tmp_path / head.__name__
        model = head_model(head)
        model.save_pretrained(path)
        torch.save(ids, path / "ids.pt")
        args += [path, auto_class.__name__]
        expected[path] = outputs(model, input_ids=ids)[0]
    run_without_package(tmp_path, *args, script=REMOTE_HEADS)
    for path, logits in expected.items():
        for a, e in zip(torch.load(path / "remote.pt"), logits, strict=True):
            assert torch.equal(a, e), path.name


def test_a_llama_checkpoint_converts_into_an_s2_classifier(tmp_path):
    """The fine-tuning start users expect: a dense Llama checkpoint loaded into an S2 head (new head layer)."""
    torch.manual_seed(0)
    config = tiny_config("dense", pad_token_id=0)
    llama = LlamaForSequenceClassification(LlamaConfig(**{k: getattr(config, k) for k in LLAMA_FIELDS}))
    llama.save_pretrained(tmp_path)
    s2 = S2LlamaForSequenceClassification.from_pretrained(tmp_path, sparsity="dense").eval()
    ids = tokens(2, 30)
    with torch.no_grad():
        torch.testing.assert_close(s2.model(input_ids=ids).last_hidden_state,
                                   llama.eval().model(input_ids=ids).last_hidden_state)
        torch.testing.assert_close(s2(input_ids=ids).logits, llama(input_ids=ids).logits)
