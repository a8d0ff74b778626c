"""Does the model use the context past its training length: the gain, the passkey in Python, the context run."""

import ast
import math

import pytest
import torch
import torch.nn.functional as F

from posenc_lab import PosencError
from posenc_lab.model import GPT, GPTConfig
from posenc_lab.lab.experiments import context as cx
from posenc_lab.lab.measure import far_context, passkey, passkey as pk, streaming


def toy(encoding="alibi", n_layer=1, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(encoding=encoding, n_layer=n_layer, n_head=2, d_model=16, train_len=8)).eval()


def stream_with_repeats(n=400, seed=1):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(97, 101, (n,), generator=g)  # 4 letters: many repeated n-grams, near and far
    return base.to(torch.uint8)


def test_far_repeats_against_a_brute_force_search():
    s = stream_with_repeats(300)
    for reach, ngram in [(5, 3), (20, 4), (1, 2)]:
        got = far_context.far_repeats(s, 17, 128, reach, ngram)
        data = s[17 : 17 + 129].tolist()
        for t in range(1, 129):  # target t of the window
            occurrences = [u for u in range(ngram - 1, t) if t >= ngram - 1
                           and data[u - ngram + 1 : u + 1] == data[t - ngram + 1 : t + 1]]
            want = bool(occurrences) and t - max(occurrences) > reach
            assert bool(got[t - 1]) == want, (reach, ngram, t)


