"""The claims' verdicts for a reader: several runs side by side, and each claim in words with the comparison it
rests on (the README's and chapter 10's first screen)."""

from __future__ import annotations

from .extras import require

require("lab", "posenc_lab.findings")

import math

import pandas as pd

from .claims import Quantity, Test, claims, values
from .stats import ALPHA, Comparison, frame, holm, verdict



def deciding(pairs: list) -> tuple:
    """The comparison a verdict rests on: of ``(Test, Comparison)`` pairs, the strongest one resolved against the
    claim (a ``fails`` rests on it), else the one with the largest p (the weakest link of a claim that needs every
    comparison)."""
    against = [(t, c) for t, c in pairs if c.matters and c.sign not in ("~", t.want)]
    if against:
        return min(against, key=lambda tc: tc[1].p)
    return max(pairs, key=lambda tc: (-1 if math.isnan(tc[1].p) else tc[1].p))


def pooled_comparisons(rows, *, judged_len: int = 2048, modes=("sliding", "nonoverlapping"),
                       alpha: float = ALPHA) -> dict[str, list]:
    """Each claim part's comparisons in every mode, judged once: ``{part: [(Test, Comparison, mode), ...]}``, the
    family :func:`~posenc_lab.claims.decided` decides a part in."""
    pooled: dict[str, list] = {}
    for mode in modes:
        for c in claims(rows, mode, judged_len=judged_len, alpha=alpha):
            for part, pairs in c["comparisons"].items():
                pooled.setdefault(f"{c['id']}: {part}", []).extend((t, cmp, mode) for t, cmp in pairs)
    return pooled


def _rests_on(triples: list) -> tuple:
    """The ``(Test, Comparison, mode)`` a part's verdict rests on (:func:`deciding`) and its index in ``triples``."""
    t, cmp = deciding([(t, c) for t, c, _ in triples])
    k = next(i for i, (_, c, _) in enumerate(triples) if c is cmp)
    return triples[k], k


def side_by_side(runs: dict, *, judged_len: int = 2048, modes=("sliding", "nonoverlapping"),
                 alpha: float = ALPHA) -> pd.DataFrame:
    """Every claim's verdict in several runs (``{name: rows}``: two recipes, two domains): per run the verdict
    decided from both modes (as :func:`~posenc_lab.claims.decided`: one family) and the comparison it rests on
    (:func:`deciding`, over both modes' comparisons: ``A / B = ratio [95 % interval], p`` and its mode); then
    ``same verdict`` across the runs."""
    table = {}
    for name, rows in runs.items():
        pooled = pooled_comparisons(rows, judged_len=judged_len, modes=modes, alpha=alpha)
        table[(name, "verdict")] = {part: verdict([(c, t.want) for t, c, _ in triples])
                                    for part, triples in pooled.items()}
        effects = {}
        for part, triples in pooled.items():
            (t, cmp, mode), _ = _rests_on(triples)
            against = t.b.label if isinstance(t.b, Quantity) else f"{t.b:g}"
            effects[part] = f"{t.a.label} / {against} = {cmp.reading()} ({mode})"
        table[(name, "rests on")] = effects
    side = pd.DataFrame(table)
    side.columns = pd.MultiIndex.from_tuples(side.columns)
    side[("all runs", "same verdict")] = side.xs("verdict", axis=1, level=1).nunique(axis=1) == 1
    return side


#: each claim part as its source states it, in words
STATEMENTS = {
    "1: a (worse at training length)": "ALiBi is slightly worse than RoPE at the training length (the article).",
    "1: b (most stable)": "ALiBi is the most stable encoding past the training length (the article).",
    "2: ntk most accurate": "RoPE with NTK-aware scaling is the most accurate past the training length (the article).",
    "2: dynamic-ntk most accurate": "RoPE with dynamic NTK is the most accurate past the training length (the article).",
    "2: yarn most accurate (ours)": "RoPE with YaRN is the most accurate past the training length (our question).",
    "3: worse than RoPE": "T5's bias extrapolates clearly worse than RoPE (the article).",
    "3: worse than ALiBi": "T5's bias extrapolates clearly worse than ALiBi (the article).",
    "ordering: sinusoidal breaks first": "The sinusoids break first (the ALiBi paper).",
    "ordering: then rotary": "RoPE breaks after the sinusoids (the ALiBi paper).",
    "ordering: T5 holds to 2x": "T5 holds to about twice the training length (the ALiBi paper).",
    "ordering: ALiBi stays flat": "ALiBi stays flat (the ALiBi paper).",
}
NAMES = {"nope": "NoPE", "sinusoidal": "the sinusoids", "learned": "the learned table", "rope/none": "RoPE",
         "rope/pi": "RoPE with PI", "rope/ntk": "RoPE with NTK", "rope/dynamic-ntk": "RoPE with dynamic NTK",
         "rope/yarn": "RoPE with YaRN", "alibi": "ALiBi", "t5": "T5", "xpos": "xPos", "kerple": "KERPLE",
         "fire": "FIRE", "ssmax": "SSMax", "ssmax-rope": "SSMax on RoPE", "nope-temp": "Llama 4's temperature",
         "irope": "iRoPE", "gemma3": "Gemma 3's layers", "rnope-swa": "RNoPE-SWA", "fope": "FoPE", "fox": "FoX",
         "cope": "CoPE"}


