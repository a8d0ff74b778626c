"""A run folder's schema: a results table or a config.json written by an older posenc_lab reads as a current one,
through the schema's migrations."""

import csv
import json
from pathlib import Path

import pytest

from posenc_lab import PosencError
from posenc_lab.lab import results
from posenc_lab.lab.experiments import language_model as experiment, retrieval
from posenc_lab.lab.experiments.families import spec_of
from posenc_lab.lab.run import units
from posenc_lab.lab.run.schema import (PARTS, SCHEMA_VERSION, config_version, migrate, migrate_config, migrate_unit,
                                       read_config, version)
from posenc_lab.lab.verdicts import tables as report

DATA = Path(__file__).parent / "data"


def old_rows() -> list[dict]:
    """Two rows of article-cpu's results.csv as committed before the schema had a version (each with the spec)."""
    with (DATA / "results-v1.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_version_1_row_migrates_to_the_current_schema():
    old = old_rows()
    new = migrate(old)
    assert [version(r) for r in old] == [1, 1] and [version(r) for r in new] == [SCHEMA_VERSION] * 2
    for before, after in zip(old, new):
        assert "config" not in after and after["schema"] == SCHEMA_VERSION
        assert {k: v for k, v in after.items() if k != "schema"} == {k: v for k, v in before.items() if k != "config"}
        assert list(after) == [("schema" if k == "config" else k) for k in before]  # the fields keep their order
    # what the migration drops is what the run's config.json records once
    assert migrate_config({"spec": json.loads(old[0]["config"])})["spec"] == results.load_config_only("article-cpu")[2]["spec"]
    header = units._csv(new, units.COLUMNS).splitlines()[0].split(",")
    assert header == units.COLUMNS and header[-1] == "schema"


def test_a_version_1_retrieval_row_migrates_too():
    old = json.loads((DATA / "retrieval-results-v1.json").read_text())
    (new,) = migrate(old)
    assert "config" not in new and new["schema"] == SCHEMA_VERSION and new["accuracy"] == old[0]["accuracy"]


def test_a_current_row_is_unchanged():
    current = migrate(old_rows())
    again = migrate(current)
    assert again == current and all(a is b for a, b in zip(again, current))
    from_csv = [{k: str(v) for k, v in r.items()} for r in current]  # "2" as read back from results.csv
    assert migrate(from_csv) == from_csv


def test_a_future_schema_is_a_clear_one_line_error():
    row = {**migrate(old_rows())[0], "schema": SCHEMA_VERSION + 1}
    with pytest.raises(PosencError, match=f"schema version {SCHEMA_VERSION + 1}, newer than") as err:
        migrate([row])
    assert "\n" not in str(err.value) and "upgrade posenc_lab" in str(err.value)
    with pytest.raises(PosencError, match="not a version number"):
        migrate([{**row, "schema": "two"}])


def test_an_old_run_folder_reads_and_resumes_in_the_current_schema(tmp_path):
    """A run folder whose units were written with the spec in every row: its table is rebuilt in the current
    schema (as the runner does after each unit), and the report's loader reads it in the current schema."""
    rows = json.loads(json.dumps(old_rows()))
    (tmp_path / "units").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"spec": json.loads(rows[0]["config"])}))
    (tmp_path / "units" / "alibi-s0.json").write_text(json.dumps({"encoding": "alibi", "seed": 0, "rows": rows}))
    units.write_table(tmp_path, units.collect_rows(tmp_path))
    written = json.loads((tmp_path / "results.json").read_text())
    assert written == migrate(rows) and all(r["schema"] == SCHEMA_VERSION for r in written)
    assert (tmp_path / "results.csv").read_text().splitlines()[0].split(",") == units.COLUMNS
    (tmp_path / "results.json").write_text(json.dumps(rows))  # a table of the older schema, read directly
    loaded, records, _ = report.load(tmp_path)
    assert loaded == written and records[0]["rows"] == written
    assert migrate_unit({"encoding": "alibi", "seed": 0}) == {"encoding": "alibi", "seed": 0}


# version 3 changed config.json only: a version-2 row has the fields of a current one
CURRENT_ROWS = {2, SCHEMA_VERSION}


@pytest.mark.parametrize("name", [n for n in results.RUNS if (results.folder(n) / "results.json").is_file()])
def test_every_committed_table_is_in_the_current_schema(name):
    """The committed files themselves, not only what the readers make of them."""
    node = results.folder(name)
    raw = json.loads((node / "results.json").read_text())
    assert {version(r) for r in raw} <= CURRENT_ROWS and not any("config" in r for r in raw)
    for table in ("results.csv", "replicate.csv"):
        if (node / table).is_file():
            with (node / table).open(newline="") as f:
                header = next(csv.reader(f))
            assert "config" not in header and header[-1] == "schema"
    for path in (node / "units").glob("*.json"):
        assert {version(r) for r in json.loads(path.read_text())["rows"]} <= CURRENT_ROWS


