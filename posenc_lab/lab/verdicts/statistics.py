"""Seeds as samples: per-seed values of the results table, and the tests every verdict is made of.

Perplexities are compared on the log scale, where seeds vary alike whatever the level: a level is
a log perplexity (the mean loss in nats per byte), a growth is ``log(ppl(L') / ppl(L))``. A
difference ``d`` of log perplexities is reported as the ratio ``exp(d)`` with its back-transformed
95 % interval and p. A difference counts, for or against a claim, only when it is resolved and at
least :data:`FLOOR` in size (a 1 % ratio of perplexities); the floor is the same in both directions.
Accuracies are not compared this way: :func:`compare_counts` tests each seed's counts exactly.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.verdicts.statistics")

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from posenc_lab.errors import PosencError
from posenc_lab.lab.labels import Label

#: the significance level of every test
ALPHA = 0.05
#: the smallest difference that decides anything: a ratio of perplexities of 1.01, on the log scale
FLOOR = math.log(1.01)
#: the smallest difference of accuracies (seed means) that decides anything: one percentage point
ACCURACY_FLOOR = 0.01


# --------------------------------------------------------------------------------------------- the samples


def label(row) -> str:
    """``rope/yarn`` for a RoPE strategy, the encoding's name otherwise."""
    return str(Label.of(row))


def frame(rows) -> pd.DataFrame:
    """The tidy results as a DataFrame with a ``label`` column (``rope/ntk``, ``alibi``, ...) and a
    ``loss`` column (nats, the log perplexity; ``log(perplexity)`` where only perplexity was given).

    Accepts the rows of a run (a list of dicts, ``results.json``) or a DataFrame already.
    """
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    if df.empty:
        raise PosencError("no result rows")
    if "label" not in df:
        df["strategy"] = df.get("strategy", "-")
        df["label"] = [label(r) for r in df[["encoding", "strategy"]].to_dict("records")]
    for column in ("eval_len", "train_len", "seed"):
        if column in df:
            df[column] = df[column].astype(int)
    for column in ("perplexity", "loss", "bits_per_byte"):
        if column in df:
            df[column] = pd.to_numeric(df[column], errors="coerce")
    if "perplexity" in df:
        derived = np.log(df["perplexity"].where(df["perplexity"] > 0))
        df["loss"] = df["loss"].fillna(derived) if "loss" in df else derived
    return df


def seed_values(df: pd.DataFrame, mode: str, name: str, length: int, metric: str = "perplexity") -> pd.Series:
    """``metric`` of ``name`` at ``length`` for each seed (indexed by seed)."""
    cell = df[(df.eval_mode == mode) & (df.label == name) & (df.eval_len == length)]
    return cell.set_index("seed")[metric]


def growth(df: pd.DataFrame, mode: str, name: str, length: int) -> pd.Series:
    """``ppl(length) / ppl(train_len)`` for each seed: a seed is compared with itself."""
    train = int(df["train_len"].iloc[0])
    return seed_values(df, mode, name, length) / seed_values(df, mode, name, train)


def log_growth(df: pd.DataFrame, mode: str, name: str, length: int) -> pd.Series:
    """``log(ppl(length) / ppl(train_len)) = loss(length) - loss(train_len)`` for each seed (nats)."""
    train = int(df["train_len"].iloc[0])
    return seed_values(df, mode, name, length, "loss") - seed_values(df, mode, name, train, "loss")


# --------------------------------------------------------------------------------------------- one test


