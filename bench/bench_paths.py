"""The paths beside plain causal attention, timed: packed sequences (varlen), a padding mask, queries after a prefix
(Tq < Tk) and bidirectional attention, with plain causal attention as the control. Issue 9 asks that none of them get
slower while the causal kernels get faster: each runs on the current kernels, on the kernels from before issue 9's
changes (another commit's ``kernels/`` folder, loaded as a package of its own) and on FlexAttention with the identical
mask (128-token blocks), in one process, the implementations alternated in rounds; medians. GPU only::

    git archive d079a15 kernels | tar -x -C /tmp/before     # the kernels before issue 9's first change (ff61a0c)
    python bench/bench_paths.py --before /tmp/before/kernels --rounds 3

Writes ``bench/results/<gpu>-<date>-paths.json`` (and a copy under ``$OUT``) after each case, then a markdown table.
Every case's outputs are also compared between the implementations (largest absolute difference to the current
kernels' output, in the JSON), so that the rows time the same work.

Cases (H=32, D=128, bf16, the headline pattern: block 64, local_blocks 16, vert_stride 16; ~131072 tokens each):

* causal: 16 x 8192, the control;
* packed: one row of 131072 tokens in sequences of 512-16384 tokens (``cu_seqlens``), the pattern restarting in each;
* padding: 16 x 8192 rows, left-padded by 0-28% (``attention_mask``), each row's pattern anchored at its first token;
  once with ``[B, H, T, D]``-contiguous inputs (packing the real tokens copies them whole first) and once heads-last
  (``[B, T, H, D]`` memory, as the model's projections give: packing is one gather);
* Tq < Tk: 4 rows, the last 4096 queries over 32768 keys (chunked prefill), bottom-right aligned;
* bidirectional: 16 x 8192, ``causal=False``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from s2_models.kernels import S2Pattern, s2_attention

PATTERN_FIELDS = dict(block_size=64, local_blocks=16, vert_stride=16)  # also given to the earlier kernels' S2Pattern
PATTERN = S2Pattern(**PATTERN_FIELDS)
HEADS, HEAD_DIM = 32, 128


@dataclass(frozen=True)
class PathCase:
    """One path's shape: ``batch`` rows of ``q_len`` queries over ``kv_len`` keys (packed: one row, ``seq_lens``)."""

    name: str
    batch: int
    q_len: int
    kv_len: int
    causal: bool = True
    seq_lens: tuple[int, ...] | None = None  # packed sequences (batch 1, q_len == kv_len == their sum)
    left_padding: tuple[int, ...] | None = None  # padding tokens at the start of each row
    heads_last: bool = False  # q, k, v as [B, T, H, D] memory seen as [B, H, T, D], as the model's projections give


