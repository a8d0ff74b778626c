"""Passkey retrieval past the training length: does the model *use* context it was not trained on?

Each of the three tasks of :mod:`posenc_lab.lab.data.tasks` (``content``, the control; ``digits``; ``multikey``) gets small
models trained on it alone at the training length (``task``). The ``multikey`` models train differently from the
other tasks' (the book's appendix says how the pilots chose it): each training window ends with 1 to 4 questions
in turn by step (``train_questions``; the one-question windows place needles everywhere the grid does), each
naming a key drawn at random, and the input embedding is untied from the output head (``tie_embeddings=False``):
tied, the names, never a target, drifted to one shared direction and were never told apart.

Exact match (every answer byte) is read with teacher forcing: the argmax at each answer position
given the true earlier answer bytes. That is exactly greedy decoding's result: greedy decoding
feeds back its own bytes, which are the true ones up to the first mistake, and one mistake fails
the match either way.

``python -m posenc_lab retrieval --preset retrieval-cpu`` trains one model per encoding at length
``L`` (loss on the answer bytes only), then measures accuracy on a grid of lengths ``L .. 8L`` x
needle depths, ``trials`` windows per cell, each cell with its Wilson 95 % interval. RoPE's
strategies are evaluated on the one trained RoPE model. The runner is the experiment's
(:func:`~posenc_lab.lab.run.units.run_units`): resumable per unit, one tidy table.

This module re-exports the tasks' names (``make_windows``, ``KEY_LEN``, ...) and the accuracy tables'
(``wilson``, ``by_length``, ``markdown_table``, ...), so that ``retrieval.<name>`` reaches them all.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.experiments.retrieval")

import csv
import io
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from posenc_lab.encodings import ENCODINGS, PRIMARY, strategies_of
from posenc_lab.errors import PosencError, PositionOutOfRange, check_positive, unknown_name
from posenc_lab.model import GPT, IGNORE
from posenc_lab.rope import ARTICLE_STRATEGIES
from posenc_lab.lab.data.tasks import KEY_LEN, MULTIKEYS, TASKS, describe_task, make_windows
from posenc_lab.lab.experiments.recipe import Composed, ModelSpec, TrainingSpec, check_registered
from posenc_lab.lab.measure.accuracy import markdown_table, wilson
from posenc_lab.lab.run import distributed
from posenc_lab.lab.run.schema import SCHEMA_VERSION
from posenc_lab.lab.run.training import autocast, flush_denormals, save_atomic, train
from posenc_lab.lab.run.units import (collect_rows, device_name, git_commit, prepare, resolve_device, run_units,
                                      write_atomic)


@torch.no_grad()
def answer_hits(model, inputs: torch.Tensor, targets: torch.Tensor, *, batch_size: int = 32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Per window and answer position (the targets that are not ``IGNORE``, the last ones of the window), whether
    the argmax there is the passkey byte (bool ``n x answer``): which byte of the answer a model gets wrong."""
    device = torch.device(device)
    answer = int((targets[0] != IGNORE).sum()) if len(targets) else KEY_LEN
    model.eval().to(device)
    out = []
    masks: dict = {}  # the windows share one length: the masks of a bias, built once
    with flush_denormals():
        for i in range(0, len(inputs), batch_size):
            x, y = inputs[i : i + batch_size].to(device), targets[i : i + batch_size].to(device)
            with autocast(device):
                logits = model(x, masks=masks)[:, -answer:]  # the last positions predict the passkey
            out.append((logits.argmax(-1) == y[:, -answer:]).cpu())
    return torch.cat(out)


