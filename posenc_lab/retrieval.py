"""Passkey retrieval past the training length: does the model *use* context it was not trained on?

Three tasks, each a small model trained on it alone at the training length (``task``):

* ``content`` (the control): a lookup by character class; described next.
* ``digits``: one shared alphabet. The passkey is five digits planted in a haystack of lowercase
  letters; the question ``?`` asks for them **in order**. The first digit is found by its class,
  but the next ones must be copied from the position after the previous one (a digit can repeat in
  the key), the byte-level form of Mohtashami & Jaggi's (2023) "the pass key is 71432".
* ``multikey``: several named keys of the same kind (``K48213;``, names distinct upper-case
  letters, the asked one at the chosen depth, the others at random places), and the question
  ``?K`` names one, in the spirit of RULER's multi-key needles (Hsieh et al. 2024): the right key
  must be told from distractors of the same kind, then copied in order. The name is followed by the
  digits directly, so that one look-up of the name finds the key. Its models train differently from
  the other tasks' (the book's appendix says how the pilots chose it): each training window ends
  with 1 to 4 questions in turn by step (``train_questions``; the one-question windows place needles
  everywhere the grid does), each naming a key drawn at random (repeats allowed: asking every key
  once let the last be found by elimination, a shortcut the pilots caught), and the input
  embedding is untied from the output head (``tie_embeddings=False``): tied, the names, never a
  target, drifted to one shared direction and were never told apart.

The ``content`` task (a synthetic passkey test in the spirit of Mohtashami & Jaggi 2023, built so that every
encoding can learn it from scratch at the training length on a CPU):

* the haystack is random lowercase letters;
* the passkey is four bytes, each drawn from its own alphabet (``0-9``, ``A-J``, ``K-T``, ``U-Z!#$%``),
  planted at a chosen depth of the haystack (depth 0: the first bytes, depth 1: the last bytes
  before the question);
* the window ends with ``?`` and the four passkey bytes: the model must reproduce them.

Because each passkey byte comes from its own alphabet and appears nowhere else, finding it is
pure content lookup (``?`` asks for a digit, a digit asks for a letter of ``A-J``, ...): no
position arithmetic is needed, so a model that fails beyond the training length fails because its
position encoding disturbs attention there, not because the task needs positions.

Exact match (all four bytes) is read with teacher forcing: the argmax at each answer position
given the true earlier answer bytes. That is exactly greedy decoding's result: greedy decoding
feeds back its own bytes, which are the true ones up to the first mistake, and one mistake fails
the match either way.

``python -m posenc_lab retrieval --preset retrieval-cpu`` trains one model per encoding at length
``L`` (loss on the answer bytes only), then measures accuracy on a grid of lengths ``L .. 8L`` x
needle depths, ``trials`` windows per cell, each cell with its Wilson 95 % interval. RoPE's
strategies are evaluated on the one trained RoPE model. The runner is the experiment's
(:func:`experiment.run_units`): resumable per unit, one tidy table.
"""

from __future__ import annotations

from .extras import require

require("lab", "posenc_lab.retrieval")

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from . import distributed
from .encodings import ENCODINGS, PRIMARY, strategies_of
from .errors import PosencError, PositionOutOfRange, check_positive, unknown_name
from .experiment import (collect_rows, device_name, git_commit, prepare, resolve_device, run_units, write_atomic)
from .model import GPT, IGNORE, GPTConfig
from .rope import ARTICLE_STRATEGIES, ROPE_SCALINGS
from .schema import SCHEMA_VERSION
from .train import TrainConfig, autocast, flush_denormals, save_atomic, train

