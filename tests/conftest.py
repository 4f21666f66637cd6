"""Shared test set-up: the Triton interpreter without a GPU, the ``gpu`` marker, and NaN-poisoned allocations."""

import math
import os

import torch

if not torch.cuda.is_available():
    # Must happen before any module decorates a Triton kernel: the interpreter is chosen at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _poisoned(allocate):
    def allocate_poisoned(*args, **kwargs):
        tensor = allocate(*args, **kwargs)
        if tensor.is_floating_point() or tensor.is_complex():
            with torch.no_grad():
                tensor.fill_(math.nan)
        return tensor

    return allocate_poisoned


@pytest.fixture(autouse=True)
def poison_uninitialized_outputs(monkeypatch):
    """Fill every freshly allocated uninitialized float tensor with NaN, so an element a kernel forgets to write
    shows up as NaN instead of passing by luck on zeroed memory."""
    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, _poisoned(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
    yield
