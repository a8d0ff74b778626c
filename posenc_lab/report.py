"""The results table summarised over seeds, and the claims judged against the noise (``python -m posenc_lab report``).

The tidy table (one row per encoding, strategy, seed, length and mode) is a ``pandas.DataFrame``;
summaries are its group-bys. Every verdict on a claim uses one decision rule, :data:`RULE`: seeds
are the samples, and a difference is *resolved* by a t-test at alpha = 0.05 (``scipy.stats``);
a claim *holds* only when every comparison behind it is resolved in its favour and large enough to
matter, and *fails* when one is resolved against it after Holm's correction. Everything else is
*not resolved*; with a single seed nothing can be resolved, and the direction alone is reported.
The spread over documents of the evaluation text is a separate question:
:func:`document_bootstrap` resamples them.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .errors import PosencError

#: the decision rule of every verdict, in words
RULE = ("Seeds are the samples. A comparison of A and B is a two-sided t-test at alpha = 0.05 with the t "
        "distribution's critical values (scipy.stats): paired, on the per-seed differences, when A and B "
        "were measured on the same seeds (two RoPE strategies of one trained model, or two encodings "
        "trained with the same seed, which see the same batches); Welch's test when the seeds differ; a "
        "one-sample test against a threshold. A claim holds when every comparison behind it is resolved "
        "in its favour (p < 0.05) and every difference is at least 1 % of the value it is compared with; "
        "it fails when some comparison is resolved against it after Holm's correction over that claim's "
        "comparisons; otherwise it is not resolved, and the direction of the means is named. With one "
        "seed nothing is resolved. The verdicts are about this evaluation text: the spread over its "
        "documents is reported apart (a bootstrap over documents), not folded into the test.")
#: perplexity growth above which an encoding is said to "break" (ALiBi paper's ordering)
BREAK = 1.10


def label(row) -> str:
    """``rope/yarn`` for a RoPE strategy, the encoding's name otherwise."""
    return row["encoding"] if row["strategy"] in ("-", "", None) or pd.isna(row["strategy"]) else f"{row['encoding']}/{row['strategy']}"