def _name(label: str) -> str:
    return NAMES.get(label, label)


def _of(label: str) -> str:
    name = _name(label)
    return name + ("'" if name.endswith("s") else "'s")


def effect_in_words(test: Test, cmp: Comparison, train: int, means: dict | None = None) -> str:
    """One comparison as a reader says it: ``ALiBi's perplexity at 512 is 0.90 times RoPE's [0.86, 0.95]``.

    A flatness test (the size of the log growth) is said as the two sizes and their difference (``means``: the
    mean ``|log growth|`` of each label); a test against a line as the growth factor and the line."""
    low, high = cmp.interval
    a = test.a
    if not isinstance(test.b, Quantity):  # a one-sample test of a growth against a line
        b = float(test.b)
        return (f"{_of(a.label)} perplexity changes by a factor of {cmp.ratio * b:.3f} from {train} to {a.length:,} "
                f"[{low * b:.3f}, {high * b:.3f}] (the breaking threshold is {b:g})")
    if a.kind == "flatness":
        sizes = f" is {means[a.label]:.3f} against {_of(test.b.label)} {means[test.b.label]:.3f}" if means else ""
        return (f"{_of(a.label)} |log growth| to {a.length:,}{sizes}, a difference of {cmp.diff:+.3f} "
                f"[{cmp.low:+.3f}, {cmp.high:+.3f}]")
    what = {"level": f"perplexity at {a.length:,}", "growth": f"growth to {a.length:,}"}[a.kind]
    return f"{_of(a.label)} {what} is {cmp.ratio:.2f} times {_of(test.b.label)} [{low:.2f}, {high:.2f}]"


def findings(rows, *, judged_len: int = 2048, alpha: float = ALPHA) -> list[dict]:
    """Each claim part for a reader: ``claim`` (as its source states it), ``verdict`` (decided from both modes),
    ``effect`` (the comparison it rests on, :func:`deciding`, in words), its ``p``, ``p_holm`` (adjusted over the
    claim part's comparisons in both modes, the family the verdict is decided in) and ``mode``."""
    df = frame(rows)
    train = int(df["train_len"].iloc[0])
    out = []
    for part, triples in pooled_comparisons(rows, judged_len=judged_len, alpha=alpha).items():
        (t, cmp, mode), k = _rests_on(triples)
        means = ({q.label: float(values(df, mode, q).mean()) for q in (t.a, t.b)}
                 if t.a.kind == "flatness" else None)
        out.append({"part": part, "claim": STATEMENTS.get(part, part),
                    "verdict": verdict([(c, t_.want) for t_, c, _ in triples]),
                    "effect": effect_in_words(t, cmp, train, means), "p": cmp.p,
                    "p_holm": holm([c.p for _, c, _ in triples])[k], "mode": mode})
    return out


def verdict_in_words(verdict: str) -> str:
    """``holds`` -> ``Holds``; ``fails`` -> ``Does not hold``; ``not resolved (the means point to fails)`` ->
    ``Not resolved (the means lean against it)``."""
    if verdict.startswith("not resolved"):
        lean = " (the means lean against it)" if "fails" in verdict else " (the means lean towards it)" \
            if "holds" in verdict else ""
        return "Not resolved" + lean
    return {"holds": "Holds", "fails": "Does not hold"}.get(verdict, verdict[0].upper() + verdict[1:])


def findings_markdown(rows, *, judged_len: int = 2048) -> str:
    """:func:`findings` as a Markdown list, one line a claim part (the README's and chapter 10's first screen)."""
    lines = []
    for f in findings(rows, judged_len=judged_len):
        effect = f["effect"][0].upper() + f["effect"][1:]
        lines.append(f"- {f['claim']} **{verdict_in_words(f['verdict'])}.** {effect}, p = {f['p']:.2g}, "
                     f"{f['p_holm']:.2g} after Holm ({f['mode'].replace('nonoverlapping', 'non-overlapping')} "
                     "windows).")
    return "\n".join(lines)


def mean_loss_at_train_len(rows, labels, *, mode: str = "nonoverlapping") -> float:
    """The mean loss (nats per byte) at the training length over ``labels`` and every seed of a run's ``rows``: the
    measure by which the better-trained of two recipes is chosen."""
    df = frame(rows)
    at = df[(df.eval_mode == mode) & (df.eval_len == df.train_len) & df.label.isin(labels)]
    return float(at["loss"].mean())


#: the references every newer method is set against: the flattest classic encoding and RoPE's best strategy
BASELINES = ("alibi", "rope/yarn")


