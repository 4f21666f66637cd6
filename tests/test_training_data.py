"""The offline text: reST cleaning, the deterministic split, and the cached Debian fetch."""

import pytest

from s2_models.training import data

RST = """\
.. _tut-classes:

*******
Classes
*******

Classes provide a means of bundling data and functionality together. See :ref:`the tutorial <tut-intro>` and
``self`` for details, or read `the docs <https://docs.python.org>`_ about *instances* today.

.. note::

   This directive body is skipped entirely, however long and wordy it happens to be.

Here is an example of a class definition written in Python code::

    class Foo:
        pass

+------+------+
| a    | b    |
+------+------+

Short line.
"""


def test_clean_rst_keeps_prose_and_strips_markup():
    text = data.clean_rst(RST)
    paragraphs = text.split("\n\n")
    assert paragraphs[0] == (
        "Classes provide a means of bundling data and functionality together. See the tutorial and self for "
        "details, or read the docs about instances today."
    )
    assert paragraphs[1] == "Here is an example of a class definition written in Python code:"
    assert len(paragraphs) == 2  # the directive body, code, table, title and short line are gone


def test_split_is_deterministic_and_holds_out_a_few_percent():
    names = [f"pkg/doc{i}.rst.txt" for i in range(2000)]
    splits = [data.split_of(n) for n in names]
    assert splits == [data.split_of(n) for n in names]
    assert 0.02 < splits.count("heldout") / len(names) < 0.08
    with pytest.raises(ValueError, match="split must be one of"):
        next(data.iter_documents("validation"))


def test_real_documents_are_disjoint_english_text():
    try:
        heldout = {d.name for d in data.iter_documents("heldout")}
    except RuntimeError as e:
        pytest.skip(f"Debian archive unreachable and nothing cached: {e}")
    first_train = [d for _, d in zip(range(50), data.iter_documents("train"))]
    assert len(heldout) > 50 and not heldout & {d.name for d in first_train}
    words = " ".join(d.text for d in first_train).split()
    assert len(words) > 10_000
    common = sum(w.lower() in {"the", "and", "of", "to", "is", "a"} for w in words) / len(words)
    assert common > 0.1, common  # English prose, not code or markup
    assert len(data.heldout_text(1000)) == 1000


def test_max_train_samples_counts_training_rows_after_the_split(tmp_path):
    """As in run_clm: the validation rows are split off first, then --max_train_samples caps what is left."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'{{"text": "document number {i} with some words"}}\n' for i in range(40)))
    train, validation = data.load_text_splits(train_files=[str(path)], validation_split_percentage=20,
                                              max_train_samples=30)
    assert len(train) == 30 and len(validation) == 8
    assert not set(train["text"]) & set(validation["text"])
