"""The glossary's terms and where each page first uses them: a term is used when its words appear in prose, and a page
introduces it by linking the glossary (``{term}`...```) at that first use.

    python book/terms.py                       # every checked page, in the book's order: first uses not linked
    python book/terms.py notebooks/08_experiment.md

The terms come from the glossary page itself (``book/glossary.md``): each entry of its ``{glossary}`` directives is one
or more term lines and an indented definition; any of an entry's terms links the entry. A definition's sentence that
starts with "Not" names, in italics, everyday uses of the same word that are not the term (``*unit circle*``).
The entries under the heading :data:`NAMES_SECTION` are the encodings' and strategies' names (RoPE, ALiBi, YaRN).
Every chapter uses several of them and derives its own, so only :data:`NAME_PAGES`, the pages a newcomer reads
first, must link them at their first use.

Prose is the Markdown outside code cells and fenced code, display and inline math, inline code, headings, HTML
comments, front matter, images and directive option lines; tables and the text of notes, exercises and figure
captions count. A term matches its words in any case, with spaces and hyphens alike, and a plural ending.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readability import _ITEM, prose_lines  # noqa: E402  the one scanner of MyST prose

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "book" / "glossary.md"
#: the glossary's section of names, and the pages that must link each name at its first use
NAMES_SECTION = "The encodings by name"
NAME_PAGES = (ROOT / "book" / "intro.md", ROOT / "notebooks" / "00_tour.md")

_ROLE = re.compile(r"\{(?P<role>[\w:-]+)\}`(?P<body>[^`]*)`")
_BLANKED = [re.compile(p, re.S) for p in (r"!\[[^\]]*\]\([^)]*\)",  # images, alt text and all
                                          r"(?<=\])\([^)\s]*\)",      # a link's target (its text stays prose)
                                          r"`[^`]*`",                  # inline code
                                          r"\$\$.*?\$\$|\$[^$]+\$",   # inline math
                                          r"<[^>\n]+>")]               # inline HTML


@dataclass(frozen=True)
class Entry:
    """One glossary entry: its terms (the first is its name) and the phrases that use a term's word otherwise."""

    terms: tuple[str, ...]
    not_terms: tuple[str, ...] = ()
    #: a name of :data:`NAMES_SECTION`: its first use is checked on :data:`NAME_PAGES` only
    name_only: bool = False
    #: the definition's text, its lines joined
    definition: str = ""

    @property
    def name(self) -> str:
        return self.terms[0]

    def pattern(self) -> re.Pattern:
        return re.compile("|".join(_term_regex(t) for t in sorted(self.terms, key=len, reverse=True)), re.I)


def _term_regex(term: str) -> str:
    words = [re.escape(w) for w in re.split(r"[\s\-–]+", term)]
    last = words[-1]
    if re.search(r"[^aeiou]y$", term):
        last = last[:-1] + "(?:y|ies)"
    elif term[-1].isalpha():
        last += "(?:s|es)?"
    return r"(?<![\w])" + r"[\s\-–]+".join(words[:-1] + [last]) + r"(?![\w])"


def glossary(path: Path = GLOSSARY) -> list[Entry]:
    """Every entry of the ``{glossary}`` directives of ``path``."""
    entries, terms, body, inside, section = [], [], [], False, ""

    def close():
        if terms:
            nots = [phrase for sentence in re.split(r"(?<=\.)\s+", " ".join(body)) if sentence.startswith("Not ")
                    for phrase in re.findall(r"\*([^*]+)\*", sentence)]
            entries.append(Entry(tuple(terms), tuple(nots), name_only=section == NAMES_SECTION,
                                 definition=" ".join(body)))
        terms.clear()
        body.clear()

    for line in path.read_text(encoding="utf-8").splitlines():
        if not inside and line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```{glossary}"):
            inside = True
            continue
        if inside and line.startswith("```"):
            close()
            inside = False
            continue
        if not inside or not line.strip() or line.startswith(":"):
            continue
        if line[0].isspace():
            body.append(line.strip())
        else:
            if body:
                close()
            terms.append(line.strip())
    return entries


def toc_pages(root: Path = ROOT) -> list[Path]:
    """The book's pages in the order of ``_toc.yml``."""
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]

    def walk(items):
        for item in items or []:
            if "file" in item:
                files.append(item["file"])
            walk(item.get("sections"))
            walk(item.get("chapters"))

    walk(toc.get("parts"))
    return [root / f"{f}.md" for f in files]


