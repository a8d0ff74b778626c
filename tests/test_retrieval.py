"""The passkey retrieval task and its runner (chapter 11)."""

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from posenc_lab import PosencError, model
from posenc_lab.model import GPT, GPTConfig, IGNORE
from posenc_lab.lab.data import tasks
from posenc_lab.lab.experiments import retrieval
from posenc_lab.lab.experiments.families import spec_of
from posenc_lab.lab.measure import accuracy


def windows(n=8, length=64, depth=None, seed=0):
    return tasks.make_windows(n, length, depth, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0, None])
def test_passkey_is_planted_once_at_its_depth_and_asked_for_at_the_end(depth):
    length = 64
    x, y, key, start = windows(length=length, depth=depth)
    haystack = length - tasks.KEY_LEN
    assert x.shape == y.shape == (8, length)
    for row in range(8):
        s = int(start[row])
        assert x[row, s : s + 4].tolist() == key[row].tolist()
        assert x[row, haystack] == tasks.QUESTION and x[row, haystack + 1 :].tolist() == key[row, :3].tolist()
        assert y[row, -4:].tolist() == key[row].tolist() and (y[row, :-4] == IGNORE).all()
        for slot, alphabet in enumerate(tasks.SLOTS):  # each passkey byte occurs in the haystack exactly once
            in_haystack = torch.isin(x[row, :haystack], alphabet)
            assert in_haystack.sum() == 1 and x[row, :haystack][in_haystack].item() == key[row, slot].item()
    if depth is not None:
        assert (start == round(depth * (haystack - 4))).all()


def test_bad_windows_are_clear_errors():
    with pytest.raises(PosencError, match="at least 8 bytes"):
        windows(length=6)
    with pytest.raises(PosencError, match=r"\[0, 1\]"):
        windows(depth=1.5)


def test_wilson_interval_known_values():
    low, high = accuracy.wilson(50, 100)
    assert (round(low, 4), round(high, 4)) == (0.4038, 0.5962)
    low, high = accuracy.wilson(0, 64)
    assert low == 0.0 and high == pytest.approx(1.96**2 / (64 + 1.96**2))  # the closed form at p = 0
    assert accuracy.wilson(64, 64)[1] == 1.0


@given(trials=st.integers(1, 5000), share=st.floats(0, 1))
def test_wilson_interval_holds_the_observed_share(trials, share):
    """The interval contains the observed share, ends at exactly 1 when every trial is right (0.9999... would
    give a plot a negative error bar) and at exactly 0 when none is, and is inside [0, 1]."""
    correct = round(share * trials)
    low, high = accuracy.wilson(correct, trials)
    assert 0.0 <= low <= correct / trials <= high <= 1.0
    assert (high == 1.0) == (correct == trials) and (low == 0.0) == (correct == 0)


def test_exact_match_is_all_four_bytes():
    class Oracle(torch.nn.Module):  # predicts the true next byte everywhere except one answer position
        def __init__(self, targets, wrong_row=None):
            super().__init__()
            self.targets, self.wrong_row = targets, wrong_row

        def forward(self, x, masks=None):
            logits = torch.zeros(*x.shape, 256)
            t = self.targets.clamp(min=0)
            logits.scatter_(-1, t[..., None], 1.0)
            if self.wrong_row is not None:
                logits[self.wrong_row, -2] = 0
                logits[self.wrong_row, -2, 0] = 1.0
            return logits

    x, y, _, _ = windows()
    assert retrieval.exact_match(Oracle(y), x, y).all()
    hits = retrieval.exact_match(Oracle(y, wrong_row=3), x, y)
    assert hits.tolist() == [True, True, True, False, True, True, True, True]
    # byte by byte: only the answer byte predicted at the second-to-last position of row 3 is wrong
    each = retrieval.answer_hits(Oracle(y, wrong_row=3), x, y)
    assert each.shape == (8, tasks.KEY_LEN) and (~each).nonzero().tolist() == [[3, tasks.KEY_LEN - 2]]


def test_loss_is_on_the_answer_only():
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="rope", n_layer=1, n_head=2, d_model=32, train_len=64))
    x, y, _, _ = windows()
    losses = model.token_losses(x, y)
    assert (losses[:, :-4] == 0).all()
    torch.testing.assert_close(model.loss(x, y), losses[:, -4:].mean())


