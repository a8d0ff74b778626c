"""The experiment: train each encoding at one length, evaluate it at that length and far beyond.

One *unit* is one encoding and one seed: train (resuming from its checkpoint), then evaluate at
every length and mode (for RoPE, once per extrapolation strategy, and optionally after a brief
fine-tune at a longer length). Each finished unit is written to ``units/`` at once, so a run that
is interrupted, or cut short by a GPU time slice, continues from the units already finished when
the same command is run again. The tidy table (``results.csv`` / ``results.json``, columns
:data:`COLUMNS`, in the schema of :mod:`posenc_lab.schema`) is rebuilt from the units after each
one; the spec is recorded once, in ``config.json``.
"""

from __future__ import annotations

from .extras import require

require("lab", "posenc_lab.experiment")

import copy
import csv
import io
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from . import __version__, distributed
from .data import Corpus, EvalText, evaluation_text, load_corpus
from .encodings import ENCODINGS, PRIMARY, strategies_of
from .errors import PosencError, check_positive, unknown_name
from .evaluate import MODES, evaluate, window_plan
from .model import GPT, GPTConfig
from .rope import ARTICLE_STRATEGIES, ROPE_SCALINGS
from .schema import SCHEMA_VERSION, migrate, migrate_unit
from .train import TrainConfig, replace_atomically, save_atomic, train

try:  # the training-speed defaults live in train.py
    from .train import default_compile
except ImportError:  # pragma: no cover
    def default_compile(device: torch.device) -> bool:
        """Whether to ``torch.compile`` the training step by default: on CUDA, not on the CPU."""
        return device.type == "cuda"

MAIN_ENCODINGS = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5")  # the article's, with several seeds
#: the encodings of the article-cpu run: the article's and the newer relatives
ARTICLE_ENCODINGS = PRIMARY


