"""Where a kernel's warps wait, per SASS instruction: a summary of Nsight Compute's source page (runs on the CPU).

Why: the aggregate warp-state reasons of ``ncu --section WarpStateStats`` say how long warps waited, not at which
instruction, and a wait that ptxas has hidden under other work costs nothing (the thirty-fourth session's tree
reductions). ``--section SourceCounters`` samples each warp's state with the instruction it is at; exported as CSV, this
groups those samples by the code they fall in. Straight-line runs of instructions with the same execution count are
the kernel's basic regions (a consumer's step loop runs once a step, its epilogue once a work item), so the samples of a
region are the share of a warp's time spent there. Reloads of spilled registers (``LDL``) get their own line: the
waits they cause land on the instruction that first reads the reloaded register (bench/NOTES.md, thirty-fifth
session). On the GPU machine::

    ncu --kernel-name regex:fwd_ws_kernel --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats -o prof python3 bench/profile_gluon_fwd.py 2048
    ncu --import prof.ncu-rep --page source --csv --print-source sass > sass.csv

then here::

    python bench/ncu_source_stalls.py sass.csv [--top 40] [--min-region-share 0.005]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
from dataclasses import dataclass

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    index: int  # position in the kernel's SASS
    text: str
    samples: int  # warp-state samples at this instruction, all reasons
    executed: int  # warp-level executions
    stalls: dict[str, int]  # samples by reason ("long_sb", "barrier", ...)


def _number(text: str) -> int:
    try:
        return int(float(text.replace(",", "")))
    except ValueError:  # "-" for counters that do not apply
        return 0


def read_source_page(path: str) -> list[Instruction]:
    """The instructions of ``ncu --page source --csv --print-source sass`` (plain or gzipped): one kernel's."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"])
    header = rows[header_at]
    column = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "(Not Issued)" not in name]
    return [
        Instruction(index, row[1].strip(), _number(row[column[SAMPLES]]), _number(row[column[EXECUTED]]),
                    {name.removeprefix("stall_"): _number(row[column[name]]) for name in reasons})
        for index, row in enumerate(rows[header_at + 1:])
        if len(row) == len(header)
    ]


def regions(instructions: list[Instruction]) -> list[tuple[int, int, int, int]]:
    """Maximal runs of consecutive instructions with the same execution count: ``(first, last, executed, samples)``."""
    runs = []
    for ins in instructions:
        if runs and runs[-1][2] == ins.executed and runs[-1][1] == ins.index - 1:
            first, _, executed, samples = runs[-1]
            runs[-1] = (first, ins.index, executed, samples + ins.samples)
        else:
            runs.append((ins.index, ins.index, ins.executed, ins.samples))
    return runs


_REGISTER = re.compile(r"\bR\d+\b")


def _operands(text: str) -> tuple[str, list[str]]:
    """``(opcode, operands)`` of a SASS instruction, without its predicate."""
    words = re.sub(r"^@!?U?P\w+\s+", "", text).split(None, 1)
    operands = [o.strip() for o in words[1].rstrip(" ;").split(",")] if len(words) > 1 else []
    return words[0], operands


def spill_reload_waits(instructions: list[Instruction]) -> list[tuple[Instruction, Instruction]]:
    """Each spill reload (``LDL``) with the first later instruction (within 400) that reads its destination register,
    unless one overwrites it first: ``(reload, reader)``. The reader's ``long_sb`` samples are the reload's cost."""
    pairs = []
    for i, ins in enumerate(instructions):
        opcode, operands = _operands(ins.text)
        if not opcode.startswith("LDL") or not operands:
            continue
        register = operands[0]
        for later in instructions[i + 1:i + 401]:
            later_opcode, later_operands = _operands(later.text)
            writes = bool(later_operands) and not later_opcode.startswith("ST")
            sources = later_operands[1:] if writes else later_operands
            if any(register in _REGISTER.findall(o) for o in sources):
                pairs.append((ins, later))
                break
            if writes and later_operands[0] == register:
                break
    return pairs


def summary(instructions: list[Instruction], top: int = 40, min_region_share: float = 0.005) -> str:
    """Markdown tables of the samples by reason and by region, the spill reloads' waits, the top instructions."""
    total = sum(ins.samples for ins in instructions) or 1
    lines = [f"{total} samples over {len(instructions)} instructions", "", "| reason | samples | share |",
             "|---|---|---|"]
    by_reason = collections.Counter()
    for ins in instructions:
        by_reason.update(ins.stalls)
    lines += [f"| {reason} | {n} | {n / total:.3f} |" for reason, n in by_reason.most_common() if n]
    lines += ["", "| instructions | executed | samples | share |", "|---|---|---|---|"]
    lines += [f"| {first}-{last} | {executed} | {samples} | {samples / total:.3f} |"
              for first, last, executed, samples in regions(instructions) if samples / total >= min_region_share]
    reloads = spill_reload_waits(instructions)
    waited = sum(reader.stalls.get("long_sb", 0) for _, reader in reloads)
    lines += ["", f"spill reloads: {len(reloads)}, long-scoreboard samples at their first readers: {waited} "
              f"({waited / total:.3f})"]
    lines += [f"  {reload.index}: {reload.text} -> {reader.index}: {reader.text} ({reader.stalls.get('long_sb', 0)})"
              for reload, reader in reloads if reader.stalls.get("long_sb", 0)]
    lines += ["", f"top {top} instructions by samples (index, samples, executed, instruction, main reasons):"]
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        reasons = ", ".join(f"{r} {n}" for r, n in collections.Counter(ins.stalls).most_common(2) if n)
        lines.append(f"  {ins.index:6d} {ins.samples:7d} {ins.executed:9d}  {ins.text:60s} {reasons}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=40, help="instructions to list, most samples first")
    parser.add_argument("--min-region-share", type=float, default=0.005, help="regions below this share are left out")
    args = parser.parse_args()
    print(summary(read_source_page(args.csv), args.top, args.min_region_share))


if __name__ == "__main__":
    main()
