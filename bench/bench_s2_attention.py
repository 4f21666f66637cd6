"""Benchmark the Triton S2-Attention kernels against dense SDPA (FlashAttention-2, cuDNN) and FlexAttention.

GPU only. Writes ``bench/results/<gpu>-<date>.json`` and prints a markdown table::

    python bench/bench_s2_attention.py            # everything (~20 min on an H100)
    python bench/bench_s2_attention.py --quick    # headline at T=131072 + short sweeps (< 8 min)
    python bench/bench_s2_attention.py --compare dkernel   # the issue-9 shapes against dkernel and cuDNN (~4 min)
    python bench/bench_s2_attention.py --compare dkernel --rounds 3 --only "D=64"   # alternated 3 times, medians

dkernel (the S2 authors' Triton library: the ``dkernel`` package, linxihui/dkernel, installed from its source) is a
baseline whenever it is importable; it gets the identical pattern (``head_sliding_offset=0``) and, for GQA, K/V
repeated to the query heads inside the timed call (it has no native GQA).

Headline: H=32, D=128, bf16, causal, B x T = 131072 tokens; pattern block 64, local_blocks 16, vert_stride 16,
heterogeneous heads; forward and forward+backward. Throughput columns:

* dense TFLOP/s: the FLOPs of dense causal attention (``flops``) over the time: comparable across methods;
* effective TFLOP/s: the FLOPs of the blocks the sparse kernel computes (kept blocks, whole) over the time;
* density: the kept fraction of the causal token pairs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

from s2_models.kernels import S2Pattern, s2_attention, triton_impl

TOKENS = 131072
HEADLINE = dict(heads=32, head_dim=128, block_size=64, local_blocks=16, vert_stride=16)


def flops(batch: int, heads: int, seqlen: int, head_dim: int, mode: str) -> float:
    """Dense causal attention FLOPs: ``4 * B * H * T^2 * D / 2`` forward, x2.5 for forward+backward."""
    forward = 4 * batch * heads * seqlen * seqlen * head_dim / 2
    return forward if mode == "fwd" else 2.5 * forward


def computed_flops(pattern: S2Pattern, batch: int, heads: int, kv_heads: int, seqlen: int, head_dim: int, mode: str):
    """FLOPs of the kept blocks, each counted whole (what a block-sparse kernel computes), over all query heads."""
    pattern_heads = pattern.num_pattern_heads(heads, kv_heads)
    num_blocks = triton.cdiv(seqlen, pattern.block_size)
    kept_blocks = pattern.block_mask(pattern_heads, num_blocks, num_blocks).sum().item() * (heads // pattern_heads)
    forward = 4 * batch * kept_blocks * pattern.block_size**2 * head_dim
    return forward if mode == "fwd" else 2.5 * forward


def density(pattern: S2Pattern, heads: int, kv_heads: int, seqlen: int) -> float:
    """Kept fraction of the causal token pairs, from the block mask (``kept_fraction`` would build T x T masks)."""
    pattern_heads = pattern.num_pattern_heads(heads, kv_heads)
    num_blocks = triton.cdiv(seqlen, pattern.block_size)
    kept = pattern.block_mask(pattern_heads, num_blocks, num_blocks)
    block = pattern.block_size
    diagonal = kept.diagonal(dim1=1, dim2=2).sum().item()
    pairs = (kept.sum().item() - diagonal) * block * block + diagonal * block * (block + 1) // 2
    return pairs / (pattern_heads * seqlen * (seqlen + 1) / 2)


def median_ms(fn, budget_ms: float) -> float:
    """Median of many runs (``do_bench``), with fewer repetitions for slow calls so every case fits the budget."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - start) * 1e3
    rep = max(3 * once_ms, min(budget_ms, 40 * once_ms))
    return triton.testing.do_bench(fn, warmup=max(once_ms, 10), rep=rep, return_mode="median")


def make_runner(attention, q, k, v, mode: str):
    """A zero-argument callable running ``attention(q, k, v)`` forward, or forward+backward (fresh grads)."""
    if mode == "fwd":
        return lambda: attention(q, k, v)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn_like(q)

    def forward_backward():
        out = attention(*leaves)
        torch.autograd.grad(out, leaves, grad_out)

    return forward_backward


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=k.shape[1] != q.shape[1])

    return attention