@dataclass
class Spec:
    """Everything that defines an experiment; a preset is a named Spec."""

    preset: str = "custom"
    encodings: tuple[str, ...] = PRIMARY
    strategies: tuple[str, ...] = ARTICLE_STRATEGIES  # RoPE extrapolation strategies evaluated
    seeds: tuple[int, ...] = (0,)  # for MAIN_ENCODINGS
    other_seeds: tuple[int, ...] = (0,)  # for the newer relatives (xpos, kerple, fire)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    train_len: int = 128
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100
    checkpoint_every: int = 200
    eval_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    eval_tokens: int = 16384  # scored bytes of the evaluation text (data.evaluation_text), the same at every length
    modes: tuple[str, ...] = MODES
    stride: int = 128  # sliding stride at every length (min(stride, length)), unless `sliding` names the lengths
    sliding: tuple[tuple[int, int], ...] = ()  # (length, stride) pairs evaluated in sliding mode; () = every length
    eval_batch_size: int = 4
    curve_points: int = 0  # checkpoint evaluations along training: this many, evenly spaced in steps
    curve_factors: tuple[int, ...] = (1, 4)  # ... at these multiples of train_len, non-overlapping
    curve_tokens: int = 32768  # ... on this many bytes of the evaluation text: 8 blocks spread evenly over it
    finetune: tuple[str, ...] = ()  # RoPE strategies to fine-tune briefly at finetune_len
    finetune_steps: int = 0
    finetune_len: int = 0
    finetune_seeds: tuple[int, ...] | None = None  # the RoPE seeds that are fine-tuned (default: all)
    backend: str = "auto"
    compile: bool | None = None  # torch.compile the training step; default: on CUDA
    notes: str = ""

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "train_len", "steps", "batch_size", "lr", "eval_tokens",
                     "stride", "eval_batch_size", "checkpoint_every"):
            check_positive(name, getattr(self, name))
        for name in self.encodings:
            if name not in ENCODINGS:
                raise unknown_name("encoding", name, ENCODINGS)
        for name in (*self.strategies, *self.finetune):
            if name not in ROPE_SCALINGS:
                raise unknown_name("RoPE scaling", name, ROPE_SCALINGS)
        for mode in self.modes:
            if mode not in MODES:
                raise unknown_name("evaluation mode", mode, MODES)
        for length in self.eval_lengths:
            check_positive("evaluation length", length)
            if self.eval_tokens % length:
                raise PosencError(f"eval_tokens ({self.eval_tokens}) must be a multiple of every evaluation length ({length})")
        for length, stride in self.sliding:
            if length not in self.eval_lengths:
                raise PosencError(f"sliding length {length} is not one of the evaluation lengths {self.eval_lengths}")
        for length, mode, stride in self.evaluations():  # the window arithmetic must work out everywhere
            window_plan(self.eval_tokens, length, mode, stride, self.eval_context())
        if self.curve_points:
            if self.curve_tokens % (8 * max(self.curve_lengths())) or self.curve_tokens > self.eval_tokens:
                raise PosencError(f"curve_tokens ({self.curve_tokens}) must be a multiple of 8 x the longest curve "
                                  f"length ({max(self.curve_lengths())}) and at most eval_tokens")
        if not self.seeds or not self.eval_lengths or not self.encodings or not self.modes:
            raise PosencError("an experiment needs at least one encoding, seed, evaluation length and mode")
        if "dynamic-ntk" in self.finetune:
            raise PosencError("dynamic-ntk has no fixed factor to fine-tune with; fine-tune with pi, ntk or yarn")
        if self.finetune and (self.finetune_steps <= 0 or self.finetune_len <= self.train_len):
            raise PosencError("fine-tuning needs --finetune-steps > 0 and --finetune-len longer than the training length")
        if self.d_model % self.n_head:
            raise PosencError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if (self.d_model // self.n_head) % 2 and any(ENCODINGS[n].hook == "rotate" for n in self.encodings):
            raise PosencError(f"RoPE and xPos rotate pairs: the head dimension d_model / n_head = "
                              f"{self.d_model // self.n_head} must be even")

    def evaluations(self) -> list[tuple[int, str, int | None]]:
        """``(length, mode, stride)`` of every evaluation of a trained model, in order."""
        sliding = dict(self.sliding) if self.sliding else {n: min(self.stride, n) for n in self.eval_lengths}
        return [(n, mode, sliding[n] if mode == "sliding" else None) for n in self.eval_lengths for mode in self.modes
                if mode == "nonoverlapping" or n in sliding]

    def eval_context(self) -> int:
        """Bytes of lead-in before the scored text: enough for every sliding window's ``length - stride``."""
        return max([n - s for n, mode, s in self.evaluations() if mode == "sliding"], default=0)

    def curve_lengths(self) -> tuple[int, ...]:
        """The lengths at which the checkpoints along training are evaluated: ``curve_factors`` times ``train_len``."""
        return tuple(f * self.train_len for f in self.curve_factors)

    def curve_steps(self) -> list[int]:
        """The training steps after which a checkpoint is evaluated: ``curve_points`` evenly spaced, the last one included."""
        return sorted({round(self.steps * (k + 1) / self.curve_points) for k in range(self.curve_points)})

    def finetune_batch(self) -> int:
        """The fine-tuning batch: the training batch's tokens per step, in windows of ``finetune_len``."""
        return max(1, self.batch_size * self.train_len // self.finetune_len)

    def seeds_for(self, encoding: str) -> tuple[int, ...]:
        """The seeds of ``encoding``: ``seeds`` for the article's encodings (``MAIN_ENCODINGS``), ``other_seeds``
        for the others."""
        return self.seeds if encoding in MAIN_ENCODINGS else self.other_seeds

    def finetunes(self, seed: int) -> tuple[str, ...]:
        """The strategies fine-tuned for RoPE seed ``seed``."""
        return self.finetune if self.finetune_seeds is None or seed in self.finetune_seeds else ()

    def model_config(self, encoding: str) -> GPTConfig:
        """The :class:`GPTConfig` of ``encoding`` under this spec."""
        return GPTConfig(encoding=encoding, n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model,
                         train_len=self.train_len, backend=self.backend)

    def train_config(self, seed: int) -> TrainConfig:
        """The :class:`TrainConfig` of one seed under this spec."""
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, lr=self.lr, warmup=self.warmup,
                           checkpoint_every=self.checkpoint_every, seed=seed)

    def to_dict(self) -> dict:
        """The spec as a plain dict (as stored in ``config.json``)."""
        return asdict(self)


#: the starting configurations of a run, by name (``python -m posenc_lab presets`` describes them)
PRESETS: dict[str, Spec] = {
    "ci": Spec(preset="ci", n_layer=2, n_head=4, d_model=64, train_len=64, steps=40, batch_size=8, lr=3e-3,
               warmup=10, checkpoint_every=20, eval_lengths=(64, 128, 256), eval_tokens=1024, stride=32,
               eval_batch_size=4, notes="every encoding end to end in about a minute on 2 CPU cores; numbers mean nothing"),
    "cpu": Spec(preset="cpu", n_layer=4, n_head=4, d_model=128, train_len=128, steps=1200, batch_size=16, lr=2e-3,
                warmup=100, checkpoint_every=200, eval_lengths=(128, 256, 512, 1024, 2048), eval_tokens=16384,
                stride=128, eval_batch_size=4,
                notes="the qualitative picture on 2 CPU cores: train at 128, evaluate to 16x"),
    "article-cpu": Spec(preset="article-cpu", encodings=ARTICLE_ENCODINGS, n_layer=4, n_head=4, d_model=128,
                        train_len=512, steps=700, batch_size=8, lr=2e-3, warmup=70, checkpoint_every=100,
                        eval_lengths=(512, 1024, 2048, 8192), eval_tokens=31 * 8192, stride=512,
                        sliding=((512, 256), (1024, 512), (2048, 1024)), eval_batch_size=4, seeds=(0, 1, 2),
                        other_seeds=(0, 1, 2), finetune=("pi", "ntk", "yarn"), finetune_steps=200, finetune_len=2048,
                        finetune_seeds=(0,), curve_points=8,
                        notes="the article's lengths on 2 CPU cores: trained at 512 for 2.9 M bytes, judged at 2048 "
                              "(4x), evaluated to 8192 on 248 KiB of 34 test files (non-overlapping at 1x, 2x, 4x, "
                              "16x; sliding at 1x, 2x and 4x with stride L'/2, so every scored byte sees at least "
                              "L'/2 bytes), three seeds of every encoding, 8 checkpoint evaluations; about 3 hours"),
    "article-long": Spec(preset="article-long", encodings=("nope", "sinusoidal", "rope", "alibi", "t5"), n_layer=4,
                         n_head=4, d_model=128, train_len=512, steps=2800, batch_size=8, lr=2e-3, warmup=280,
                         checkpoint_every=100, eval_lengths=(512, 1024, 2048, 8192), eval_tokens=31 * 8192, stride=512,
                         sliding=((512, 256), (1024, 512), (2048, 1024)), eval_batch_size=4, seeds=(0, 1, 2), curve_points=16,
                         notes="article-cpu's model and recipe with 4x its training tokens (11.5 M bytes) for the "
                               "article's encodings, three seeds, evaluated as article-cpu, 16 checkpoint "
                               "evaluations; many hours on 2 CPU cores: run it in the background, it resumes"),
    "colab": Spec(preset="colab", n_layer=6, n_head=6, d_model=384, train_len=512, steps=1500, batch_size=16,
                  lr=1e-3, warmup=150, checkpoint_every=250, eval_lengths=(512, 1024, 2048, 4096, 8192),
                  eval_tokens=32768, stride=256, eval_batch_size=2,
                  notes="sized for a Colab T4 in about 30 minutes"),
    "paper": Spec(preset="paper", n_layer=12, n_head=8, d_model=512, train_len=512, steps=4000, batch_size=64,
                  lr=6e-4, warmup=300, checkpoint_every=250, eval_lengths=(512, 1024, 2048, 4096, 8192, 16384),
                  eval_tokens=65536, stride=512, eval_batch_size=4, seeds=(0, 1, 2),
                  notes="the article's model (12 layers, 8 heads, d_model 512, trained at 512) on a GPU"),
}
# the same model, tokens and evaluation in twice as many steps of half the batch: the recipe's own effect on the
# verdicts (warm-up and checkpoints stretched alike, so the checkpoint evaluations fall on the same tokens)
PRESETS["article-long-b4"] = replace(
    PRESETS["article-long"], preset="article-long-b4", batch_size=4, steps=5600, warmup=560, checkpoint_every=200,
    notes="article-long's model, 11.5 M training bytes and evaluation in batches of 4 windows for 5,600 steps "
          "(twice the optimiser steps), three seeds; a GPU runs its units side by side (--jobs)")
# the headline's recipes on English prose (data.load_corpus names the corpus): the two domains differ only in text
PRESETS["prose-long"] = replace(PRESETS["article-long"], preset="prose-long",
                                notes="article-long's recipe on English prose (--corpus)")
PRESETS["prose-long-b4"] = replace(PRESETS["article-long-b4"], preset="prose-long-b4",
                                   notes="article-long-b4's recipe on English prose (--corpus)")


# the sinusoids at the small amplitude, one seed, with article-cpu's recipe and evaluation (its
# sinusoidal seed 0 sees the same batches and the same bytes, so the two units compare directly)
PRESETS["amplitude-cpu"] = replace(
    PRESETS["article-cpu"], preset="amplitude-cpu", encodings=("sinusoidal-small",), seeds=(0,), other_seeds=(0,),
    finetune=(), finetune_steps=0, finetune_len=0, finetune_seeds=None,
    notes="the old sinusoidal amplitude (sinusoidal-small, RMS 0.02, tokens unscaled) with article-cpu's recipe "
          "and evaluation, seed 0 only: compare it with article-cpu's sinusoidal seed 0; about 6 minutes")


# what today's models run, trained with article-cpu's recipe and evaluation (plain RoPE and ALiBi are
# article-cpu's own units: same batches, same bytes), three seeds each. Plain RoPE is trained again here so that
# Llama 3's scaling (inference only) is evaluated on every seed: article-cpu keeps the weights of seed 0 only.
# Its rows also check that a run reproduces: same seed, same batches, same bytes as article-cpu's RoPE.
PRESETS["variants-cpu"] = replace(
    PRESETS["article-cpu"], preset="variants-cpu",
    encodings=("rope", "rope-partial", "p-rope", "rope-b500", "rope-b500k", "rope-nope", "rope-random",
               "learned-random"),
    strategies=("none", "yarn", "llama3"),
    seeds=(0, 1, 2), other_seeds=(0, 1, 2), finetune=(), finetune_steps=0, finetune_len=0, finetune_seeds=None,
    curve_points=0,
    notes="partial rotary, p-RoPE, bases 500 and 500,000, a NoPE last layer and randomized positions (RoPE and "
          "learned) with article-cpu's recipe and evaluation, three seeds each, and plain RoPE again (none, YaRN "
          "and Llama 3's scaling, on every seed); about 2 hours 15 minutes on 2 CPU cores")


def preset(name: str, **overrides) -> Spec:
    """The spec of preset ``name`` (a key of :data:`PRESETS`), with the ``overrides`` that are not ``None``."""
    if name not in PRESETS:
        raise unknown_name("preset", name, PRESETS)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[name], **overrides)


