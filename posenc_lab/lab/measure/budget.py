"""The budget along training: each unit's checkpoint evaluations as a results table, the verdicts and the spread
of the encodings checkpoint by checkpoint, and a power-law fit that extrapolates the spread (chapter 8's "Along
training"). :mod:`posenc_lab.lab.verdicts.tables` re-exports these names."""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.budget")

from pathlib import Path

import numpy as np
import pandas as pd

from posenc_lab.errors import PosencError
from posenc_lab.lab.verdicts.claims import claims, comparison_table
from posenc_lab.lab.verdicts.statistics import ALPHA, adjusted, frame



def load_checkpoints(out: Path | str) -> pd.DataFrame | None:
    """The evaluations along training of a run (``checkpoints.csv``), or None for a run that did not keep them."""
    path = Path(out) / "checkpoints.csv"
    if not path.exists():
        return None
    return budget_frame(pd.read_csv(path, keep_default_na=False, na_values=[""]))


def budget_frame(checkpoints, train_len: int | None = None) -> pd.DataFrame:
    """The checkpoint evaluations as a results table (``label``, ``perplexity``, ...) with ``step`` and
    ``tokens_seen``. Strategies are evaluated at the longer lengths only (at the training length they
    rotate as ``none`` does), so their training-length rows are copied from ``rope/none``'s."""
    df = frame(checkpoints)
    if "train_len" not in df:
        if train_len is None:
            train_len = int(df["eval_len"].min())
        df["train_len"] = train_len
    df["perplexity"] = pd.to_numeric(df["perplexity"], errors="coerce")
    train = int(df["train_len"].iloc[0])
    plain = df[(df.label == "rope/none") & (df.eval_len == train)]
    strategies = sorted(set(df.loc[df.label.str.startswith("rope/"), "strategy"]) - {"none"})
    copies = [plain.assign(strategy=s, label=f"rope/{s}") for s in strategies
              if df[(df.strategy == s) & (df.eval_len == train)].empty]
    return pd.concat([df, *copies], ignore_index=True) if copies else df


def budget_growth(checkpoints, length: int) -> pd.DataFrame:
    """``ppl(length) / ppl(train_len)`` at every checkpoint, one row per label, seed and step."""
    df = budget_frame(checkpoints)
    train = int(df["train_len"].iloc[0])
    keys = ["label", "seed", "step", "tokens_seen"]
    short = df[df.eval_len == train].set_index(keys)["perplexity"]
    long = df[df.eval_len == length].set_index(keys)["perplexity"]
    return (long / short).dropna().rename("growth").reset_index()


def budget_verdicts(checkpoints, *, judged_len: int | None = None, alpha: float = ALPHA) -> pd.DataFrame:
    """Every claim's verdict at every checkpoint (non-overlapping windows, the curve lengths): a row per
    claim and part, a column per number of training tokens seen (millions). Where does a verdict flip,
    and does it flip back? A claim part with no data at every budget (it needs a length, an encoding
    or a strategy the checkpoints were not evaluated with: e.g. the ALiBi paper's order needs two lengths
    past the training length, "T5 holds to about 2x" lengths of 2x and 4x) is left out of the table and named in
    ``table.attrs["left out"]``."""
    df = budget_frame(checkpoints)
    judged_len = judged_len or int(df["eval_len"].max())
    records = []
    for tokens, at_step in df.groupby("tokens_seen", sort=True):
        for c in claims(at_step, "nonoverlapping", judged_len=judged_len, alpha=alpha):
            for part, v in c["verdicts"].items():
                records.append({"claim": f"{c['id']}: {part}", "tokens (M)": float(f"{tokens / 1e6:.3g}"),
                                "verdict": "not resolved" if v.startswith("not resolved") else v})
    table = pd.DataFrame(records).pivot(index="claim", columns="tokens (M)", values="verdict")
    table = table.loc[list(dict.fromkeys(r["claim"] for r in records))]
    unjudged = (table == "no data").all(axis=1)
    kept = table[~unjudged]
    kept.attrs["left out"] = list(table.index[unjudged])  # no data at any budget: named, not hidden
    return kept


def budget_comparisons(checkpoints, *, judged_len: int | None = None, alpha: float = ALPHA) -> pd.DataFrame:
    """Every comparison behind :func:`budget_verdicts`, one row per checkpoint (``tokens (M)``) and test, with the
    ratio, its interval and ``p``; the whole grid is one exploratory family, so ``p holm``, ``p BH`` and
    ``survives`` (:func:`~posenc_lab.lab.verdicts.statistics.adjusted`) sit beside the raw p. A verdict that flips between checkpoints on
    comparisons that survive neither adjustment is threshold noise."""
    df = budget_frame(checkpoints)
    judged_len = judged_len or int(df["eval_len"].max())
    tables = []
    for tokens, at_step in df.groupby("tokens_seen", sort=True):
        table = comparison_table(at_step, modes=("nonoverlapping",), judged_len=judged_len, alpha=alpha)
        tables.append(table.assign(**{"tokens (M)": float(f"{tokens / 1e6:.3g}")}))
    table = pd.concat(tables, ignore_index=True)
    return adjusted(table[table["p"].notna()].drop(columns="p holm"), alpha=alpha)


