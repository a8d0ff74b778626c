"""The runner every experiment shares: units run one after another and written as they finish, and the
bookkeeping around them (where a run ran, on which code, and the tables rebuilt from its units).

:func:`run_units` writes each finished unit to ``units/`` at once, so that a run that is interrupted, or
cut short by a GPU time slice, continues from the units already finished when the same command is run
again; :func:`prepare` records the run's configuration once, in ``config.json``, and refuses a folder
that holds another experiment. The language-model experiment (:mod:`posenc_lab.lab.experiments.language_model`), passkey
retrieval (:mod:`posenc_lab.lab.experiments.retrieval`) and the context measurements (:mod:`posenc_lab.lab.experiments.context`) all run
through it.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.run.units")

import csv
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from posenc_lab import __version__
from posenc_lab.errors import PosencError
from posenc_lab.lab.data.corpora import Corpus
from posenc_lab.lab.run import distributed
from posenc_lab.lab.run.schema import SCHEMA_VERSION, migrate, migrate_config
from posenc_lab.lab.run.training import replace_atomically

def git_commit() -> str:
    """The package checkout's commit, ``-dirty`` when the package's own source has uncommitted changes
    (the results depend on it; edits elsewhere in the repository do not make a run dirty), or ``unknown``.
    ``POSENC_GIT_COMMIT`` names it where the source travelled without its repository (a copy on a lent GPU)."""
    if os.environ.get("POSENC_GIT_COMMIT"):
        return os.environ["POSENC_GIT_COMMIT"]
    here = Path(__file__).resolve().parents[2]  # the package, posenc_lab/
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    """A readable name of ``device`` for the results: the GPU's, or the CPU's with its thread count, and the number
    of processes."""
    processes = f" x {distributed.world_size()} processes" if distributed.active() else ""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device) + processes
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads){processes}"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so that a kill never leaves half a file."""
    replace_atomically(path, lambda tmp: tmp.write_text(text))


#: the columns of the results table, in the schema of :mod:`posenc_lab.lab.run.schema`
COLUMNS = ["encoding", "strategy", "seed", "train_len", "eval_len", "eval_mode", "stride", "status", "loss",
           "perplexity", "bits_per_byte", "tokens", "eval_seconds", "train_loss", "train_steps", "train_tokens",
           "train_seconds", "train_tokens_per_s", "finetune_steps", "finetune_tokens", "finetune_len", "preset", "corpus", "corpus_sha256",
           "python", "device", "torch", "posenc_lab", "git_commit", "schema"]


def default_device() -> torch.device:
    """CUDA when a GPU is available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | None) -> torch.device:
    """The device of a run: ``device`` as given (``cpu``, ``cuda``, ``cuda:N``) or :func:`default_device`; under
    ``torchrun``, this process's own GPU."""
    try:
        device = torch.device(device) if device else default_device()
    except RuntimeError:
        raise PosencError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PosencError("--device cuda was asked for, but this torch sees no CUDA GPU")
    if distributed.active() and device.type == "cuda":  # under torchrun: this process's own GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def run_context(spec, corpus: Corpus, device: torch.device) -> dict:
    """The columns every row of a run carries: what ran, on what, with which code, and the row's schema version
    (the spec itself is recorded once, in ``config.json``)."""
    return {"preset": spec.preset, "corpus": corpus.name, "corpus_sha256": corpus.meta["sha256"],
            "python": ".".join(map(str, sys.version_info[:3])), "device": device_name(device),
            "torch": torch.__version__, "posenc_lab": __version__, "git_commit": git_commit(),
            "schema": SCHEMA_VERSION}


def collect(out: Path, part: str = "rows") -> list[dict]:
    """Every row of every finished unit, in a stable order: the results (``rows``), the per-document
    losses (``documents``) or the checkpoint evaluations (``checkpoints``)."""
    units = sorted((out / "units").glob("*.json"))
    return [row for path in units for row in json.loads(path.read_text()).get(part, [])]


