"""Rewrite the results tables of run folders in the current schema (:mod:`posenc_lab.lab.run.schema`).

For every run folder (a folder with ``config.json``) under the given root (``results/`` by default): its
``results.json`` and ``results.csv``, the rows of each ``units/*.json`` record, and any older table of the same
run kept beside them (``replicate.csv``) go through :func:`posenc_lab.lab.run.schema.migrate`. Before a row's ``config``
column is dropped it is checked against the spec ``config.json`` records, so nothing is lost; after the rewrite
every table is checked to hold the same values as before, but for ``config`` and ``schema``. A context run's
tables (and its units) carry no spec and are another table: they are left as they are. Running it again changes nothing.

    python scripts/migrate_results.py            # results/ of this checkout
    python scripts/migrate_results.py runs/      # run folders of your own
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from posenc_lab.errors import PosencError
from posenc_lab.lab.experiments import retrieval
from posenc_lab.lab.run import units
from posenc_lab.lab.run.schema import DROPPED, migrate, migrate_config, migrate_unit
from posenc_lab.lab.run.units import _csv, write_atomic

#: tables of older trainings of a run, kept beside its own (CSV only)
OLDER_TABLES = ("replicate.csv",)


def _check_spec(rows: list[dict], config: dict, where: Path) -> None:
    """Every row's ``config`` (a version-1 row's copy of the spec, flat) is the spec of ``config.json``, both read
    in the current shape."""
    recorded = migrate_config(config)["spec"]
    rest = {k: v for k, v in config.items() if k not in ("schema", "spec")}  # what says which kind of run it is
    for row in rows:
        if "config" in row and migrate_config({**rest, "spec": json.loads(row["config"])})["spec"] != recorded:
            raise PosencError(f"{where}: a row records a spec that config.json does not; migrating would lose it")


def _same_values(before: list[dict], after: list[dict], where: Path) -> None:
    """``after`` holds ``before``'s values, but for the dropped columns, ``schema`` and columns empty in both."""
    if len(before) != len(after):
        raise PosencError(f"{where}: {len(before)} rows became {len(after)}")
    for old, new in zip(before, after):
        kept = {k: v for k, v in old.items() if k not in (*DROPPED, "schema")}
        now = {k: v for k, v in new.items() if k != "schema" and not (v == "" and k not in old)}
        if kept != now:
            raise PosencError(f"{where}: a row changed in migration: {sorted(set(kept.items()) ^ set(now.items()))}")


def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def migrate_run(folder: Path, log=print) -> list[Path]:
    """Rewrite ``folder``'s tables in the current schema; returns the files that changed."""
    config = json.loads((folder / "config.json").read_text())
    columns = retrieval.COLUMNS if "task" in config else units.COLUMNS
    changed = []

    def write(path: Path, text: str) -> None:
        if path.read_text() != text:
            write_atomic(path, text)
            changed.append(path)

    if (folder / "results.json").is_file():
        rows = json.loads((folder / "results.json").read_text())
        _check_spec(rows, config, folder / "results.json")
        current = migrate(rows)
        _same_values(rows, current, folder / "results.json")
        write(folder / "results.json", json.dumps(current, indent=1))
        before_csv = _read_csv(folder / "results.csv")
        _check_spec(before_csv, config, folder / "results.csv")
        write(folder / "results.csv", _csv(current, columns))
        _same_values(before_csv, _read_csv(folder / "results.csv"), folder / "results.csv")
    for name in OLDER_TABLES:
        path = folder / name
        if path.is_file():
            rows = _read_csv(path)
            _check_spec(rows, config, path)
            write(path, _csv(migrate(rows), columns))
            _same_values(rows, _read_csv(path), path)
    for path in sorted((folder / "units").glob("*.json")) if (folder / "results.json").is_file() else ():
        record = json.loads(path.read_text())
        if "rows" in record:
            _check_spec(record["rows"], config, path)
            current = migrate_unit(record)
            _same_values(record["rows"], current["rows"], path)
            write(path, json.dumps(current))
    log(f"{folder}: {len(changed)} files rewritten")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / "results",
                        help="a folder of run folders (default: results/ of this checkout)")
    args = parser.parse_args(argv)
    for folder in sorted(p.parent for p in args.root.glob("*/config.json")):
        migrate_run(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