@pytest.mark.parametrize("encoding", ["alibi", "nope", "rope"])
def test_gain_against_a_hand_computation(encoding):
    """A one-layer model with a relative (shift-invariant) encoding: limiting attention to the last W keys
    is the same as running it on the last W bytes alone, computed here without the mask."""
    model, s = toy(encoding), stream_with_repeats(400)
    length, reach, block = 32, 8, 64
    blocks = [0, 150]
    got = far_context.gain(model, s, length=length, reach=reach, blocks=blocks, block_tokens=block, threshold=0.05, ngram=3)
    full, limited = [], []
    with torch.no_grad():
        for offset in blocks:
            for start in range(offset, offset + block, length):
                w = s[start : start + length + 1].long()
                full.append(F.cross_entropy(model(w[None, :-1])[0].float(), w[1:], reduction="none").double())
                row = []
                for p in range(length):
                    lo = max(0, p - reach + 1)
                    logits = model(w[None, lo : p + 1])[0, -1].float()
                    row.append(F.cross_entropy(logits[None], w[p + 1 : p + 2]).double())
                limited.append(torch.stack(row))
    full, limited = torch.cat(full), torch.cat(limited)
    far = torch.arange(len(full)) % length >= reach
    torch.testing.assert_close(got["per_target"]["full"], full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["per_target"]["reach"], limited, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["per_target"]["reach"][~far], got["per_target"]["full"][~far], rtol=1e-5, atol=1e-5)
    diff = (limited - full)[far]
    assert got["far_tokens"] == int(far.sum()) == len(blocks) * (block // length) * (length - reach)
    assert got["gain"] == pytest.approx(float(diff.mean()), abs=1e-6)
    assert got["share_better"] == pytest.approx(float((diff > 0.05).double().mean()), abs=1e-9)
    rep = got["per_target"]["repeat"][far]
    assert got["gain_repeats"] == pytest.approx(float(diff[rep].mean()), abs=1e-6)
    assert 0 < got["share_repeats"] < 1


def test_gain_refuses_a_length_within_reach_and_reports_a_table_that_cannot_extrapolate():
    model, s = toy("nope"), stream_with_repeats(200)
    with pytest.raises(PosencError, match="must exceed the reach"):
        far_context.gain(model, s, length=8, reach=8, blocks=[0], block_tokens=64)
    learned = toy("learned")
    assert far_context.gain(learned, s, length=16, reach=8, blocks=[0], block_tokens=64)["status"] == "cannot extrapolate"


PY = b'''import os


def f(x):
    """Doc."""
    if x:
        y = 1
    else:
        y = 2
    return y


@staticmethod
def g():
    return [
        1,
        2,
    ]


class C:
    a = 1

    def m(self):
        return self.a
'''


def test_statement_lines_are_line_starts_with_their_indentation():
    lines = pk.statement_lines(PY)
    assert lines and all(PY[s : s + len(i)] == i and (s == 0 or PY[s - 1 : s] == b"\n") for s, i in lines)
    texts = {PY[s:].split(b"\n", 1)[0].strip() for s, _ in lines}
    assert b"@staticmethod" not in texts and b"def g():" not in texts  # a decorated definition is not split
    assert b"y = 2" in texts and b"return self.a" in texts
    assert pk.statement_lines(b"def broken(:\n") == []


def test_passkey_windows_plant_valid_python_and_ask_for_the_key():
    text = pk.PasskeyText([PY * 6, b"x = (1,\n 2)\n" * 80, PY * 4])
    g = torch.Generator().manual_seed(0)
    for depth in (0.0, 0.5, 1.0):
        w = pk.passkey_windows(text, 6, 512, depth, g)
        assert w["inputs"].shape == (6, 512) and w["keys"].shape == (6, pk.PASSKEY_DIGITS)
        for row, key, dist in zip(w["inputs"], w["keys"], w["distance"]):
            seq = bytes(row.tolist()) + bytes([int(key[-1])])
            k = bytes(key.tolist())
            assert all(48 <= c <= 57 for c in k)  # one shared alphabet: digits
            assert seq.endswith(b'assert PASSKEY == "' + k)
            at = seq.index(b'PASSKEY = "' + k + b'"\n')
            line_start = seq.rfind(b"\n", 0, at) + 1
            ast.parse(seq[line_start : at + len(b'PASSKEY = "') + pk.PASSKEY_DIGITS + 1].strip())
            assert int(dist) == len(seq) - pk.PASSKEY_DIGITS - (at + len(b'PASSKEY = "'))
        assert w["depth"].min() >= 0 and w["depth"].max() <= 1
    near = pk.passkey_windows(text, 20, 512, 1.0, torch.Generator().manual_seed(1))["distance"].float().mean()
    far = pk.passkey_windows(text, 20, 512, 0.0, torch.Generator().manual_seed(1))["distance"].float().mean()
    assert far > 300 > near


def test_planted_line_keeps_its_document_parseable():
    text = pk.PasskeyText([PY])
    for k, (at, doc, indent) in enumerate(text.candidates):
        assert text.valid(k)
        ast.parse(PY[:at] + pk.plant_line(indent, b"12345") + PY[at:])


def test_digit_hits_read_the_last_positions():
    class Echo(torch.nn.Module):  # predicts the next byte as the current byte + 1
        def forward(self, x, masks=None):
            return F.one_hot((x + 1) % 256, 256).float()

    inputs = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    keys = torch.tensor([[8, 9, 10], [4, 9, 6]])
    hits = pk.digit_hits(Echo(), inputs, keys)
    assert hits.tolist() == [[True, True, True], [True, False, True]]


def test_the_choice_among_digits_ignores_every_other_byte():
    # the model ranks "x" first everywhere, then the digit (position + 3) mod 10: over all bytes it never hits
    # a digit key; among the ten digits it picks that digit
    logits = torch.zeros(2, 3, 256)
    logits[..., ord("x")] = 5.0
    for p in range(3):
        logits[:, p, ord("0") + (p + 3) % 10] = 2.0
        logits[:, p, ord("0") + (p + 7) % 10] = 1.0
    assert (pk.choose(logits) == ord("x")).all()
    assert pk.choose(logits, pk.DIGIT_BYTES).tolist() == [[ord("3"), ord("4"), ord("5")]] * 2

    class Fixed(torch.nn.Module):
        def forward(self, x, masks=None):
            return logits[:, :1].expand(len(x), x.shape[1], 256)

    keys = torch.tensor([[ord("3")] * 3, [ord("7")] * 3])
    assert not pk.digit_hits(Fixed(), torch.zeros(2, 4, dtype=torch.long), keys).any()
    among = pk.digit_hits(Fixed(), torch.zeros(2, 4, dtype=torch.long), keys, among=pk.DIGIT_BYTES)
    assert among.tolist() == [[True] * 3, [False] * 3]


def test_the_measurements_of_the_context_runs_live_in_their_own_modules():
    """The gain's and the passkey's names are defined in ``measure.far_context`` and ``measure.passkey``, where every
    import names them (``tests/test_architecture.py``); the context module is the run, its presets and its report."""
    from posenc_lab.lab.measure import far_context as gn

    for module, names in ((gn, ["far_repeats", "gain", "gain_table", "windowed_verdicts", "far_context_family"]),
                          (pk, ["PasskeyText", "plant_line", "question", "statement_lines", "passkey_windows",
                                "answer_logits", "choose", "passkey_table"])):
        for name in names:
            assert getattr(module, name).__module__ == module.__name__, name
    assert not hasattr(cx, "far_repeats") and not hasattr(cx, "answer_hits") and not hasattr(cx, "DIGITS")


@pytest.mark.slow
def test_context_runner_end_to_end_and_resumes(tmp_path):
    from posenc_lab.lab.experiments import language_model as experiment

    trained = tmp_path / "trained"
    experiment.run(experiment.preset("ci", encodings=("rope", "alibi", "learned")), trained, progress=False,
                   log=lambda *a: None)
    spec = cx.context_preset("context-ci", run=str(trained))
    gains, keys = cx.run(spec, tmp_path / "context", progress=False, log=lambda *a: None)
    labels = {(r["encoding"], r["strategy"]) for r in gains}
    assert labels == {("rope", "none"), ("rope", "yarn"), ("alibi", "-"), ("learned", "-")}
    for r in gains:
        if r["encoding"] == "learned":
            assert r["status"] == "cannot extrapolate"
        else:
            assert r["status"] == "ok" and r["reach"] == 64 and r["far_tokens"] == 2 * 2 * 64
            assert r["gain"] == pytest.approx(r["far_loss_reach"] - r["far_loss_full"], abs=1e-9)
    assert len(keys) == len(labels) * 2 * 2
    for r in keys:
        assert r["status"] == ("cannot extrapolate" if r["encoding"] == "learned" else "ok")
        if r["status"] == "ok":
            assert 0 <= r["accuracy"] <= r["digit_accuracy"] + 1e-12 <= 1 + 1e-12 and r["trials"] == 2
            # the argmax over ten digits hits whenever the argmax over all bytes does
            assert r["digit_accuracy"] <= r["choice_accuracy"] + 1e-12 <= 1 + 1e-12
    header = (tmp_path / "context" / "gain.csv").read_text().splitlines()[0].split(",")
    assert header == cx.GAIN_COLUMNS
    assert (tmp_path / "context" / "passkey.csv").read_text().splitlines()[0].split(",") == cx.PASSKEY_COLUMNS
    text = cx.report(tmp_path / "context")
    assert "| rope/yarn | 128 |" in text and "| learned | 128 | cannot extrapolate" in text
    streams = __import__("json").loads((tmp_path / "context" / "stream.json").read_text())
    assert [(r["encoding"], r["sinks"], r["window"], r["tokens"]) for r in streams] == [("rope", 0, 64, 256),
                                                                                         ("rope", 2, 62, 256)]
    assert all(0 < r["first_token_mass"] < 1 and r["loss"] > 0 for r in streams)
    assert "| rope | 2 |" in text
    log = []
    cx.run(spec, tmp_path / "context", progress=False, log=log.append)
    assert all("done already" in line for line in log)
    with pytest.raises(PosencError, match="different experiment"):
        cx.run(cx.context_preset("context-ci", run=str(trained), trials=3), tmp_path / "context", progress=False,
               log=lambda *a: None)
    with pytest.raises(PosencError, match="neither a run folder"):
        cx.run(cx.context_preset("context-ci", run=str(tmp_path / "nothing")), tmp_path / "c2", progress=False)
    # the gain alone (as context-variants measures it): no passkey windows, no streams, the same gains
    alone = cx.context_preset("context-ci", run=str(trained), passkey_multiples=(), sink_encodings=())
    gains_alone, keys_alone = cx.run(alone, tmp_path / "gain-only", progress=False, log=lambda *a: None)
    assert keys_alone == [] and (tmp_path / "gain-only" / "stream.json").read_text().strip() == "[]"
    text = cx.report(tmp_path / "gain-only")  # a run without passkey rows reports its gains only
    assert "gain from context beyond the reach" in text and "passkey" not in text
    by_label = {(r["encoding"], r["strategy"], r["eval_len"]): r.get("gain") for r in gains}
    assert {(r["encoding"], r["strategy"], r["eval_len"]): r.get("gain") for r in gains_alone} == by_label


@pytest.mark.slow
def test_context_jobs_split_the_units_and_match_one_process(tmp_path, capsys):
    """context --jobs measures each trained model in its own process on one folder; --unit measures one."""
    import json

    from posenc_lab.__main__ import main
    from posenc_lab.lab.experiments import language_model as experiment

    trained = tmp_path / "trained"
    experiment.run(experiment.preset("ci", encodings=("rope", "alibi")), trained, progress=False, log=lambda *a: None)
    args = ["context", "--preset", "context-ci", "--run", str(trained), "--encodings", "rope,alibi", "--no-progress",
            "--no-report"]
    assert main([*args, "--jobs", "2", "--out", str(tmp_path / "jobs")]) == 0
    assert "rope:0 done" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "jobs" / "units").iterdir()) == ["alibi-s0.json", "rope-s0.json"]
    assert main([*args, "--unit", "alibi:0", "--out", str(tmp_path / "one")]) == 0
    assert [p.name for p in (tmp_path / "one" / "units").iterdir()] == ["alibi-s0.json"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0  # the rest, resumed in this process
    a, b = (json.loads((tmp_path / d / "gain.json").read_text()) for d in ("jobs", "one"))
    assert [(r["encoding"], r["strategy"], r["eval_len"]) for r in a] == [(r["encoding"], r["strategy"], r["eval_len"])
                                                                          for r in b]
    for x, y in zip(a, b, strict=True):
        assert x["gain"] == pytest.approx(y["gain"], rel=1e-5, abs=1e-7)
    assert main([*args, "--unit", "t5:0", "--out", str(tmp_path / "bad")]) == 2
    assert "not in this experiment" in capsys.readouterr().err


def test_each_job_gets_its_own_unit_only():
    from posenc_lab.lab.run.processes import without_options

    argv = ["context", "--unit", "rope:0", "--jobs", "4", "--unit=t5:1", "--seeds", "0"]
    assert without_options(argv, ("--unit", "--jobs")) == ["context", "--seeds", "0"]


def test_the_prose_context_presets_plant_no_python_passkey():
    for name in ("context-prose-long-b4", "context-prose-long"):
        assert cx.context_preset(name).passkey_multiples == ()


@pytest.mark.parametrize("name", ["context-long", "context-variants", "context-recent", "context-past-softmax"])
def test_the_context_presets_of_other_runs_measure_only_that_runs_encodings(name):
    from posenc_lab.lab.experiments import language_model as experiment

    spec = cx.context_preset(name)
    trained = experiment.preset({"context-long": "article-long", "context-variants": "variants-cpu",
                                 "context-recent": "recent-cpu", "context-past-softmax": "past-softmax-cpu"}[name])
    assert set(spec.encodings) == set(trained.encodings) and spec.run == trained.preset
    assert set(spec.strategies) <= set(trained.strategies) | {"pi", "ntk", "dynamic-ntk"}


def test_context_command_line_errors_are_one_sentence(capsys):
    from posenc_lab.__main__ import main

    assert main(["context", "--preset", "context-ci"]) == 2
    assert "give the trained models with --run" in capsys.readouterr().err
    assert main(["context", "--preset", "nope", "--run", "article-cpu"]) == 2
    assert "unknown context preset" in capsys.readouterr().err
    assert main(["context", "--run", "/no/such/run", "--out", "/tmp/x-context-test"]) == 2
    assert "neither a run folder" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- attention sinks


@pytest.mark.parametrize("encoding", ["rope", "alibi", "t5", "nope"])
@pytest.mark.parametrize("sinks", [0, 3])
def test_streaming_with_sinks_against_recomputation(encoding, sinks):
    """One layer: token t sees the sinks and the last W tokens at slot positions, which is the model run on exactly
    those tokens (computed here without any cache)."""
    model, s = toy(encoding), stream_with_repeats(70).long()
    window = 10
    got = streaming.streaming_losses(model, s, window=window, sinks=sinks)
    want = []
    with torch.no_grad():
        for t in range(len(s) - 1):
            seen = s[: t + 1] if t + 1 <= sinks + window else torch.cat([s[:sinks], s[t - window + 1 : t + 1]])
            logits = model(seen[None])[0, -1].float()
            want.append(F.cross_entropy(logits[None], s[t + 1 : t + 2]).double())
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "learned", "sinusoidal"])
def test_a_sink_cache_longer_than_the_stream_is_the_plain_cache(encoding):
    model, s = toy(encoding, n_layer=3), stream_with_repeats(8).long()  # learned: 8 positions
    got = streaming.streaming_losses(model, s, window=50, sinks=4)
    with torch.no_grad():
        want = model.token_losses(s[None, :-1], s[None, 1:])[0].double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    prompt = s[None, :3]
    with torch.no_grad():
        plain = model.generate(prompt, 4, cache=True)
        model.new_cache = lambda **kw: type(model).new_cache(model, window=50, sinks=2)  # generate with a sink cache
        rolled = model.generate(prompt, 4, cache=True)
    assert torch.equal(plain, rolled)


