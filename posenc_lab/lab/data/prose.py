"""The ``prose`` corpus: English prose from two public-domain texts that Debian packages ship, read offline from
their installed files (or a copy of them): Jane Austen's six novels (``r-cran-janeaustenr``, an R data package, read
with a small reader of R's serialization) and the World English Bible (``sword-text-web``, a SWORD module of
compressed OSIS markup), one document per chapter. :func:`posenc_lab.lab.data.corpora.load_corpus` reads it as ``prose`` or
``prose:FOLDER`` (this module imports nothing from the rest of the package)."""

from __future__ import annotations

import gzip
import os
import re
import struct
import zlib
from pathlib import Path

from posenc_lab.errors import PosencError

PROSE_ENV = "POSENC_PROSE_DIR"
PROSE_INSTALL = "apt-get install r-cran-janeaustenr sword-text-web"
#: folder name in a copied prose folder -> (Debian package, its installed folder, the files read)
PROSE_SOURCES = {
    "janeaustenr": ("r-cran-janeaustenr", "/usr/lib/R/site-library/janeaustenr/data", ("Rdata.rdb", "Rdata.rdx")),
    "engWEB2015eb": ("sword-text-web", "/usr/share/sword/modules/texts/ztext/engWEB2015eb",
                     tuple(f"{t}.{x}" for t in ("ot", "nt") for x in ("bzs", "bzv", "bzz"))),
}
PROSE_META = {
    "source": "debian:r-cran-janeaustenr (Jane Austen's six novels, 1811-1818) + debian:sword-text-web "
              "(World English Bible with Deuterocanon, engWEB2015eb); one document per chapter",
    "licence": "public domain (both texts; janeaustenr's packaging MIT)",
}
_AUSTEN_CHAPTER = re.compile(rb"^(?:CHAPTER|Chapter) [IVXLC\d]+\.?\s*$", re.M)


