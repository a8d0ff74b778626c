"""The experiment: evaluation arithmetic, training safety, resume after kill -9, the ci preset, the CLI."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posenc_lab import PosencError, TrainingDiverged
from posenc_lab.__main__ import main
from posenc_lab.model import GPT, GPTConfig
from posenc_lab.lab.experiments import extend_run, language_model as experiment
from posenc_lab.lab.measure import budget, perplexity_grid
from posenc_lab.lab.measure.perplexity import evaluate, unscored, window_plan
from posenc_lab.lab.run import units
from posenc_lab.lab.run.schema import SCHEMA_VERSION
from posenc_lab.lab.run.training import TrainConfig, train
from posenc_lab.lab.verdicts import claims, tables as report

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tokens,length,stride", [(64, 16, 4), (96, 32, 32), (1024, 256, 64), (48, 48, 8)])
def test_every_mode_scores_each_target_exactly_once(tokens, length, stride):
    lead_in = length - stride  # enough lead-in for every sliding window
    for mode in ("nonoverlapping", "sliding"):
        scored = []
        for start, first in window_plan(tokens, length, mode, stride, lead_in):
            scored += range(start + first + 1, start + length + 1)
        assert sorted(scored) == list(range(lead_in + 1, lead_in + tokens + 1))


@pytest.mark.parametrize("tokens,length,stride,lead_in", [(64, 16, 4, 0), (1024, 256, 64, 100), (96, 32, 8, 24)])
def test_every_sliding_target_sees_at_least_length_minus_stride_bytes(tokens, length, stride, lead_in):
    # Press et al.'s definition: a target at window index i has i earlier bytes in its window
    plan = window_plan(tokens, length, "sliding", stride, lead_in)
    targets = [(start + i + 1, i) for start, first in plan for i in range(first, length)]
    assert all(i >= length - stride for _, i in targets)
    assert len({t for t, _ in targets}) == len(targets)  # once each
    missing = max(0, length - stride - lead_in)  # without enough lead-in, the first windows are left out
    left_out = -(-missing // stride) * stride
    assert unscored(tokens, length, "sliding", stride, lead_in) == left_out == tokens - len(targets)
    assert sorted(t for t, _ in targets) == list(range(lead_in + 1 + left_out, lead_in + tokens + 1))


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(encoding="alibi", n_layer=1, n_head=2, d_model=16, train_len=8)).eval()


def test_evaluate_matches_direct_computation(tiny_model):
    stream = (torch.arange(200) * 7 % 256).to(torch.uint8)
    r = evaluate(tiny_model, stream, length=32, tokens=64)
    with torch.no_grad():
        windows = stream[:65].long()
        manual = torch.cat([tiny_model.token_losses(windows[None, s:s + 32], windows[None, s + 1:s + 33])[0] for s in (0, 32)])
    assert r["loss"] == pytest.approx(manual.double().mean().item(), rel=1e-6)
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2))
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
    # sliding windows with stride = length are non-overlapping windows
    assert evaluate(tiny_model, stream, length=32, tokens=64, mode="sliding", stride=32)["loss"] == pytest.approx(r["loss"])
    # with lead-in, sliding windows score the same targets, each with at least length - stride bytes before it
    slid = evaluate(tiny_model, stream, length=32, tokens=64, mode="sliding", stride=8, lead_in=24)
    with torch.no_grad():
        manual = torch.cat([tiny_model.token_losses(stream[None, e - 32:e].long(), stream[None, e - 31:e + 1].long())[0, -8:]
                            for e in range(32, 89, 8)])
    assert slid["tokens"] == 64 and slid["loss"] == pytest.approx(manual.double().mean().item(), rel=1e-6)


def test_per_document_losses_add_up_to_the_total(tiny_model):
    stream = (torch.arange(300) * 11 % 256).to(torch.uint8)
    documents = torch.arange(300) // 37  # eight documents and a bit
    for mode, stride in (("nonoverlapping", None), ("sliding", 8)):
        r = evaluate(tiny_model, stream, length=32, tokens=128, mode=mode, stride=stride, lead_in=24, documents=documents)
        sums = r["per_document"]
        assert sum(n for _, n in sums.values()) == r["tokens"] == 128
        assert sum(s for s, _ in sums.values()) / 128 == pytest.approx(r["loss"], rel=1e-9)
        # targets 25 .. 152 belong to documents 0 .. 4; document 1 holds targets 37 .. 73
        assert set(sums) == {0, 1, 2, 3, 4} and sums[1][1] == 37


@pytest.mark.parametrize("kwargs,match", [
    (dict(length=0), "positive"), (dict(tokens=-4), "positive"), (dict(mode="sliding", stride=0), "positive"),
    (dict(mode="sliding", stride=5), "stride 5"), (dict(mode="strided"), "valid modes"), (dict(length=24), "multiple"),
])
def test_bad_evaluation_arguments(tiny_model, kwargs, match):
    stream = torch.zeros(500, dtype=torch.uint8)
    args = dict(length=16, tokens=64) | kwargs
    with pytest.raises(PosencError, match=match):
        evaluate(tiny_model, stream, **args)


def poisoned_model(monkeypatch, nan_at) -> GPT:
    """A one-layer RoPE model whose loss turns NaN at the calls ``nan_at`` says (a predicate of the call count)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="rope", n_layer=1, n_head=2, d_model=16, train_len=8))
    real_loss, calls = model.loss, []

    def poisoned(x, y):
        calls.append(1)
        loss = real_loss(x, y)
        return loss * float("nan") if nan_at(len(calls)) else loss

    monkeypatch.setattr(model, "loss", poisoned)
    return model