def test_sink_cache_gives_each_new_token_the_slot_attention_uses():
    """Past the capacity a new token takes the last slot (sinks + window - 1), in the embedding as in attention."""
    model, s = toy("learned", n_layer=2), stream_with_repeats(30).long()  # learned: a table of 8 positions
    seen = []
    original = model.encoding.embed
    model.encoding.embed = lambda x, positions: seen.append(positions.tolist()) or original(x, positions)
    streaming.streaming_losses(model, s, window=5, sinks=2)
    assert seen[0] == list(range(7)) and all(p == [6] for p in seen[1:]) and len(seen) == 1 + (29 - 7)


def test_sink_cache_errors_are_one_sentence():
    from posenc_lab.backends import SinkCache

    with pytest.raises(PosencError, match="window must be an integer >= 1"):
        SinkCache(0)
    with pytest.raises(PosencError, match="sinks must be an integer >= 0"):
        SinkCache(4, -1)
    model = toy("rope")
    with pytest.raises(PosencError, match="one at a time"):
        model(torch.zeros(1, 12, dtype=torch.long), cache=model.new_cache(window=4, sinks=1))
    yarn = toy("rope")
    yarn.encoding.set_scaling("yarn")  # a factor that follows the length: the cached keys' rotation would change
    with pytest.raises(PosencError, match="sink cache cannot serve"):
        yarn(torch.zeros(1, 3, dtype=torch.long), cache=yarn.new_cache(window=4, sinks=1))


