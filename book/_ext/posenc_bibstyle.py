"""Sphinx helper: the bibliography page labels its entries by author and year, as the text cites them.

The chapters cite with ``bibtex_reference_style: author_year`` ("Press et al., 2022"), but the
bibliography's own labels come from the pybtex formatting style, whose default (``alpha``) gives
labels such as "PSL22". This extension registers the formatting style ``posenc-author-year``:
pybtex's ``unsrt`` formatting, entries sorted by author and year, labelled "Press et al. 2022"
("Kingma and Ba 2015" for two authors; a letter after the year where two entries would share a
label). ``_config.yml`` selects it with ``bibtex_default_style``.
"""

from __future__ import annotations

from collections import Counter

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from sphinx.application import Sphinx

NAME = "posenc-author-year"


def _plain(latex: str) -> str:
    """A name as text: braces and accents of its BibTeX form resolved (``Del{\\'e}tang`` -> Delétang)."""
    return Text.from_latex(latex).render_as("text")


def author_year(entry) -> str:
    """``Surname Year``, ``Surname and Surname Year`` or ``Surname et al. Year``."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    names = [_plain(" ".join(p.last_names) or " ".join(p.first_names)) for p in people]
    if not names:
        who = entry.key
    elif len(names) == 1:
        who = names[0]
    elif len(names) == 2 and names[1] != "others":
        who = f"{names[0]} and {names[1]}"
    else:
        who = f"{names[0]} et al."
    return f"{who} {entry.fields.get('year', 'n.d.')}"


class AuthorYearLabels(BaseLabelStyle):
    """Labels "Surname et al. Year", made unique by a letter after the year."""

    def format_labels(self, sorted_entries):
        entries = list(sorted_entries)
        labels = [author_year(entry) for entry in entries]
        counts, seen = Counter(labels), Counter()
        for label in labels:
            if counts[label] > 1:
                seen[label] += 1
                label = f"{label}{'abcdefghijklmnopqrstuvwxyz'[seen[label] - 1]}"
            yield label


class AuthorYearStyle(UnsrtStyle):
    """pybtex's ``unsrt`` entries, sorted by author, year and title, with :class:`AuthorYearLabels`."""

    default_label_style = AuthorYearLabels
    default_sorting_style = "author_year_title"


register_plugin("pybtex.style.formatting", NAME, AuthorYearStyle)


def setup(app: Sphinx) -> dict:
    return {"parallel_read_safe": True, "parallel_write_safe": True}
