"""Real English text that works offline: the reStructuredText sources of the Linux kernel and Python docs.

Both ship as Debian packages (``linux-doc-6.1``, ``python3.11-doc``) fetched once with ``apt-get download`` and
unpacked (see ``s2_models.downloads``). Each ``.rst.txt`` source becomes one document of plain prose: markup is
stripped crudely and paragraphs that are mostly code, tables or symbols are dropped. The train / held-out split is
by a hash of each document's path, so it is deterministic and does not shift when documents are added.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from s2_models.downloads import debian_package_tree

DOC_PACKAGES = ("linux-doc-6.1", "python3.11-doc")
SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 5  # share of documents held out (by path hash) for perplexity and evaluation

_ROLE = re.compile(r":[\w:+-]+:`([^`<]*?)\s*(?:<[^`>]*>)?`")  # :ref:`text <target>` -> text
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_+")  # `text <url>`_ -> text
_INLINE = re.compile(r"``([^`]+)``|`([^`]+)`_*|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")  # heading rules like "======"
_DIRECTIVE = re.compile(r"^\s*\.\.(\s|$)")  # ".. note::", ".. _label:", comments
_FIELD = re.compile(r"^\s*:[\w -]+:(\s|$)")  # ":Author: ...", ":param x:" field lists


@dataclass(frozen=True)
class Document:
    name: str  # "<package>/<path relative to the package's _sources>", stable across machines
    text: str


def iter_documents(split: str = "train", packages: tuple[str, ...] = DOC_PACKAGES) -> Iterator[Document]:
    """Yield the clean documents of ``split`` ("train" or "heldout") in a deterministic order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for package in packages:
        root = debian_package_tree(package)
        sources = sorted(root.glob("usr/share/doc/*/html/_sources/**/*.txt"))
        if not sources:
            raise RuntimeError(f"{package} unpacked to {root} but holds no html/_sources/**/*.txt files")
        for path in sources:
            name = f"{package}/{path.relative_to(_sources_dir(path)).as_posix()}"
            if split_of(name) != split:
                continue
            text = clean_rst(path.read_text(encoding="utf-8", errors="replace"))
            if text:
                yield Document(name, text)


def split_of(name: str) -> str:
    """The split a document belongs to: a stable hash of its name, ``HELDOUT_PERCENT`` percent held out."""
    bucket = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def heldout_text(max_chars: int, packages: tuple[str, ...] = DOC_PACKAGES) -> str:
    """The first ``max_chars`` characters of the held-out documents, joined by blank lines."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    parts, total = [], 0
    for doc in iter_documents("heldout", packages):
        parts.append(doc.text)
        total += len(doc.text) + 2
        if total >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


def text_dataset(split: str = "train", max_documents: int | None = None, packages: tuple[str, ...] = DOC_PACKAGES):
    """The documents of ``split`` as a ``datasets.Dataset`` with columns ``name`` and ``text``."""
    from datasets import Dataset

    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or None, got {max_documents}")
    rows = []
    for doc in iter_documents(split, packages):
        rows.append({"name": doc.name, "text": doc.text})
        if max_documents is not None and len(rows) >= max_documents:
            break
    return Dataset.from_list(rows)


def clean_rst(source: str, min_words: int = 8) -> str:
    """Crudely turn reStructuredText into prose paragraphs.

    Drops directives and their indented bodies (code blocks, tables, toctrees), heading rules, field lists and
    literal blocks after ``::``; unwraps inline markup; keeps paragraphs of at least ``min_words`` words that are
    mostly letters. Paragraphs are joined by blank lines.
    """
    paragraphs, current = [], []
    skip_indent = None  # indentation that belongs to a skipped block (directive body or literal block)
    for raw in source.splitlines():
        line = raw.rstrip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line or indent > skip_indent:
                continue
            skip_indent = None
        if not line.strip():
            _flush(current, paragraphs, min_words)
            continue
        if _DIRECTIVE.match(line) or _UNDERLINE.match(line) or _FIELD.match(line) or line.lstrip()[:1] in "+|":
            _flush(current, paragraphs, min_words)
            if _DIRECTIVE.match(line):
                skip_indent = indent
            continue
        if indent > 0 and not current:  # an indented paragraph is a block quote or code: skip it
            skip_indent = indent - 1
            continue
        current.append(line.strip())
        if line.endswith("::"):  # the next indented block is literal code
            last = current.pop()  # "text::" reads "text:"; a bare or spaced "::" disappears
            last = last[:-1] if re.search(r"\S::$", last) else last[:-2].rstrip()
            if last:
                current.append(last)
            _flush(current, paragraphs, min_words)
            skip_indent = indent
    _flush(current, paragraphs, min_words)
    return "\n\n".join(paragraphs)


def _flush(lines: list[str], paragraphs: list[str], min_words: int) -> None:
    if not lines:
        return
    text = " ".join(lines)
    lines.clear()
    text = _LINK.sub(r"\1", text)
    text = _ROLE.sub(r"\1", text)
    text = _INLINE.sub(lambda m: next(g for g in m.groups() if g is not None), text)
    text = re.sub(r"\s+", " ", text).strip()
    letters = sum(c.isalpha() or c.isspace() for c in text)
    if len(text.split()) >= min_words and letters >= 0.85 * len(text):
        paragraphs.append(text)


def _sources_dir(path: Path) -> Path:
    for parent in path.parents:
        if parent.name == "_sources":
            return parent
    raise ValueError(f"{path} is not inside an html/_sources directory")
