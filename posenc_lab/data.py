"""Corpora as byte streams: the embedded default, any local text, and WikiText-103 when online.

* Tokens are bytes (vocabulary 256): nothing to download, nothing to train.
* ``stdlib`` (the default): the ``.py`` files of the running Python's standard library, without its
  test suites, so it exists offline everywhere, Colab included. Its Python version and a SHA-256 of
  its contents go into every result, so that runs on different Pythons are never mistaken for
  comparable ones.
* A path: a text file, or a folder of text files (binary files are skipped).
* ``stdlib:FOLDER`` (optionally ``stdlib:FOLDER@3.11.7``): the same corpus read from another Python's standard
  library folder, so that a machine whose own Python differs trains on the same bytes (same SHA-256).
* ``prose`` (or ``prose:FOLDER``, or the folder in ``$POSENC_PROSE_DIR``): English prose from two Debian packages,
  read offline from their installed files: Jane Austen's six novels (``r-cran-janeaustenr``) and the World English
  Bible (``sword-text-web``), both public domain, one document per chapter. See :data:`PROSE_SOURCES`.
* ``wikitext-103``: the ALiBi paper's benchmark, through the optional ``datasets`` package.
* Splits are by document, deterministic (a hash of the document's name), never across documents;
  WikiText keeps its official splits. Documents are joined with a ``0x00`` byte between them.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import struct
import sys
import sysconfig
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import PosencError

SPLITS = ("train", "valid", "test")
SEPARATOR = b"\x00"
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    name: str
    documents: dict[str, list[tuple[str, bytes]]]  # split -> [(document name, bytes)]
    meta: dict = field(default_factory=dict)

    def stream(self, split: str) -> torch.Tensor:
        """The split's documents joined by ``SEPARATOR``, as a uint8 tensor of byte tokens."""
        if split not in SPLITS:
            raise PosencError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        data = SEPARATOR.join(body for _, body in self.documents[split])
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()

    def describe(self) -> dict:
        """The corpus's name, metadata and the size of each split in bytes and documents, as recorded with every
        result."""
        sizes = {s: sum(len(b) for _, b in docs) for s, docs in self.documents.items()}
        return {"corpus": self.name, **self.meta, **{f"{s}_bytes": n for s, n in sizes.items()},
                **{f"{s}_documents": len(d) for s, d in self.documents.items()}}


def split_of(name: str, fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)) -> str:
    """Deterministic split of a document by the SHA-1 of its name (same on every machine and Python)."""
    u = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big") / 2**64
    return SPLITS[0] if u < fractions[0] else SPLITS[1] if u < fractions[0] + fractions[1] else SPLITS[2]


