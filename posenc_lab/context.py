"""Does a language model *use* the context past its training length?

Perplexity at a length ``L' > L`` can stay flat while the model ignores everything beyond ``L``
(Press et al. 2022, appendix B, ask this of ALiBi; Hu et al. 2024 and Fang et al. 2025 show that
perplexity need not track long-context ability). Two measurements ask it directly of the models
whose perplexity the book reports, without retraining them:

* **The gain from context beyond the reach** (:func:`gain`). The same targets are scored twice in
  non-overlapping windows of ``L'``: with full causal attention, and with every layer's attention
  limited to the last ``W`` keys (``reach=W``, a sliding-window mask, :func:`~posenc_lab.backends.attention`).
  For a target at window position ``p >= W`` the two differ only in what lies ``W`` or more
  positions back; ``loss(reach) - loss(full)`` on those *far* targets is the gain: positive, the model
  uses the far context; zero, it ignores it; negative, the far context hurts it. With ``W = L`` the
  limited model is also the baseline every extrapolation strategy must beat: a model that looks no
  further back in any layer than it was trained to (through ``n_layer`` layers information can still
  travel up to ``n_layer (W - 1)`` bytes, as in any sliding-window model). Alongside the mean, in the
  spirit of LongPPL (Fang et al. 2025): the share of far targets whose loss falls by more than a
  stated threshold with the long context (and rises by more than it), and where those bytes sit: the
  share that are **far repeats**, bytes that continue an ``n``-gram whose latest earlier occurrence in
  the window lies beyond the reach (so copying it needs the far context).
* **A passkey inside the language model** (:func:`passkey_windows`, :func:`answer_hits`). The models
  were trained on Python, so the passkey is Python: a line ``PASSKEY = "48213"`` planted at a
  statement boundary of held-out text (checked with Python's ``ast``: the document with the line planted
  still parses), and at the end of the window ``assert PASSKEY == "`` followed by the five digits,
  which are scored by teacher forcing (the argmax at each digit given the true earlier ones; see
  :mod:`posenc_lab.retrieval` for why this equals greedy decoding's exact match). Every digit comes from the
  same alphabet, so the model must copy the digits in order from the right place. The argmax runs
  over all 256 bytes, so a model that does not expect a digit after the question scores below the
  10 % a guessing digit would get; the *choice* accuracy takes the argmax over the ten digits only
  (chance exactly 10 % per digit, 0.001 % for all five), which separates "does not retrieve" from
  "does not know a digit comes".
"""

from __future__ import annotations

from .extras import require

require("lab", "posenc_lab.context")

import ast
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from .encodings import strategies_of
from .errors import PosencError, PositionOutOfRange, check_positive, unknown_name
from .evaluate import evaluate
from .rope import ARTICLE_STRATEGIES, ROPE_SCALINGS
from .train import autocast, flush_denormals

#: the default threshold (nats) of the per-byte view: a far target "uses" the long context when its loss
#: falls by more than this with it (stated, not tuned: a factor of e^0.5 ~ 1.65 in the byte's probability)
THRESHOLD = 0.5
#: the default n-gram of a far repeat
NGRAM = 8
PASSKEY_DIGITS = 5
#: the passkey's alphabet
DIGITS = b"0123456789"
_NAME = b"PASSKEY"


# --------------------------------------------------------------------------------------------- far repeats


def far_repeats(stream: torch.Tensor, start: int, length: int, reach: int, ngram: int = NGRAM) -> torch.Tensor:
    """For each target ``start + 1 .. start + length`` of a window, whether it is a *far repeat*: the ``ngram``
    bytes ending at it (itself included) occurred earlier in the window, and the latest such occurrence ends
    more than ``reach`` bytes back, so that a query limited to the last ``reach`` keys cannot see it (bool,
    ``length``). Targets with fewer than ``ngram - 1`` bytes of window before them are never repeats."""
    check_positive("ngram", ngram)
    data = bytes(stream[start : start + length + 1].tolist())
    flags = torch.zeros(length, dtype=torch.bool)
    last: dict[bytes, int] = {}
    for t in range(ngram - 1, length + 1):  # t: index in the window of the n-gram's last byte
        gram = data[t - ngram + 1 : t + 1]
        u = last.get(gram)
        if t >= 1 and u is not None and t - u > reach:
            flags[t - 1] = True  # target t of the window is stream[start + t], flag index t - 1
        last[gram] = t
    return flags


