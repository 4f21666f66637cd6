"""A larger offline English corpus from Debian documentation packages, tokenized for SmolLM2 into uint16 pieces.

``training/data.py`` reads two packages (4.2M training tokens); this builder reads every package in ``SOURCES``
(the kernel, Python, PostgreSQL, Perl, GNU binutils/autoconf/bash/glibc manuals, SQLite, Apache, Rust, Erlang, Qt,
Django, SciPy, ...), each fetched with ``apt-get download`` and unpacked with ``dpkg -x`` (nothing installed; see
``s2_models.downloads``). Each source file becomes one document of clean prose, by format:

- ``rst``: Sphinx ``_sources/*.txt`` (reStructuredText) -> ``training.data.clean_rst``;
- ``html``: HTML pages -> the text of their paragraphs, list items and headings (``html.parser``), without
  ``script``/``style``/``pre`` blocks;
- ``info``: GNU info manuals (``*.info*.gz``, from texinfo) -> their paragraphs, without menus, node headers and
  indented examples;
- ``pod``: Perl's POD -> its paragraphs, without commands and verbatim (indented) blocks;
- ``text``: plain text or AsciiDoc -> its paragraphs.

Every format ends in the same prose filter as ``clean_rst``: a paragraph is kept when it has at least 8 words and is
mostly letters, so code, tables and navigation fall away. A document is kept when it has at least ``MIN_WORDS``
words and reads as English (common English words make up a fair share of it), and only once (identical texts from
two pages or packages count once). The split is by a stable hash of the document's name (``training.data.split_of``,
5% held out); training documents are ordered by a hash of their name, so any prefix of the stream mixes all packages.

Output (``python -m s2_models.training.corpus --out data/corpus``):

- ``train_000.bin``, ``train_001.bin``, ...: the training stream, documents joined with EOS, flat little-endian
  ``uint16`` token ids, ``PIECE_TOKENS`` tokens per piece (< 60 MiB, so that one piece travels with one GPU run);
  concatenated in order they are the whole stream (``cat train_*.bin > train.bin``);
- ``heldout.bin``: the held-out stream, the same way;
- ``manifest.json``: per package its version, ``.deb`` size and sha256, documents and tokens per split; per piece
  its tokens, bytes and sha256; the tokenizer and the EOS id.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import multiprocessing
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

from s2_models.downloads import debian_package_info, debian_package_tree
from s2_models.training.data import Document, _flush, clean_rst, split_of

PIECE_TOKENS = 25_000_000  # 47.7 MiB of uint16: one piece plus the repository fit the 64 MiB a GPU run carries
MIN_WORDS = 50  # shorter documents are index pages, stubs and link lists
ENGLISH_SHARE = 0.12  # minimum share of very common English words in a document's words
TOKEN_DTYPE = np.uint16

_DOC = "usr/share/doc"


@dataclass(frozen=True)
class Source:
    """Files of one Debian package in one format: ``globs`` relative to the unpacked root."""

    package: str
    format: str  # one of FORMATS
    globs: tuple[str, ...]
    exclude: str | None = None  # regex: files whose path (relative to the root) it finds are skipped


_SPHINX = "usr/share/doc/*/html/_sources/**/*.txt"  # reStructuredText sources that Sphinx ships with its HTML
_INFO = "usr/share/info/**/*.info*.gz"
# Sphinx HTML, for projects whose API reference is generated from docstrings (it exists only in the HTML); the
# highlighted module sources, the copied reST sources and the static files are skipped
_HTML = "usr/share/doc/**/*.html"
_SPHINX_EXTRAS = r"/_modules/|/_sources/|/_static/|/_images/|/genindex|/py-modindex|/search\.html"

SOURCES = (
    Source("linux-doc-6.1", "rst", (_SPHINX,)),
    Source("python3.11-doc", "rst", (_SPHINX,)),
    Source("llvm-15-doc", "rst", (_SPHINX,)),
    Source("clang-15-doc", "rst", (_SPHINX,)),
    Source("cmake-doc", "rst", (_SPHINX,)),
    Source("sphinx-doc", "rst", (_SPHINX,)),
    Source("pypy3-doc", "rst", (_SPHINX,)),
    Source("python-flask-doc", "rst", (_SPHINX,)),
    Source("python-werkzeug-doc", "rst", (_SPHINX,)),
    Source("python-setuptools-doc", "rst", (_SPHINX,)),
    Source("python-xarray-doc", "rst", (_SPHINX,)),
    Source("python-pytest-doc", "rst", (_SPHINX,)),
    Source("python-cryptography-doc", "rst", (_SPHINX,)),
    Source("nova-doc", "rst", (_SPHINX,)),
    Source("neutron-doc", "rst", (_SPHINX,)),
    Source("swift-doc", "rst", ("usr/share/doc/swift-doc/**/_sources/**/*.txt",)),
    Source("python-pandas-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-sklearn-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-scipy-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-sympy-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-dask-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-statsmodels-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-astropy-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-ase-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-celery-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-scrapy-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-tornado-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-lxml-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-mpmath-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("keystone-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("heat-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("glance-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-openstackclient-doc", "html", (_HTML,), exclude=_SPHINX_EXTRAS),
    Source("python-django-doc", "html", (f"{_DOC}/python-django-doc/html/**/*.html",), exclude=_SPHINX_EXTRAS),
    Source("python-sqlalchemy-doc", "html", (f"{_DOC}/python-sqlalchemy-doc/html/**/*.html",)),
    Source("python-biopython-doc", "html", (f"{_DOC}/python-biopython-doc/Doc/**/*.html",)),
    Source("docutils-doc", "html", (f"{_DOC}/docutils-doc/**/*.html",)),
    Source("postgresql-doc-15", "html", (f"{_DOC}/postgresql-doc-15/html/*.html",)),
    Source("sqlite3-doc", "html", (f"{_DOC}/sqlite3/**/*.html",)),
    Source("apache2-doc", "html", (f"{_DOC}/apache2-doc/manual/en/**/*.html",)),
    # the per-architecture intrinsics (~14k near-identical pages) and highlighted sources are not prose
    Source("rust-doc", "html", (f"{_DOC}/rust-doc/html/**/*.html",), exclude="/arch/|/src/"),
    Source("erlang-doc", "html", (f"{_DOC}/erlang-doc/**/*.html",)),
    Source("openjdk-17-doc", "html", (f"{_DOC}/openjdk-17-jre-headless/api/**/*.html",), exclude="/class-use/"),
    Source("qtbase5-doc-html", "html", ("usr/share/qt5/doc/**/*.html",)),
    Source("boost1.74-doc", "html", (f"{_DOC}/libboost1.74-doc/**/*.html",)),
    Source("ghc-doc", "html", (f"{_DOC}/ghc-doc/html/**/*.html",), exclude="/src/"),
    Source("debian-handbook", "html", (f"{_DOC}/debian-handbook/html/en-US/*.html",)),
    Source("debian-reference-en", "html", ("usr/share/debian-reference/*.en.html",)),
    Source("developers-reference", "html", ("usr/share/developers-reference/*.html",)),
    Source("debian-policy", "html", (f"{_DOC}/debian-policy/**/*.html",)),
    Source("debian-faq", "html", (f"{_DOC}/debian/FAQ/*.html",)),
    Source("maint-guide", "html", (f"{_DOC}/maint-guide/html/*.en.html",)),
    Source("gimp-help-en", "html", ("usr/share/gimp/2.0/help/en/**/*.html",)),
    Source("libreoffice-help-en-us", "html", ("usr/share/libreoffice/help/en-US/**/*.html",)),
    Source("kicad-doc-en", "html", (f"{_DOC}/kicad/help/en/*.html",)),
    Source("octave-doc", "html", (f"{_DOC}/octave/**/*.html",)),
    Source("maxima-doc", "html", (f"{_DOC}/maxima-doc/html/*.html",)),
    Source("gnuplot-doc", "html", (f"{_DOC}/gnuplot/htmldocs/*.html",)),
    Source("nodejs-doc", "html", (f"{_DOC}/nodejs/api/*.html",)),
    Source("exim4-doc-html", "html", (f"{_DOC}/exim4-doc-html/**/*.html",)),
    Source("postfix-doc", "html", (f"{_DOC}/postfix/html/*.html",)),
    Source("bind9-doc", "html", (f"{_DOC}/bind9-doc/**/*.html",)),
    Source("abs-guide", "html", (f"{_DOC}/abs-guide/html/*.html",)),
    Source("zsh-doc", "html", (f"{_DOC}/zsh-common/html/*.html",)),
    Source("git-doc", "text", (f"{_DOC}/git-doc/**/*.txt",)),
    Source("autoconf-doc", "info", (_INFO,)),
    Source("binutils-doc", "info", (_INFO,)),
    Source("bash-doc", "info", (_INFO,)),
    Source("lilypond-doc", "info", (_INFO,)),
    Source("guile-3.0-doc", "info", (_INFO,)),
    Source("r-doc-info", "info", (_INFO,)),
    Source("sbcl-doc", "info", (_INFO,)),
    Source("perl-doc", "pod", ("usr/share/perl/*/pod/*.pod",)),
)


# ---------------------------------------------------------------------------------------------------------------
# format -> prose


class _ProseHTMLParser(HTMLParser):
    """Collects the text of block elements (paragraphs, list items, headings, table cells) as separate strings."""

    BLOCKS = frozenset("p div li dd dt h1 h2 h3 h4 h5 h6 td th tr table ul ol dl br section article blockquote "
                       "title caption figcaption header footer nav main aside hr body".split())
    SKIPPED = frozenset("script style pre noscript svg math head textarea".split())

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._parts: list[str] = []
        self._skip_depth = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIPPED:
            self._skip_depth += 1
        if tag in self.BLOCKS or tag in self.SKIPPED:
            self._end_block()

    def handle_startendtag(self, tag, attrs):
        if tag in self.BLOCKS:
            self._end_block()

    def handle_endtag(self, tag):
        if tag in self.SKIPPED:
            self._skip_depth = max(0, self._skip_depth - 1)
        if tag in self.BLOCKS or tag in self.SKIPPED:
            self._end_block()

    def handle_data(self, data):
        if not self._skip_depth:
            self._parts.append(data)

    def close(self):
        super().close()
        self._end_block()

    def _end_block(self):
        if self._parts:
            self.blocks.append("".join(self._parts))
            self._parts.clear()


def clean_html(source: str, min_words: int = 8) -> str:
    """The prose paragraphs of an HTML page, joined by blank lines (same prose filter as ``clean_rst``)."""
    parser = _ProseHTMLParser()
    parser.feed(source)
    parser.close()
    paragraphs: list[str] = []
    for block in parser.blocks:
        _flush([html.unescape(block).replace("\u00b6", " ")], paragraphs, min_words)  # "¶": Sphinx permalinks
    return "\n\n".join(paragraphs)


def clean_paragraphs(source: str, min_words: int = 8) -> str:
    """Plain text (also AsciiDoc, info, POD bodies): blank-line separated paragraphs; indented paragraphs (examples,
    verbatim blocks) and lines that are rules or delimiters are dropped; same prose filter as ``clean_rst``."""
    paragraphs: list[str] = []
    current: list[str] = []
    for raw in source.splitlines():
        line = raw.rstrip()
        if not line.strip():
            _flush(current, paragraphs, min_words)
            continue
        if not current and line[:1] in " \t":  # an indented paragraph: an example or a verbatim block
            continue
        if _RULE.match(line):
            _flush(current, paragraphs, min_words)
            continue
        current.append(line.strip())
    _flush(current, paragraphs, min_words)
    return "\n\n".join(paragraphs)


_RULE = re.compile(r"^\s*([-=*_~+.^#`'\"<>|/\\])\1{2,}\s*$|^\s*\|[=-]")  # ----, ====, |=== (AsciiDoc tables)
_INFO_MENU = re.compile(r"^\* Menu:|^\* [^:]+::")
_INFO_NODE = re.compile(r"^File: \S+,\s+Node:")
_POD_CODE = re.compile(r"[A-Z]<<+\s(.*?)\s>>+|[A-Z]<([^<>]*)>")  # B<bold>, C<code>, L<text|link>, C<< x >>


def clean_info(source: str, min_words: int = 8) -> str:
    """A GNU info file: node separators, node headers, menus and indented examples dropped, paragraphs kept."""
    lines = []
    for line in source.replace("\x1f", "\n").splitlines():
        if _INFO_NODE.match(line) or _INFO_MENU.match(line) or line.startswith("Tag Table:"):
            lines.append("")
            continue
        lines.append(line.replace("\x7f", ""))
    return clean_paragraphs("\n".join(lines), min_words)


def clean_pod(source: str, min_words: int = 8) -> str:
    """Perl POD: ``=command`` paragraphs and verbatim (indented) blocks dropped, formatting codes unwrapped."""
    lines = []
    for line in source.splitlines():
        if line.startswith("="):
            lines.append("")
            continue
        for _ in range(3):  # nested codes, innermost first: L<C<foo>>
            line = _POD_CODE.sub(_pod_code_text, line)
        lines.append(line)
    return clean_paragraphs("\n".join(lines), min_words)


def _pod_code_text(match: re.Match) -> str:
    text = match.group(1) if match.group(1) is not None else match.group(2)
    if match.group(0)[0] == "L":  # L<text|target> -> text, L<target> -> target
        text = text.split("|", 1)[0]
    if match.group(0)[0] in "XZ":  # index entries and zero-width codes
        return ""
    if match.group(0)[0] == "E":
        return {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}.get(text, "")
    return text


FORMATS: dict[str, Callable[[str], str]] = {
    "rst": clean_rst,
    "html": clean_html,
    "info": clean_info,
    "pod": clean_pod,
    "text": clean_paragraphs,
}

# A sample of the most frequent English words: in English prose they make up ~40% of all words, in code, tables and
# other languages next to none.
_ENGLISH_WORDS = frozenset(
    "the of and to a in is that for it as with be on by this are or an not from at which can you if when but all "
    "will one has have its their there they more also these than other only any into may was been each such".split()
)


def is_english_prose(text: str, min_words: int = MIN_WORDS) -> bool:
    """At least ``min_words`` words, of which at least ``ENGLISH_SHARE`` are very common English words."""
    words = text.lower().split()
    if len(words) < min_words:
        return False
    return sum(w in _ENGLISH_WORDS for w in words) >= ENGLISH_SHARE * len(words)


def read_source_file(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def iter_source_documents(source: Source) -> Iterator[Document]:
    """The clean English documents of one source, named ``<package>/<path in the package>``, in path order."""
    if source.format not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {source.format!r}")
    root = debian_package_tree(source.package)
    skip = re.compile(source.exclude) if source.exclude else None
    paths, seen = [], set()
    for path in sorted({p for pattern in source.globs for p in root.glob(pattern) if p.is_file()}):
        real = path.resolve()  # Debian links documentation folders under several names
        if real not in seen and not (skip and skip.search("/" + path.relative_to(root).as_posix())):
            seen.add(real)
            paths.append(path)
    if not paths:
        raise RuntimeError(f"{source.package} unpacked to {root} holds no files matching {source.globs}")
    clean = FORMATS[source.format]
    for path in paths:
        text = clean(read_source_file(path))
        if is_english_prose(text):
            yield Document(f"{source.package}/{path.relative_to(root).as_posix()}", text)


# ---------------------------------------------------------------------------------------------------------------
# documents -> token pieces


def stable_order_key(name: str) -> bytes:
    """Documents are ordered by this hash of their name: a fixed shuffle that mixes packages."""
    return hashlib.sha256(b"order:" + name.encode()).digest()


def _source_documents(source: Source) -> tuple[list[Document], float]:
    begin = time.perf_counter()
    return list(iter_source_documents(source)), time.perf_counter() - begin


def collect_documents(sources, log=print, jobs: int = 1) -> tuple[dict[str, list[Document]], dict[str, dict]]:
    """Every source's documents, deduplicated by text, split by name: ``({split: docs}, {package: stats})``.

    ``jobs`` processes clean the sources in parallel; the result does not depend on it (sources are folded in
    order, so the first of two identical documents is the one kept)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    for source in sources:  # fetch first, one at a time (apt and the cache are not for concurrent writers)
        debian_package_tree(source.package)
    splits: dict[str, list[Document]] = {"train": [], "heldout": []}
    stats: dict[str, dict] = {}
    seen: set[bytes] = set()
    if jobs == 1:
        results = map(_source_documents, sources)
    else:
        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_source_documents, sources)
    for source, (docs, seconds) in zip(sources, results):
        entry = stats.setdefault(source.package, {"formats": [], "documents": {"train": 0, "heldout": 0},
                                                  "duplicates_dropped": 0})
        entry["formats"].append(source.format)
        for doc in docs:
            digest = hashlib.sha1(doc.text.encode()).digest()
            if digest in seen:
                entry["duplicates_dropped"] += 1
                continue
            seen.add(digest)
            split = split_of(doc.name)
            splits[split].append(doc)
            entry["documents"][split] += 1
        log(f"{source.package:26s} {source.format:5s} {entry['documents']}  ({seconds:.0f} s)")
    if jobs > 1:
        pool.close()
        pool.join()
    for split, docs in splits.items():
        if not docs:
            raise RuntimeError(f"the sources gave no {split} documents")
        docs.sort(key=lambda d: stable_order_key(d.name))
    return splits, stats