def frame(rows) -> pd.DataFrame:
    """The tidy results as a DataFrame with a ``label`` column (``rope/ntk``, ``alibi``, ...).

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
    return df


def summarize(rows, metric: str = "perplexity") -> pd.DataFrame:
    """Mean, standard deviation and number of seeds of ``metric`` for every mode, label and length.

    Indexed by ``(eval_mode, label, eval_len)``; NaN (cannot extrapolate) stays NaN.
    """
    df = frame(rows)
    return df.groupby(["eval_mode", "label", "eval_len"])[metric].agg(mean="mean", std="std", n="count")


def _cell(mean: float, std: float, n: int) -> str:
    if math.isnan(mean):
        return "cannot extrapolate"
    return f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"


def markdown_table(rows, mode: str, metric: str = "perplexity", *, labels=None, lengths=None) -> str:
    """One Markdown table: a row per encoding (and RoPE strategy), a column per evaluation length,
    ``mean ± std`` over seeds (the header says how many; ``a/b`` when rows have different numbers of seeds,
    e.g. fine-tuned rows of one seed). A cell no row measured reads "not evaluated"."""
    summary = summarize(rows, metric)
    if mode not in summary.index.get_level_values("eval_mode"):
        raise PosencError(f"no rows for evaluation mode {mode!r}")
    table = summary.loc[mode]
    if labels is not None:
        table = table[table.index.get_level_values("label").isin(labels)]
    if lengths is not None:
        table = table[table.index.get_level_values("eval_len").isin(lengths)]
    cells = table.apply(lambda r: _cell(r["mean"], r["std"], int(r["n"])), axis=1).unstack("eval_len")
    if labels is not None:
        cells = cells.loc[[name for name in labels if name in cells.index]]
    if lengths is not None:
        cells = cells[[n for n in lengths if n in cells.columns]]
    seeds = sorted(set(table["n"].astype(int)) - {0}) or [0]  # the header counts only the rows it shows
    over = f", mean ± std over {seeds[0] if len(seeds) == 1 else '/'.join(map(str, seeds))} seeds" if max(seeds) > 1 else ""
    lines = [f"| {metric} ({mode}{over}) | " + " | ".join(map(str, cells.columns)) + " |",
             "|---" * (len(cells.columns) + 1) + "|"]
    for name, row in cells.iterrows():
        lines.append(f"| {name} | " + " | ".join("not evaluated" if pd.isna(v) else v for v in row) + " |")
    return "\n".join(lines)


def load(out: Path | str) -> tuple[list[dict], list[dict], dict]:
    """Rows, unit records and config of a run folder (or of a committed results folder)."""
    out = Path(out)
    if not (out / "results.json").exists():
        raise PosencError(f"{out} has no results.json: is it the --out folder of a finished or partial run?")
    rows = json.loads((out / "results.json").read_text())
    units = [json.loads(p.read_text()) for p in sorted((out / "units").glob("*.json"))]
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    return rows, units, config


def report(out: Path | str) -> str:
    """The text report of a run: a table for every evaluation mode (figures: :func:`plots.save_report_figures`)."""
    rows, units, config = load(out)
    if not rows:
        raise PosencError(f"{out} has no finished unit yet")
    df = frame(rows)
    first = rows[0]
    text = [f"# {Path(out).name}: preset {first['preset']}, corpus {first['corpus']} "
            f"(sha256 {first['corpus_sha256'][:12]}, Python {first['python']}), trained at {first['train_len']}, "
            f"device {first['device']}, torch {first['torch']}, commit {first['git_commit'][:12]}", ""]
    for mode in sorted(df["eval_mode"].unique()):
        text += [markdown_table(df, mode), ""]
    text.append("bits per byte = loss / ln 2; perplexity = exp(loss), per byte.")
    documents = load_documents(out)
    if documents is not None:
        boot = document_bootstrap(documents)
        text += ["", f"Over the {int(boot['documents'].max())} documents of the evaluation text (perplexity of the "
                 "seeds' mean loss, 95 % percentile bootstrap over documents; easiest and hardest document):", "",
                 "| mode | encoding | length | perplexity | bootstrap 95 % | easiest .. hardest document |",
                 "|---|---|---|---|---|---|"]
        for r in boot.itertuples():
            text.append(f"| {r.eval_mode} | {r.label} | {r.eval_len} | {r.perplexity:.3f} | {r.low:.3f} .. "
                        f"{r.high:.3f} | {r.doc_min:.2f} .. {r.doc_max:.2f} |")
    return "\n".join(text)


def load_documents(out: Path | str) -> pd.DataFrame | None:
    """The per-document losses of a run (``documents.csv``), or None for a run made before they were kept."""
    path = Path(out) / "documents.csv"
    if not path.exists():
        return None
    return frame(pd.read_csv(path, keep_default_na=False, na_values=[""]))


def document_bootstrap(documents, *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Perplexity with a percentile bootstrap interval over the documents of the evaluation text.

    For every mode, label and length: the documents are resampled with replacement (the same draw
    for every seed), each seed's loss is the token-weighted mean over the drawn documents, the seeds'
    losses are averaged and exponentiated. ``perplexity`` is the value on the documents as they are,
    ``low``/``high`` the ``level`` interval of the resamples; ``doc_min``/``doc_max`` the perplexity
    of the easiest and the hardest single document (seeds averaged). The interval answers "how much
    would the number move on other files like these", which the spread over seeds does not.
    """
    df = frame(documents)
    df = df.assign(summed=df["loss"].astype(float) * df["tokens"].astype(float))
    rng = np.random.default_rng(seed)
    records = []
    for (mode, name, length), cell in df.groupby(["eval_mode", "label", "eval_len"], sort=True):
        summed = cell.pivot_table(index="seed", columns="document", values="summed", aggfunc="sum")
        counts = cell.pivot_table(index="seed", columns="document", values="tokens", aggfunc="sum")
        summed, counts = summed.to_numpy(float), counts.to_numpy(float)
        if np.isnan(summed).any():  # a seed without a document (cannot extrapolate, or a partial unit)
            continue
        n_docs = summed.shape[1]
        draws = rng.integers(0, n_docs, size=(resamples, n_docs))
        boot_loss = (summed[:, draws].sum(-1) / counts[:, draws].sum(-1)).mean(0)
        low, high = np.quantile(np.exp(boot_loss), [(1 - level) / 2, (1 + level) / 2])
        per_doc = np.exp((summed / counts).mean(0))
        records.append({"eval_mode": mode, "label": name, "eval_len": int(length), "documents": n_docs,
                        "perplexity": float(np.exp((summed.sum(1) / counts.sum(1)).mean())),
                        "low": float(low), "high": float(high),
                        "doc_min": float(per_doc.min()), "doc_max": float(per_doc.max())})
    return pd.DataFrame(records)


