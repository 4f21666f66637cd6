"""bench/item_cost_model.py on the CPU: the fit recovers the per-item and per-step costs it was given, and the counts
taken from the package's lists agree with dense causal attention's where the pattern keeps every block."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import item_cost_model  # noqa: E402


def test_the_fit_recovers_the_costs_of_dense_rows():
    per_item, per_step = 3e-5, 1.5e-5  # ms a work item and a step, over all programs
    rows = []
    for seqlen in (1024, 2048, 8192):
        items, steps = item_cost_model.dense_counts(131072 // seqlen, 32, seqlen)
        for round_, noise in enumerate((0.99, 1.01, 1.0)):  # the median round is the exact one
            rows.append(dict(section=f"dense work, T={seqlen}", impl="sdpa-cudnn", mode="fwd", batch=131072 // seqlen,
                             heads=32, seqlen=seqlen, round=round_, ms=(items * per_item + steps * per_step) * noise))
    rows.append(dict(section="block 64, T=8192", impl="sdpa-cudnn", mode="fwd", batch=16, heads=32, seqlen=8192,
                     ms=1.0))  # not a dense-work row: left out of the fit
    fitted = item_cost_model.dense_fits(rows)["sdpa-cudnn"]
    assert fitted == pytest.approx((per_item, per_step), rel=1e-9)


def test_a_pattern_that_keeps_every_block_has_dense_attentions_items_and_steps():
    seqlen = 1024
    fields = dict(block_size=64, local_blocks=seqlen // 64)
    assert item_cost_model.sparse_counts(fields, 2, seqlen, 4, 4) == item_cost_model.dense_counts(2, 4, seqlen)
    # a sparse pattern reads fewer steps, and its split steps count as half a step
    items, steps = item_cost_model.sparse_counts(dict(block_size=64, local_blocks=4), 2, seqlen, 4, 4)
    assert items == 2 * 4 * seqlen // 128 and 0 < steps < item_cost_model.dense_counts(2, 4, seqlen)[1]
    assert steps * 2 == int(steps * 2)
