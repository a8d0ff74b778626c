"""The evaluations of one trained model under a language-model spec
(:class:`~posenc_lab.lab.experiments.language_model.Spec`, read for its evaluation and model parts only): every
length and mode of the spec on the evaluation text, and the checkpoint evaluations along training.

For RoPE, each extrapolation strategy is evaluated in turn; at a length where a strategy rotates the
positions exactly as no scaling does (every strategy at the training length: compared, not assumed),
the rows that no scaling measured are reused (:class:`PlainRotation`).
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.perplexity_grid")

import math

import torch

from posenc_lab.encodings import ENCODINGS
from posenc_lab.lab.data.corpora import EvalText
from posenc_lab.lab.measure.perplexity import evaluate


def evaluate_all(model, spec, text: EvalText, device, progress, label, *, same_as=None,
                  evaluations=None) -> tuple[list[dict], dict, list[dict]]:
    """Every evaluation of ``spec`` (or only ``evaluations``, ``(length, mode, stride)`` triples) on
    ``text``: result rows, per-position curves, per-document rows.

    ``same_as(length)`` may return the rows, curve and document rows already measured for a length
    at which this model is known to compute exactly the same thing (a RoPE strategy at the training
    length); they are reused instead of recomputed.
    """
    rows, per_position, documents = [], {}, []
    settings = spec.evaluation
    for length, mode, stride in (settings.evaluations() if evaluations is None else evaluations):
        reused = same_as(length, mode) if same_as is not None else None
        if reused is not None:
            row, curve, docs = reused
            rows.append(row)
            documents += docs
            if curve is not None:
                per_position[str(length)] = curve
            continue
        r = evaluate(model, text.stream, length=length, tokens=settings.eval_tokens, mode=mode, stride=stride,
                     lead_in=text.lead_in, documents=text.documents, batch_size=settings.eval_batch_size, device=device,
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


def curve_blocks(spec, text: EvalText) -> list[int]:
    """Where the checkpoint evaluations read: 8 blocks of ``curve_tokens / 8`` scored bytes, spread evenly
    over the evaluation text (offsets of their first target, relative to the scored text)."""
    block = spec.evaluation.curve_tokens // 8
    slots = spec.evaluation.eval_tokens // block
    return [round(k * (slots - 1) / 7) * block for k in range(8)]


def evaluate_checkpoint(model, spec, text: EvalText, device, strategies=("-",)) -> list[dict]:
    """Perplexity at each curve length (non-overlapping) on the curve blocks, for each strategy; the model
    is left in training mode with its strategy restored."""
    was_training = model.training
    rows = []
    for strategy in strategies:
        if strategy != "-":
            model.encoding.set_scaling(strategy)
        for length in spec.curve_lengths():
            if strategy not in ("-", "none") and length <= spec.model.train_len:
                continue  # a strategy changes nothing at the training length (checked where the rows are reused: PlainRotation)
            total, count, status = 0.0, 0, "ok"
            for offset in curve_blocks(spec, text):
                r = evaluate(model, text.stream, length=length, tokens=spec.evaluation.curve_tokens // 8,
                             mode="nonoverlapping", lead_in=text.lead_in + offset,
                             batch_size=spec.evaluation.eval_batch_size, device=device)
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


def same_rotation(model, strategy: str, length: int) -> bool:
    """Whether RoPE with ``strategy`` rotates positions ``0 .. length-1`` exactly as without scaling
    (every strategy does at the training length): compared, not assumed."""
    positions = torch.arange(length)
    current = model.encoding.scaling
    mine = model.encoding.set_scaling(strategy).cos_sin(positions)
    plain = model.encoding.set_scaling("none").cos_sin(positions)
    model.encoding.set_scaling(current)
    return all(torch.equal(a, b) for a, b in zip(mine, plain))


class PlainRotation:
    """The rows the 'none' strategy measured for a RoPE model, reused for a strategy that rotates the same
    positions exactly as 'none' does (every strategy at the training length): compared, not assumed."""

    def __init__(self, model, encoding: str):
        self.model, self.encoding, self.measured = model, encoding, {}

    def remember(self, evaluated: list[dict], per_position: dict, docs: list[dict]) -> None:
        """Keep the rows, curves and document rows that the 'none' strategy measured (:func:`evaluate_all`)."""
        for r in evaluated:
            key = (r["eval_len"], r["eval_mode"])
            self.measured[key] = (r, per_position.get(str(r["eval_len"])) if r["eval_mode"] == "nonoverlapping" else None,
                                  [d for d in docs if (d["eval_len"], d["eval_mode"]) == key])

    def same_as(self, length, mode):
        """The remembered ``(row, curve, documents)`` at ``(length, mode)`` when the model's current strategy
        rotates those positions exactly as 'none' does, else ``None`` (``same_as`` of :func:`evaluate_all`)."""
        scaling = self.model.encoding.scaling if ENCODINGS[self.encoding].has_strategies else "none"
        if scaling == "none" or (length, mode) not in self.measured:
            return None
        return self.measured[(length, mode)] if same_rotation(self.model, scaling, length) else None
