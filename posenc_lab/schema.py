"""The schema of a run's results table (``results.csv`` / ``results.json``, and the rows of each unit record), and
the one place that reads older run folders.

A row names its schema in the column ``schema``; a row without one is of version 1.

* version 1: every row repeated the run's whole spec as JSON in a ``config`` column -- the spec the folder's
  ``config.json`` records once.
* version 2 (:data:`SCHEMA_VERSION`): no ``config`` column (the spec is read from ``config.json``); ``schema``
  names the version.

:func:`migrate` turns rows of any known version into rows of the current one; every reader of a results table
goes through it, so that a run folder written by an older posenc_lab reads (and resumes) as a new one.
:func:`trained_as` is the same knowledge for the models of an older run.
"""

from __future__ import annotations

from .errors import PosencError

#: the version of the results table this posenc_lab writes
SCHEMA_VERSION = 2
#: the columns a version-1 row carried that the current schema leaves out (the spec is in ``config.json``)
DROPPED = ("config",)


def version(row: dict) -> int:
    """The schema version of ``row``: its ``schema`` column (a number, or its text from a CSV), 1 when it has none."""
    value = row.get("schema")
    if value in (None, ""):
        return 1
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PosencError(f"a results row names schema {value!r}, not a version number") from None


def migrate(rows: list[dict]) -> list[dict]:
    """``rows`` of any known schema version as rows of :data:`SCHEMA_VERSION`.

    A current row is returned as it is. A version-1 row loses its ``config`` column and gains ``schema`` in its
    place; every other field (and the order of the fields) is kept. A row of a version newer than this
    posenc_lab knows is an error: it was written by a newer posenc_lab."""
    out = []
    for row in rows:
        v = version(row)
        if v == SCHEMA_VERSION:
            out.append(row)
        elif v == 1:
            out.append(_from_v1(row))
        else:
            raise PosencError(f"a results row has schema version {v}, newer than this posenc_lab's "
                              f"{SCHEMA_VERSION}: upgrade posenc_lab to read it")
    return out


def _from_v1(row: dict) -> dict:
    migrated = {}
    for key, value in row.items():
        if key == "config":
            migrated["schema"] = SCHEMA_VERSION  # where the spec was, the version that moved it to config.json
        elif key not in DROPPED:
            migrated[key] = value
    migrated.setdefault("schema", SCHEMA_VERSION)
    return migrated


def trained_as(encoding: str, config: dict) -> str:
    """The registered encoding that reproduces what a run trained under the name ``encoding``.

    A language-model run whose ``config.json`` records no evaluation text trained ``sinusoidal`` with the
    table at RMS 0.02 and unscaled tokens, which is ``sinusoidal-small``; loading its weights into
    ``sinusoidal`` would pair them with an amplitude they never saw. Retrieval runs (a ``task`` in their
    config) record no evaluation text, so nothing in their config tells the two apart: they keep their name
    (every committed retrieval run with weights trained today's ``sinusoidal``; an older retrieval folder needs
    ``sinusoidal-small`` by hand). The rows of such a run keep the name it was run under."""
    if encoding == "sinusoidal" and "evaluation_text" not in config and "task" not in config:
        return "sinusoidal-small"
    return encoding


def migrate_unit(record: dict) -> dict:
    """A unit record (``units/<encoding>-s<seed>.json``) with its ``rows`` in the current schema."""
    if "rows" not in record:
        return record
    return {**record, "rows": migrate(record["rows"])}