def test_first_token_mass_is_the_weight_on_key_zero():
    from posenc_lab.lab.measure import diagnostics

    model, s = toy("alibi", n_layer=2), stream_with_repeats(30).long()
    mass = diagnostics.first_token_mass(model, s[None], min_query=5)
    weights = diagnostics.attention_weights(model, s[None])
    assert mass.shape == (2, 2)
    torch.testing.assert_close(mass[1, 0], weights[1][0, 0, 5:, 0].mean())


@pytest.mark.parametrize("name", ["retrieval-cpu", "context-cpu"])
def test_a_committed_run_without_language_models_is_refused(name):
    with pytest.raises(PosencError, match="not a language-model run"):
        cx.run(cx.context_preset("context-ci", run=name), "/nonexistent-never-written", progress=False)


def test_the_committed_context_run_has_its_three_tables_and_every_seed():
    from posenc_lab.lab import results

    rows = results.rows("context-cpu")
    gains, keys, streams = (results.read_json("context-cpu", t) for t in results.CONTEXT_TABLES)
    assert len(rows) == len(gains) + len(keys) + len(streams)
    assert {r["seed"] for r in gains} == {r["seed"] for r in keys} == {0, 1, 2}
    assert {r["encoding"] for r in streams} == {"nope", "rope", "alibi"}
    # 9 encodings with RoPE's 5 strategies at 3 lengths, less learned (it cannot run past 512)
    assert len(far_context.gain_table(gains)) == 12 * 3
    assert {r["status"] for r in gains if r["encoding"] == "learned"} == {"cannot extrapolate"}


