"""Does a language model *use* the context past its training length?

Perplexity at a length ``L' > L`` can stay flat while the model ignores everything beyond ``L``
(Press et al. 2022, appendix B, ask this of ALiBi; Hu et al. 2024 and Fang et al. 2025 show that
perplexity need not track long-context ability). A context run (``python -m posenc_lab context``) asks it
directly of the models whose perplexity the book reports, without retraining them:

* **the gain from context beyond the reach** (:mod:`posenc_lab.lab.measure.far_context`): the same targets scored with full
  attention and with attention limited to the training length;
* **a passkey inside the language model** (:mod:`posenc_lab.lab.measure.passkey`): a Python assignment planted far back
  and asked for at the end of the window;
* **attention sinks** (:func:`~posenc_lab.lab.measure.streaming.streaming_losses`): one stream read through a rolling cache
  of the training length, with and without the first tokens kept.

This module holds the run (:class:`ContextSpec`, :func:`run`, :func:`report`) and re-exports the names of the
two measurement modules (``context.gain``, ``context.passkey_windows``, ``context.gain_table``, ...).
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.experiments.context")

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from posenc_lab.encodings import strategies_of
from posenc_lab.errors import PosencError, check_positive, unknown_name
from posenc_lab.rope import ARTICLE_STRATEGIES, ROPE_SCALINGS
from posenc_lab.lab.experiments.recipe import Composed
from posenc_lab.lab.measure.far_context import NGRAM, THRESHOLD, gain, gain_table, windowed_verdicts
from posenc_lab.lab.measure.passkey import PasskeyText, passkey_scores, passkey_table, passkey_windows
from posenc_lab.lab.measure.perplexity import evaluate
from posenc_lab.lab.measure.streaming import streaming_losses
from posenc_lab.lab.run.schema import is_context_run


# --------------------------------------------------------------------------------------------- the runner


@dataclass
class ContextSpec(Composed):
    """Everything that defines a context experiment on the trained models of a language-model run (which records
    the model, the training and the evaluation text: the spec has no parts of its own)."""

    preset: str = "custom"
    run: str = "article-cpu"  # a run folder (--out of ``python -m posenc_lab run``) or a committed run's name
    encodings: tuple[str, ...] = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5", "xpos", "kerple", "fire")
    strategies: tuple[str, ...] = ARTICLE_STRATEGIES
    seeds: tuple[int, ...] = (0, 1, 2)
    lengths: tuple[int, ...] = (1024, 2048, 8192)  # the gain at these lengths
    reach: int = 0  # keys each query may attend to in the limited evaluation; 0: the run's training length
    blocks: int = 8  # ... on this many blocks of the run's evaluation text, spread evenly over it
    block_tokens: int = 8192
    threshold: float = THRESHOLD
    ngram: int = NGRAM
    passkey_multiples: tuple[int, ...] = (1, 2, 4, 8)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 20  # passkey windows per (length, depth) cell and seed
    eval_batch_size: int = 4
    sink_encodings: tuple[str, ...] = ("nope", "rope", "alibi")  # streamed through a rolling cache
    sink_counts: tuple[int, ...] = (0, 4)  # ... without and with attention sinks
    stream_blocks: int = 2  # ... over the first this many blocks, each one stream of block_tokens + 1 bytes
    notes: str = ""

    def __post_init__(self):
        for name in ("blocks", "block_tokens", "trials", "eval_batch_size", "ngram", "stream_blocks"):
            check_positive(name, getattr(self, name))
        if self.reach < 0:
            raise PosencError(f"reach must be >= 0 (0: the training length), got {self.reach}")
        for name in self.strategies:
            if name not in ROPE_SCALINGS:
                raise unknown_name("RoPE scaling", name, ROPE_SCALINGS)
        if any(d < 0 or d > 1 for d in self.depths):
            raise PosencError(f"passkey depths must lie in [0, 1], got {self.depths}")
        for length in self.lengths:
            if self.block_tokens % length:
                raise PosencError(f"block_tokens ({self.block_tokens}) must be a multiple of every length ({length})")
        if self.stream_blocks > self.blocks or any(k < 0 for k in self.sink_counts):
            raise PosencError("stream_blocks must be at most blocks, and sink counts >= 0")


#: the starting configurations of a context experiment, by name
CONTEXT_PRESETS: dict[str, ContextSpec] = {
    "context-ci": ContextSpec(preset="context-ci", run="", encodings=("rope", "alibi", "learned"),
                              strategies=("none", "yarn"), seeds=(0,), lengths=(128,), blocks=2, block_tokens=256,
                              passkey_multiples=(2, 4),
                              depths=(0.0, 1.0), trials=2, sink_encodings=("rope",), sink_counts=(0, 2), stream_blocks=1,
                              notes="end to end in seconds on a toy run; numbers mean nothing"),
    "context-cpu": ContextSpec(preset="context-cpu",
                               notes="the article-cpu models, no retraining: the gain from context past 512 bytes at "
                                     "1k, 2k and 8k on 8 blocks of 8 KiB of the test text, and a Python passkey at "
                                     "1x to 8x, every encoding and RoPE strategy, three seeds"),
    "context-long": ContextSpec(preset="context-long", run="article-long",
                                encodings=("nope", "sinusoidal", "rope", "alibi", "t5"),
                                notes="context-cpu's measurements on the article-long models (four times the "
                                      "training tokens, the article's five encodings), no retraining"),
    "context-long-b4": ContextSpec(preset="context-long-b4", run="article-long-b4",
                                   encodings=("nope", "sinusoidal", "rope", "alibi", "t5"),
                                   notes="context-long's measurements on the article-long-b4 models, no retraining"),
    "context-prose-long-b4": ContextSpec(preset="context-prose-long-b4", run="prose-long-b4",
                                         encodings=("nope", "sinusoidal", "rope", "alibi", "t5"),
                                         passkey_multiples=(),
                                         notes="context-long's gain and streams on the prose-long-b4 models; no "
                                               "passkey (it plants a Python assignment, and prose has none)"),
    "context-prose-long": ContextSpec(preset="context-prose-long", run="prose-long",
                                      encodings=("nope", "sinusoidal", "rope", "alibi", "t5"), passkey_multiples=(),
                                      notes="context-long's gain and streams on the prose-long models; no passkey"),
    "context-variants": ContextSpec(preset="context-variants", run="variants-cpu",
                                    encodings=("rope", "rope-partial", "p-rope", "rope-b500", "rope-b500k", "rope-nope",
                                               "rope-random", "learned-random"),
                                    strategies=("none", "yarn", "llama3"), passkey_multiples=(), sink_encodings=(),
                                    notes="the gain from context past 512 bytes on the variants-cpu models (chapter "
                                          "12), every seed, no retraining; no passkey (article-cpu's budget teaches "
                                          "no model to copy one) and no streams"),
    "context-recent": ContextSpec(preset="context-recent", run="recent-cpu",
                                  encodings=("fox", "ssmax-rope", "gemma3", "cope", "ssmax", "fope", "nope-temp", "irope",
                                             "rnope-swa"), strategies=("none",), passkey_multiples=(), sink_encodings=(),
                                  notes="the gain from context past 512 bytes on the recent-cpu models (the methods "
                                        "of 2024-26), every seed, no retraining; no passkey and no streams"),
    "context-past-softmax": ContextSpec(preset="context-past-softmax", run="past-softmax-cpu",
                                        encodings=("stick-breaking", "path", "dape-kerple"), strategies=("none",),
                                        passkey_multiples=(), sink_encodings=(),
                                        notes="context-recent's measurement on the past-softmax-cpu models "
                                              "(stick-breaking, PaTH, DAPE on KERPLE), every seed, no retraining"),
}


def context_preset(name: str, **overrides) -> ContextSpec:
    """The spec of context preset ``name`` with the ``overrides`` that are not ``None``."""
    if name not in CONTEXT_PRESETS:
        raise unknown_name("context preset", name, CONTEXT_PRESETS)
    return CONTEXT_PRESETS[name].override(**overrides)


GAIN_COLUMNS = ["encoding", "strategy", "seed", "train_len", "eval_len", "reach", "status", "tokens", "loss_full",
                "loss_reach", "far_tokens", "far_loss_full", "far_loss_reach", "gain", "share_better", "share_worse",
                "share_repeats", "gain_repeats", "gain_others", "better_repeats", "threshold", "ngram", "run",
                "git_commit"]
STREAM_COLUMNS = ["encoding", "seed", "train_len", "sinks", "window", "tokens", "loss", "loss_full", "first_token_mass",
                  "run", "git_commit"]
PASSKEY_COLUMNS = ["encoding", "strategy", "seed", "train_len", "eval_len", "multiple", "depth", "status", "trials",
                   "correct", "accuracy", "ci_low", "ci_high", "digit_accuracy", "first_digit_accuracy",
                   "choice_accuracy", "distance_mean", "run", "git_commit"]


def _load_run(spec: ContextSpec):
    """``(config, model loader)`` of the spec's run: a folder, else a committed run's name."""
    from posenc_lab.lab import results
    from posenc_lab.lab.run import schema

    def checked(config):
        if "corpus" not in config or is_context_run(config):  # a retrieval run has no corpus, a context run "trained"
            raise PosencError(f"{spec.run!r} is not a language-model run (python -m posenc_lab run): it has no "
                              "trained models to measure")
        return config

    folder = Path(spec.run)
    if (folder / "config.json").is_file():
        config = checked(schema.read_config(folder / "config.json"))
        return config, lambda enc, seed, **o: results.model_from_run(folder, enc, seed=seed, **o)
    if spec.run in results.RUNS:
        config = checked(results.load_config_only(spec.run)[2])
        return config, lambda enc, seed, **o: results.model(spec.run, enc, seed=seed, **o)
    raise PosencError(f"{spec.run!r} is neither a run folder (with config.json) nor a committed run "
                      f"({', '.join(results.RUNS)})")


def blocks_of(text, spec: ContextSpec) -> list[int]:
    """Stream offsets of the ``spec.blocks`` blocks the gain is measured on, spread evenly over the scored text."""
    slots = text.tokens // spec.block_tokens
    if slots < spec.blocks:
        raise PosencError(f"the run's evaluation text holds {slots} blocks of {spec.block_tokens} bytes; "
                          f"{spec.blocks} were asked for")
    step = (slots - 1) / max(1, spec.blocks - 1)
    return [text.lead_in + round(k * step) * spec.block_tokens for k in range(spec.blocks)]


def _batch_size(spec: ContextSpec, length: int) -> int:
    """Windows per forward pass at ``length``: ``eval_batch_size`` up to 2,048 bytes, fewer beyond."""
    return max(1, spec.eval_batch_size * 2048 // max(length, 2048))


def run_context_unit(spec: ContextSpec, encoding: str, seed: int, load, train_len: int, text, passkey: PasskeyText,
                     device, progress: bool, common: dict) -> dict:
    """The gain and the passkey for one trained model (every RoPE strategy on the RoPE model), and its streams."""
    gains, keys = [], []
    for strategy in strategies_of(encoding, spec.strategies):
        model = load(encoding, seed, **({"scaling": strategy} if strategy != "-" else {}))
        base = {"encoding": encoding, "strategy": strategy, "seed": seed, "train_len": train_len, **common}
        gains += _gain_rows(model, spec, text, base, device, progress)
        keys += _passkey_rows(model, spec, passkey, base, device, progress)
    streams = []
    if encoding in spec.sink_encodings:
        streams = _stream_rows(load(encoding, seed), spec, text, encoding, seed, train_len, device, progress, common)
    return {"encoding": encoding, "seed": seed, "rows": gains, "passkey": keys, "stream": streams}


def _gain_rows(model, spec: ContextSpec, text, base: dict, device, progress: bool) -> list[dict]:
    """The gain rows of one model (named by ``base``) at every length of ``spec``."""
    reach = spec.reach or base["train_len"]
    rows = []
    for length in spec.lengths:
        r = gain(model, text.stream, length=length, reach=reach, blocks=blocks_of(text, spec),
                 block_tokens=spec.block_tokens, threshold=spec.threshold, ngram=spec.ngram,
                 batch_size=_batch_size(spec, length), device=device, progress=progress,
                 desc=f"{base['encoding']}/{base['strategy']}/s{base['seed']} {length}")
        r.pop("per_target", None)
        rows.append({**base, "eval_len": length, "reach": reach, "threshold": spec.threshold, "ngram": spec.ngram, **r})
    return rows


def _passkey_rows(model, spec: ContextSpec, passkey: PasskeyText, base: dict, device, progress: bool) -> list[dict]:
    """The passkey rows of one model (named by ``base``): one per multiple of the training length and depth."""
    rows = []
    cells = [(m, d) for m in spec.passkey_multiples for d in spec.depths]
    for multiple, depth in tqdm(cells, desc=f"passkey {base['encoding']}/{base['strategy']}/s{base['seed']}",
                                disable=not progress, leave=False):
        length = multiple * base["train_len"]
        # the same windows for every encoding and strategy of a seed, other windows for each seed (so that the
        # pooled interval counts independent windows)
        g = torch.Generator().manual_seed(1_000_003 * (base["seed"] + 1) + 7919 * length + round(1000 * depth))
        w = passkey_windows(passkey, spec.trials, length, depth, g)
        rows.append({**base, "eval_len": length, "multiple": multiple, "depth": depth,
                     "distance_mean": float(w["distance"].double().mean()),
                     **passkey_scores(model, w, batch_size=_batch_size(spec, length), device=device)})
    return rows


def _stream_rows(model, spec: ContextSpec, text, encoding: str, seed: int, train_len: int, device, progress: bool,
                 common: dict) -> list[dict]:
    """One row per sink count: the loss of the first ``stream_blocks`` blocks read as streams through a rolling
    cache of the training length, beside their loss with full attention and the weight on token 0."""
    from posenc_lab.lab.measure.diagnostics import first_token_mass

    starts = blocks_of(text, spec)[: spec.stream_blocks]
    full = list(_full_losses(model, text.stream, starts, spec, device))
    sample = torch.stack([text.stream[b : b + train_len] for b in starts]).long()
    mass = float(first_token_mass(model, sample.to(device)).mean())  # at the training length, every layer and head
    rows = []
    for sinks in spec.sink_counts:
        window = train_len - sinks  # the cache spans the training length
        losses = torch.cat([streaming_losses(model, text.stream[b : b + spec.block_tokens + 1], window=window,
                                             sinks=sinks, device=device, progress=progress,
                                             desc=f"stream {encoding}/s{seed} sinks {sinks}") for b in starts])
        rows.append({"encoding": encoding, "seed": seed, "train_len": train_len, "sinks": sinks, "window": window,
                     "tokens": int(losses.numel()), "loss": float(losses.mean()),
                     "loss_full": float(torch.cat(full).mean()), "first_token_mass": mass, **common})
    return rows


def _full_losses(model, stream, starts, spec: ContextSpec, device):
    """Each block's losses with full attention over one window of ``block_tokens`` (the stream's baseline)."""
    for b in starts:
        r = evaluate(model, stream, length=spec.block_tokens, tokens=spec.block_tokens, lead_in=b, device=device,
                     batch_size=1, per_target=True)
        yield r["per_target"] if r["status"] == "ok" else torch.full((spec.block_tokens,), math.nan, dtype=torch.float64)


def write_tables(out: Path, gains: list[dict], keys: list[dict], streams: list[dict] = ()) -> None:
    """``gain``, ``passkey`` and ``stream`` tables, each as ``.csv`` and ``.json``, atomically."""
    from posenc_lab.lab.run.units import _csv, write_atomic

    for name, rows, columns in (("gain", gains, GAIN_COLUMNS), ("passkey", keys, PASSKEY_COLUMNS),
                                ("stream", list(streams), STREAM_COLUMNS)):
        write_atomic(out / f"{name}.csv", _csv(rows, columns))
        write_atomic(out / f"{name}.json", json.dumps(rows, indent=1))


def units_of(spec: ContextSpec) -> list[tuple[str, int]]:
    """The ``(encoding, seed)`` units of ``spec`` that its run trained, seed-major."""
    trained = _load_run(spec)[0]["spec"]["encodings"]
    return [(e, s) for s in spec.seeds for e in spec.encodings if e in trained]


def run(spec: ContextSpec, out: Path | str, *, device: str | None = None, progress: bool = True,
        corpus: str | None = None, only: list[tuple[str, int]] | None = None,
        log=print) -> tuple[list[dict], list[dict]]:
    """Every unit of ``spec`` not yet finished in ``out`` (resumable per trained model), or only the units in
    ``only`` (processes that share ``out`` split the work); returns the gain and passkey rows of every finished
    unit. ``corpus`` loads the run's corpus from elsewhere (``stdlib:PATH``, a folder); its SHA-256 must be the
    one the run recorded."""
    from posenc_lab import __version__
    from posenc_lab.lab.data.corpora import evaluation_text, load_corpus
    from posenc_lab.lab.experiments.language_model import Spec
    from posenc_lab.lab.run.schema import migrate_config
    from posenc_lab.lab.run.units import collect, git_commit, prepare, resolve_device, run_units

    out = Path(out)
    device = resolve_device(device)
    config, load = _load_run(spec)
    run_spec = Spec.from_dict(migrate_config(config)["spec"])  # a language-model run: _load_run checked it
    train_len = run_spec.model.train_len
    corpus = load_corpus(corpus or config.get("corpus", {}).get("corpus", "stdlib"))
    recorded = config.get("corpus", {}).get("sha256")
    if recorded and corpus.meta.get("sha256") != recorded:
        raise PosencError(f"this machine's {corpus.name!r} corpus differs from the one the run trained and was "
                          "evaluated on (its SHA-256 differs): the gain would be measured on other text")
    reach = spec.reach or train_len
    if any(length <= reach for length in spec.lengths):
        raise PosencError(f"every length of the gain must exceed the reach ({reach}); got {spec.lengths}")
    if spec.sink_encodings and max(spec.sink_counts, default=0) >= train_len:
        raise PosencError(f"the sink counts {spec.sink_counts} must be below the training length {train_len}")
    text = evaluation_text(corpus, run_spec.evaluation.eval_tokens, lead_in=run_spec.evaluation.lead_in())
    passkey = PasskeyText([body for _, body in corpus.documents["test"]]) if spec.passkey_multiples else None
    prepare(out, {"spec": spec.to_dict(), "trained": config["spec"], "corpus": corpus.describe(),
                  "evaluation_text": text.describe()})
    common = {"run": spec.run, "git_commit": git_commit(), "posenc_lab": __version__, "torch": torch.__version__}
    units = [(e, s) for s in spec.seeds for e in spec.encodings if e in run_spec.encodings]
    if only is not None:
        unknown = sorted(set(only) - set(units))
        if unknown:
            raise PosencError(f"units {unknown} are not in this experiment's {units}")
        units = [u for u in units if u in only]
    run_units(out, units, lambda e, s: run_context_unit(spec, e, s, load, train_len, text, passkey, device,
                                                          progress, common),
              after_each=lambda o: write_tables(o, collect(o), collect(o, "passkey"), collect(o, "stream")), log=log)
    gains, keys = collect(out), collect(out, "passkey")
    write_tables(out, gains, keys, collect(out, "stream"))
    return gains, keys


# --------------------------------------------------------------------------------------------- the report


def report(out: Path | str) -> str:
    """The text report of a context run folder: the gain table and the passkey table."""
    out = Path(out)
    if not (out / "gain.json").exists():
        raise PosencError(f"{out} has no gain.json: is it the --out folder of a context run?")
    gains = json.loads((out / "gain.json").read_text())
    keys = json.loads((out / "passkey.json").read_text())
    if not gains:
        raise PosencError(f"{out} has no finished unit yet")
    first = gains[0]
    lines = [f"# {out.name}: the models of {first['run']}, reach {first['reach']} keys, commit {first['git_commit'][:12]}",
             "", "gain from context beyond the reach (nats per far byte; > 0: the far context helps), mean over seeds:",
             "", "| label | length | loss, full | loss, reach | gain | sd | better | worse | far repeats | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (label, length), r in gain_table(gains).iterrows():
        lines.append(f"| {label} | {length} | {r['far_loss_full']:.3f} | {r['far_loss_reach']:.3f} | {r['gain']:+.3f} | "
                     f"{r['gain_sd']:.3f} | {r['share_better']:.1%} | {r['share_worse']:.1%} | "
                     f"{r['share_repeats']:.1%} | {int(r['seeds'])} |")
    for length in sorted({r["eval_len"] for r in gains if r["status"] == "ok"}):
        if len({r["seed"] for r in gains}) < 2:
            break
        table = windowed_verdicts(gains, length)
        heading = (f"does each model use the far context, and does it beat RoPE limited to {first['reach']} keys "
                    f"(rope/none's far loss {table['window'].iloc[0]:.3f})?" if table["window"].notna().any()
                    else "does each model use the far context? (no rope/none rows: no windowed baseline)")
        lines += ["", f"at {length}: {heading} (paired t-tests over seeds)",
                  "", "| label | uses the far context | beats the window |", "|---|---|---|"]
        lines += [f"| {label} | {r['uses the far context']} | {r['beats the window']} |" for label, r in table.iterrows()]
    if keys:
        lines += ["", "passkey in Python, exact match of the five digits pooled over depths and seeds [Wilson 95 %: the "
                  "precision of these models' pooled windows, not an interval over seeds]:",
                  "", "| label | length | exact match | digits | first digit | digits, argmax of ten | distance |",
                  "|---|---|---|---|---|---|---|"]
        for (label, length), r in passkey_table(keys).iterrows():
            if r["status"] != "ok":
                lines.append(f"| {label} | {length} | cannot extrapolate | | | | |")
                continue
            lines.append(f"| {label} | {length} | {r['accuracy']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] | "
                         f"{r['digit_accuracy']:.2f} | {r['first_digit_accuracy']:.2f} | "
                         f"{'not measured' if math.isnan(r['choice_accuracy']) else format(r['choice_accuracy'], '.2f')} | "
                         f"{r['distance']:.0f} |")
    streams = json.loads((out / "stream.json").read_text()) if (out / "stream.json").exists() else []
    if streams:
        import pandas as pd

        table = pd.DataFrame(streams).groupby(["encoding", "sinks"])[["loss", "loss_full", "first_token_mass"]].mean()
        lines += ["", "one stream through a rolling cache of the training length (sinks + window), mean over seeds:", "",
                  "| encoding | sinks | loss, rolling cache | loss, full attention | weight on token 0 |",
                  "|---|---|---|---|---|"]
        for (encoding, sinks), r in table.iterrows():
            lines.append(f"| {encoding} | {sinks} | {r['loss']:.3f} | {r['loss_full']:.3f} | {r['first_token_mass']:.3f} |")
    return "\n".join(lines)