def collect_rows(out: Path) -> list[dict]:
    """The results table of a run folder from its units (:func:`collect`), in the current schema: the rows of a
    unit written by an older posenc_lab are read through :func:`~posenc_lab.lab.run.schema.migrate`."""
    return migrate(collect(out))


#: the columns of the per-document and checkpoint tables
DOCUMENT_COLUMNS = ["encoding", "strategy", "seed", "eval_len", "eval_mode", "document", "tokens", "loss"]
CHECKPOINT_COLUMNS = ["encoding", "strategy", "seed", "step", "tokens_seen", "eval_len", "eval_mode", "status", "loss",
                      "perplexity", "tokens"]


def _csv(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_table(out: Path, rows: list[dict]) -> None:
    """``results.csv``/``results.json`` from ``rows``, and ``documents.csv``/``checkpoints.csv`` from the units."""
    write_atomic(out / "results.csv", _csv(rows, COLUMNS))
    write_atomic(out / "results.json", json.dumps(rows, indent=1))
    for part, columns in (("documents", DOCUMENT_COLUMNS), ("checkpoints", CHECKPOINT_COLUMNS)):
        extra = collect(out, part)
        if extra:
            write_atomic(out / f"{part}.csv", _csv(extra, columns))


def prepare(out: Path, config: dict) -> None:
    """Record ``config`` in ``out/config.json``, with its schema version; refuse a folder that holds a different
    experiment. A ``config.json`` written by an older posenc_lab is compared in the current shape
    (:func:`~posenc_lab.lab.run.schema.migrate_config`), and rewritten in it."""
    config_path = out / "config.json"
    config = {"schema": SCHEMA_VERSION, **config}
    if config_path.exists():
        previous = migrate_config(json.loads(config_path.read_text()))
        if previous.get("extending"):
            raise PosencError(f"{out} is being extended (run --extend was interrupted): finish it with the same "
                              "options and --extend")
        if json.loads(json.dumps(config)) != {k: previous.get(k) for k in config}:
            raise PosencError(f"{out} holds a different experiment (its config.json differs): use a new --out, --extend "
                              "to add evaluations to a finished run, "
                              "or the same options to continue it")
    distributed.barrier()  # every process has read the old config before the main one rewrites it
    if distributed.is_main():
        write_atomic(config_path, json.dumps(config, indent=1))


def run_units(out: Path, units: list[tuple[str, int]], run_one, *, after_each=None, log=print) -> None:
    """The runner every experiment shares: ``run_one(encoding, seed)`` for each unit not finished in ``out``.

    A finished unit is written to ``out/units/<encoding>-s<seed>.json`` at once (atomically), so an
    interrupted run continues from the units already done; its checkpoints are then deleted (its
    final weights stay in ``out/models``). ``after_each(out)`` runs after every unit (the tables). A unit's
    ``seconds`` is its wall time, with the training time of any earlier, interrupted process added
    (``resumed_seconds`` of its record; the evaluation time lost with such a process is not counted).
    """
    log = log if distributed.is_main() else (lambda *a: None)
    for i, (encoding, seed) in enumerate(units, 1):
        path = out / "units" / f"{encoding}-s{seed}.json"
        if distributed.agree(path.exists(), f"whether {path} is finished"):
            log(f"[{i}/{len(units)}] {encoding} seed {seed}: done already ({path})")
            continue
        log(f"[{i}/{len(units)}] {encoding} seed {seed}")
        t0 = time.perf_counter()
        record = run_one(encoding, seed)
        # the unit's wall time: this process's, plus the training time a checkpoint carried from before a resume
        record["seconds"] = round(time.perf_counter() - t0 + record.pop("resumed_seconds", 0.0), 1)
        if distributed.is_main():  # one process writes; the others wait for the file before going on
            write_atomic(path, json.dumps(record))
            for ckpt in (out / "checkpoints").glob(f"{encoding}-s{seed}*.pt"):
                ckpt.unlink()  # the unit is done: its training state is no longer needed (weights are in models/)
            if after_each is not None:
                after_each(out)
        distributed.barrier()
