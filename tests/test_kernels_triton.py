"""Triton S2-Attention kernels vs the float64 reference (forward, lse, and gradients of q, k, v).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (fp16/fp32 only: the interpreter's bf16 dot is
wrong); bf16 and large shapes run in the ``gpu``-marked tests.

Tolerance (as FlashAttention's tests): the kernel's error against float64 must be at most 2x (3x for gradients) the
error of the same computation done by PyTorch in the input dtype, plus a tiny absolute floor.
"""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import pytest  # noqa: E402

from s2_models.kernels import S2Pattern, s2_attention, triton_impl, triton_setup  # noqa: E402
from s2_models.kernels.layouts import BlockLayout  # noqa: E402
from s2_models.kernels.naive import naive_s2_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ABS_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}


@pytest.fixture(autouse=True)
def no_autotuning(monkeypatch):
    """Timing tile candidates for every test shape would dominate the GPU tests: use the default tiles."""
    monkeypatch.setenv("S2_ATTENTION_AUTOTUNE", "0")


def _make_inputs(seed, batch, q_heads, kv_heads, q_len, k_len, head_dim, dtype, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, k_len, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, k_len, head_dim, generator=gen)
    grad_out = torch.randn(batch, q_heads, q_len, head_dim, generator=gen)
    grad_lse = torch.randn(batch, q_heads, q_len, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, grad_out)] + [grad_lse.to(device)]


def _forward_backward(fn, q, k, v, grad_out, grad_lse, cast):
    """Run ``fn(q, k, v) -> (out, lse)`` on leaf copies cast by ``cast``; return out, lse, dq, dk, dv."""
    leaves = [cast(t).detach().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    seen = torch.isfinite(lse)
    loss = (out * cast(grad_out)).sum() + (torch.where(seen, lse, 0.0) * grad_lse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out.detach(), lse.detach(), *grads


def _assert_close(name, kernel, reference, low_precision, factor, floor):
    kernel, reference, low_precision = (t.double() for t in (kernel, reference, low_precision))
    if name == "lse":  # rows that see no key: -inf in all three
        assert torch.equal(torch.isinf(kernel), torch.isinf(reference)), "lse: -inf rows differ"
        finite = ~torch.isinf(reference)
        kernel, reference, low_precision = (torch.where(finite, t, 0.0) for t in (kernel, reference, low_precision))
    assert not torch.isnan(kernel).any(), f"{name}: NaN"
    error = (kernel - reference).abs().max().item()
    baseline = (low_precision - reference).abs().max().item()
    message = f"{name}: error {error:.3g} > {factor} x torch error {baseline:.3g} + {floor}"
    assert error <= factor * baseline + floor, message


def check_against_reference(seed, shape, dtype, pattern=None, causal=True, memory="bhtd", key_gain=None, **kwargs):
    """Compare the Triton backend with naive fp64 and naive in ``dtype`` (outputs, lse and all gradients).

    ``memory="bthd"``: q, k, v and the output gradient stored as the model's projections ``[B, T, H, D]`` and seen
    as ``[B, H, T, D]`` through a transpose. ``key_gain`` (``[Tk]``) multiplies each key position's K."""
    q, k, v, grad_out, grad_lse = _make_inputs(seed, *shape, dtype)
    if key_gain is not None:
        k = (k.float() * key_gain.to(k.device)[:, None]).to(dtype)
    if memory == "bthd":
        q, k, v, grad_out = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, grad_out))
    reference_device = DEVICE if dtype != torch.float16 or DEVICE == "cuda" else "cpu"

    def triton_fn(q_, k_, v_):
        return s2_attention(q_, k_, v_, pattern, causal=causal, backend="triton", return_lse=True, **kwargs)

    def naive_fn(precision):
        ref_kwargs = {key: (val.to(reference_device) if torch.is_tensor(val) else val) for key, val in kwargs.items()}
        return lambda q_, k_, v_: naive_s2_attention(q_, k_, v_, pattern, causal=causal, dtype=precision, **ref_kwargs)

    results = _forward_backward(triton_fn, q, k, v, grad_out, grad_lse, lambda t: t)
    exact = _forward_backward(naive_fn(torch.float64), q, k, v, grad_out, grad_lse, lambda t: t.to(reference_device))
    low = _forward_backward(naive_fn(dtype), q, k, v, grad_out, grad_lse, lambda t: t.to(reference_device))
    assert results[0].dtype == dtype and results[1].dtype == torch.float32
    for name, kernel, ref, lowp in zip(("out", "lse", "dq", "dk", "dv"), results, exact, low):
        factor = 2 if name in ("out", "lse") else 3
        _assert_close(name, kernel.cpu(), ref.cpu(), lowp.cpu(), factor, ABS_FLOOR[dtype])
    return results


