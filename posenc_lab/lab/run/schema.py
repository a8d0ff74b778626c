"""The schema of a run folder -- its results table (``results.csv`` / ``results.json``, and the rows of each unit
record) and its ``config.json`` -- and the one place that reads older run folders.

A row names its schema in the column ``schema``, a ``config.json`` under the key ``schema``; a row without one is of
version 1, a ``config.json`` without one of version 2 or older.

* version 1: every row repeated the run's whole spec as JSON in a ``config`` column -- the spec the folder's
  ``config.json`` records once.
* version 2: no ``config`` column (the spec is read from ``config.json``); ``schema`` names the version. The
  spec in ``config.json`` is flat: every setting a key of its own.
* version 3 (:data:`SCHEMA_VERSION`): the rows are those of version 2. The spec in ``config.json`` is composed of
  parts (:data:`PARTS`): ``{"model": {"n_layer": 4, ...}, "training": {"steps": 700, ...}, ...}``, and
  ``config.json`` names its version.

:func:`migrate` turns rows of any known version into rows of the current one, :func:`migrate_config` does the
same for a ``config.json``; every reader of a run folder goes through them, so that a run folder written by an
older posenc_lab reads (and resumes) as a new one. :func:`trained_as` is the same knowledge for the models of an
older run.
"""

from __future__ import annotations

import json
from pathlib import Path

from posenc_lab.errors import PosencError

#: the version of the run folder (results table and ``config.json``) this posenc_lab writes
SCHEMA_VERSION = 3
#: the columns a version-1 row carried that the current schema leaves out (the spec is in ``config.json``)
DROPPED = ("config",)
#: the key length in bytes of the content retrieval task, with which every retrieval row made before rows recorded
#: their ``distance`` was made: such a row's distance follows from its window's length and depth
CONTENT_KEY_LEN = 4


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

    A current row is returned as it is, a version-2 row with its ``schema`` set to the current version (its
    fields are the current ones). A version-1 row loses its ``config`` column and gains ``schema`` in its place;
    every other field (and the order of the fields) is kept. A row of a version newer than this posenc_lab knows
    is an error: it was written by a newer posenc_lab."""
    out = []
    for row in rows:
        v = version(row)
        if v == SCHEMA_VERSION:
            out.append(row)
        elif v == 2:  # the same row; only config.json changed shape
            out.append({**row, "schema": SCHEMA_VERSION})
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


#: the keys of a flat (version 2) spec that each part of a version-3 spec took, in the part's order. A retrieval
#: spec has a model and a training part only: its evaluation (the grid of lengths and depths) stays at its top level
PARTS = {"model": ("n_layer", "n_head", "d_model", "train_len", "backend", "tie_embeddings"),
         "training": ("steps", "batch_size", "lr", "warmup", "checkpoint_every"),
         "evaluation": ("eval_lengths", "eval_tokens", "modes", "stride", "sliding", "eval_batch_size", "curve_points",
                        "curve_factors", "curve_tokens"),
         "finetuning": ("finetune", "finetune_steps", "finetune_len", "finetune_seeds")}


def config_version(config: dict) -> int:
    """The schema version of a ``config.json``: its ``schema`` key, 2 when it has none (version 1 kept the same
    ``config.json`` as version 2)."""
    value = config.get("schema", 2)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PosencError(f"a config.json names schema {value!r}, not a version number")
    return value


def is_context_run(config: dict) -> bool:
    """Whether a ``config.json`` is a context run's: it records the language-model spec it measured under
    ``trained`` and has no model of its own.

    >>> is_context_run({"spec": {}, "trained": {}}), is_context_run({"spec": {}})
    (True, False)
    """
    return "trained" in config


def migrate_config(config: dict) -> dict:
    """A run's ``config.json`` of any known schema version in the current shape.

    A current config is returned as it is. An older one gains ``schema`` and has each flat spec composed of its
    parts (:data:`PARTS`), in place of the first key each part took: the ``spec`` of a language-model or
    retrieval run, the language-model spec a context run measured (``trained``) and the one an interrupted
    extension was heading for (``extending``). A context run's own ``spec`` has no parts and is kept. Every other
    key, and the values themselves, are kept."""
    v = config_version(config)
    if v == SCHEMA_VERSION:
        return config
    if v > SCHEMA_VERSION:
        raise PosencError(f"a config.json has schema version {v}, newer than this posenc_lab's {SCHEMA_VERSION}: "
                          "upgrade posenc_lab to read it")
    parts = ("model", "training") if "task" in config else tuple(PARTS)  # a retrieval run describes its task
    nested = ("trained", "extending") if is_context_run(config) else ("spec", "extending")
    return {"schema": SCHEMA_VERSION, **{key: _compose(value, parts) if key in nested and isinstance(value, dict)
                                          else value for key, value in config.items()}}


def read_config(path: Path | str) -> dict:
    """The ``config.json`` at ``path`` in the current shape (:func:`migrate_config`)."""
    return migrate_config(json.loads(Path(path).read_text()))


def _compose(flat: dict, parts: tuple[str, ...]) -> dict:
    """A flat spec with the keys of each of ``parts`` gathered under the part's name, where its first key was."""
    owner = {key: part for part in parts for key in PARTS[part]}
    out: dict = {}
    for key, value in flat.items():
        if key in owner:
            out.setdefault(owner[key], {})
        else:
            out[key] = value
    for part in {owner[k] for k in flat if k in owner}:
        out[part] = {k: flat[k] for k in PARTS[part] if k in flat}
    return out


def trained_as(encoding: str, config: dict) -> str:
    """The registered encoding that reproduces what a run trained under the name ``encoding``.

    A language-model run whose ``config.json`` records no evaluation text trained ``sinusoidal`` with the
    table at RMS 0.02 and unscaled tokens, which is ``sinusoidal-small``; loading its weights into
    ``sinusoidal`` would pair them with an amplitude they never saw. Retrieval runs (a ``task`` in their
    config) record no evaluation text, so nothing in their config tells the two apart: they keep their name
    (every committed retrieval run with weights trained today's ``sinusoidal``; an older retrieval folder needs
    ``sinusoidal-small`` by hand). The rows of such a run keep the name it was run under."""
    if "evaluation_text" not in config and "task" not in config:
        return _TRAINED_BEFORE_EVALUATION_TEXT.get(encoding, encoding)
    return encoding


#: the encodings whose recipe differs in a run whose config records no evaluation text: the name such a run trained
#: under -> the registered encoding that reproduces it
_TRAINED_BEFORE_EVALUATION_TEXT = {"sinusoidal": "sinusoidal-small"}


def migrate_unit(record: dict) -> dict:
    """A unit record (``units/<encoding>-s<seed>.json``) with its ``rows`` in the current schema."""
    if "rows" not in record:
        return record
    return {**record, "rows": migrate(record["rows"])}
