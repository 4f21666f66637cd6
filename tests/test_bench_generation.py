"""bench/bench_generation.py on the CPU: the read-ceiling kernel of its launch-size section reads every element once
(Triton's interpreter)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_generation  # noqa: E402


@pytest.mark.parametrize("programs, block, stages", [(3, 2048, 1), (1, 8192, 3), (5, 2048, 3)])
def test_streaming_sum_reads_every_element_once(programs, block, stages):
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(programs)).to(torch.bfloat16)  # not a multiple
    partials = torch.empty(programs)
    bench_generation.streaming_sum_kernel[(programs,)](x, partials, x.numel(), BLOCK=block, STAGES=stages)
    torch.testing.assert_close(partials.sum(), x.float().sum(), rtol=1e-5, atol=1e-3)
