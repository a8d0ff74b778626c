"""The experiment: train each encoding at one length, evaluate it at that length and far beyond.

One *unit* is one encoding and one seed: train (resuming from its checkpoint), then evaluate at
every length and mode (for RoPE, once per extrapolation strategy, and optionally after a brief
fine-tune at a longer length). Each finished unit is written to ``units/`` at once, so a run that
is interrupted, or cut short by a GPU time slice, continues from the units already finished when
the same command is run again. The tidy table (``results.csv`` / ``results.json``, columns
:data:`~posenc_lab.runner.COLUMNS`, in the schema of :mod:`posenc_lab.schema`) is rebuilt from the units after each
one; the spec is recorded once, in ``config.json``.
"""

from __future__ import annotations

from .extras import require

require("lab", "posenc_lab.experiment")

import copy
from dataclasses import replace
from pathlib import Path

import torch

from . import distributed
from .data import Corpus, EvalText, evaluation_text, load_corpus
from .encodings import ENCODINGS, strategies_of
from .errors import PosencError
from .evaluations import PlainRotation, encoding_state, evaluate_all, evaluate_checkpoint
from .model import GPT
from .runner import collect_rows, prepare, resolve_device, run_context, run_units, write_table
from .specs import Spec, units_of

# the experiment is made of these modules; code and chapters import their names from here as well
from .evaluations import curve_blocks  # noqa: F401
from .extension import extend  # noqa: F401
from .runner import (CHECKPOINT_COLUMNS, COLUMNS, DOCUMENT_COLUMNS, _csv, collect, default_device,  # noqa: F401
                     device_name, git_commit, write_atomic)
from .specs import ARTICLE_ENCODINGS, LONG_RUN_ENCODINGS, PRESETS, preset  # noqa: F401
from .train import default_compile, save_atomic, train


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
    """Fine-tune a copy of the RoPE ``model`` briefly at ``finetune_len`` (:class:`~posenc_lab.specs.FinetuningSpec`)
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