FILLER = torch.tensor(list(b"abcdefghijklmnopqrstuvwxyz"))
SLOTS = [torch.tensor(list(chars)) for chars in (b"0123456789", b"ABCDEFGHIJ", b"KLMNOPQRST", b"UVWXYZ!#$%")]
QUESTION = ord("?")
KEY_LEN = len(SLOTS)
#: the retrieval tasks (see the module docstring)
TASKS = ("content", "digits", "multikey")
DIGITS = torch.tensor(list(b"0123456789"))
NAMES = torch.tensor(list(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
DIGITS_LEN = 5  # the passkey of the digits and multikey tasks
MULTIKEYS = 4  # named keys in a multikey window (the asked one and three distractors)


def _place(seq, rows, start, piece):
    seq[rows, start[:, None] + torch.arange(piece.shape[1])] = piece


def _digit_windows(n, length, depth, generator, task, keys=MULTIKEYS, questions=1):
    """The ``digits`` and ``multikey`` windows: ``length + 1`` bytes, the last ``DIGITS_LEN`` the answer (with
    ``questions`` > 1, multikey only: that many questions at the end, each answer scored)."""
    if task == "digits":
        needle_len, ask_len = DIGITS_LEN, 1
    else:
        needle_len, ask_len = DIGITS_LEN + 2, 2  # "K48213;" and "?K"
    tail = questions * (ask_len + DIGITS_LEN)
    haystack = length + 1 - tail
    slots = keys if task == "multikey" else 1
    if haystack < 2 * slots * needle_len:
        raise PosencError(f"a {task} retrieval window needs at least {2 * slots * needle_len + tail - 1} "
                          f"bytes, got {length}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise PosencError(f"needle depth must lie in [0, 1], got {depth}")
    seq = FILLER[torch.randint(len(FILLER), (n, length + 1), generator=generator)]
    key = DIGITS[torch.randint(len(DIGITS), (n, DIGITS_LEN), generator=generator)]
    last = haystack - needle_len
    start = torch.randint(last + 1, (n,), generator=generator) if depth is None else torch.full((n,), round(depth * last))
    rows = torch.arange(n)[:, None]
    if task == "digits":
        _place(seq, rows, start, key)
        every = key[:, None, :]  # n 1 5
    else:
        names = torch.stack([NAMES[torch.randperm(len(NAMES), generator=generator)[:keys]] for _ in range(n)])  # n K
        semi = torch.full((n, 1), ord(";"))
        _place(seq, rows, start, torch.cat([names[:, :1], key, semi], 1))
        every = key[:, None, :].repeat(1, keys, 1)  # n K 5: every needle's digits, the asked one first
        for i in range(n):  # the distractors: other names, other digits, never overlapping a needle
            taken = [(int(start[i]), int(start[i]) + needle_len)]
            for k in range(1, keys):
                while True:
                    at = int(torch.randint(last + 1, (1,), generator=generator))
                    if all(at + needle_len <= a or at >= b for a, b in taken):
                        break
                taken.append((at, at + needle_len))
                other = key[i]
                while torch.equal(other, key[i]):  # a distractor's digits always differ from the asked key's
                    other = DIGITS[torch.randint(len(DIGITS), (DIGITS_LEN,), generator=generator)]
                seq[i, at : at + needle_len] = torch.cat([names[i, k : k + 1], other, semi[0]])
                every[i, k] = other
    # the questions after the haystack: "?" (the name asked: multikey), the digits ("?B90215?K48213..."); the first
    # asks for the needle placed at the depth, each later one for a needle drawn at random, repeats allowed (asking
    # every key once would let the last be found by elimination); the loss is on every answer
    asked = torch.cat([torch.zeros(n, 1, dtype=torch.long),
                       torch.randint(keys, (n, questions - 1), generator=generator)], 1)  # n questions: needle asked
    answers = torch.zeros(length + 1, dtype=torch.bool)
    for q in range(questions):
        at = haystack + q * (ask_len + DIGITS_LEN)
        seq[:, at] = QUESTION
        if task == "multikey":
            seq[:, at + 1] = names[rows[:, 0], asked[:, q]]
        seq[:, at + ask_len : at + ask_len + DIGITS_LEN] = every[rows[:, 0], asked[:, q]]
        answers[at + ask_len : at + ask_len + DIGITS_LEN] = True
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, ~answers[1:]] = IGNORE
    return inputs.long(), targets.long(), key.long(), start


def make_windows(n: int, length: int, depth: float | None, generator: torch.Generator, task: str = "content",
                 keys: int = MULTIKEYS, questions: int = 1):
    """``n`` windows of ``length`` bytes: inputs ``n x length``, targets (``IGNORE`` except the answer
    positions), the passkeys (``n x 4`` for ``content``, ``n x 5`` digits otherwise) and the (asked)
    needle's start positions.

    Layout of the ``length + 1`` bytes (``content``): haystack (``length - 4`` bytes, passkey inside it), ``?``,
    the passkey. ``depth`` in [0, 1] places the passkey at ``round(depth * (length - 8))``; ``None`` draws
    it uniformly per window (training). ``digits``: haystack, ``?``, the five digits; ``multikey``:
    haystack with ``keys`` named keys (four unless asked otherwise), ``?``, the asked name, its five digits;
    ``depth`` places the asked needle the same way. ``questions`` > 1 (multikey, for training): the window ends
    with that many questions (``?B90215?K48213...``), the first naming the needle placed at the depth and each later
    one a needle drawn at random (repeats allowed), and every answer is scored; the returned passkeys and starts
    are those of the first question's needle.
    """
    if questions != 1 and task != "multikey":
        raise PosencError(f"several questions are for the multikey task, not {task}")
    if questions < 1:
        raise PosencError(f"a window asks at least one question, got {questions}")
    if task not in TASKS:
        raise unknown_name("retrieval task", task, TASKS)
    if not 1 <= keys <= len(NAMES):
        raise PosencError(f"a multikey window holds 1 to {len(NAMES)} named keys, got {keys}")
    if task != "content":
        return _digit_windows(n, length, depth, generator, task, keys, questions)
    haystack = length - KEY_LEN
    if haystack < KEY_LEN:
        raise PosencError(f"a retrieval window needs at least {2 * KEY_LEN} bytes, got {length}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise PosencError(f"needle depth must lie in [0, 1], got {depth}")
    seq = FILLER[torch.randint(len(FILLER), (n, length + 1), generator=generator)]
    key = torch.stack([slot[torch.randint(len(slot), (n,), generator=generator)] for slot in SLOTS], dim=1)  # n 4
    last = haystack - KEY_LEN
    if depth is None:
        start = torch.randint(last + 1, (n,), generator=generator)
    else:
        start = torch.full((n,), round(depth * last))
    rows = torch.arange(n)[:, None]
    seq[rows, start[:, None] + torch.arange(KEY_LEN)] = key
    seq[:, haystack] = QUESTION
    seq[:, haystack + 1:] = key
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, :haystack] = IGNORE  # the loss is on the four answer bytes only
    return inputs.long(), targets.long(), key.long(), start


@torch.no_grad()
def answer_hits(model, inputs: torch.Tensor, targets: torch.Tensor, *, batch_size: int = 32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Per window and answer position (the targets that are not ``IGNORE``, the last ones of the window), whether
    the argmax there is the passkey byte (bool ``n x answer``): which byte of the answer a model gets wrong."""
    device = torch.device(device)
    answer = int((targets[0] != IGNORE).sum()) if len(targets) else KEY_LEN
    model.eval().to(device)
    out = []
    with flush_denormals():
        for i in range(0, len(inputs), batch_size):
            x, y = inputs[i : i + batch_size].to(device), targets[i : i + batch_size].to(device)
            with autocast(device):
                logits = model(x)[:, -answer:]  # the last positions predict the passkey
            out.append((logits.argmax(-1) == y[:, -answer:]).cpu())
    return torch.cat(out)


def exact_match(model, inputs: torch.Tensor, targets: torch.Tensor, *, batch_size: int = 32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Per window, whether the argmax at every answer position is the passkey byte (bool ``n``; see
    :func:`answer_hits`)."""
    return answer_hits(model, inputs, targets, batch_size=batch_size, device=device).all(-1)


def wilson(correct: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % for ``z = 1.96``)."""
    if trials == 0:
        return math.nan, math.nan
    p = correct / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    # at p = 0 and p = 1 the interval ends exactly at 0 and 1; rounding must not put it past p (0.9999... < 1)
    low = 0.0 if correct == 0 else max(0.0, min(p, centre - half))
    high = 1.0 if correct == trials else min(1.0, max(p, centre + half))
    return low, high


@dataclass
class RetrievalSpec:
    """Everything that defines a retrieval experiment; a preset is a named RetrievalSpec."""

    preset: str = "custom"
    task: str = "content"
    encodings: tuple[str, ...] = PRIMARY
    strategies: tuple[str, ...] = ARTICLE_STRATEGIES
    seeds: tuple[int, ...] = (0,)
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    train_len: int = 128
    steps: int = 1500
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    checkpoint_every: int = 250
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
    #: the input embedding and the output head share one matrix (the language model's GPT-2 form); untied, the
    #: names of the multikey task, never a target, keep apart (see :class:`~posenc_lab.model.GPTConfig`)
    tie_embeddings: bool = True
    monitor_every: int = 100  # training accuracy at the training length, every this many steps
    monitor_trials: int = 128
    eval_batch_size: int = 32
    backend: str = "auto"
    notes: str = ""

    def __post_init__(self):
        if self.task not in TASKS:
            raise unknown_name("retrieval task", self.task, TASKS)
        for name in ("n_layer", "n_head", "d_model", "train_len", "steps", "batch_size", "lr", "trials",
                     "monitor_every", "monitor_trials", "eval_batch_size", "checkpoint_every"):
            check_positive(name, getattr(self, name))
        for name in self.encodings:
            if name not in ENCODINGS:
                raise unknown_name("encoding", name, ENCODINGS)
        for name in self.strategies:
            if name not in ROPE_SCALINGS:
                raise unknown_name("RoPE scaling", name, ROPE_SCALINGS)
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
        if self.train_len < 4 * KEY_LEN:
            raise PosencError(f"train_len must be at least {4 * KEY_LEN} bytes for a retrieval window")

    def model_config(self, encoding: str) -> GPTConfig:
        """The :class:`GPTConfig` of ``encoding`` under this spec."""
        return GPTConfig(encoding=encoding, n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model,
                         train_len=self.train_len, backend=self.backend, tie_embeddings=self.tie_embeddings)

    def to_dict(self) -> dict:
        """The spec as a plain dict (as stored in ``config.json``). The task is left out when it is ``content``,
        the only task before there were three, so that the runs made then keep their configuration."""
        d = asdict(self)
        if d["task"] == "content":
            del d["task"]
        if not d["train_keys"]:  # nor the training keys unless set (the runs made before they existed)
            del d["train_keys"]
        if not d["train_questions"]:
            del d["train_questions"]
        if d["tie_embeddings"]:
            del d["tie_embeddings"]
        return d


#: the starting configurations of a retrieval run, by name
RETRIEVAL_PRESETS: dict[str, RetrievalSpec] = {
    "retrieval-ci": RetrievalSpec(preset="retrieval-ci", n_layer=1, d_model=32, train_len=32, steps=6, batch_size=4,
                                  warmup=2, checkpoint_every=3, multiples=(1, 2), depths=(0.0, 1.0), trials=4,
                                  monitor_every=3, monitor_trials=4, notes="end to end in seconds; numbers mean nothing"),
    "retrieval-cpu": RetrievalSpec(preset="retrieval-cpu", steps=1000, trials=100,
                                   notes="passkey retrieval trained at 128 bytes, judged at 1x to 8x, every encoding, "
                                         "on 2 CPU cores in under an hour"),
    "retrieval-digits-cpu": RetrievalSpec(preset="retrieval-digits-cpu", task="digits",
                                          encodings=("nope", "sinusoidal", "rope", "alibi", "t5"), seeds=(0, 1, 2),
                                          steps=4000, trials=100,
                                          notes="five digits copied in order (one shared alphabet), trained at 128 "
                                                "bytes for 4,000 steps (1,000 do not teach it), judged at 1x to 8x, "
                                                "the article's encodings, three seeds; about 75 minutes"),
    "retrieval-multikey-cpu": RetrievalSpec(preset="retrieval-multikey-cpu", task="multikey",
                                            encodings=("rope", "alibi", "nope", "sinusoidal", "t5"), seeds=(0, 1, 2),
                                            steps=8000, trials=100, train_questions=(1, 2, 3, 4),
                                            tie_embeddings=False,
                                            notes="the named key among three distractors of the same kind, trained at "
                                                  "128 bytes for 8,000 steps with 1-4 questions per window and "
                                                  "untied embeddings (with tied ones the names are not told "
                                                  "apart), judged at 1x to 8x, the article's encodings, three seeds; "
                                                  "about 5.5 hours"),
}


def retrieval_preset(name: str, **overrides) -> RetrievalSpec:
    """The spec of retrieval preset ``name`` (a key of :data:`RETRIEVAL_PRESETS`), with the ``overrides`` that are
    not ``None``."""
    if name not in RETRIEVAL_PRESETS:
        raise unknown_name("retrieval preset", name, RETRIEVAL_PRESETS)
    return replace(RETRIEVAL_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


COLUMNS = ["task", "encoding", "strategy", "seed", "train_len", "eval_len", "multiple", "depth", "distance", "status", "trials",
           "correct", "accuracy", "ci_low", "ci_high", "train_accuracy", "train_steps", "train_seconds", "preset",
           "device", "torch", "posenc_lab", "git_commit", "schema"]


def _grid(model, spec: RetrievalSpec, seed: int, device, progress: bool, label: str) -> list[dict]:
    rows = []
    cells = [(m, d) for m in spec.multiples for d in spec.depths]
    for multiple, depth in tqdm(cells, desc=f"retrieval {label}", disable=not progress, leave=False):
        length = multiple * spec.train_len
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
    cfg = TrainConfig(steps=spec.steps, batch_size=spec.batch_size, lr=spec.lr, warmup=spec.warmup,
                      checkpoint_every=spec.checkpoint_every, seed=seed)
    monitor_g = torch.Generator().manual_seed(4242 + seed)
    probe = make_windows(spec.monitor_trials, spec.train_len, None, monitor_g, spec.task)
    curve = []

    def batches(step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        keys = spec.train_keys[step % len(spec.train_keys)] if spec.train_keys else MULTIKEYS
        questions = spec.train_questions[step % len(spec.train_questions)] if spec.train_questions else 1
        x, y, _, _ = make_windows(spec.batch_size, spec.train_len, None, g, spec.task, keys, questions)
        return x, y

    def monitor(step):
        if step % spec.monitor_every == 0 or step == spec.steps:
            accuracy = exact_match(model, probe[0], probe[1], batch_size=spec.eval_batch_size, device=device)
            curve.append({"step": step, "accuracy": float(accuracy.float().mean())})
            model.train()

    trained = train(model, None, cfg, batches=batches, on_step=monitor,
                    checkpoint=out / "checkpoints" / f"{encoding}-s{seed}.pt", device=device, progress=progress,
                    desc=f"train {encoding}/s{seed}", extra_state=curve)
    base = {"task": spec.task, "encoding": encoding, "seed": seed, "train_len": spec.train_len,
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

    from . import __version__

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


def describe_task(task: str = "content") -> dict:
    """The task's alphabets, as stored with the results: the filler bytes, the passkey's alphabet per slot, the
    question byte and the answer's length (and, for the newer tasks, their name, names and key count)."""
    if task == "content":
        return {"filler": FILLER.tolist(), "slots": [s.tolist() for s in SLOTS], "question": QUESTION,
                "answer_bytes": KEY_LEN}
    described = {"task": task, "filler": FILLER.tolist(), "slots": [DIGITS.tolist()] * DIGITS_LEN,
                 "question": QUESTION, "answer_bytes": DIGITS_LEN}
    if task == "multikey":  # the form is recorded: a folder made with the first form (K=48213;, ?K=) is refused
        described.update(names=NAMES.tolist(), keys=MULTIKEYS, needle="K48213;", question="?K")
    return described


def frame(rows):
    """The retrieval rows as a DataFrame with a ``label`` column (``rope/yarn``, ``alibi``, ...)."""
    from .report import frame as results_frame

    return results_frame(rows)


def with_wilson(table):
    """Add ``ci_low`` and ``ci_high``, the Wilson 95 % interval of ``correct`` out of ``trials`` on each row, to
    the DataFrame ``table`` (in place; also returned)."""
    intervals = [wilson(int(c), int(t)) for c, t in zip(table["correct"], table["trials"])]
    table["ci_low"], table["ci_high"] = zip(*intervals) if intervals else ((), ())
    return table


#: the exact match at the training length, at the end of training, from which a model counts as having learned its
#: task: below it, what it does past the training length says nothing about extrapolation
LEARNED = 0.95


def by_length(rows):
    """Exact-match accuracy per label and length: ``accuracy``, the mean of the seeds' accuracies (each pooled over
    depths), with ``ci_low``/``ci_high`` its 95 % interval from the seeds (:func:`~posenc_lab.stats.seed_interval`) and
    ``per_seed`` the seeds' accuracies; ``wilson_low``/``wilson_high`` the Wilson interval of all windows pooled,
    which is the precision of these trained models' pooled score, not an interval for the encoding. A DataFrame
    indexed by ``(label, eval_len)``; ``train_accuracy`` is the lowest over the seeds (a label counts as learned
    when every seed learned its task, :data:`LEARNED`)."""
    from .stats import seed_interval

    df = frame(rows)
    pooled = df.groupby(["label", "eval_len"]).agg(correct=("correct", "sum"), trials=("trials", "sum"),
                                                   status=("status", "first"), train_accuracy=("train_accuracy", "min"))
    with_wilson(pooled)
    pooled = pooled.rename(columns={"ci_low": "wilson_low", "ci_high": "wilson_high"})
    seeds = df.groupby(["label", "eval_len", "seed"]).agg(correct=("correct", "sum"), trials=("trials", "sum"))
    per_seed = (seeds["correct"] / seeds["trials"].where(seeds["trials"] > 0)).groupby(["label", "eval_len"])
    intervals = per_seed.apply(lambda x: seed_interval(x.to_numpy()))
    pooled["accuracy"] = [intervals.loc[i][0] for i in pooled.index]
    pooled["ci_low"] = [intervals.loc[i][1] for i in pooled.index]
    pooled["ci_high"] = [intervals.loc[i][2] for i in pooled.index]
    pooled["per_seed"] = [tuple(round(float(v), 3) for v in per_seed.get_group(i)) for i in pooled.index]
    return pooled


def by_distance(rows, edges=(0, 64, 128, 256, 512, 1024, 2048)):
    """Exact-match accuracy per label and *absolute* distance from the question back to the needle, pooled over
    lengths, depths and seeds, with its Wilson 95 % interval: a DataFrame indexed by ``(label, distance)``, where
    ``distance`` is the bin ``[a, b)`` of ``edges`` (bytes) that each grid cell's distance falls in. It separates
    "far from the question" from "long window": an encoding that fails by distance fails at the same distance
    in every window; one that fails by length fails near the question too. The last bin is open (distances past
    the last edge fall in it). The intervals count windows, pooled over seeds: they say how precisely these
    models' accuracy is known, not how another seed would do (:func:`by_seed`)."""
    import pandas as pd

    df = frame(rows)
    df = df[df["status"] == "ok"].copy()
    if "distance" not in df:  # runs of the content task made before the column existed: the same geometry
        if "task" in df and set(df["task"].dropna()) - {"content"}:
            raise PosencError("rows of the digits or multikey task without a distance column: re-run them")
        last = df["eval_len"] - 2 * KEY_LEN
        df["distance"] = df["eval_len"] - KEY_LEN - (df["depth"] * last).round().astype(int)
    labels = [f"{a}-{b}" for a, b in zip(edges[:-1], edges[1:])] + [f"{edges[-1]}+"]
    df["distance_bin"] = pd.cut(df["distance"], bins=[*edges, math.inf], right=False, labels=labels)
    pooled = df.groupby(["label", "distance_bin"], observed=True).agg(correct=("correct", "sum"),
                                                                       trials=("trials", "sum"))
    pooled = pooled[pooled["trials"] > 0]
    pooled["accuracy"] = pooled["correct"] / pooled["trials"]
    with_wilson(pooled)
    return pooled.rename_axis(["label", "distance"])


def by_seed(rows):
    """Exact-match accuracy per label, length and seed (pooled over depths): the samples a comparison of
    encodings rests on, since windows scored by the same trained model are not independent samples of the
    encoding."""
    df = frame(rows)
    df = df[df["status"] == "ok"]
    g = df.groupby(["label", "eval_len", "seed"]).agg(correct=("correct", "sum"), trials=("trials", "sum"))
    return g["correct"] / g["trials"]


def markdown_table(rows) -> str:
    """Exact match per encoding (rows) and length (columns): the mean of the seeds' accuracies [95 % interval from
    the seeds] and each seed's accuracy; a label some seed of which did not learn its task (:data:`LEARNED`) is
    marked so in its first column."""
    table = by_length(rows)
    lengths = sorted(table.index.get_level_values("eval_len").unique())
    lines = ["| exact match, mean of the seeds [95 % interval from the seeds] (each seed) | "
             + " | ".join(map(str, lengths)) + " |",
             "|---" * (len(lengths) + 1) + "|"]
    for name in sorted(table.index.get_level_values("label").unique()):
        cells = []
        for n in lengths:
            r = table.loc[(name, n)] if (name, n) in table.index else None
            if r is None:
                cells.append("")
            elif r["status"] != "ok":
                cells.append("cannot extrapolate")
            else:
                interval = "" if math.isnan(r["ci_low"]) else f" [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
                cells.append(f"{r['accuracy']:.2f}{interval} ({', '.join(f'{v:.2f}' for v in r['per_seed'])})")
        learned = table.loc[name]["train_accuracy"].min()
        mark = (" (training accuracy unknown)" if math.isnan(learned) else
                f" (not learned: lowest seed {learned:.2f} at the end of training)" if learned < LEARNED else "")
        lines.append(f"| {name}{mark} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(out: Path | str) -> str:
    """The text report of a retrieval run folder: where it ran, each unit's training accuracy, and the accuracy
    table."""
    from .report import load

    rows, units, config = load(out)
    if not rows:
        raise PosencError(f"{out} has no finished unit yet")
    first = rows[0]
    trained = ", ".join(f"{u['encoding']} {u['train_accuracy'][-1]['accuracy']:.3f}" for u in units if u["train_accuracy"])
    return "\n".join([f"# {Path(out).name}: preset {first['preset']}, trained at {first['train_len']} bytes, "
                      f"device {first['device']}, torch {first['torch']}, commit {first['git_commit'][:12]}", "",
                      f"exact match at the training length at the end of training: {trained}", "",
                      markdown_table(rows)])