def tokenize_stream(docs: list[Document], tokenizer, batch_size: int = 64) -> Iterator[tuple[Document, np.ndarray]]:
    """Each document's token ids followed by EOS, as ``uint16``."""
    eos = tokenizer.eos_token_id
    if eos is None or len(tokenizer) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"the tokenizer needs an EOS token and at most 65536 ids, has eos={eos}, {len(tokenizer)} ids")
    for first in range(0, len(docs), batch_size):
        batch = docs[first : first + batch_size]
        encoded = tokenizer([d.text for d in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for doc, ids in zip(batch, encoded):
            yield doc, np.array([*ids, eos], dtype=TOKEN_DTYPE)


class PieceWriter:
    """Writes a token stream into ``<prefix>_000.bin``, ... of at most ``piece_tokens`` tokens each (or one file
    ``<prefix>.bin`` with ``single=True``) and records each piece's tokens, bytes and sha256."""

    def __init__(self, out: Path, prefix: str, piece_tokens: int = PIECE_TOKENS, single: bool = False):
        if piece_tokens < 1:
            raise ValueError(f"piece_tokens must be >= 1, got {piece_tokens}")
        self.out, self.prefix, self.piece_tokens, self.single = out, prefix, piece_tokens, single
        self.pieces: list[dict] = []
        self._file = None
        self._hash = None
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._file is None:
                self._open()
            room = ids.size if self.single else self.piece_tokens - self._count
            part, ids = ids[:room], ids[room:]
            data = part.astype("<u2", copy=False).tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += part.size
            if not self.single and self._count == self.piece_tokens:
                self._close()

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close()
        return self.pieces

    def _open(self):
        name = f"{self.prefix}.bin" if self.single else f"{self.prefix}_{len(self.pieces):03d}.bin"
        self._file = (self.out / name).open("wb")
        self._hash = hashlib.sha256()
        self._count = 0

    def _close(self):
        path = Path(self._file.name)
        self._file.close()
        self.pieces.append({"file": path.name, "tokens": self._count, "bytes": path.stat().st_size,
                            "sha256": self._hash.hexdigest()})
        self._file = None


def build_corpus(out: Path, sources=SOURCES, tokenizer=None, piece_tokens: int = PIECE_TOKENS, log=print,
                 jobs: int = 1) -> dict:
    """Build the corpus into ``out`` (see the module docstring); returns the manifest, also written to
    ``out/manifest.json``."""
    if tokenizer is None:
        from s2_models.smollm2 import WHEEL_REQUIREMENT, load_tokenizer

        tokenizer, tokenizer_name = load_tokenizer(), f"SmolLM2-135M-Instruct ({WHEEL_REQUIREMENT} GGUF)"
    else:
        tokenizer_name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("train_*.bin"), out / "heldout.bin"]:
        stale.unlink(missing_ok=True)
    begin = time.perf_counter()
    splits, stats = collect_documents(sources, log, jobs)
    for entry in stats.values():
        entry["tokens"] = {"train": 0, "heldout": 0}
    files = {}
    for split, docs in splits.items():
        writer = PieceWriter(out, split, piece_tokens, single=split == "heldout")
        for doc, ids in tokenize_stream(docs, tokenizer):
            stats[doc.name.split("/", 1)[0]]["tokens"][split] += int(ids.size)
            writer.write(ids)
        files[split] = writer.close()
        log(f"{split}: {len(docs)} documents, {sum(p['tokens'] for p in files[split]):,} tokens "
            f"({time.perf_counter() - begin:.0f} s)")
    packages = {}
    for package, entry in stats.items():
        packages[package] = {**debian_package_info(package), **entry}
    manifest = {
        "description": "English prose from Debian documentation packages (s2_models.training.corpus)",
        "tokenizer": tokenizer_name,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": "uint16 little-endian, documents joined with EOS (each document ends with it)",
        "split": "by sha1 of the document name, 5% held out (s2_models.training.data.split_of)",
        "order": "documents of a split ordered by sha256('order:' + name)",
        "documents": {split: len(docs) for split, docs in splits.items()},
        "tokens": {split: sum(p["tokens"] for p in pieces) for split, pieces in files.items()},
        "files": files,
        "packages": packages,
        "build_seconds": round(time.perf_counter() - begin),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (pieces + manifest.json)")
    parser.add_argument("--packages", default=None, help="comma-separated subset of the packages (default: all)")
    parser.add_argument("--piece-tokens", type=int, default=PIECE_TOKENS, help="tokens per training piece")
    parser.add_argument("--jobs", type=int, default=1, help="processes that clean packages in parallel")
    args = parser.parse_args(argv)
    sources = SOURCES
    if args.packages:
        wanted = {p.strip() for p in args.packages.split(",") if p.strip()}
        unknown = wanted - {s.package for s in SOURCES}
        if unknown:
            raise ValueError(f"--packages: unknown {sorted(unknown)}; known: {sorted({s.package for s in SOURCES})}")
        sources = tuple(s for s in SOURCES if s.package in wanted)
    manifest = build_corpus(args.out, sources, piece_tokens=args.piece_tokens, log=lambda m: print(m, flush=True),
                            jobs=args.jobs)
    print(json.dumps({"documents": manifest["documents"], "tokens": manifest["tokens"]}, indent=2))
    return manifest


if __name__ == "__main__":
    main(sys.argv[1:])