def test_the_committed_context_run_of_the_long_models_has_every_seed_and_the_choice_among_digits():
    from posenc_lab.lab import results

    gains, keys, streams = (results.read_json("context-long", t) for t in results.CONTEXT_TABLES)
    assert {r["seed"] for r in gains} == {r["seed"] for r in keys} == {r["seed"] for r in streams} == {0, 1, 2}
    # the article's five encodings, RoPE with its five strategies, at 3 lengths
    assert len(far_context.gain_table(gains)) == 9 * 3 and {r["status"] for r in gains} == {"ok"}
    assert all(r["run"] == "runs/article-long" for r in gains)
    assert all(not math.isnan(r["choice_accuracy"]) for r in keys if r["status"] == "ok")


def test_the_committed_context_run_of_the_variants_measures_the_gain_alone_on_every_seed():
    from posenc_lab.lab import results

    gains, keys, streams = (results.read_json("context-variants", t) for t in results.CONTEXT_TABLES)
    assert keys == [] and streams == [] and {r["seed"] for r in gains} == {0, 1, 2}
    # 7 variants and RoPE with none, yarn and llama3, at 3 lengths; randomized learned runs to M = 8192
    assert len(far_context.gain_table(gains)) == 10 * 3 and {r["status"] for r in gains} == {"ok"}


