"""Corpora, splits and batches."""

import pytest
import torch

from posenc_lab import PosencError
from posenc_lab.lab.data import corpora as data, prose


def test_split_is_deterministic_by_document_name():
    names = [f"doc{i}.py" for i in range(2000)]
    first = [data.split_of(n) for n in names]
    assert first == [data.split_of(n) for n in names]
    share = {s: first.count(s) / len(first) for s in data.SPLITS}
    assert 0.87 < share["train"] < 0.93 and 0.03 < share["test"] < 0.07


def test_stdlib_corpus_is_split_by_document_and_described():
    corpus = data.load_corpus("stdlib")
    names = {s: {n for n, _ in docs} for s, docs in corpus.documents.items()}
    assert not names["train"] & names["test"] and not names["train"] & names["valid"] and not names["valid"] & names["test"]
    assert all(not {"test", "site-packages"} & set(n.split("/")) for docs in names.values() for n in docs)
    info = corpus.describe()
    assert info["python"].count(".") == 2 and len(info["sha256"]) == 64 and info["train_bytes"] > 5_000_000
    stream = corpus.stream("test")
    assert stream.dtype == torch.uint8 and len(stream) == info["test_bytes"] + info["test_documents"] - 1


def test_path_corpus_reads_text_files_and_skips_binary(tmp_path):
    for i in range(60):
        (tmp_path / f"f{i}.txt").write_text(f"document {i}\n" * 20)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    corpus = data.load_corpus(str(tmp_path))
    assert sum(len(d) for d in corpus.documents.values()) == 60
    assert corpus.meta["source"] == str(tmp_path.resolve())


def test_bad_corpora_are_clear_errors(tmp_path):
    with pytest.raises(PosencError, match="does not exist"):
        data.load_corpus(str(tmp_path / "nowhere"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PosencError, match="has no text"):
        data.load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "one.txt").write_text("just one document")
    with pytest.raises(PosencError, match="too small"):
        data.load_corpus(str(tmp_path / "one.txt"))


WIKITEXT_SAMPLE = [
    "", " = Valkyria Chronicles III = \n", "", " Senjō no Valkyria 3 is a tactical role @-@ playing game . \n",
    " = = Gameplay = = \n", " The game 's battle system ... \n",
    " = Tower Building of the Little Rock Arsenal = \n", " The building was built in 1840 . \n",
    " = = = History = = = \n", " It was a <unk> . \n",
]


def test_wikitext_rows_are_grouped_into_articles_at_top_level_headings():
    articles = data.wikitext_articles(WIKITEXT_SAMPLE)
    assert len(articles) == 2
    assert articles[0].strip().startswith("= Valkyria") and "Gameplay" in articles[0]
    assert "History" in articles[1] and "Valkyria" not in articles[1]


def test_wikitext_corpus_loading_code_on_local_data(tmp_path):
    # the real loading code, with the same rows a `datasets` WikiText split has, read from a local file
    path = tmp_path / "wiki.txt"
    path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in WIKITEXT_SAMPLE))
    calls = []

    def loader(name, config):
        calls.append((name, config))
        rows = path.read_text().splitlines(keepends=True)
        return {split: {"text": rows} for split in ("train", "validation", "test")}

    corpus = data.wikitext_corpus("wikitext-103-raw-v1", loader=loader)
    assert calls == [("wikitext", "wikitext-103-raw-v1")]
    assert corpus.name == "wikitext-103" and all(len(docs) == 2 for docs in corpus.documents.values())
    assert b"Little Rock" in corpus.stream("test").numpy().tobytes()


def test_wikitext_without_network_or_package_is_a_clear_error():
    def offline(*args):
        raise ConnectionError("no route to host")

    with pytest.raises(PosencError, match="could not load WikiText.*no route to host"):
        data.wikitext_corpus(loader=offline)


def test_batches_are_a_pure_function_of_seed_and_step():
    stream = torch.arange(10_000) % 256
    stream = stream.to(torch.uint8)
    x1, y1 = data.batch_at(stream, 17, batch_size=4, length=32, seed=3)
    x2, y2 = data.batch_at(stream, 17, batch_size=4, length=32, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])
    assert not torch.equal(x1, data.batch_at(stream, 18, batch_size=4, length=32, seed=3)[0])


