"""bench/clock_log.py's parsing of nvidia-smi samples and their summary per timed window (CPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import clock_log  # noqa: E402


def test_samples_parse_and_summarize_per_window():
    lines = [
        "2026/11/27 10:00:00.000, 1980, 650.25, 61, 0x0000000000000000",
        "2026/11/27 10:00:00.050, 1755, 699.80, 63, 0x0000000000000004",
        "2026/11/27 10:00:00.100, 1740, [N/A], 64, 0x0000000000000004",  # unreadable power: skipped
        "2026/11/27 10:00:00.150, 1700, 700.10, 66",  # a driver without the throttle-reasons field
        "timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, clocks_throttle_reasons.active",
    ]
    samples = clock_log.parse_samples(lines)
    assert [s["sm_mhz"] for s in samples] == [1980, 1755, 1700]
    assert samples[2]["reasons"] == "-"
    assert samples[1]["time"] - samples[0]["time"] == pytest.approx(0.05)
    summary = clock_log.window_summary(samples, samples[1]["time"], samples[2]["time"])
    assert summary == dict(samples=2, sm_mhz=1727.5, watts=700.0, celsius=66, reasons=["-", "0x0000000000000004"])
    assert clock_log.window_summary(samples, 0, 1) == dict(samples=0)
