"""One comparison row's implementations timed in turn while the GPU's clock, power and temperature are sampled (GPU).

Why: at 16 x 8192 the tuner times the forward kernel at ~4.8 ms, but the comparison's rounds
(``bench_s2_attention.py --compare``) measure the same call at 5.1-6.3 ms. This runs a row as the comparison does
(fresh inputs per implementation, ``median_ms`` with the comparison's budget) and also the tuner's short
``do_bench``, with ``nvidia-smi`` sampling every 50 ms, so that each timing carries the SM clock, power draw,
temperature and throttle reasons it ran under. On an H100 every implementation ran at the 700 W software power cap,
its clock at what that power allows (bench/NOTES.md, thirty-second session)::

    python bench/clock_log.py --only "block 64, T=8192" --rounds 4 --out $OUT/clock_log.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import triton.testing
from bench_s2_attention import (
    COMPARE_SHAPES,
    compare_pattern,
    dkernel,
    dkernel_available,
    make_runner,
    median_ms,
    s2,
    sdpa,
)

FIELDS = ["timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"]


def parse_samples(lines: list[str]) -> list[dict]:
    """``nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits`` lines (the throttle reasons may be
    missing, where the driver does not know the field) -> samples with host ``time`` (s)."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) not in (4, 5):
            continue
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append(dict(time=stamp, sm_mhz=float(fields[1]), watts=float(fields[2]), celsius=float(fields[3]),
                                reasons=fields[4] if len(fields) == 5 else "-"))
        except ValueError:  # a header, or "[N/A]"
            continue
    return samples


def window_summary(samples: list[dict], start: float, end: float) -> dict:
    """The samples taken in ``[start, end]``: median SM clock, mean power, highest temperature, throttle reasons."""
    inside = [s for s in samples if start <= s["time"] <= end]
    if not inside:
        return dict(samples=0)
    return dict(samples=len(inside), sm_mhz=statistics.median(s["sm_mhz"] for s in inside),
                watts=round(statistics.fmean(s["watts"] for s in inside), 1),
                celsius=max(s["celsius"] for s in inside), reasons=sorted({s["reasons"] for s in inside}))


def save(out: str, row: str, records: list[dict], log: Path) -> None:
    """Each timing with its window's summary of the samples logged so far, and the samples, as JSON."""
    samples = parse_samples(log.read_text().splitlines())
    for record in records:
        for method in ("comparison", "tuner"):
            record[method].update(window_summary(samples, record[method]["start"], record[method]["end"]))
    Path(out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), row=row, records=records,
                                         samples=samples), indent=1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="block 64, T=8192", help="the COMPARE_SHAPES row (exact name)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--budget-ms", type=float, default=300, help="the comparison's budget per measurement")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = {row[0]: row for row in COMPARE_SHAPES}
    if args.only not in rows:
        parser.error(f"--only must be one of the comparison's row names {list(rows)}, got {args.only!r}")
    name, fields, batch, seqlen, heads, kv_heads, head_dim = rows[args.only]
    pattern = compare_pattern(fields, heads)
    impls = {"s2-triton": lambda: s2(pattern)}
    if dkernel_available():
        impls["dkernel"] = lambda: dkernel(pattern, heads, kv_heads, seqlen)
    from torch.nn.attention import SDPBackend
    impls["sdpa-cudnn"] = lambda: sdpa(SDPBackend.CUDNN_ATTENTION)

    queried = FIELDS if subprocess.run(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv"],
                                       capture_output=True).returncode == 0 else FIELDS[:-1]
    log = Path(tempfile.mkstemp(suffix=".csv")[1])
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(queried)}", "--format=csv,noheader,nounits",
                                "-lms", "50", "-f", str(log)])
    records = []
    try:
        for round_ in range(args.rounds):
            for impl, factory in impls.items():
                q, k, v = (torch.randn(batch, h, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                           for h in (heads, kv_heads, kv_heads))
                attention = factory()
                for mode in ("fwd", "fwd+bwd"):
                    run = make_runner(attention, q, k, v, mode)
                    run()  # compiles and tunes outside the windows (the GPU idles meanwhile, at its highest clock)
                    torch.cuda.synchronize()
                    timings = {}
                    for method in ("comparison", "tuner"):  # median_ms(budget), then do_bench(rep=30) as the tuner
                        start = time.time()
                        if method == "comparison":
                            ms = median_ms(run, args.budget_ms)
                        else:
                            ms = triton.testing.do_bench(run, warmup=5, rep=30, return_mode="median")
                        timings[method] = dict(ms=round(ms, 3), start=start, end=time.time())
                    records.append(dict(round=round_, impl=impl, mode=mode, **timings))
                    print(round_, impl, mode, {m: t["ms"] for m, t in timings.items()}, flush=True)
                del q, k, v
                torch.cuda.empty_cache()
            save(args.out, name, records, log)  # after each round: a run cut by its time limit keeps its rounds
    finally:
        time.sleep(0.2)
        sampler.send_signal(signal.SIGINT)  # nvidia-smi's loop ends on an interrupt, its file written
        sampler.wait(timeout=10)
    save(args.out, name, records, log)
    for r in records:
        print(f"{r['round']} {r['impl']:11s} {r['mode']:8s} " + "  ".join(
            f"{m} {r[m]['ms']:7.3f} ms {r[m].get('sm_mhz', '-')} MHz {r[m].get('watts', '-')} W "
            f"{r[m].get('celsius', '-')} C {r[m].get('reasons', '-')}" for m in ("comparison", "tuner")))


if __name__ == "__main__":
    main()
