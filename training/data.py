"""Training text: the user's own data (files or a ``datasets`` dataset, ``load_text_splits``), or by default real
English text that works offline: the reStructuredText sources of the Linux kernel and Python docs.

The bundled text ships as Debian packages (``linux-doc-6.1``, ``python3.11-doc``) fetched once with
``apt-get download`` and unpacked (see ``s2_models.downloads``). Each ``.rst.txt`` source becomes one document of plain
prose: markup is stripped crudely and paragraphs that are mostly code, tables or symbols are dropped. The train /
held-out split is by a hash of each document's path, so it is deterministic and does not shift when documents are added.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

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


FILE_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def load_text_splits(
    *,
    train_files: Sequence[str] | None = None,
    validation_files: Sequence[str] | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    text_column_name: str | None = None,
    validation_split_percentage: int = 5,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    streaming: bool = False,
    allow_download: bool = False,
):
    """``(train, validation)`` datasets of one column, ``text``, from the sources ``s2-train`` names.

    The sources: ``train_files`` / ``validation_files`` (``load_data_files``), else ``dataset_name``
    (``load_named_dataset``), else the bundled text (its own held-out split). Without a validation set,
    ``validation_split_percentage`` percent of the training rows are held out (``split_off_validation``); validation
    is ``None`` when there is none. ``IterableDataset`` s when ``streaming``. Errors name the command-line argument.
    """
    if not 0 <= validation_split_percentage < 100:
        raise ValueError(f"--validation_split_percentage must be in [0, 100), got {validation_split_percentage}")
    for argument, value in (("--max_train_samples", max_train_samples), ("--max_eval_samples", max_eval_samples)):
        if value is not None and value < 1:
            raise ValueError(f"{argument} must be >= 1, got {value}")
    if train_files:
        splits = {"train": load_data_files(train_files, "--train_file", streaming)}
        source = {"train": f"--train_file {list(train_files)}"}
    elif dataset_name:
        splits = load_named_dataset(dataset_name, dataset_config_name, streaming, allow_download)
        source = {name: f"--dataset_name {dataset_name!r} (split {name!r})" for name in splits}
        if "train" not in splits:
            raise ValueError(f"--dataset_name {dataset_name!r} has no 'train' split (splits: {sorted(splits)})")
    else:
        if validation_files or dataset_config_name:
            raise ValueError("--validation_file and --dataset_config_name need --train_file or --dataset_name")
        bundled = (text_dataset("train", max_train_samples), text_dataset("heldout", max_eval_samples))
        return tuple((part.to_iterable_dataset() if streaming else part).select_columns(["text"]) for part in bundled)
    if validation_files:
        splits["validation"] = load_data_files(validation_files, "--validation_file", streaming)
        source["validation"] = f"--validation_file {list(validation_files)}"

    column = text_column(splits["train"], text_column_name, source["train"])
    train = _only_text(splits["train"], column, None)
    if "validation" in splits:
        validation = _only_text(splits["validation"], text_column(splits["validation"], column, source["validation"]),
                                max_eval_samples)
    elif validation_split_percentage:  # split first, as run_clm does: --max_train_samples counts training rows
        train, validation = split_off_validation(train, validation_split_percentage)
        validation = _first_rows(validation, max_eval_samples)
    else:
        validation = None
    train = _first_rows(train, max_train_samples)
    if not streaming and len(train) == 0:
        raise ValueError(f"{source['train']} holds no rows of text")
    if not streaming and validation is not None and len(validation) == 0:
        where = source.get("validation") or (
            f"--validation_split_percentage {validation_split_percentage} of {source['train']} ({len(train)} rows)"
        )
        raise ValueError(f"{where} holds no rows of text (pass --validation_split_percentage 0 to skip evaluation)")
    return train, validation


def load_data_files(files: Sequence[str], argument: str, streaming: bool = False):
    """One split from local files of one format: a ``Dataset`` (an ``IterableDataset`` when ``streaming``).

    A text file holds one document per blank-line-separated paragraph (a file without blank lines is one document);
    json/jsonl and csv one per row. ``argument`` ("--train_file") names the files in the errors: a missing or empty
    file, an unknown extension, formats mixed.
    """
    from datasets import load_dataset

    formats = set()
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"{argument} {name!r}: no such file")
        if path.stat().st_size == 0:
            raise ValueError(f"{argument} {name!r} is empty")
        if path.suffix.lower() not in FILE_FORMATS:
            raise ValueError(f"{argument} {name!r}: the extension must be one of {sorted(FILE_FORMATS)}")
        formats.add(FILE_FORMATS[path.suffix.lower()])
    if len(formats) != 1:
        raise ValueError(f"{argument} files must share one format (text, json or csv), got {list(files)}")
    builder = formats.pop()
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    return load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=streaming, **options)


def load_named_dataset(name: str, config_name: str | None, streaming: bool, allow_download: bool) -> dict:
    """The splits of ``--dataset_name``: a folder written by ``save_to_disk``, a local dataset folder, or a Hub
    dataset already in the local ``datasets`` cache. The Hub is asked only when ``allow_download``."""
    from datasets import DatasetDict, load_dataset, load_from_disk
    from datasets import config as datasets_config

    path = Path(name)
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        if config_name:
            raise ValueError(f"--dataset_config_name does not apply to the save_to_disk folder {name!r}")
        loaded = load_from_disk(str(path))
        splits = dict(loaded) if isinstance(loaded, DatasetDict) else {"train": loaded}
        return {split: data.to_iterable_dataset() if streaming else data for split, data in splits.items()}
    # datasets reads HF_HUB_OFFLINE once, at import; offline it looks the name up in its cache instead of the Hub.
    offline = contextlib.nullcontext() if allow_download else mock.patch.object(datasets_config, "HF_HUB_OFFLINE", True)
    try:
        with offline:
            return dict(load_dataset(name, config_name, streaming=streaming))
    except (ConnectionError, FileNotFoundError) as e:  # datasets' "not found" errors are FileNotFoundErrors
        where = "on the Hub or locally" if allow_download else "locally (pass --allow_download to fetch it)"
        raise ValueError(f"--dataset_name {name!r} was not found {where}: {e}") from e


def text_column(dataset, requested: str | None, source: str) -> str:
    """The column holding the text: ``requested``, else ``"text"`` if present, else the first (as run_clm)."""
    columns = dataset.column_names
    if columns is None:  # a stream whose features are not declared: read them off the first row
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"{source} holds no rows")
        columns = list(first)
    if requested is None:
        return "text" if "text" in columns else columns[0]
    if requested not in columns:
        raise ValueError(f"--text_column_name {requested!r} is not a column of {source}; its columns: {columns}")
    return requested


def split_off_validation(dataset, percentage: int):
    """``(train, validation)``: row ``i`` is held out when ``i * percentage / 100`` crosses an integer, so the held-out
    rows are spread evenly through the data and the same rule splits a stream."""

    def held_out(_, i):
        return (i + 1) * percentage // 100 > i * percentage // 100

    return (
        dataset.filter(lambda row, i: not held_out(row, i), with_indices=True),
        dataset.filter(held_out, with_indices=True),
    )


def _only_text(dataset, column: str, max_rows: int | None):
    dataset = dataset.select_columns([column])
    if column != "text":
        dataset = dataset.rename_column(column, "text")
    return _first_rows(dataset, max_rows)


def _first_rows(dataset, max_rows: int | None):
    if max_rows is None:
        return dataset
    if hasattr(dataset, "__len__"):
        return dataset.select(range(min(max_rows, len(dataset))))
    return dataset.take(max_rows)


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