def flex(pattern: S2Pattern, heads: int, kv_heads: int, seqlen: int, flex_block: int):
    """FlexAttention with the identical mask (S2 block mask + token causal) through a mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pattern_heads = pattern.num_pattern_heads(heads, kv_heads)
    num_blocks = triton.cdiv(seqlen, pattern.block_size)
    kept = pattern.block_mask(pattern_heads, num_blocks, num_blocks, device="cuda")
    heads_per_pattern, block_size = heads // pattern_heads, pattern.block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return kept[h // heads_per_pattern, q_idx // block_size, kv_idx // block_size] & (kv_idx <= q_idx)

    block_mask = create_block_mask(mask_mod, None, heads, seqlen, seqlen, device="cuda", BLOCK_SIZE=flex_block,
                                   _compile=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    # Flex's default kernel tiles (128 rows) must divide its mask blocks: smaller mask blocks need smaller tiles.
    tiles = None if flex_block >= 128 else {
        "BLOCK_M": flex_block, "BLOCK_N": flex_block,  # forward
        "BLOCK_M1": flex_block // 2, "BLOCK_N1": flex_block, "BLOCK_M2": flex_block, "BLOCK_N2": flex_block // 2,
    }
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=kv_heads != heads,
                                    kernel_options=tiles)


def dkernel(pattern: S2Pattern, heads: int, kv_heads: int, seqlen: int):
    """dkernel's ``LocalStrideSparseAttention`` with the same pattern; K/V repeated for GQA inside the call."""
    from dkernel import LocalStrideSparseAttention

    pattern_heads = pattern.num_pattern_heads(heads, kv_heads)
    if (pattern.head_sliding_offset != 0 or pattern.num_dense_heads or pattern.per_query_head
            or pattern.head_step(pattern_heads) != dkernel_head_step(pattern, heads)):
        raise ValueError("dkernel's local-stride pattern differs: needs head_sliding_offset=0, no dense heads, KV-head "
                         "patterns and head_sliding_step=dkernel_head_step(pattern, heads)")
    attn = LocalStrideSparseAttention(
        heads, seqlen, pattern.block_size, pattern.local_blocks, pattern.vert_stride, homo_head=pattern.homo_head,
        num_kv_heads=kv_heads if kv_heads != heads else None, head_sliding_offset=0, seq_dim=2,
    ).cuda()

    def attention(q, k, v):
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return attn(q, k, v)

    return attention