@dataclass(frozen=True)
class Comparison:
    """A two-sided test of A against B.

    On the log scale (``scale="log"``) ``diff`` is ``mean(log A) - mean(log B)`` and ``low``/``high``
    its 95 % t-interval; ``ratio`` is ``exp(diff)``. ``kind`` is ``"welch"``, ``"paired"`` (the
    per-seed differences), ``"threshold"`` (one sample against a number) or ``"exact"`` (accuracies,
    :func:`compare_counts`: ``diff`` in accuracy points, ``low``/``high`` the seeds' range). ``p`` is
    NaN where no test is possible (one seed, no spread).
    """

    diff: float
    low: float
    high: float
    t: float
    df: float
    p: float
    n: tuple[int, int]
    kind: str = "welch"
    alpha: float = ALPHA
    scale: str = "log"
    se: float = math.nan

    @property
    def floor(self) -> float:
        """The smallest difference that decides a claim: ``log 1.01`` on the log scale, :data:`ACCURACY_FLOOR`
        for accuracies."""
        return ACCURACY_FLOOR if self.scale == "accuracy" else FLOOR

    @property
    def resolved(self) -> bool:
        """Whether the test rejects equal means at ``alpha`` (never with a single seed)."""
        return not math.isnan(self.p) and self.p < self.alpha

    @property
    def sign(self) -> str:
        """``"<"``, ``">"`` (A below / above B, resolved) or ``"~"`` (not resolved)."""
        return ("<" if self.diff < 0 else ">") if self.resolved else "~"

    @property
    def matters(self) -> bool:
        """Whether the difference reaches the floor (:data:`FLOOR`, or :data:`ACCURACY_FLOOR` for accuracies)."""
        return abs(self.diff) >= self.floor

    @property
    def ratio(self) -> float:
        """``exp(diff)``: A's perplexity (growth) over B's; NaN for accuracies."""
        return math.exp(self.diff) if self.scale == "log" and not math.isnan(self.diff) else math.nan

    @property
    def relative(self) -> float:
        """``ratio - 1`` on the log scale (A is ``relative`` above B); the difference itself for accuracies."""
        return self.ratio - 1 if self.scale == "log" else self.diff

    @property
    def interval(self) -> tuple[float, float]:
        """The 95 % interval of ``ratio`` (back-transformed), or of ``diff`` for accuracies."""
        return (math.exp(self.low), math.exp(self.high)) if self.scale == "log" else (self.low, self.high)

    def reading(self) -> str:
        """``ratio [low, high], p = ...`` and what it decides: ``<``/``>`` when it counts, ``resolved, under 1 %``,
        ``not resolved`` or ``no test``."""
        if math.isnan(self.diff):
            return "no data"
        if self.scale == "log":
            low, high = self.interval
            size = f"ratio {self.ratio:.3f} [{low:.3f}, {high:.3f}]"
        else:
            size = f"{self.diff:+.2f} (seeds {self.low:+.2f} .. {self.high:+.2f})"
        if math.isnan(self.p):
            return f"{size}, no test"
        said = self.sign if self.resolved and self.matters else ("resolved, under 1 %" if self.resolved else "not resolved")
        return f"{size}, p = {self.p:.3g}: {said}"


def _no_spread(values: np.ndarray) -> bool:
    """Whether ``values`` do not vary, to rounding: a t-test then has nothing to estimate its error from. Equal
    values can come out unequal in their last bits (``np.std([0.998] * 3)`` is about 1e-16, not 0), which would
    otherwise give an unbounded ``t``."""
    return len(values) == 0 or float(np.ptp(values)) <= 1e-12 * max(1.0, float(np.abs(values).max()))


