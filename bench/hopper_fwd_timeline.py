"""Where the warp-specialized forward's item boundaries go: per-item timelines of its partitions (GPU).

``kernels/hopper_fwd.py``'s kernel, instrumented (a copy, patched below through ``kernel_versions``): every consumer
stores ``%globaltimer`` at six events of each work item, the loader at three, into ``TRACE [programs, ITEMS, 16]``
(the first ``ITEMS`` items of each program). Consumer ``c``'s slots ``6c + e``:

* ``e = 0`` its loop's last regular step released (the item's boundary begins);
* ``1`` the next item decoded (its Q has arrived, its counts read: loaded before the twenty-ninth session, published
  by the loader since);
* ``2`` the last step's products issued (the next item's first scores and this item's last ``P V``);
* ``3`` both complete;
* ``4`` the output rows stored (issued);
* ``5`` (at the next item's index) that item's start done: its split step's products and first softmax, so its
  loop may begin.

The loader's slots: ``12`` item decoded (its claim read; since the twenty-ninth session that happens while the
item before it runs), ``13`` its Q copy issued (after the Q buffer was freed), ``14``
its last K/V copy issued; ``15`` holds the item's regular steps times 2, plus 1 with a split step. A stamp is read
only once the scalar it follows exists (the read is predicated on it); where that scalar does not order the read
after a product's wait, the SASS does (``bench/hopper_fwd_offline.py --kernel-file`` compiles a patched copy). Per
shape, the percentiles of each segment in microseconds, the loop's step time, each boundary in steps, and how far
the loader runs ahead. The consumers' six events are stamped four at a time (``EVENT_SETS``, one instrumented copy
and run each): all six at once spill inside the step loop, the measured thing. Offline (sm_90, D=128, block 64) each
set leaves both step loops as the kernel's (806 instructions each, no spill access) and the shared memory as the
kernel's; the boundary code spills more (284-292 bytes against 100), which the boundary's segments include. Each
``SR_GLOBALTIMER`` read follows the wait it stands for in the SASS (the last products' ``WARPGROUP.DEPBAR`` before
event 3, the loop's last one before 0) and precedes the next one (event 2 comes before the wait for the next
scores)::

    python bench/hopper_fwd_timeline.py --only "block 64, T=8192;block 64, T=32768" --out $OUT/timeline.json

Prepared in the twenty-eighth session; first run on an H100 in the twenty-ninth (2026-11-27), on that session's
kernels (``bench/results/hopper_fwd_timeline_*session29*.json``; what they showed: bench/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from hopper_fwd_ab import SHAPES, forward_inputs, use  # (importing it turns the tuner off: the forced candidate runs)
from kernel_versions import patched_module

from s2_models.kernels import s2_attention

KERNEL = Path(__file__).resolve().parents[1] / "kernels" / "hopper_fwd.py"
ITEMS = 512  # items stamped per program (16 x 8192: ~248 a program)
STAMP = f'''
    @gluon.jit
    def _timeline_row(trace, iteration, WARPS: gl.constexpr):
        """This program's stamps of item ``iteration`` (the first {ITEMS}), as a one-element pointer and mask."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        row = trace + (gl.program_id(0) * {ITEMS} + iteration).to(gl.int64) * 16 + gl.arange(0, 1, layout)
        return row, gl.full([1], iteration, gl.int32, layout) < {ITEMS}

    @gluon.jit
    def _stamp(trace, iteration, slot, dep, WARPS: gl.constexpr):
        """%globaltimer once ``dep`` (an int32) exists, at slot ``slot`` of item ``iteration``."""
        row, mask = _timeline_row(trace, iteration, WARPS)
        time = gl.inline_asm_elementwise(
            "{{ .reg .pred p; setp.ne.s32 p, $1, -2147483647; @p mov.u64 $0, %globaltimer; "
            "@!p mov.u64 $0, %globaltimer; }}", "=l,r", [gl.full([1], dep, gl.int32, row.type.layout)],
            dtype=gl.int64, is_pure=False, pack=1)
        gl.store(row + slot, time, mask=mask)

