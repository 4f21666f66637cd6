"""bench/hopper_fwd_ab.py on the CPU: the lists of its arms without split steps, the package's tiles by default, and a
version's own tile and lists."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import hopper_fwd_ab  # noqa: E402

from s2_models.kernels import S2Pattern, triton_impl  # noqa: E402


@pytest.fixture
def arm_state(monkeypatch):
    """The tuner's and list builder's state that ``hopper_fwd_ab.use`` sets, restored after the test."""
    monkeypatch.setattr(triton_impl, "split_first_step", triton_impl.split_first_step)
    monkeypatch.setattr(triton_impl, "hopper_fwd", triton_impl.hopper_fwd)
    monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", type(triton_impl._TUNED_CONFIGS)(triton_impl._TUNED_CONFIGS))
    for size in ("small", "medium"):
        monkeypatch.setitem(triton_impl._CANDIDATES, ("fwd", size), triton_impl._CANDIDATES[("fwd", size)])


def test_lists_without_split_steps_are_the_built_lists_with_split_count_zero(arm_state):
    """An arm without split steps gets the forward's lists as built, in the layout the kernel reads (a third count,
    0 for every tile), where the split lists of the same pattern do have split steps."""
    pattern = S2Pattern(block_size=64, local_blocks=5, vert_stride=3)
    blocks = 3000 // 64
    args = (64, True, 128, 64, 2, True)  # block size, causal, tile, unit, group, resident_is_query
    built = triton_impl.build_unit_lists(pattern.block_mask(4, blocks, blocks), *args[:2], tile=128, unit=64, group=2,
                                         resident_is_query=True)
    split = triton_impl.split_first_step(*built, 2, 2)
    assert split[2][..., 2].sum() > 0  # the pattern has split steps to leave out
    units, bits, counts = hopper_fwd_ab.plain_lists(*built, 2, 2)
    assert torch.equal(units, built[0]) and torch.equal(bits, built[1])
    assert counts.shape == split[2].shape and torch.equal(counts[..., :2], built[2])
    assert not counts[..., 2].any()
    # use() swaps it in for the arm's list builds
    arm_kernel = type("ArmKernel", (), {"BLOCK_M": 128, "_num_sms": staticmethod(lambda device: 132)})
    hopper_fwd_ab.use(arm_kernel, (128, 3), split_steps=False)
    assert triton_impl.split_first_step is hopper_fwd_ab.plain_lists
    layout = type("Layout", (), {"block_mask": pattern.block_mask(4, blocks, blocks), "block_size": 64,
                                 "causal": True, "cache_key": None})()
    assert not triton_impl._unit_lists(layout, 128, 128, True, split_first=True)[2][..., 2].any()


def test_an_arm_without_a_tile_runs_each_head_dims_package_tile(arm_state):
    """Without ``--tiles`` an arm runs what the tuner would at each head dim (D = 64's deep ring, D = 128's), with the
    version's own ``BLOCK_M``."""
    arm_kernel = type("ArmKernel", (), {"BLOCK_M": 128, "_num_sms": staticmethod(lambda device: 132)})
    hopper_fwd_ab.use(arm_kernel, None)
    for size in ("small", "medium"):
        (config,) = triton_impl._CANDIDATES[("fwd", size)]
        assert config == triton_impl._WARP_SPECIALIZED_FWD[size][0]


def test_a_version_may_fix_its_own_tile_and_lists(arm_state):
    """A version whose kernel takes other work items (``AB_TILE``, ``SPLIT_STEPS = False``, its own ``BLOCK_M``) is
    timed with them, whatever tile the command line gives the other arms."""
    arm_kernel = type("ArmKernel", (), {"BLOCK_M": 64, "AB_TILE": (64, 3), "SPLIT_STEPS": False,
                                        "_num_sms": staticmethod(lambda device: 132)})
    hopper_fwd_ab.use(arm_kernel, (128, 3))
    assert triton_impl.split_first_step is hopper_fwd_ab.plain_lists
    for size in ("small", "medium"):
        (config,) = triton_impl._CANDIDATES[("fwd", size)]
        assert (config.block_m, config.block_n, config.num_stages, config.gluon) == (64, 64, 3, True)


def test_forward_timeline_patches_apply_to_the_current_kernel(tmp_path):
    """bench/hopper_fwd_timeline.py's stamps find their anchors in the current kernel, in every event set."""
    import hopper_fwd_timeline

    for events in hopper_fwd_timeline.EVENT_SETS:
        module = hopper_fwd_timeline.instrumented_kernel(str(tmp_path), events)  # raises if an anchor is gone
        assert hasattr(module, "_stamp") and hasattr(module, "s2_attention_fwd_ws_kernel")