class _RReader:
    """Just enough of R's XDR serialization (``saveRDS``/lazy-load databases) to read vectors and lists."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def _int(self) -> int:
        self.pos += 4
        return struct.unpack_from(">i", self.data, self.pos - 4)[0]

    def read(self):
        if self.data[:2] != b"X\n":
            raise PosencError("not an R serialization in XDR format")
        self.pos = 2
        version = self._int()
        self._int(), self._int()
        if version == 3:
            self.pos += 4 + self._int()  # the native encoding's name
        return self._item()

    def _item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & 512, flags & 1024
        if kind == 254:  # NULL
            return None
        if kind in (253, 252, 251, 250, 242, 241):  # environments and markers carry no data here
            return None
        if kind == 255:  # a reference to an earlier symbol or environment
            return self.refs[(flags >> 8 or self._int()) - 1]
        if kind == 1:  # symbol
            self.refs.append(self._item())
            return self.refs[-1]
        if kind == 9:  # CHARSXP
            n = self._int()
            self.pos += max(n, 0)
            return None if n == -1 else self.data[self.pos - n : self.pos]
        if kind in (2, 6, 239, 240):  # pairlists: [(tag, value), ...]
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            head, tail = self._item(), self._item()
            return [(tag, head)] + (tail or [])
        if kind in (10, 13):
            n = self._int()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:
            n = self._int()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):
            value = [self._item() for _ in range(self._int())]
        else:
            raise PosencError(f"unsupported R object type {kind}")
        if has_attr:
            attributes = dict(self._item() or [])
            if b"names" in attributes and isinstance(value, list):
                return dict(zip(attributes[b"names"], value))
        return value


def r_lazyload(folder: Path) -> dict[str, object]:
    """The objects of an R package's lazy-load data base (``Rdata.rdx`` index, ``Rdata.rdb`` zlib-compressed
    serializations), by name."""
    index = _RReader(gzip.decompress((folder / "Rdata.rdx").read_bytes())).read()
    database = (folder / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index[b"variables"].items():
        out[name.decode()] = _RReader(zlib.decompress(database[offset + 4 : offset + length])).read()
    return out


def austen_documents(folder: Path) -> list[tuple[str, bytes]]:
    """Jane Austen's novels from janeaustenr's data (one character vector of lines per novel), one document per
    chapter (``austen/emma/07``; the front matter before chapter 1, when there is any, is ``.../00``)."""
    docs = []
    for novel, lines in sorted(r_lazyload(folder).items()):
        text = b"\n".join(line or b"" for line in lines).strip() + b"\n"
        starts = [m.start() for m in _AUSTEN_CHAPTER.finditer(text)]
        pieces = [text[: starts[0]] if starts else text] + [text[a:b] for a, b in zip(starts, starts[1:] + [None])]
        docs += [(f"austen/{novel}/{i:02d}", p.strip() + b"\n") for i, p in enumerate(pieces) if p.strip()]
    return docs


def sword_ztext(folder: Path) -> list[bytes]:
    """The entries (verses, and the headings before them) of a SWORD zText module, in order: ``*.bzs`` lists the
    zlib blocks of ``*.bzz``, ``*.bzv`` each entry's (block, offset, size)."""
    entries = []
    for testament in ("ot", "nt"):
        blocks_index = (folder / f"{testament}.bzs").read_bytes()
        compressed = (folder / f"{testament}.bzz").read_bytes()
        blocks = []
        for k in range(len(blocks_index) // 12):
            offset, size, _ = struct.unpack_from("<III", blocks_index, 12 * k)
            blocks.append(zlib.decompress(compressed[offset : offset + size]))
        verses = (folder / f"{testament}.bzv").read_bytes()
        for k in range(len(verses) // 10):
            block, start, size = struct.unpack_from("<IIH", verses, 10 * k)
            if size:
                entries.append(blocks[block][start : start + size])
    return entries


def osis_text(markup: str) -> str:
    """Plain text from OSIS markup: footnotes dropped, paragraphs, poetry lines and titles end a line."""
    import html

    text = re.sub(r"<note\b.*?</note>", "", markup, flags=re.S).replace("</w><w", "</w> <w")
    text = re.sub(r'<div\b[^>]*\beID="[^"]*"[^>]*/>|<l\b[^>]*\beID="[^"]*"[^>]*/>|</l>|</title>|<lb\b[^>]*/>',
                  "\n", text)
    text = html.unescape(re.sub(r"<[^>]+>", "", text))
    text = re.sub(r"[ \t]*\n[ \t]*", "\n", re.sub(r"[ \t\r\f\v]+", " ", text))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def web_documents(folder: Path) -> list[tuple[str, bytes]]:
    """The World English Bible (SWORD module engWEB2015eb), one document per chapter (``web/Gen.1``); the text
    before the first chapter (the translators' preface) is ``web/preface``."""
    markup = " ".join(e.decode("utf-8") for e in sword_ztext(folder))
    parts = re.split(r'<chapter\b[^>]*\bosisID="([^"]+)"[^>]*\bsID="[^"]*"[^>]*/>', markup)
    named = [("preface", parts[0])] + list(zip(parts[1::2], parts[2::2]))
    docs = [(f"web/{name}", osis_text(body).encode() + b"\n") for name, body in named]
    return [(n, b) for n, b in docs if b.strip()]


def prose_folders(folder: str | None = None) -> dict[str, Path]:
    """Where each prose source is: ``FOLDER/janeaustenr`` and ``FOLDER/engWEB2015eb`` for a copied folder (the
    argument, else ``$POSENC_PROSE_DIR``), else the Debian packages' installed folders."""
    folder = folder or os.environ.get(PROSE_ENV)
    found = {}
    for key, (package, installed, files) in PROSE_SOURCES.items():
        where = Path(folder).expanduser() / key if folder else Path(installed)
        missing = [f for f in files if not (where / f).is_file()]
        if missing:
            how = (f"copy the installed {installed} there" if folder
                   else f"install it ({PROSE_INSTALL}) or name a copied folder (prose:FOLDER or ${PROSE_ENV})")
            raise PosencError(f"the prose corpus's {package} text is missing ({where / missing[0]}): {how}")
        found[key] = where
    return found


def prose_documents(folder: str | None = None) -> tuple[list[tuple[str, bytes]], dict]:
    """Jane Austen's six novels and the World English Bible, one ``(name, bytes)`` document per chapter, and the
    corpus's metadata (source, licence, size); :func:`posenc_lab.lab.data.corpora.load_corpus` makes them the ``prose`` corpus."""
    where = prose_folders(folder)
    docs = austen_documents(where["janeaustenr"]) + web_documents(where["engWEB2015eb"])
    return docs, {**PROSE_META, "total_bytes": sum(len(b) for _, b in docs)}


