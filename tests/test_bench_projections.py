"""bench/projection_ab.py on the CPU (Triton's interpreter): every arm it times computes its projection (cuBLAS's
``F.linear`` chain, the package's launchers, a swept launch shape) and the swept shapes fit the shared memory the
launchers budget."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import projection_ab  # noqa: E402

from s2_models.kernels.fused_triton import SkinnyTiles, _default_skinny_tiles, pipeline_bytes  # noqa: E402


@pytest.mark.parametrize("name, outputs", [("qkv", (40, 24, 24)), ("o", (40,)), ("gate_up", (56, 56)),
                                           ("down", (40,))])
def test_every_arm_computes_the_projection(name, outputs):
    width = 96
    weights = [torch.randn(n, width) / 10 for n in outputs]
    x, residual = torch.randn(3, width), torch.randn(3, outputs[0])
    with torch.no_grad():
        expected = projection_ab.projection_call(name, weights, x, residual, "cublas")
        for arm in ("package", SkinnyTiles(16, 64, 2)):
            got = projection_ab.projection_call(name, weights, x, residual, arm)
            for mine, reference in zip(got if isinstance(got, list) else [got],
                                       expected if isinstance(expected, list) else [expected]):
                torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)


def test_swept_shapes_fit_the_budget_and_include_the_default():
    """Every swept shape fits the launchers' budget, and the sweep holds the package's default shape at the 1B
    model's sizes (q/k/v, gate/up, down), so a sweep's best is compared with what the package runs."""
    for width, loops, weights_per_loop, max_stages in ((2048, 3, 1, 5), (2048, 1, 2, 3), (8192, 1, 1, 5)):
        shapes = projection_ab.sweep_tiles(width, loops, weights_per_loop)
        assert shapes and all(pipeline_bytes(t, loops, weights_per_loop, 2) <= 200 * 1024 for t in shapes)
        default = _default_skinny_tiles(torch.empty(8, width, dtype=torch.bfloat16), loops, weights_per_loop,
                                        max_stages)
        assert default in shapes, (default, shapes)