'''
CONSUMER = "consumer * 6 + "
# (anchor, text[, "before"]): kernel_versions.patched_source. The trace's parameter, the loader's stamps, the launch.
BASE_PATCHES = [
    ("\n\ndef supported(", STAMP, "before"),
    ("        work_counter,  # int32 [1], zero: work items claimed after each program's first\n",
     "        trace,  # int64 [programs, ITEMS, 16]: the timeline\n"),
    ("                (_compute_partition, (0, ", "trace, "),
    ("                (_compute_partition, (1, ", "trace, "),
    ("                (stream_load_partition, (", "trace, "),
    ("    def _compute_partition(consumer: gl.constexpr, ", "trace, "),
    ("    def stream_load_partition(", "trace, "),
    # The next item's stamps (it is decoded while this one runs).
    ("             n_num_entries, n_split) = work_item(gl.where(work < num_work, work, 0), work_args, TILE, "
     "IS_VARLEN, True)\n",
     "            _stamp(trace, iteration + 1, 12, n_num_entries, 1)\n"
     "            row, mask = _timeline_row(trace, iteration + 1, 1)\n"
     "            regular_steps = gl.cdiv(n_num_entries, GROUP)\n"
     "            gl.store(row + 15, gl.full([1], regular_steps * 2 + n_split, gl.int64, row.type.layout), "
     "mask=mask)\n"),
    ("            kv_head = q_head // q_heads_per_kv\n", "            _stamp(trace, iteration, 13, qb, 1)\n", "before"),
    ("            iteration += 1\n            seq = n_seq\n", "            _stamp(trace, iteration, 14, step, 1)\n",
     "before"),
    ("    s2_attention_fwd_ws_kernel[grid](\n",
     "    global TRACE\n"
     f"    TRACE = torch.full((grid[0], {ITEMS}, 16), -1, dtype=torch.int64, device=q.device)\n", "before"),
    ("        torch.zeros(1, dtype=torch.int32, device=q.device),  # the work counter: a fresh zero for every launch\n",
     "        TRACE,\n"),
]
# The consumers' stamps, by event. All six at once spill inside the step loop (26-29 accesses a step in consumer 0 at
# D=128, block 64; offline), which would slow the loop being measured: EVENT_SETS stamp four at a time, sets checked
# offline to leave both step loops within a few instructions of the kernel's and without a spill access (thirty-first
# session: 798 / 808 against 795 / 804).
CONSUMER_STAMPS = {
    0: [("            # The next item (its Q was copied while this one ran).\n",
         f"            _stamp(trace, iteration, {CONSUMER}0, step, 4)\n", "before")],
    1: [("            has_first = n_num_entries > 0\n",
         f"            _stamp(trace, iteration, {CONSUMER}1, n_num_entries, 4)\n")],
    2: [("                s_first = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))\n",
         f"                _stamp(trace, iteration, {CONSUMER}2, first_slot, 4)\n", "before")],
    3: [("                # The next ring step's K was read by s_next only where it is a plain first step",
         f"                _stamp(trace, iteration, {CONSUMER}3, step, 4)\n", "before")],
    4: [("            iteration += 1\n            work = next_work\n            seqlen_k_seq = n_seqlen_k_seq\n",
         f"            _stamp(trace, iteration, {CONSUMER}4, step, 4)\n", "before")],
    5: [("        pending = pending * (num_entries * (work < num_work) == 0)\n",
         f"        _stamp(trace, 0, {CONSUMER}5, pending, 4)\n"),
        ("            pending = pending * (num_entries == 0)  # paid by _item_start unless the item has no steps\n",
         f"            _stamp(trace, iteration, {CONSUMER}5, pending, 4)\n")],
}
EVENT_SETS = ((0, 2, 4, 5), (0, 1, 2, 5), (0, 2, 3, 5))
# (segment, first event, last event): a consumer's events 0-5 as above, 6-11 the same events of its next item
SEGMENTS = [("loop", 5, 0), ("decode", 0, 1), ("issue", 1, 2), ("last_products", 2, 3), ("epilogue", 3, 4),
            ("start", 4, 11), ("boundary", 0, 11), ("item", 5, 11)]


def instrumented_kernel(directory: str, events=EVENT_SETS[0]):
    """A copy of the forward's module with the loader's stamps and the consumers' ``events`` (``module.TRACE`` after
    each launch)."""
    patches = BASE_PATCHES + [patch for event in events for patch in CONSUMER_STAMPS[event]]
    return patched_module(KERNEL, patches, directory, "timeline_" + "".join(map(str, events)))


def segments(trace: np.ndarray) -> dict:
    """Percentiles (10 / 50 / 90) over the items with the stamps each needs: each consumer's segments in us, its
    loop's step time and its boundary in steps; the loader's segments, and its lead (item ``n`` claimed before the
    earlier consumer's boundary into it begins)."""
    stamps = np.where(trace < 0, np.nan, trace.astype(np.float64) / 1e3)  # [programs, ITEMS, 16] us
    regular_steps = np.where(trace[:, :, 15] < 0, np.nan, trace[:, :, 15] // 2)

    def pct(x):
        x = x[np.isfinite(x)]
        return np.percentile(x, (10, 50, 90)).round(3).tolist() if x.size else None

    def next_item(x):
        return np.concatenate([x[:, 1:], np.full_like(x[:, :1], np.nan)], axis=1)

    result = {}
    for consumer in (0, 1):
        events = stamps[:, :, 6 * consumer: 6 * consumer + 6]
        events = np.concatenate([events, next_item(events)], axis=2)  # [programs, ITEMS, 12]
        spans = {name: events[:, :, last] - events[:, :, first] for name, first, last in SEGMENTS}
        step_us = spans["loop"] / np.where(regular_steps >= 3, regular_steps - 1, np.nan)  # the loop: all but the last
        result[f"consumer {consumer}"] = {**{name: pct(span) for name, span in spans.items()}, "step": pct(step_us),
                                         "boundary_in_steps": pct(spans["boundary"] / step_us)}
    boundary_begins = np.fmin(stamps[:, :, 0], stamps[:, :, 6])  # into the next item
    previous = np.concatenate([np.full_like(boundary_begins[:, :1], np.nan), boundary_begins[:, :-1]], axis=1)
    result["loader"] = {"q_issued_after_claim": pct(stamps[:, :, 13] - stamps[:, :, 12]),
                        "copies_issued_after_claim": pct(stamps[:, :, 14] - stamps[:, :, 12]),
                        "claim_ahead_of_boundary": pct(previous - stamps[:, :, 12])}
    result["items_stamped"] = int(np.isfinite(stamps[:, :, 5]).sum())
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="block 64, T=8192;block 64, T=32768", help="shape names, ';'-separated")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    with tempfile.TemporaryDirectory() as directory:
        for events in EVENT_SETS:
            module = instrumented_kernel(directory, events)
            use(module, None)
            for name, *shape in SHAPES:
                if name not in args.only.split(";"):
                    continue
                q, k, v, pattern = forward_inputs(*shape)
                for _ in range(2):  # the first call compiles and builds the lists
                    s2_attention(q, k, v, pattern, backend="triton")
                torch.cuda.synchronize()
                row = segments(module.TRACE.cpu().numpy())
                results["shapes"].setdefault(name, {})[f"events {events}"] = row
                print(name, events, json.dumps(row), flush=True)
                with open(args.out, "w") as f:  # after each run: a call cut by its time limit keeps what it measured
                    json.dump(results, f, indent=1)

if __name__ == "__main__":
    main()