# --------------------------------------------------------------------------------------------- bookkeeping


def git_commit() -> str:
    """The package checkout's commit, ``-dirty`` when the package's own source has uncommitted changes
    (the results depend on it; edits elsewhere in the repository do not make a run dirty), or ``unknown``.
    ``POSENC_GIT_COMMIT`` names it where the source travelled without its repository (a copy on a lent GPU)."""
    if os.environ.get("POSENC_GIT_COMMIT"):
        return os.environ["POSENC_GIT_COMMIT"]
    here = Path(__file__).resolve().parent
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


COLUMNS = ["encoding", "strategy", "seed", "train_len", "eval_len", "eval_mode", "stride", "status", "loss",
           "perplexity", "bits_per_byte", "tokens", "eval_seconds", "train_loss", "train_steps", "train_tokens",
           "train_seconds", "train_tokens_per_s", "finetune_steps", "finetune_tokens", "finetune_len", "preset", "corpus", "corpus_sha256",
           "python", "device", "torch", "posenc_lab", "git_commit", "schema"]


# --------------------------------------------------------------------------------------------- running


def default_device() -> torch.device:
    """CUDA when a GPU is available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _evaluate_all(model, spec: Spec, text: EvalText, device, progress, label, *, same_as=None,
                  evaluations=None) -> tuple[list[dict], dict, list[dict]]:
    """Every evaluation of ``spec`` (or only ``evaluations``, ``(length, mode, stride)`` triples) on
    ``text``: result rows, per-position curves, per-document rows.

    ``same_as(length)`` may return the rows, curve and document rows already measured for a length
    at which this model is known to compute exactly the same thing (a RoPE strategy at the training
    length); they are reused instead of recomputed.
    """
    rows, per_position, documents = [], {}, []
    for length, mode, stride in (spec.evaluations() if evaluations is None else evaluations):
        reused = same_as(length, mode) if same_as is not None else None
        if reused is not None:
            row, curve, docs = reused
            rows.append(row)
            documents += docs
            if curve is not None:
                per_position[str(length)] = curve
            continue
        r = evaluate(model, text.stream, length=length, tokens=spec.eval_tokens, mode=mode, stride=stride,
                     context=text.context, documents=text.documents, batch_size=spec.eval_batch_size, device=device,
                     progress=progress, desc=f"{label} L={length} {mode}")
        rows.append({"eval_len": length, "eval_mode": mode, "stride": stride or "", "status": r["status"],
                     "loss": r["loss"], "perplexity": r["perplexity"], "bits_per_byte": r["bits_per_byte"],
                     "tokens": r["tokens"], "eval_seconds": round(r["seconds"], 3)})
        for doc, (summed, count) in (r["per_document"] or {}).items():
            documents.append({"eval_len": length, "eval_mode": mode, "document": text.names[doc], "tokens": count,
                              "loss": round(summed / count, 6)})
        if mode == "nonoverlapping" and r["per_position"] is not None:
            per_position[str(length)] = [round(x, 5) for x in r["per_position"]]
    return rows, per_position, documents


def curve_blocks(spec: Spec, text: EvalText) -> list[int]:
    """Where the checkpoint evaluations read: 8 blocks of ``curve_tokens / 8`` scored bytes, spread evenly
    over the evaluation text (offsets of their first target, relative to the scored text)."""
    block = spec.curve_tokens // 8
    slots = spec.eval_tokens // block
    return [round(k * (slots - 1) / 7) * block for k in range(8)]


def evaluate_checkpoint(model, spec: Spec, text: EvalText, device, strategies=("-",)) -> list[dict]:
    """Perplexity at each curve length (non-overlapping) on the curve blocks, for each strategy; the model
    is left in training mode with its strategy restored."""
    was_training = model.training
    rows = []
    for strategy in strategies:
        if strategy != "-":
            model.encoding.set_scaling(strategy)
        for length in spec.curve_lengths():
            if strategy not in ("-", "none") and length <= spec.train_len:
                continue  # a strategy changes nothing at the training length (checked in run_unit's reuse)
            total, count, status = 0.0, 0, "ok"
            for offset in curve_blocks(spec, text):
                r = evaluate(model, text.stream, length=length, tokens=spec.curve_tokens // 8, mode="nonoverlapping",
                             context=text.context + offset, batch_size=spec.eval_batch_size, device=device)
                if r["status"] != "ok":
                    status = r["status"]
                    break
                total, count = total + r["loss"] * r["tokens"], count + r["tokens"]
            loss = total / count if status == "ok" else math.nan
            rows.append({"strategy": strategy, "eval_len": length, "eval_mode": "nonoverlapping", "status": status,
                         "loss": loss, "perplexity": math.exp(loss) if status == "ok" else math.nan, "tokens": count})
    if "none" in strategies:
        model.encoding.set_scaling("none")
    model.train(was_training)
    return rows


def encoding_state(model) -> dict:
    """The learned parameters of a bias encoding (small tables), for the book's figures."""
    if not (model.encoding.has_bias and any(True for _ in model.encoding.parameters())):
        return {}
    return {k: v.detach().cpu().tolist() for k, v in model.encoding.state_dict().items()}


