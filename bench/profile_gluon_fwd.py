"""Launch the warp-specialized Gluon forward a few times on dense causal work, for a profiler to attach to (GPU).

``bench/ncu_source_stalls.py`` reads where this kernel's warps wait; Nsight Compute needs a process that runs it.
The kernel is forced as ``hopper_fwd_ab.py`` forces it (the tuner's only forward candidate), on B x T = 131072
tokens, 32 heads of D = 128, a block-64 pattern whose local window covers the whole sequence (every causal block
kept), so that the work is cuDNN's dense causal attention's::

    ncu --kernel-name regex:fwd_ws_kernel --launch-skip 2 --launch-count 1 --section SourceCounters \\
        -o prof python bench/profile_gluon_fwd.py 2048
"""

import argparse

import torch
from hopper_fwd_ab import use

from s2_models.kernels import S2Pattern, s2_attention, triton_impl


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("seqlen", type=int, help="T; the batch is 131072 // T")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    if not 64 <= args.seqlen <= 131072 or args.seqlen % 64:
        raise ValueError(f"seqlen must be a multiple of 64 in [64, 131072], got {args.seqlen}")
    use(triton_impl.hopper_fwd, None)
    batch = 131072 // args.seqlen
    pattern = S2Pattern(block_size=64, local_blocks=args.seqlen // 64, vert_stride=16)
    q, k, v = (torch.randn(batch, 32, args.seqlen, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(args.launches):
        s2_attention(q, k, v, pattern, backend="triton")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