def test_every_byte_of_the_stream_can_be_a_training_target():
    # a stream of exactly one window: its only start is 0, and its last byte is the last target
    stream = torch.arange(33, dtype=torch.uint8)
    x, y = data.batch_at(stream, 0, batch_size=3, length=32, seed=0)
    assert torch.equal(y[0], stream[1:].long()) and (x[:, 0] == 0).all()
    # over many draws from a longer stream, every start appears, the last one included
    stream = torch.arange(40, dtype=torch.uint8)
    starts = {int(data.batch_at(stream, s, batch_size=8, length=32, seed=1)[0][i, 0]) for s in range(200) for i in range(8)}
    assert starts == set(range(8))


def test_a_stream_shorter_than_one_window_is_one_clear_error():
    with pytest.raises(PosencError, match="32 bytes, fewer than one window of 33"):
        data.batch_at(torch.zeros(32, dtype=torch.uint8), 0, batch_size=1, length=32, seed=0)


# --- stdlib from another Python's folder -------------------------------------------------------------------------------

def test_stdlib_from_a_folder_is_the_same_corpus(tmp_path):
    import sysconfig

    here = data.load_corpus("stdlib")
    there = data.load_corpus("stdlib:" + sysconfig.get_paths()["stdlib"])
    assert there.meta["sha256"] == here.meta["sha256"] and there.describe() == here.describe()
    lib = tmp_path / "lib" / "python3.12"
    for i in range(80):
        (lib / f"m{i}").mkdir(parents=True)
        (lib / f"m{i}" / "mod.py").write_text(f"x = {i}\n")
    (lib / "test").mkdir()
    (lib / "test" / "test_x.py").write_text("skipped = True\n")
    assert data.load_corpus(f"stdlib:{lib}").meta["python"] == "3.12"
    assert data.load_corpus(f"stdlib:{lib}@3.12.4").meta["python"] == "3.12.4"
    (tmp_path / "include" / "python3.12").mkdir(parents=True)
    (tmp_path / "include" / "python3.12" / "patchlevel.h").write_text('#define PY_VERSION      "3.12.1"\n')
    corpus = data.load_corpus(f"stdlib:{lib}")
    assert corpus.meta["python"] == "3.12.1" and corpus.name == "stdlib"
    assert sum(len(d) for d in corpus.documents.values()) == 80
    with pytest.raises(PosencError, match="does not exist"):
        data.load_corpus(f"stdlib:{tmp_path / 'nowhere'}")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "a.py").write_text("a = 1\n")
    with pytest.raises(PosencError, match="@3.11.7"):
        data.load_corpus(f"stdlib:{tmp_path / 'odd'}")


# --- prose: small files in the installed packages' formats ------------------------------------------------------------

def _r_serialize(obj) -> bytes:
    """R's XDR serialization (version 2) of bytes (a string), a list of bytes (a character vector), a list of ints,
    or a dict (a named list): the subset that janeaustenr's data base uses."""
    import struct

    def item(o):
        if isinstance(o, dict):
            names = list(o)
            return (struct.pack(">ii", 19 | 512, len(o)) + b"".join(item(v) for v in o.values())
                    + struct.pack(">i", 2 | 1024) + struct.pack(">i", 1) + item(b"names") + item(names)
                    + struct.pack(">i", 254))
        if isinstance(o, bytes):
            return struct.pack(">ii", 9, len(o)) + o
        if o and isinstance(o[0], int):
            return struct.pack(f">ii{len(o)}i", 13, len(o), *o)
        return struct.pack(">ii", 16, len(o)) + b"".join(item(s) for s in o)

    return b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300) + item(obj)


def _write_janeaustenr(folder, novels: dict[str, list[bytes]]):
    import gzip
    import struct
    import zlib

    folder.mkdir(parents=True)
    database, index = b"", {}
    for name, lines in novels.items():
        blob = _r_serialize(lines)
        record = struct.pack(">i", len(blob)) + zlib.compress(blob)
        index[name.encode()] = [len(database), len(record)]
        database += record
    (folder / "Rdata.rdb").write_bytes(database)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(_r_serialize({b"variables": index, b"references": {},
                                                                   b"compressed": [1]})))


