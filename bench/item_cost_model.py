"""What work items cost the forward kernels: a per-item and a per-step cost fitted to dense work, used to predict the
sparse rows (runs on the CPU, from a comparison's JSON).

Why: the Gluon forward and cuDNN's both run one persistent program per SM over work items of 128 query rows, each a
list of 128-key steps. On dense causal work the forward keeps cuDNN's pace at long sequences, but at 16 x 8192 the
block-64 pattern's items are ~9 steps long, against ~32 on average for dense causal attention at that T, so what an
item costs beyond its steps weighs three times as much. ``bench_s2_attention.py --compare dkernel --only "dense
work"`` times both kernels on identical dense work at T = 1024 ... 32768 with the same tokens, so that the items get
shorter as T does (T / 256 steps on average). Fitting ``ms = (items x per_item + steps x per_step) / SMs`` to those
rows separates the two costs for each kernel; the package's own lists (``triton_impl._unit_lists``, split steps
counted as half a step) then give each sparse row's items and steps, and so the time a kernel with either cost
structure would take there, and its per-FLOP efficiency against cuDNN's dense causal kernel (``bench/NOTES.md``,
thirty-third session)::

    python bench/item_cost_model.py \
        bench/results/NVIDIA-H100-80GB-HBM3-2026-11-27-compare-dkernel-session33-dense-work.json
"""

import argparse
import json
import statistics

from bench_s2_attention import COMPARE_SHAPES, compare_pattern, density

from s2_models.kernels import triton_impl
from s2_models.kernels.layouts import BlockLayout

TILE = 128  # query rows per work item and keys per step of the Gluon forward at D = 128


def dense_counts(batch: int, heads: int, seqlen: int) -> tuple[int, int]:
    """Work items and 128-key steps of dense causal attention: query tile ``m`` reads ``m + 1`` steps."""
    tiles = -(-seqlen // TILE)
    return batch * heads * tiles, batch * heads * tiles * (tiles + 1) // 2


def sparse_counts(fields: dict, batch: int, seqlen: int, heads: int, kv_heads: int) -> tuple[int, float]:
    """Work items and steps of a comparison row's pattern, from the lists the Gluon forward reads: a split step (each
    consumer computes half of it) counts as half a step."""
    pattern = compare_pattern(fields, heads)
    pattern_heads = pattern.num_pattern_heads(heads, kv_heads)
    blocks = -(-seqlen // pattern.block_size)
    layout = BlockLayout(pattern.block_mask(pattern_heads, blocks, blocks), pattern.block_size, True, None)
    _, _, counts = triton_impl._unit_lists(layout, TILE, TILE, resident_is_query=True, split_first=True)
    group = TILE // min(pattern.block_size, TILE)
    regular = (counts[..., 1].long() + group - 1) // group
    steps = (regular.sum().item() + 0.5 * counts[..., 2].sum().item()) * batch * heads // pattern_heads
    return batch * heads * counts.shape[1], steps


def fit(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Least squares of ``ms = items x a + steps x b`` (no intercept) over ``(items, steps, ms)``: ``(a, b)`` in ms."""
    sxx = sum(i * i for i, _, _ in points)
    sxy = sum(i * s for i, s, _ in points)
    syy = sum(s * s for _, s, _ in points)
    sxt = sum(i * t for i, _, t in points)
    syt = sum(s * t for _, s, t in points)
    det = sxx * syy - sxy * sxy
    return (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det


def dense_fits(rows: list[dict], mode: str = "fwd") -> dict:
    """Per implementation, ``(per_item, per_step)`` in ms fitted to the dense-work rows (medians over rounds)."""
    times: dict = {}
    for r in rows:
        if r.get("mode") == mode and "ms" in r and r["section"].startswith("dense work"):
            times.setdefault((r["impl"], r["batch"], r["heads"], r["seqlen"]), []).append(r["ms"])
    points: dict = {}
    for (impl, batch, heads, seqlen), ms in times.items():
        points.setdefault(impl, []).append((*dense_counts(batch, heads, seqlen), statistics.median(ms)))
    return {impl: fit(p) for impl, p in points.items() if len(p) >= 2}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("comparison", help="a bench_s2_attention.py --compare JSON with the dense-work rows")
    parser.add_argument("--sms", type=int, default=132, help="programs in flight (one per SM; H100 SXM: 132)")
    args = parser.parse_args()
    with open(args.comparison) as f:
        fits = dense_fits(json.load(f)["rows"])
    if "sdpa-cudnn" not in fits:
        raise SystemExit("the comparison has no cuDNN dense-work rows to fit")
    print("| kernel | per work item (us) | per 128 x 128 step (us) |\n|---|---|---|")
    for impl, (per_item, per_step) in fits.items():
        print(f"| {impl} | {per_item * args.sms * 1e3:.2f} | {per_step * args.sms * 1e3:.3f} |")
    cudnn = fits["sdpa-cudnn"]
    print("\n| shape | items | steps an item | " + " | ".join(f"{impl}-like: ms, efficiency" for impl in fits) + " |")
    print("|---|---|---|" + "---|" * len(fits))
    for name, fields, batch, seqlen, heads, kv_heads, head_dim in COMPARE_SHAPES:
        if head_dim != TILE or fields["block_size"] < 32:
            continue  # the dense-work rows are at D = 128; blocks of 16 run the Triton forward, whose items differ
        items, steps = sparse_counts(fields, batch, seqlen, heads, kv_heads)
        dense_items, dense_steps = dense_counts(batch, heads, seqlen)
        cudnn_dense = dense_items * cudnn[0] + dense_steps * cudnn[1]
        kept = density(compare_pattern(fields, heads), heads, kv_heads, seqlen)
        cells = []
        for per_item, per_step in fits.values():
            ms = items * per_item + steps * per_step
            cells.append(f"{ms:.2f}, {cudnn_dense * kept / ms:.2f}")
        print(f"| {name} | {items} | {steps / items:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