def exact_match(model, inputs: torch.Tensor, targets: torch.Tensor, *, batch_size: int = 32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Per window, whether the argmax at every answer position is the passkey byte (bool ``n``; see
    :func:`answer_hits`)."""
    return answer_hits(model, inputs, targets, batch_size=batch_size, device=device).all(-1)


#: the model and the training of a retrieval run unless a preset says otherwise: two layers, batches of 32
MODEL = ModelSpec(n_layer=2)
TRAINING = TrainingSpec(steps=1500, batch_size=32, checkpoint_every=250)


@dataclass
class RetrievalSpec(Composed):
    """Everything that defines a retrieval experiment; a preset is a named RetrievalSpec. The model's shape and
    the training recipe are the language-model experiment's parts (``MODEL`` and ``TRAINING`` by
    default); the grid of lengths and depths, and the task, are the retrieval's own."""

    preset: str = "custom"
    task: str = "content"
    encodings: tuple[str, ...] = PRIMARY
    strategies: tuple[str, ...] = ARTICLE_STRATEGIES
    seeds: tuple[int, ...] = (0,)
    model: ModelSpec = field(default_factory=lambda: MODEL)
    training: TrainingSpec = field(default_factory=lambda: TRAINING)
    multiples: tuple[int, ...] = (1, 2, 4, 8)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 64
    #: multikey only: the number of named keys in the training windows, cycled by step (e.g. (1, 2, 3, 4): the lone
    #: key teaches the copying, the others the choice); empty: MULTIKEYS in every window. The probe of training
    #: accuracy and the grid always ask among MULTIKEYS keys.
    train_keys: tuple[int, ...] = ()
    #: multikey only: the number of questions at the end of the training windows, cycled by step (e.g. (1, 2, 3, 4)),
    #: each naming a key drawn at random (a denser signal for the choice of key); empty: one. The probe and the grid
    #: ask one, so the cycle should hold 1: its windows are the only ones whose needles reach the grid's last bytes
    train_questions: tuple[int, ...] = ()
    monitor_every: int = 100  # training accuracy at the training length, every this many steps
    monitor_trials: int = 128
    eval_batch_size: int = 32
    #: options of some encodings, by name, passed to :func:`~posenc_lab.make_encoding` (e.g. a layer mix's
    #: pattern, ``{"gemma3": {"sliding_window_pattern": 2}}``, so that a 2-layer model has a global layer)
    encoding_options: dict = field(default_factory=dict)
    notes: str = ""

    def __post_init__(self):
        if self.task not in TASKS:
            raise unknown_name("retrieval task", self.task, TASKS)
        for name in ("trials", "monitor_every", "monitor_trials", "eval_batch_size"):
            check_positive(name, getattr(self, name))
        check_registered(self.encodings, self.strategies)
        if not self.multiples or min(self.multiples) < 1 or any(not isinstance(m, int) for m in self.multiples):
            raise PosencError(f"multiples of the training length must be integers >= 1, got {self.multiples}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise PosencError(f"needle depths must lie in [0, 1], got {self.depths}")
        if self.train_keys and (self.task != "multikey" or not all(1 <= k <= MULTIKEYS for k in self.train_keys)):
            raise PosencError(f"train_keys is for the multikey task, each 1 to {MULTIKEYS}; got {self.train_keys} "
                              f"for the {self.task} task")
        if self.train_questions and (self.task != "multikey" or not all(q >= 1 for q in self.train_questions)):
            raise PosencError(f"train_questions is for the multikey task, each at least 1; got "
                              f"{self.train_questions} for the {self.task} task")
        if self.model.train_len < 4 * KEY_LEN:
            raise PosencError(f"train_len must be at least {4 * KEY_LEN} bytes for a retrieval window")
        for name in self.encoding_options:
            if name not in self.encodings:
                raise PosencError(f"encoding_options name {name!r}, which the spec does not train "
                                  f"({', '.join(self.encodings)})")

    def model_config(self, encoding: str):
        """The :class:`~posenc_lab.model.GPTConfig` of ``encoding`` in this spec's model, with its
        ``encoding_options``."""
        cfg = self.model.config(encoding)
        cfg.encoding_options = dict(self.encoding_options.get(encoding, {}))
        return cfg

    def to_dict(self) -> dict:
        """The spec as a plain dict (as stored in ``config.json``), each part a dict of its own. The task is left out
        when it is ``content``, the only task before there were three, so that the runs made then keep their
        configuration (and the model's ``tie_embeddings`` when tied, :meth:`~posenc_lab.lab.experiments.recipe.ModelSpec.to_dict`)."""
        d = super().to_dict()
        if d["task"] == "content":
            del d["task"]
        if not d["train_keys"]:  # nor the training keys unless set (the runs made before they existed)
            del d["train_keys"]
        if not d["train_questions"]:
            del d["train_questions"]
        if not d["encoding_options"]:  # nor options unless set
            del d["encoding_options"]
        return d


#: the starting configurations of a retrieval run, by name
RETRIEVAL_PRESETS: dict[str, RetrievalSpec] = {
    "retrieval-ci": RetrievalSpec(preset="retrieval-ci", model=ModelSpec(n_layer=1, d_model=32, train_len=32),
                                  training=TrainingSpec(steps=6, batch_size=4, warmup=2, checkpoint_every=3),
                                  multiples=(1, 2), depths=(0.0, 1.0), trials=4,
                                  monitor_every=3, monitor_trials=4, notes="end to end in seconds; numbers mean nothing"),
    "retrieval-cpu": RetrievalSpec(preset="retrieval-cpu", training=replace(TRAINING, steps=1000), trials=100,
                                   notes="passkey retrieval trained at 128 bytes, judged at 1x to 8x, every encoding, "
                                         "on 2 CPU cores in under an hour"),
    "retrieval-digits-cpu": RetrievalSpec(preset="retrieval-digits-cpu", task="digits",
                                          encodings=("nope", "sinusoidal", "rope", "alibi", "t5"), seeds=(0, 1, 2),
                                          training=replace(TRAINING, steps=4000), trials=100,
                                          notes="five digits copied in order (one shared alphabet), trained at 128 "
                                                "bytes for 4,000 steps (1,000 do not teach it), judged at 1x to 8x, "
                                                "the article's encodings, three seeds; about 75 minutes"),
    "retrieval-digits-recent": RetrievalSpec(preset="retrieval-digits-recent", task="digits",
                                             encodings=("fox", "cope", "ssmax-rope", "gemma3"), seeds=(0, 1, 2),
                                             training=replace(TRAINING, steps=4000), trials=100,
                                             encoding_options={"gemma3": {"sliding_window_pattern": 2}},
                                             notes="retrieval-digits-cpu's task, recipe and judgement for FoX, CoPE, "
                                                   "SSMax on RoPE and Gemma 3's local/global layers, three seeds; "
                                                   "the recipe's 2 layers hold one mix only, a local layer (window "
                                                   "L/4) and then a global one"),
    "retrieval-digits-past-softmax": RetrievalSpec(preset="retrieval-digits-past-softmax", task="digits",
                                                   encodings=("stick-breaking", "path", "dape-kerple"), seeds=(0, 1, 2),
                                                   training=replace(TRAINING, steps=4000), trials=100,
                                                   notes="retrieval-digits-cpu's task, recipe and judgement for "
                                                         "stick-breaking, PaTH and DAPE on KERPLE, three seeds"),
    "retrieval-multikey-cpu": RetrievalSpec(preset="retrieval-multikey-cpu", task="multikey",
                                            encodings=("rope", "alibi", "nope", "sinusoidal", "t5"), seeds=(0, 1, 2),
                                            model=replace(MODEL, tie_embeddings=False),
                                            training=replace(TRAINING, steps=8000), trials=100,
                                            train_questions=(1, 2, 3, 4),
                                            notes="the named key among three distractors of the same kind, trained at "
                                                  "128 bytes for 8,000 steps with 1-4 questions per window and "
                                                  "untied embeddings (with tied ones the names are not told "
                                                  "apart), judged at 1x to 8x, the article's encodings, three seeds; "
                                                  "about 5.5 hours"),
}


def retrieval_preset(name: str, **overrides) -> RetrievalSpec:
    """The spec of retrieval preset ``name`` (a key of :data:`RETRIEVAL_PRESETS`), with the ``overrides`` that are
    not ``None``, each by its flat name (``steps``, ``train_len``, ...)."""
    if name not in RETRIEVAL_PRESETS:
        raise unknown_name("retrieval preset", name, RETRIEVAL_PRESETS)
    return RETRIEVAL_PRESETS[name].override(**overrides)


COLUMNS = ["task", "encoding", "strategy", "seed", "train_len", "eval_len", "multiple", "depth", "distance", "status", "trials",
           "correct", "accuracy", "ci_low", "ci_high", "train_accuracy", "train_steps", "train_seconds", "preset",
           "device", "torch", "posenc_lab", "git_commit", "schema"]


def _grid(model, spec: RetrievalSpec, seed: int, device, progress: bool, label: str) -> list[dict]:
    rows = []
    cells = [(m, d) for m in spec.multiples for d in spec.depths]
    for multiple, depth in tqdm(cells, desc=f"retrieval {label}", disable=not progress, leave=False):
        length = multiple * spec.model.train_len
        g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 7919 * length + round(1000 * depth))
        inputs, targets, _, start = make_windows(spec.trials, length, depth, g, spec.task)
        distance = length - int((targets[0] != IGNORE).sum()) - int(start[0])  # the first answer's query to the needle
        try:
            hits = exact_match(model, inputs, targets, batch_size=max(1, spec.eval_batch_size // multiple), device=device)
        except PositionOutOfRange:
            rows.append({"eval_len": length, "multiple": multiple, "depth": depth, "distance": distance,
                         "status": "cannot extrapolate",
                         "trials": 0, "correct": 0, "accuracy": math.nan, "ci_low": math.nan, "ci_high": math.nan})
            continue
        correct = int(hits.sum())
        low, high = wilson(correct, spec.trials)
        rows.append({"eval_len": length, "multiple": multiple, "depth": depth, "distance": distance, "status": "ok",
                     "trials": spec.trials,
                     "correct": correct, "accuracy": correct / spec.trials, "ci_low": low, "ci_high": high})
    return rows


def run_retrieval_unit(spec: RetrievalSpec, encoding: str, seed: int, out: Path, device, progress: bool,
                       common: dict) -> dict:
    """Train one encoding on the passkey task at ``train_len`` and measure the grid (every RoPE strategy)."""
    torch.manual_seed(seed)
    model = GPT(spec.model_config(encoding))
    train_len, steps, batch_size = spec.model.train_len, spec.training.steps, spec.training.batch_size
    monitor_g = torch.Generator().manual_seed(4242 + seed)
    probe = make_windows(spec.monitor_trials, train_len, None, monitor_g, spec.task)
    curve = []

    def batches(step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        keys = spec.train_keys[step % len(spec.train_keys)] if spec.train_keys else MULTIKEYS
        questions = spec.train_questions[step % len(spec.train_questions)] if spec.train_questions else 1
        x, y, _, _ = make_windows(batch_size, train_len, None, g, spec.task, keys, questions)
        return x, y

    def monitor(step):
        if step % spec.monitor_every == 0 or step == steps:
            accuracy = exact_match(model, probe[0], probe[1], batch_size=spec.eval_batch_size, device=device)
            curve.append({"step": step, "accuracy": float(accuracy.float().mean())})
            model.train()

    trained = train(model, None, spec.training.config(seed), batches=batches, on_step=monitor,
                    checkpoint=out / "checkpoints" / f"{encoding}-s{seed}.pt", device=device, progress=progress,
                    desc=f"train {encoding}/s{seed}", extra_state=curve)
    base = {"task": spec.task, "encoding": encoding, "seed": seed, "train_len": train_len,
            "train_accuracy": curve[-1]["accuracy"] if curve else math.nan, "train_steps": trained["train_steps"],
            "train_seconds": round(trained["train_seconds"], 2), **common}
    rows = []
    for strategy in strategies_of(encoding, spec.strategies):
        if strategy != "-":
            model.encoding.set_scaling(strategy)
        rows += [{**base, "strategy": strategy, **r} for r in _grid(model, spec, seed, device, progress,
                                                                     f"{encoding}/{strategy}")]
    if ENCODINGS[encoding].has_strategies:
        model.encoding.set_scaling("none")
    if distributed.is_main():
        save_atomic({k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()},
                    out / "models" / f"{encoding}-s{seed}.pt")
    return {"encoding": encoding, "seed": seed, "rows": rows, "train_losses": [round(x, 4) for x in trained["losses"]],
            "train_accuracy": curve, "resumed_seconds": trained["resumed_seconds"]}


def write_table(out: Path, rows: list[dict]) -> None:
    """Write the tidy table ``rows`` to ``out/results.csv`` and ``out/results.json``, atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(out / "results.csv", buf.getvalue())
    write_atomic(out / "results.json", json.dumps(rows, indent=1))


def run(spec: RetrievalSpec, out: Path | str, *, device: str | None = None, progress: bool = True,
        log=print) -> list[dict]:
    """Run every unit of ``spec`` not yet finished in ``out``; returns the rows of the whole table."""
    out = Path(out)
    device = resolve_device(device)
    prepare(out, {"spec": spec.to_dict(), "task": describe_task(spec.task)})
    import sys

    from posenc_lab import __version__

    common = {"preset": spec.preset, "device": device_name(device), "torch": torch.__version__,
              "posenc_lab": __version__, "git_commit": git_commit(), "schema": SCHEMA_VERSION,
              "python": ".".join(map(str, sys.version_info[:3]))}
    units = [(e, s) for s in spec.seeds for e in spec.encodings]  # seed by seed: a part-run has every encoding
    run_units(out, units, lambda e, s: run_retrieval_unit(spec, e, s, out, device, progress, common),
              after_each=lambda o: write_table(o, collect_rows(o)), log=log)
    rows = collect_rows(out)
    if distributed.is_main():
        write_table(out, rows)
    return rows



def report(out: Path | str) -> str:
    """The text report of a retrieval run folder: where it ran, each unit's training accuracy, and the accuracy
    table."""
    from posenc_lab.lab.verdicts.tables import load

    rows, units, config = load(out)
    if not rows:
        raise PosencError(f"{out} has no finished unit yet")
    first = rows[0]
    trained = ", ".join(f"{u['encoding']} {u['train_accuracy'][-1]['accuracy']:.3f}" for u in units if u["train_accuracy"])
    return "\n".join([f"# {Path(out).name}: preset {first['preset']}, trained at {first['train_len']} bytes, "
                      f"device {first['device']}, torch {first['torch']}, commit {first['git_commit'][:12]}", "",
                      f"exact match at the training length at the end of training: {trained}", "",
                      markdown_table(rows)])