# ---------------------------------------------------------------------------------------------- interpreter-sized
SMALL_CASES = [
    # (batch, Hq, Hkv, Tq, Tk, D), pattern fields, causal
    ((1, 2, 2, 1, 1, 16), dict(block_size=16, local_blocks=1, vert_stride=2), True),
    ((2, 2, 1, 17, 17, 32), dict(block_size=16, local_blocks=2, vert_stride=3), True),
    ((1, 4, 2, 127, 127, 64), dict(block_size=32, local_blocks=1, vert_stride=2), True),
    ((1, 4, 1, 200, 200, 32), dict(block_size=16, local_blocks=2, vert_stride=4, num_dense_heads=0), True),
    ((1, 4, 4, 200, 200, 16), dict(block_size=64, local_blocks=1, vert_stride=2, homo_head=True), True),
    ((1, 2, 2, 260, 260, 32), dict(block_size=128, local_blocks=1, vert_stride=2), True),
    ((1, 4, 2, 33, 200, 32), dict(block_size=16, local_blocks=2, vert_stride=3, head_sliding_offset=0), True),
    ((2, 4, 1, 1, 130, 64), dict(block_size=32, local_blocks=1, vert_stride=2, num_dense_heads=1), True),
    ((1, 4, 2, 150, 150, 32), dict(block_size=16, local_blocks=2, vert_stride=4, per_query_head=True), True),
    ((1, 2, 1, 200, 200, 32), dict(block_size=32, local_blocks=1, vert_stride=3), False),
    ((1, 2, 2, 90, 170, 16), dict(block_size=16, local_blocks=2, vert_stride=4, num_dense_heads=1), False),
    ((1, 2, 2, 200, 200, 80), dict(block_size=64, local_blocks=1, vert_stride=2), True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", range(len(SMALL_CASES)))
def test_matches_reference(case, dtype):
    shape, fields, causal = SMALL_CASES[case]
    check_against_reference(100 + case, shape, dtype, S2Pattern(**fields), causal=causal)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
    ids=["fp32", "fp16", "bf16"],
)
def test_running_maximum_moves_late(dtype):
    """K's gain steps from 1 to 3 at position 100 and to 8 at 200: a late row's score maximum climbs by ~7 and then
    ~19 log2 units as the forward walks its keys, so the online softmax must rescale what it has summed (fp16
    probabilities overflow if the second rescale is skipped; a lazy rescale with a threshold of 8 passes)."""
    gain = torch.ones(300, dtype=torch.float64)
    gain[100:], gain[200:] = 3.0, 8.0
    pattern = S2Pattern(block_size=16, local_blocks=3, vert_stride=3)
    check_against_reference(16, (1, 4, 2, 300, 300, 32), dtype, pattern, key_gain=gain)


@pytest.mark.parametrize(
    "fwd, dq, dkdv",
    [((32, 16), (16, 32), (16, 32)), ((16, 64), (32, 64), (64, 16)), ((128, 32), (64, 16), (32, 64))],
    ids=["small", "wide-kv", "merged-q"],
)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_tile_shapes(monkeypatch, fwd, dq, dkdv, block_size):
    """Kernel tiles smaller than, equal to and larger than the sparse block (gather and Merge-Q paths)."""
    configs = {kind: triton_impl.TileConfig(*tiles, 4, 1) for kind, tiles in (("fwd", fwd), ("dq", dq), ("dkdv", dkdv))}
    monkeypatch.setattr(triton_impl, "INTERPRETER_CONFIGS", configs)
    monkeypatch.setattr(triton_impl, "_interpreting", lambda device: True)
    pattern = S2Pattern(block_size=block_size, local_blocks=2, vert_stride=3, head_sliding_step=1)
    check_against_reference(7 * block_size, (1, 4, 2, 150, 180, 32), torch.float32, pattern)


def test_dkdv_lists_leave_out_the_blocks_before_the_first_query(monkeypatch):
    """Tq < Tk: the dk/dv lists hold no query block before the first query's (no query sits there; walked masked,
    they were 5-5.5x the lists' entries at 4096 of 32768 keys), and the gradients stay the reference's."""
    built = []

    def spy(mask, *args):
        built.append((mask, args[-1]))  # args[-1]: resident_is_query
        return build_unit_lists(mask, *args)

    build_unit_lists = triton_impl.build_unit_lists
    monkeypatch.setattr(triton_impl, "build_unit_lists", spy)
    monkeypatch.setattr(triton_impl, "_UNIT_LIST_CACHE", type(triton_impl._UNIT_LIST_CACHE)())
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    # 163 keys before the first query: its block (10) holds queries from its fourth row on, so it must stay
    check_against_reference(5, (1, 4, 2, 37, 200, 32), torch.float32, pattern)
    first_block = (200 - 37) // 16
    dkdv_masks = [mask for mask, resident_is_query in built if not resident_is_query]
    assert dkdv_masks and all(not m[:, :first_block].any() and m[:, first_block:].any() for m in dkdv_masks)
    assert all(m[:, :first_block].any() for m, resident_is_query in built if resident_is_query)


def test_varlen_with_empty_sequence():
    lens_q, lens_k = [5, 0, 70, 33], [40, 0, 70, 100]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    shape = (1, 4, 2, sum(lens_q), sum(lens_k), 32)
    for causal in (True, False):
        check_against_reference(11, shape, torch.float16, pattern, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask(side):
    lengths = torch.tensor([50, 97, 3])
    positions = torch.arange(97)
    real = positions[None] < lengths[:, None] if side == "right" else positions[None] >= 97 - lengths[:, None]
    pattern = S2Pattern(block_size=32, local_blocks=1, vert_stride=2)
    out = check_against_reference(12, (3, 2, 1, 40, 97, 16), torch.float32, pattern, attention_mask=real.to(DEVICE))[0]
    q_real = real[:, -40:].to(out.device)
    assert torch.all(out[~q_real[:, None, :, None].expand_as(out)] == 0), "padded query rows must be 0"


def test_user_block_mask_with_empty_rows():
    """A user mask (never cached) where some query blocks keep nothing: lse = -inf, out = 0, no NaN gradients."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 7, 7, generator=gen) < 0.4
    mask[0, 2] = False
    mask[1, :, 0] = True
    mask[1, 5] = False
    out, lse = check_against_reference(13, (1, 4, 2, 100, 100, 32), torch.float32, block_mask=mask.to(DEVICE),
                                       block_size=16, causal=False)[:2]
    assert torch.all(lse[0, :2, 32:48] == -math.inf) and torch.all(out[0, :2, 32:48] == 0)


def test_strided_inputs():
    """[B, T, H, D] memory viewed as [B, H, T, D], and a sliced head dim: no copies, same results."""
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    gen = torch.Generator().manual_seed(14)
    qkv = torch.randn(1, 120, 8, 48, generator=gen).to(DEVICE)  # [B, T, H, D + 16]
    q = qkv[:, :, :4, :32].transpose(1, 2)
    k = qkv[:, :, 4:6, 16:48].transpose(1, 2)
    v = qkv[:, :, 6:, :32].transpose(1, 2)
    out, lse = s2_attention(q, k, v, pattern, backend="triton", return_lse=True)
    ref_out, ref_lse = s2_attention(q.contiguous(), k.contiguous(), v.contiguous(), pattern, backend="triton",
                                    return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_outputs_and_gradients_are_stored_heads_last(backend):
    """out, dq, dk and dv are stored [B, T, H, D]: a model reads the output back through ``.transpose(1, 2)`` and
    its projections take the gradients through the same views, with no copy (the Triton launchers allocate them so;
    the op lays out the PyTorch path's results the same way, as its fake implementation promises torch.compile)."""
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    q, k, v = (torch.randn(2, 40, h, 16, device=DEVICE).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    out = s2_attention(q, k, v, pattern, backend=backend)
    assert out.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(grad.transpose(1, 2).is_contiguous() for grad in grads)
    model_view = out.transpose(1, 2)
    assert model_view.contiguous().data_ptr() == model_view.data_ptr(), "the model's read-back copies"


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("block_size", [64, 128])
def test_tma_loads_equal_pointer_loads(monkeypatch, layout, block_size):
    """Tiles that are one contiguous unit load through TMA descriptors in all three kernels, for [B, H, T, D] memory
    and for the [B, T, H, D] projection output behind a transpose (K and V slices of one tensor, GQA): outputs and
    gradients equal the per-row pointer loads', which the reference tests check."""
    gen = torch.Generator().manual_seed(block_size)
    batch, seqlen, q_heads, kv_heads, head_dim = 2, 2 * block_size + 37, 4, 2, 32
    if layout == "bhtd":
        q, k, v = (torch.randn(batch, h, seqlen, head_dim, generator=gen) for h in (q_heads, kv_heads, kv_heads))
    else:
        q = torch.randn(batch, seqlen, q_heads, head_dim, generator=gen).transpose(1, 2)
        kv = torch.randn(batch, seqlen, 2 * kv_heads, head_dim, generator=gen).transpose(1, 2)
        k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    grad_out = torch.randn(batch, q_heads, seqlen, head_dim, generator=gen).to(DEVICE)
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    pattern = S2Pattern(block_size=block_size, local_blocks=1, vert_stride=2)
    used = []  # per launch: whether it got descriptors
    row_descriptors = triton_impl._row_descriptors

    def spy(*args):
        descriptors = row_descriptors(*args)
        used.append(descriptors[0] is not None)
        return descriptors

    monkeypatch.setattr(triton_impl, "_row_descriptors", spy)

    def run(use_tma):
        monkeypatch.setattr(triton_impl, "_USE_TMA", use_tma)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = s2_attention(*leaves, pattern, backend="triton")
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]

    with_tma = run(True)
    assert used == [True, True, True], "forward, dq and dk/dv should all use TMA here"
    for name, a, b in zip(("out", "dq", "dk", "dv"), with_tma, run(False)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), name


def test_excluded_blocks_are_never_read():
    """Perturbing K/V inside blocks a query block excludes leaves that block's output rows bit-for-bit unchanged,
    while rows that do read the perturbed block change."""
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=4)
    q, k, v, _, _ = _make_inputs(15, 1, 2, 2, 160, 160, 32, torch.float32)
    block_mask = pattern.block_mask(2, 10, 10)  # [P, M, N]
    perturbed_block = 5
    k2, v2 = k.clone(), v.clone()
    k2[:, :, perturbed_block * 16 : (perturbed_block + 1) * 16] += 3.0
    v2[:, :, perturbed_block * 16 : (perturbed_block + 1) * 16] -= 5.0
    out = s2_attention(q, k, v, pattern, backend="triton")
    out2 = s2_attention(q, k2, v2, pattern, backend="triton")
    for head in range(2):
        excluded = (~block_mask[head, :, perturbed_block]).repeat_interleave(16)
        assert excluded.any() and (~excluded).any()
        assert torch.equal(out[0, head, excluded.to(out.device)], out2[0, head, excluded.to(out.device)])
        assert not torch.equal(out[0, head, ~excluded.to(out.device)], out2[0, head, ~excluded.to(out.device)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group_split", [2, 4])
def test_dkdv_group_split_matches_reference(monkeypatch, group_split, dtype):
    """dK/dV with a GQA group's query heads shared out among programs (float32 partial sums, added by the launcher):
    odd length, varied patterns per KV head, a group of 4."""
    config = triton_impl.INTERPRETER_CONFIGS["dkdv"]
    split_config = triton_impl.TileConfig(config.block_m, config.block_n, config.num_warps, config.num_stages,
                                          group_split=group_split)
    monkeypatch.setitem(triton_impl.INTERPRETER_CONFIGS, "dkdv", split_config)
    if DEVICE == "cuda":
        monkeypatch.setitem(triton_impl._CANDIDATES, ("dkdv", "small"), [split_config])
        monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", {})
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
    check_against_reference(150 + group_split, (2, 8, 2, 151, 151, 32), dtype, pattern)


def test_the_launchers_power_of_two_is_tritons():
    """The launchers' plain-Python ``next_power_of_2`` (tune keys, block sizes, the TMA check) equals Triton's."""
    for n in range(1, 1100):
        assert triton_setup.next_power_of_2(n) == triton_setup.triton.next_power_of_2(n), n


@pytest.mark.parametrize("resident_is_query", [True, False], ids=["query-tiles", "key-tiles"])
def test_unit_lists_cover_exactly_the_kept_units(resident_is_query):
    """Full entries are kept by every block of the tile and need no causal mask; full + partial = the kept set. The
    full entries run ascending for query tiles, descending for key tiles (dk/dv walks from the sequence's end)."""
    pattern = S2Pattern(block_size=16, local_blocks=3, vert_stride=5)
    mask = pattern.block_mask(3, 20, 20)
    units, _, counts = triton_impl.build_unit_lists(mask, 16, True, tile=64, unit=16, group=2,
                                                    resident_is_query=resident_is_query)
    resident_mask = mask if resident_is_query else mask.transpose(1, 2)
    for head in range(3):
        for tile in range(units.shape[1]):
            num_full, num_total = counts[head, tile].tolist()
            assert num_full % 2 == 0
            listed = units[head, tile, :num_total].tolist()
            rows = resident_mask[head, tile * 4 : tile * 4 + 4]
            assert sorted(listed) == rows.any(0).nonzero().flatten().tolist()
            for unit in listed[:num_full]:
                assert rows[:, unit].all()
                assert unit < tile * 4 if resident_is_query else unit >= tile * 4 + 4
            full = listed[:num_full]
            assert full == sorted(full, reverse=not resident_is_query)


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_split_first_step_gives_each_half_of_a_tile_its_own_entries(block_size):
    """The warp-specialized forward's lists: a split step (half of its entries kept only by the first consumer's
    blocks, half only by the second's) first where a tile has them, then every other entry in its order; nothing
    lost or repeated. Tiles of one block (block 128) have none."""
    pattern = S2Pattern(block_size=block_size, local_blocks=5, vert_stride=3)
    blocks = 3000 // block_size
    unit = block_size  # keys per entry: min(block_size, the forward's 128-key steps)
    group, blocks_per_tile = 128 // unit, 128 // block_size
    lists = triton_impl.build_unit_lists(pattern.block_mask(4, blocks, blocks), block_size, True, tile=128, unit=unit,
                                         group=group, resident_is_query=True)
    units, bits, counts = triton_impl.split_first_step(*lists, group, blocks_per_tile)
    first_half = (1 << (blocks_per_tile // 2)) - 1
    half = group // 2
    for head in range(4):
        for tile in range(units.shape[1]):
            old_full, old_total = lists[2][head, tile].tolist()
            num_full, num_regular, split = counts[head, tile].tolist()
            old = list(zip(lists[0][head, tile, :old_total].tolist(), lists[1][head, tile, :old_total].tolist()))
            new = list(zip(units[head, tile, :num_regular + group * split].tolist(),
                           bits[head, tile, :num_regular + group * split].tolist()))
            assert sorted(new) == sorted(old) and num_full == old_full
            head_entries, regular = new[:group * split], new[group * split:]
            assert regular == [entry for entry in old if entry not in head_entries]  # the others keep their order
            if split:
                assert num_regular >= 1
                assert all(entry_bits & ~first_half == 0 for _, entry_bits in head_entries[:half])
                assert all(entry_bits & first_half == 0 for _, entry_bits in head_entries[half:])
    if blocks_per_tile < 2:
        assert not counts[..., 2].any()
    else:
        assert counts[..., 2].any()


# ---------------------------------------------------------------------------------------------- GPU
GPU_CASES = [
    # (batch, Hq, Hkv, Tq, Tk, D), block_size
    ((1, 4, 2, 1000, 1000, 64), 16),
    ((2, 4, 4, 2048, 2048, 128), 64),
    ((1, 8, 2, 1500, 4096, 128), 32),
    ((1, 2, 1, 4096, 4096, 256), 128),
    ((1, 4, 4, 3000, 3000, 96), 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_matches_reference(case, dtype):
    shape, block_size = GPU_CASES[case]
    pattern = S2Pattern(block_size=block_size, local_blocks=4, vert_stride=4)
    check_against_reference(200 + case, shape, dtype, pattern)


# Packed sequences of the GPU varlen tests: an empty one, a one-token one, ends inside tiles and query units.
PACKED_LENGTHS = [1000, 0, 1, 2047, 700]


def _packed_cu_seqlens() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.mark.gpu
def test_gpu_varlen_bf16():
    cu = _packed_cu_seqlens()
    pattern = S2Pattern(block_size=32, local_blocks=4, vert_stride=8)
    check_against_reference(300, (1, 8, 2, sum(PACKED_LENGTHS), sum(PACKED_LENGTHS), 128), torch.bfloat16, pattern,
                            cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    pattern = S2Pattern(block_size=16, local_blocks=8, vert_stride=8)
    q, k, v, grad_out, grad_lse = _make_inputs(301, 2, 8, 2, 2048, 2048, 128, torch.bfloat16)

    def fn(q_, k_, v_):
        return s2_attention(q_, k_, v_, pattern, backend="triton", return_lse=True)

    first = _forward_backward(fn, q, k, v, grad_out, grad_lse, lambda t: t)
    second = _forward_backward(fn, q, k, v, grad_out, grad_lse, lambda t: t)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _gpu_candidates():
    """(kind, head-dim class, config) for every GPU tile candidate, pipelined ones included."""
    return [(kind, size, config) for (kind, size), configs in triton_impl._CANDIDATES.items() for config in configs]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,size,config", _gpu_candidates(), ids=lambda x: str(x))
def test_gpu_every_candidate_config(monkeypatch, kind, size, config):
    """Each candidate the tuner may pick (any num_stages) is exact: pipelining must not change results."""
    monkeypatch.setitem(triton_impl._CANDIDATES, (kind, size), [config])
    monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", {})
    head_dim = {"small": 64, "medium": 128, "large": 256}[size]
    if config.gluon and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for compute capability 9.0")
    block_size = 64 if config.gluon and kind == "dkdv" else 32  # (the Gluon dk/dv takes blocks >= 64)
    pattern = S2Pattern(block_size=block_size, local_blocks=3, vert_stride=4)
    check_against_reference(400, (1, 8, 2, 1111, 1111, head_dim), torch.bfloat16, pattern)  # GQA groups of 4


WARP_SPECIALIZED_CASES = [
    # (batch, Hq, Hkv, Tq, Tk, D), pattern fields, memory layout
    ((2, 4, 2, 1111, 1111, 128), dict(block_size=64, local_blocks=3, vert_stride=4), "bhtd"),
    ((1, 8, 2, 3001, 3001, 64), dict(block_size=128, local_blocks=2, vert_stride=3), "bhtd"),
    ((1, 4, 4, 700, 2100, 128), dict(block_size=64, local_blocks=2, vert_stride=5), "bhtd"),  # Tq < Tk (prefill)
    ((2, 8, 2, 1500, 1500, 128), dict(block_size=64, local_blocks=4, vert_stride=8, per_query_head=True), "bthd"),
    ((1, 4, 1, 257, 257, 64), dict(block_size=128, local_blocks=1, vert_stride=2, num_dense_heads=1), "bthd"),
    ((1, 4, 2, 2001, 2001, 128), dict(block_size=32, local_blocks=5, vert_stride=7), "bhtd"),
    ((2, 4, 2, 1777, 1777, 64), dict(block_size=64, local_blocks=3, vert_stride=5), "bhtd"),  # D=64's deep ring
    ((1, 4, 4, 900, 1900, 64), dict(block_size=32, local_blocks=4, vert_stride=6), "bthd"),
]


def test_backward_gpu_cases_cover_what_their_tests_claim():
    """The Gluon dk/dv's and the group split's GPU cases, filtered from the forward's, keep the head dims, blocks and
    GQA groups their tests' docstrings name, however the forward's cases change."""
    dkdv = {(shape[-1], fields["block_size"], shape[1] // shape[2]) for shape, fields, _ in GLUON_DKDV_CASES}
    assert {d for d, _, _ in dkdv} == {64, 128} and {b for _, b, _ in dkdv} == {64, 128}
    assert {g for _, _, g in dkdv} >= {2, 4}
    assert {fields["block_size"] for _, fields, _ in GROUP_SPLIT_CASES} == {32, 64, 128}


def test_warp_specialized_cases_run_split_steps():
    """The Gluon forward's GPU cases with blocks of 32 and 64 have tiles that start with a split step, so those tests
    check the split step's halves, not only the ordinary steps."""
    for (_, q_heads, kv_heads, _, k_len, _), fields, _ in WARP_SPECIALIZED_CASES:
        pattern = S2Pattern(**fields)
        if pattern.block_size > 64:
            continue
        blocks = -(-k_len // pattern.block_size)
        mask = pattern.block_mask(pattern.num_pattern_heads(q_heads, kv_heads), blocks, blocks)
        layout = BlockLayout(mask, pattern.block_size, True, None)
        _, _, counts = triton_impl._unit_lists(layout, 128, 128, resident_is_query=True, split_first=True)
        assert counts[..., 2].any(), fields


@pytest.mark.parametrize(("q_len", "k_len"), [(1, 1), (127, 128), (128, 128), (129, 300), (1000, 1000), (5, 4097)])
def test_warp_specialized_item_args_match_the_query_tiles(q_len, k_len):
    """The Gluon kernels' work item of tile rank ``r`` runs query tile ``last_tile - r`` (``hopper_fwd.item_args``,
    without varlen): over the launch's ``num_q_tiles`` ranks, from the tile of the last query row down to that of row
    0, as the kernels computed them before the launch passed them (bench/NOTES.md, thirty-fifth session)."""
    from s2_models.kernels import hopper_fwd

    q, k = torch.empty(1, 2, q_len, 64), torch.empty(1, 2, k_len, 64)
    pattern = S2Pattern(block_size=64, local_blocks=2, vert_stride=2)
    blocks = -(-k_len // 64)
    layout = BlockLayout(pattern.block_mask(pattern.num_pattern_heads(2, 2), blocks, blocks), 64, True, None)
    num_q_tiles = triton_impl._problem(q, k, layout, None).num_q_tiles(hopper_fwd.BLOCK_M)
    first_pos, seqlen_k, last_tile = hopper_fwd.item_args(q, k)
    assert (first_pos, seqlen_k) == (k_len - q_len, k_len)
    assert last_tile == (k_len - 1) // hopper_fwd.BLOCK_M  # the last query row's tile
    assert last_tile - (num_q_tiles - 1) == first_pos // hopper_fwd.BLOCK_M  # rank num_q_tiles - 1: row 0's tile


@pytest.mark.parametrize("layout_name", ["heads-last", "heads-first", "varlen", "one-row-padded-heads"])
def test_warp_specialized_output_origin_finds_every_row(layout_name):
    """The Gluon forward's epilogue copies a head's rows through the output's row view from ``hopper_fwd.output_origin``
    (no division in the kernel): for every batch row (packed: the batch stride zeroed, as the launch passes it), head
    and position, row ``b * rows_b + h * rows_h + t`` and column ``h * cols_h`` must be that element's offset."""
    from s2_models.kernels import hopper_fwd
    from s2_models.kernels.layouts import empty_heads_last, row_view

    batch, heads, seqlen, head_dim = 3, 4, 5, 16
    base = torch.empty(batch, heads, seqlen, head_dim)
    out = {
        "heads-last": empty_heads_last(base),  # what the forward allocates
        "heads-first": base,
        "varlen": empty_heads_last(base[:1]),
        "one-row-padded-heads": torch.empty(1, seqlen, heads, 2 * head_dim)[..., :head_dim].transpose(1, 2),
    }[layout_name]
    (_, row_stride), _ = row_view(out)
    strides = (0, *out.stride()[1:]) if layout_name == "varlen" else out.stride()
    rows_b, rows_h, cols_h = hopper_fwd.output_origin(strides)
    for b in range(out.shape[0]):
        for h in range(heads):
            for t in range(seqlen):
                offset = b * strides[0] + h * strides[1] + t * strides[2]
                assert (b * rows_b + h * rows_h + t) * row_stride + h * cols_h == offset, (b, h, t)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3], ids=["one-per-sm", "3-programs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", range(len(WARP_SPECIALIZED_CASES)))
def test_gpu_warp_specialized_forward(monkeypatch, case, dtype, programs):
    """The Gluon forward (hopper_fwd.py) against the float64 reference: odd lengths, GQA, Tq < Tk, one pattern per
    query head, dense heads, the [B, T, H, D] projection output behind a transpose, key tiles of one list entry
    (blocks >= 64) or gathered from two (block 32); it must really run. With 3 programs each one runs many work
    items in turn, so that an item's Q and K/V ring steps follow the item before it in the same program. With the
    head dim's tile (D = 64: the deep ring, with the second consumer 4 ring steps behind; D = 128: one step)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized forward is for compute capability 9.0")
    (batch, q_heads, kv_heads, q_len, k_len, head_dim), fields, memory = WARP_SPECIALIZED_CASES[case]
    size = "small" if head_dim <= 64 else "medium"
    monkeypatch.setitem(triton_impl._CANDIDATES, ("fwd", size), triton_impl._WARP_SPECIALIZED_FWD[size])
    monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", {})
    if programs is not None:
        monkeypatch.setattr(triton_impl.hopper_fwd, "_num_sms", lambda device: programs)
    launches = []
    launch = triton_impl.hopper_fwd.launch
    monkeypatch.setattr(triton_impl.hopper_fwd, "launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    pattern = S2Pattern(**fields)
    q, k, v, _, _ = _make_inputs(500 + case, batch, q_heads, kv_heads, q_len, k_len, head_dim, torch.float32, "cpu")
    if memory == "bthd":  # the model's projections: [B, T, H, D] seen as [B, H, T, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.to(DEVICE, dtype) for t in (q, k, v))
    out, lse = s2_attention(q, k, v, pattern, backend="triton", return_lse=True)
    assert launches, "the warp-specialized forward did not run"
    exact_out, exact_lse = naive_s2_attention(q, k, v, pattern, dtype=torch.float64)
    low_out, low_lse = naive_s2_attention(q, k, v, pattern, dtype=dtype)
    _assert_close("out", out, exact_out, low_out, 2, ABS_FLOOR[dtype])
    _assert_close("lse", lse, exact_lse, low_lse, 2, ABS_FLOOR[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("programs", [None, 2], ids=["one-per-sm", "2-programs"])
def test_gpu_warp_specialized_forward_varlen(monkeypatch, programs, head_dim):
    """Packed sequences (an empty one, one shorter than a tile) through the Gluon forward; with 2 programs, work items
    with no steps (past a sequence's end) sit between items that have some. Both head dims' rings."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized forward is for compute capability 9.0")
    size = "small" if head_dim <= 64 else "medium"
    monkeypatch.setitem(triton_impl._CANDIDATES, ("fwd", size), triton_impl._WARP_SPECIALIZED_FWD[size])
    monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", {})
    if programs is not None:
        monkeypatch.setattr(triton_impl.hopper_fwd, "_num_sms", lambda device: programs)
    cu = _packed_cu_seqlens()
    pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
    launches = []
    launch = triton_impl.hopper_fwd.launch
    monkeypatch.setattr(triton_impl.hopper_fwd, "launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    q, k, v, _, _ = _make_inputs(510, 1, 8, 2, sum(PACKED_LENGTHS), sum(PACKED_LENGTHS), head_dim, torch.bfloat16)
    out, lse = s2_attention(q, k, v, pattern, backend="triton", return_lse=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert launches, "the warp-specialized forward did not run"
    exact_out, exact_lse = naive_s2_attention(q, k, v, pattern, dtype=torch.float64, cu_seqlens_q=cu, cu_seqlens_k=cu)
    low_out, low_lse = naive_s2_attention(q, k, v, pattern, dtype=torch.bfloat16, cu_seqlens_q=cu, cu_seqlens_k=cu)
    _assert_close("out", out, exact_out, low_out, 2, ABS_FLOOR[torch.bfloat16])
    _assert_close("lse", lse, exact_lse, low_lse, 2, ABS_FLOOR[torch.bfloat16])


def _force_gluon_backward(monkeypatch, kind: str, head_dim: int, configs: list) -> list:
    """Make ``configs`` (Gluon kernels of hopper_bwd.py) the only ``kind`` ("dq" or "dkdv") candidates; returns the
    list their launches append to."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward kernels are for compute capability 9.0")
    size = "small" if head_dim <= 64 else "medium"
    monkeypatch.setitem(triton_impl._CANDIDATES, (kind, size), configs)
    monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", {})
    launches = []
    launch = getattr(triton_impl.hopper_bwd, f"launch_{kind}")
    monkeypatch.setattr(triton_impl.hopper_bwd, f"launch_{kind}",
                        lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    return launches


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3], ids=["one-per-sm", "3-programs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", range(len(WARP_SPECIALIZED_CASES)))
def test_gpu_gluon_dq(monkeypatch, case, dtype, programs):
    """The Gluon dq (and the statistics it stores for dk/dv) against the float64 reference, on the Gluon forward's
    cases: odd lengths, GQA, Tq < Tk, one pattern per query head, dense heads, the [B, T, H, D] projection output
    behind a transpose, D = 64 and 128, blocks 32 (two list entries a step), 64 and 128; with 3 programs each runs
    many work items in turn. It must really run."""
    shape, fields, memory = WARP_SPECIALIZED_CASES[case]
    launches = _force_gluon_backward(monkeypatch, "dq", shape[-1], triton_impl._GLUON_DQ)
    if programs is not None:
        monkeypatch.setattr(triton_impl.hopper_fwd, "_num_sms", lambda device: programs)
    check_against_reference(560 + case, shape, dtype, S2Pattern(**fields), memory=memory)
    assert launches, "the Gluon dq did not run"


@pytest.mark.gpu
def test_gpu_gluon_dq_without_lse_gradient(monkeypatch):
    """Without ``return_lse`` no lse gradient reaches the backward (the kernel's other delta)."""
    launches = _force_gluon_backward(monkeypatch, "dq", 128, triton_impl._GLUON_DQ)
    pattern = S2Pattern(block_size=64, local_blocks=3, vert_stride=4)
    q, k, v, grad_out, _ = _make_inputs(570, 2, 4, 2, 1111, 1111, 128, torch.bfloat16)
    grads = []
    for fn in (lambda *t: s2_attention(*t, pattern, backend="triton"),
               lambda *t: naive_s2_attention(*t, pattern, dtype=torch.float64)[0],
               lambda *t: naive_s2_attention(*t, pattern, dtype=torch.bfloat16)[0]):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        grads.append(torch.autograd.grad((fn(*leaves) * grad_out).sum(), leaves))
    assert launches, "the Gluon dq did not run"
    for index, name in enumerate(("dq", "dk", "dv")):
        _assert_close(name, grads[0][index], grads[1][index], grads[2][index], 3, ABS_FLOOR[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 2], ids=["one-per-sm", "2-programs"])
def test_gpu_gluon_dq_varlen(monkeypatch, programs):
    """Packed sequences (an empty one, one shorter than a tile) through the Gluon dq: a tile's rows past its
    sequence's end read the next sequence's, which must not leak into its gradients."""
    launches = _force_gluon_backward(monkeypatch, "dq", 128, triton_impl._GLUON_DQ)
    if programs is not None:
        monkeypatch.setattr(triton_impl.hopper_fwd, "_num_sms", lambda device: programs)
    cu = _packed_cu_seqlens()
    pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
    check_against_reference(571, (1, 8, 2, sum(PACKED_LENGTHS), sum(PACKED_LENGTHS), 128), torch.bfloat16, pattern,
                            cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert launches, "the Gluon dq did not run"


# The Gluon forward's cases that the Gluon dk/dv takes: queries that are the keys' tokens, blocks >= 64.
GLUON_DKDV_CASES = [
    case for case in WARP_SPECIALIZED_CASES if case[0][3] == case[0][4] and case[1]["block_size"] >= 64
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", range(len(GLUON_DKDV_CASES)))
def test_gpu_gluon_dkdv(monkeypatch, case, dtype):
    """The Gluon dk/dv against the float64 reference: odd lengths (a sequence ending inside a query unit and a key
    tile; an odd number of key tiles, so that a program's second consumer has none), GQA groups of 2 and 4 (its ring
    runs on across a group's heads), one pattern per query head, dense heads, the [B, T, H, D] projection output
    behind a transpose, D = 64 and 128, blocks 64 and 128; it must really run."""
    shape, fields, memory = GLUON_DKDV_CASES[case]
    launches = _force_gluon_backward(monkeypatch, "dkdv", shape[-1], triton_impl._GLUON_DKDV)
    check_against_reference(540 + case, shape, dtype, S2Pattern(**fields), memory=memory)
    assert launches, "the Gluon dk/dv did not run"


@pytest.mark.gpu
def test_gpu_gluon_dkdv_varlen(monkeypatch):
    """Packed sequences (an empty one, one shorter than a tile, ends inside a query unit) through the Gluon dk/dv:
    a sequence's rows past its end read the next sequence's, which must not leak into its gradients."""
    launches = _force_gluon_backward(monkeypatch, "dkdv", 128, triton_impl._GLUON_DKDV)
    cu = _packed_cu_seqlens()
    pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
    check_against_reference(550, (1, 8, 2, sum(PACKED_LENGTHS), sum(PACKED_LENGTHS), 128), torch.bfloat16, pattern,
                            cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert launches, "the Gluon dk/dv did not run"


# The Gluon forward's cases with GQA groups (of 2 or 4) and queries that are the keys' tokens (training).
GROUP_SPLIT_CASES = [case for case in WARP_SPECIALIZED_CASES if case[0][3] == case[0][4] and case[0][1] > case[0][2]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", range(len(GROUP_SPLIT_CASES)))
def test_gpu_dkdv_group_split(monkeypatch, case, dtype):
    """dK/dV with a GQA group's query heads shared out among programs, each split that divides the group, against
    the float64 reference: odd lengths, one pattern per query head, dense heads, the [B, T, H, D] projection output
    behind a transpose, blocks 32/64/128 (TMA and gathered query units)."""
    shape, fields, memory = GROUP_SPLIT_CASES[case]
    size = "small" if shape[-1] <= 64 else "medium"
    splits = [c for c in triton_impl._GROUP_SPLIT_DKDV if (shape[1] // shape[2]) % c.group_split == 0]
    assert splits
    for config in splits:
        monkeypatch.setitem(triton_impl._CANDIDATES, ("dkdv", size), [config])  # the only usable candidate
        monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", {})  # (with tuning on, no earlier pick is reused)
        check_against_reference(520 + case, shape, dtype, S2Pattern(**fields), memory=memory)


@pytest.mark.gpu
def test_gpu_dkdv_group_split_varlen(monkeypatch):
    """Packed sequences (an empty one, one shorter than a tile, ends inside a query unit) with split groups."""
    cu = _packed_cu_seqlens()
    for config in triton_impl._GROUP_SPLIT_DKDV:
        monkeypatch.setitem(triton_impl._CANDIDATES, ("dkdv", "medium"), [config])
        monkeypatch.setattr(triton_impl, "_TUNED_CONFIGS", {})
        pattern = S2Pattern(block_size=64, local_blocks=4, vert_stride=8)
        check_against_reference(530, (1, 8, 2, sum(PACKED_LENGTHS), sum(PACKED_LENGTHS), 128), torch.bfloat16, pattern,
                                cu_seqlens_q=cu, cu_seqlens_k=cu)