def _on_scale(values, scale: str) -> np.ndarray:
    """Values as the test sees them: ``log`` of positive ratios (``scale="ratio"``), or as given (``"log"``)."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if scale == "log":
        return x
    if scale != "ratio":
        raise PosencError(f"unknown scale {scale!r}: 'ratio' (perplexities, growths) or 'log' (losses, log growths)")
    if (x <= 0).any():
        raise PosencError("a ratio scale needs positive values (perplexities, growths): pass scale='log' for losses "
                          "in nats, and compare accuracies with compare_counts")
    return np.log(x)


def _result(diff, se, dof, n, kind, alpha) -> Comparison:
    if not se > 0 or math.isnan(dof):
        return Comparison(diff, math.nan, math.nan, math.nan, math.nan, math.nan, n, kind, alpha)
    t = diff / se
    half = float(stats.t.ppf(1 - alpha / 2, dof)) * se
    return Comparison(diff, diff - half, diff + half, t, dof, float(2 * stats.t.sf(abs(t), dof)), n, kind, alpha,
                      se=float(se))


def compare(a, b, *, alpha: float = ALPHA, scale: str = "ratio") -> Comparison:
    """Welch's t-test of two samples (values over seeds) on the log scale; ``b`` may be a number (a one-sample
    t-test against a threshold, e.g. a growth of 1.10). ``scale="ratio"``: the values are perplexities or
    growths and their logs are tested; ``scale="log"``: they are logs already (losses in nats). NaN dropped."""
    a = _on_scale(a, scale)
    if np.isscalar(b):
        (ref,) = _on_scale([b], scale)
        n = (len(a), math.inf)
        if not len(a):
            return _result(math.nan, math.nan, math.nan, n, "threshold", alpha)
        diff = float(a.mean() - ref)
        no_test = len(a) < 2 or _no_spread(a)
        return _result(diff, math.nan if no_test else a.std(ddof=1) / math.sqrt(len(a)), len(a) - 1, n, "threshold", alpha)
    b = _on_scale(b, scale)
    n = (len(a), len(b))
    if not len(a) or not len(b):
        return _result(math.nan, math.nan, math.nan, n, "welch", alpha)
    diff = float(a.mean() - b.mean())
    if min(n) < 2 or (_no_spread(a) and _no_spread(b)):
        return _result(diff, math.nan, math.nan, n, "welch", alpha)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch-Satterthwaite
    return _result(diff, math.sqrt(va + vb), dof, n, "welch", alpha)


def compare_paired(a: pd.Series, b: pd.Series, *, alpha: float = ALPHA, scale: str = "ratio") -> Comparison:
    """The paired t-test of two samples indexed by seed, over the seeds both have, on the log scale (``scale``
    as in :func:`compare`): two strategies of one trained model, or two encodings trained with the same seed
    (they see the same batches). Differences that do not vary over the seeds, to rounding, leave nothing to
    estimate the error from: no test (``p`` NaN)."""
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1).dropna()
    d = _on_scale(both.a, scale) - _on_scale(both.b, scale)
    n = (len(d), len(d))
    if not len(d):
        return _result(math.nan, math.nan, math.nan, n, "paired", alpha)
    no_test = len(d) < 2 or _no_spread(d)
    return _result(float(d.mean()), math.nan if no_test else d.std(ddof=1) / math.sqrt(len(d)), len(d) - 1, n,
                   "paired", alpha)


def compare_design(a: pd.Series, b, *, alpha: float = ALPHA, scale: str = "ratio") -> Comparison:
    """The test the design calls for: paired when ``a`` and ``b`` are indexed by the same seeds, Welch's
    test otherwise, a one-sample test when ``b`` is a number; on the log scale (``scale`` as in :func:`compare`)."""
    if isinstance(a, pd.Series) and isinstance(b, pd.Series):
        sa, sb = set(a.dropna().index), set(b.dropna().index)
        if sa == sb and len(sa) > 1:
            return compare_paired(a, b, alpha=alpha, scale=scale)
        return compare(a.to_numpy(), b.to_numpy(), alpha=alpha, scale=scale)
    return compare(a.to_numpy() if isinstance(a, pd.Series) else a, b, alpha=alpha, scale=scale)


def compare_counts(a: pd.DataFrame, b: pd.DataFrame, *, alpha: float = ALPHA) -> Comparison:
    """Accuracies of A against B, seed by seed: ``a`` and ``b`` hold ``correct`` and ``trials`` indexed by seed.

    Each seed's two counts get Fisher's exact test; the comparison is resolved when every shared seed's test is
    resolved in the same direction, and its ``p`` is the largest of theirs (an intersection-union test: level
    ``alpha`` for "every trained model differs"). Why not a t-test on the seeds' accuracies: at 0 or 1 the
    accuracies stop varying, so the t-test's error estimate shrinks as the evidence for a difference weakens
    (three seeds near 0 give a tiny p, three seeds exactly at 0 give none). The exact test's p only shrinks with
    more windows and a larger gap. ``diff`` is the mean over seeds of the accuracy differences, ``low``/``high``
    the smallest and largest of them."""
    seeds = sorted(set(a.index) & set(b.index))
    if not seeds:
        return Comparison(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, (0, 0), "exact", alpha, "accuracy")
    diffs, ps = [], []
    for s in seeds:
        ca, ta, cb, tb = (int(a.loc[s, "correct"]), int(a.loc[s, "trials"]), int(b.loc[s, "correct"]),
                          int(b.loc[s, "trials"]))
        diffs.append(ca / ta - cb / tb)
        ps.append(float(stats.fisher_exact([[ca, ta - ca], [cb, tb - cb]]).pvalue))
    diffs = np.array(diffs)
    same_way = (diffs > 0).all() or (diffs < 0).all()
    p = max(ps) if same_way else 1.0
    return Comparison(float(diffs.mean()), float(diffs.min()), float(diffs.max()), math.nan, math.nan, p,
                      (len(seeds), len(seeds)), "exact", alpha, "accuracy")


def seed_interval(accuracies, *, level: float = 0.95) -> tuple[float, float, float]:
    """The mean of the seeds' accuracies and its t-interval over the seeds, clipped to [0, 1]: ``(mean, low,
    high)``. An interval for display, from the samples that vary between encodings (the seeds), not from the
    windows one model scored; no verdict rests on it (:func:`compare_counts` decides). Seeds that agree give
    a zero width; one seed gives no interval (NaN)."""
    x = np.asarray(accuracies, dtype=float)
    x = x[~np.isnan(x)]
    if not len(x):
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf((1 + level) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, max(0.0, mean - half), min(1.0, mean + half)


# --------------------------------------------------------------------------------------------- margins and power


def p_against_value(c: Comparison, value: float) -> float:
    """The two-sided p of the same t-test with its null moved from 0 to ``value`` (``diff = value``), on the scale
    of ``diff``: how the declared analysis tests a difference against a margin ("at least 10 %"). NaN without a
    test."""
    if not c.se > 0:
        return math.nan
    return float(2 * stats.t.sf(abs(c.diff - value) / c.se, c.df))


def equivalence_p(c: Comparison, margin: float) -> float:
    """Two one-sided tests (TOST) of ``|diff| < margin``: the larger of the p of ``diff <= -margin`` and of
    ``diff >= margin`` against their one-sided alternatives. Below alpha, the ``1 - 2 alpha`` interval of
    ``diff`` lies inside ``(-margin, margin)``: the two are equal within the margin. NaN without a test."""
    if not c.se > 0:
        return math.nan
    lower = stats.t.sf((c.diff + margin) / c.se, c.df)
    upper = stats.t.cdf((c.diff - margin) / c.se, c.df)
    return float(max(lower, upper))


def smallest_resolved(c: Comparison, *, power: float = 0.8) -> float:
    """The smallest difference (on the scale of ``diff``: nats) that ``c``'s test resolves with probability
    ``power`` at its own alpha, given its number of seeds and the spread it observed: statsmodels' power of the
    one-sample (paired, threshold) or two-sample (Welch, pooled spread) t-test, two-sided. NaN without a test."""
    from statsmodels.stats.power import TTestIndPower, TTestPower

    if not c.se > 0:
        return math.nan
    if c.kind in ("paired", "threshold"):
        n = c.n[0]
        sd = c.se * math.sqrt(n)
        d = TTestPower().solve_power(effect_size=None, nobs=n, alpha=c.alpha, power=power, alternative="two-sided")
    else:
        n1, n2 = c.n
        sd = c.se / math.sqrt(1 / n1 + 1 / n2)
        d = TTestIndPower().solve_power(effect_size=None, nobs1=n1, ratio=n2 / n1, alpha=c.alpha, power=power,
                                        alternative="two-sided")
    return float(d) * sd


# --------------------------------------------------------------------------------------------- families


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input's order.

    Sort the m p-values ascending; the k-th smallest (k = 1..m) is multiplied by ``m - k + 1``, the
    running maximum is taken so that the adjusted values keep the order, and each is capped at 1.
    Rejecting where the adjusted value is below alpha controls the family-wise error rate at alpha.
    NaN (no test) is left NaN and not counted in m.
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(len(p), np.nan)
    finite = np.flatnonzero(~np.isnan(p))
    m = len(finite)
    running = 0.0
    for k, i in enumerate(finite[np.argsort(p[finite], kind="stable")]):
        running = max(running, min(1.0, (m - k) * p[i]))
        out[i] = running
    return out.tolist()


def bh(pvalues) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (1995), in the input's order: the k-th smallest of m times ``m / k``,
    then the running minimum from the largest down, capped at 1. Rejecting where it is below q controls the
    false discovery rate at q (independent or positively dependent tests). NaN is left NaN, not counted in m."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(len(p), np.nan)
    finite = np.flatnonzero(~np.isnan(p))
    m = len(finite)
    running = 1.0
    order = finite[np.argsort(p[finite], kind="stable")]
    for k in range(m, 0, -1):
        i = order[k - 1]
        running = min(running, m / k * p[i])
        out[i] = running
    return out.tolist()


def adjusted(table: pd.DataFrame, column: str = "p", *, alpha: float = ALPHA) -> pd.DataFrame:
    """``table`` with Holm's and Benjamini-Hochberg's adjusted values of ``column`` beside it (``p holm``,
    ``p BH``) and ``survives``: which adjustment keeps the row at ``alpha`` (``holm and BH``, ``BH``, ``none``).
    The whole table is one family: an exploratory grid, read in prose only where a difference survives."""
    out = table.copy()
    out[f"{column} holm"] = holm(out[column])
    out[f"{column} BH"] = bh(out[column])
    keep_holm, keep_bh = out[f"{column} holm"] < alpha, out[f"{column} BH"] < alpha
    out["survives"] = np.where(keep_holm, "holm and BH", np.where(keep_bh, "BH", "none"))
    return out


# --------------------------------------------------------------------------------------------- a verdict


def verdict(comparisons: list, want: str | None = None) -> str:
    """The verdict of one claim part (or of one claim in both modes, pooled as one family).

    ``comparisons`` is a list of :class:`Comparison`, each wanted in direction ``want`` (``"<"`` or ``">"``),
    or a list of ``(Comparison, want)`` pairs. A comparison *counts* when it is resolved and reaches its floor.
    ``holds``: every comparison counts in its wanted direction (an intersection-union test: each at alpha);
    ``fails``: some comparison resolved against its direction after Holm's correction over the family reaches
    the floor; ``not resolved (resolved, under 1 %)`` when a resolved difference would decide it but is under
    the floor; ``not resolved`` otherwise, with the direction the means point to; ``no data`` for nothing.
    """
    pairs = [(c, want) if isinstance(c, Comparison) else tuple(c) for c in comparisons]
    pairs = [(c, w) for c, w in pairs if not math.isnan(c.diff)]
    if not pairs:
        return "no data"
    adjusted_p = holm([c.p for c, _ in pairs])
    against = [(c.diff < 0) != (w == "<") for c, w in pairs]
    resolved_against = [bad and p < c.alpha for (c, _), bad, p in zip(pairs, against, adjusted_p)]
    if any(r and c.matters for r, (c, _) in zip(resolved_against, pairs)):
        return "fails"
    if all(c.resolved and not bad for (c, _), bad in zip(pairs, against)):
        if all(c.matters for c, _ in pairs):
            return "holds"
        return "not resolved (resolved, under 1 %)"
    if any(resolved_against):
        return "not resolved (resolved, under 1 %)"
    return f"not resolved (the means point to {'fails' if any(against) else 'holds'})"


def direction(verdict_text: str) -> str:
    """What a verdict says, without its strength: ``holds``/``fails`` for a resolved verdict and for the
    direction an unresolved one names ("not resolved (the means point to holds)" -> ``holds``);
    ``unclear`` for an unresolved verdict that names none, ``no data`` for none."""
    if verdict_text in ("holds", "fails", "no data"):
        return verdict_text
    for word in ("holds", "fails"):
        if f"point to {word}" in verdict_text:
            return word
    return "unclear"
