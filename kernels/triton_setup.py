"""Importing Triton for the kernel files: a clear error where it is missing, an interpreter fix, and the launchers'
``next_power_of_2``.

Kernel files do ``from .triton_setup import tl, triton``. The import sits in ``try`` so that transformers'
``check_imports`` (which skips ``try`` blocks) lets a ``trust_remote_code`` checkpoint load on machines without
Triton; there the kernels are never imported (``interface.py`` imports them lazily) and the PyTorch path runs.
"""

import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (dependent_launch.py)
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401 (re-exported to the kernel files)
except ImportError as e:  # no Triton on this machine (macOS, Windows, some CPU images)
    raise ImportError(f"the S2 Triton kernels need Triton: {e}") from e


def _patch_interpreter_loop_bounds() -> None:
    """Make runtime loop bounds work in Triton's interpreter with NumPy >= 2.4.

    The interpreter (Triton 3.6) holds every scalar as a 1-element array and turns loop bounds into ints with
    ``int(array)``, which NumPy 2.4 rejects ("only 0-dimensional arrays can be converted"). ``.item()`` works on
    every NumPy. Only applied under ``TRITON_INTERPRET=1``; compiled kernels are unaffected.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "s2_loop_bound_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor.s2_loop_bound_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_loop_bounds()


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), for the launchers' block sizes; plain Python, where
    ``triton.next_power_of_2`` (a ``constexpr_function`` in newer Triton) costs a few microseconds a call on the
    launch path."""
    return 1 << max(0, n - 1).bit_length()


_STAGES_THAT_FIT: dict[tuple, int] = {}


def launch_within_shared_memory(launch, num_stages: int, key: tuple):
    """``launch(num_stages=s)`` with the deepest software pipeline ``s <= num_stages`` whose compiled kernel fits the
    GPU's shared memory. What a stage takes depends on the Triton version and on shapes a launcher's defaults were
    not tuned at (the decode kernel at 3 stages: ~290-350 KB in float32 with head dim 128, 256 KB in bf16 with head
    dim 256, where a Hopper program may use 227 KB; bench/NOTES.md, fifty-third session). Triton reports it when the
    launch is prepared, before anything runs (``OutOfResources``); the next shallower pipeline is then tried, and the
    depth that fits is remembered under ``key`` (what fixes the compiled variant's shared memory). Returns what
    ``launch`` returns (Triton's compiled kernel; None in the interpreter)."""
    stages = _STAGES_THAT_FIT.get(key, num_stages)
    while True:
        try:
            compiled = launch(num_stages=stages)
        except triton.runtime.errors.OutOfResources:
            if stages == 1:
                raise
            stages -= 1
            continue
        if stages != num_stages:
            _STAGES_THAT_FIT[key] = stages
        return compiled


# Triton's ``load_binary`` opts a kernel that uses more shared memory than this in to all that one program may use;
# a kernel that uses less may not launch with more than it was compiled with.
_DEFAULT_SHARED_MEMORY_LIMIT = 48 * 1024


def reserve_shared_memory(compiled, nbytes: int) -> bool:
    """Make every later launch of ``compiled`` (Triton's ``CompiledKernel``) ask for at least ``nbytes`` of shared
    memory, so that fewer of its programs fit on one SM; the kernel uses no more than before. Triton 3.6 has no
    compile option for it (3.9's ``min_shared_mem``); a launch takes its shared memory from the kernel's
    ``packed_metadata`` (Triton 3.6 to 3.9). Only for kernels that use more than 48 KB, which Triton opted in to the
    SM's whole shared memory when it loaded them. Returns whether later launches ask for ``nbytes`` or more; where
    a Triton packs its launch metadata otherwise, launches keep asking for what the kernel uses (a placement, never
    a result, depends on it)."""
    packed = getattr(compiled, "packed_metadata", None)
    if not (isinstance(packed, tuple) and len(packed) == 3):
        return False
    warps, ctas, shared = packed
    if shared < nbytes and compiled.metadata.shared > _DEFAULT_SHARED_MEMORY_LIMIT:
        compiled.packed_metadata = (warps, ctas, nbytes)
        shared = nbytes
    return shared >= nbytes


__all__ = ["launch_within_shared_memory", "next_power_of_2", "reserve_shared_memory", "tl", "triton"]
