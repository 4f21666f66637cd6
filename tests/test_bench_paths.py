"""bench/bench_paths.py on the CPU: its FlexAttention masks are the S2 pattern of each path (packed sequences, left
padding, queries after a prefix, bidirectional), checked as dense masked attention against ``s2_attention``'s exact
PyTorch path in float64; a different pattern fails the check. And the earlier commit's kernels load as a package."""

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import bench_paths  # noqa: E402
from kernel_versions import load_package  # noqa: E402

from s2_models.kernels import S2Pattern, s2_attention  # noqa: E402

PATTERN = S2Pattern(block_size=16, local_blocks=2, vert_stride=3)
HEADS = 4
CASES = bench_paths.path_cases(tokens=384, seqlen=96)


def masked_attention(q, k, v, mask):
    """Dense attention where ``mask [B, H, Tq, Tk]`` allows; rows that see nothing are 0."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1).nan_to_num(0.0)
    return weights @ v


def flex_mask(case, pattern):
    """``flex_mask_mod`` evaluated at every (row, head, query, key), as FlexAttention evaluates it."""
    mask_mod = bench_paths.flex_mask_mod(case, pattern, HEADS, "cpu")
    b, h, i, j = (torch.arange(n).view([-1 if d == axis else 1 for d in range(4)])
                  for axis, n in enumerate((case.batch, HEADS, case.q_len, case.kv_len)))
    return mask_mod(b, h, i, j).expand(case.batch, HEADS, case.q_len, case.kv_len)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flex_masks_are_the_s2_pattern_of_each_path(case):
    q, k, v, kwargs = bench_paths.case_inputs(case, HEADS, 16, "cpu", torch.float64, torch.Generator().manual_seed(0))
    exact = s2_attention(q, k, v, PATTERN, backend="torch", **kwargs)
    torch.testing.assert_close(masked_attention(q, k, v, flex_mask(case, PATTERN)), exact, rtol=0, atol=1e-12)
    wrong = S2Pattern(block_size=16, local_blocks=2, vert_stride=4)
    assert (masked_attention(q, k, v, flex_mask(case, wrong)) - exact).abs().max() > 1e-3


def test_the_cases_hold_what_they_name():
    by_kind = {case.name.split(",")[0] + (", heads-last" if case.heads_last else ""): case
               for case in bench_paths.path_cases()}
    assert set(by_kind) == {"causal", "packed", "padding", "padding, heads-last", "Tq < Tk", "bidirectional"}
    assert by_kind["padding, heads-last"].left_padding == by_kind["padding"].left_padding
    packed = by_kind["packed"]
    assert sum(packed.seq_lens) == packed.q_len == 131072 and min(packed.seq_lens) >= 1 and len(packed.seq_lens) > 8
    padding = by_kind["padding"]
    assert padding.left_padding[0] == 0 and max(padding.left_padding) < 0.3 * padding.kv_len
    assert by_kind["Tq < Tk"].q_len < by_kind["Tq < Tk"].kv_len and not by_kind["bidirectional"].causal


def test_an_earlier_kernels_folder_loads_as_a_package_of_its_own(tmp_path):
    (tmp_path / "__init__.py").write_text("from .ops import attend\n")
    (tmp_path / "ops.py").write_text("def attend():\n    return 'earlier'\n")
    assert load_package(str(tmp_path), "s2_kernels_test_before").attend() == "earlier"
    with pytest.raises(ValueError, match="folder must be a kernels folder holding __init__.py"):
        load_package(str(tmp_path / "ops.py"), "s2_kernels_test_missing")


def test_the_table_takes_medians_and_divides_by_the_current_kernels(capsys):
    rows = [dict(case="padding", impl=impl, mode=mode, round=n, ms=ms)
            for impl, mode, times in (("s2-triton", "fwd", (2.0, 4.0, 3.0)), ("s2-triton", "fwd+bwd", (10.0,)),
                                      ("s2-before", "fwd", (6.0, 6.0, 9.0)), ("s2-before", "fwd+bwd", (15.0,)))
            for n, ms in enumerate(times)]
    rows.append(dict(case="padding", impl="flex-128", error="RuntimeError: no GPU"))
    bench_paths.print_table(rows)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert [c.strip() for c in last.strip("|").split("|")] == [
        "padding", "3.00 / 10.00", "6.00 / 15.00", "2.00x, 1.50x", "- / -", "-, -"]
