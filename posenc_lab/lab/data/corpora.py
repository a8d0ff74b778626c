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
  Bible (``sword-text-web``), both public domain, one document per chapter (:mod:`posenc_lab.lab.data.prose`).
* ``wikitext-103``: the ALiBi paper's benchmark, through the optional ``datasets`` package.
* Splits are by document, deterministic (a hash of the document's name), never across documents;
  WikiText keeps its official splits. Documents are joined with a ``0x00`` byte between them.
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posenc_lab.errors import PosencError
from posenc_lab.lab.data.prose import prose_documents

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


def prose_corpus(folder: str | None = None) -> Corpus:
    """``prose``: Jane Austen's six novels and the World English Bible, one document per chapter, split by name
    (:func:`posenc_lab.lab.data.prose.prose_documents`)."""
    docs, meta = prose_documents(folder)
    return from_documents("prose", docs, meta)


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
    """The evaluation text: ``lead_in`` bytes of lead-in, then the scored bytes, one document index per byte.

    ``stream`` holds the bytes (uint8), ``documents[i]`` the index in ``names`` of the document byte
    ``i`` comes from (the separator before a document counts as that document's), ``cap`` the most
    bytes taken from one document.
    """

    stream: torch.Tensor
    documents: torch.Tensor
    names: list[str]
    lead_in: int
    tokens: int
    cap: int

    def describe(self) -> dict:
        """What every result records about the text: scored bytes, lead-in, document cap, the number of documents
        scored from, and a SHA-256 of the bytes read."""
        scored = self.documents[self.lead_in + 1 : self.lead_in + self.tokens + 1]
        counts = torch.bincount(scored.long(), minlength=len(self.names))
        # "eval_context": the key the committed results carry for the lead-in
        return {"eval_text_bytes": self.tokens, "eval_context": self.lead_in, "eval_document_cap": self.cap,
                "eval_documents": int((counts > 0).sum()), "eval_text_sha256": hashlib.sha256(
                    self.stream[: self.lead_in + self.tokens + 1].numpy().tobytes()).hexdigest()}


def evaluation_text(corpus: Corpus, tokens: int, *, lead_in: int = 0, split: str = "test",
                    granularity: int = 1024) -> EvalText:
    """The first ``cap`` bytes of every document of ``split`` (in name order), joined, with the
    smallest ``cap`` (a multiple of ``granularity``) that yields ``lead_in + tokens + 1`` bytes.

    Capping every document at the same size spreads the scored text over as many documents as the
    split has, instead of the first few long ones; within a document the text stays contiguous, so
    long windows still read long stretches of one file. Raises when the whole split is too short.
    """
    if split not in SPLITS:
        raise PosencError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    check = tokens + lead_in + 1
    docs = corpus.documents[split]
    longest = max((len(b) for _, b in docs), default=0)
    available = sum(len(b) for _, b in docs) + len(docs) - 1
    if available < check:
        raise PosencError(f"the {split} split of {corpus.name!r} has {available} bytes, fewer than the "
                          f"{check} the evaluation needs ({lead_in} of lead-in + {tokens} scored + 1): "
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
    return EvalText(stream, torch.tensor(owner, dtype=torch.int32), [n for n, _ in docs], lead_in, tokens, cap)


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