@pytest.mark.slow
def test_nan_loss_stops_with_clear_message_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    model = poisoned_model(monkeypatch, lambda call: call > 5)
    stream = (torch.arange(5000) % 97).to(torch.uint8)
    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 5 .*last good checkpoint .*ckpt.pt is kept"):
        train(model, stream, TrainConfig(steps=10, checkpoint_every=2, batch_size=2), checkpoint=ckpt, progress=False)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state"]["step"] == 4
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


def test_out_of_gpu_memory_is_a_clear_error(tiny_model, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(tiny_model, "token_losses", oom)
    with pytest.raises(PosencError, match="out of GPU memory evaluating at length 16 with batch size 8: lower the batch size"):
        evaluate(tiny_model, torch.zeros(100, dtype=torch.uint8), length=16, tokens=32)


def test_spec_rejects_bad_input():
    with pytest.raises(PosencError, match="valid presets: amplitude-cpu, article-cpu, article-long, article-long-b4, article-shape, ci, colab, cpu, paper, past-softmax-cpu, prose-long, prose-long-b4, recent-cpu, variants-cpu"):
        experiment.preset("huge")
    with pytest.raises(PosencError, match="positive"):
        experiment.preset("ci", train_len=0)
    with pytest.raises(PosencError, match="positive"):
        experiment.preset("ci", stride=-1)
    with pytest.raises(PosencError, match="multiple"):
        experiment.preset("ci", eval_lengths=(64, 100))
    with pytest.raises(PosencError, match="valid encodings"):
        experiment.preset("ci", encodings=("rope", "cope-v2"))
    with pytest.raises(PosencError, match="no fixed factor"):
        experiment.preset("ci", finetune=("dynamic-ntk",), finetune_steps=5, finetune_len=128)
    with pytest.raises(PosencError, match="longer than the training length") as err:
        experiment.preset("ci", finetune=("pi",), finetune_steps=5, finetune_len=64)
    assert "\n" not in str(err.value)


def test_a_spec_is_composed_of_parts_and_overrides_go_to_the_part_that_holds_them():
    """The model's shape, the training recipe, the evaluation and the fine-tuning are parts of a spec; an override
    by a flat name changes that one value of its part and nothing else."""
    ci = experiment.PRESETS["ci"]
    spec = experiment.preset("ci", steps=10, eval_lengths=(64,), n_layer=1, finetune=("pi",), finetune_steps=2,
                             finetune_len=128, seeds=(3,))
    assert spec.training == replace(ci.training, steps=10) and spec.model == replace(ci.model, n_layer=1)
    assert spec.evaluation == replace(ci.evaluation, eval_lengths=(64,)) and spec.seeds == (3,)
    assert spec.finetuning.finetune == ("pi",) and experiment.preset("ci", steps=None) == ci
    assert spec.model.config("rope").n_layer == 1 and spec.training.config(7).seed == 7
    names = experiment.Spec.flat_names()
    assert len(names) == len(set(names)) and {"steps", "train_len", "eval_lengths", "finetune_len"} <= set(names)
    assert experiment.Spec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(PosencError, match="unknown setting 'stepz'; valid settings: .*steps"):
        experiment.preset("ci", stepz=3)


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ci")
    spec = experiment.preset("ci", finetune=("pi",), finetune_steps=4, finetune_len=128)
    rows = experiment.run(spec, out, progress=False, log=lambda *a: None)
    return out, spec, rows


@pytest.mark.slow
def test_ci_preset_runs_every_encoding_end_to_end(ci_run):
    out, spec, rows = ci_run
    labels = {(r["encoding"], r["strategy"]) for r in rows}
    assert {e for e, _ in labels} == set(spec.encodings)
    assert {s for e, s in labels if e == "rope"} == {"none", "pi", "ntk", "dynamic-ntk", "yarn", "pi+ft"}
    evaluation = spec.evaluation
    assert len(rows) == (len(spec.encodings) - 1 + 6) * len(evaluation.eval_lengths) * len(evaluation.modes)
    for r in rows:
        if r["encoding"] == "learned" and r["eval_len"] > spec.model.train_len:
            assert r["status"] == "cannot extrapolate" and math.isnan(r["loss"])
        else:
            assert r["status"] == "ok" and 0 < r["loss"] < 10 and r["tokens"] == evaluation.eval_tokens
    ft = [r for r in rows if r["strategy"] == "pi+ft"]
    assert all(r["finetune_steps"] == 4 and r["finetune_tokens"] == 4 * 4 * 128 for r in ft)
    assert sorted(p.name for p in (out / "models").iterdir()) == sorted(f"{e}-s0.pt" for e in spec.encodings)
    assert not list((out / "checkpoints").glob("*.pt")), "finished units keep weights, not training state"
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert header == units.COLUMNS
    first = rows[0]
    assert first["torch"] == torch.__version__ and first["device"].startswith("cpu") and first["corpus"] == "stdlib"
    assert first["schema"] == SCHEMA_VERSION and "config" not in first  # the spec is in config.json, once
    config = json.loads((out / "config.json").read_text())
    assert config["schema"] == SCHEMA_VERSION and config["spec"]["preset"] == "ci"
    assert config["spec"]["training"] == {"steps": 40, "batch_size": 8, "lr": 3e-3, "warmup": 10, "checkpoint_every": 20}
    assert experiment.Spec.from_dict(config["spec"]) == spec  # the spec, composed of its parts, round-trips


@pytest.mark.slow
def test_report_tables_and_figures(ci_run):
    out, spec, rows = ci_run
    text = report.report(out)
    assert "| learned | " in text and "cannot extrapolate" in text and "| rope/yarn |" in text
    assert main(["report", str(out)]) == 0
    for name in ("ppl_vs_length.png", "per_position.png"):
        assert (out / "figures" / name).stat().st_size > 10_000


@pytest.mark.slow
def test_rerun_continues_and_refuses_a_different_experiment(ci_run):
    out, spec, rows = ci_run
    logged = []
    again = experiment.run(spec, out, progress=False, log=logged.append)
    assert again == rows and all("done already" in line for line in logged)
    with pytest.raises(PosencError, match="holds a different experiment"):
        experiment.run(experiment.preset("ci", steps=41), out, progress=False)


def cli(*args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kw.setdefault("cwd", ROOT)
    return subprocess.Popen([sys.executable, "-m", "posenc_lab", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def comparable(rows):
    timing = {"eval_seconds", "train_seconds", "train_tokens_per_s", "git_commit"}
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


@pytest.mark.slow
def test_a_resumed_unit_counts_the_training_time_of_the_process_before(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="rope", n_layer=1, n_head=2, d_model=16, train_len=8))
    stream = torch.randint(0, 256, (4096,))
    ckpt = tmp_path / "unit.pt"
    first = train(model, stream, TrainConfig(steps=2, batch_size=2, warmup=1, checkpoint_every=2), checkpoint=ckpt,
                  progress=False)
    assert first["resumed_seconds"] == 0.0
    carried = torch.load(ckpt, weights_only=False)["state"]["seconds"]
    assert carried == first["train_seconds"] > 0
    second = train(model, stream, TrainConfig(steps=4, batch_size=2, warmup=1, checkpoint_every=2), checkpoint=ckpt,
                   progress=False)
    assert second["resumed_seconds"] == carried and second["train_seconds"] > carried
    # the runner adds it to the unit's wall time, and the unit file does not keep the field
    units.run_units(tmp_path, [("rope", 0)], lambda e, s: {"encoding": e, "seed": s, "resumed_seconds": 1000.0},
                         log=lambda *a: None)
    unit = json.loads((tmp_path / "units" / "rope-s0.json").read_text())
    assert 1000.0 <= unit["seconds"] < 1010.0 and "resumed_seconds" not in unit


@pytest.mark.slow
def test_resume_after_kill_9_gives_identical_results(tmp_path):
    args = ["run", "--preset", "ci", "--encodings", "t5", "--steps", "300", "--checkpoint-every", "30",
            "--eval-lengths", "64,128", "--no-progress", "--no-report"]
    whole = cli(*args, "--out", str(tmp_path / "whole"))
    killed = cli(*args, "--out", str(tmp_path / "killed"))
    ckpt = tmp_path / "killed" / "checkpoints" / "t5-s0.pt"
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "units" / "t5-s0.json").exists(), "the run ended before it was killed"
    step = torch.load(ckpt, weights_only=False)["state"]["step"]
    assert 0 < step < 300
    resumed = cli(*args, "--out", str(tmp_path / "killed"))
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    a = json.loads((tmp_path / "whole" / "results.json").read_text())
    b = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert comparable(a) == comparable(b)
    ua = json.loads((tmp_path / "whole" / "units" / "t5-s0.json").read_text())
    ub = json.loads((tmp_path / "killed" / "units" / "t5-s0.json").read_text())
    assert ua["train_losses"] == ub["train_losses"] and ua["encoding_state"] == ub["encoding_state"]
    # the resumed unit's wall time holds all of its training, the part before the kill included
    assert ub["seconds"] >= b[0]["train_seconds"] - 0.1


@pytest.mark.parametrize("args,message", [
    (["run", "--preset", "huge", "--out", "x"], "unknown preset 'huge'; valid presets: amplitude-cpu, article-cpu, article-long, article-long-b4, article-shape, ci, colab, cpu, paper, past-softmax-cpu, prose-long, prose-long-b4, recent-cpu, variants-cpu"),
    (["run", "--preset", "ci", "--corpus", "/no/such/corpus", "--out", "x"], "corpus path '/no/such/corpus' does not exist"),
    (["run", "--preset", "ci", "--eval-lengths", "64,0", "--out", "x"], "evaluation length must be a positive number"),
    (["run", "--preset", "ci", "--stride", "0", "--out", "x"], "stride must be a positive number"),
    (["run", "--preset", "ci", "--encodings", "rope,cope-v2", "--out", "x"], "unknown encoding 'cope-v2'"),
    (["report", "/no/such/run"], "has no results.json"),
])
def test_cli_bad_input_is_one_clear_line(tmp_path, args, message):
    args = [str(tmp_path / a) if a == "x" else a for a in args]
    p = cli(*args)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and message in err and "Traceback" not in err


@pytest.mark.slow
def test_article_preset_runs_at_toy_size(tmp_path):
    """The article-cpu preset's configuration (every encoding, three seeds, fine-tune rows for one seed, 512 -> 8192
    shape scaled down 8x, its evaluation text to 4 windows of the longest length, 2 checkpoint evaluations) end to
    end, so that it cannot rot."""
    article = experiment.PRESETS["article-cpu"]
    scale, evaluation = 8, article.evaluation
    spec = experiment.preset("article-cpu", n_layer=1, d_model=32, steps=3, batch_size=2, warmup=1,
                             train_len=article.model.train_len // scale,
                             eval_lengths=tuple(n // scale for n in evaluation.eval_lengths),
                             eval_tokens=4 * evaluation.eval_lengths[-1] // scale, stride=evaluation.stride // scale,
                             sliding=tuple((n // scale, s // scale) for n, s in evaluation.sliding),
                             curve_tokens=2048, curve_points=2, checkpoint_every=1,
                             finetune_steps=2, finetune_len=article.finetuning.finetune_len // scale)
    assert spec.seeds == spec.other_seeds == (0, 1, 2) and spec.finetuning.finetune_seeds == (0,)
    rows = experiment.run(spec, tmp_path, progress=False, log=lambda *a: None)
    units = {(r["encoding"], r["seed"]) for r in rows}
    assert units == {(e, s) for e in spec.encodings for s in (0, 1, 2)}
    finetuned = {(r["strategy"], r["seed"]) for r in rows if r["strategy"].endswith("+ft")}
    assert finetuned == {(f"{s}+ft", 0) for s in ("pi", "ntk", "yarn")}
    for mode in ("sliding", "nonoverlapping"):  # every claim has its numbers in both modes
        text = claims.claims_text(rows, mode, judged_len=spec.evaluation.eval_lengths[2])
        assert text.startswith("decision rule") and "no data" not in text and "n/a" not in text


@pytest.mark.slow
def test_article_long_preset_is_article_cpu_with_four_times_the_tokens_and_runs_at_toy_size(tmp_path):
    """article-long is article-cpu's model, recipe and evaluation with at least 4x its training tokens
    (the schedule stretched alike), for the article's encodings, three seeds, 16 checkpoint evaluations; end to end
    at toy size, with numbers behind every claim in both modes and the verdicts along training."""
    long, short = experiment.PRESETS["article-long"], experiment.PRESETS["article-cpu"]
    assert long.model == short.model and (long.seeds, long.strategies) == (short.seeds, short.strategies)
    assert long.evaluation == replace(short.evaluation, curve_points=long.evaluation.curve_points)
    lt, st = long.training, short.training
    assert lt.batch_size == st.batch_size and lt.lr == st.lr
    assert lt.steps * lt.batch_size >= 4 * st.steps * st.batch_size and lt.warmup / lt.steps == st.warmup / st.steps
    assert {"sinusoidal", "rope", "alibi", "t5"} <= set(long.encodings) and long.evaluation.curve_points >= 8
    scale, evaluation = 8, long.evaluation
    spec = experiment.preset("article-long", n_layer=1, d_model=32, steps=16, batch_size=2, warmup=2,
                             train_len=long.model.train_len // scale,
                             eval_lengths=tuple(n // scale for n in evaluation.eval_lengths),
                             eval_tokens=4096, stride=evaluation.stride // scale,
                             sliding=tuple((n // scale, s // scale) for n, s in evaluation.sliding),
                             curve_tokens=2048, checkpoint_every=4)
    rows = experiment.run(spec, tmp_path, progress=False, log=lambda *a: None)
    assert {(r["encoding"], r["seed"]) for r in rows} == {(e, s) for e in long.encodings for s in (0, 1, 2)}
    checkpoints = units.collect(tmp_path, "checkpoints")
    assert sorted({c["step"] for c in checkpoints}) == spec.curve_steps() and len(spec.curve_steps()) == 16
    assert (tmp_path / "checkpoints.csv").read_text().count("\n") == len(checkpoints) + 1
    for mode in ("sliding", "nonoverlapping"):
        text = claims.claims_text(rows, mode, judged_len=spec.evaluation.eval_lengths[2])
        assert "no data" not in text and "n/a" not in text
    table = budget.budget_verdicts(checkpoints)
    assert len(table.columns) == 16 and list(table.columns) == sorted(table.columns)
    assert "1: a (slightly worse at training length)" in table.index


@pytest.mark.slow
def test_extend_adds_evaluations_from_the_kept_weights(tmp_path):
    """A length and a sliding stride added after a run: exactly the rows a fresh run of the larger spec makes,
    from the kept weights, without training; and every way the two specs may not differ is refused."""
    small = dict(encodings=("rope", "alibi"), strategies=("none", "yarn"), steps=6, eval_lengths=(64, 128),
                 sliding=((128, 64),), finetune=("pi",), finetune_steps=2, finetune_len=128)
    before = experiment.preset("ci", **small)
    after = experiment.preset("ci", **{**small, "eval_lengths": (64, 128, 256), "sliding": ((64, 32), (128, 64))})
    quiet = dict(progress=False, log=lambda *a: None)
    old = experiment.run(before, tmp_path / "a", **quiet)
    units_before = {p.name: json.loads(p.read_text()) for p in (tmp_path / "a" / "units").glob("*.json")}
    extended = extend_run.extend(after, tmp_path / "a", **quiet)
    fresh = experiment.run(after, tmp_path / "b", **quiet)
    assert len(extended) > len(old)
    # no training: the same training record, no training state written; the old rows unchanged
    for name, unit in units_before.items():
        now = json.loads((tmp_path / "a" / "units" / name).read_text())
        assert now["train_losses"] == unit["train_losses"] and now["checkpoints"] == unit["checkpoints"]
        assert all(r in now["rows"] for r in unit["rows"])
    assert not list((tmp_path / "a" / "checkpoints").glob("*.pt"))
    # the new rows carry the extension's commit and machine, the old ones those of the run
    new_rows = [r for r in extended if (r["eval_len"], r["eval_mode"]) in {(256, "nonoverlapping"), (64, "sliding")}]
    assert new_rows and {r["git_commit"] for r in new_rows} == {units.git_commit()}
    # fine-tuned weights are not kept, so +ft rows keep only the evaluations they had
    key = lambda r: (r["encoding"], r["strategy"], r["seed"], r["eval_len"], r["eval_mode"])
    have = {key(r) for r in extended}
    assert comparable(extended) == comparable([r for r in fresh if key(r) in have])
    assert {key(r) for r in fresh} - have == {("rope", "pi+ft", 0, 256, "nonoverlapping"),
                                              ("rope", "pi+ft", 0, 64, "sliding")}
    unit = json.loads((tmp_path / "a" / "units" / "rope-s0.json").read_text())
    assert unit["extended"][0]["evaluations"] == [[64, "sliding", 32], [256, "nonoverlapping", None]]
    assert unit["extended"][0]["not_extended"] == [["pi+ft", 64, "sliding", 32], ["pi+ft", 256, "nonoverlapping", None]]
    assert set(unit["per_position"]["none"]) == {"64", "128", "256"}
    assert json.loads((tmp_path / "a" / "config.json").read_text())["spec"]["evaluation"]["eval_lengths"] == [64, 128, 256]
    docs = sorted((tmp_path / "a" / "documents.csv").read_text().splitlines())
    gone = ("rope,pi+ft,0,256,nonoverlapping,", "rope,pi+ft,0,64,sliding,")
    assert docs == sorted(line for line in (tmp_path / "b" / "documents.csv").read_text().splitlines()
                          if not line.startswith(gone))
    assert extend_run.extend(after, tmp_path / "a", **quiet) == extended  # nothing left to add
    snapshot = {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    for change, message in [(dict(steps=7), "steps differ"),
                            (dict(eval_lengths=(64, 128, 256), sliding=((256, 64), (128, 64))), "different evaluation text"),
                            (dict(eval_lengths=(128,)), "drops")]:
        with pytest.raises(PosencError, match=message):
            extend_run.extend(experiment.preset("ci", **{**small, **change}), tmp_path / "a", **quiet)
    assert {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()} == snapshot, "a refusal wrote"
    (tmp_path / "a" / "models" / "alibi-s0.pt").unlink()
    with pytest.raises(PosencError, match="kept no final weights for alibi-s0"):
        extend_run.extend(after, tmp_path / "a", **quiet)
    with pytest.raises(PosencError, match="no run to extend"):
        extend_run.extend(after, tmp_path / "none", **quiet)


@pytest.mark.slow
def test_an_interrupted_extension_blocks_run_and_continues(tmp_path, monkeypatch):
    """An extension cut short leaves config.json naming the spec it extends to: run refuses the folder, extend
    with another spec refuses, extend with the same spec finishes, and the result equals an uninterrupted one.
    Under torchrun, and on another kind of device than the run's, extend refuses before writing anything."""
    small = dict(encodings=("nope", "alibi"), steps=4, eval_lengths=(64, 128), modes=("nonoverlapping",))
    before, after = experiment.preset("ci", **small), experiment.preset("ci", **{**small, "eval_lengths": (64, 128, 256)})
    quiet = dict(progress=False, log=lambda *a: None)
    for out in ("cut", "whole"):
        experiment.run(before, tmp_path / out, **quiet)
    whole = extend_run.extend(after, tmp_path / "whole", **quiet)
    real, calls = perplexity_grid.evaluate_all, []

    def cut_after_one_unit(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(extend_run, "evaluate_all", cut_after_one_unit)
    with pytest.raises(KeyboardInterrupt):
        extend_run.extend(after, tmp_path / "cut", **quiet)
    monkeypatch.setattr(extend_run, "evaluate_all", real)
    extending = json.loads((tmp_path / "cut" / "config.json").read_text())["extending"]
    assert extending["evaluation"]["eval_lengths"] == [64, 128, 256]
    with pytest.raises(PosencError, match="being extended"):
        experiment.run(before, tmp_path / "cut", **quiet)
    with pytest.raises(PosencError, match="another spec"):
        extend_run.extend(experiment.preset("ci", **{**small, "eval_lengths": (64, 128, 512)}), tmp_path / "cut",
                          **quiet)
    cut = extend_run.extend(after, tmp_path / "cut", **quiet)
    assert comparable(cut) == comparable(whole)
    assert "extending" not in json.loads((tmp_path / "cut" / "config.json").read_text())
    assert experiment.run(after, tmp_path / "cut", **quiet) == cut  # the extended run is an ordinary run again

    further = experiment.preset("ci", **{**small, "eval_lengths": (64, 128, 256, 512)})
    snapshot = {p: p.read_bytes() for p in (tmp_path / "cut").rglob("*") if p.is_file()}
    monkeypatch.setattr(experiment.distributed, "active", lambda: True)
    with pytest.raises(PosencError, match="one process"):
        extend_run.extend(further, tmp_path / "cut", **quiet)
    monkeypatch.undo()
    unit_path = tmp_path / "cut" / "units" / "nope-s0.json"
    unit = json.loads(unit_path.read_text())
    for r in unit["rows"]:
        r["device"] = "cuda:0 (a GPU)"
    unit_path.write_text(json.dumps(unit))
    snapshot[unit_path] = unit_path.read_bytes()
    with pytest.raises(PosencError, match="evaluated on cuda"):
        extend_run.extend(further, tmp_path / "cut", **quiet)
    assert {p: p.read_bytes() for p in (tmp_path / "cut").rglob("*") if p.is_file()} == snapshot


@pytest.mark.slow
def test_cli_extend(tmp_path):
    args = ["run", "--preset", "ci", "--encodings", "nope", "--steps", "2", "--modes", "nonoverlapping",
            "--no-report", "--no-progress", "--out", str(tmp_path)]
    assert main([*args, "--eval-lengths", "64"]) == 0
    assert main([*args, "--eval-lengths", "64,128", "--extend"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["eval_len"] for r in rows] == [64, 128] and "train_losses" in json.loads(
        (tmp_path / "units" / "nope-s0.json").read_text())


@pytest.mark.slow
def test_cli_out_defaults_to_runs_preset(tmp_path):
    p = cli("run", "--preset", "ci", "--encodings", "nope", "--steps", "2", "--eval-lengths", "64", "--no-report",
            "--no-progress", cwd=tmp_path)
    p.communicate(timeout=300)
    assert p.returncode == 0 and (tmp_path / "runs" / "ci" / "units" / "nope-s0.json").exists()


def test_cli_help_explains_every_option():
    p = cli("run", "--help")
    out, _ = p.communicate(timeout=60)
    for option in ("--preset", "--encodings", "--corpus", "--eval-lengths", "--stride", "--finetune", "--seeds", "--device"):
        assert option in out


@pytest.mark.slow
def test_cli_jobs_runs_units_side_by_side_and_matches_one_process(tmp_path):
    """--jobs runs each unit in its own process on the shared folder; the table equals a one-process run's."""
    args = ["run", "--preset", "ci", "--encodings", "nope,alibi", "--seeds", "0", "--steps", "3",
            "--eval-lengths", "64", "--modes", "nonoverlapping", "--no-report", "--no-progress"]
    p = cli(*args, "--jobs", "2", "--out", str(tmp_path / "jobs"))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "nope:0 done" in out and "alibi:0 done" in out
    assert sorted(x.name for x in (tmp_path / "jobs" / "logs").iterdir()) == ["alibi-s0.log", "nope-s0.log"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("jobs", "one"))
    # each process gets its share of the cores: the device's thread count differs, and with it the order of
    # floating-point sums (losses agree to rounding)
    assert [r.pop("device").split("(")[0] for r in a] == [r.pop("device").split("(")[0] for r in b]
    for x, y in zip(comparable(a), comparable(b), strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-6) if isinstance(x[k], float) else x[k] == y[k], k


@pytest.mark.slow
def test_cli_unit_runs_only_that_unit_and_refuses_a_bad_one(tmp_path):
    args = ["run", "--preset", "ci", "--encodings", "nope,alibi", "--steps", "2", "--eval-lengths", "64",
            "--modes", "nonoverlapping", "--no-report", "--no-progress", "--out", str(tmp_path)]
    assert main([*args, "--unit", "alibi:0"]) == 0
    assert [p.name for p in (tmp_path / "units").iterdir()] == ["alibi-s0.json"]
    p = cli(*args, "--unit", "alibi")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "is not ENCODING:SEED" in err and "Traceback" not in err


@pytest.mark.slow
def test_jobs_from_main_hand_the_units_the_arguments_given_to_main(tmp_path, capsys):
    """main(argv) with --jobs: each unit's process gets ``argv``, not the calling program's own command line."""
    args = ["run", "--preset", "ci", "--encodings", "nope", "--seeds", "0,1", "--steps", "2", "--eval-lengths", "64",
            "--modes", "nonoverlapping", "--no-report", "--no-progress", "--jobs", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "nope:0 done" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "units").iterdir()) == ["nope-s0.json", "nope-s1.json"]


def test_an_odd_head_dimension_is_refused_only_by_encodings_that_rotate_pairs():
    assert experiment.preset("ci", encodings=("ssmax", "nope-temp"), d_model=36, n_head=4).model.d_model == 36
    with pytest.raises(PosencError, match="must be even"):
        experiment.preset("ci", encodings=("ssmax-rope",), d_model=36, n_head=4)


@pytest.mark.slow
def test_losses_read_in_windows_equal_losses_read_every_step(tmp_path):
    """Reading the loss every 4 steps (as on CUDA) trains the same model and records the same losses; a checkpoint
    forces a read, so a run resumed from it is unchanged."""
    stream = (torch.arange(4000) % 89).to(torch.uint8)
    runs = {}
    for every in (1, 4):
        torch.manual_seed(0)
        model = GPT(GPTConfig(encoding="rope", n_layer=1, n_head=2, d_model=16, train_len=8))
        runs[every] = train(model, stream, TrainConfig(steps=10, checkpoint_every=3, batch_size=2, warmup=2),
                            checkpoint=tmp_path / f"every{every}.pt", progress=False, sync_every=every)
        assert torch.load(tmp_path / f"every{every}.pt", weights_only=False)["state"]["step"] == 10
    assert runs[1]["losses"] == runs[4]["losses"] and len(runs[4]["losses"]) == 10


@pytest.mark.slow
def test_nan_loss_found_at_a_windowed_read_names_its_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    model = poisoned_model(monkeypatch, lambda call: call == 7)
    stream = (torch.arange(5000) % 97).to(torch.uint8)
    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 6 .*ckpt.pt is kept"):
        train(model, stream, TrainConfig(steps=12, checkpoint_every=4, batch_size=2), checkpoint=ckpt,
              progress=False, sync_every=3)
    assert torch.load(ckpt, weights_only=False)["state"]["step"] == 4


def test_the_past_softmax_methods_train_under_the_recent_methods_recipe():
    """Their paired comparisons with article-cpu's baselines need the same model, batches and evaluation."""
    past, recent = experiment.PRESETS["past-softmax-cpu"], experiment.PRESETS["recent-cpu"]
    assert set(past.encodings) == {"stick-breaking", "path", "dape-kerple"}
    assert replace(past, preset="recent-cpu", encodings=recent.encodings, notes=recent.notes) == recent
