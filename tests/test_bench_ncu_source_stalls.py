"""bench/ncu_source_stalls.py on the CPU, on a small source page written as ncu writes it: regions split where the
execution count changes, a spill reload is paired with the instruction that first reads its register (not one that
only overwrites it), and gzipped pages read like plain ones."""

import csv
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ncu_source_stalls  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed", "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]
# (instruction, samples, executed, long_sb, barrier)
PAGE = [
    ("LDC R1, c[0x0][0x28]", 1, 100, 0, 0),
    ("LDL R4, [R1+0x8]", 2, 800, 0, 0),
    ("IMAD.U32 R5, RZ, RZ, UR4", 3, 800, 0, 0),
    ("@P0 LDL R6, [R1+0xc]", 1, 800, 0, 0),
    ("MOV R6, RZ", 1, 800, 0, 0),  # overwrites R6 before any read: no pair for that reload
    ("R2UR UR9, R4", 50, 800, 48, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x1", 40, 100, 0, 40),
]


def write_page(path, opener=open):
    with opener(path, "wt", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "kernel", ""])
        writer.writerow(HEADER)
        for i, (text, samples, executed, long_sb, barrier) in enumerate(PAGE):
            writer.writerow([hex(0x1000 + 16 * i), "  " + text, samples, samples, samples, f"{executed:,}", long_sb,
                             barrier, 0])


def test_regions_and_spill_reload_waits(tmp_path):
    write_page(tmp_path / "page.csv")
    instructions = ncu_source_stalls.read_source_page(str(tmp_path / "page.csv"))
    assert [i.text for i in instructions] == [text for text, *_ in PAGE]
    assert instructions[5].stalls == {"long_sb": 48, "barrier": 0}
    assert ncu_source_stalls.regions(instructions) == [(0, 0, 100, 1), (1, 5, 800, 57), (6, 6, 100, 40)]
    pairs = ncu_source_stalls.spill_reload_waits(instructions)
    assert [(reload.index, reader.index) for reload, reader in pairs] == [(1, 5)]
    text = ncu_source_stalls.summary(instructions, top=2)
    assert "long-scoreboard samples at their first readers: 48" in text
    assert "| 1-5 | 800 | 57 |" in text


def test_gzipped_page(tmp_path):
    write_page(tmp_path / "page.csv.gz", gzip.open)
    assert len(ncu_source_stalls.read_source_page(str(tmp_path / "page.csv.gz"))) == len(PAGE)
