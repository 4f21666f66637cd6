"""Compile the warp-specialized forward (kernels/hopper_fwd.py) for sm_90 on a machine without a GPU, and read it.

Device time is scarce; what the compiler makes of a kernel change is not. This compiles the Gluon kernel for an
H100 (compute capability 9.0) through Triton's own pipeline, with a stand-in for the CUDA driver that only answers
which GPU to compile for, then reports ptxas's resource use (registers, spills, shared memory) and, for each loop of
the SASS that issues ``HGMMA`` (warp-group matrix products), its instruction count and mix. The innermost such loop is
a consumer's step (one ``S = Q K^T`` and one ``O += P V``); its length is the per-step issue cost. Run it in an
environment with the GPU machine's Triton (3.6: ``pip install triton==3.6.0 torch==2.11.0`` in a spare venv; the
CUDA libraries are not needed) and this package installed::

    python bench/hopper_fwd_offline.py --head-dim 128 --block-size 64
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from kernel_versions import load_version
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import ty_to_cpp
from triton.runtime import driver


class _CompileOnlyDriver:
    """What Triton's compile path asks the driver: the target, a device and stream number, device properties."""

    class utils:  # noqa: N801 - Triton reads driver.utils.get_device_properties
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return ty_to_cpp(ty)


def compile_kernel(head_dim: int, block_size: int, block_n: int | None = None, num_buffers: int | None = None,
                   kernel_file=None, registers: tuple[int, int] | None = None):
    """The compiled kernel for bf16, causal, [B, T, H, D] queries (the model's layout), as ``hopper_fwd.launch``
    would launch it (``warmup``: compile, do not run); ``block_n``, ``num_buffers``: keys per step and V ring slots
    (``None``: the package's tile for ``head_dim``, ``triton_impl._WARP_SPECIALIZED_FWD``); ``kernel_file``: another
    version of ``hopper_fwd.py``; ``registers``: (consumer, loader) register counts instead of the module's for
    ``block_n``. Returns ``(kernel, block_n, num_buffers)``."""
    driver.set_active(_CompileOnlyDriver())
    from s2_models.kernels import triton_impl

    package = triton_impl._WARP_SPECIALIZED_FWD["small" if head_dim <= 64 else "medium"][0]
    block_n = block_n or package.block_n
    num_buffers = num_buffers or package.num_stages

    hopper_fwd = triton_impl.hopper_fwd if kernel_file is None else load_version(kernel_file)
    if registers is not None:
        hopper_fwd.REGISTERS = {**hopper_fwd.REGISTERS, block_n: registers}
    from s2_models.kernels.layouts import BlockLayout
    from s2_models.kernels.pattern import S2Pattern

    compiled = []
    kernel, num_sms = hopper_fwd.s2_attention_fwd_ws_kernel, hopper_fwd._num_sms

    class _Warmup:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled.append(kernel.warmup(*args, grid=grid, **kwargs))

    batch, heads, seqlen = 1, 4, 1024
    q = torch.empty(batch, seqlen, heads, head_dim, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.empty(batch, heads, seqlen, head_dim, dtype=torch.bfloat16) for _ in range(2))
    pattern = S2Pattern(block_size=block_size, local_blocks=4, vert_stride=4)
    blocks = seqlen // block_size
    layout = BlockLayout(pattern.block_mask(num_heads=heads, num_q_blocks=blocks, num_kv_blocks=blocks), block_size,
                         True, None)
    lists = triton_impl._unit_lists(layout, hopper_fwd.BLOCK_M, block_n, resident_is_query=True, split_first=True)
    row_views = tuple(triton_impl.row_view(t) for t in (q, k, v))
    hopper_fwd.s2_attention_fwd_ws_kernel, hopper_fwd._num_sms = _Warmup(), lambda device: 132
    try:
        hopper_fwd.launch(q, k, v, triton_impl.empty_heads_last(q), torch.empty(batch, heads, seqlen), row_views,
                          lists, triton_impl._problem(q, k, layout, None), 0.1, block_size, block_n, heads,
                          num_buffers)
    finally:
        hopper_fwd.s2_attention_fwd_ws_kernel, hopper_fwd._num_sms = kernel, num_sms
    return compiled[0], block_n, num_buffers


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.backends.nvidia.compiler.get_ptxas(90).path), name)


def ptxas_report(kernel) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        log = subprocess.run([_tool("ptxas"), "-v", "--gpu-name=sm_90a", ptx.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    return [line.split(":", 1)[-1].strip() for line in log.splitlines() if "registers" in line or "spill" in line]


def matrix_product_loops(kernel) -> list[dict]:
    """Each loop of the SASS (a backward branch to a label) that issues HGMMA: its length and instruction mix."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin.name], capture_output=True, text=True).stdout
    labels, instructions = {}, []
    for line in sass.splitlines():
        if label := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[label.group(1)] = len(instructions)
        elif instruction := re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            instructions.append(re.sub(r"^@!?U?P\w+\s+", "", instruction.group(1)))
    loops = []
    for end, instruction in enumerate(instructions):
        target = re.search(r"\bBRA\b.*?(\.L_x_\d+)", instruction)
        start = labels.get(target.group(1), end) if target else end
        body = instructions[start:end + 1]
        if start < end and any(x.startswith("HGMMA") for x in body):
            mix = collections.Counter(x.split()[0].split(".")[0] for x in body)
            spills = mix["LDL"] + mix["STL"]  # local-memory traffic inside the loop: spilled registers
            loops.append({"first": start, "last": end, "instructions": len(body), "spill_accesses": spills,
                          "mix": dict(mix.most_common(12))})
    return sorted(loops, key=lambda loop: loop["instructions"])


def print_report(kernel, title: str, loops: int) -> None:
    """Shared memory, ptxas's resource use, and the ``loops`` shortest ``HGMMA`` loops of a compiled kernel."""
    print(f"{title}: shared memory {kernel.metadata.shared} bytes")
    print(*ptxas_report(kernel), sep="\n")
    for loop in matrix_product_loops(kernel)[:loops]:
        print(f"loop of {loop['instructions']} instructions (SASS {loop['first']}..{loop['last']}), "
              f"{loop['spill_accesses']} spill accesses: {loop['mix']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--loops", type=int, default=2, help="how many of the shortest HGMMA loops to print")
    parser.add_argument("--block-n", type=int, help="keys per step (default: the package's)")
    parser.add_argument("--num-buffers", type=int, help="V ring slots, K's one fewer (default: the package's)")
    parser.add_argument("--registers", help="CONSUMER,LOADER register counts (default: the module's)")
    parser.add_argument("--kernel-file", help="another version of kernels/hopper_fwd.py to compile instead")
    args = parser.parse_args()
    registers = tuple(int(x) for x in args.registers.split(",")) if args.registers else None
    kernel, block_n, num_buffers = compile_kernel(args.head_dim, args.block_size, args.block_n, args.num_buffers,
                                                  args.kernel_file, registers)
    print_report(kernel, f"D={args.head_dim}, block {args.block_size}, {block_n}-key steps, {num_buffers} buffers",
                 args.loops)


if __name__ == "__main__":
    main()
