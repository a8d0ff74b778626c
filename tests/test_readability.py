"""The book's prose measured: sentence lengths against the targets, and no word of the project's own history."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book"))
import readability  # noqa: E402

CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.md"))
# what a reader of a chapter should never meet: the making of the book instead of its subject
HISTORY = re.compile(r"\bissues? #?\d+|before the corrections?|runs? made before|\bcommit [0-9a-f]{7,}\b|"
                     r"\b[0-9a-f]{7,40}\b(?= \()|earlier sessions?|stop \d+", re.IGNORECASE)


def test_sentences_are_split_at_ends_and_skip_code_math_tables_and_headings():
    text = """---
kernelspec: {}
---
# A heading that is long enough to count if it were prose at all

First sentence, e.g. with an abbreviation. Second one with $x^2$ and `code`!

```{code-cell} ipython3
print("Not prose. At all.")
```

$$
a = b. C = d.
$$

| a | table. Row. |
|---|---|

* A list item
* Another item. With two sentences.

```{exercise}
:label: ex-x

Prose inside an exercise counts.
```

Prose after a directive counts too.

````{note}
A note.
````

Last words.
"""
    got = readability.sentences(text)
    assert got == ["First sentence, e.g. with an abbreviation.", "Second one with X and X!", "A list item",
                   "Another item.", "With two sentences.", "Prose inside an exercise counts.",
                   "Prose after a directive counts too.", "A note.", "Last words."]
    assert readability.words("Second one with X and X!") == 6


def test_the_targets_fail_a_long_sentence():
    long = "word " * 61 + "end."
    s = readability.Stats("x", [long.strip(), "Short one."])
    assert s.longest == 62 and not s.meets()
    assert readability.Stats("y", ["Short one.", "Another short one."]).meets()


@pytest.mark.parametrize("md", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_prose_meets_the_sentence_targets(md):
    s = readability.measure(md)
    worst = sorted(s.sentences, key=readability.words, reverse=True)[:3]
    assert s.meets(), (f"{md.name}: mean {s.mean:.1f} words, {100 * s.share_over_40:.1f} % over 40, longest "
                       f"{s.longest} (targets {readability.TARGETS}); longest: {worst}")


@pytest.mark.parametrize("md", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_speaks_of_encodings_not_of_its_own_making(md):
    nb = json.loads(md.with_suffix(".ipynb").read_text())
    texts = [md.read_text()]
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", "")))
    hits = sorted({m.group(0) for t in texts for m in HISTORY.finditer(t)})
    assert not hits, f"{md.name} speaks of the project's history: {hits}"


def test_prose_lines_give_each_line_at_its_offset_and_leave_out_code_math_and_comments():
    text = ("---\nkernelspec: {}\n---\nProse one.\n<!-- a\ncomment -->\n```{code-cell} ipython3\nx = 1\n```\n"
            "$$\na = b\n$$\n```{note}\nA note.\n```\n```{glossary}\nterm\n  Its definition.\n```\nEnd.")
    got = list(readability.prose_lines(text, skip=("glossary",)))
    kept = [line for _, line in got if line]
    assert kept == ["Prose one.", "A note.", "End."]
    assert all(text[at:at + len(line)] == line for at, line in got)
    assert "Its definition." in [line.strip() for _, line in readability.prose_lines(text)]