def content_hash(documents: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 over the documents' names and contents, whatever their order: the corpus's identity in the results."""
    h = hashlib.sha256()
    for name, body in sorted(documents):
        h.update(name.encode() + b"\x00" + hashlib.sha256(body).digest())
    return h.hexdigest()


def from_documents(name: str, documents: list[tuple[str, bytes]], meta: dict | None = None) -> Corpus:
    """Split named documents by :func:`split_of`; an empty corpus is an error."""
    documents = [(n, b) for n, b in documents if b]
    if not documents:
        raise PosencError(f"corpus {name!r} has no text")
    splits = {s: [] for s in SPLITS}
    for doc in sorted(documents):
        splits[split_of(doc[0])].append(doc)
    for s in SPLITS:
        if not splits[s]:
            raise PosencError(f"corpus {name!r} is too small: its {s} split got no document "
                              f"({len(documents)} documents in all; splits are by document)")
    return Corpus(name, splits, {"sha256": content_hash(documents), **(meta or {})})


def stdlib_documents(root: Path | str | None = None) -> list[tuple[str, bytes]]:
    """The ``.py`` files of a standard library folder (the running Python's by default), without its test suites, as
    ``(name, bytes)`` pairs."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _STDLIB_SKIP.intersection(rel.parts):
            continue
        try:
            docs.append((rel.as_posix(), path.read_bytes()))
        except OSError:
            continue
    return docs


def stdlib_version(root: Path) -> str:
    """The Python version of a standard library folder: ``PY_VERSION`` of the ``patchlevel.h`` beside it
    (``../../include/pythonX.Y/``) when there is one, else the ``X.Y`` of the folder's name ``pythonX.Y``."""
    match = re.fullmatch(r"python(\d+\.\d+)", root.name)
    for header in ([root.parent.parent / "include" / root.name / "patchlevel.h"] if match else []):
        try:
            found = re.search(rb'#define\s+PY_VERSION\s+"([^"]+)"', header.read_bytes())
        except OSError:
            continue
        if found:
            return found.group(1).decode()
    if match:
        return match.group(1)
    raise PosencError(f"cannot tell the Python version of the standard library at {str(root)!r}: name the "
                      "version, as in stdlib:/path/to/lib/python3.11@3.11.7")


def stdlib_corpus(folder: str | None = None) -> Corpus:
    """``stdlib`` from the running Python, or ``stdlib:FOLDER[@VERSION]`` from another Python's library folder."""
    if folder is None:
        root, version = None, ".".join(map(str, sys.version_info[:3]))
    else:
        folder, _, version = folder.partition("@")
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise PosencError(f"standard library folder {folder!r} does not exist")
        version = version or stdlib_version(root)
    return from_documents("stdlib", stdlib_documents(root), {"python": version, "source": "python stdlib *.py"})


def _is_text(body: bytes) -> bool:
    if b"\x00" in body[:8192]:
        return False
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def path_documents(path: Path) -> list[tuple[str, bytes]]:
    """The text files at ``path`` (a file, or every file under a folder) as ``(name, bytes)`` pairs; binary files
    are skipped."""
    if not path.exists():
        raise PosencError(f"corpus path {str(path)!r} does not exist")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    docs = [(p.relative_to(path).as_posix() if path.is_dir() else p.name, p.read_bytes()) for p in files]
    return [(n, b) for n, b in docs if _is_text(b)]


def wikitext_articles(lines: Iterable[str]) -> list[str]:
    """Group WikiText rows into articles: a new article starts at each top-level heading ``= Title =``."""
    articles: list[list[str]] = []
    for line in lines:
        stripped = line.strip()
        top_heading = stripped.startswith("= ") and stripped.endswith(" =") and not stripped.startswith("= =")
        if top_heading or not articles:
            articles.append([])
        articles[-1].append(line)
    return ["".join(a) for a in articles if "".join(a).strip()]


def wikitext_corpus(config: str = "wikitext-103-raw-v1", loader: Callable | None = None) -> Corpus:
    """WikiText through ``datasets.load_dataset("wikitext", config)``, its official splits kept, one document per article."""
    if loader is None:
        try:
            from datasets import load_dataset
        except ImportError:
            raise PosencError("the wikitext corpora need the optional 'datasets' package: "
                              "pip install 'posenc-lab[network]' (and a network connection)") from None
        loader = load_dataset
    try:
        dataset = loader("wikitext", config)
    except Exception as err:  # network, hub or cache trouble: say which corpus and why
        raise PosencError(f"could not load WikiText ({config}): {err}") from None
    names = {"train": "train", "valid": "validation", "test": "test"}
    documents = {}
    for split, hf_split in names.items():
        articles = wikitext_articles(dataset[hf_split]["text"])
        documents[split] = [(f"{split}/{i:06d}", a.encode()) for i, a in enumerate(articles)]
    everything = [d for docs in documents.values() for d in docs]
    if not all(documents.values()):
        raise PosencError(f"WikiText ({config}) has an empty split")
    return Corpus(config.removesuffix("-raw-v1").removesuffix("-v1"), documents,
                  {"sha256": content_hash(everything), "source": f"datasets:wikitext/{config}"})


# --- English prose: two public-domain texts shipped by Debian packages, read from their installed files ---------------

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


def prose_corpus(folder: str | None = None) -> Corpus:
    """``prose``: Jane Austen's six novels and the World English Bible, one document per chapter, split by name."""
    where = prose_folders(folder)
    docs = austen_documents(where["janeaustenr"]) + web_documents(where["engWEB2015eb"])
    return from_documents("prose", docs, {**PROSE_META, "total_bytes": sum(len(b) for _, b in docs)})


def load_corpus(spec: str = "stdlib") -> Corpus:
    """``stdlib`` (default, offline), ``stdlib:FOLDER[@VERSION]``, ``prose`` / ``prose:FOLDER`` (offline, Debian
    packages), ``wikitext-103`` / ``wikitext-2`` (network), or a path to text."""
    if spec == "stdlib" or spec.startswith("stdlib:"):
        return stdlib_corpus(spec.partition(":")[2] or None)
    if spec == "prose" or spec.startswith("prose:"):
        return prose_corpus(spec.partition(":")[2] or None)
    if spec in ("wikitext-103", "wikitext-2"):
        return wikitext_corpus(f"{spec}-raw-v1")
    path = Path(spec).expanduser()
    return from_documents(path.name or str(path), path_documents(path), {"source": str(path.resolve())})


@dataclass
class EvalText:
    """The evaluation text: ``context`` bytes of lead-in, then the scored bytes, one document index per byte.

    ``stream`` holds the bytes (uint8), ``documents[i]`` the index in ``names`` of the document byte
    ``i`` comes from (the separator before a document counts as that document's), ``cap`` the most
    bytes taken from one document.
    """

    stream: torch.Tensor
    documents: torch.Tensor
    names: list[str]
    context: int
    tokens: int
    cap: int

    def describe(self) -> dict:
        """What every result records about the text: scored bytes, context, document cap, the number of documents
        scored from, and a SHA-256 of the bytes read."""
        scored = self.documents[self.context + 1 : self.context + self.tokens + 1]
        counts = torch.bincount(scored.long(), minlength=len(self.names))
        return {"eval_text_bytes": self.tokens, "eval_context": self.context, "eval_document_cap": self.cap,
                "eval_documents": int((counts > 0).sum()), "eval_text_sha256": hashlib.sha256(
                    self.stream[: self.context + self.tokens + 1].numpy().tobytes()).hexdigest()}


def evaluation_text(corpus: Corpus, tokens: int, *, context: int = 0, split: str = "test",
                    granularity: int = 1024) -> EvalText:
    """The first ``cap`` bytes of every document of ``split`` (in name order), joined, with the
    smallest ``cap`` (a multiple of ``granularity``) that yields ``context + tokens + 1`` bytes.

    Capping every document at the same size spreads the scored text over as many documents as the
    split has, instead of the first few long ones; within a document the text stays contiguous, so
    long windows still read long stretches of one file. Raises when the whole split is too short.
    """
    if split not in SPLITS:
        raise PosencError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    check = tokens + context + 1
    docs = corpus.documents[split]
    longest = max((len(b) for _, b in docs), default=0)
    available = sum(len(b) for _, b in docs) + len(docs) - 1
    if available < check:
        raise PosencError(f"the {split} split of {corpus.name!r} has {available} bytes, fewer than the "
                          f"{check} the evaluation needs ({context} of lead-in + {tokens} scored + 1): "
                          "lower --eval-tokens or use a larger corpus")

    def joined(cap):
        return sum(min(len(b), cap) for _, b in docs) + len(docs) - 1

    cap = granularity
    while joined(cap) < check and cap < longest:
        cap += granularity
    data, owner = bytearray(), []
    for i, (_, body) in enumerate(docs):
        piece = (SEPARATOR if i else b"") + body[:cap]
        data += piece
        owner += [i] * len(piece)
    stream = torch.frombuffer(data, dtype=torch.uint8).clone()
    return EvalText(stream, torch.tensor(owner, dtype=torch.int32), [n for n, _ in docs], context, tokens, cap)


def batch_at(stream: torch.Tensor, step: int, *, batch_size: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of ``step``: random windows drawn from a generator seeded by ``(seed, step)``.

    A pure function of its arguments, so a run resumed at any step sees exactly the batches an
    uninterrupted run would have seen. Returns inputs and next-byte targets, ``b n`` int64.
    """
    if len(stream) < length + 1:
        raise PosencError(f"the training text has {len(stream)} bytes, fewer than one window of {length + 1} "
                          f"(length {length} inputs and their next-byte targets)")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    # every start 0 .. len - length - 1 (randint's bound is exclusive): the stream's last byte is a target too
    starts = torch.randint(0, len(stream) - length, (batch_size,), generator=g)
    windows = torch.stack([stream[s : s + length + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