@pytest.mark.slow
def test_retrieval_runs_every_encoding_end_to_end_and_resumes(tmp_path):
    spec = retrieval.retrieval_preset("retrieval-ci")
    rows = retrieval.run(spec, tmp_path, progress=False, log=lambda *a: None)
    labels = {(r["encoding"], r["strategy"]) for r in rows}
    assert {e for e, _ in labels} == set(spec.encodings)
    assert {s for e, s in labels if e == "rope"} == set(spec.strategies)
    cells = len(spec.multiples) * len(spec.depths)
    assert len(rows) == (len(spec.encodings) - 1 + len(spec.strategies)) * cells
    for r in rows:
        if r["encoding"] == "learned" and r["multiple"] > 1:
            assert r["status"] == "cannot extrapolate" and math.isnan(r["accuracy"])
        else:
            assert r["status"] == "ok" and 0 <= r["accuracy"] <= 1 and r["ci_low"] <= r["accuracy"] <= r["ci_high"]
    assert "exact match" in retrieval.report(tmp_path)
    again = retrieval.run(spec, tmp_path, progress=False, log=lambda *a: None)  # every unit is done: nothing reruns
    assert again == rows
    with pytest.raises(PosencError, match="different experiment"):
        retrieval.run(retrieval.retrieval_preset("retrieval-ci", trials=5), tmp_path, progress=False, log=lambda *a: None)


def test_bad_retrieval_specs_name_the_problem():
    with pytest.raises(PosencError, match="multiples"):
        retrieval.retrieval_preset("retrieval-ci", multiples=(0, 2))
    with pytest.raises(PosencError, match="depths"):
        retrieval.retrieval_preset("retrieval-ci", depths=(0.5, 2.0))
    with pytest.raises(PosencError, match="valid retrieval presets"):
        retrieval.retrieval_preset("huge")


# --------------------------------------------------------------------------------------------- the tasks that need positions


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0, None])
def test_digits_task_has_one_shared_alphabet_and_asks_for_the_key_in_order(depth):
    length, n = 96, 16
    x, y, key, start = tasks.make_windows(n, length, depth, torch.Generator().manual_seed(3), "digits")
    digits = tasks.DIGITS
    haystack = length - tasks.DIGITS_LEN
    for row in range(n):
        s = int(start[row])
        assert torch.isin(key[row], digits).all()
        assert x[row, s : s + 5].tolist() == key[row].tolist()
        in_haystack = torch.isin(x[row, :haystack], digits)  # the key is the only digits before the question
        assert in_haystack.sum() == 5 and x[row, :haystack][in_haystack].tolist() == key[row].tolist()
        assert x[row, haystack] == tasks.QUESTION
        assert y[row, -5:].tolist() == key[row].tolist() and (y[row, :-5] == IGNORE).all()
    if depth is not None:
        assert (start == round(depth * (haystack - 5))).all()
    repeats = sum(len(set(k.tolist())) < 5 for k in key)  # keys with a repeated digit need order, not class
    assert repeats > 0


@pytest.mark.parametrize("depth", [0.0, 1.0, None])
@pytest.mark.parametrize("keys", [tasks.MULTIKEYS, 1, 2])
def test_multikey_task_has_distractors_of_the_same_kind_that_differ_from_the_asked_key(depth, keys):
    length, n = 128, 24
    x, y, key, start = tasks.make_windows(n, length, depth, torch.Generator().manual_seed(4), "multikey", keys)
    for row in range(n):
        text = bytes(x[row].tolist()) + bytes([int(y[row, -1])])
        body, asked = text[:-7], text[-7:]
        assert asked[:1] == b"?" and asked[2:] == bytes(key[row].tolist())
        needles = [(m.start(), m.group()) for m in __import__("re").finditer(rb"[A-Z][0-9]{5};", body)]
        assert len(needles) == keys
        names = [b[:1] for _, b in needles]
        assert len(set(names)) == keys and asked[1:2] in names
        at, needle = next((a, b) for a, b in needles if b[:1] == asked[1:2])
        assert at == int(start[row]) and needle[1:6] == asked[2:]
        assert all(b[1:6] != asked[2:] for _, b in needles if b[:1] != asked[1:2])
        assert body.count(asked[1:2]) == 1  # the name occurs once before the question: one look-up finds it
        assert (y[row, :-5] == IGNORE).all()