# --------------------------------------------------------------------------------------------- the gain


def gain(model, stream: torch.Tensor, *, length: int, reach: int, blocks: list[int], block_tokens: int,
         threshold: float = THRESHOLD, ngram: int = NGRAM, batch_size: int = 4, device="cpu",
         progress: bool = False, desc: str = "gain") -> dict:
    """The gain from context beyond ``reach`` at evaluation length ``length`` (see the module docstring).

    ``blocks`` are stream offsets: block ``b`` scores targets ``b + 1 .. b + block_tokens`` in non-overlapping
    windows of ``length`` (``block_tokens`` a multiple of it). Returns ``status``, ``loss_full`` and
    ``loss_reach`` over every scored target, and over the *far* targets (window position ``>= reach``):
    ``far_tokens``, ``far_loss_full``, ``far_loss_reach``, ``gain`` (``far_loss_reach - far_loss_full``),
    ``share_better``/``share_worse`` (far targets whose loss falls / rises by more than ``threshold``
    with the long context), ``share_repeats`` (far targets that are far repeats), ``gain_repeats`` and
    ``gain_others`` (the gain on each group), ``better_repeats`` (the share of far repeats among the
    bytes that got better), and ``per_target`` (``full``, ``reach``, ``far``, ``repeat`` tensors).
    """
    if length <= reach:
        raise PosencError(f"the evaluation length ({length}) must exceed the reach ({reach}): "
                          "below it the two evaluations are the same")
    if block_tokens % length:
        raise PosencError(f"block_tokens ({block_tokens}) must be a multiple of the evaluation length ({length})")
    full, limited, far, repeat = [], [], [], []
    for i, offset in enumerate(blocks):
        kwargs = dict(length=length, tokens=block_tokens, context=offset, batch_size=batch_size, device=device,
                      per_target=True, progress=progress)
        a = evaluate(model, stream, desc=f"{desc} {i + 1}/{len(blocks)} full", **kwargs)
        if a["status"] != "ok":
            return {"status": a["status"], "reason": a.get("reason", "")}
        b = evaluate(model, stream, reach=reach, desc=f"{desc} {i + 1}/{len(blocks)} reach {reach}", **kwargs)
        full.append(a["per_target"])
        limited.append(b["per_target"])
        far.append(torch.arange(block_tokens) % length >= reach)
        repeat.append(torch.cat([far_repeats(stream, start, length, reach, ngram)
                                 for start in range(offset, offset + block_tokens, length)]))
    full, limited, far, repeat = map(torch.cat, (full, limited, far, repeat))
    diff = (limited - full)[far]  # > 0: the far context lowered the loss
    rep = repeat[far]
    better = diff > threshold

    def mean(x):
        return float(x.mean()) if x.numel() else math.nan

    return {
        "status": "ok", "tokens": int(full.numel()), "loss_full": mean(full), "loss_reach": mean(limited),
        "far_tokens": int(far.sum()), "far_loss_full": mean(full[far]), "far_loss_reach": mean(limited[far]),
        "gain": mean(diff), "share_better": mean(better.double()), "share_worse": mean((diff < -threshold).double()),
        "share_repeats": mean(rep.double()), "gain_repeats": mean(diff[rep]), "gain_others": mean(diff[~rep]),
        "better_repeats": mean(rep[better].double()),
        "per_target": {"full": full, "reach": limited, "far": far, "repeat": repeat},
    }


# --------------------------------------------------------------------------------------------- attention sinks


