"""Programmatic dependent launch (PDL) for the decode step's kernels, on Hopper and later GPUs.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream is still running, as
soon as every program of that kernel has called ``griddepcontrol.launch_dependents``. Its programs are placed on
SMs as they free up and do their set-up, then wait in ``griddepcontrol.wait`` until the kernel before has finished
and its writes are visible. Between two such kernels, the second one's launch and set-up overlap the first one's
tail. The decode-step kernels (decode attention, cache append, RMSNorm, rotary, decode-sized projections) launch this
way. On an H100 (bench/NOTES.md, twentieth session): a decode launch at batch 8, 32k in a CUDA graph of decode
launches 22.84 -> 22.07 us; the ``generate`` step of the 1B hybrid at 32k, PDL off -> on alternated in one process,
1.89 / 1.89 -> 1.83 / 1.86 ms at batch 8 (PDL's arm first: the first arm of a process ran fastest) and 1.39 -> 1.34 ms
at batch 1.

The rule each kernel keeps (``wait_for_preceding_kernel``): nothing before the wait reads what a preceding kernel
may write, or writes anything. Only tables that are copied to the GPU once, when a layout is first used, are read
before it (the decode kernel's slot tables). Kernels launched the ordinary way (PyTorch's, cuBLAS's) wait for the
whole of the kernel before them, as always.

Every kernel lets the next one launch right after its wait, so that the next one's launch and set-up overlap as
much of it as possible. A PDL kernel behind the decode kernel once made the hardware place the decode kernel's 128
programs two to an SM on up to 60 SMs, leaving up to 64 idle, and the launch took 22.7 us instead of 18.4 (the 1B
hybrid's decode step at 8 x 32k on an H200 as a CUDA graph: +104 us a step even for a PDL kernel of one program
that only waits; bench/NOTES.md, fifty-first to fifty-seventh sessions; ``bench/pdl_edge.py`` reproduces it at one
layer). The kernel's 186 registers and 64 KB allow two programs an SM, so a decode launch whose programs fit one to
an SM now reserves more than half an SM's shared memory (``decode_triton.py``): with a PDL kernel behind it the
layer takes what it takes with an ordinary one. The kernel behind it is o_proj: in captured decode steps on sm_90
the Gluon projection (``hopper_linear.py``) with PDL, whose weight copies start before its wait (the step at batch
8 1.241 -> 1.202 ms against cuBLAS's; 1.229 launched the ordinary way; sixtieth session); elsewhere cuBLAS's, the
ordinary way (this package's Triton projection there made the batch-8 step slower: 1.348 -> 1.371 ms, fifty-seventh
session). Until that reservation, the cache append let the decode kernel launch only at its end (launching it at the
append's start made the decode launches 18.6 -> 23.0 us, the same doubling); with it, at its start: the batch-8
step 1.334 / 1.335 -> 1.328 / 1.329 ms (fifty-seventh session).

``S2_ATTENTION_PDL=0`` launches every kernel the ordinary way.
"""

from __future__ import annotations

import functools
import os

import torch

from .triton_setup import gdc_launch_dependents, gdc_wait, tl, triton

ENV_SWITCH = "S2_ATTENTION_PDL"


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA GPU of compute capability >= 9.0, not Triton's
    interpreter, and ``S2_ATTENTION_PDL`` not ``0`` (read at every launch, so that a benchmark can switch it; a CUDA
    graph replays its launches as they were captured)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(ENV_SWITCH) == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes ``PDL: tl.constexpr`` and calls ``wait_for_preceding_kernel``: the
    kernel's switch and Triton's ``launch_pdl``, on or off together."""
    pdl = programmatic_launch(device)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_for_preceding_kernel(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible, then let the next kernel
    launch (it waits for this one in turn). A no-op unless launched with PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

