"""A passkey inside the language model: can a model trained on Python copy a key from far back in a window?

The models were trained on Python, so the passkey is Python (:func:`passkey_windows`): a line
``PASSKEY = "48213"`` planted at a statement boundary of held-out text (checked with Python's ``ast``: the
document with the line planted still parses), and at the end of the window ``assert PASSKEY == "`` followed by
the five digits, which are scored by teacher forcing (the argmax at each digit given the true earlier ones; see
:mod:`posenc_lab.lab.experiments.retrieval` for why this equals greedy decoding's exact match). Every digit comes from the same
alphabet, so the model must copy the digits in order from the right place. The argmax runs over all 256 bytes,
so a model that does not expect a digit after the question scores below the 10 % a guessing digit would get;
the *choice* accuracy takes the argmax over the ten digits only (chance exactly 10 % per digit, 0.001 % for all
five), which separates "does not retrieve" from "does not know a digit comes" (:func:`digit_hits`,
:func:`passkey_scores`, :func:`passkey_table`).
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.passkey")

import ast
import math
import re

import torch

from posenc_lab.errors import PosencError, PositionOutOfRange
from posenc_lab.lab.measure.accuracy import wilson, with_wilson
from posenc_lab.lab.measure.far_context import label_column
from posenc_lab.lab.run.training import autocast, flush_denormals

#: the digits of a passkey
PASSKEY_DIGITS = 5
#: the passkey's alphabet, as bytes (the ``among`` of :func:`choose` for the choice accuracy)
DIGIT_BYTES = b"0123456789"
_NAME = b"PASSKEY"


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
    masks: dict = {}  # the windows share one length: the masks of a bias, built once
    with flush_denormals():
        for i in range(0, len(inputs), batch_size):
            with autocast(device):
                logits = model(inputs[i : i + batch_size].to(device), masks=masks)[:, -k:]
            out.append(logits.float().cpu())
    return torch.cat(out)


def digit_hits(model, inputs: torch.Tensor, keys: torch.Tensor, *, batch_size: int = 8, device="cpu",
               among: bytes | None = None) -> torch.Tensor:
    """Teacher-forced hits (bool ``n x k``): whether the argmax at each of the key's positions is the key's
    byte. ``among``: the argmax over these bytes only (e.g. :data:`DIGIT_BYTES`: which digit the model ranks
    first, whether or not it expects a digit there; chance is ``1 / len(among)``)."""
    return choose(answer_logits(model, inputs, keys.shape[1], batch_size=batch_size, device=device), among) == keys


def choose(logits: torch.Tensor, among: bytes | None = None) -> torch.Tensor:
    """The argmax byte of each row of ``logits`` (``... x vocab``), over all bytes or over the bytes ``among``."""
    if among is None:
        return logits.argmax(-1)
    allowed = torch.tensor(list(among))
    return allowed[logits[..., allowed].argmax(-1)]


def passkey_scores(model, windows: dict, *, batch_size: int = 8, device="cpu") -> dict:
    """The scores of ``windows`` (from :func:`passkey_windows`): ``status``, ``trials``, ``correct`` (the windows
    whose digits are all the argmax over every byte), ``accuracy`` with its Wilson 95 % interval (``ci_low``,
    ``ci_high``), ``digit_accuracy``, ``first_digit_accuracy`` and ``choice_accuracy`` (the argmax over the ten
    digits). A model that cannot run at the windows' length scores ``cannot extrapolate``, with NaN accuracies."""
    try:
        logits = answer_logits(model, windows["inputs"], PASSKEY_DIGITS, device=device, batch_size=batch_size)
    except PositionOutOfRange:
        return {"status": "cannot extrapolate", "trials": 0, "correct": 0, "accuracy": math.nan, "ci_low": math.nan,
                "ci_high": math.nan, "digit_accuracy": math.nan, "first_digit_accuracy": math.nan,
                "choice_accuracy": math.nan}
    hits = choose(logits) == windows["keys"]
    trials = len(hits)
    correct = int(hits.all(-1).sum())
    low, high = wilson(correct, trials)
    return {"status": "ok", "trials": trials, "correct": correct, "accuracy": correct / trials, "ci_low": low,
            "ci_high": high, "digit_accuracy": float(hits.double().mean()),
            "first_digit_accuracy": float(hits[:, 0].double().mean()),
            "choice_accuracy": float((choose(logits, DIGIT_BYTES) == windows["keys"]).double().mean())}


def passkey_table(rows) -> "pandas.DataFrame":
    """Per label and length: exact match pooled over depths and seeds (Wilson 95 % interval), the per-digit and
    first-digit accuracy, the choice accuracy (argmax over the ten digits; NaN for tables without the column;
    over the rows that measured it only, counted in ``choice_trials``), and the mean distance from the
    planted digits to the question."""
    import pandas as pd

    df = pd.DataFrame(rows).assign(label=label_column)
    df["digit_hits"] = df["digit_accuracy"] * df["trials"]
    df["first_hits"] = df["first_digit_accuracy"] * df["trials"]
    if "choice_accuracy" not in df:  # a table without the choice accuracy
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