@torch.no_grad()
def streaming_losses(model, tokens: torch.Tensor, *, window: int, sinks: int = 0, device="cpu",
                     progress: bool = False, desc: str = "stream") -> torch.Tensor:
    """The loss (nats, float64) of every next token of ``tokens`` (``n`` byte ids) read as one stream through a
    rolling :class:`~posenc_lab.backends.SinkCache` of the first ``sinks`` tokens and the last ``window``
    (StreamingLLM, Xiao et al. 2024): ``n - 1`` losses. The first ``sinks + window`` tokens go in one
    forward pass, the rest one at a time. Positions are the cache's slots, so a relative encoding
    (RoPE, ALiBi, T5, ...) never meets a distance beyond ``sinks + window``; an absolute one keeps the
    slot each token had when it entered."""
    device = torch.device(device)
    model.eval().to(device)
    tokens = tokens.long().to(device)
    caches = model.new_cache(window=window, sinks=sinks)
    first = min(sinks + window, len(tokens) - 1)
    out = []
    with flush_denormals(), autocast(device):
        logits = model(tokens[None, :first], cache=caches)[0].float()
        out.append(torch.nn.functional.cross_entropy(logits, tokens[1 : first + 1], reduction="none"))
        for t in tqdm(range(first, len(tokens) - 1), desc=desc, disable=not progress, leave=False):
            logits = model(tokens[None, t : t + 1], cache=caches)[0].float()
            out.append(torch.nn.functional.cross_entropy(logits, tokens[t + 1 : t + 2], reduction="none"))
    return torch.cat(out).double().cpu()


# --------------------------------------------------------------------------------------------- a passkey in Python


def plant_line(indent: bytes, key: bytes) -> bytes:
    """The planted assignment, as a line of Python with the indentation of the statement it precedes."""
    return indent + _NAME + b' = "' + key + b'"\n'


def question(indent: bytes) -> bytes:
    """The question that ends the window; the passkey's digits follow it."""
    return indent + b"assert " + _NAME + b' == "'


def statement_lines(document: bytes) -> list[tuple[int, bytes]]:
    """``(offset of the line start, indentation)`` of every line where a statement of ``document`` begins with
    only whitespace before it (none if the document does not parse)."""
    try:
        tree = ast.parse(document)
    except (SyntaxError, ValueError):
        return []
    starts = [0]
    for line in document.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            lineno = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            line_start = starts[lineno - 1]
            indent = document[line_start : line_start + node.col_offset]
            if not getattr(node, "decorator_list", None) and re.fullmatch(rb"[ \t]*", indent):
                found.add((line_start, indent))
    return sorted(found)


class PasskeyText:
    """Held-out Python documents joined by ``0x00`` (as in training), with the line starts where a planted
    assignment keeps its document valid Python (checked when first used, then remembered)."""

    def __init__(self, documents: list[bytes]):
        self.documents = [d for d in documents if d]
        self.stream = b"\x00".join(self.documents)
        self._offsets, self.candidates = [], []  # candidates: (global offset, document index, indentation)
        offset = 0
        for i, doc in enumerate(self.documents):
            self._offsets.append(offset)
            self.candidates += [(offset + s, i, indent) for s, indent in statement_lines(doc)]
            offset += len(doc) + 1
        if not self.candidates:
            raise PosencError("none of the documents parses as Python: the passkey task needs Python text")
        self._valid: dict[int, bool] = {}

    def valid(self, k: int) -> bool:
        """Whether planting before candidate ``k`` leaves its document parseable."""
        if k not in self._valid:
            at, doc, indent = self.candidates[k]
            local = at - self._offsets[doc]
            body = self.documents[doc]
            try:
                ast.parse(body[:local] + plant_line(indent, b"0" * PASSKEY_DIGITS) + body[local:])
                self._valid[k] = True
            except (SyntaxError, ValueError):
                self._valid[k] = False
        return self._valid[k]