def _write_ztext(folder, testaments: dict[str, list[str]]):
    import struct
    import zlib

    folder.mkdir(parents=True)
    for testament, entries in testaments.items():
        block, index = b"", struct.pack("<IIH", 0, 0, 0)  # the module's empty heading entry
        for entry in entries:
            index += struct.pack("<IIH", 0, len(block), len(entry.encode()))
            block += entry.encode()
        compressed = zlib.compress(block)
        (folder / f"{testament}.bzz").write_bytes(compressed)
        (folder / f"{testament}.bzs").write_bytes(struct.pack("<III", 0, len(compressed), len(block)))
        (folder / f"{testament}.bzv").write_bytes(index)


def _prose_sample(root):
    novel = [b"A SMALL NOVEL", b"", b"by Nobody"]
    for c in range(1, 31):
        novel += [b"", f"CHAPTER {c}".encode(), b"", f"Chapter {c} begins: the rain fell on house {c},".encode(),
                  b"and the neighbours talked of nothing else."]
    _write_janeaustenr(root / "janeaustenr", {"smallnovel": novel, "tiny": [b"Chapter 1", b"", b"Short."]})
    verses = ['<div sID="p0" type="x-p"/>A preface in plain words.<div eID="p0" type="x-p"/>']
    for c in range(1, 31):
        verses.append(f'<chapter n="{c}" osisID="Book.{c}" sID="Book.{c}"/><title type="chapter">Part {c}</title>')
        verses.append(f'<w lemma="x">Then</w> <w lemma="y">we</w><note placement="foot">a note</note><w>walked</w> '
                      f"&amp; sang {c}.<div eID=\"g{c}\" type=\"x-p\"/>")
        verses.append(f'<l sID="l{c}"/>a line of song<l eID="l{c}"/><chapter eID="Book.{c}"/>')
    _write_ztext(root / "engWEB2015eb", {"ot": verses[:31], "nt": verses[31:]})


def test_prose_documents_are_read_from_the_packages_formats(tmp_path):
    _prose_sample(tmp_path)
    austen = dict(prose.austen_documents(tmp_path / "janeaustenr"))
    assert austen["austen/smallnovel/00"] == b"A SMALL NOVEL\n\nby Nobody\n"
    assert austen["austen/smallnovel/07"].startswith(b"CHAPTER 7\n\nChapter 7 begins")
    assert len(austen) == 32 and austen["austen/tiny/01"] == b"Chapter 1\n\nShort.\n"
    web = dict(prose.web_documents(tmp_path / "engWEB2015eb"))
    assert web["web/preface"] == b"A preface in plain words.\n"
    assert web["web/Book.3"] == b"Part 3\nThen we walked & sang 3.\na line of song\n"
    assert len(web) == 31


def test_prose_corpus_loads_from_a_folder_or_the_environment(tmp_path, monkeypatch):
    _prose_sample(tmp_path / "copy")
    corpus = data.load_corpus(f"prose:{tmp_path / 'copy'}")
    assert corpus.name == "prose" and len(corpus.meta["sha256"]) == 64 and "public domain" in corpus.meta["licence"]
    assert sum(len(d) for d in corpus.documents.values()) == 63
    assert corpus.meta["total_bytes"] == sum(len(b) for d in corpus.documents.values() for _, b in d)
    monkeypatch.setenv(prose.PROSE_ENV, str(tmp_path / "copy"))
    assert data.load_corpus("prose").meta["sha256"] == corpus.meta["sha256"]


def test_missing_prose_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.delenv(prose.PROSE_ENV, raising=False)
    monkeypatch.setattr(prose, "PROSE_SOURCES", {k: (p, str(tmp_path / k), f) for k, (p, _, f) in
                                                prose.PROSE_SOURCES.items()})
    with pytest.raises(PosencError, match="apt-get install r-cran-janeaustenr sword-text-web"):
        data.load_corpus("prose")
    with pytest.raises(PosencError, match="missing"):
        data.load_corpus(f"prose:{tmp_path / 'nowhere'}")


@pytest.mark.skipif(not all((__import__("pathlib").Path(d) / f[0]).is_file() for _, d, f in
                            prose.PROSE_SOURCES.values()), reason="the Debian prose packages are not installed")
def test_installed_prose_corpus_is_large_enough():
    info = data.load_corpus("prose").describe()
    assert info["total_bytes"] > 4_000_000 and info["test_bytes"] >= 250_000 and info["test_documents"] >= 20
