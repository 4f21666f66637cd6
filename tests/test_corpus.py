"""The corpus builder: format cleaners, the English filter, piece writing and the manifest (no downloads: the Debian
packages are replaced by small trees written here)."""

import gzip
import json

import numpy as np
import pytest

from s2_models.training import corpus
from s2_models.training.data import split_of

PROSE = ("The scheduler decides which task runs next on each processor, and it tries to keep every core busy "
         "while it also respects the priorities that the administrator has set for the system.")


def test_clean_html_keeps_paragraphs_and_drops_code_navigation_and_scripts():
    page = f"""<html><head><title>x</title><style>p {{color: red}}</style></head><body>
    <div class="nav"><a href="a.html">Next</a> | <a href="b.html">Previous</a></div>
    <h1>Scheduling&para;</h1><p>{PROSE.replace("processor", "<code>processor</code>")}</p>
    <pre>for (i = 0; i &lt; n; i++) schedule(); and this line has many words in it too ok</pre>
    <script>var words = "this script text has more than eight words in it";</script>
    <ul><li>It is a list item that has more than eight words &amp; one entity.</li></ul></body></html>"""
    text = corpus.clean_html(page)
    assert text.split("\n\n") == [PROSE, "It is a list item that has more than eight words & one entity."]


def test_clean_info_drops_menus_headers_and_examples():
    info = (f"\x1f\nFile: as.info,  Node: Overview,  Next: Invoking,  Up: Top\n\n1 Overview\n**********\n\n{PROSE}\n\n"
            "     as -o out.o in.s --with many options that look like words here\n\n* Menu:\n\n"
            "* Invoking::     How to run the assembler and what options it takes.\n\n")
    assert corpus.clean_info(info) == PROSE


def test_clean_pod_unwraps_formatting_codes():
    pod = ("=head1 NAME\n\nperlintro - a brief introduction\n\n=head2 Basics\n\n"
           f"{PROSE.replace('scheduler', 'B<scheduler>')} See L<perlsyn|perlsyn/Loops> and C<< $x->method >> "
           "for E<lt>moreE<gt>.\n\n    my $x = 1; # verbatim code block that should not be part of the prose at all\n")
    assert corpus.clean_pod(pod) == PROSE + " See perlsyn and $x->method for <more>."


def test_is_english_prose():
    assert corpus.is_english_prose(" ".join([PROSE] * 2))
    assert not corpus.is_english_prose(PROSE)  # too short for a document
    german = ("Der Planer entscheidet, welche Aufgabe als nächste auf jedem Prozessor läuft, und versucht dabei "
              "jeden Kern auszulasten. ") * 4
    assert not corpus.is_english_prose(german)


def test_piece_writer_splits_a_stream_into_pieces(tmp_path):
    writer = corpus.PieceWriter(tmp_path, "train", piece_tokens=10)
    stream = np.arange(27, dtype=np.uint16)
    for part in (stream[:4], stream[4:19], stream[19:]):
        writer.write(part)
    pieces = writer.close()
    assert [(p["file"], p["tokens"], p["bytes"]) for p in pieces] == [
        ("train_000.bin", 10, 20), ("train_001.bin", 10, 20), ("train_002.bin", 7, 14)]
    joined = np.concatenate([np.fromfile(tmp_path / p["file"], dtype="<u2") for p in pieces])
    np.testing.assert_array_equal(joined, stream)
    with pytest.raises(ValueError, match="piece_tokens"):
        corpus.PieceWriter(tmp_path, "x", piece_tokens=0)


class ByteTokenizer:
    """A stand-in for SmolLM2's tokenizer: one id per byte, EOS = 256."""

    eos_token_id = 256
    name_or_path = "bytes"

    def __len__(self):
        return 257

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        return {"input_ids": [list(t.encode()) for t in texts]}


@pytest.fixture()
def packages(tmp_path, monkeypatch):
    """Two fake unpacked packages: an HTML one (with a duplicate page and a non-English page) and an info one."""
    roots = {}
    for package in ("fake-html-doc", "fake-info-doc"):
        roots[package] = tmp_path / package / "root"
    html_dir = roots["fake-html-doc"] / "usr/share/doc/fake/html"
    html_dir.mkdir(parents=True)
    for i in range(100):
        (html_dir / f"page{i:02d}.html").write_text(f"<p>Page {i}. {PROSE}</p><p>{PROSE} Again {i}.</p>")
    (html_dir / "copy.html").write_text("<p>Page 0. " + PROSE + "</p><p>" + PROSE + " Again 0.</p>")
    (html_dir / "german.html").write_text("<p>" + "Der Planer entscheidet, welche Aufgabe als nächste läuft. " * 9)
    info_dir = roots["fake-info-doc"] / "usr/share/info"
    info_dir.mkdir(parents=True)
    (info_dir / "fake.info.gz").write_bytes(gzip.compress(f"{PROSE}\n\n{PROSE} Info.\n".encode()))
    monkeypatch.setattr(corpus, "debian_package_tree", lambda package: roots[package])
    monkeypatch.setattr(corpus, "debian_package_info", lambda package: {"package": package, "version": "1.0",
                                                                        "deb_bytes": 123, "sha256": "ab" * 32})
    return (corpus.Source("fake-html-doc", "html", ("usr/share/doc/fake/html/*.html",)),
            corpus.Source("fake-info-doc", "info", ("usr/share/info/*.info*.gz",)))


def test_build_corpus_writes_pieces_and_a_manifest(tmp_path, packages):
    out = tmp_path / "out"
    manifest = corpus.build_corpus(out, packages, tokenizer=ByteTokenizer(), piece_tokens=4096, log=lambda m: None)
    html_entry = manifest["packages"]["fake-html-doc"]
    assert html_entry["duplicates_dropped"] == 1  # copy.html repeats page00.html
    assert sum(html_entry["documents"].values()) == 100  # german.html is not English
    assert manifest["packages"]["fake-info-doc"]["version"] == "1.0"
    names = [f"fake-html-doc/usr/share/doc/fake/html/page{i:02d}.html" for i in range(100)]
    assert html_entry["documents"]["heldout"] == sum(split_of(n) == "heldout" for n in names) > 0
    for split in ("train", "heldout"):
        pieces = manifest["files"][split]
        stream = np.concatenate([np.fromfile(out / p["file"], dtype="<u2") for p in pieces])
        per_package = sum(e["tokens"][split] for e in manifest["packages"].values())
        assert stream.size == manifest["tokens"][split] == per_package
        assert (stream == 256).sum() == manifest["documents"][split]  # every document ends with EOS
        assert all(p["tokens"] <= 4096 for p in pieces)
    assert len(manifest["files"]["train"]) > 1 and [p["file"] for p in manifest["files"]["heldout"]] == ["heldout.bin"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    # the same build again, cleaning in two processes, gives the same bytes (stale pieces are removed first)
    again = corpus.build_corpus(out, packages, tokenizer=ByteTokenizer(), piece_tokens=4096, log=lambda m: None,
                                jobs=2)
    assert again["files"] == manifest["files"] and again["packages"] == manifest["packages"]


def test_unknown_package_and_format_are_refused(tmp_path, packages):
    with pytest.raises(ValueError, match="--packages: unknown"):
        corpus.main(["--out", str(tmp_path), "--packages", "no-such-doc"])
    with pytest.raises(ValueError, match="format must be one of"):
        list(corpus.iter_source_documents(corpus.Source("fake-html-doc", "latex", ("*.tex",))))