def test_the_committed_context_run_of_the_recent_methods_pairs_with_context_cpu():
    """Chapter 13 sets context-recent's rows beside context-cpu's ALiBi, RoPE and YaRN: the two must score the
    same bytes at the same lengths and reach, every seed of every method."""
    from posenc_lab.lab import results

    gains, keys, streams = (results.read_json("context-recent", t) for t in results.CONTEXT_TABLES)
    assert keys == [] and streams == [] and {r["status"] for r in gains} == {"ok"}
    recent, cpu = (results.read_json(n, "config.json") for n in ("context-recent", "context-cpu"))
    assert recent["evaluation_text"] == cpu["evaluation_text"] and recent["corpus"] == cpu["corpus"]
    for key in ("lengths", "reach", "blocks", "block_tokens"):
        assert recent["spec"][key] == cpu["spec"][key]
    assert {(r["encoding"], r["seed"]) for r in gains} == {(e, s) for e in cx.context_preset("context-recent").encodings
                                                           for s in (0, 1, 2)}
    assert len(far_context.gain_table(gains)) == 9 * 3


def test_windowed_verdicts_follow_the_rule_on_hand_made_rows():
    def row(encoding, strategy, seed, full, reach):
        return {"encoding": encoding, "strategy": strategy, "seed": seed, "eval_len": 1024, "status": "ok",
                "far_loss_full": full, "far_loss_reach": reach}

    rows = []
    for seed, jitter in zip((0, 1, 2), (0.0, 0.01, -0.01)):
        rows += [row("rope", "none", seed, 2.5 + jitter, 1.6 + jitter / 2),  # hurt by the far context
                 row("rope", "yarn", seed, 1.7 + jitter, 1.75 + 1.5 * jitter),  # helped, but worse than the window
                 row("nope", "-", seed, 1.5 + jitter, 1.58 + 2 * jitter),  # helped, and better than the window
                 row("alibi", "-", seed, 1.8, 1.8)]                          # ignores it: no spread, no test
    table = far_context.windowed_verdicts(rows, 1024)
    assert table.loc["rope/none", "uses the far context"] == "fails"
    assert table.loc["rope/yarn", "uses the far context"] == "holds"
    assert table.loc["rope/yarn", "beats the window"] == "fails"
    assert table.loc["nope", "beats the window"] == "holds"
    assert table.loc["alibi", "uses the far context"].startswith("not resolved")  # no spread over seeds: no test
    assert table.loc["rope/yarn", "window"] == pytest.approx(1.6)
    assert (table["seeds"] == 3).all()
    with pytest.raises(PosencError, match="no finished gain rows"):
        far_context.windowed_verdicts(rows, 2048)