def _same_rotation(model, strategy: str, length: int) -> bool:
    """Whether RoPE with ``strategy`` rotates positions ``0 .. length-1`` exactly as without scaling
    (every strategy does at the training length): compared, not assumed."""
    positions = torch.arange(length)
    current = model.encoding.scaling
    mine = model.encoding.set_scaling(strategy).cos_sin(positions)
    plain = model.encoding.set_scaling("none").cos_sin(positions)
    model.encoding.set_scaling(current)
    return all(torch.equal(a, b) for a, b in zip(mine, plain))


class _PlainRotation:
    """The rows the 'none' strategy measured for a RoPE model, reused for a strategy that rotates the same
    positions exactly as 'none' does (every strategy at the training length): compared, not assumed."""

    def __init__(self, model, encoding: str):
        self.model, self.encoding, self.measured = model, encoding, {}

    def remember(self, evaluated: list[dict], per_position: dict, docs: list[dict]) -> None:
        for r in evaluated:
            key = (r["eval_len"], r["eval_mode"])
            self.measured[key] = (r, per_position.get(str(r["eval_len"])) if r["eval_mode"] == "nonoverlapping" else None,
                                  [d for d in docs if (d["eval_len"], d["eval_mode"]) == key])

    def same_as(self, length, mode):
        scaling = self.model.encoding.scaling if ENCODINGS[self.encoding].has_strategies else "none"
        if scaling == "none" or (length, mode) not in self.measured:
            return None
        return self.measured[(length, mode)] if _same_rotation(self.model, scaling, length) else None