def path_cases(tokens: int = 131072, seqlen: int = 8192) -> list[PathCase]:
    """The cases at ``tokens`` tokens each (rows of ``seqlen``; the prefix case has rows of 4 x ``seqlen``)."""
    batch = tokens // seqlen
    generator = torch.Generator().manual_seed(0)
    seq_lens, total = [], 0
    while total < tokens:
        length = int(torch.randint(seqlen // 16, 2 * seqlen + 1, (1,), generator=generator))
        seq_lens.append(min(length, tokens - total))
        total += seq_lens[-1]
    padding = tuple(b * (seqlen * 3 // 10) // batch for b in range(batch))
    long_rows = max(1, tokens // (4 * seqlen))
    return [
        PathCase(f"causal, {batch} x {seqlen}", batch, seqlen, seqlen),
        PathCase(f"packed, {len(seq_lens)} sequences in {tokens}", 1, tokens, tokens, seq_lens=tuple(seq_lens)),
        PathCase(f"padding, {batch} x {seqlen}, left 0-{max(padding) * 100 // seqlen}%", batch, seqlen, seqlen,
                 left_padding=padding),
        PathCase(f"padding, heads-last, {batch} x {seqlen}, left 0-{max(padding) * 100 // seqlen}%", batch, seqlen,
                 seqlen, left_padding=padding, heads_last=True),
        PathCase(f"Tq < Tk, {long_rows} x {seqlen // 2} of {4 * seqlen}", long_rows, seqlen // 2, 4 * seqlen),
        PathCase(f"bidirectional, {batch} x {seqlen}", batch, seqlen, seqlen, causal=False),
    ]


def case_inputs(case: PathCase, heads: int, head_dim: int, device, dtype, generator: torch.Generator):
    """``q [B, H, Tq, D]``, ``k``, ``v [B, H, Tk, D]`` and the keyword arguments of ``s2_attention`` for ``case``."""

    def normal(length):
        if case.heads_last:
            x = torch.randn(case.batch, length, heads, head_dim, generator=generator).transpose(1, 2)
        else:
            x = torch.randn(case.batch, heads, length, head_dim, generator=generator)
        return x.to(device=device, dtype=dtype)

    q, k, v = normal(case.q_len), normal(case.kv_len), normal(case.kv_len)
    kwargs: dict = {"causal": case.causal}
    if case.seq_lens is not None:
        cu = torch.tensor([0, *torch.tensor(case.seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(case.seq_lens),
                      max_seqlen_k=max(case.seq_lens))
    if case.left_padding is not None:
        positions = torch.arange(case.kv_len, device=device)
        kwargs["attention_mask"] = positions >= torch.tensor(case.left_padding, device=device)[:, None]
    return q, k, v, kwargs


def flex_mask_mod(case: PathCase, pattern: S2Pattern, heads: int, device):
    """FlexAttention's ``mask_mod`` for ``case``: the S2 pattern at each token's position in its own sequence.
    ``heads``: the pattern's heads, one per query head (the cases have as many KV heads as query heads)."""
    block = pattern.block_size
    longest = max(case.seq_lens) if case.seq_lens is not None else case.kv_len
    num_blocks = -(-longest // block)
    kept = pattern.block_mask(heads, num_blocks, num_blocks, causal=case.causal, device=device)
    offset = case.kv_len - case.q_len  # bottom-right aligned queries

    def visible(h, q_pos, k_pos):
        seen = kept[h, q_pos // block, k_pos // block]
        return seen & (k_pos <= q_pos) if case.causal else seen

    if case.seq_lens is not None:
        lengths = torch.tensor(case.seq_lens, device=device)
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        starts = lengths.cumsum(0) - lengths

        def mask_mod(b, h, q_idx, kv_idx):
            same = sequence[q_idx] == sequence[kv_idx]
            return same & visible(h, q_idx - starts[sequence[q_idx]], kv_idx - starts[sequence[kv_idx]])

    elif case.left_padding is not None:
        padding = torch.tensor(case.left_padding, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            pad = padding[b]
            real = (q_idx + offset >= pad) & (kv_idx >= pad)
            return real & visible(h, (q_idx + offset - pad).clamp(min=0), (kv_idx - pad).clamp(min=0))

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return visible(h, q_idx + offset, kv_idx)

    return mask_mod


def flex_attention_for(case: PathCase, pattern: S2Pattern, heads: int, flex_block: int = 128):
    """FlexAttention (compiled) with ``case``'s mask at ``flex_block``-token blocks, as ``attention(q, k, v)``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(flex_mask_mod(case, pattern, heads, "cuda"), case.batch, heads, case.q_len,
                                   case.kv_len, device="cuda", BLOCK_SIZE=flex_block, _compile=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def s2_attention_with(op, case_kwargs: dict, pattern: S2Pattern):
    """``op`` (an ``s2_attention``, this package's or an earlier commit's) as ``attention(q, k, v)``."""
    return lambda q, k, v: op(q, k, v, pattern, backend="triton", **case_kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=None, help="an earlier commit's kernels/ folder, timed beside these")
    parser.add_argument("--no-flex", dest="flex", action="store_false", help="leave FlexAttention out")
    parser.add_argument("--rounds", type=int, default=3, help="each case's implementations timed in turn this often")
    parser.add_argument("--only", default=None, help="cases whose name contains one of these (';'-separated)")
    parser.add_argument("--budget-ms", type=float, default=300, help="timing budget per measurement")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_s2_attention import make_runner, median_ms, shape_selected
    from kernel_versions import load_package

    implementations = [("s2-triton", lambda case, kwargs: s2_attention_with(s2_attention, kwargs, PATTERN))]
    if args.before:
        before = load_package(args.before, "s2_kernels_before")
        before_pattern = before.S2Pattern(**PATTERN_FIELDS)
        implementations.append(
            ("s2-before", lambda case, kwargs: s2_attention_with(before.s2_attention, kwargs, before_pattern)))
    if args.flex:
        implementations.append(("flex-128", lambda case, kwargs: flex_attention_for(case, PATTERN, HEADS)))

    gpu = torch.cuda.get_device_name()
    path = Path(__file__).resolve().parent / "results" / f"{gpu.replace(' ', '-')}-{datetime.date.today()}-paths.json"
    rows: list[dict] = []

    def save():
        record = dict(meta=dict(gpu=gpu, torch=torch.__version__, argv=sys.argv[1:], pattern=PATTERN_FIELDS,
                                heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16"), rows=rows)
        path.write_text(json.dumps(record, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], path.name).write_text(path.read_text())

    for case in path_cases():
        if not shape_selected(case.name, args.only):
            continue
        q, k, v, kwargs = case_inputs(case, HEADS, HEAD_DIM, "cuda", torch.bfloat16, torch.Generator().manual_seed(1))
        attentions, reference, out = {}, None, None
        for impl, factory in implementations:
            try:
                attentions[impl] = factory(case, kwargs)
                out = attentions[impl](q, k, v)
                reference = out if reference is None else reference
                difference = (out.float() - reference.float()).abs().max().item()
                rows.append(dict(case=case.name, impl=impl, max_abs_difference_to_s2=difference))
            except Exception as error:  # e.g. a path the earlier kernels refused: recorded, the rest goes on
                attentions.pop(impl, None)
                rows.append(dict(case=case.name, impl=impl, error=f"{type(error).__name__}: {error}"[:300]))
            print(json.dumps(rows[-1]), flush=True)
        for round_ in range(args.rounds):
            for impl, attention in attentions.items():
                for mode in ("fwd", "fwd+bwd"):
                    row = dict(case=case.name, impl=impl, mode=mode, round=round_)
                    try:
                        row["ms"] = round(median_ms(make_runner(attention, q, k, v, mode), args.budget_ms), 3)
                    except Exception as error:  # e.g. out of memory: recorded, the rest goes on
                        row["error"] = f"{type(error).__name__}: {error}"[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del q, k, v, attentions, reference, out
        torch.cuda.empty_cache()
        save()
    print(f"\nwrote {path}\n")
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """Medians over the rounds: ms of each implementation, and before / current (> 1: the current kernels faster)."""
    times: dict = {}
    for r in rows:
        if "ms" in r:
            times.setdefault((r["case"], r["impl"], r["mode"]), []).append(r["ms"])
    median = {key: statistics.median(ms) for key, ms in times.items()}
    cases = list(dict.fromkeys(case for case, _, _ in median))
    print("| case | s2 fwd / fwd+bwd ms | before fwd / fwd+bwd ms | before / s2 fwd, fwd+bwd "
          "| Flex-128 fwd / fwd+bwd ms | Flex / s2 fwd, fwd+bwd |")
    print("|---|---|---|---|---|---|")

    def cell(case, impl):
        return " / ".join(f"{median[(case, impl, m)]:.2f}" if (case, impl, m) in median else "-"
                          for m in ("fwd", "fwd+bwd"))

    def ratio(case, impl):
        return ", ".join(f"{median[(case, impl, m)] / median[(case, 's2-triton', m)]:.2f}x"
                         if (case, impl, m) in median and (case, "s2-triton", m) in median else "-"
                         for m in ("fwd", "fwd+bwd"))

    for case in cases:
        print(f"| {case} | {cell(case, 's2-triton')} | {cell(case, 's2-before')} | {ratio(case, 's2-before')} "
              f"| {cell(case, 'flex-128')} | {ratio(case, 'flex-128')} |")


if __name__ == "__main__":
    main()
