"""bench/decode_ab.py, bench/decode_timeline.py and bench/pdl_edge.py on the CPU (Triton's interpreter): a loaded copy
of the decode kernel's module runs exactly as the package's, the chunk read sums every element once, the timeline's
and the PDL-edge variants' source patches still find their places in the current kernel, and the PDL-edge arms launch
what they say."""

import itertools
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_ab  # noqa: E402
import decode_timeline  # noqa: E402
import pdl_edge  # noqa: E402

from s2_models.kernels import decode_triton  # noqa: E402
from s2_models.kernels.decode import CompactLayout, s2_cache_append  # noqa: E402
from s2_models.kernels.pattern import S2Pattern  # noqa: E402


def small_decode_case(seed: int = 0):
    """A compact layout, a one-token query, its row lengths and full caches of 2 rows x 2 KV heads."""
    generator = torch.Generator().manual_seed(seed)
    layout = CompactLayout(S2Pattern(block_size=16, local_blocks=2, vert_stride=3), num_q_heads=4, num_kv_heads=2,
                           ring_blocks=2)
    seq_lens = torch.tensor([150, 97], dtype=torch.int32)
    num_ring, slots = 2, 2 + 4  # ring blocks, then up to 4 vertical slots (150 tokens: blocks 0-9, 3 stripes)
    q = torch.randn(2, 4, 1, 32, generator=generator)
    k, v = (torch.randn(2, 2, slots * 16, 32, generator=generator) for _ in range(2))
    return layout, seq_lens, num_ring, q, k, v


def test_loaded_copy_runs_like_the_package(tmp_path):
    copy = tmp_path / "decode_copy.py"
    shutil.copy(decode_triton.__file__, copy)
    module = decode_ab.load_version(str(copy))
    assert module is not decode_triton and module.__name__.startswith("s2_models.kernels._decode_")
    layout, seq_lens, num_ring, q, k, v = small_decode_case()
    scale = decode_ab.SHAPES["head_dim"] ** -0.5  # the harness's launcher scales as for its model
    expected = decode_triton.decode_attention_triton(q, k, v, seq_lens, layout, num_ring, scale, 3,
                                                     tiles=decode_triton.DecodeTiles(64, 2, 1))
    for counters in (torch.zeros(2 * 2, dtype=torch.int32), None):  # kept across launches; decode_ab --counters fresh
        setup = {"q": q, "seq_lens": seq_lens, "num_ring": num_ring, "split_counters": counters}
        assert torch.equal(decode_ab.launch(module, setup, layout, (64, 2, 1), 3, k, v), expected)
        assert counters is None or not counters.any()
    auto = decode_triton.decode_attention_triton(q, k, v, seq_lens, layout, num_ring, scale, 3)  # --tiles auto
    setup["split_counters"] = None
    assert torch.equal(decode_ab.launch(module, setup, layout, None, 3, k, v), auto)
    assert decode_ab.compiled_variants(module) == []  # the interpreter compiles nothing; on a GPU, one entry a variant