# --------------------------------------------------------------------------------------------- the noise

#: the significance level of every test
ALPHA = 0.05
#: the smallest relative difference that counts as a difference that matters (1 % of the reference value)
PRACTICAL = 0.01


@dataclass(frozen=True)
class Comparison:
    """A two-sided t-test of ``mean(A) - mean(B)`` (:data:`RULE`).

    ``kind`` is ``"welch"`` (two independent samples), ``"paired"`` (samples indexed by the same
    seeds: the test of the per-seed differences) or ``"threshold"`` (one sample against a number).
    ``relative`` is ``diff`` divided by the reference (B's mean or the threshold), the size compared
    with :data:`PRACTICAL`. ``p`` is NaN where no test is possible (one seed, no spread).
    """

    diff: float
    relative: float
    t: float
    df: float
    p: float
    n: tuple[int, int]
    kind: str = "welch"
    alpha: float = ALPHA

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
        """Whether the difference is at least :data:`PRACTICAL` of the reference value."""
        return abs(self.relative) >= PRACTICAL


def _nan_comparison(diff, relative, n, kind, alpha) -> Comparison:
    return Comparison(diff, relative, math.nan, math.nan, math.nan, n, kind, alpha)


def _finish(diff, ref, result, n, kind, alpha) -> Comparison:
    t, p = float(result.statistic), float(result.pvalue)
    df = float(getattr(result, "df", math.nan))
    return Comparison(diff, diff / abs(ref) if ref else math.nan, t, df, p, n, kind, alpha)


def _no_spread(values: np.ndarray) -> bool:
    """Whether ``values`` do not vary, to rounding: a t-test then has nothing to estimate its error from. Equal
    values can come out unequal in their last bits (``np.std([0.998] * 3)`` is about 1e-16, not 0), which would
    otherwise give an unbounded ``t``."""
    return len(values) == 0 or float(np.ptp(values)) <= 1e-12 * max(1.0, float(np.abs(values).max()))


def compare(a, b, *, alpha: float = ALPHA) -> Comparison:
    """Welch's t-test of two samples (values over seeds); ``b`` may be a number (a one-sample t-test
    against a threshold). NaN values (cannot extrapolate) are dropped."""
    a = np.asarray(a, dtype=float)
    a = a[~np.isnan(a)]
    if np.isscalar(b):
        ref = float(b)
        if not len(a):
            return _nan_comparison(math.nan, math.nan, (0, math.inf), "threshold", alpha)
        diff = float(a.mean()) - ref
        if len(a) < 2 or _no_spread(a):
            return _nan_comparison(diff, diff / abs(ref) if ref else math.nan, (len(a), math.inf), "threshold", alpha)
        return _finish(diff, ref, stats.ttest_1samp(a, ref), (len(a), math.inf), "threshold", alpha)
    b = np.asarray(b, dtype=float)
    b = b[~np.isnan(b)]
    if not len(a) or not len(b):
        return _nan_comparison(math.nan, math.nan, (len(a), len(b)), "welch", alpha)
    diff, ref = float(a.mean() - b.mean()), float(b.mean())
    if min(len(a), len(b)) < 2 or (_no_spread(a) and _no_spread(b)):
        return _nan_comparison(diff, diff / abs(ref) if ref else math.nan, (len(a), len(b)), "welch", alpha)
    return _finish(diff, ref, stats.ttest_ind(a, b, equal_var=False), (len(a), len(b)), "welch", alpha)


def compare_paired(a: pd.Series, b: pd.Series, *, alpha: float = ALPHA) -> Comparison:
    """The paired t-test of two samples indexed by seed, over the seeds both have: for two strategies
    applied to the same trained model, and for two encodings trained with the same seed (they see
    the same batches in the same order, :func:`data.batch_at`).

    Differences that do not vary over the seeds (as when every seed scores 0.998 at one length and 0
    at another), to rounding, leave the test nothing to estimate its error from: no test (``p`` NaN)."""
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1).dropna()
    if both.empty:
        return _nan_comparison(math.nan, math.nan, (0, 0), "paired", alpha)
    d = (both.a - both.b).to_numpy(dtype=float)
    diff, ref = float(d.mean()), float(both.b.mean())
    n = (len(both), len(both))
    if len(both) < 2 or _no_spread(d):
        return _nan_comparison(diff, diff / abs(ref) if ref else math.nan, n, "paired", alpha)
    return _finish(diff, ref, stats.ttest_rel(both.a, both.b), n, "paired", alpha)