def _training_length_losses(checkpoints, labels) -> pd.DataFrame:
    """Seed-mean loss (nats) at the training length, non-overlapping windows: one row per checkpoint
    (``tokens_seen``), one column per label in ``labels``' order; NaN where a checkpoint lacks a label."""
    df = budget_frame(checkpoints)
    train = int(df["train_len"].iloc[0])
    short = df[(df.eval_len == train) & (df.eval_mode == "nonoverlapping") & df.label.isin(labels)]
    missing = sorted(set(labels) - set(short.label))
    if missing:
        raise PosencError(f"no checkpoint evaluations at the training length for {', '.join(missing)}")
    return short.groupby(["tokens_seen", "label"])["loss"].mean().unstack()[list(labels)].sort_index()


def budget_spread(checkpoints, labels) -> pd.DataFrame:
    """Is the gap between ``labels`` at the training length still closing? One row per checkpoint
    (``tokens (M)``): each label's perplexity there (``exp`` of its seed-mean loss, non-overlapping windows
    at the training length, as :func:`budget_extrapolation` fits it) and ``spread``, ``max/min - 1`` over
    the labels. Checkpoints that lack one of the labels are left out."""
    table = np.exp(_training_length_losses(checkpoints, labels).dropna())
    table["spread"] = table.max(axis=1) / table.min(axis=1) - 1
    table.index = pd.Index(table.index / 1e6, name="tokens (M)")
    table.columns.name = None
    return table


def _power_law(tokens, floor, scale, exponent):
    return floor + scale * tokens ** (-exponent)


def budget_extrapolation(checkpoints, labels, *, within: float = 0.10, horizon: float = 1000.0) -> dict:
    """How many training tokens until ``labels`` reach perplexities within ``within`` of each other at
    the training length, extrapolated from the checkpoint curves -- an extrapolation, stated as one.

    For every label, the seed-mean loss (nats, non-overlapping windows at the training length) against
    tokens seen ``t`` (millions) is fitted by ``loss(t) = floor + scale * t**(-exponent)`` (least squares,
    ``scipy.optimize.curve_fit``; floor, scale and exponent positive). The fitted curves are followed
    on a log grid from the last checkpoint to ``horizon`` times it; the answer is the first ``t`` at
    which the largest and smallest fitted perplexity are within ``within`` (``max/min - 1 <= within``).

    Returns ``{"fits": DataFrame(label, floor, scale, exponent, rmse, last_tokens_m, last_loss),
    "gap_now": relative spread of the last measured perplexities, "tokens_m": the extrapolated
    millions of tokens or None (not within the horizon), "gap_at_horizon"}``. The floors are the least
    determined numbers: a curve still falling fast leaves them loose, and the answer with them.
    """
    from scipy.optimize import curve_fit

    curves = _training_length_losses(checkpoints, labels)
    fits, last_t = [], 0.0
    for name in labels:
        c = curves[name].dropna()
        t, y = c.index.to_numpy() / 1e6, c.to_numpy()
        if len(t) < 4:
            raise PosencError(f"{name} has {len(t)} checkpoint evaluations; a three-parameter fit needs at least 4")
        guess = (max(y.min() * 0.9, 1e-3), max(y[0] - y.min(), 1e-3) * t[0] ** 0.5, 0.5)
        params, _ = curve_fit(_power_law, t, y, p0=guess, bounds=([0, 0, 1e-3], [y.min(), np.inf, 5]), maxfev=20000)
        rmse = float(np.sqrt(np.mean((_power_law(t, *params) - y) ** 2)))
        fits.append({"label": name, "floor": params[0], "scale": params[1], "exponent": params[2], "rmse": rmse,
                     "last_tokens_m": t[-1], "last_loss": y[-1]})
        last_t = max(last_t, t[-1])
    fits = pd.DataFrame(fits)
    last = np.exp(fits["last_loss"])
    grid = np.geomspace(last_t, last_t * horizon, 2000)
    predicted = np.stack([_power_law(grid, r.floor, r.scale, r.exponent) for r in fits.itertuples()])
    spread = np.exp(predicted.max(0) - predicted.min(0)) - 1
    reached = np.nonzero(spread <= within)[0]
    return {"fits": fits, "gap_now": float(last.max() / last.min() - 1),
            "tokens_m": float(grid[reached[0]]) if len(reached) else None, "gap_at_horizon": float(spread[-1]),
            "within": within, "horizon_m": float(grid[-1])}