@pytest.mark.parametrize("programs, block", [(3, 2048), (7, 4096)])
def test_chunk_read_sums_every_element_once(programs, block):
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(programs)).to(torch.bfloat16)
    chunk = -(-x.numel() // programs)  # the last chunk is short
    partials = torch.empty(programs)
    decode_timeline.chunk_sum_kernel[(programs,)](x, partials, x.numel(), chunk, BLOCK=block, STAGES=1)
    torch.testing.assert_close(partials.sum(), x.float().sum(), rtol=1e-5, atol=1e-3)


def test_timeline_patches_apply_to_the_current_kernel(tmp_path):
    module = decode_timeline.instrumented_kernel(str(tmp_path))  # raises if an anchor is gone
    source = (tmp_path / "decode_triton_instrumented.py").read_text()
    assert source.count("_stamp(trace_row,") == 5 and "if arrived == num_splits - 1:" in source
    assert hasattr(module, "_stamp") and hasattr(module, "s2_decode_fwd_kernel")
    preallocated = decode_timeline.instrumented_kernel(str(tmp_path), preallocated=True)  # for launches in a graph
    source = (tmp_path / "decode_triton_instrumented_preallocated.py").read_text()
    assert "torch.full(" not in source and "TRACE = TRACE_BUFFERS[TRACE_CALLS % len(TRACE_BUFFERS)]" in source
    assert preallocated.TRACE_BUFFERS == [] and preallocated.TRACE_CALLS == 0


def test_pdl_edge_variants_patch_the_current_kernel(tmp_path):
    assert pdl_edge.variant_module("head", str(tmp_path)) is decode_triton
    for name, condition in pdl_edge.VARIANTS.items():
        module = pdl_edge.variant_module(name, str(tmp_path))  # raises if the split counter's line is gone
        source = (tmp_path / f"decode_triton_{name}.py").read_text()
        assert condition in source and pdl_edge.SPLIT_COUNTER not in source and hasattr(module, "s2_decode_fwd_kernel")
    with pytest.raises(ValueError, match="variant must be head or one of"):
        pdl_edge.variant_module("fast", str(tmp_path))


@pytest.mark.parametrize("before, after", itertools.product(("none", "append"), ("none", "ordinary", "marker")))
def test_pdl_edge_arm_launches_the_append_decode_marker_and_ordinary_kernel(before, after):
    layout, seq_lens, num_ring, q, k, v = small_decode_case(seed=1)
    setup = {"q": q, "seq_lens": seq_lens, "num_ring": num_ring, "split_counters": torch.zeros(4, dtype=torch.int32)}
    k_expected, v_expected = k.clone(), v.clone()
    if before == "append":  # the new token of each KV head (the query's first head of its group) at seq_lens - 1
        new = q[:, ::2, :1]
        s2_cache_append(k_expected, v_expected, new, new, seq_lens, layout, num_ring_slots=num_ring)
        assert not torch.equal(k_expected, k)
    expected = decode_ab.launch(decode_triton, setup, layout, pdl_edge.TILES, 2, k_expected, v_expected)
    ordinary = torch.zeros(3)
    out = pdl_edge.layer_launches(decode_triton, setup, layout, 2, k, v, before, after, ordinary)
    assert torch.equal(k, k_expected) and torch.equal(v, v_expected) and torch.equal(out, expected)
    assert ordinary.tolist() == [float(after != "none")] * 3


def test_timeline_phases_from_stamps():
    """Stamps in ns from an arbitrary origin; -1 where a program did not stamp (no merge, or one split)."""
    trace = np.full((4, 8), -1, dtype=np.int64)
    trace[:, 0] = [5_000, 5_100, 5_200, 5_000]  # starts
    trace[:, 1] = trace[:, 0] + 1_000  # key range known
    trace[:, 2] = trace[:, 1] + [10_000, 12_000, 14_000, 16_000]  # key loops
    trace[:, 3] = trace[:, 2] + 500  # atomics
    trace[3, 4] = trace[3, 3] + 700  # only the last program merges
    trace[:, 5] = [0, 1, 1, 2]  # SMs
    phases = decode_timeline.phases(trace)
    assert phases["start"] == [0.0, 0.05, 0.2] and phases["prologue"] == [1.0, 1.0, 1.0]
    assert phases["loop"] == [10.0, 13.0, 16.0] and phases["merge"] == [0.7, 0.7, 0.7]
    assert phases["span_us"] == 18.2 and phases["most_programs_on_one_sm"] == 2
    assert phases["per_program"][3] == [2, 0.0, 1.0, 17.0, 18.2]


@pytest.mark.gpu
def test_compiled_variants_report_each_launch_shape(tmp_path):
    """On a GPU ``decode_ab`` lists one entry per compiled launch shape, and its programs an SM stay within what the
    variant's registers and shared memory allow (an occupancy query given the wrong threads or bytes overshoots)."""
    copy = tmp_path / "decode_copy.py"
    shutil.copy(decode_triton.__file__, copy)
    module = decode_ab.load_version(str(copy))  # a fresh kernel: only this test's variants
    layout = CompactLayout(S2Pattern(block_size=64, local_blocks=2, vert_stride=4), num_q_heads=8, num_kv_heads=2,
                           ring_blocks=2)
    seq_lens = torch.tensor([1000, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 8 * 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    setup = {"q": q, "seq_lens": seq_lens, "num_ring": 2, "split_counters": None}
    for stages in (3, 4):
        decode_ab.launch(module, setup, layout, (128, 4, stages), 2, k, v)
    variants = sorted(decode_ab.compiled_variants(module), key=lambda variant: variant["num_stages"])
    assert [(variant["num_warps"], variant["num_stages"]) for variant in variants] == [(4, 3), (4, 4)]
    properties = torch.cuda.get_device_properties(0)
    for variant in variants:
        threads = 32 * variant["num_warps"]
        by_threads = properties.max_threads_per_multi_processor // threads
        by_registers = getattr(properties, "regs_per_multiprocessor", 65536) // (variant["registers"] * threads)
        by_shared = properties.shared_memory_per_multiprocessor // max(1, variant["shared_bytes"])
        assert 1 <= variant["programs_per_sm"] <= min(by_threads, by_registers, by_shared), variant
    assert variants[0]["shared_bytes"] < variants[1]["shared_bytes"]
    assert variants[1]["programs_per_sm"] <= variants[0]["programs_per_sm"]


@pytest.mark.gpu
def test_pdl_edge_placement_stamps_every_program_of_every_launch_in_the_graph(tmp_path):
    """``pdl_edge.placement`` replays a graph of an arm's launches with trace buffers allocated before the capture:
    every launch's programs stamp their own buffer (a fill inside the graph would be a launch between the arm's), and
    the marker and closing kernel stamp the edges between the launches."""
    module = decode_timeline.instrumented_kernel(str(tmp_path), preallocated=True)
    layout = CompactLayout(S2Pattern(block_size=64, local_blocks=2, vert_stride=4), num_q_heads=8, num_kv_heads=2,
                           ring_blocks=2)
    seq_lens = torch.tensor([1000, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    caches = [[torch.randn(2, 2, 8 * 64, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv"] for _ in range(3)]
    setup = {"q": q, "seq_lens": seq_lens, "num_ring": 2, "split_counters": torch.zeros(16, dtype=torch.int32,
                                                                                         device="cuda"),
             "caches": caches}
    result = pdl_edge.placement(module, setup, layout, 2, "append", "marker", torch.zeros(4, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert len(result["launches"]) == 3
    for launch in result["launches"]:
        assert launch["programs"] == 2 * 2 * 2  # splits x rows x KV heads
        assert sum(launch["sms_by_programs"]) == sms and launch["span_us"] > 0
        assert sum(count * programs for programs, count in enumerate(launch["sms_by_programs"])) == 8
    assert 1 <= result["most_programs_on_one_sm"] <= 2
    assert result["us_per_layer"] > 0 and len(result["sms_without_program"]) == 5 * 3  # samples x launches
    assert all(sms - 8 <= idle < sms for idle in result["sms_without_program"])
    assert set(result["gaps_us_median"]) == {"closing_to_decode_start", "decode_end_to_marker_past_wait",
                                             "decode_end_to_closing"}
    assert result["gaps_us_median"]["decode_end_to_marker_past_wait"] > 0  # the marker waits for the whole launch
