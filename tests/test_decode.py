"""The decode / chunked-prefill op over the compact cache: PyTorch path vs the fp64 reference, Triton vs PyTorch."""

import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from s2_models.kernels import decode_triton, dependent_launch
from s2_models.kernels.decode import CompactLayout, ring_blocks_for, s2_cache_append, s2_decode_attention, slot_blocks
from s2_models.kernels.naive import naive_s2_attention
from s2_models.kernels.pattern import S2Pattern

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATTERNS = (
    S2Pattern(block_size=16, local_blocks=2, vert_stride=3),
    S2Pattern(block_size=16, local_blocks=1, vert_stride=4, homo_head=True),
    S2Pattern(block_size=16, local_blocks=3, vert_stride=5, per_query_head=True),
    S2Pattern(block_size=32, local_blocks=1, vert_stride=2, num_dense_heads=1),
)


def compact_cache(k, seq_lens, layout):
    """The compact cache of left-padded full ``k [B, Hkv, T, D]`` holding ``seq_lens`` real tokens per row."""
    b, hkv, t, d = k.shape
    bs = layout.block_size
    n = int(seq_lens.max())
    num_ring = layout.num_ring_slots(n)
    num_slots = num_ring + layout.num_vertical_slots(n)
    blocks = slot_blocks(layout, seq_lens, num_ring, num_slots)
    pos = blocks[..., None] * bs + torch.arange(bs)
    ok = (blocks[..., None] >= 0) & (pos < seq_lens[:, None, None, None])
    index = (t - seq_lens[:, None, None, None] + pos).clamp(0, t - 1)
    out = k[torch.arange(b)[:, None, None, None], torch.arange(hkv)[None, :, None, None], index]
    return out.masked_fill(~ok[..., None], 0).flatten(2, 3), num_ring


def allocated_ahead(cache, layout, num_ring, extra_slots):
    """``cache`` as a static cache holds it: the whole ring allocated and ``extra_slots`` more vertical slots, all
    filled with finite garbage that no query may read (the ring keeps its slot order, the vertical slots move)."""
    bs = layout.block_size
    b, hkv, _, d = cache.shape
    ring = torch.randn(b, hkv, layout.ring_blocks * bs, d, dtype=cache.dtype)
    ring[:, :, : num_ring * bs] = cache[:, :, : num_ring * bs]
    extra = torch.randn(b, hkv, extra_slots * bs, d, dtype=cache.dtype)
    return torch.cat([ring, cache[:, :, num_ring * bs :], extra], 2)


def case(pattern, dtype, tq, seed_lens, extra_slots=None):
    b, hkv, group, d = 2, 2, 2, 32
    t = max(seed_lens)
    q = torch.randn(b, hkv * group, tq, d, dtype=dtype)
    k, v = (torch.randn(b, hkv, t, d, dtype=dtype) for _ in range(2))
    seq_lens = torch.tensor(seed_lens)
    mask = torch.arange(t)[None, :] >= (t - seq_lens)[:, None]
    layout = CompactLayout(pattern, hkv * group, hkv, ring_blocks_for(pattern, tq))
    k_cache, num_ring = compact_cache(k, seq_lens, layout)
    v_cache, _ = compact_cache(v, seq_lens, layout)
    if extra_slots is not None:
        k_cache, v_cache = (allocated_ahead(c, layout, num_ring, extra_slots) for c in (k_cache, v_cache))
        num_ring = layout.ring_blocks
    full_q = torch.zeros(b, hkv * group, t, d, dtype=dtype)
    full_q[:, :, t - tq :] = q
    ref, _ = naive_s2_attention(full_q, k, v, pattern, attention_mask=mask)
    return q, k_cache, v_cache, seq_lens, layout, num_ring, ref[:, :, t - tq :]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tq", [1, 7, 40])
def test_torch_path_matches_reference(pattern, tq):
    lens = [random.randint(tq, 230), random.randint(1, 230)]  # the second row may be shorter than the chunk
    q, kc, vc, seq_lens, layout, num_ring, ref = case(pattern, torch.float64, tq, lens)
    out = s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=num_ring, backend="torch")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


# vert_stride 20: more residues than the kernel packs into integers (16), so its tables are looked up by tl.gather
WIDE_STRIDE = S2Pattern(block_size=16, local_blocks=2, vert_stride=20)