def compare_design(a: pd.Series, b, *, alpha: float = ALPHA) -> Comparison:
    """The test the design calls for: paired when ``a`` and ``b`` are indexed by the same seeds, Welch's
    test otherwise, a one-sample test when ``b`` is a number."""
    if isinstance(a, pd.Series) and isinstance(b, pd.Series):
        sa, sb = set(a.dropna().index), set(b.dropna().index)
        if sa == sb and len(sa) > 1:
            return compare_paired(a, b, alpha=alpha)
        return compare(a.to_numpy(), b.to_numpy(), alpha=alpha)
    return compare(a.to_numpy() if isinstance(a, pd.Series) else a, b, alpha=alpha)


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


def verdict(comparisons: list, want: str | None = None) -> str:
    """The verdict of one claim part under :data:`RULE`.

    ``comparisons`` is a list of :class:`Comparison`, each wanted in direction ``want`` (``"<"`` or
    ``">"``), or a list of ``(Comparison, want)`` pairs. ``holds``: every comparison resolved in its
    wanted direction at alpha and at least :data:`PRACTICAL` in size (an intersection-union test: its
    error rate is at most alpha without correction); ``fails``: some comparison resolved against its
    direction after Holm's correction over the part's comparisons; ``not resolved`` otherwise, with the
    direction the means point to; ``no data`` when nothing can be compared.
    """
    pairs = [(c, want) if isinstance(c, Comparison) else tuple(c) for c in comparisons]
    pairs = [(c, w) for c, w in pairs if not math.isnan(c.diff)]
    if not pairs:
        return "no data"
    adjusted = holm([c.p for c, _ in pairs])
    against = [(c.diff < 0) != (w == "<") for c, w in pairs]
    if any(bad and p < c.alpha for (c, _), bad, p in zip(pairs, against, adjusted)):
        return "fails"
    if all(c.resolved and not bad for (c, _), bad in zip(pairs, against)):
        if all(c.matters for c, _ in pairs):
            return "holds"
        return f"not resolved (resolved, but a difference is under {PRACTICAL:.0%})"
    return f"not resolved (the means point to {'fails' if any(against) else 'holds'})"


def seed_values(df: pd.DataFrame, mode: str, name: str, length: int, metric: str = "perplexity") -> pd.Series:
    """``metric`` of ``name`` at ``length`` for each seed (indexed by seed)."""
    cell = df[(df.eval_mode == mode) & (df.label == name) & (df.eval_len == length)]
    return cell.set_index("seed")[metric]


def growth(df: pd.DataFrame, mode: str, name: str, length: int) -> pd.Series:
    """``ppl(length) / ppl(train_len)`` for each seed: a seed is compared with itself."""
    train = int(df["train_len"].iloc[0])
    return seed_values(df, mode, name, length) / seed_values(df, mode, name, train)


def _fmt(values: pd.Series) -> str:
    values = values.dropna()
    if values.empty:
        return "n/a"
    return f"{values.mean():.3f} ± {values.std():.3f}" if len(values) > 1 else f"{values.mean():.3f}"