def dkernel_head_step(pattern: S2Pattern, heads: int) -> int:
    """dkernel's stripe shift per head: counted from the *query* head count even with GQA (ours counts pattern
    heads), so comparisons set ``head_sliding_step`` to this."""
    return 0 if pattern.homo_head else max(1, pattern.vert_stride // heads)


def dkernel_available() -> bool:
    try:
        import dkernel  # noqa: F401
    except ImportError:
        return False
    return True


# Issue 9's shapes (H=32, D=128 unless given): name, pattern fields, batch, seqlen, heads, kv_heads, head_dim.
COMPARE_SHAPES = [
    ("block 64, T=131072", dict(block_size=64, local_blocks=16), 1, 131072, 32, 32, 128),
    ("block 64, T=32768", dict(block_size=64, local_blocks=16), 4, 32768, 32, 32, 128),
    ("block 64, T=8192", dict(block_size=64, local_blocks=16), 16, 8192, 32, 32, 128),
    ("block 16, T=16384", dict(block_size=16, local_blocks=64), 8, 16384, 32, 32, 128),
    ("block 32, T=16384", dict(block_size=32, local_blocks=32), 8, 16384, 32, 32, 128),
    ("block 128, T=16384", dict(block_size=128, local_blocks=8), 8, 16384, 32, 32, 128),
    ("D=64, block 64, T=32768", dict(block_size=64, local_blocks=16), 4, 32768, 32, 32, 64),
    ("GQA 32/8, block 64, T=32768", dict(block_size=64, local_blocks=16), 4, 32768, 32, 8, 128),
    ("GQA 32/8, D=64, T=16384", dict(block_size=64, local_blocks=16), 8, 16384, 32, 8, 64),
]


# The same kernels doing dense causal work (a local window as long as the sequence keeps every causal block): their
# efficiency against cuDNN on identical work separates the dense-tile speed from what sparsity costs. The same tokens
# at shorter T give shorter work items (a 128-row query tile reads T / 256 key steps of 128 on average), as a sparse
# pattern does: at T=2048 about as many as the block-64 pattern's at T=8192, so these rows show what short items cost
# the dense kernels themselves.
DENSE_WORK_SHAPES = [("dense work, T=1024", 128, 1024), ("dense work, T=2048", 64, 2048),
                     ("dense work, T=4096", 32, 4096), ("dense work, T=8192", 16, 8192),
                     ("dense work, T=32768", 4, 32768)]


def compare_pattern(fields: dict, heads: int) -> S2Pattern:
    """A COMPARE_SHAPES row's pattern, as dkernel builds it (``head_sliding_offset=0``)."""
    return S2Pattern(vert_stride=16, head_sliding_offset=0, head_sliding_step=max(1, 16 // heads), **fields)


def shape_selected(name: str, only: str | None) -> bool:
    """Whether ``--only`` picks the shape ``name``: one of its ``;``-separated parts is in the name or, written
    ``=name``, is the name (``block 64, T=32768`` is also a part of the D=64 and GQA rows' names)."""
    if not only:
        return True
    return any(name == part[1:] if part.startswith("=") else part in name for part in only.split(";"))


def compare(rows: list, baselines: list, budget: float, only: str | None, save, rounds: int = 1) -> None:
    """Issue 9's table: s2 vs dkernel vs cuDNN dense causal (and FlexAttention with the identical mask, BLOCK_SIZE
    128, on every row), with ratios and per-FLOP efficiency vs cuDNN; then the dense-work rows. Each shape's
    implementations are measured in turn ``rounds`` times (rows carry their round; the table takes medians), so that
    a drift of the GPU's clocks during a shape weighs on all of them alike. ``save()`` after each shape: a run cut
    short keeps what it measured."""
    from torch.nn.attention import SDPBackend

    modes = ("fwd", "fwd+bwd")
    cases = []  # (shape name, [(impl, attention factory)], pattern, batch, heads, kv_heads, seqlen, head_dim)
    for name, fields, batch, seqlen, heads, kv_heads, head_dim in COMPARE_SHAPES:
        pattern = compare_pattern(fields, heads)
        impls = [("s2-triton", lambda p=pattern: s2(p))]
        if "dkernel" in baselines:
            impls.append(("dkernel", lambda p=pattern, h=heads, g=kv_heads, t=seqlen: dkernel(p, h, g, t)))
        if "cudnn" in baselines:
            impls.append(("sdpa-cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)))
        if "flex" in baselines:  # 128-token blocks at every pattern block size; the mask_mod keeps it exact
            impls.append(("flex-128", lambda p=pattern, h=heads, g=kv_heads, t=seqlen: flex(p, h, g, t, 128)))
        cases.append((name, impls, pattern, batch, heads, kv_heads, seqlen, head_dim))
    for name, batch, seqlen in DENSE_WORK_SHAPES:
        pattern = S2Pattern(block_size=64, local_blocks=seqlen // 64, vert_stride=16)
        impls = [("s2-triton", lambda p=pattern: s2(p))]
        if "cudnn" in baselines:
            impls.append(("sdpa-cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)))
        if "flash" in baselines:
            impls.append(("sdpa-flash2", lambda: sdpa(SDPBackend.FLASH_ATTENTION)))
        cases.append((name, impls, pattern, batch, 32, 32, seqlen, 128))
    for name, impls, pattern, *shape in cases:
        if not shape_selected(name, only):
            continue
        for round_ in range(rounds):
            for impl, factory in impls:
                run_case(rows, name, impl, factory, pattern, *shape, modes, budget, round_=round_)
        save()


def print_comparison(rows: list) -> None:
    """ms per (shape, impl, mode), the median over rounds; ratio = dkernel ms / s2 ms (> 1: s2 faster); efficiency =
    cuDNN ms x density / impl ms (the issue's per-FLOP efficiency against cuDNN's dense causal kernel); FlashAttention-2
    (SDPA's flash backend) where it ran (the dense-work rows)."""
    times: dict = {}
    by_round = {(r["section"], r["impl"], r["mode"], r["round"]): r["ms"] for r in rows if "ms" in r}
    for r in rows:
        if "ms" in r:
            times.setdefault((r["section"], r["impl"], r["mode"]), ([], r["density"]))[0].append(r["ms"])
    table: dict = {}
    for (section, impl, mode), (ms, kept) in times.items():
        table.setdefault(section, {})[(impl, mode)] = (statistics.median(ms), kept)

    def ratio_cell(section, mode):
        """dkernel / s2 of the medians, and the range of the rounds' own ratios when there were several."""
        per_round = [by_round[(section, "dkernel", mode, n)] / ms for (sec, impl, m, n), ms in by_round.items()
                     if (sec, impl, m) == (section, "s2-triton", mode) and (section, "dkernel", mode, n) in by_round]
        if not per_round:
            return "-"
        median = table[section][("dkernel", mode)][0] / table[section][("s2-triton", mode)][0]
        spread = f" ({min(per_round):.3f}-{max(per_round):.3f})" if len(per_round) > 1 else ""
        return f"{median:.3f}{spread}"
    print("| shape | s2 fwd / fwd+bwd ms | dkernel fwd / fwd+bwd ms | dkernel / s2 fwd, fwd+bwd "
          "| cuDNN fwd / fwd+bwd ms | eff. vs cuDNN s2 fwd, fwd+bwd | eff. vs cuDNN dkernel fwd, fwd+bwd "
          "| Flex-128 fwd / fwd+bwd ms | FA2 fwd / fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(section, impl):
        vals = [table[section].get((impl, m)) for m in ("fwd", "fwd+bwd")]
        return vals, " / ".join(f"{v[0]:.2f}" if v else "-" for v in vals)

    for section in table:
        s2_vals, s2_cell = cell(section, "s2-triton")
        dk_vals, dk_cell = cell(section, "dkernel")
        cu_vals, cu_cell = cell(section, "sdpa-cudnn")
        ratio = ", ".join(ratio_cell(section, mode) for mode in ("fwd", "fwd+bwd"))
        eff = [", ".join(f"{c[0] * c[1] / x[0]:.2f}" if c and x else "-" for c, x in zip(cu_vals, vals))
               for vals in (s2_vals, dk_vals)]
        print(f"| {section} | {s2_cell} | {dk_cell} | {ratio} | {cu_cell} | {eff[0]} | {eff[1]} "
              f"| {cell(section, 'flex-128')[1]} | {cell(section, 'sdpa-flash2')[1]} |")


def s2(pattern: S2Pattern):
    return lambda q, k, v: s2_attention(q, k, v, pattern, backend="triton")


def run_case(rows, section, impl, attention_factory, pattern, batch, heads, kv_heads, seqlen, head_dim, modes, budget,
             round_: int = 0):
    dtype = torch.bfloat16
    q = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, seqlen, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, seqlen, head_dim, device="cuda", dtype=dtype)
    kept = density(pattern, heads, kv_heads, seqlen)
    try:
        attention = attention_factory()
    except Exception as error:  # a baseline unavailable on this GPU/torch: record, keep going
        attention, setup_error = None, f"{type(error).__name__}: {error}"[:300]
    for mode in modes:
        row = dict(section=section, impl=impl, batch=batch, seqlen=seqlen, heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, block_size=pattern.block_size, mode=mode, density=round(kept, 4), round=round_)
        try:
            if attention is None:
                raise RuntimeError(setup_error)
            ms = median_ms(make_runner(attention, q, k, v, mode), budget)
            dense = flops(batch, heads, seqlen, head_dim, mode)
            effective = computed_flops(pattern, batch, heads, kv_heads, seqlen, head_dim, mode)
            row.update(ms=round(ms, 3), dense_tflops=round(dense / ms / 1e9, 1))
            if impl.startswith(("s2", "flex", "dkernel")):
                row["effective_tflops"] = round(effective / ms / 1e9, 1)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    del q, k, v
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="headline at T=131072 and short sweeps (< 8 min)")
    parser.add_argument("--sections", default="headline,blocks,headdim,gqa")
    parser.add_argument("--seqlens", default=None, help="comma-separated headline T (default 8192,32768,131072)")
    parser.add_argument("--baselines", default="flash,cudnn,flex")
    parser.add_argument("--flex-blocks", default=None, help="FlexAttention BLOCK_SIZEs, best is kept (128,64)")
    parser.add_argument("--sweep-seqlen", type=int, default=None, help="T of the sweeps (default 32768)")
    parser.add_argument("--budget-ms", type=float, default=None, help="timing budget per measurement")
    parser.add_argument("--compare", choices=["dkernel"], default=None,
                        help="only issue 9's shapes: s2 vs dkernel vs cuDNN, with ratios")
    parser.add_argument("--only", default=None,
                        help="with --compare: shapes whose name contains one of these (separated by ';'), or is one "
                             "written '=name'")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --compare: measure each shape's implementations in turn this many times")
    args = parser.parse_args()
    seqlens = [int(t) for t in (args.seqlens or ("131072" if args.quick else "8192,32768,131072")).split(",")]
    flex_blocks = [int(b) for b in (args.flex_blocks or ("128" if args.quick else "128,64")).split(",")]
    sweep_seqlen = args.sweep_seqlen or (16384 if args.quick else 32768)
    budget = args.budget_ms or (400 if args.quick else 1500)
    sections, baselines = args.sections.split(","), args.baselines.split(",")
    modes = ("fwd", "fwd+bwd")
    rows: list[dict] = []
    from torch.nn.attention import SDPBackend

    gpu = torch.cuda.get_device_name().replace(" ", "-")
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = f"-compare-{args.compare}" if args.compare else ""
    path = out_dir / f"{gpu}-{datetime.date.today().isoformat()}{suffix}.json"

    def save():
        tuned = {" ".join(map(str, key)): {str(c): round(ms, 3) for c, ms in timings.items()}
                 for key, timings in triton_impl.TUNING_TIMINGS.items()}
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    argv=sys.argv[1:], tuning=tuned)
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], path.name).write_text(path.read_text())

    if dkernel_available():
        baselines.append("dkernel")
    if args.compare:
        sections = []
        compare(rows, baselines, args.budget_ms or 300, args.only, save, args.rounds)

    if "headline" in sections:
        pattern = S2Pattern(block_size=HEADLINE["block_size"], local_blocks=HEADLINE["local_blocks"],
                            vert_stride=HEADLINE["vert_stride"])
        heads, head_dim = HEADLINE["heads"], HEADLINE["head_dim"]
        for seqlen in seqlens:
            batch = max(1, TOKENS // seqlen)
            shape = (pattern, batch, heads, heads, seqlen, head_dim, modes, budget)
            run_case(rows, "headline", "s2-triton", lambda p=pattern: s2(p), *shape)
            if "flash" in baselines:
                run_case(rows, "headline", "sdpa-flash2", lambda: sdpa(SDPBackend.FLASH_ATTENTION), *shape)
            if "cudnn" in baselines:
                run_case(rows, "headline", "sdpa-cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION), *shape)
            if "dkernel" in baselines and pattern.head_sliding_offset == 0:
                run_case(rows, "headline", "dkernel", lambda t=seqlen: dkernel(pattern, heads, heads, t), *shape)
            if "flex" in baselines:
                for flex_block in flex_blocks:
                    run_case(rows, "headline", f"flex-{flex_block}",
                             lambda fb=flex_block, t=seqlen: flex(pattern, heads, heads, t, fb), *shape)

    sweeps = []
    if "blocks" in sections:  # Merge-Q / gather: small blocks should keep >= 0.7x the throughput of block 64
        for block_size in (16, 32, 64, 128):
            local = HEADLINE["local_blocks"] * 64 // block_size  # same window in tokens
            sweeps.append(("blocks", S2Pattern(block_size=block_size, local_blocks=local, vert_stride=16), 32, 32, 128))
    if "headdim" in sections:
        for head_dim in (64, 128, 256):
            sweeps.append(("headdim", S2Pattern(block_size=64, local_blocks=16, vert_stride=16), 32, 32, head_dim))
    if "gqa" in sections:
        sweeps.append(("gqa", S2Pattern(block_size=64, local_blocks=16, vert_stride=16), 32, 8, 128))
    for section, pattern, heads, kv_heads, head_dim in sweeps:
        batch = max(1, TOKENS // sweep_seqlen)
        run_case(rows, section, "s2-triton", lambda p=pattern: s2(p), pattern, batch, heads, kv_heads, sweep_seqlen,
                 head_dim, modes, budget)

    save()
    print(f"\nwrote {path}\n")
    print("| section | impl | B x T | Hq/Hkv | D | bs | mode | ms | dense TFLOP/s | eff. TFLOP/s | density |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r.get("ms", r.get("error", "")[:40])
        print(f"| {r['section']} | {r['impl']} | {r['batch']}x{r['seqlen']} | {r['heads']}/{r['kv_heads']} | "
              f"{r['head_dim']} | {r['block_size']} | {r['mode']} | {ms} | {r.get('dense_tflops', '')} | "
              f"{r.get('effective_tflops', '')} | {r['density']} |")
    if args.compare:
        print()
        print_comparison(rows)


if __name__ == "__main__":
    main()
