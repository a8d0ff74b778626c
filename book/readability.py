"""Sentence lengths of the book's prose: per chapter, the mean words per sentence, the share over 40 words and
the longest sentence.

    python book/readability.py                 # every chapter, the README and the landing page
    python book/readability.py notebooks/03_rope.md --longest 5

Prose is the Markdown outside code cells and fenced code, display math, tables, headings, HTML comments,
front matter and directive lines (a directive's fence and its ``:option:`` lines; the text inside an
exercise, a note or a figure caption is prose and counts). Inline math and inline code count as one word.
A sentence ends at ``.``, ``!`` or ``?`` followed by a space and a capital, a digit or an opening bracket, at
a blank line and at the end of a list item.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the book's targets, held by tests/test_readability.py
TARGETS = {"mean": 20.0, "share_over_40": 0.05, "longest": 60}
_LONG = 40
# fenced blocks whose content is not prose
_NOT_PROSE = re.compile(r"^(`{3,}|~{3,}|:{3,})\s*(\{(code-cell|code|code-block|math|raw|list-table|csv-table|"
                        r"literalinclude|bibliography|tableofcontents|mermaid)\}|[a-z0-9+-]*\s*$)")
_FENCE = re.compile(r"^(`{3,}|~{3,}|:{3,})")
_ITEM = re.compile(r"^([*+-]|\d+[.)])\s+")
_END = re.compile(r"(?<=[.!?])[\"')\]*_]*\s+(?=[\"'(\[*_]*[A-Z0-9(])")
_ABBREVIATIONS = ("e.g.", "i.e.", "et al.", "cf.", "vs.", "Fig.", "Eq.", "eq.", "approx.", "resp.", "No.")


@dataclass
class Stats:
    name: str
    sentences: list[str]

    @property
    def lengths(self) -> list[int]:
        return [words(s) for s in self.sentences]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.lengths) if self.sentences else 0.0

    @property
    def share_over_40(self) -> float:
        return sum(n > _LONG for n in self.lengths) / len(self.sentences) if self.sentences else 0.0

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    def meets(self, targets: dict = TARGETS) -> bool:
        return (self.mean <= targets["mean"] and self.share_over_40 <= targets["share_over_40"]
                and self.longest <= targets["longest"])


def words(sentence: str) -> int:
    """Words of a sentence: whitespace-separated tokens that hold a letter or a digit."""
    return sum(bool(re.search(r"[A-Za-z0-9]", t)) for t in sentence.split())


def prose_lines(text: str, skip: tuple[str, ...] = ()) -> Iterator[tuple[int, str]]:
    """The lines of a MyST document that may hold prose, as ``(offset, line)`` with each line's offset in ``text``.

    Front matter, HTML comments, code cells and other non-prose fences, display math (``$$``) and the fence and
    option lines of a directive are left out; the text inside a prose directive (an exercise, a note, a figure
    caption) is kept. A line that ends a paragraph (a blank line, a heading, a fence, display math, a comment, a
    directive option, a label, ``+++``, an HTML line) comes as ``(offset, "")``. Each caller decides further what
    counts (tables, images, footnotes). ``skip`` names further directives whose text is left out (``"glossary"``)."""
    skip_fence, in_math, in_comment = None, False, False
    lines = text.split("\n")
    front = bool(lines) and lines[0].strip() == "---"
    open_prose: list[str] = []  # the fences of the prose directives (exercise, note, figure ...) now open
    offset = 0
    for i, raw in enumerate(lines):
        here, offset = offset, offset + len(raw) + 1
        line = raw.strip()
        if front:
            front = not (i > 0 and line == "---")
            continue
        if in_comment:
            in_comment = "-->" not in line
            continue
        if skip_fence:
            if line.startswith(skip_fence) and line.strip(skip_fence[0]) == "":
                skip_fence = None
            continue
        if in_math:
            in_math = not line.endswith("$$")
            continue
        if line.startswith("<!--"):
            in_comment = "-->" not in line
            yield here, ""
            continue
        if line.startswith("$$"):
            in_math = not (len(line) > 2 and line.endswith("$$"))
            yield here, ""
            continue
        fence = _FENCE.match(line)
        if fence:
            if open_prose and line == open_prose[-1]:  # the end of a prose directive, not a code block
                open_prose.pop()
            elif _NOT_PROSE.match(line) or any(line.startswith(f"{fence.group(1)}{{{d}}}") for d in skip):
                skip_fence = fence.group(1)
            else:
                open_prose.append(fence.group(1))
            yield here, ""
            continue
        if (not line or line.startswith(("#", "<", "+++")) or re.match(r"^:[\w-]+:", line)
                or re.match(r"^\(\S+\)=$", line)):
            yield here, ""
            continue
        yield here, raw


def prose_blocks(text: str) -> list[str]:
    """The prose of a Markdown (MyST) document as paragraphs and list items, markup reduced to words (tables and
    footnote definitions left out)."""
    blocks, current = [], []

    def flush():
        if current:
            blocks.append(" ".join(current))
            current.clear()

    for _, raw in prose_lines(text):
        line = raw.strip()
        if not line or line.startswith("|") or line.startswith("[^") and "]:" in line:
            flush()
            continue
        if _ITEM.match(line):  # a list item starts a block of its own
            flush()
            line = _ITEM.sub("", line)
        current.append(line)
    flush()
    return [_plain(b) for b in blocks if _plain(b)]


def _plain(block: str) -> str:
    block = re.sub(r"\$[^$]+\$", "X", block)                    # inline math: one word
    block = re.sub(r"`[^`]+`", "X", block)                      # inline code, roles' targets
    block = re.sub(r"\{[\w:-]+\}X", "X", block)                 # {cite}`...`, {ref}`...`
    block = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", block)    # links and images: their text
    block = re.sub(r"<[^>]+>", " ", block)                      # inline HTML
    return re.sub(r"\s+", " ", block).strip()


def sentences(text: str) -> list[str]:
    """The prose sentences of a Markdown document."""
    out = []
    for block in prose_blocks(text):
        protected = block
        for abbreviation in _ABBREVIATIONS:
            protected = protected.replace(abbreviation, abbreviation.replace(".", "\u2024"))
        for piece in _END.split(protected):
            piece = piece.replace("\u2024", ".").strip()
            if words(piece):
                out.append(piece)
    return out


def measure(path: Path) -> Stats:
    return Stats(path.name, sentences(path.read_text(encoding="utf-8")))


def default_paths() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.md")) + [ROOT / "book" / "intro.md", ROOT / "README.md"]


def table(stats: list[Stats]) -> str:
    rows = ["| document | sentences | mean words | over 40 | longest | meets targets |", "|---|---|---|---|---|---|"]
    for s in stats:
        rows.append(f"| {s.name} | {len(s.sentences)} | {s.mean:.1f} | {100 * s.share_over_40:.1f} % | {s.longest} | "
                    f"{'yes' if s.meets() else 'no'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="Markdown files (default: the chapters, intro, README)")
    parser.add_argument("--longest", type=int, default=0, metavar="K", help="also print each file's K longest sentences")
    args = parser.parse_args(argv)
    stats = [measure(p) for p in (args.paths or default_paths())]
    print(f"targets: mean <= {TARGETS['mean']:.0f} words, <= {100 * TARGETS['share_over_40']:.0f} % over "
          f"{_LONG} words, none over {TARGETS['longest']}")
    print(table(stats))
    for s in stats if args.longest else ():
        print(f"\n{s.name}:")
        for sentence in sorted(s.sentences, key=words, reverse=True)[: args.longest]:
            print(f"  [{words(sentence)}] {sentence}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
