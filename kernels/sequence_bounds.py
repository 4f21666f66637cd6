"""Where a sequence (or batch row) lies in packed tensors: one Triton helper for the Triton and the Gluon kernels."""

from .triton_setup import tl, triton


@triton.jit
def sequence_bounds(cu_seqlens_q, cu_seqlens_k, seq, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """First q row, first k row, query length and key length of sequence (or batch row) ``seq``."""
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + seq)
        k_start = tl.load(cu_seqlens_k + seq)
        seqlen_q = tl.load(cu_seqlens_q + seq + 1) - q_start
        seqlen_k = tl.load(cu_seqlens_k + seq + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    return q_start, k_start, seqlen_q, seqlen_k