def test_exact_match_reads_as_many_answer_bytes_as_the_task_has():
    class Oracle(torch.nn.Module):
        def __init__(self, targets, wrong):
            super().__init__()
            self.targets, self.wrong = targets, wrong

        def forward(self, x, masks=None):
            logits = torch.nn.functional.one_hot(self.targets.clamp(min=0), 256).float()
            logits[0, -5] = torch.nn.functional.one_hot(torch.tensor(self.wrong), 256).float()  # first digit wrong
            return logits

    x, y, key, _ = tasks.make_windows(4, 64, 0.5, torch.Generator().manual_seed(0), "digits")
    hits = retrieval.exact_match(Oracle(y, wrong=int(key[0, 0] + 1) % 256), x, y)
    assert hits.tolist() == [False, True, True, True]


def test_task_names_and_config_identity():
    with pytest.raises(PosencError, match="unknown retrieval task"):
        retrieval.RetrievalSpec(task="needle")
    assert "task" not in retrieval.RetrievalSpec().to_dict()  # the runs made before the new tasks keep their config
    assert retrieval.RetrievalSpec(task="digits").to_dict()["task"] == "digits"
    with pytest.raises(PosencError, match="window needs at least 62 bytes"):
        tasks.make_windows(2, 30, 0.0, torch.Generator(), "multikey")
    with pytest.raises(PosencError, match="holds 1 to 26 named keys, got 0"):
        tasks.make_windows(2, 128, 0.0, torch.Generator(), "multikey", keys=0)
    # the training keys: only for multikey, each 1 to MULTIKEYS, and recorded only when set
    assert "train_keys" not in retrieval.RetrievalSpec(task="multikey").to_dict()
    assert retrieval.RetrievalSpec(task="multikey", train_keys=(1, 4)).to_dict()["train_keys"] == (1, 4)
    for task, keys in (("digits", (1, 2)), ("multikey", (0, 4)), ("multikey", (5,))):
        with pytest.raises(PosencError, match="train_keys is for the multikey task"):
            retrieval.RetrievalSpec(task=task, train_keys=keys)


def test_multikey_windows_with_several_questions_score_each_answer_against_its_own_needle():
    x, y, key, start = tasks.make_windows(64, 128, None, torch.Generator().manual_seed(3), "multikey",
                                              questions=4)
    repeated = 0
    for i in range(64):
        text = bytes(x[i].tolist() + [int(y[i, -1])]).decode()
        tail = text[-4 * 7:]  # four questions of "?" + name + five digits
        asked = [tail[q * 7 + 1] for q in range(4)]
        assert [tail[q * 7] for q in range(4)] == ["?"] * 4
        repeated += len(set(asked)) < 4
        haystack = text[: -4 * 7]
        for q, name in enumerate(asked):  # each answer is the digits that follow its name in the haystack
            assert haystack.count(name) == 1
            at = haystack.index(name)
            assert tail[q * 7 + 2 : q * 7 + 7] == haystack[at + 1 : at + 6]
        scored = (y[i] != model.IGNORE).nonzero().flatten()
        assert len(scored) == 20 and "".join(chr(int(t)) for t in y[i, scored]) == \
            "".join(tail[q * 7 + 2 : q * 7 + 7] for q in range(4))
        # the first question asks for the needle the function returns
        assert bytes(key[i].tolist()).decode() == haystack[int(start[i]) + 1 : int(start[i]) + 6] == tail[2:7]
    # the later names are drawn with repeats: the three after the first are distinct from it and each other with
    # probability 3!/4^3 (about 0.09), so asking every key once (the last then found by elimination) would leave
    # repeated at 0
    assert repeated > 40
    with pytest.raises(PosencError, match="several questions are for the multikey task"):
        tasks.make_windows(2, 128, None, torch.Generator(), "digits", questions=2)
    with pytest.raises(PosencError, match="at least one question, got 0"):
        tasks.make_windows(2, 128, None, torch.Generator(), "multikey", questions=0)
    for task, questions in (("digits", (1, 2)), ("multikey", (0, 4))):
        with pytest.raises(PosencError, match="train_questions is for the multikey task"):
            retrieval.RetrievalSpec(task=task, train_questions=questions)
    assert "train_questions" not in retrieval.RetrievalSpec(task="multikey").to_dict()
    assert retrieval.RetrievalSpec(task="multikey", train_questions=(1, 4)).to_dict()["train_questions"] == (1, 4)