@pytest.mark.parametrize("pattern", [*PATTERNS[::3], WIDE_STRIDE], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# rows: 2 and 6 (the 8-row tile, keys on the products' M axis), 18 (two 16-row tiles), 40 (one 64-row tile)
@pytest.mark.parametrize("tq,num_splits", [(1, 1), (1, 3), (3, 2), (9, 2), (20, 2)])
def test_triton_matches_torch_path(pattern, dtype, tq, num_splits):
    lens = [random.randint(tq, 300), random.randint(1, 300)]
    q, kc, vc, seq_lens, layout, num_ring, ref = case(pattern, dtype, tq, lens)
    expected = s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=num_ring, backend="torch")
    # compiled on a GPU, interpreted (TRITON_INTERPRET=1, set by conftest) without one
    on_device = (t.to(DEVICE) for t in (q, kc, vc, seq_lens))
    out = s2_decode_attention(*on_device, layout, num_ring_slots=num_ring, backend="triton", num_splits=num_splits)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float().cpu(), expected.float(), atol=tol, rtol=tol)


DENSE = S2Pattern(block_size=16, local_blocks=1, vert_stride=1)  # every block vertical: a static cache's dense layers


@pytest.mark.parametrize("pattern", [PATTERNS[0], PATTERNS[2], DENSE], ids=repr)
@pytest.mark.parametrize("tq", [1, 3])
def test_slots_allocated_ahead_are_ignored(pattern, tq):
    """A static cache allocates the whole ring and the vertical slots of its maximum length up front: whatever the
    unfilled slots hold, both paths give the reference (the kernel also sizes its loop from each row's length, so
    it does not load them; that is a matter of speed, measured in the benchmark)."""
    lens = [random.randint(tq, 150), random.randint(1, 40)]
    q, kc, vc, seq_lens, layout, num_ring, ref = case(pattern, torch.float64, tq, lens, extra_slots=9)
    out = s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=num_ring, backend="torch")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    on_device = [t.float().to(DEVICE) for t in (q, kc, vc)] + [seq_lens.to(DEVICE)]
    for num_splits in (1, 4):
        out = s2_decode_attention(*on_device, layout, num_ring_slots=num_ring, backend="triton",
                                  num_splits=num_splits)
        torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pattern", [PATTERNS[2], DENSE], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unfilled_slots_may_hold_nan(pattern, dtype):
    """Memory a static cache allocated but never wrote may hold any bits: NaN in every slot position that holds no
    real token (empty ring slots, the tail of the newest block, the slots allocated ahead) changes nothing."""
    lens = [random.randint(1, 150), random.randint(1, 40)]
    q, kc, vc, seq_lens, layout, num_ring, ref = case(pattern, dtype, 1, lens, extra_slots=5)
    bs = layout.block_size
    blocks = slot_blocks(layout, seq_lens, num_ring, kc.shape[2] // bs)  # [B, Hkv, S]
    pos = blocks[..., None] * bs + torch.arange(bs)
    holds_token = ((blocks[..., None] >= 0) & (pos < seq_lens[:, None, None, None])).flatten(2)
    kc, vc = (c.masked_fill(~holds_token[..., None], float("nan")) for c in (kc, vc))
    on_device = [t.to(DEVICE) for t in (q, kc, vc, seq_lens)]
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for num_splits in (1, 3):
        out = s2_decode_attention(*on_device, layout, num_ring_slots=num_ring, backend="triton",
                                  num_splits=num_splits)
        torch.testing.assert_close(out.double().cpu(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("tq", [1, 9])
def test_split_counters_are_left_zero_and_reused(tq):
    """The split-KV kernel merges in the program that finishes last, found with one counter per (row, KV head, row
    tile): a caller's counters come back zero, so call after call (a cache's steps) reuses them and stays exact; too
    few counters (a long chunk has more row tiles) and the call uses its own."""
    pattern = PATTERNS[2]
    for counters in (torch.zeros(2 * 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)):
        counters = counters.to(DEVICE)
        for _ in range(3):
            lens = [random.randint(tq, 300), random.randint(1, 300)]
            q, kc, vc, seq_lens, layout, num_ring, ref = case(pattern, torch.float32, tq, lens)
            on_device = [t.to(DEVICE) for t in (q, kc, vc, seq_lens)]
            out = s2_decode_attention(*on_device, layout, num_ring_slots=num_ring, backend="triton", num_splits=3,
                                      split_counters=counters)
            torch.testing.assert_close(out.double().cpu(), ref.double(), atol=1e-5, rtol=1e-5)
            assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_merge_across_programs_on_gpu(num_splits):
    """On a GPU the splits of one row run at the same time: the last to finish must see every other split's output
    (the counter's release/acquire). Many rows and splits, one counter buffer, a CUDA graph replayed over fresh
    inputs, each replay against the PyTorch path."""
    pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
    b, hkv, group, d, t = 16, 8, 4, 64, 8192
    layout = CompactLayout(pattern, hkv * group, hkv, ring_blocks_for(pattern, 1))
    seq_lens = torch.randint(t // 2, t + 1, (b,))
    k, v = (torch.randn(b, hkv, t, d, dtype=torch.float16) for _ in range(2))
    kc, num_ring = compact_cache(k, seq_lens, layout)
    vc, _ = compact_cache(v, seq_lens, layout)
    kc, vc, seq_lens = kc.cuda(), vc.cuda(), seq_lens.cuda()
    q = torch.empty(b, hkv * group, 1, d, dtype=torch.float16, device="cuda")
    counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")

    def step():
        return s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=num_ring, backend="triton",
                                   num_splits=num_splits, split_counters=counters)

    q.normal_()
    step()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(20):
        q.normal_()
        kc.normal_()
        graph.replay()
        expected = s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=num_ring, backend="torch")
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tq", [1, 2, 6, 64])  # rows: 4, 8 (keys on M), 24 (two 16-row tiles), 256 (64-row tiles)
def test_triton_on_gpu(dtype, tq):
    _check_triton_on_gpu(dtype, tq, d=128, hkv=4, t=5000, seq_lens=[5000, 5000 - 777, tq], tolerance=2e-2)


def _check_triton_on_gpu(dtype, tq, d, hkv, t, seq_lens, tolerance):
    """The Triton decode kernel against the PyTorch path on compact caches of random K/V (groups of 4 query heads)."""
    pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
    b, group = len(seq_lens), 4
    q = torch.randn(b, hkv * group, tq, d, dtype=dtype)
    k, v = (torch.randn(b, hkv, t, d, dtype=dtype) for _ in range(2))
    seq_lens = torch.tensor(seq_lens)
    layout = CompactLayout(pattern, hkv * group, hkv, ring_blocks_for(pattern, tq))
    kc, num_ring = compact_cache(k, seq_lens, layout)
    vc, _ = compact_cache(v, seq_lens, layout)
    args = [x.cuda() for x in (q, kc, vc, seq_lens)]
    expected = s2_decode_attention(*args, layout, num_ring_slots=num_ring, backend="torch")
    out = s2_decode_attention(*args, layout, num_ring_slots=num_ring, backend="triton")
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, d", [(torch.float32, 128), (torch.float32, 256), (torch.bfloat16, 256)])
@pytest.mark.parametrize("tq", [1, 6, 64])
def test_triton_on_gpu_where_the_default_pipeline_does_not_fit(dtype, d, tq):
    """Head dims and dtypes whose 3-stage decode kernel asks more shared memory than a Hopper program has (290-700
    KB): the launcher takes a shallower pipeline (``launch_within_shared_memory``) and the outputs stay PyTorch's."""
    _check_triton_on_gpu(dtype, tq, d, hkv=2, t=3000, seq_lens=[3000, 3000 - 777],
                         tolerance=2e-2 if dtype == torch.bfloat16 else 1e-4)


_COMPILE_DECODE_VARIANTS = """
import sys
import torch
sys.path.insert(0, "bench")
from hopper_fwd_offline import _CompileOnlyDriver
from triton.runtime import driver
driver.set_active(_CompileOnlyDriver())
from s2_models.kernels import decode_triton
from s2_models.kernels.decode import CompactLayout, ring_blocks_for
from s2_models.kernels.pattern import S2Pattern
decode_triton.launch_options = lambda device: {"PDL": True, "launch_pdl": True}
kernel, shared = decode_triton.s2_decode_fwd_kernel, []
class Warmup:
    def __getitem__(self, grid):
        return lambda *a, **kw: shared.append(kernel.warmup(*a, grid=grid, **kw).metadata.shared)
decode_triton.s2_decode_fwd_kernel = Warmup()
pattern = S2Pattern(block_size=64, local_blocks=16, vert_stride=16)
layout = CompactLayout(pattern, 32, 8, ring_blocks_for(pattern, 1))
rows = []
# (head dim, dtype, tiles): the default launch shape where it was tuned, and a depth the launcher can fall back to
# elsewhere
for d, dtype, tiles in ((64, torch.bfloat16, decode_triton.DecodeTiles()),
                        (128, torch.bfloat16, decode_triton.DecodeTiles()),
                        (128, torch.float32, decode_triton.DecodeTiles(num_stages=2)),
                        (256, torch.bfloat16, decode_triton.DecodeTiles(num_stages=1))):
    cache = torch.empty(2, 8, 64 * 64, d, dtype=dtype)
    for tq in (1, 4, 16):  # 8-, 16- and 64-row tiles
        q = torch.empty(2, 32, tq, d, dtype=dtype)
        decode_triton.decode_attention_triton(q, cache, cache.clone(), torch.full((2,), 4000), layout, 16, 0.1, 2,
                                              tiles=tiles)
        rows.append((d, str(dtype).split(".")[1], tq, tiles.num_stages, shared[-1]))
print(repr(rows))
"""


def test_decode_pipelines_fit_hopper_shared_memory():
    """The decode kernel compiled for sm_90 by the installed Triton (offline, no GPU), each row tile: 16-bit caches up
    to head dim 128 fit the 227 KB of a Hopper program at the default launch shape (what was tuned and measured), and
    float32 at head dim 128 and bf16 at 256, which do not (bench/NOTES.md, fifty-third session), fit at a shallower
    pipeline (2 stages, 1), which ``launch_within_shared_memory`` falls back to."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_DECODE_VARIANTS], capture_output=True, text=True,
                            env=env, cwd=Path(__file__).resolve().parents[1], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 (our own subprocess's repr)
    assert len(rows) == 12 and all(shared <= 232448 for *_, shared in rows), rows


def test_a_launch_takes_the_deepest_pipeline_that_fits(monkeypatch):
    """``launch_within_shared_memory``: a launch that Triton refuses for its shared memory is retried with one stage
    fewer until one fits; the depth found is reused for the same key, and a launch that fits nowhere raises."""
    from triton.runtime.errors import OutOfResources

    from s2_models.kernels import triton_setup

    monkeypatch.setattr(triton_setup, "_STAGES_THAT_FIT", {})
    tried = []

    def launch(num_stages, fits=2):
        tried.append(num_stages)
        if num_stages > fits:
            raise OutOfResources(num_stages * 100_000, 232_448, "shared memory")

    triton_setup.launch_within_shared_memory(launch, 4, key="a")
    triton_setup.launch_within_shared_memory(launch, 4, key="a")
    assert tried == [4, 3, 2, 2]
    with pytest.raises(OutOfResources):
        triton_setup.launch_within_shared_memory(lambda num_stages: launch(num_stages, fits=0), 3, key="b")
    tried.clear()
    triton_setup.launch_within_shared_memory(launch, 2, key="c")  # fits at once: nothing remembered
    assert tried == [2] and "c" not in triton_setup._STAGES_THAT_FIT


class _RefusesDeepPipelines:
    """Stands in for a Triton kernel on a GPU whose shared memory holds only ``fits`` pipeline stages: deeper launches
    raise ``OutOfResources`` as Triton does when it prepares them; the others run the real kernel. ``stage_keyword``:
    the launch keyword that sets the depth."""

    def __init__(self, kernel, fits: int, stage_keyword: str):
        self.kernel, self.fits, self.stage_keyword, self.depths = kernel, fits, stage_keyword, []

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def launch(*args, **kwargs):
            self.depths.append(kwargs[self.stage_keyword])
            if kwargs[self.stage_keyword] > self.fits:
                raise OutOfResources(300_000, 232_448, "shared memory")
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_decode_launcher_falls_back_to_a_pipeline_that_fits(monkeypatch):
    """``decode_attention_triton`` launches through ``launch_within_shared_memory``: on a GPU that refuses its 3-stage
    pipeline it runs at the deepest one that fits, with the same outputs, and does not try the refused depth again."""
    from s2_models.kernels import triton_setup

    monkeypatch.setattr(triton_setup, "_STAGES_THAT_FIT", {})
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    layout = CompactLayout(pattern, 4, 2, ring_blocks=2)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=generator)
    k, v = (torch.randn(2, 2, 6 * 16, 32, generator=generator) for _ in range(2))
    seq_lens = torch.tensor([90, 61], dtype=torch.int32)
    expected = decode_triton.decode_attention_triton(q, k, v, seq_lens, layout, 2, 0.2, 2)
    refusing = _RefusesDeepPipelines(decode_triton.s2_decode_fwd_kernel, fits=1, stage_keyword="num_stages")
    monkeypatch.setattr(decode_triton, "s2_decode_fwd_kernel", refusing)
    for _ in range(2):
        assert torch.equal(decode_triton.decode_attention_triton(q, k, v, seq_lens, layout, 2, 0.2, 2), expected)
    assert refusing.depths == [3, 2, 1, 1]


def test_the_projection_launchers_fall_back_to_a_pipeline_that_fits(monkeypatch):
    """The decode projections launch the same way (``STAGES`` is their depth)."""
    from s2_models.kernels import fused_triton, triton_setup

    monkeypatch.setattr(triton_setup, "_STAGES_THAT_FIT", {})
    x, w = torch.randn(3, 64), torch.randn(40, 64) / 8
    tiles = fused_triton.SkinnyTiles(16, 32, 3)
    expected = (fused_triton.linear_group_fwd(x, [w, w], tiles=tiles),
                fused_triton.linear_swiglu_fwd(x, w, w.flip(0), tiles=tiles))
    for name in ("_linear_group_kernel", "_linear_swiglu_kernel"):
        monkeypatch.setattr(fused_triton, name, _RefusesDeepPipelines(getattr(fused_triton, name), 2, "STAGES"))
    outs = fused_triton.linear_group_fwd(x, [w, w], tiles=tiles)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected[0]))
    assert torch.equal(fused_triton.linear_swiglu_fwd(x, w, w.flip(0), tiles=tiles), expected[1])
    assert fused_triton._linear_group_kernel.depths == [3, 2] and fused_triton._linear_swiglu_kernel.depths == [3, 2]


@pytest.mark.gpu
def test_dependent_launches_read_what_the_kernel_before_wrote(monkeypatch):
    """With programmatic dependent launch (Hopper and later) the append and decode kernels may start before the
    kernel ahead of them has finished, and must still read its writes. A CUDA graph of decode steps (the new
    token's K/V appended and the row lengths advanced in one launch, attention with 4 splits) whose new keys and
    values are large, each step against the PyTorch path, and PDL off gives the same bits. A wait left out would be
    a race this test need not catch (with it deleted from both kernels the test still passed on an H100):
    dependent_launch.py's rule keeps it."""
    pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
    b, hkv, group, d, t, steps = 8, 8, 4, 128, 4096, 8
    layout = CompactLayout(pattern, hkv * group, hkv, ring_blocks_for(pattern, 1))
    seq_lens0 = torch.full((b,), t)
    k, v = (torch.randn(b, hkv, t, d, dtype=torch.float16) for _ in range(2))
    room = layout.num_vertical_slots(t + steps) - layout.num_vertical_slots(t)
    caches0 = [allocated_ahead(compact_cache(x, seq_lens0, layout)[0], layout, layout.num_ring_slots(t), room).cuda()
               for x in (k, v)]
    num_ring = layout.ring_blocks
    q = torch.randn(steps, b, hkv * group, 1, d, dtype=torch.float16, device="cuda")
    new_k, new_v = (8 * torch.randn(steps, b, hkv, 1, d, dtype=torch.float16, device="cuda") for _ in range(2))

    def fresh_state():  # caches, row lengths, split counters
        return *(c.clone() for c in caches0), seq_lens0.cuda(), torch.zeros(b * hkv, dtype=torch.int32, device="cuda")

    def run(state, backend):
        kc, vc, seq_lens, counters = state
        outs = []
        for i in range(steps):  # the static cache's step: the append advances the lengths in its launch
            s2_cache_append(kc, vc, new_k[i], new_v[i], seq_lens, layout, num_ring_slots=num_ring,
                            advance_lengths=True, backend=backend)
            outs.append(s2_decode_attention(q[i], kc, vc, seq_lens, layout, num_ring_slots=num_ring, backend=backend,
                                            num_splits=4, split_counters=counters))
        return torch.stack(outs)

    def graphed():
        run(fresh_state(), "triton")  # compiles
        state, graph = fresh_state(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # (capturing runs nothing: the state stays fresh)
            outs = run(state, "triton")
        graph.replay()
        return outs.clone()

    monkeypatch.delenv("S2_ATTENTION_PDL", raising=False)
    assert dependent_launch.programmatic_launch(q.device) == (torch.cuda.get_device_capability()[0] >= 9)
    expected = run(fresh_state(), "torch")
    with_pdl = graphed()
    torch.testing.assert_close(with_pdl.float(), expected.float(), atol=2e-2, rtol=2e-2)
    monkeypatch.setenv("S2_ATTENTION_PDL", "0")
    assert torch.equal(graphed(), with_pdl)


def test_programmatic_launch_only_on_hopper_gpus(monkeypatch):
    """PDL needs compute capability 9.0; never in the interpreter or on the CPU; S2_ATTENTION_PDL=0 turns it off."""
    monkeypatch.setattr(dependent_launch, "_capable", lambda index: index == 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("S2_ATTENTION_PDL", raising=False)
    assert dependent_launch.programmatic_launch(torch.device("cuda", 0))
    assert not dependent_launch.programmatic_launch(torch.device("cuda", 1))
    assert not dependent_launch.programmatic_launch(torch.device("cpu"))
    monkeypatch.setenv("S2_ATTENTION_PDL", "0")
    assert not dependent_launch.programmatic_launch(torch.device("cuda", 0))
    monkeypatch.delenv("S2_ATTENTION_PDL")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dependent_launch.programmatic_launch(torch.device("cuda", 0))


class _Compiled:
    """Stands in for Triton's ``CompiledKernel``: what a launch reads its shared memory from, and what it uses."""

    def __init__(self, shared: int):
        self.metadata = SimpleNamespace(shared=shared)
        self.packed_metadata = (4, 1, shared)


def test_reserving_shared_memory_raises_a_launch_and_never_lowers_it():
    """``reserve_shared_memory``: launches of a kernel using over 48 KB (which Triton opted in to all of an SM's
    shared memory) ask for the reservation; one using less cannot (a launch may not ask beyond what it was loaded
    with) and says so; a kernel already asking for more keeps its own; launch metadata packed otherwise (another
    Triton) is left alone."""
    from s2_models.kernels.triton_setup import reserve_shared_memory

    large, small, deep = _Compiled(65536), _Compiled(32768), _Compiled(200_000)
    assert reserve_shared_memory(large, 116_737) and large.packed_metadata == (4, 1, 116_737)
    assert large.metadata.shared == 65536
    assert not reserve_shared_memory(small, 116_737) and small.packed_metadata == (4, 1, 32768)
    assert reserve_shared_memory(deep, 116_737) and deep.packed_metadata == (4, 1, 200_000)
    other = _Compiled(65536)
    other.packed_metadata = (4, 1, 65536, 0)
    assert not reserve_shared_memory(other, 116_737) and other.packed_metadata == (4, 1, 65536, 0)


@pytest.mark.gpu
def test_decode_launches_of_one_program_an_sm_reserve_over_half_its_shared_memory(monkeypatch):
    """A decode launch whose programs fit one to an SM asks for more than half an SM's shared memory, so that a
    kernel launched behind it with PDL cannot make the hardware place two on one SM (bench/NOTES.md, fifty-seventh
    session); a launch of more programs than SMs, of the same shapes but its batch (so the same specialisation),
    runs a compiled variant of its own, unreserved. Both give the PyTorch path's outputs."""
    launched, reserved = [], []  # the compiled kernels launched; (compiled kernel, bytes) reserved
    launch_within_shared_memory = decode_triton.launch_within_shared_memory
    reserve = decode_triton.reserve_shared_memory

    def record_launch(*args, **kwargs):
        launched.append(launch_within_shared_memory(*args, **kwargs))
        return launched[-1]

    def record_reservation(compiled, nbytes):
        reserved.append((compiled, nbytes))
        return reserve(compiled, nbytes)

    monkeypatch.setattr(decode_triton, "launch_within_shared_memory", record_launch)
    monkeypatch.setattr(decode_triton, "reserve_shared_memory", record_reservation)
    properties = torch.cuda.get_device_properties(0)
    _check_triton_on_gpu(torch.bfloat16, 1, 64, hkv=8, t=700, seq_lens=[700, 500], tolerance=2e-2)
    assert len(reserved) == 1 and reserved[0][0] is launched[-1]
    compiled, nbytes = reserved[0]
    assert 2 * nbytes > properties.shared_memory_per_multiprocessor
    assert compiled.packed_metadata[2] == nbytes > compiled.metadata.shared > 48 * 1024
    # one more row than SMs / 8 KV heads: more programs than SMs, whatever the split count
    rows = properties.multi_processor_count // 8 + 1
    _check_triton_on_gpu(torch.bfloat16, 1, 64, hkv=8, t=700, seq_lens=[700] * rows, tolerance=2e-2)
    assert len(reserved) == 1 and launched[-1] is not compiled
    assert launched[-1].packed_metadata[2] == launched[-1].metadata.shared


@pytest.mark.gpu
def test_decode_launch_left_to_the_launcher_takes_the_measured_pipeline_depth(monkeypatch):
    """Without ``tiles`` the launcher picks the stages by ``_default_num_stages`` (on an H200, four at 8 rows x 8 KV
    heads x 2 splits: 128 programs, one an SM over more than half the SMs), and the outputs stay PyTorch's."""
    stages = []
    launch_within_shared_memory = decode_triton.launch_within_shared_memory

    def record_launch(launch, num_stages, **kwargs):
        stages.append(num_stages)
        return launch_within_shared_memory(launch, num_stages, **kwargs)

    monkeypatch.setattr(decode_triton, "launch_within_shared_memory", record_launch)
    _check_triton_on_gpu(torch.bfloat16, 1, 64, hkv=8, t=6000, seq_lens=[6000] * 8, tolerance=2e-2)
    properties = torch.cuda.get_device_properties(0)
    assert stages == [decode_triton._default_num_stages(128, properties.multi_processor_count, properties.name)]
    if "H200" in properties.name.split():
        assert stages == [4]


def test_pipeline_depth_follows_the_launch_only_where_it_was_measured():
    """Four stages on an H200 where the programs run one an SM over more than half of its 132 SMs; three at batch 1's
    64 programs, beyond one an SM, and on GPUs where four were not measured faster (an H100; a GH200 is not an H200)."""
    h200 = "NVIDIA H200"
    assert decode_triton._default_num_stages(128, 132, h200) == 4  # batch 8 x 8 KV heads x 2 splits
    assert decode_triton._default_num_stages(67, 132, h200) == 4
    assert decode_triton._default_num_stages(66, 132, h200) == 3  # half the SMs
    assert decode_triton._default_num_stages(64, 132, h200) == 3  # batch 1 x 8 KV heads x 8 splits
    assert decode_triton._default_num_stages(133, 132, h200) == 3  # two an SM somewhere
    assert decode_triton._default_num_stages(128, 132, "NVIDIA H100 80GB HBM3") == 3
    assert decode_triton._default_num_stages(128, 132, "NVIDIA GH200 480GB") == 3
    assert decode_triton._default_num_stages(128, 132, "NVIDIA H200 NVL") == 4


def test_split_count_aims_at_one_program_per_sm(monkeypatch):
    """The H100 launches the split rule was measured at (132 SMs; programs = batch x KV heads; 128-key tiles)."""
    monkeypatch.setattr(decode_triton, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert decode_triton._choose_num_splits(64, 24, cuda) == 2  # batch 8, 32k: one program an SM
    assert decode_triton._choose_num_splits(256, 24, cuda) == 1  # batch 32 fills the GPU unsplit
    assert decode_triton._choose_num_splits(8, 24, cuda) == 6  # batch 1, 32k: >= 4 tiles a split
    assert decode_triton._choose_num_splits(8, 72, cuda) == 8  # batch 1, 128k: at most 8 splits to merge
    assert decode_triton._choose_num_splits(8, 72, torch.device("cpu")) == 1


def test_bad_input():
    pattern = PATTERNS[0]
    q, kc, vc, seq_lens, layout, num_ring, _ = case(pattern, torch.float32, 1, [50, 40])
    with pytest.raises(ValueError, match="num_ring_slots"):
        s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=99)
    with pytest.raises(ValueError, match="seq_lens"):
        s2_decode_attention(q, kc, vc, seq_lens[:1], layout, num_ring_slots=num_ring)
    with pytest.raises(ValueError, match="heads"):
        s2_decode_attention(q[:, :2], kc, vc, seq_lens, layout, num_ring_slots=num_ring)
    with pytest.raises(ValueError, match="backend"):
        s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=num_ring, backend="cuda")
    with pytest.raises(ValueError, match="split_counters"):
        s2_decode_attention(q, kc, vc, seq_lens, layout, num_ring_slots=num_ring, split_counters=torch.zeros(4))
    with pytest.raises(ValueError, match="ring_blocks"):
        CompactLayout(pattern, 4, 2, ring_blocks=1)
    with pytest.raises(ValueError, match="advance_lengths must be a bool"):
        s2_cache_append(kc, vc, kc[:, :, :1], vc[:, :, :1], seq_lens, layout, num_ring_slots=num_ring,
                        advance_lengths=1)
    for block_n, num_warps in ((32, 4), (128, 8)):  # 4 and 8 keys in each of a warp's two key groups
        with pytest.raises(ValueError, match=r"tiles.block_n must give each key group >= 16 keys"):
            decode_triton.decode_attention_triton(q, kc, vc, seq_lens, layout, num_ring, 1.0, None,
                                                  tiles=decode_triton.DecodeTiles(block_n, num_warps, 1))


@pytest.mark.parametrize("tq", [1, 5, 70])
@pytest.mark.parametrize("pattern", [PATTERNS[0], S2Pattern(block_size=16, local_blocks=1, vert_stride=3,
                                                             per_query_head=True)], ids=repr)
def test_triton_append_writes_what_the_torch_path_writes(pattern, tq):
    """New tokens land in the slots ``block_slots`` names; padding positions (row still empty) are skipped. With
    ``advance_lengths`` (lengths before the tokens, every token real) the same slots are written and each row's
    length grows by ``tq``, whether one program (Triton) or a separate add (PyTorch) does it."""
    device = DEVICE
    layout = CompactLayout(pattern, 4, 2, ring_blocks_for(pattern, tq))
    seq_lens = torch.tensor([200, tq - 3, 131], device=device)  # row 1: three leading padding tokens
    num_ring = layout.num_ring_slots(200)
    slots = num_ring + layout.num_vertical_slots(200)
    caches = [torch.randn(3, 2, slots * pattern.block_size, 48, device=device) for _ in range(2)]
    key, value = (torch.randn(3, 2, tq, 48, device=device) for _ in range(2))
    lengths_before = torch.tensor([200 - tq, 0, 131 - tq], device=device)  # row 1 empty: its tokens at 0..tq-1
    written = {}
    for backend in ("torch", "triton"):
        k_cache, v_cache = (c.clone() for c in caches)
        s2_cache_append(k_cache, v_cache, key, value, seq_lens, layout, num_ring_slots=num_ring, backend=backend)
        written[backend] = (k_cache, v_cache)
        k_cache, v_cache, lengths = (c.clone() for c in (*caches, lengths_before))
        s2_cache_append(k_cache, v_cache, key, value, lengths, layout, num_ring_slots=num_ring, advance_lengths=True,
                        backend=backend)
        written[backend, "advanced"] = (k_cache, v_cache, lengths)
    for written_by_torch, written_by_triton in ((written["torch"], written["triton"]),
                                                (written["torch", "advanced"], written["triton", "advanced"])):
        for expected, got in zip(written_by_torch, written_by_triton):
            assert torch.equal(expected, got)
    assert not torch.equal(written["torch"][0], caches[0])
    assert torch.equal(written["torch", "advanced"][2], lengths_before + tq)
    # Rows 0 and 2 hold no padding: the same slots with either convention for the lengths.
    for both in zip(written["torch"], written["torch", "advanced"]):
        assert torch.equal(both[0][[0, 2]], both[1][[0, 2]])
    assert not torch.equal(written["torch", "advanced"][0][1], caches[0][1])  # the empty row's tokens are written