def claims(rows, mode: str, *, judged_len: int = 2048, alpha: float = ALPHA) -> list[dict]:
    """The article's three claims and the ALiBi paper's ordering, as they were written, judged at
    ``judged_len`` in one mode.

    ``judged_len`` is the article's 4x of 512 (2048); the claims speak of "beyond training", and each
    verdict names the length it used. Every verdict states its criterion, the numbers (mean ± std
    over seeds) and the decision rule, so a reader can disagree with the criterion without having to
    trust the conclusion. Encodings and strategies are compared seed by seed when both have the same
    seeds (:func:`compare_design`). Fine-tuned rows (``+ft``) are not schemes of their own here: they
    had more training.
    """
    df = frame(rows)
    df = df[df.eval_mode == mode]
    lengths = sorted(df["eval_len"].unique())
    train = int(df["train_len"].iloc[0])
    if judged_len not in lengths:
        judged_len = lengths[-1]
    n = judged_len
    out = []

    def cmp(a, b):
        return compare_design(a, b, alpha=alpha)

    def g(name, length=n):
        return growth(df, mode, name, length)

    def ppl(name, length=n):
        return seed_values(df, mode, name, length)

    labels = sorted(name for name in df["label"].unique() if "+ft" not in name)
    runs_at_n = [name for name in labels if not ppl(name).isna().all()]
    encodings = [name for name in runs_at_n if not name.startswith("rope/") or name == "rope/none"]
    others = [c for c in encodings if c != "alibi"]
    out.append({
        "id": "1",
        "claim": "1. ALiBi is slightly worse than RoPE at the training length but the most stable beyond it",
        "criterion": f"(a) ALiBi's perplexity at {train} above RoPE's (no scaling); (b) ALiBi's growth "
                     f"ppl({n}) / ppl({train}) below that of every other encoding that can run at {n}",
        "numbers": f"at {train}: ALiBi {_fmt(ppl('alibi', train))}, RoPE {_fmt(ppl('rope/none', train))}; growth to "
                   f"{n}: " + ", ".join(f"{c} {_fmt(g(c))}" for c in sorted(encodings, key=lambda c: g(c).mean())),
        "verdicts": {
            "a (worse at training length)": verdict([cmp(ppl("alibi", train), ppl("rope/none", train))], ">"),
            "b (most stable)": verdict([cmp(g("alibi"), g(c)) for c in others], "<"),
        },
    })
    ntk_like = ("rope/ntk", "rope/dynamic-ntk")

    def most_accurate(name, rivals):
        return verdict([cmp(ppl(name), ppl(s)) for s in rivals], "<") if name in runs_at_n else "no data"

    rivals = [s for s in runs_at_n if s not in ntk_like]
    out.append({
        "id": "2",
        "claim": "2. RoPE with NTK-aware scaling is the most accurate of all schemes past the training length",
        "criterion": f"ntk (and, separately, dynamic-ntk) has a lower perplexity at {n} than every other scheme that "
                     f"runs there: every encoding and every RoPE strategy without fine-tuning; (ours, not the "
                     f"article's) the same test for yarn",
        "numbers": f"at {n}: " + ", ".join(f"{s} {_fmt(ppl(s))}" for s in sorted(runs_at_n, key=lambda s: ppl(s).mean())),
        "verdicts": {
            "ntk most accurate": most_accurate("rope/ntk", rivals),
            "dynamic-ntk most accurate": most_accurate("rope/dynamic-ntk", rivals),
            "yarn most accurate (ours)": most_accurate("rope/yarn", [s for s in runs_at_n if s != "rope/yarn"]),
        },
    })
    out.append({
        "id": "3",
        "claim": "3. T5's bias extrapolates clearly worse than RoPE and ALiBi",
        "criterion": f"T5's growth ppl({n}) / ppl({train}) above RoPE's (no scaling) and above ALiBi's",
        "numbers": f"growth to {n}: T5 {_fmt(g('t5'))}, RoPE {_fmt(g('rope/none'))}, ALiBi {_fmt(g('alibi'))}",
        "verdicts": {"worse than RoPE": verdict([cmp(g("t5"), g("rope/none"))], ">"),
                     "worse than ALiBi": verdict([cmp(g("t5"), g("alibi"))], ">")},
    })
    beyond = [length for length in lengths if train < length <= n] or [length for length in lengths if length > train]
    if not beyond:
        return out
    first, last = beyond[0], beyond[-1]

    def breaks(name, length):  # one-sample test of the growth against BREAK
        return cmp(g(name, length), BREAK)

    def first_break(name):
        for length in beyond:
            c = breaks(name, length)
            if c.resolved and c.diff > 0:
                return length
        return None

    names = ("sinusoidal", "rope/none", "t5", "alibi")
    order = {name: first_break(name) for name in names}
    out.append({
        "id": "ordering",
        "claim": "ALiBi paper's ordering: sinusoidal breaks first, then rotary, T5 holds to about 2x, ALiBi stays flat",
        "criterion": f"an encoding breaks at a length when its growth over the training length exceeds {BREAK} "
                     f"(a one-sample test against {BREAK}); judged at {', '.join(map(str, beyond))}. Sinusoidal "
                     f"breaks first: it breaks at {first} and grows more there than rotary, T5 and ALiBi. Then "
                     f"rotary: rotary breaks by {last} and grows less than sinusoidal at {first}. T5 holds: below "
                     f"{BREAK} up to {2 * train}. ALiBi stays flat: below {BREAK} everywhere",
        "numbers": "; ".join(f"{name}: breaks at {order[name] or 'no length'} (growth "
                             + ", ".join(f"{length}: {_fmt(g(name, length))}" for length in beyond) + ")"
                             for name in names),
        "verdicts": {  # an order needs two lengths past the training length ("no data" with one)
            "sinusoidal breaks first": verdict([(breaks("sinusoidal", first), ">")]
                                               + [(cmp(g("sinusoidal", first), g(o, first)), ">")
                                                  for o in ("rope/none", "t5", "alibi")]) if first < last else "no data",
            "then rotary": verdict([(breaks("rope/none", last), ">"),
                                    (cmp(g("rope/none", first), g("sinusoidal", first)), "<")])
                           if first < last else "no data",
            "T5 holds to 2x": verdict([breaks("t5", length) for length in beyond if length <= 2 * train], "<"),
            "ALiBi stays flat": verdict([breaks("alibi", length) for length in beyond], "<"),
        },
    })
    return out