def test_choice_accuracy_counts_only_the_rows_that_measured_it():
    def row(seed, choice):
        r = {"encoding": "rope", "strategy": "none", "seed": seed, "eval_len": 512, "depth": 0.5, "status": "ok",
             "trials": 10, "correct": 0, "digit_accuracy": 0.1, "first_digit_accuracy": 0.0, "distance_mean": 100.0}
        return r if choice is None else {**r, "choice_accuracy": choice}

    table = passkey.passkey_table([row(0, 0.5), row(1, None)])  # seed 1's unit was made before the column existed
    assert table.loc[("rope/none", 512), "choice_accuracy"] == pytest.approx(0.5)
    assert table.loc[("rope/none", 512), "choice_trials"] == 10
    assert math.isnan(passkey.passkey_table([row(0, None)]).loc[("rope/none", 512), "choice_accuracy"])


def test_windowed_verdicts_pair_by_seed_not_by_order_and_refuse_duplicates():
    def row(encoding, strategy, seed, full, reach):
        return {"encoding": encoding, "strategy": strategy, "seed": seed, "eval_len": 1024, "status": "ok",
                "far_loss_full": full, "far_loss_reach": reach}

    base = {0: 1.60, 1: 1.90, 2: 1.75, 3: 1.70}  # large differences between seeds, small within a seed
    rows = [row("rope", "none", s, 2.5, base[s]) for s in (0, 1, 2, 3)]
    rows += [row("nope", "-", s, base[s] - 0.05 - 0.001 * s, base[s] + 0.2) for s in (3, 1, 0)]  # other order
    table = far_context.windowed_verdicts(rows, 1024)
    assert table.loc["nope", "beats the window"] == "holds"  # only when paired by seed
    assert table.loc["nope", "seeds"] == 3  # seed 2 has no nope row: three pairs
    with pytest.raises(PosencError, match="more than one row for a seed"):
        far_context.windowed_verdicts(rows + [row("nope", "-", 1, 1.8, 1.9)], 1024)


def test_the_report_of_the_committed_context_run_prints_the_verdicts():
    from posenc_lab.lab import results

    text = cx.report(results.folder("context-cpu"))
    assert "at 2048: does each model use the far context, and does it beat RoPE limited to 512 keys" in text
    assert "| nope | holds | fails |" in text
    assert "| alibi | 512 | 0.00 [0.00, 0.01] |" in text and "not measured" in text
    with pytest.raises(PosencError, match="is a context run"):
        results.load("context-cpu")


def test_a_run_folder_without_language_models_is_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"spec": {"train_len": 128}, "task": {}}))
    with pytest.raises(PosencError, match="not a language-model run"):
        cx.run(cx.context_preset("context-ci", run=str(tmp_path)), tmp_path / "out", progress=False)


def test_the_far_context_family_tests_each_hypothesis_once_and_adjusts_as_scipy_does():
    """RoPE's own "beats the window" is its "uses the far context" (its limited self is the window): the family holds
    it once, and its adjusted p-values are Holm's and Benjamini-Hochberg's over the distinct tests, by scipy."""
    import numpy as np
    from scipy import stats as st

    from posenc_lab.lab import results

    rows = results.read_json("context-cpu", "gain.json")
    family = far_context.far_context_family(rows)
    rope = family[family.label == "rope/none"]
    assert set(rope["question"]) == {"uses the far context"} and len(rope) == rope["eval_len"].nunique()
    assert not family.duplicated(["label", "eval_len", "question"]).any()
    assert len(family) == 3 * (2 * (family["label"].nunique() - 1) + 1)  # three lengths, every p a distinct test
    p = family["p"].to_numpy()
    np.testing.assert_allclose(family["p BH"], st.false_discovery_control(p, method="bh"), rtol=1e-12)
    order = np.argsort(p)
    holm = np.maximum.accumulate(np.minimum(1, (len(p) - np.arange(len(p))) * p[order]))
    expected = np.empty_like(p)
    expected[order] = holm
    np.testing.assert_allclose(family["p holm"], expected, rtol=1e-12)
