"""Compile the Gluon backward kernels (kernels/hopper_bwd.py: dq, dk/dv) for sm_90 without a GPU, and read them.

``hopper_fwd_offline.py``'s counterpart for the backward: the same stand-in driver and reports (ptxas's registers and
spills, each ``HGMMA`` loop's length and mix), for the dq kernel or the dk/dv kernel as ``launch_dq`` /
``launch_dkdv`` would launch them (bf16, causal, the model's ``[B, T, H, D]`` layout). In the environment with the GPU
machine's Triton (see ``hopper_fwd_offline.py``)::

    python bench/hopper_bwd_offline.py dq --head-dim 128 --block-size 64
    python bench/hopper_bwd_offline.py dkdv --head-dim 128 --kernel-file .gpu/hopper_bwd_variant.py
"""

import argparse

import torch
from hopper_fwd_offline import _CompileOnlyDriver, print_report
from kernel_versions import load_version
from triton.runtime import driver


def compile_kernel(kind: str, head_dim: int, block_size: int, kernel_file=None):
    """The compiled ``kind`` (``"dq"`` or ``"dkdv"``) kernel (``warmup``: compiled, not run); ``kernel_file``: another
    version of ``hopper_bwd.py``."""
    driver.set_active(_CompileOnlyDriver())
    from s2_models.kernels import triton_impl
    from s2_models.kernels.layouts import BlockLayout
    from s2_models.kernels.pattern import S2Pattern

    hopper_bwd = triton_impl.hopper_bwd if kernel_file is None else load_version(kernel_file)
    name = f"s2_attention_bwd_{kind}_ws_kernel"
    kernel, num_sms = getattr(hopper_bwd, name), hopper_bwd.hopper_fwd._num_sms
    compiled = []

    class _Warmup:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled.append(kernel.warmup(*args, grid=grid, **kwargs))

    batch, heads, seqlen = 1, 4, 1024
    q, k, v, out, dout = (torch.empty(batch, seqlen, heads, head_dim, dtype=torch.bfloat16).transpose(1, 2)
                          for _ in range(5))
    stats = [torch.empty(batch, heads, seqlen) for _ in range(3)]  # lse, lse_log2, delta
    pattern = S2Pattern(block_size=block_size, local_blocks=4, vert_stride=4)
    blocks = seqlen // block_size
    layout = BlockLayout(pattern.block_mask(num_heads=heads, num_q_blocks=blocks, num_kv_blocks=blocks), block_size,
                         True, None)
    problem = triton_impl._problem(q, k, layout, None)
    setattr(hopper_bwd, name, _Warmup())
    hopper_bwd.hopper_fwd._num_sms = lambda device: 132
    try:
        if kind == "dq":
            config = triton_impl._GLUON_DQ[0]
            lists = triton_impl._unit_lists(layout, config.block_m, config.block_n, resident_is_query=True)
            row_views = tuple(triton_impl.row_view(t) for t in (q, dout, out, k, v))
            hopper_bwd.launch_dq(q, k, v, out, dout, stats[0], None, triton_impl.empty_heads_last(q), *stats[1:],
                                 row_views, lists, problem, 0.1, 0.1, block_size, heads, config.num_stages)
        else:
            config = triton_impl._GLUON_DKDV[0]
            lists = triton_impl._unit_lists(layout, config.block_n, config.block_m, resident_is_query=False)
            row_views = tuple(triton_impl.row_view(t) for t in (q, dout, k, v))
            hopper_bwd.launch_dkdv(q, dout, k, v, *stats[1:], triton_impl.empty_heads_last(k),
                                   triton_impl.empty_heads_last(v), row_views, lists, problem, 0.1, 0.1, block_size,
                                   heads, config.num_stages)
    finally:
        setattr(hopper_bwd, name, kernel)
        hopper_bwd.hopper_fwd._num_sms = num_sms
    return compiled[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["dq", "dkdv"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--loops", type=int, default=2, help="how many of the shortest HGMMA loops to print")
    parser.add_argument("--kernel-file", help="another version of kernels/hopper_bwd.py to compile instead")
    args = parser.parse_args()
    kernel = compile_kernel(args.kind, args.head_dim, args.block_size, args.kernel_file)
    print_report(kernel, f"{args.kind}, D={args.head_dim}, block {args.block_size}", args.loops)


if __name__ == "__main__":
    main()