def claims_text(rows, mode: str, *, judged_len: int = 2048, width: int = 76, rule: bool = True,
                criteria: bool = True) -> str:
    """:func:`claims` as plain text wrapped at ``width``: the decision rule first (unless ``rule=False``), then each
    claim with its criterion (unless ``criteria=False``, for a second mode of claims already printed), the
    numbers measured and the verdicts."""
    lines = textwrap.wrap(f"decision rule: {RULE}", width) + [""] if rule else []
    for c in claims(rows, mode, judged_len=judged_len):
        lines += textwrap.wrap(c["claim"], width, subsequent_indent="   ")
        parts = ([("criterion", c["criterion"])] if criteria else []) + [(f"measured ({mode})", c["numbers"])]
        for name, text in parts:
            lines += textwrap.wrap(f"{name}: {text}", width, initial_indent="  ", subsequent_indent="    ")
        for part, v in c["verdicts"].items():
            lines += textwrap.wrap(f"verdict, {part}: {v}", width, initial_indent="  ", subsequent_indent="    ")
        lines.append("")
    return "\n".join(lines).rstrip()


def verdict_table(rows, *, modes=("nonoverlapping", "sliding"), judged_lens=(2048,), alpha: float = ALPHA) -> pd.DataFrame:
    """Every claim's verdicts in one table: a row per claim and part, a column per (mode, judged length)."""
    df = frame(rows)
    measured = {mode: set(df.loc[df.eval_mode == mode, "eval_len"]) for mode in modes}
    records = [{"claim": f"{c['id']}: {part}", "mode": mode, "judged at": length, "verdict": v}
               for mode in modes for length in judged_lens if length in measured[mode]
               for c in claims(df, mode, judged_len=length, alpha=alpha) for part, v in c["verdicts"].items()]
    table = pd.DataFrame(records).pivot(index="claim", columns=["mode", "judged at"], values="verdict")
    return table.loc[list(dict.fromkeys(r["claim"] for r in records))]


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


def verdicts_side_by_side(runs: dict, *, mode: str = "sliding", judged_len: int = 2048,
                          alpha: float = ALPHA) -> pd.DataFrame:
    """The claims' verdicts of several runs (``{name: rows}``) at one mode and judged length: a column per
    run, then ``same verdict`` (identical text) and ``same direction`` (:func:`direction`), for the
    question "which verdicts changed between two budgets (or set-ups)?". A run that cannot judge a
    claim there shows ``no data``."""
    columns = {}
    for name, rows in runs.items():
        table = verdict_table(rows, modes=(mode,), judged_lens=(judged_len,), alpha=alpha)
        columns[name] = table[(mode, judged_len)] if (mode, judged_len) in table else pd.Series(dtype=object)
    side = pd.DataFrame(columns).fillna("no data")
    side["same verdict"] = side[list(runs)].nunique(axis=1) == 1
    side["same direction"] = side[list(runs)].apply(lambda r: r.map(direction).nunique() == 1, axis=1)
    return side


