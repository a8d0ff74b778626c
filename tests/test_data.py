"""Corpora, splits and batches."""

import pytest
import torch

from posenc_lab import PosencError, data


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