def passkey_windows(text: PasskeyText, n: int, length: int, depth: float, generator: torch.Generator) -> dict:
    """``n`` windows of ``length`` bytes with a planted passkey (see the module docstring).

    The window's ``length + 1`` bytes: held-out text with the assignment planted at the statement line
    nearest to ``depth`` of the text (0: its first bytes, 1: just before the question), then the
    question and the five digits (the last five targets). Returns ``inputs`` (``n x length``),
    ``keys`` (``n x 5`` byte values), ``distance`` (bytes from the first planted digit to the first
    answer byte) and ``depth`` (where the line actually went, in [0, 1]).
    """
    if not 0.0 <= depth <= 1.0:
        raise PosencError(f"the passkey depth must lie in [0, 1], got {depth}")
    if length < 2 * (len(plant_line(b"", b"0" * PASSKEY_DIGITS)) + len(question(b"")) + 8):
        raise PosencError(f"a passkey window of {length} bytes is too short for the planted line and the question")
    cands = torch.tensor([c[0] for c in text.candidates])
    # question points: statement lines indented by at most 8 bytes, with a full window of text before them
    ends = [k for k, c in enumerate(text.candidates) if c[0] >= length and len(c[2]) <= 8]
    if not ends:
        raise PosencError(f"the held-out text ({len(text.stream)} bytes) is too short for windows of {length}")
    inputs, keys, distance, depths = [], [], [], []
    for _ in range(n):
        end_k = ends[int(torch.randint(len(ends), (1,), generator=generator))]
        end = text.candidates[end_k][0]
        key = bytes(ord("0") + int(d) for d in torch.randint(10, (PASSKEY_DIGITS,), generator=generator))
        ask = question(text.candidates[end_k][2])
        # the window: text[lo : at] + planted line + text[at : end] + question + key, length + 1 bytes in all
        room = length + 1 - len(ask) - PASSKEY_DIGITS  # haystack bytes, the planted line included
        target = end - room + depth * (room - 40)  # room for a line of up to 40 bytes with its indentation
        order = torch.argsort((cands - target).abs().double(), stable=True).tolist()
        for k in order:
            at, _, indent = text.candidates[k]
            line = plant_line(indent, key)
            lo = end - (room - len(line))
            if lo <= at <= end and text.valid(k):
                break
        else:
            raise PosencError("no statement line in the window where the passkey can be planted")
        seq = text.stream[lo:at] + line + text.stream[at:end] + ask + key
        assert len(seq) == length + 1, (len(seq), length)
        first_digit = (at - lo) + len(indent) + len(_NAME) + len(b' = "')
        inputs.append(torch.tensor(list(seq[:-1])))
        keys.append(torch.tensor(list(key)))
        distance.append(length + 1 - PASSKEY_DIGITS - first_digit)
        depths.append((at - lo) / max(1, room - len(line)))
    return {"inputs": torch.stack(inputs).long(), "keys": torch.stack(keys).long(),
            "distance": torch.tensor(distance), "depth": torch.tensor(depths)}


@torch.no_grad()
def answer_logits(model, inputs: torch.Tensor, k: int = PASSKEY_DIGITS, *, batch_size: int = 8,
                  device="cpu") -> torch.Tensor:
    """The logits (float ``n x k x vocab``) that predict the last ``k`` bytes of each window: the last ``k``
    targets of a window are the key, and the input holds all but its last byte, so position ``n - k`` predicts
    the key's first byte given the window, and each later one the next byte given the true earlier ones
    (teacher forcing)."""
    device = torch.device(device)
    model.eval().to(device)
    out = []
    with flush_denormals():
        for i in range(0, len(inputs), batch_size):
            with autocast(device):
                logits = model(inputs[i : i + batch_size].to(device))[:, -k:]
            out.append(logits.float().cpu())
    return torch.cat(out)


def answer_hits(model, inputs: torch.Tensor, keys: torch.Tensor, *, batch_size: int = 8, device="cpu",
                among: bytes | None = None) -> torch.Tensor:
    """Teacher-forced hits (bool ``n x k``): whether the argmax at each of the key's positions is the key's
    byte. ``among``: the argmax over these bytes only (e.g. ``b"0123456789"``: which digit the model ranks
    first, whether or not it expects a digit there; chance is ``1 / len(among)``)."""
    return choose(answer_logits(model, inputs, keys.shape[1], batch_size=batch_size, device=device), among) == keys


