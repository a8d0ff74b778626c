"""The results table's schema: a table written by an older posenc_lab reads as a current one, through one migration."""

import csv
import json
from pathlib import Path

import pytest

from posenc_lab import PosencError, experiment, report, results
from posenc_lab.schema import SCHEMA_VERSION, migrate, migrate_unit, version

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
    assert json.loads(old[0]["config"]) == results.load_config_only("article-cpu")[2]["spec"]
    header = experiment._csv(new, experiment.COLUMNS).splitlines()[0].split(",")
    assert header == experiment.COLUMNS and header[-1] == "schema"


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
    experiment.write_table(tmp_path, experiment.collect_rows(tmp_path))
    written = json.loads((tmp_path / "results.json").read_text())
    assert written == migrate(rows) and all(r["schema"] == SCHEMA_VERSION for r in written)
    assert (tmp_path / "results.csv").read_text().splitlines()[0].split(",") == experiment.COLUMNS
    (tmp_path / "results.json").write_text(json.dumps(rows))  # a table of the older schema, read directly
    loaded, units, _ = report.load(tmp_path)
    assert loaded == written and units[0]["rows"] == written
    assert migrate_unit({"encoding": "alibi", "seed": 0}) == {"encoding": "alibi", "seed": 0}


@pytest.mark.parametrize("name", [n for n in results.RUNS if (results.folder(n) / "results.json").is_file()])
def test_every_committed_table_is_in_the_current_schema(name):
    """The committed files themselves, not only what the readers make of them."""
    node = results.folder(name)
    raw = json.loads((node / "results.json").read_text())
    assert {version(r) for r in raw} == {SCHEMA_VERSION} and not any("config" in r for r in raw)
    for table in ("results.csv", "replicate.csv"):
        if (node / table).is_file():
            with (node / table).open(newline="") as f:
                header = next(csv.reader(f))
            assert "config" not in header and header[-1] == "schema"
    for path in (node / "units").glob("*.json"):
        assert {version(r) for r in json.loads(path.read_text())["rows"]} == {SCHEMA_VERSION}
