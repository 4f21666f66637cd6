"""Instrumented copies of a kernel module: text inserted at anchors of its source, each anchor checked (GPU tools)."""

from __future__ import annotations

from pathlib import Path

from hopper_fwd_offline import load_version


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
