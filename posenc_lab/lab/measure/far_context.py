"""The gain from context beyond the reach: does a language model *use* the bytes past its training length?

The same targets are scored twice in non-overlapping windows of ``L'`` (:func:`gain`): with full causal
attention, and with every layer's attention limited to the last ``W`` keys (``reach=W``, a sliding-window mask,
:func:`~posenc_lab.backends.attention`). For a target at window position ``p >= W`` the two differ only in what
lies ``W`` or more positions back; ``loss(reach) - loss(full)`` on those *far* targets is the gain: positive,
the model uses the far context; zero, it ignores it; negative, the far context hurts it. With ``W = L`` the
limited model is also the baseline every extrapolation strategy must beat: a model that looks no further back
in any layer than it was trained to (through ``n_layer`` layers information can still travel up to
``n_layer (W - 1)`` bytes, as in any sliding-window model). Alongside the mean, in the spirit of LongPPL (Fang
et al. 2025): the share of far targets whose loss falls by more than a stated threshold with the long context
(and rises by more than it), and where those bytes sit: the share that are **far repeats** (:func:`far_repeats`),
bytes that continue an ``n``-gram whose latest earlier occurrence in the window lies beyond the reach (so copying
it needs the far context).

Over the seeds of a run: :func:`gain_table` (means per label and length), :func:`windowed_verdicts` (does each
model use the far context, does it beat RoPE's window) and :func:`far_context_family` (every verdict as one
family).
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.far_context")

import math

import torch

from posenc_lab.errors import PosencError, check_positive
from posenc_lab.lab.measure.perplexity import evaluate
from posenc_lab.lab.labels import Label

#: the default threshold (nats) of the per-byte view: a far target "uses" the long context when its loss
#: falls by more than this with it (stated, not tuned: a factor of e^0.5 ~ 1.65 in the byte's probability)
THRESHOLD = 0.5
#: the default n-gram of a far repeat
NGRAM = 8


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
        kwargs = dict(length=length, tokens=block_tokens, lead_in=offset, batch_size=batch_size, device=device,
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


# --------------------------------------------------------------------------------------------- tables


def label_column(df) -> "pandas.Series":
    """The ``label`` of each row of a context run's table: ``rope/yarn`` for a RoPE strategy, the encoding otherwise."""
    import pandas as pd

    return pd.Series([str(Label.of({"encoding": e, "strategy": s})) for e, s in zip(df["encoding"], df["strategy"])],
                     index=df.index, dtype=object)


def gain_table(rows) -> "pandas.DataFrame":
    """Per label and length: the mean over seeds of the far targets' loss with full and limited attention, the
    gain, the shares that got better and worse, and the far repeats' share and gain; ``seeds`` counts them."""
    df = ratio_frame(rows)
    cols = ["far_loss_full", "far_loss_reach", "gain", "share_better", "share_worse", "share_repeats", "gain_repeats",
            "gain_others"]
    table = df.groupby(["label", "eval_len"])[cols].mean()
    table["gain_sd"] = df.groupby(["label", "eval_len"])["gain"].std()
    table["seeds"] = df.groupby(["label", "eval_len"])["seed"].nunique()
    return table


def ratio_frame(rows) -> "pandas.DataFrame":
    """The finished rows of a context run's table with their ``label`` and ``ratio``: the far bytes' perplexity
    with full attention over the same model's with the last ``reach`` keys, ``exp(-gain)`` (below 1: the far bytes
    help)."""
    import numpy as np
    import pandas as pd

    df = pd.DataFrame(rows)
    df = df[df["status"] == "ok"]
    return df.assign(label=label_column, ratio=np.exp(-df["gain"]))


def _per_seed(df, label, length, column):
    mine = df[(df["label"] == label) & (df["eval_len"] == length)]
    if mine["seed"].duplicated().any():
        raise PosencError(f"{label} at {length} has more than one row for a seed: rows of two runs mixed?")
    return mine.set_index("seed")[column]


def windowed_verdicts(rows, length: int, *, baseline: str = "rope/none", alpha: float | None = None) -> "pandas.DataFrame":
    """Two verdicts per label at evaluation length ``length``, on the far targets (window position past the
    reach), under the book's rule (:data:`posenc_lab.lab.verdicts.claims.RULE`: seeds are the samples, paired t-tests):

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

    from posenc_lab.lab.verdicts import statistics

    alpha = statistics.ALPHA if alpha is None else alpha
    df = pd.DataFrame(rows)
    df = df[(df["status"] == "ok") & (df["eval_len"] == length)].assign(label=label_column)
    if df.empty:
        raise PosencError(f"no finished gain rows at length {length}")
    window = _per_seed(df, baseline, length, "far_loss_reach") if baseline in set(df["label"]) else None
    out = []
    for label in sorted(df["label"].unique()):
        full, reach = _per_seed(df, label, length, "far_loss_full"), _per_seed(df, label, length, "far_loss_reach")
        uses = statistics.compare_paired(full, reach, alpha=alpha, scale="log")
        beats = None if window is None else statistics.compare_paired(full, window, alpha=alpha, scale="log")
        paired = len(full) if window is None else len(full.index.intersection(window.index))
        out.append({"label": label, "far_loss_full": full.mean(), "far_loss_reach": reach.mean(),
                    "window": math.nan if window is None else window.mean(),
                    "uses the far context": statistics.verdict([uses], "<"),
                    "beats the window": "no baseline" if beats is None else statistics.verdict([beats], "<"),
                    "ratio uses": uses.ratio, "p uses": uses.p, "ratio beats": math.nan if beats is None else beats.ratio,
                    "p beats": math.nan if beats is None else beats.p, "seeds": paired})
    return pd.DataFrame(out).set_index("label")


def far_context_family(rows, *, baseline: str = "rope/none", alpha: float | None = None) -> "pandas.DataFrame":
    """Every verdict of :func:`windowed_verdicts` at every length as one exploratory family: one row per label,
    length and question (``uses the far context``, ``beats the window``) with the perplexity ratio, the raw ``p``
    and Holm's and Benjamini-Hochberg's adjusted values beside it (:func:`~posenc_lab.lab.verdicts.statistics.adjusted`); read in prose only
    what survives. For ``baseline``'s own label the two questions are one test (its limited self is the window), so
    the family holds it once, as ``uses the far context``."""
    import pandas as pd

    from posenc_lab.lab.verdicts.statistics import ALPHA, adjusted

    lengths = sorted({r["eval_len"] for r in rows if r["status"] == "ok"})
    records = []
    for length in lengths:
        table = windowed_verdicts(rows, length, baseline=baseline, alpha=alpha)
        for label, r in table.iterrows():
            for question, key in (("uses the far context", "uses"), ("beats the window", "beats")):
                if not math.isnan(r[f"p {key}"]) and not (label == baseline and key == "beats"):
                    records.append({"label": label, "eval_len": length, "question": question, "verdict": r[question],
                                    "ratio": r[f"ratio {key}"], "p": r[f"p {key}"]})
    return adjusted(pd.DataFrame(records, columns=["label", "eval_len", "question", "verdict", "ratio", "p"]),
                    alpha=ALPHA if alpha is None else alpha)

