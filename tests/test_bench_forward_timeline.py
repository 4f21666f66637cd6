"""bench/hopper_fwd_timeline.py on the CPU: its source patches still find their places in the current Gluon forward,
and the segments it reports from the stamps."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import hopper_fwd_timeline  # noqa: E402


@pytest.mark.parametrize("events", hopper_fwd_timeline.EVENT_SETS)
def test_timeline_patches_apply_to_the_current_kernel(tmp_path, events):
    module = hopper_fwd_timeline.instrumented_kernel(str(tmp_path), events)  # raises if an anchor is gone
    source = next(tmp_path.glob("hopper_fwd_timeline_*.py")).read_text()
    # the loader's three, each consumer event's one (event 5 also at the first item), the helper's definition
    assert source.count("_stamp(trace,") == 3 + len(events) + (5 in events) + 1
    assert hasattr(module, "_stamp") and hasattr(module, "s2_attention_fwd_ws_kernel")


def test_segments_from_stamps():
    """Consumer 0 runs items of 9 regular steps (a split step first): a loop of 8 steps of 1 us, then the boundary's
    events 1, 2, 3, 0.5 and 4 us apart; consumer 1 stamped nothing; the loader claims each item 6 us before the
    boundary into it begins."""
    trace = np.full((2, hopper_fwd_timeline.ITEMS, 16), -1, dtype=np.int64)
    for program in range(2):
        start = 1_000_000 * program  # ns, any origin
        for item in range(4):
            event = [0] * 6
            event[5] = start
            event[0] = start + 8_000
            event[1] = event[0] + 1_000
            event[2] = event[1] + 2_000
            event[3] = event[2] + 3_000
            event[4] = event[3] + 500
            trace[program, item, :6] = [event[e] for e in range(6)]
            trace[program, item, 12] = event[0] - 6_000 - 18_500  # claimed 6 us before the previous boundary
            trace[program, item, 13] = trace[program, item, 12] + 300
            trace[program, item, 14] = trace[program, item, 12] + 700
            trace[program, item, 15] = 9 * 2 + 1
            start = event[4] + 4_000
    result = hopper_fwd_timeline.segments(trace)
    consumer = result["consumer 0"]
    for name, us in (("loop", 8.0), ("decode", 1.0), ("issue", 2.0), ("last_products", 3.0), ("epilogue", 0.5),
                     ("start", 4.0), ("boundary", 10.5), ("item", 18.5), ("step", 1.0), ("boundary_in_steps", 10.5)):
        assert consumer[name] == [us] * 3, name
    assert all(value is None for value in result["consumer 1"].values())
    assert result["loader"] == {"q_issued_after_claim": [0.3] * 3, "copies_issued_after_claim": [0.7] * 3,
                                "claim_ahead_of_boundary": [6.0] * 3}
    assert result["items_stamped"] == 8
