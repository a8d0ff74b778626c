"""Every term defined before it is used: the glossary page names the book's terms, and each page of the book (the
landing page, the tour and the chapters, in the order of _toc.yml) links a term to the glossary at its first use in
prose. The terms are read from book/glossary.md itself (book/terms.py), so this test cannot drift from the page."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book"))
import terms  # noqa: E402

ENTRIES = terms.glossary()
PAGES = terms.checked_pages()
#: the terms the first read found used before they were explained; the glossary must define each
REQUIRED = ("sliding windows", "non-overlapping windows", "growth", "log growth", "floor", "equivalence", "margin",
            "Holm", "Benjamini–Hochberg", "seed", "unit", "effective context length", "perplexity", "training length",
            "extrapolation", "not resolved", "mode-dependent", "intersection–union test", "line for breaking")


def page_with(tmp_path, body: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text("---\njupytext: {}\n---\n\n# A title with sliding windows\n\n" + body, encoding="utf-8")
    return page


def unlinked(page: Path) -> list[str]:
    return [u.entry.name for u in terms.first_uses(page, ENTRIES)]


def test_the_glossary_defines_every_term_the_first_read_stumbled_on():
    names = {t.lower() for e in ENTRIES for t in e.terms}
    missing = [t for t in REQUIRED if t.lower() not in names]
    assert not missing, f"book/glossary.md lacks {missing}"
    assert len(names) == sum(len(e.terms) for e in ENTRIES), "a term appears in two entries"


def test_the_glossary_and_the_tour_open_the_book():
    pages = [p.relative_to(ROOT).as_posix() for p in terms.toc_pages()]
    assert pages[:3] == ["book/intro.md", "notebooks/00_tour.md", "book/glossary.md"]
    assert PAGES[0].name == "intro.md" and PAGES[1].name == "00_tour.md" and len(PAGES) == 16


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_page_links_a_glossary_term_at_its_first_use(page):
    found = terms.first_uses(page, ENTRIES)
    assert not found, "a term is used before the page links the glossary ({term}`...`): " + "; ".join(map(str, found))


def test_every_term_link_names_a_glossary_term():
    names = {t.lower() for e in ENTRIES for t in e.terms}
    for page in terms.toc_pages():
        for body in re.findall(r"\{term\}`([^`]+)`", page.read_text(encoding="utf-8")):
            target = re.search(r"<([^>]+)>\s*$", body)
            name = re.sub(r"\s+", " ", (target.group(1) if target else body).strip().lower())
            assert name in names, f"{page.name}: {{term}}`{body}` names no glossary term"


def test_a_use_in_prose_before_its_link_is_found(tmp_path):
    page = page_with(tmp_path, "Each claim is decided in sliding windows.\n\n"
                               "Later we link {term}`sliding windows`, and use seeds, {term}`seeds <seed>`.\n")
    assert unlinked(page) == ["sliding windows", "seed"]


def test_a_link_before_the_use_introduces_the_term_and_any_of_its_forms(tmp_path):
    page = page_with(tmp_path, "The {term}`growth factor <growth>` of RoPE; its log growth and growth follow.\n\n"
                               "Five {term}`seeds <seed>`, then every seed.\n")
    assert unlinked(page) == []


def test_code_math_headings_and_images_are_not_prose(tmp_path):
    page = page_with(tmp_path, "```{code-cell} ipython3\nprint('sliding windows, seed 0')\n```\n\n"
                               "$$\n\\text{perplexity} = e^{\\text{loss}}\n$$\n\n"
                               "Inline `seed` code and $\\text{perplexity}$ math.\n\n"
                               "## Holm's correction\n\n"
                               "![a figure of Holm and the floor](figure.png)\n\n"
                               "<!-- a comment about Holm -->\n")
    assert unlinked(page) == []


def test_tables_notes_and_wrapped_lines_are_prose(tmp_path):
    page = page_with(tmp_path, "| claim | answer |\n|---|---|\n| a training length | holds |\n\n"
                               "```{note}\nA note on Holm.\n```\n\n"
                               "Scored in non-overlapping\nwindows, and Benjamini-Hochberg too.\n")
    assert unlinked(page) == ["training length", "Holm", "non-overlapping windows", "Benjamini–Hochberg"]


def test_everyday_uses_the_glossary_names_are_not_the_term(tmp_path):
    """The glossary's "Not ..." sentences name the other meanings of a word (the unit circle, a content margin)."""
    unit = next(e for e in ENTRIES if e.name == "unit")
    assert "unit circle" in unit.not_terms
    page = page_with(tmp_path, "A point on the unit circle, a score margin, by a wide margin.\n\n"
                               "Then the units ran.\n")
    assert unlinked(page) == ["unit"]


#: the glossary name of each encoding and RoPE strategy of the headline run, by its label in the results
ENCODING_NAMES = {"nope": "NoPE", "sinusoidal": "sinusoids", "rope/none": "RoPE", "rope/pi": "PI",
                  "rope/ntk": "NTK-aware scaling", "rope/dynamic-ntk": "dynamic NTK", "rope/yarn": "YaRN",
                  "alibi": "ALiBi", "t5": "T5"}


def test_every_encoding_of_the_headline_run_has_a_name_entry_that_links_its_chapter():
    """The README's and the tour's rows name each encoding and strategy; the glossary explains each one, in its
    section of names, and points to the chapter that derives it (or to the term that does)."""
    from posenc_lab.lab import readme
    from posenc_lab.lab.verdicts.statistics import label

    labels = {label(r) for r in readme.rows_of(readme.HEADLINE)}
    assert labels == set(ENCODING_NAMES), labels
    by_term = {t: e for e in ENTRIES for t in e.terms}
    for name in ENCODING_NAMES.values():
        entry = by_term[name]
        assert entry.name_only, f"{name} is not in the section {terms.NAMES_SECTION!r}"
        assert re.search(r"See \[[^\]]+\]\(\.\./notebooks/\d\d_\w+\)|See \{term\}", entry.definition), name


def test_a_name_is_checked_on_the_first_pages_only(tmp_path, monkeypatch):
    """A chapter derives the encodings it is about and need not link their names; the landing page and the tour
    must, as they must any term."""
    assert [p.name for p in terms.NAME_PAGES] == ["intro.md", "00_tour.md"]
    assert all(p in terms.checked_pages() for p in terms.NAME_PAGES)
    page = page_with(tmp_path, "RoPE turns pairs; ALiBi adds a line, over a {term}`training length`.\n")
    assert unlinked(page) == []
    monkeypatch.setattr(terms, "NAME_PAGES", (page,))
    assert unlinked(page) == ["RoPE", "ALiBi"]