@pytest.mark.parametrize("name", list(results.RUNS))
def test_every_committed_config_is_in_the_current_schema(name):
    """Every committed config.json names the current version and its spec is composed of parts."""
    raw = json.loads((results.folder(name) / "config.json").read_text())
    assert raw["schema"] == SCHEMA_VERSION and migrate_config(raw) is raw
    lm = raw.get("trained", raw["spec"])  # a context run's own spec has no parts; the models it measured do
    assert {"model", "training"} <= set(lm) and not set(lm) & {"n_layer", "steps", "train_len", "eval_lengths"}


def flat(spec: dict) -> dict:
    """A spec of parts as version 2 recorded it: every setting a key of its own."""
    return {k: v for key, value in spec.items() for k, v in (value.items() if key in PARTS else [(key, value)])}


def test_an_old_flat_config_migrates_to_a_spec_of_parts_and_round_trips():
    old = {"spec": json.loads(old_rows()[0]["config"]), "corpus": {"corpus": "stdlib"}}  # article-cpu, flat
    new = migrate_config(old)
    assert config_version(old) == 2 and new["schema"] == SCHEMA_VERSION and new["corpus"] == old["corpus"]
    spec = new["spec"]
    assert spec["model"] == {"n_layer": 4, "n_head": 4, "d_model": 128, "train_len": 512, "backend": "auto"}
    assert spec["training"] == {"steps": 700, "batch_size": 8, "lr": 0.002, "warmup": 70, "checkpoint_every": 100}
    assert spec["evaluation"]["eval_lengths"] == [512, 1024, 2048, 8192] and spec["finetuning"]["finetune_len"] == 2048
    assert flat(spec) == old["spec"]  # nothing lost, nothing added
    assert migrate_config(new) is new  # a current config is returned as it is
    read = spec_of(old)  # from the old shape or the new, the same spec
    assert read == spec_of(new) == experiment.PRESETS["article-cpu"]
    assert json.loads(json.dumps(read.to_dict())) == spec and experiment.Spec.from_dict(spec) == read


def test_an_old_retrieval_and_context_config_migrate_too(tmp_path):
    old = {"spec": json.loads(json.loads((DATA / "retrieval-results-v1.json").read_text())[0]["config"]),
           "task": {"task": "content"}}
    new = migrate_config(old)
    assert set(new["spec"]["model"]) == {"n_layer", "n_head", "d_model", "train_len", "backend"}
    assert "evaluation" not in new["spec"] and new["spec"]["eval_batch_size"] == 32  # its grid stays its own
    assert spec_of(old) == spec_of(new) == retrieval.RETRIEVAL_PRESETS["retrieval-cpu"]
    context = results.load_config_only("context-cpu")[2]
    older = {k: v for k, v in {**context, "trained": flat(context["trained"])}.items() if k != "schema"}
    (tmp_path / "config.json").write_text(json.dumps(older))
    assert read_config(tmp_path / "config.json") == context  # the models' spec composed, the context's own kept


def test_a_newer_config_is_a_clear_one_line_error():
    with pytest.raises(PosencError, match=f"schema version {SCHEMA_VERSION + 1}, newer than") as err:
        migrate_config({"schema": SCHEMA_VERSION + 1, "spec": {}})
    assert "\n" not in str(err.value)
    with pytest.raises(PosencError, match="not a version number"):
        migrate_config({"schema": "three"})


@pytest.mark.slow
def test_a_run_whose_config_is_in_the_old_shape_resumes(tmp_path):
    """A run folder written before the spec had parts: the same spec continues it (the unit left to do is
    trained, the finished one is kept) and config.json is rewritten in the current shape; another spec is
    still refused."""
    spec = experiment.preset("ci", encodings=("nope", "alibi"), steps=2, eval_lengths=(64,), modes=("nonoverlapping",))
    quiet = dict(progress=False, log=lambda *a: None)
    rows = experiment.run(spec, tmp_path, **quiet)
    config = json.loads((tmp_path / "config.json").read_text())
    old = {k: v for k, v in {**config, "spec": flat(config["spec"])}.items() if k != "schema"}
    (tmp_path / "config.json").write_text(json.dumps(old, indent=1))
    kept = (tmp_path / "units" / "nope-s0.json").read_text()
    (tmp_path / "units" / "alibi-s0.json").unlink()
    with pytest.raises(PosencError, match="different experiment"):
        experiment.run(experiment.preset("ci", **{**dict(encodings=("nope", "alibi"), eval_lengths=(64,)),
                                                  "steps": 3, "modes": ("nonoverlapping",)}), tmp_path, **quiet)
    again = experiment.run(spec, tmp_path, **quiet)
    assert (tmp_path / "units" / "nope-s0.json").read_text() == kept
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]  # the unit trained again ends where it did
    assert json.loads((tmp_path / "config.json").read_text()) == config
