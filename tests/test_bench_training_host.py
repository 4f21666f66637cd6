"""bench/profile_training_host.py on the CPU: a ``--tiny`` run writes every arm's step times, profile and attention
host costs (its numbers mean nothing on the CPU; the script is for the GPU)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_tiny_run_writes_every_arm(tmp_path):
    out = tmp_path / "host.json"
    command = [sys.executable, str(BENCH / "profile_training_host.py"), "--tiny", "--out", str(out), "--rounds", "1",
               "--steps", "1", "--warmup", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert list(results["arms"]) == ["s2-packed", "s2-batch", "llama-batch"]
    for arm in results["arms"].values():
        for mode in ("device_thread", "calling_thread"):
            assert len(arm["steps"][mode]["step_ms"]) == 1 and arm["steps"][mode]["step_ms"][0] > 0
            assert arm["steps"][mode]["issue_ms"][0] > 0
        assert arm["timeline"]["self_time_ms"] and arm["syncs"] == {}  # no GPU: no kernels, no syncs
    for costs in results["attention_host_us"].values():
        assert costs["forward_no_grad_us"] > 0 and costs["forward_backward_us"] > 0


def test_unknown_arm_is_an_error(tmp_path):
    command = [sys.executable, str(BENCH / "profile_training_host.py"), "--tiny", "--out", str(tmp_path / "x.json"),
               "--arms", "s2-packed,dense"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--arms: 'dense' is not one of" in result.stderr