def against_baselines(rows, methods, *, baselines=BASELINES, lengths=None, modes=("nonoverlapping", "sliding"),
                      alpha: float = ALPHA) -> pd.DataFrame:
    """Each of ``methods`` against each of ``baselines`` at each length both were evaluated at (``lengths``: a
    subset), in each mode: :func:`~posenc_lab.report.versus` (a paired t-test over the seeds on the log scale,
    when both were trained with the same seeds and batches), every row one exploratory family. Adds ``outcome``:
    ``lower`` or ``higher`` (perplexity against the baseline) where the difference is at least 1 % and survives
    Benjamini-Hochberg at ``alpha`` over the whole table, ``not resolved`` otherwise."""
    from .report import versus

    return judged(versus(rows, [(m, b) for b in baselines for m in methods], mode=modes, lengths=lengths, alpha=alpha))


def judged(table: pd.DataFrame) -> pd.DataFrame:
    """A :func:`~posenc_lab.report.versus` table with ``outcome``: ``lower`` or ``higher`` where the difference is at
    least 1 % and survives Benjamini-Hochberg over the table, ``not resolved`` otherwise."""
    counts = (table["sign"] != "~") & (table["survives"] != "none")
    return table.assign(outcome=table["sign"].map({"<": "lower", ">": "higher"}).where(counts, "not resolved"))


def against_in_words(table: pd.DataFrame, baseline: str, length: int, mode: str = "nonoverlapping") -> str:
    """One line of :func:`against_baselines`' table in words: which methods have a lower perplexity than
    ``baseline`` at ``length`` in ``mode``, which a higher one, and which are not resolved, each lower or higher
    one with its ratio."""
    cell = table[(table["b"] == baseline) & (table["eval_len"] == length)]
    if "mode" in cell:
        cell = cell[cell["mode"] == mode]
    if cell.empty:
        raise ValueError(f"no comparison with {baseline} at {length} in {mode} windows")
    parts = []
    for outcome in ("lower", "higher", "not resolved"):
        these = cell[cell["outcome"] == outcome].sort_values("ratio")
        if these.empty:
            continue
        named = [_name(r.a) + ("" if outcome == "not resolved" else f" ({r.ratio:.2f})") for r in these.itertuples()]
        parts.append(f"{outcome}: {', '.join(named)}")
    return f"Against {_name(baseline)} at {length:,}, " + "; ".join(parts) + "."


def learned_methods(rows, methods) -> tuple[list[str], list[str]]:
    """Which of ``methods`` learned a retrieval run's task (every seed at least
    :data:`~posenc_lab.accuracy.LEARNED` at the end of training), and which did not: ``(learned, not_learned)``."""
    from .accuracy import LEARNED, by_length

    table = by_length(rows)
    lowest = table.groupby(level="label")["train_accuracy"].min()
    learned = [m for m in methods if m in lowest.index and lowest[m] >= LEARNED]
    return learned, [m for m in methods if m not in learned]


def retrieval_against_baselines(rows, methods, *, baselines=BASELINES, floor: float = 0.01,
                                alpha: float = ALPHA) -> pd.DataFrame:
    """The exact match of each of ``methods`` in a retrieval run's ``rows`` against each of ``baselines`` at every
    length, and against itself at the training length at every longer one. Chapter 9's rule for counts
    (:func:`~posenc_lab.stats.compare_counts`: Fisher's exact test per seed, resolved when every seed's test is
    resolved the same way, ``p`` the largest of theirs); the whole grid one exploratory family, adjusted by Holm and
    Benjamini-Hochberg (:func:`~posenc_lab.stats.adjusted`). ``outcome``: ``higher`` or ``lower`` where the mean
    difference is at least ``floor`` and survives Benjamini-Hochberg at ``alpha``, ``not resolved`` otherwise.
    Columns: ``method``, ``against``, ``multiple`` (of the training length), ``eval_len``, ``difference`` (the mean
    over seeds), ``low``/``high`` (the smallest and largest seed's), ``seeds``, ``p``, ``p holm``, ``p BH``,
    ``survives``, ``outcome``. Pass the methods that learned the task (:func:`learned_methods`): a method that did not
    says nothing about extrapolation."""
    from .accuracy import frame as retrieval_frame, seed_counts
    from .stats import adjusted, compare_counts

    counts = seed_counts(rows)
    cells = counts.index.droplevel("seed").unique()  # (label, eval_len)
    train_len = int(retrieval_frame(rows)["train_len"].iloc[0])
    records = []
    for method in methods:
        for n in sorted(n for label, n in cells if label == method):
            others = [(b, (b, n)) for b in baselines if (b, n) in cells]
            if n > train_len:
                others.append(("itself at L", (method, train_len)))
            for against, key in others:
                c = compare_counts(counts.loc[(method, n)], counts.loc[key], alpha=alpha)
                records.append({"method": method, "against": against, "multiple": n // train_len, "eval_len": int(n),
                                "difference": c.diff, "low": c.low, "high": c.high, "seeds": c.n[0], "p": c.p})
    columns = ["method", "against", "multiple", "eval_len", "difference", "low", "high", "seeds", "p"]
    family = adjusted(pd.DataFrame(records, columns=columns), alpha=alpha)
    counted = (family["p BH"] < alpha) & (family["difference"].abs() >= floor)
    outcome = family["difference"].gt(0).map({True: "higher", False: "lower"})
    return family.assign(outcome=outcome.where(counted, "not resolved"))