def run_unit(spec: Spec, encoding: str, seed: int, train_stream, text: EvalText, out: Path, device, progress,
             common: dict) -> dict:
    """Train and evaluate one encoding with one seed; returns the unit record (rows, curves, documents,
    checkpoint evaluations)."""
    label = f"{encoding}/s{seed}"
    torch.manual_seed(seed)
    model = GPT(spec.model_config(encoding))
    compile = spec.compile if spec.compile is not None else default_compile(device)
    strategies = strategies_of(encoding, spec.strategies)
    curve_steps = set(spec.curve_steps()) if spec.curve_points else set()
    checkpoints: list = []  # saved in the training checkpoint, so a resumed run keeps the evaluations made

    def on_step(step):
        if step in curve_steps and not any(r["step"] == step for r in checkpoints):
            for r in evaluate_checkpoint(model, spec, text, device, strategies):
                checkpoints.append({"step": step, "tokens_seen": step * spec.batch_size * spec.train_len, **r})

    trained = train(model, train_stream, spec.train_config(seed), checkpoint=out / "checkpoints" / f"{encoding}-s{seed}.pt",
                    device=device, progress=progress, desc=f"train {label}", compile=compile,
                    on_step=on_step if curve_steps else None, extra_state=checkpoints)
    base = {"encoding": encoding, "seed": seed, "train_len": spec.train_len, "train_loss": round(trained["train_loss"], 5),
            "train_steps": trained["train_steps"], "train_tokens": trained["train_tokens"],
            "train_seconds": round(trained["train_seconds"], 2),
            "train_tokens_per_s": round(trained["train_tokens_per_s"], 1), "finetune_steps": 0, "finetune_tokens": 0,
            "finetune_len": "", **common}
    rows, curves, documents = [], {}, []
    plain = _PlainRotation(model, encoding)
    for strategy in strategies:
        if strategy != "-":
            model.encoding.set_scaling(strategy)
        evaluated, per_position, docs = _evaluate_all(model, spec, text, device, progress, f"{label} {strategy}",
                                                      same_as=plain.same_as)
        if strategy == "none":
            plain.remember(evaluated, per_position, docs)
        rows += [{**base, "strategy": strategy, **r} for r in evaluated]
        documents += [{"strategy": strategy, **d} for d in docs]
        curves[strategy] = per_position
    if ENCODINGS[encoding].has_strategies:
        model.encoding.set_scaling("none")
        for strategy in spec.finetunes(seed):
            tuned = copy.deepcopy(model)
            factor = spec.finetune_len / spec.train_len
            tuned.encoding.set_scaling(strategy, factor=factor)
            ft_cfg = replace(spec.train_config(seed), steps=spec.finetune_steps, lr=spec.lr / 10,
                             warmup=max(1, spec.finetune_steps // 10))
            ft_cfg = replace(ft_cfg, batch_size=spec.finetune_batch())  # same tokens per step
            ft = train(tuned, train_stream, ft_cfg, length=spec.finetune_len,
                       checkpoint=out / "checkpoints" / f"{encoding}-s{seed}-ft-{strategy}.pt",
                       device=device, progress=progress, desc=f"fine-tune {label} {strategy}", compile=compile)
            evaluated, per_position, docs = _evaluate_all(tuned, spec, text, device, progress, f"{label} {strategy}+ft")
            name = f"{strategy}+ft"
            rows += [{**base, "strategy": name, "finetune_steps": spec.finetune_steps, "finetune_tokens": ft["train_tokens"],
                      "finetune_len": spec.finetune_len, **r} for r in evaluated]
            documents += [{"strategy": name, **d} for d in docs]
            curves[name] = per_position
    if distributed.is_main():
        save_atomic(model.state_dict(), out / "models" / f"{encoding}-s{seed}.pt")
    ident = {"encoding": encoding, "seed": seed}
    return {"encoding": encoding, "seed": seed, "rows": rows, "per_position": curves,
            "documents": [{**ident, **d} for d in documents], "checkpoints": [{**ident, **c} for c in checkpoints],
            "train_losses": [round(x, 4) for x in trained["losses"]], "encoding_state": encoding_state(model),
            "resumed_seconds": trained["resumed_seconds"]}


def _evaluation_key(row: dict) -> tuple[int, str, int | None]:
    stride = row.get("stride")
    return int(row["eval_len"]), row["eval_mode"], int(stride) if row["eval_mode"] == "sliding" else None


def _device_kind(device: str) -> str:
    return device.split(" ")[0].split(":")[0]  # "cpu (x86_64, 2 threads)" -> cpu; "cuda:0 (H200)" -> cuda


def extend(spec: Spec, out: Path | str, *, corpus: Corpus | str = "stdlib", device: str | None = None,
           progress: bool = True, log=print) -> list[dict]:
    """Add to a finished run the evaluations that ``spec`` asks for and its units lack, from the final
    weights the run kept (``out/models``), without training; returns the rows of the whole table.

    For a length or a sliding stride added to a preset after its run was made. ``spec`` must describe
    the same experiment apart from its evaluations (model, recipe, seeds, corpus and evaluation text
    equal: a new sliding window may not need more lead-in than the run's text has), it may only add
    evaluations, and it must run on the kind of device the run was evaluated on (a CUDA device
    evaluates in bfloat16, a CPU in float32: the rows of one table must not mix them). The new rows
    carry the unit's training fields and the extension's own machine and commit; each extended unit
    records what was added, by which commit, in how many seconds, and what was not (``extended``).
    Fine-tuned strategies (``+ft``) are not extended: their weights are not kept.

    Every unit is checked before any is written. While an extension is in progress ``config.json``
    names the spec it is extending to (``extending``): ``run`` refuses the folder until an
    ``extend`` with that spec has finished, and an interrupted ``extend`` continues where it stopped.
    One process only (not under ``torchrun``).
    """
    if distributed.active():
        raise PosencError("run --extend in one process (not under torchrun): it evaluates a few models")
    out = Path(out)
    config_path = out / "config.json"
    if not config_path.exists():
        raise PosencError(f"{out} holds no run to extend (no config.json)")
    previous = json.loads(config_path.read_text())
    device = resolve_device(device)
    corpus = load_corpus(corpus) if isinstance(corpus, str) else corpus
    text = evaluation_text(corpus, spec.eval_tokens, context=spec.eval_context())
    config = json.loads(json.dumps({"spec": spec.to_dict(), "corpus": corpus.describe(),
                                    "evaluation_text": text.describe()}))
    if previous.get("extending") not in (None, config["spec"]):
        raise PosencError(f"{out} is being extended to another spec (config.json 'extending'): finish that "
                          "extension first, with the same options")
    free = {"eval_lengths", "sliding", "notes"}
    differ = sorted(k for k in config["spec"] if k not in free and config["spec"][k] != previous["spec"].get(k))
    if differ:
        raise PosencError(f"{out} holds a different experiment ({', '.join(differ)} differ): extending adds "
                          "evaluations only")
    for part in ("corpus", "evaluation_text"):
        if config[part] != previous.get(part):
            raise PosencError(f"{out} was evaluated on a different {part.replace('_', ' ')} (a new sliding window "
                              "that needs more lead-in changes the text): re-run the experiment instead")
    wanted = spec.evaluations()
    paths = sorted((out / "units").glob("*.json"))
    missing_models = [p.stem for p in paths if not (out / "models" / f"{p.stem}.pt").exists()]
    if missing_models:
        raise PosencError(f"{out} kept no final weights for {', '.join(missing_models)} (models/): cannot extend")
    common = run_context(spec, corpus, device)
    plans = []  # every unit checked before any is written
    for path in paths:
        unit = migrate_unit(json.loads(path.read_text()))
        kinds = {_device_kind(r["device"]) for r in unit["rows"]}
        if kinds != {_device_kind(common["device"])}:
            raise PosencError(f"{path.stem} was evaluated on {', '.join(sorted(kinds))}, this extension would run "
                              f"on {common['device']}: extend on the same kind of device (--device)")
        strategies = list(dict.fromkeys(r["strategy"] for r in unit["rows"]))
        todo, not_extended = {}, []
        for strategy in strategies:
            have = {_evaluation_key(r) for r in unit["rows"] if r["strategy"] == strategy}
            dropped = have - set(wanted)
            if dropped:
                raise PosencError(f"{path.stem} {strategy} has evaluations the new spec drops "
                                  f"({sorted(dropped, key=str)}): extending only adds")
            missing = [e for e in wanted if e not in have]
            if strategy.endswith("+ft"):
                not_extended += [[strategy, *e] for e in missing]
            else:
                todo[strategy] = missing
        if any(todo.values()):
            plans.append((path, unit, strategies, todo, not_extended))
    if plans:
        write_atomic(config_path, json.dumps({**previous, "extending": config["spec"]}, indent=1))
    new_fields = ("device", "torch", "python", "posenc_lab", "git_commit", "schema")
    for path, unit, strategies, todo, not_extended in plans:
        encoding, seed = unit["encoding"], unit["seed"]
        t0 = time.perf_counter()
        log(f"extending {path.stem}: {sum(map(len, todo.values()))} evaluations")
        model = GPT(spec.model_config(encoding))
        state = torch.load(out / "models" / f"{encoding}-s{seed}.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        model.to(device).eval()
        plain = _PlainRotation(model, encoding)  # the 'none' strategy's new rows, reused as run_unit does
        for strategy in strategies:
            if not todo.get(strategy):
                continue
            if strategy != "-":
                model.encoding.set_scaling(strategy)
            base = {k: v for k, v in next(r for r in unit["rows"] if r["strategy"] == strategy).items()
                    if k not in ("eval_len", "eval_mode", "stride", "status", "loss", "perplexity", "bits_per_byte",
                                 "tokens", "eval_seconds")}
            base.update({k: common[k] for k in new_fields})  # the training is the unit's; the evaluation is ours
            evaluated, per_position, docs = _evaluate_all(model, spec, text, device, progress,
                                                          f"{path.stem} {strategy}", same_as=plain.same_as,
                                                          evaluations=todo[strategy])
            if strategy == "none":
                plain.remember(evaluated, per_position, docs)
            unit["rows"] += [{**base, **r} for r in evaluated]
            unit["documents"] = unit.get("documents", []) + [
                {"encoding": encoding, "seed": seed, "strategy": strategy, **d} for d in docs]
            unit.setdefault("per_position", {}).setdefault(strategy, {}).update(per_position)
        if ENCODINGS[encoding].has_strategies:
            model.encoding.set_scaling("none")
        order = {e: i for i, e in enumerate(wanted)}
        unit["rows"].sort(key=lambda r: (strategies.index(r["strategy"]), order[_evaluation_key(r)]))
        unit["extended"] = unit.get("extended", []) + [{
            "commit": common["git_commit"], "seconds": round(time.perf_counter() - t0, 1),
            "evaluations": [list(e) for e in dict.fromkeys(e for v in todo.values() for e in v)],
            "not_extended": not_extended}]
        write_atomic(path, json.dumps(unit))
    if any(p[4] for p in plans):
        log("fine-tuned strategies (+ft) were not extended: their weights are not kept")
    write_atomic(config_path, json.dumps(config, indent=1))
    rows = collect_rows(out)
    write_table(out, rows)
    return rows


def collect(out: Path, part: str = "rows") -> list[dict]:
    """Every row of every finished unit, in a stable order: the results (``rows``), the per-document
    losses (``documents``) or the checkpoint evaluations (``checkpoints``)."""
    units = sorted((out / "units").glob("*.json"))
    return [row for path in units for row in json.loads(path.read_text()).get(part, [])]


def collect_rows(out: Path) -> list[dict]:
    """The results table of a run folder from its units (:func:`collect`), in the current schema: the rows of a
    unit written by an older posenc_lab are read through :func:`~posenc_lab.schema.migrate`."""
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
    """Record ``config`` in ``out/config.json``; refuse a folder that holds a different experiment."""
    config_path = out / "config.json"
    if config_path.exists():
        previous = json.loads(config_path.read_text())
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


def run_context(spec, corpus: Corpus, device: torch.device) -> dict:
    """The columns every row of a run carries: what ran, on what, with which code, and the row's schema version
    (the spec itself is recorded once, in ``config.json``)."""
    return {"preset": spec.preset, "corpus": corpus.name, "corpus_sha256": corpus.meta["sha256"],
            "python": ".".join(map(str, sys.version_info[:3])), "device": device_name(device),
            "torch": torch.__version__, "posenc_lab": __version__, "git_commit": git_commit(),
            "schema": SCHEMA_VERSION}


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


def units_of(spec: Spec) -> list[tuple[str, int]]:
    """The ``(encoding, seed)`` units of ``spec``, seed-major: every encoding's first seed before any second seed,
    so that a run cut short compares all encodings."""
    return sorted(((e, s) for e in spec.encodings for s in spec.seeds_for(e)),
                  key=lambda u: (u[1], spec.encodings.index(u[0])))


def run(spec: Spec, out: Path | str, *, corpus: Corpus | str = "stdlib", device: str | None = None,
        progress: bool = True, only: list[tuple[str, int]] | None = None, log=print) -> list[dict]:
    """Run every unit of ``spec`` not yet finished in ``out`` (or only the units in ``only``: several processes
    can share one ``out``, each with its own units); returns the rows of the whole table."""
    out = Path(out)
    device = resolve_device(device)
    corpus = load_corpus(corpus) if isinstance(corpus, str) else corpus
    text = evaluation_text(corpus, spec.eval_tokens, context=spec.eval_context())
    prepare(out, {"spec": spec.to_dict(), "corpus": corpus.describe(), "evaluation_text": text.describe()})
    train_stream = corpus.stream("train")
    distributed.check_divisible(spec.batch_size)  # before any training, not when a unit gets there
    if spec.finetune:
        distributed.check_divisible(spec.finetune_batch())
    common = run_context(spec, corpus, device)
    units = units_of(spec)
    if only is not None:
        unknown = sorted(set(only) - set(units))
        if unknown:
            raise PosencError(f"units {unknown} are not in this run's {units}")
        units = [u for u in units if u in only]
    run_units(out, units, lambda e, s: run_unit(spec, e, s, train_stream, text, out, device, progress, common),
              after_each=lambda o: write_table(o, collect_rows(o)), log=log)
    rows = collect_rows(out)
    if distributed.is_main():
        write_table(out, rows)
    return rows