def checked_pages(root: Path = ROOT) -> list[Path]:
    """The pages whose first uses are checked, in the book's order: the landing page and every notebook page (the tour
    and the chapters). The README is not a book page; the appendix and the package reference are left out."""
    return [p for p in toc_pages(root) if p.parent.name == "notebooks" or p == root / "book" / "intro.md"]


def paragraphs(text: str) -> list[tuple[int, str]]:
    """The prose of a MyST page as ``(offset, paragraph)``: each paragraph's offset in ``text``; the paragraph keeps
    its line breaks, so that an offset inside it maps back to the file. The lines are book/readability.py's
    (``prose_lines``, a glossary's definitions left out); a table's rule line and an image line end a paragraph, a table's rows are prose."""
    out, current, start = [], [], None

    def flush():
        nonlocal current, start
        if current:
            out.append((start, "\n".join(current)))
        current, start = [], None

    for here, raw in prose_lines(text, skip=("glossary",)):
        line = raw.strip()
        if not line or line.startswith(("|---", "![")):
            flush()
            continue
        if _ITEM.match(line):
            flush()
        if start is None:
            start = here
        current.append(raw)
    flush()
    return out


@dataclass(frozen=True)
class Use:
    """A term's first use on a page that does not link the glossary."""

    page: Path
    entry: Entry
    offset: int
    text: str
    line: int
    in_link_text: bool

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.text!r} ({self.entry.name}) is not linked"


def _events(paragraph: str, entries: list[Entry]) -> list[tuple[int, str, Entry, str, bool]]:
    """``(position, "link" or "use", entry, matched text, inside a link's text)`` of one paragraph, in order."""
    by_term = {t.lower(): e for e in entries for t in e.terms}
    events = []
    clean = list(paragraph)

    def blank(a, b):
        clean[a:b] = " " * (b - a)

    for m in _ROLE.finditer(paragraph):
        if m.group("role") == "term":
            body = m.group("body")
            target = re.search(r"<([^>]+)>\s*$", body)
            name = (target.group(1) if target else body).strip().lower()
            name = re.sub(r"\s+", " ", name)
            if name in by_term:
                events.append((m.start(), "link", by_term[name], body, False))
        blank(m.start(), m.end())
    links = [(m.start(), m.end()) for m in re.finditer(r"(?<!!)\[[^\]]*\](?=\()", "".join(clean))]
    for rx in _BLANKED:
        for m in rx.finditer("".join(clean)):
            blank(m.start(), m.end())
    text = "".join(clean)
    for e in entries:
        masked = text
        for phrase in e.not_terms:
            masked = re.sub(_term_regex(phrase), lambda m: " " * len(m.group(0)), masked, flags=re.I)
        for m in e.pattern().finditer(masked):
            inside = any(a < m.start() < b for a, b in links)
            events.append((m.start(), "use", e, m.group(0), inside))
    return sorted(events, key=lambda x: (x[0], x[1] == "use"))


def first_uses(page: Path, entries: list[Entry] | None = None) -> list[Use]:
    """Every entry whose first use on ``page`` comes before any link to it, at that first use. The names
    (:attr:`Entry.name_only`) count on :data:`NAME_PAGES` only; elsewhere a link to one still counts as a link."""
    entries = glossary() if entries is None else entries
    if page.resolve() not in {p.resolve() for p in NAME_PAGES}:
        entries = [e for e in entries if not e.name_only]
    text = page.read_text(encoding="utf-8")
    linked, reported, out = set(), set(), []
    for offset, paragraph in paragraphs(text):
        for pos, kind, entry, matched, inside in _events(paragraph, entries):
            if kind == "link":
                linked.add(entry.name)
            elif entry.name not in linked and entry.name not in reported:
                reported.add(entry.name)
                at = offset + pos
                out.append(Use(page, entry, at, matched, text.count("\n", 0, at) + 1, inside))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="pages (default: every checked page, in the book's order)")
    args = parser.parse_args(argv)
    entries = glossary()
    found = [u for p in (args.paths or checked_pages()) for u in first_uses(p.resolve(), entries)]
    for use in found:
        print(use)
    print(f"{len(entries)} entries; {len(found)} first uses not linked")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