def test_several_questions_shorten_the_haystack_and_the_depth_places_the_needle_in_it():
    for questions in (1, 2, 4):
        _, _, key, start = tasks.make_windows(4, 128, 1.0, torch.Generator().manual_seed(0), "multikey",
                                                  questions=questions)
        last = 129 - questions * 7 - 7  # the haystack's last needle start
        assert start.tolist() == [last] * 4
    # only the one-question windows reach the grid's last needle place (why the preset's cycle holds 1)
    spec = retrieval.RETRIEVAL_PRESETS["retrieval-multikey-cpu"]
    assert 1 in spec.train_questions and not spec.model.tie_embeddings


def test_a_retrieval_spec_may_untie_the_embeddings_and_records_it_only_then():
    tied = retrieval.RetrievalSpec(task="multikey")
    untied = tied.override(tie_embeddings=False)
    assert "tie_embeddings" not in tied.to_dict()["model"] and untied.to_dict()["model"]["tie_embeddings"] is False
    assert tied.model.config("rope").tie_embeddings and not untied.model.config("rope").tie_embeddings


@pytest.mark.slow
def test_training_windows_cycle_through_the_training_keys_and_the_probe_asks_among_all(tmp_path, monkeypatch):
    seen, asked = [], []
    make = tasks.make_windows

    def recording(n, length, depth, generator, task="content", keys=tasks.MULTIKEYS, questions=1):
        seen.append((n, keys))
        asked.append((n, questions))
        return make(n, length, depth, generator, task, keys, questions)

    monkeypatch.setattr(retrieval, "make_windows", recording)
    spec = retrieval.retrieval_preset("retrieval-ci", task="multikey", encodings=("nope",), train_len=64, steps=6,
                                      train_keys=(1, 2, 3), monitor_trials=5, trials=3, multiples=(1,),
                                      depths=(0.5,))
    retrieval.run_retrieval_unit(spec, "nope", 0, tmp_path, "cpu", False, {})
    training = [k for n, k in seen if n == spec.training.batch_size]
    assert training == [(1, 2, 3)[step % 3] for step in range(len(training))] and len(training) >= spec.training.steps
    assert [k for n, k in seen if n in (spec.monitor_trials, spec.trials)] == \
        [tasks.MULTIKEYS] * sum(n in (spec.monitor_trials, spec.trials) for n, _ in seen)
    assert {q for _, q in asked} == {1}
    # several questions: the training windows only; the probe and the grid still ask one
    asked.clear()
    retrieval.run_retrieval_unit(dataclasses.replace(spec, train_questions=(1, 3)), "nope", 0, tmp_path / "q", "cpu",
                                 False, {})
    training = [q for n, q in asked if n == spec.training.batch_size]
    assert training == [(1, 3)[step % 2] for step in range(len(training))]
    assert {q for n, q in asked if n in (spec.monitor_trials, spec.trials)} == {1}


def test_accuracy_by_absolute_distance_pools_cells_by_their_distance():
    def row(seed, length, depth, distance, correct, trials=10):
        return {"encoding": "alibi", "strategy": "-", "seed": seed, "eval_len": length, "depth": depth,
                "distance": distance, "status": "ok", "correct": correct, "trials": trials}

    rows = [row(0, 128, 1.0, 5, 10), row(0, 512, 1.0, 5, 9), row(1, 512, 0.0, 500, 1), row(1, 1024, 0.5, 510, 0),
            {**row(0, 2048, 0.0, 0, 0, 0), "status": "cannot extrapolate"}]
    table = accuracy.by_distance(rows, edges=(0, 64, 1024))
    assert table.loc[("alibi", "0-64"), "correct"] == 19 and table.loc[("alibi", "0-64"), "trials"] == 20
    assert table.loc[("alibi", "64-1024"), "accuracy"] == pytest.approx(1 / 20)
    low, high = accuracy.wilson(1, 20)
    assert (table.loc[("alibi", "64-1024"), "ci_low"], table.loc[("alibi", "64-1024"), "ci_high"]) == (low, high)
    seeds = accuracy.by_seed(rows)
    assert seeds[("alibi", 512, 0)] == pytest.approx(0.9) and seeds[("alibi", 512, 1)] == pytest.approx(0.1)


