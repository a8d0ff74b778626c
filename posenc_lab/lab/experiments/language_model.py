"""The language-model experiment: what a run is (its :class:`Spec`, the named presets, the units a spec trains) and
the run itself, which trains each encoding at one length and evaluates it at that length and far beyond.

A spec is composed of parts: the model's shape (:class:`~posenc_lab.lab.experiments.recipe.ModelSpec`) and the training recipe
(:class:`~posenc_lab.lab.experiments.recipe.TrainingSpec`), which passkey retrieval shares, the evaluation (:class:`EvaluationSpec`)
and the fine-tuning (:class:`FinetuningSpec`).

A *unit* is one encoding and one seed. The article's encodings (:data:`ARTICLE_ENCODINGS`) are run with
``seeds``, the newer relatives with ``other_seeds``; ``python -m posenc_lab presets`` describes the presets.

Each unit is trained (resuming from its checkpoint), then evaluated at
every length and mode (for RoPE, once per extrapolation strategy, and optionally after a brief
fine-tune at a longer length). Each finished unit is written to ``units/`` at once, so a run that
is interrupted, or cut short by a GPU time slice, continues from the units already finished when
the same command is run again. The tidy table (``results.csv`` / ``results.json``, columns
:data:`~posenc_lab.lab.run.units.COLUMNS`, in the schema of :mod:`posenc_lab.lab.run.schema`) is rebuilt from the units after each
one; the spec is recorded once, in ``config.json``.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.experiments.language_model")

import copy
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from posenc_lab.encodings import ENCODINGS, PRIMARY, strategies_of
from posenc_lab.errors import PosencError, check_positive, unknown_name
from posenc_lab.model import GPT
from posenc_lab.rope import ARTICLE_STRATEGIES
from posenc_lab.lab.data.corpora import Corpus, EvalText, evaluation_text, load_corpus
from posenc_lab.lab.experiments.recipe import Composed, ModelSpec, TrainingSpec, check_registered
from posenc_lab.lab.measure.perplexity import MODES, window_plan
from posenc_lab.lab.measure.perplexity_grid import PlainRotation, encoding_state, evaluate_all, evaluate_checkpoint
from posenc_lab.lab.run import distributed
from posenc_lab.lab.run.training import default_compile, save_atomic, train
from posenc_lab.lab.run.units import collect_rows, prepare, resolve_device, run_context, run_units, write_table

#: the article's encodings: run with every seed of ``Spec.seeds`` (the newer relatives with ``other_seeds``)
ARTICLE_ENCODINGS = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5")
#: the article's encodings but the learned table, which cannot score past its training length: the long runs' set
LONG_RUN_ENCODINGS = tuple(name for name in ARTICLE_ENCODINGS if not ENCODINGS[name].bounded)


@dataclass(frozen=True)
class EvaluationSpec:
    """How a trained model is evaluated: the lengths and modes on the evaluation text, and the checkpoint
    evaluations along training (the curve)."""

    eval_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    eval_tokens: int = 16384  # scored bytes of the evaluation text (data.evaluation_text), the same at every length
    modes: tuple[str, ...] = MODES
    stride: int = 128  # sliding stride at every length (min(stride, length)), unless `sliding` names the lengths
    sliding: tuple[tuple[int, int], ...] = ()  # (length, stride) pairs evaluated in sliding mode; () = every length
    eval_batch_size: int = 4
    curve_points: int = 0  # checkpoint evaluations along training: this many, evenly spaced in steps
    curve_factors: tuple[int, ...] = (1, 4)  # ... at these multiples of train_len, non-overlapping
    curve_tokens: int = 32768  # ... on this many bytes of the evaluation text: 8 blocks spread evenly over it

    def __post_init__(self):
        for name in ("eval_tokens", "stride", "eval_batch_size"):
            check_positive(name, getattr(self, name))
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
            window_plan(self.eval_tokens, length, mode, stride, self.lead_in())

    def evaluations(self) -> list[tuple[int, str, int | None]]:
        """``(length, mode, stride)`` of every evaluation of a trained model, in order."""
        sliding = dict(self.sliding) if self.sliding else {n: min(self.stride, n) for n in self.eval_lengths}
        return [(n, mode, sliding[n] if mode == "sliding" else None) for n in self.eval_lengths for mode in self.modes
                if mode == "nonoverlapping" or n in sliding]

    def lead_in(self) -> int:
        """Bytes of lead-in before the scored text: enough for every sliding window's ``length - stride``."""
        return max([n - s for n, mode, s in self.evaluations() if mode == "sliding"], default=0)

    def to_dict(self) -> dict:
        """The part as a plain dict."""
        return asdict(self)