def spread_at_training_length(rows, labels, *, mode: str = "nonoverlapping") -> dict:
    """How far apart ``labels`` are at the training length: per label the mean perplexity over seeds,
    and ``spread = max / min - 1`` of those means (issue 20's goal: within 10 % for RoPE, ALiBi, T5
    and sinusoidal, as in the converged literature's 2 %)."""
    df = frame(rows)
    train = int(df["train_len"].iloc[0])
    means = {name: float(seed_values(df, mode, name, train).mean()) for name in labels}
    missing = [name for name, v in means.items() if math.isnan(v)]
    if missing:
        raise PosencError(f"no {mode} rows at the training length ({train}) for {', '.join(missing)}")
    return {"means": means, "spread": max(means.values()) / min(means.values()) - 1, "train_len": train}


def versus(rows, pairs, *, mode: str, lengths=None, metric: str = "perplexity", alpha: float = ALPHA) -> pd.DataFrame:
    """Label A against label B at each length, under :data:`RULE`'s test (:func:`compare_design`: paired over the
    seeds both have when they have the same seeds). ``pairs`` is a list of ``(a, b)`` labels; ``lengths``
    defaults to every length both were evaluated at in ``mode``. One row per pair and length: ``a``, ``b``,
    ``eval_len``, the seed means ``mean a`` and ``mean b``, ``relative`` (``(a - b) / b`` of the means), the
    test's ``p`` and ``test`` (paired, welch), and ``sign``: ``<`` or ``>`` where the difference is resolved at
    ``alpha``, ``~`` where it is not. A difference, not a claim: which direction a paper predicts is for the
    caller to say (:func:`verdict`)."""
    df = frame(rows)
    records = []
    for a, b in pairs:
        missing = [name for name in (a, b) if not (df.label == name).any()]
        if missing:
            raise PosencError(f"no rows for {', '.join(missing)}")
        shared = set(df.loc[(df.eval_mode == mode) & (df.label == a), "eval_len"]) & set(
            df.loc[(df.eval_mode == mode) & (df.label == b), "eval_len"])
        for n in sorted(shared if lengths is None else shared & set(lengths)):
            va, vb = seed_values(df, mode, a, n, metric), seed_values(df, mode, b, n, metric)
            c = compare_design(va, vb, alpha=alpha)
            records.append({"a": a, "b": b, "eval_len": n, "mean a": float(va.mean()), "mean b": float(vb.mean()),
                            "relative": c.relative, "p": c.p, "test": c.kind, "sign": c.sign})
    return pd.DataFrame(records, columns=["a", "b", "eval_len", "mean a", "mean b", "relative", "p", "test", "sign"])


#: the rows of the README's headline tables, in the order of the registry
HEADLINE_LABELS = ("nope", "sinusoidal", "learned", "rope/none", "rope/pi", "rope/ntk", "rope/dynamic-ntk", "rope/yarn",
                   "xpos", "alibi", "t5", "kerple", "fire")


def headline(rows, *, judged_len: int = 2048) -> str:
    """The README's headline: both modes' tables (mean ± std over seeds) and the claims' verdicts at
    ``judged_len``, as Markdown. The README holds exactly this text (a test checks it)."""
    labels = [name for name in HEADLINE_LABELS if name in set(frame(rows)["label"])]
    verdicts = verdict_table(rows, judged_lens=(judged_len,))
    lines = ["| claim (judged at %d) | sliding | non-overlapping |" % judged_len, "|---|---|---|"]
    for claim, row in verdicts.iterrows():
        lines.append(f"| {claim} | {row[('sliding', judged_len)]} | {row[('nonoverlapping', judged_len)]} |")
    return "\n\n".join([markdown_table(rows, "sliding", labels=labels),
                        markdown_table(rows, "nonoverlapping", labels=labels), "\n".join(lines)])


# --------------------------------------------------------------------------------------------- the budget


def load_checkpoints(out: Path | str) -> pd.DataFrame | None:
    """The evaluations along training of a run (``checkpoints.csv``), or None for a run made before they were kept."""
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
    copies = [plain.assign(strategy=s, label=f"rope/{s}") for s in sorted(df.loc[df.encoding == "rope", "strategy"].unique())
              if s != "none" and df[(df.strategy == s) & (df.eval_len == train)].empty]
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
    past the training length, "T5 holds to 2x" a length of 2x) is left out of the table and named in
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