def test_distance_of_old_content_rows_is_the_windows_geometry():
    # rows made before the distance column: by_distance recomputes it, and it must equal the windows' own
    for length, depth in [(128, 0.0), (256, 0.25), (512, 0.5), (1024, 1.0)]:
        x, y, key, start = tasks.make_windows(1, length, depth, torch.Generator().manual_seed(0))
        distance = length - int((y[0] != model.IGNORE).sum()) - int(start[0])
        rows = [{"encoding": "t5", "strategy": "-", "seed": 0, "eval_len": length, "depth": depth, "status": "ok",
                 "correct": 1, "trials": 1}]
        table = accuracy.by_distance(rows, edges=(distance, distance + 1))
        assert len(table) == 1 and table["trials"].iloc[0] == 1


def test_a_label_whose_seeds_did_not_all_learn_the_task_is_marked():
    def row(seed, length, train_accuracy, correct):
        return {"encoding": "nope", "strategy": "-", "seed": seed, "eval_len": length, "depth": 0.5, "status": "ok",
                "correct": correct, "trials": 10, "train_accuracy": train_accuracy}

    rows = [row(0, 128, 1.0, 10), row(1, 128, 0.89, 8), row(0, 256, 1.0, 9), row(1, 256, 0.89, 3)]
    table = accuracy.by_length(rows)
    assert table.loc[("nope", 128), "train_accuracy"] == 0.89  # the lowest seed, not the first
    assert table.loc[("nope", 256), "accuracy"] == pytest.approx(12 / 20)
    text = accuracy.markdown_table(rows)
    assert "| nope (not learned: lowest seed 0.89 at the end of training) |" in text
    assert "not learned" not in accuracy.markdown_table([row(0, 128, 0.96, 10)])


def test_distances_past_the_last_edge_fall_in_an_open_bin_and_unknown_training_is_marked():
    rows = [{"encoding": "alibi", "strategy": "-", "seed": 0, "eval_len": 4096, "depth": 0.0, "distance": 3000,
             "status": "ok", "correct": 1, "trials": 10, "train_accuracy": float("nan")}]
    table = accuracy.by_distance(rows, edges=(0, 64, 2048))
    assert table.loc[("alibi", "2048+"), "trials"] == 10
    assert "(training accuracy unknown)" in accuracy.markdown_table(rows)
    old = [{k: v for k, v in rows[0].items() if k != "distance"} | {"task": "digits"}]
    with pytest.raises(PosencError, match="without a distance column"):
        accuracy.by_distance(old)


def test_the_multikey_form_is_recorded_with_the_run():
    described = tasks.describe_task("multikey")
    assert described["needle"] == "K48213;" and described["question"] == "?K"
    x, y, key, start = tasks.make_windows(1, 96, 0.5, torch.Generator().manual_seed(0), "multikey")
    window = bytes(x[0].tolist())
    at = int(start[0])
    assert window[at + 1 : at + 6] == bytes(key[0].tolist()) and window[at + 6 : at + 7] == b";"
    # the input ends with the question, the name and the first four digits (the fifth is only a target)
    assert window[-6:-5] == b"?" and window[-5:-4] == window[at : at + 1] and window[-4:] == window[at + 1 : at + 5]


@pytest.mark.slow
def test_the_command_line_passes_the_multikey_training_options(tmp_path):
    from posenc_lab.__main__ import main

    out = tmp_path / "run"
    assert main(["retrieval", "--preset", "retrieval-ci", "--task", "multikey", "--encodings", "nope", "--steps", "2",
                 "--train-len", "72", "--multiples", "1", "--depths", "0.5", "--trials", "2", "--train-questions",
                 "1,2", "--untied", "--no-progress", "--out", str(out)]) == 0
    spec = json.loads((out / "config.json").read_text())["spec"]
    assert spec["train_questions"] == [1, 2] and spec["model"]["tie_embeddings"] is False
    assert spec["model"]["train_len"] == 72 and spec["training"]["steps"] == 2
    weights = torch.load(out / "models" / "nope-s0.pt", weights_only=True)
    assert not torch.equal(weights["head.weight"], weights["tok_emb.weight"])
    # results.model_from_run rebuilds a retrieval run's model from its folder, untied as trained, every weight in place
    from posenc_lab.lab import results

    assert isinstance(spec_of(json.loads((out / "config.json").read_text())), retrieval.RetrievalSpec)
    model = results.model_from_run(out, "nope")
    assert not model.training and not model.cfg.tie_embeddings and model.cfg.train_len == 72
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