def choose(logits: torch.Tensor, among: bytes | None = None) -> torch.Tensor:
    """The argmax byte of each row of ``logits`` (``... x vocab``), over all bytes or over the bytes ``among``."""
    if among is None:
        return logits.argmax(-1)
    allowed = torch.tensor(list(among))
    return allowed[logits[..., allowed].argmax(-1)]


# --------------------------------------------------------------------------------------------- the runner


@dataclass
class ContextSpec:
    """Everything that defines a context experiment on the trained models of a language-model run."""

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

    def to_dict(self) -> dict:
        """The spec as a plain dict (as stored in ``config.json``)."""
        return asdict(self)


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
}


def context_preset(name: str, **overrides) -> ContextSpec:
    """The spec of context preset ``name`` with the ``overrides`` that are not ``None``."""
    if name not in CONTEXT_PRESETS:
        raise unknown_name("context preset", name, CONTEXT_PRESETS)
    return replace(CONTEXT_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


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
    from . import results

    def checked(config):
        if "corpus" not in config or "trained" in config:  # a retrieval run has no corpus, a context run "trained"
            raise PosencError(f"{spec.run!r} is not a language-model run (python -m posenc_lab run): it has no "
                              "trained models to measure")
        return config

    folder = Path(spec.run)
    if (folder / "config.json").is_file():
        config = checked(json.loads((folder / "config.json").read_text()))
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
    return [text.context + round(k * step) * spec.block_tokens for k in range(spec.blocks)]


def run_context_unit(spec: ContextSpec, encoding: str, seed: int, load, train_len: int, text, passkey: PasskeyText,
                     device, progress: bool, common: dict) -> dict:
    """The gain and the passkey for one trained model (every RoPE strategy on the RoPE model)."""
    reach = spec.reach or train_len
    gains, keys = [], []
    for strategy in strategies_of(encoding, spec.strategies):
        model = load(encoding, seed, **({"scaling": strategy} if strategy != "-" else {}))
        base = {"encoding": encoding, "strategy": strategy, "seed": seed, "train_len": train_len, **common}
        for length in spec.lengths:
            r = gain(model, text.stream, length=length, reach=reach, blocks=blocks_of(text, spec),
                     block_tokens=spec.block_tokens, threshold=spec.threshold, ngram=spec.ngram,
                     batch_size=max(1, spec.eval_batch_size * 2048 // max(length, 2048)), device=device,
                     progress=progress, desc=f"{encoding}/{strategy}/s{seed} {length}")
            r.pop("per_target", None)
            gains.append({**base, "eval_len": length, "reach": reach, "threshold": spec.threshold, "ngram": spec.ngram,
                          **r})
        cells = [(m, d) for m in spec.passkey_multiples for d in spec.depths]
        for multiple, depth in tqdm(cells, desc=f"passkey {encoding}/{strategy}/s{seed}", disable=not progress,
                                    leave=False):
            length = multiple * train_len
            # the same windows for every encoding and strategy of a seed, other windows for each seed (so that the
            # pooled interval counts independent windows)
            g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 7919 * length + round(1000 * depth))
            w = passkey_windows(passkey, spec.trials, length, depth, g)
            cell = {**base, "eval_len": length, "multiple": multiple, "depth": depth,
                    "distance_mean": float(w["distance"].double().mean())}
            try:
                logits = answer_logits(model, w["inputs"], PASSKEY_DIGITS, device=device,
                                       batch_size=max(1, spec.eval_batch_size * 2048 // max(length, 2048)))
            except PositionOutOfRange:
                keys.append({**cell, "status": "cannot extrapolate", "trials": 0, "correct": 0, "accuracy": math.nan,
                             "ci_low": math.nan, "ci_high": math.nan, "digit_accuracy": math.nan,
                             "first_digit_accuracy": math.nan, "choice_accuracy": math.nan})
                continue
            from .retrieval import wilson

            hits = choose(logits) == w["keys"]
            correct = int(hits.all(-1).sum())
            low, high = wilson(correct, spec.trials)
            keys.append({**cell, "status": "ok", "trials": spec.trials, "correct": correct,
                         "accuracy": correct / spec.trials, "ci_low": low, "ci_high": high,
                         "digit_accuracy": float(hits.double().mean()),
                         "first_digit_accuracy": float(hits[:, 0].double().mean()),
                         "choice_accuracy": float((choose(logits, DIGITS) == w["keys"]).double().mean())})
    streams = []
    if encoding in spec.sink_encodings:
        from .diagnostics import first_token_mass

        model = load(encoding, seed)
        starts = blocks_of(text, spec)[: spec.stream_blocks]
        full = list(_full_losses(model, text.stream, starts, spec, device))
        sample = torch.stack([text.stream[b : b + train_len] for b in starts]).long()
        mass = float(first_token_mass(model, sample.to(device)).mean())  # at the training length, every layer and head
        for sinks in spec.sink_counts:
            window = train_len - sinks  # the cache spans the training length
            losses = torch.cat([streaming_losses(model, text.stream[b : b + spec.block_tokens + 1], window=window,
                                                 sinks=sinks, device=device, progress=progress,
                                                 desc=f"stream {encoding}/s{seed} sinks {sinks}") for b in starts])
            streams.append({"encoding": encoding, "seed": seed, "train_len": train_len, "sinks": sinks, "window": window,
                            "tokens": int(losses.numel()), "loss": float(losses.mean()),
                            "loss_full": float(torch.cat(full).mean()), "first_token_mass": mass, **common})
    return {"encoding": encoding, "seed": seed, "rows": gains, "passkey": keys, "stream": streams}


def _full_losses(model, stream, starts, spec: ContextSpec, device):
    """Each block's losses with full attention over one window of ``block_tokens`` (the stream's baseline)."""
    for b in starts:
        r = evaluate(model, stream, length=spec.block_tokens, tokens=spec.block_tokens, context=b, device=device,
                     batch_size=1, per_target=True)
        yield r["per_target"] if r["status"] == "ok" else torch.full((spec.block_tokens,), math.nan, dtype=torch.float64)


def write_tables(out: Path, gains: list[dict], keys: list[dict], streams: list[dict] = ()) -> None:
    """``gain``, ``passkey`` and ``stream`` tables, each as ``.csv`` and ``.json``, atomically."""
    from .experiment import _csv, write_atomic

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
    from . import __version__
    from .data import evaluation_text, load_corpus
    from .experiment import Spec, collect, git_commit, prepare, resolve_device, run_units

    out = Path(out)
    device = resolve_device(device)
    config, load = _load_run(spec)
    run_spec = Spec(**{k: tuple(v) if isinstance(v, list) else v for k, v in config["spec"].items()})
    corpus = load_corpus(corpus or config.get("corpus", {}).get("corpus", "stdlib"))
    recorded = config.get("corpus", {}).get("sha256")
    if recorded and corpus.meta.get("sha256") != recorded:
        raise PosencError(f"this machine's {corpus.name!r} corpus differs from the one the run trained and was "
                          "evaluated on (its SHA-256 differs): the gain would be measured on other text")
    reach = spec.reach or run_spec.train_len
    if any(length <= reach for length in spec.lengths):
        raise PosencError(f"every length of the gain must exceed the reach ({reach}); got {spec.lengths}")
    if spec.sink_encodings and max(spec.sink_counts, default=0) >= run_spec.train_len:
        raise PosencError(f"the sink counts {spec.sink_counts} must be below the training length {run_spec.train_len}")
    text = evaluation_text(corpus, run_spec.eval_tokens, context=run_spec.eval_context())
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
    run_units(out, units, lambda e, s: run_context_unit(spec, e, s, load, run_spec.train_len, text, passkey, device,
                                                          progress, common),
              after_each=lambda o: write_tables(o, collect(o), collect(o, "passkey"), collect(o, "stream")), log=log)
    gains, keys = collect(out), collect(out, "passkey")
    write_tables(out, gains, keys, collect(out, "stream"))
    return gains, keys


# --------------------------------------------------------------------------------------------- tables


def _label(df):
    return df["encoding"].where(df["strategy"] == "-", df["encoding"] + "/" + df["strategy"])


def gain_table(rows) -> "pandas.DataFrame":
    """Per label and length: the mean over seeds of the far targets' loss with full and limited attention, the
    gain, the shares that got better and worse, and the far repeats' share and gain; ``seeds`` counts them."""
    import pandas as pd

    df = pd.DataFrame(rows)
    df = df[df["status"] == "ok"].assign(label=_label)
    cols = ["far_loss_full", "far_loss_reach", "gain", "share_better", "share_worse", "share_repeats", "gain_repeats",
            "gain_others"]
    table = df.groupby(["label", "eval_len"])[cols].mean()
    table["gain_sd"] = df.groupby(["label", "eval_len"])["gain"].std()
    table["seeds"] = df.groupby(["label", "eval_len"])["seed"].nunique()
    return table


def passkey_table(rows) -> "pandas.DataFrame":
    """Per label and length: exact match pooled over depths and seeds (Wilson 95 % interval), the per-digit and
    first-digit accuracy, the choice accuracy (argmax over the ten digits; NaN for runs made before it was
    measured; over the rows that measured it only, counted in ``choice_trials``), and the mean distance from the
    planted digits to the question."""
    import pandas as pd

    from .retrieval import with_wilson

    df = pd.DataFrame(rows).assign(label=_label)
    df["digit_hits"] = df["digit_accuracy"] * df["trials"]
    df["first_hits"] = df["first_digit_accuracy"] * df["trials"]
    if "choice_accuracy" not in df:  # runs made before the column existed
        df["choice_accuracy"] = math.nan
    measured = df["choice_accuracy"].notna()
    df["choice_hits"] = (df["choice_accuracy"] * df["trials"]).where(measured, 0.0)
    df["choice_trials"] = df["trials"].where(measured, 0)  # a unit made before the column counts for nothing
    g = df.groupby(["label", "eval_len"]).agg(correct=("correct", "sum"), trials=("trials", "sum"),
                                              digit_hits=("digit_hits", "sum"), first_hits=("first_hits", "sum"),
                                              choice_hits=("choice_hits", "sum"), choice_trials=("choice_trials", "sum"),
                                              status=("status", "first"), distance=("distance_mean", "mean"))
    g["accuracy"] = g["correct"] / g["trials"].where(g["trials"] > 0)
    g["digit_accuracy"] = g["digit_hits"] / g["trials"].where(g["trials"] > 0)
    g["first_digit_accuracy"] = g["first_hits"] / g["trials"].where(g["trials"] > 0)
    g["choice_accuracy"] = g["choice_hits"] / g["choice_trials"].where(g["choice_trials"] > 0)
    with_wilson(g)
    return g.drop(columns=["digit_hits", "first_hits", "choice_hits"])  # choice_trials: how many were measured


def _per_seed(df, label, length, column):
    mine = df[(df["label"] == label) & (df["eval_len"] == length)]
    if mine["seed"].duplicated().any():
        raise PosencError(f"{label} at {length} has more than one row for a seed: rows of two runs mixed?")
    return mine.set_index("seed")[column]


def windowed_verdicts(rows, length: int, *, baseline: str = "rope/none", alpha: float | None = None) -> "pandas.DataFrame":
    """Two verdicts per label at evaluation length ``length``, on the far targets (window position past the
    reach), under the book's rule (:data:`posenc_lab.claims.RULE`: seeds are the samples, paired t-tests):

    * ``uses the far context``: the label's loss with full attention is below its own loss with attention
      limited to the reach (the gain is positive); ``fails`` means the far context makes it worse;
    * ``beats the window``: its loss with full attention is below ``baseline``'s loss with attention limited to
      the reach: for ``rope/none``, RoPE as trained, never looking further back than it was trained to
      (the baseline an extrapolation strategy must beat; for ``baseline``'s own row the two verdicts agree).
      For another encoding it compares two trained models, paired by seed (they saw the same batches), so
      the verdict also carries the difference the two already have at the training length.

    Losses in nats are log perplexities, so both are tested on the log scale and a gain counts only when it is at
    least a 1 % ratio of perplexities (``exp(gain) >= 1.01``), in either direction.

    Columns: ``far_loss_full``, ``far_loss_reach`` (means over seeds), ``window`` (the baseline's limited
    loss), the two verdicts, ``ratio uses`` and ``ratio beats`` (perplexity with full attention over the other,
    ``exp`` of the mean paired difference), their ``p uses`` and ``p beats``, and ``seeds`` (the seeds paired with
    the baseline, or the label's own). Across lengths and labels these verdicts are an exploratory grid:
    :func:`far_context_family` adjusts their p-values as one family."""
    import pandas as pd

    from . import report as rep

    alpha = rep.ALPHA if alpha is None else alpha
    df = pd.DataFrame(rows)
    df = df[(df["status"] == "ok") & (df["eval_len"] == length)].assign(label=_label)
    if df.empty:
        raise PosencError(f"no finished gain rows at length {length}")
    window = _per_seed(df, baseline, length, "far_loss_reach") if baseline in set(df["label"]) else None
    out = []
    for label in sorted(df["label"].unique()):
        full, reach = _per_seed(df, label, length, "far_loss_full"), _per_seed(df, label, length, "far_loss_reach")
        uses = rep.compare_paired(full, reach, alpha=alpha, scale="log")
        beats = None if window is None else rep.compare_paired(full, window, alpha=alpha, scale="log")
        paired = len(full) if window is None else len(full.index.intersection(window.index))
        out.append({"label": label, "far_loss_full": full.mean(), "far_loss_reach": reach.mean(),
                    "window": math.nan if window is None else window.mean(),
                    "uses the far context": rep.verdict([uses], "<"),
                    "beats the window": "no baseline" if beats is None else rep.verdict([beats], "<"),
                    "ratio uses": uses.ratio, "p uses": uses.p, "ratio beats": math.nan if beats is None else beats.ratio,
                    "p beats": math.nan if beats is None else beats.p, "seeds": paired})
    return pd.DataFrame(out).set_index("label")


def far_context_family(rows, *, baseline: str = "rope/none", alpha: float | None = None) -> "pandas.DataFrame":
    """Every verdict of :func:`windowed_verdicts` at every length as one exploratory family: one row per label,
    length and question (``uses the far context``, ``beats the window``) with the perplexity ratio, the raw ``p``
    and Holm's and Benjamini-Hochberg's adjusted values beside it (:func:`~posenc_lab.stats.adjusted`); read in prose only
    what survives."""
    import pandas as pd

    from .stats import ALPHA, adjusted

    lengths = sorted({r["eval_len"] for r in rows if r["status"] == "ok"})
    records = []
    for length in lengths:
        table = windowed_verdicts(rows, length, baseline=baseline, alpha=alpha)
        for label, r in table.iterrows():
            for question, key in (("uses the far context", "uses"), ("beats the window", "beats")):
                if not math.isnan(r[f"p {key}"]):
                    records.append({"label": label, "eval_len": length, "question": question, "verdict": r[question],
                                    "ratio": r[f"ratio {key}"], "p": r[f"p {key}"]})
    return adjusted(pd.DataFrame(records, columns=["label", "eval_len", "question", "verdict", "ratio", "p"]),
                    alpha=ALPHA if alpha is None else alpha)


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
        question = (f"does each model use the far context, and does it beat RoPE limited to {first['reach']} keys "
                    f"(rope/none's far loss {table['window'].iloc[0]:.3f})?" if table["window"].notna().any()
                    else "does each model use the far context? (no rope/none rows: no windowed baseline)")
        lines += ["", f"at {length}: {question} (paired t-tests over seeds)",
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
