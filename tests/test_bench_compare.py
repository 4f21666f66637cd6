"""bench/bench_s2_attention.py's comparison table on the CPU: ``--rounds`` rows reduce to medians, the dkernel / S2
ratio is the medians' ratio with the range of the rounds' own ratios, and the efficiency against cuDNN is cuDNN's ms
x the kept fraction / the implementation's ms."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import bench_s2_attention  # noqa: E402


def _rows(ms_by_impl: dict, section: str = "block 64, T=8192", kept: float = 0.25) -> list:
    """One row per (implementation, mode, round), as ``run_case`` writes them."""
    return [dict(section=section, impl=impl, mode=mode, round=n, ms=ms, density=kept)
            for (impl, mode), per_round in ms_by_impl.items() for n, ms in enumerate(per_round)]


def _table_row(capsys, rows: list) -> list[str]:
    bench_s2_attention.print_comparison(rows)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_rounds_reduce_to_medians_with_the_range_of_the_rounds_ratios(capsys):
    rows = _rows({
        ("s2-triton", "fwd"): [2.0, 6.0, 3.0],  # median 3 (mean 3.67)
        ("dkernel", "fwd"): [3.0, 4.0, 6.0],  # median 4; the rounds' own ratios 1.5, 0.667, 2.0
        ("sdpa-cudnn", "fwd"): [12.0, 12.0, 9.0],  # median 12
        ("s2-triton", "fwd+bwd"): [10.0, 10.0, 10.0],
        ("dkernel", "fwd+bwd"): [15.0, 15.0, 15.0],
        ("sdpa-cudnn", "fwd+bwd"): [40.0, 40.0, 40.0],
    })
    (section, s2_ms, dkernel_ms, ratios, cudnn_ms, s2_efficiency, dkernel_efficiency, flex,
     flash) = _table_row(capsys, rows)
    assert section == "block 64, T=8192"
    assert (s2_ms, dkernel_ms, cudnn_ms) == ("3.00 / 10.00", "4.00 / 15.00", "12.00 / 40.00")
    assert ratios == "1.333 (0.667-2.000), 1.500 (1.500-1.500)"
    assert s2_efficiency == "1.00, 1.00"  # 12 x 0.25 / 3 and 40 x 0.25 / 10
    assert dkernel_efficiency == "0.75, 0.67"
    assert flex == flash == "- / -"


def test_dense_work_rows_show_flash_attention_beside_cudnn(capsys):
    rows = _rows({("s2-triton", "fwd"): [4.0, 6.0], ("sdpa-cudnn", "fwd"): [5.0, 5.0],
                  ("sdpa-flash2", "fwd"): [7.0, 8.0, 9.0]}, section="dense work, T=2048", kept=1.0)
    cells = _table_row(capsys, rows)
    assert cells[0] == "dense work, T=2048"
    assert cells[5] == "1.00, -"  # cuDNN 5 x 1.0 / S2's median 5
    assert cells[-1] == "8.00 / -"


def test_one_round_and_missing_baselines(capsys):
    rows = _rows({("s2-triton", "fwd"): [5.0], ("s2-triton", "fwd+bwd"): [20.0], ("dkernel", "fwd"): [6.0]})
    rows.append(dict(section="block 64, T=8192", impl="dkernel", mode="fwd+bwd", round=0, density=0.25,
                     error="OutOfMemoryError: ..."))  # a failed measurement carries no ms
    cells = _table_row(capsys, rows)
    assert cells[1:4] == ["5.00 / 20.00", "6.00 / -", "1.200, -"]  # one round: no range
    assert cells[4:7] == ["- / -", "-, -", "-, -"]  # no cuDNN run: no efficiency


def test_only_picks_shapes_by_part_or_by_exact_name():
    names = [name for name, *_ in bench_s2_attention.COMPARE_SHAPES]
    pick = lambda only: [n for n in names if bench_s2_attention.shape_selected(n, only)]  # noqa: E731
    assert pick(None) == names
    assert pick("block 64, T=32768") == ["block 64, T=32768", "D=64, block 64, T=32768", "GQA 32/8, block 64, T=32768"]
    assert pick("=block 64, T=32768") == ["block 64, T=32768"]
    assert pick("=block 64, T=32768;block 16") == ["block 64, T=32768", "block 16, T=16384"]
    assert pick("=block 64") == []