@dataclass(frozen=True)
class FinetuningSpec:
    """RoPE strategies fine-tuned briefly at a longer length after training, then evaluated as ``<strategy>+ft``."""

    finetune: tuple[str, ...] = ()  # RoPE strategies to fine-tune briefly at finetune_len
    finetune_steps: int = 0
    finetune_len: int = 0
    finetune_seeds: tuple[int, ...] | None = None  # the RoPE seeds that are fine-tuned (default: all)

    def __post_init__(self):
        check_registered(strategies=self.finetune)
        if "dynamic-ntk" in self.finetune:
            raise PosencError("dynamic-ntk has no fixed factor to fine-tune with; fine-tune with pi, ntk or yarn")

    def to_dict(self) -> dict:
        """The part as a plain dict."""
        return asdict(self)


@dataclass
class Spec(Composed):
    """Everything that defines an experiment; a preset is a named Spec. The model's shape, the training recipe,
    the evaluation and the fine-tuning are its parts (:meth:`~posenc_lab.lab.experiments.recipe.Composed.override` sets a value
    of any part by its flat name)."""

    preset: str = "custom"
    encodings: tuple[str, ...] = PRIMARY
    strategies: tuple[str, ...] = ARTICLE_STRATEGIES  # RoPE extrapolation strategies evaluated
    seeds: tuple[int, ...] = (0,)  # for ARTICLE_ENCODINGS
    other_seeds: tuple[int, ...] = (0,)  # for the newer relatives (xpos, kerple, fire)
    model: ModelSpec = field(default_factory=ModelSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    finetuning: FinetuningSpec = field(default_factory=FinetuningSpec)
    compile: bool | None = None  # torch.compile the training step; default: on CUDA
    notes: str = ""

    def __post_init__(self):
        model, evaluation, tune = self.model, self.evaluation, self.finetuning
        check_registered(self.encodings, self.strategies)
        if evaluation.curve_points:
            longest = max(self.curve_lengths())
            if evaluation.curve_tokens % (8 * longest) or evaluation.curve_tokens > evaluation.eval_tokens:
                raise PosencError(f"curve_tokens ({evaluation.curve_tokens}) must be a multiple of 8 x the longest "
                                  f"curve length ({longest}) and at most eval_tokens")
        if not self.seeds or not evaluation.eval_lengths or not self.encodings or not evaluation.modes:
            raise PosencError("an experiment needs at least one encoding, seed, evaluation length and mode")
        if tune.finetune and (tune.finetune_steps <= 0 or tune.finetune_len <= model.train_len):
            raise PosencError("fine-tuning needs --finetune-steps > 0 and --finetune-len longer than the training length")
        if (model.d_model // model.n_head) % 2 and any(ENCODINGS[n].rotates_pairs for n in self.encodings):
            raise PosencError(f"RoPE and xPos rotate pairs: the head dimension d_model / n_head = "
                              f"{model.d_model // model.n_head} must be even")

    def curve_lengths(self) -> tuple[int, ...]:
        """The lengths at which the checkpoints along training are evaluated: ``curve_factors`` times ``train_len``."""
        return tuple(f * self.model.train_len for f in self.evaluation.curve_factors)

    def curve_steps(self) -> list[int]:
        """The training steps after which a checkpoint is evaluated: ``curve_points`` evenly spaced, the last one included."""
        points, steps = self.evaluation.curve_points, self.training.steps
        return sorted({round(steps * (k + 1) / points) for k in range(points)})

    def finetune_batch(self) -> int:
        """The fine-tuning batch: the training batch's tokens per step, in windows of ``finetune_len``."""
        return max(1, self.training.batch_size * self.model.train_len // self.finetuning.finetune_len)

    def seeds_for(self, encoding: str) -> tuple[int, ...]:
        """The seeds of ``encoding``: ``seeds`` for the article's encodings (:data:`ARTICLE_ENCODINGS`), ``other_seeds``
        for the others."""
        return self.seeds if encoding in ARTICLE_ENCODINGS else self.other_seeds

    def finetunes(self, seed: int) -> tuple[str, ...]:
        """The strategies fine-tuned for RoPE seed ``seed``."""
        tune = self.finetuning
        return tune.finetune if tune.finetune_seeds is None or seed in tune.finetune_seeds else ()


#: the article's evaluation (article-cpu and the long runs): to 16x the training length of 512 on 248 KiB,
#: non-overlapping at every length and sliding with stride L'/2 up to 4x, with checkpoint evaluations
ARTICLE_EVALUATION = EvaluationSpec(eval_lengths=(512, 1024, 2048, 8192), eval_tokens=31 * 8192, stride=512,
                                    sliding=((512, 256), (1024, 512), (2048, 1024)), eval_batch_size=4, curve_points=8)

#: the starting configurations of a run, by name (``python -m posenc_lab presets`` describes them)
PRESETS: dict[str, Spec] = {
    "ci": Spec(preset="ci", model=ModelSpec(n_layer=2, n_head=4, d_model=64, train_len=64),
               training=TrainingSpec(steps=40, batch_size=8, lr=3e-3, warmup=10, checkpoint_every=20),
               evaluation=EvaluationSpec(eval_lengths=(64, 128, 256), eval_tokens=1024, stride=32, eval_batch_size=4),
               notes="every encoding end to end in about a minute on 2 CPU cores; numbers mean nothing"),
    "cpu": Spec(preset="cpu", model=ModelSpec(n_layer=4, n_head=4, d_model=128, train_len=128),
                training=TrainingSpec(steps=1200, batch_size=16, lr=2e-3, warmup=100, checkpoint_every=200),
                evaluation=EvaluationSpec(eval_lengths=(128, 256, 512, 1024, 2048), eval_tokens=16384, stride=128,
                                          eval_batch_size=4),
                notes="the qualitative picture on 2 CPU cores: train at 128, evaluate to 16x"),
    "article-cpu": Spec(preset="article-cpu", encodings=PRIMARY, seeds=(0, 1, 2), other_seeds=(0, 1, 2),
                        model=ModelSpec(n_layer=4, n_head=4, d_model=128, train_len=512),
                        training=TrainingSpec(steps=700, batch_size=8, lr=2e-3, warmup=70, checkpoint_every=100),
                        evaluation=ARTICLE_EVALUATION,
                        finetuning=FinetuningSpec(finetune=("pi", "ntk", "yarn"), finetune_steps=200,
                                                  finetune_len=2048, finetune_seeds=(0,)),
                        notes="the article's lengths on 2 CPU cores: trained at 512 for 2.9 M bytes, judged at 2048 "
                              "(4x), evaluated to 8192 on 248 KiB of 34 test files (non-overlapping at 1x, 2x, 4x, "
                              "16x; sliding at 1x, 2x and 4x with stride L'/2, so every scored byte sees at least "
                              "L'/2 bytes), three seeds of every encoding, 8 checkpoint evaluations; about 3 hours"),
    "article-long": Spec(preset="article-long", encodings=LONG_RUN_ENCODINGS, seeds=(0, 1, 2),
                         model=ModelSpec(n_layer=4, n_head=4, d_model=128, train_len=512),
                         training=TrainingSpec(steps=2800, batch_size=8, lr=2e-3, warmup=280, checkpoint_every=100),
                         evaluation=replace(ARTICLE_EVALUATION, curve_points=16),
                         notes="article-cpu's model and recipe with 4x its training tokens (11.5 M bytes) for the "
                               "article's encodings, three seeds, evaluated as article-cpu, 16 checkpoint "
                               "evaluations; many hours on 2 CPU cores: run it in the background, it resumes"),
    "colab": Spec(preset="colab", model=ModelSpec(n_layer=6, n_head=6, d_model=384, train_len=512),
                  training=TrainingSpec(steps=1500, batch_size=16, lr=1e-3, warmup=150, checkpoint_every=250),
                  evaluation=EvaluationSpec(eval_lengths=(512, 1024, 2048, 4096, 8192), eval_tokens=32768, stride=256,
                                            eval_batch_size=2),
                  notes="sized for a Colab T4 in about 30 minutes"),
    "paper": Spec(preset="paper", seeds=(0, 1, 2), model=ModelSpec(n_layer=12, n_head=8, d_model=512, train_len=512),
                  training=TrainingSpec(steps=4000, batch_size=64, lr=6e-4, warmup=300, checkpoint_every=250),
                  evaluation=EvaluationSpec(eval_lengths=(512, 1024, 2048, 4096, 8192, 16384), eval_tokens=65536,
                                            stride=512, eval_batch_size=4),
                  notes="the article's model (12 layers, 8 heads, d_model 512, trained at 512) on a GPU"),
}
# the article's own shape in one call of a lent GPU (scripts/device_article_shape.sh): 12 layers, 8 heads, width 512,
# trained at 512 on a fixed byte budget (the same on any card), judged on the headline's evaluation text
PRESETS["article-shape"] = Spec(
    preset="article-shape", encodings=LONG_RUN_ENCODINGS, seeds=(0, 1, 2),
    model=ModelSpec(n_layer=12, n_head=8, d_model=512, train_len=512),
    training=TrainingSpec(steps=560, batch_size=32, lr=6e-4, warmup=56, checkpoint_every=140),
    evaluation=replace(ARTICLE_EVALUATION, curve_points=0),
    notes="the article's model shape (12 layers, 8 heads, d_model 512, trained at 512) on 9.2 M training bytes per "
          "unit (batch 32 x 560 steps, 0.8 of the headline's bytes), the article's encodings x 3 seeds, evaluated "
          "as article-cpu (to 16x, both modes, every RoPE strategy) on the same text; sized for one 540-second call "
          "of an H100 at 30 % MFU (scripts/device_article_shape.sh), far too slow for a CPU")
# the same model, tokens and evaluation in twice as many steps of half the batch: the recipe's own effect on the
# verdicts (warm-up and checkpoints stretched alike, so the checkpoint evaluations fall on the same tokens)
PRESETS["article-long-b4"] = PRESETS["article-long"].override(
    preset="article-long-b4", batch_size=4, steps=5600, warmup=560, checkpoint_every=200,
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
    finetuning=FinetuningSpec(),
    notes="the old sinusoidal amplitude (sinusoidal-small, RMS 0.02, tokens unscaled) with article-cpu's recipe "
          "and evaluation, seed 0 only: compare it with article-cpu's sinusoidal seed 0; about 6 minutes")


# what today's models run, trained with article-cpu's recipe and evaluation (plain RoPE and ALiBi are
# article-cpu's own units: same batches, same bytes), three seeds each. Plain RoPE is trained again here so that
# Llama 3's scaling (inference only) is evaluated on every seed: article-cpu keeps the weights of seed 0 only.
# Its rows also check that a run reproduces: same seed, same batches, same bytes as article-cpu's RoPE.
PRESETS["variants-cpu"] = PRESETS["article-cpu"].override(
    preset="variants-cpu",
    encodings=("rope", "rope-partial", "p-rope", "rope-b500", "rope-b500k", "rope-nope", "rope-random",
               "learned-random"),
    strategies=("none", "yarn", "llama3"),
    seeds=(0, 1, 2), other_seeds=(0, 1, 2), finetuning=FinetuningSpec(), curve_points=0,
    notes="partial rotary, p-RoPE, bases 500 and 500,000, a NoPE last layer and randomized positions (RoPE and "
          "learned) with article-cpu's recipe and evaluation, three seeds each, and plain RoPE again (none, YaRN "
          "and Llama 3's scaling, on every seed); about 2 hours 15 minutes on 2 CPU cores")


# the methods of 2024-26 with article-cpu's model, recipe and evaluation, three seeds each: their baselines (plain
# RoPE with and without YaRN, ALiBi, NoPE) are article-cpu's own units, trained on the same batches and bytes. The
# four core methods (FoX, SSMax on RoPE, a local/global mix, CoPE) come first, so a run cut short compares them.
PRESETS["recent-cpu"] = PRESETS["article-cpu"].override(
    preset="recent-cpu",
    encodings=("fox", "ssmax-rope", "gemma3", "cope", "ssmax", "fope", "nope-temp", "irope", "rnope-swa"),
    strategies=("none",), seeds=(0, 1, 2), other_seeds=(0, 1, 2), finetuning=FinetuningSpec(), curve_points=0,
    notes="SSMax (on NoPE and RoPE), FoPE, FoX, CoPE, Llama 4's temperature, iRoPE, Gemma 3's and RNoPE-SWA's "
          "local/global layers with article-cpu's recipe and evaluation, three seeds each; many hours on 2 CPU cores: "
          "run it in the background, it resumes")

# Three methods that move position past the softmax's fixed form, under the same recipe, data and evaluation: the
# cheapest to train first (stick-breaking, then PaTH, then DAPE on KERPLE), so a run cut short has the most units.
PRESETS["past-softmax-cpu"] = PRESETS["recent-cpu"].override(
    preset="past-softmax-cpu", encodings=("stick-breaking", "path", "dape-kerple"),
    notes="stick-breaking attention, PaTH and DAPE on KERPLE with article-cpu's recipe and evaluation, three seeds "
          "each, compared with article-cpu's ALiBi and RoPE (with YaRN) on the same batches; many hours on 2 CPU "
          "cores: run it in the background, it resumes")


def preset(name: str, **overrides) -> Spec:
    """The spec of preset ``name`` (a key of :data:`PRESETS`), with the ``overrides`` that are not ``None``, each
    by its flat name (``steps``, ``eval_lengths``, ...: :meth:`~posenc_lab.lab.experiments.recipe.Composed.override`)."""
    if name not in PRESETS:
        raise unknown_name("preset", name, PRESETS)
    return PRESETS[name].override(**overrides)


def units_of(spec: Spec) -> list[tuple[str, int]]:
    """The ``(encoding, seed)`` units of ``spec``, seed-major: every encoding's first seed before any second seed,
    so that a run cut short compares all encodings."""
    return sorted(((e, s) for e in spec.encodings for s in spec.seeds_for(e)),
                  key=lambda u: (u[1], spec.encodings.index(u[0])))


def run_unit(spec: Spec, encoding: str, seed: int, train_stream, text: EvalText, out: Path, device, progress,
             common: dict) -> dict:
    """Train and evaluate one encoding with one seed; returns the unit record (rows, curves, documents,
    checkpoint evaluations)."""
    label = f"{encoding}/s{seed}"
    torch.manual_seed(seed)
    model = GPT(spec.model.config(encoding))
    compile = spec.compile if spec.compile is not None else default_compile(device)
    strategies = strategies_of(encoding, spec.strategies)
    train_len = spec.model.train_len
    curve_steps = set(spec.curve_steps()) if spec.evaluation.curve_points else set()
    checkpoints: list = []  # saved in the training checkpoint, so a resumed run keeps the evaluations made

    def on_step(step):
        if step in curve_steps and not any(r["step"] == step for r in checkpoints):
            for r in evaluate_checkpoint(model, spec, text, device, strategies):
                checkpoints.append({"step": step, "tokens_seen": step * spec.training.batch_size * train_len, **r})

    trained = train(model, train_stream, spec.training.config(seed),
                    checkpoint=out / "checkpoints" / f"{encoding}-s{seed}.pt",
                    device=device, progress=progress, desc=f"train {label}", compile=compile,
                    on_step=on_step if curve_steps else None, extra_state=checkpoints)
    base = {"encoding": encoding, "seed": seed, "train_len": train_len, "train_loss": round(trained["train_loss"], 5),
            "train_steps": trained["train_steps"], "train_tokens": trained["train_tokens"],
            "train_seconds": round(trained["train_seconds"], 2),
            "train_tokens_per_s": round(trained["train_tokens_per_s"], 1), "finetune_steps": 0, "finetune_tokens": 0,
            "finetune_len": "", **common}
    rows, curves, documents = [], {}, []
    plain = PlainRotation(model, encoding)
    for strategy in strategies:
        if strategy != "-":
            model.encoding.set_scaling(strategy)
        evaluated, per_position, docs = evaluate_all(model, spec, text, device, progress, f"{label} {strategy}",
                                                     same_as=plain.same_as)
        if strategy == "none":
            plain.remember(evaluated, per_position, docs)
        rows += [{**base, "strategy": strategy, **r} for r in evaluated]
        documents += [{"strategy": strategy, **d} for d in docs]
        curves[strategy] = per_position
    if ENCODINGS[encoding].has_strategies:
        model.encoding.set_scaling("none")
        for strategy in spec.finetunes(seed):
            _finetune(model, spec, strategy, seed, train_stream, text, out, device, progress, compile, base,
                      (rows, curves, documents))
    if distributed.is_main():
        save_atomic(model.state_dict(), out / "models" / f"{encoding}-s{seed}.pt")
    ident = {"encoding": encoding, "seed": seed}
    return {"encoding": encoding, "seed": seed, "rows": rows, "per_position": curves,
            "documents": [{**ident, **d} for d in documents], "checkpoints": [{**ident, **c} for c in checkpoints],
            "train_losses": [round(x, 4) for x in trained["losses"]], "encoding_state": encoding_state(model),
            "resumed_seconds": trained["resumed_seconds"], "peak_gib": peak_gib(device)}


def peak_gib(device) -> float | None:
    """The most GPU memory this process has held (GiB) on ``device``; None on the CPU."""
    device = torch.device(device)
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _finetune(model, spec: Spec, strategy: str, seed: int, train_stream, text: EvalText, out: Path, device, progress,
              compile: bool, base: dict, record: tuple[list, dict, list]) -> None:
    """Fine-tune a copy of the RoPE ``model`` briefly at ``finetune_len`` (:class:`~posenc_lab.lab.experiments.language_model.FinetuningSpec`)
    with ``strategy``, evaluate it, and add its rows, curves and document rows (strategy ``<strategy>+ft``) to
    ``record``."""
    rows, curves, documents = record
    encoding, label = base["encoding"], f"{base['encoding']}/s{seed}"
    steps, length = spec.finetuning.finetune_steps, spec.finetuning.finetune_len
    tuned = copy.deepcopy(model)
    tuned.encoding.set_scaling(strategy, factor=length / spec.model.train_len)
    ft_cfg = replace(spec.training.config(seed), steps=steps, lr=spec.training.lr / 10, warmup=max(1, steps // 10),
                     batch_size=spec.finetune_batch())  # same tokens per step
    ft = train(tuned, train_stream, ft_cfg, length=length,
               checkpoint=out / "checkpoints" / f"{encoding}-s{seed}-ft-{strategy}.pt",
               device=device, progress=progress, desc=f"fine-tune {label} {strategy}", compile=compile)
    evaluated, per_position, docs = evaluate_all(tuned, spec, text, device, progress, f"{label} {strategy}+ft")
    name = f"{strategy}+ft"
    rows += [{**base, "strategy": name, "finetune_steps": steps, "finetune_tokens": ft["train_tokens"],
              "finetune_len": length, **r} for r in evaluated]
    documents += [{"strategy": name, **d} for d in docs]
    curves[name] = per_position


def run(spec: Spec, out: Path | str, *, corpus: Corpus | str = "stdlib", device: str | None = None,
        progress: bool = True, only: list[tuple[str, int]] | None = None, log=print) -> list[dict]:
    """Run every unit of ``spec`` not yet finished in ``out`` (or only the units in ``only``: several processes
    can share one ``out``, each with its own units); returns the rows of the whole table."""
    out = Path(out)
    device = resolve_device(device)
    corpus = load_corpus(corpus) if isinstance(corpus, str) else corpus
    text = evaluation_text(corpus, spec.evaluation.eval_tokens, lead_in=spec.evaluation.lead_in())
    prepare(out, {"spec": spec.to_dict(), "corpus": corpus.describe(), "evaluation_text": text.describe()})
    train_stream = corpus.stream("train")
    distributed.check_divisible(spec.training.batch_size)  # before any training, not when a unit gets there
    if spec.finetuning.finetune:
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