@pytest.mark.slow
def test_the_answer_digits_script_reads_a_run_byte_by_byte(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from posenc_lab.__main__ import main

    out = tmp_path / "run"
    assert main(["retrieval", "--preset", "retrieval-ci", "--task", "digits", "--encodings", "rope", "--strategies",
                 "none", "--steps", "2", "--multiples", "1", "--depths", "0,1", "--trials", "2", "--no-progress",
                 "--out", str(out)]) == 0
    script = Path(__file__).parent.parent / "scripts" / "answer_digits.py"
    p = subprocess.run([sys.executable, str(script), str(out), "rope", "0", "--windows", "4"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("rope seed 0, digits, 32 bytes, 4 windows a depth") and len(lines) == 3
    missing = subprocess.run([sys.executable, str(script), str(out), "rope", "1"], capture_output=True, text=True,
                             timeout=120)  # a seed the run never trained: one line that says so, no traceback
    assert missing.returncode == 1 and "no trained model for rope seed 1" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    for line in lines[1:]:  # five shares, each a multiple of 1/4, and the exact match
        shares = line.split("right by answer byte ")[1].split(";")[0].split()
        assert len(shares) == tasks.DIGITS_LEN and all(float(s) * 4 == round(float(s) * 4) for s in shares)


def test_the_tasks_and_the_accuracy_tables_live_in_their_own_modules():
    """The tasks' and the accuracy tables' functions are defined in ``data.tasks`` and ``measure.accuracy``, where
    every import names them; the retrieval module is the run, its presets and its report."""
    from posenc_lab.lab.data import tasks
    from posenc_lab.lab.measure import accuracy

    for module, names in ((tasks, ["make_windows", "describe_task"]),
                          (accuracy, ["wilson", "with_wilson", "frame", "by_length", "by_distance", "by_seed",
                                      "seed_counts", "markdown_table"])):
        for name in names:
            assert getattr(module, name).__module__ == module.__name__, name
    assert not hasattr(retrieval, "FILLER") and not hasattr(retrieval, "by_seed")


@pytest.mark.parametrize("preset", list(retrieval.RETRIEVAL_PRESETS))
def test_every_encoding_of_every_retrieval_preset_builds_at_its_depth(preset):
    """A preset names no encoding its model cannot hold (a layer mix with no global layer is refused at build)."""
    spec = retrieval.retrieval_preset(preset)
    for name in spec.encodings:
        GPT(spec.model_config(name))


@pytest.mark.slow
def test_encoding_options_reach_the_trained_model_and_the_loaded_one(tmp_path):
    from posenc_lab.lab import results

    spec = retrieval.retrieval_preset("retrieval-ci", encodings=("gemma3",),
                                      encoding_options={"gemma3": {"sliding_window_pattern": 1}})
    assert spec.model.n_layer == 1 and spec.to_dict()["encoding_options"] == {"gemma3": {"sliding_window_pattern": 1}}
    assert retrieval.RetrievalSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert "encoding_options" not in retrieval.retrieval_preset("retrieval-ci").to_dict()  # older configs unchanged
    retrieval.run(spec, tmp_path, progress=False, log=lambda *a: None)
    model = results.model_from_run(tmp_path, "gemma3")
    assert model.encoding.interval == 1 and model.encoding.for_layer(0, 1) is model.encoding.global_layer
    with pytest.raises(PosencError, match="encoding_options name 'fox', which the spec does not train"):
        retrieval.retrieval_preset("retrieval-ci", encoding_options={"fox": {}})
    digits = retrieval.retrieval_preset("retrieval-digits-recent")
    mix = GPT(digits.model_config("gemma3")).encoding
    assert [mix.for_layer(i, 2).window for i in range(2)] == [digits.model.train_len // 4, None]


def test_the_past_softmax_digits_run_is_the_digits_run_with_other_encodings():
    past, base = (retrieval.retrieval_preset(n) for n in ("retrieval-digits-past-softmax", "retrieval-digits-cpu"))
    assert set(past.encodings) == {"stick-breaking", "path", "dape-kerple"}
    assert dataclasses.replace(past, preset=base.preset, encodings=base.encodings, notes=base.notes) == base
