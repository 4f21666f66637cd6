"""Checks shared by the tests of every ``s2_attention`` backend.

Tolerance like FlashAttention's: a backend's error against the float64 reference must stay within 2x (3x for
gradients) of the error that PyTorch makes computing the same masked attention in the input dtype, plus a tiny floor.
"""

from __future__ import annotations

import torch

from s2_models.kernels import S2Pattern, s2_attention
from s2_models.kernels.naive import naive_s2_attention
from s2_models.kernels.pattern import token_mask

ABS_FLOOR = {torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float32: 2e-5}


def random_qkv(b, hq, hkv, tq, tk, d, dtype, device="cpu"):
    q = torch.randn(b, hq, tq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, hkv, tk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, hkv, tk, d, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def _outputs_and_grads(fn, q, k, v, grad_out, grad_lse):
    out, lse = fn(q, k, v)
    seen = torch.isfinite(lse)
    loss = (out.to(grad_out.dtype) * grad_out).sum() + (lse.masked_fill(~seen, 0).to(grad_lse.dtype) * grad_lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return out, lse, grads


def assert_matches_reference(q, k, v, backend, pattern=None, **kwargs):
    """Compare ``s2_attention(..., backend=backend)`` with the fp64 reference: outputs, lse and all gradients."""
    leaf = lambda t, dtype: t.detach().to(dtype).requires_grad_()  # noqa: E731
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    grad_lse = torch.randn(q.shape[:3], dtype=torch.float64, device=q.device)

    def ours(q_, k_, v_):
        return s2_attention(q_, k_, v_, pattern, backend=backend, return_lse=True, **kwargs)

    def reference(dtype):
        return lambda q_, k_, v_: naive_s2_attention(q_, k_, v_, pattern, dtype=dtype, **kwargs)

    out, lse, grads = _outputs_and_grads(ours, q, k, v, grad_out.to(q.dtype), grad_lse.float())
    exact_inputs = (leaf(t, torch.float64) for t in (q, k, v))
    exact = _outputs_and_grads(reference(torch.float64), *exact_inputs, grad_out, grad_lse)
    same_dtype = _outputs_and_grads(
        reference(q.dtype), *(leaf(t, q.dtype) for t in (q, k, v)), grad_out.to(q.dtype), grad_lse.to(q.dtype)
    )

    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3]
    assert torch.equal(torch.isfinite(lse), torch.isfinite(exact[1])), "rows that see no key differ"
    assert not out.isnan().any(), "output has NaN (an unwritten element?)"
    seen = torch.isfinite(exact[1])
    names = ["out", "lse", "dq", "dk", "dv"]
    ours_all = [out, lse.masked_fill(~seen, 0), *grads]
    exact_all = [exact[0], exact[1].masked_fill(~seen, 0), *exact[2]]
    same_all = [same_dtype[0], same_dtype[1].masked_fill(~seen, 0), *same_dtype[2]]
    for name, mine, ref, baseline in zip(names, ours_all, exact_all, same_all):
        factor = 2 if name in ("out", "lse") else 3
        error = (mine.double() - ref).abs().max().item()
        allowed = factor * (baseline.double() - ref).abs().max().item() + ABS_FLOOR[q.dtype]
        assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


def assert_excluded_blocks_are_unread(backend, dtype, device="cpu"):
    """Perturb keys/values inside a block the pattern excludes for some query rows: those rows must not change at
    all (bit for bit), while rows that do read the block must change. Fails for a wrong sparse pattern."""
    pattern = S2Pattern(block_size=16, local_blocks=2, vert_stride=4)
    b, hq, hkv, t, d = 2, 4, 2, 160, 32
    q, k, v = (x.detach() for x in random_qkv(b, hq, hkv, t, t, d, dtype, device))
    base = s2_attention(q, k, v, pattern, backend=backend)
    allowed = token_mask(pattern.block_mask(hkv, 10, 10), 16, t, t)  # [Hkv, T, T]
    for kv_head in range(hkv):
        for block in (0, 4, 5):
            keys = slice(16 * block, 16 * block + 16)
            k2, v2 = k.clone(), v.clone()
            k2[:, kv_head, keys] += torch.randn_like(k2[:, kv_head, keys])
            v2[:, kv_head, keys] += 10.0
            out = s2_attention(q, k2, v2, pattern, backend=backend)
            reads = allowed[kv_head, :, keys].any(-1)  # [T]: query rows that read the block
            group = slice(kv_head * (hq // hkv), (kv_head + 1) * (hq // hkv))
            assert torch.equal(out[:, group][:, :, ~reads], base[:, group][:, :, ~reads]), (kv_head, block)
            assert (out[:, group][:, :, reads] != base[:, group][:, :, reads]).any(-1).all(), (kv_head, block)
            other = [h for h in range(hq) if h // (hq // hkv) != kv_head]
            assert torch.equal(out[:, other], base[:, other]), "another KV head's query group changed"
