"""Other versions of a kernel module, for the GPU tools that compare or instrument kernels: a copy (another commit's,
a variant) loaded beside the package's, another commit's whole kernels folder as a package of its own, and
instrumented copies, text inserted at anchors of its source."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def load_version(path: str, prefix: str = "_version_"):
    """The module at ``path`` (a copy of one of ``kernels/``' modules) as a module of ``s2_models.kernels`` named
    ``prefix`` + its file's name, so that its relative imports resolve."""
    name = "s2_models.kernels." + prefix + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there (triton_impl's TileConfig)
    spec.loader.exec_module(module)
    return module


def load_package(folder: str, name: str):
    """The kernels folder ``folder`` (another commit's whole ``kernels/``, e.g. ``git archive REV kernels``) as a
    package of its own named ``name``, beside ``s2_models.kernels``; its modules import each other relatively."""
    init = Path(folder, "__init__.py")
    if not init.is_file():
        raise ValueError(f"folder must be a kernels folder holding __init__.py, got {folder!r}")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(Path(folder))])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def patched_source(source: str, patches: list[tuple], name: str = "the kernel") -> str:
    """``source`` with ``patches`` applied in order: ``(anchor, text)`` inserts ``text`` after ``anchor``,
    ``(anchor, text, "before")`` before it, ``(anchor, text, "replace")`` instead of it. Each anchor must occur exactly
    once in the source as patched so far, so that a changed kernel fails loudly instead of stamping the wrong place."""
    for anchor, text, *mode in patches:
        if source.count(anchor) != 1:
            raise RuntimeError(f"{name} changed: anchor not found exactly once: {anchor!r}")
        where = mode[0] if mode else "after"
        source = source.replace(anchor, {"after": anchor + text, "before": text + anchor, "replace": text}[where])
    return source


def patched_module(kernel: Path, patches: list[tuple], directory: str, suffix: str = "instrumented"):
    """A copy of the module at ``kernel`` with ``patches`` (``patched_source``), loaded as a module of
    ``s2_models.kernels`` (named after ``kernel`` and ``suffix``) so that its relative imports resolve."""
    source = patched_source(kernel.read_text(), patches, kernel.name)
    path = Path(directory, f"{kernel.stem}_{suffix}.py")
    path.write_text(source)
    return load_version(str(path))
