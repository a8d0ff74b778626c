"""The committed results: one loader for a checkout and an installed package (chapters opened alone on Colab)."""

import pytest
import torch

from posenc_lab import PosencError
from posenc_lab.lab import results
from posenc_lab.lab.experiments.families import spec_of
from posenc_lab.lab.verdicts import tables as report


def test_every_committed_folder_is_a_named_run():
    """Every folder of committed results is a run of ``results.RUNS`` (which readers and the tools list) or the
    benchmarks, and every named run has its folder."""
    folders = {p.name for p in results.root().iterdir() if p.is_dir()} - {"benchmarks"}
    assert folders == set(results.RUNS)


@pytest.mark.parametrize("name", [n for n in results.RUNS if not n.startswith("context-")])
def test_every_committed_run_loads(name):
    rows, units, config = results.load(name)
    assert rows and units and config["spec"]
    assert {(u["encoding"], u["seed"]) for u in units} == {(r["encoding"], r["seed"]) for r in rows}


def test_committed_benchmarks_load():
    for name in ("cpu-attention", "cpu-train", "cpu-long-eval", "cpu-levers", "cpu-generate", "cpu-peer", "cpu-step"):
        bench = results.benchmark(name)
        assert bench["rows"] and bench["environment"]


def test_unknown_results_are_a_clear_error():
    with pytest.raises(PosencError, match="no committed results named 'nope-run'"):
        results.load("nope-run")
    with pytest.raises(PosencError, match="no committed benchmark"):
        results.benchmark("gpu-dreams")


@pytest.mark.slow  # evaluates two trained models on the evaluation text
@pytest.mark.parametrize("encoding", ["alibi", "sinusoidal"])
def test_committed_models_reproduce_their_committed_numbers(encoding):
    """The float16 weights of article-cpu seed 0 score (about) what the run measured in float32.

    Sinusoidal checks that a model is rebuilt with the recipe its run trained with (config.json says which)."""
    from posenc_lab.lab.data.corpora import load_corpus
    from posenc_lab.lab.measure.perplexity import evaluate

    rows, _, config = results.load("article-cpu")
    spec = spec_of(config)
    train_len, eval_tokens = spec.model.train_len, spec.evaluation.eval_tokens
    model = results.model("article-cpu", encoding)
    assert model.cfg.train_len == train_len and not model.training
    corpus = load_corpus("stdlib")
    if "evaluation_text" in config:  # the run's own evaluation text: every test file's first bytes, with a lead-in
        from posenc_lab.lab.data.corpora import evaluation_text

        text = evaluation_text(corpus, eval_tokens, lead_in=spec.evaluation.lead_in())
        assert text.describe() == config["evaluation_text"]  # the same bytes as the run scored
        stream, lead_in = text.stream, text.lead_in
    else:
        stream, context = corpus.stream("test"), 0
    got = evaluate(model, stream, length=train_len, tokens=eval_tokens, mode="nonoverlapping", lead_in=lead_in)
    want = next(r for r in rows if r["encoding"] == encoding and r["seed"] == 0 and r["eval_len"] == train_len
                and r["eval_mode"] == "nonoverlapping")
    assert got["loss"] == pytest.approx(want["loss"], rel=2e-3)  # float16 weights: close, not equal


def test_export_models_writes_float16_weights(tmp_path):
    from posenc_lab.model import GPT, GPTConfig

    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="alibi", n_layer=1, n_head=2, d_model=16, train_len=8))
    torch.save(model.state_dict(), run / "models" / "alibi-s0.pt")
    (written,) = results.export_models(run, "toy", ["alibi"], root=tmp_path / "results")
    state = torch.load(written, weights_only=True)
    assert all(v.dtype == torch.float16 for v in state.values() if v.is_floating_point())
    assert written.stat().st_size < (run / "models" / "alibi-s0.pt").stat().st_size


@pytest.mark.parametrize("run", ["article-long-b4", "article-long", "prose-long-b4"])
def test_run_readme_is_the_committed_results(run):
    """No hand-typed number: results/<run>/README.md (the tables, verdicts and caveats the README links to) is what
    ``python -m posenc_lab.lab.readme`` writes from the committed results, report.headline() included."""
    from posenc_lab.lab import readme

    assert run in readme.RUN_READMES
    held = (results.folder(run) / "README.md").read_text(encoding="utf-8")
    rows, _, _ = results.load(run)
    assert report.headline(rows) in held
    assert held == readme.run_readme(run), f"results/{run}/README.md differs: run python -m posenc_lab.lab.readme"


@pytest.mark.parametrize("name", [n for n in results.RUNS if not n.startswith("context-")])
def test_a_runs_model_shape_is_its_specs_model_part(name):
    """:func:`results.model_shape` reads the model part alone, as every kind of spec holds it."""
    config = results.load_config_only(name)[2]
    assert results.model_shape(config) == spec_of(config).model


def test_a_context_run_has_no_model_shape_or_spec_of_its_own():
    config = results.load_config_only("context-cpu")[2]
    with pytest.raises(PosencError, match="context run"):
        results.model_shape(config)
    with pytest.raises(PosencError, match="context run"):
        spec_of(config)


def test_the_lab_modules_examples_run():
    """The examples in the docstrings of the experiments' shared parts, of the run kinds and of the verdicts in words."""
    import doctest

    from posenc_lab.lab.experiments import families, recipe
    from posenc_lab.lab.verdicts import in_words

    for module in (recipe, families, in_words):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted >= 1 and result.failed == 0, module.__name__
