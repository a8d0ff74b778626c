"""The article's claims and the ALiBi paper's ordering, as tests of per-seed log-scale quantities.

A claim part is a list of :class:`Test`: a quantity of one label (a log perplexity at a length, a log
growth, or the size of a log growth) against another label's or against a threshold, wanted below
or above. The same tests are judged by t-tests over the seeds (:func:`claims`) and by a paired
bootstrap over the documents of the evaluation text (:func:`claim_bootstrap`), so that the two read
exactly the same differences.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.verdicts.claims")

import math
import textwrap
from dataclasses import dataclass

import numpy as np
import pandas as pd

from posenc_lab.lab.verdicts.statistics import (ALPHA, Comparison, FLOOR, compare_design, equivalence_p, frame, holm,
                                                log_growth, p_against_value, seed_values)
from posenc_lab.lab.labels import Label

#: perplexity growth above which an encoding is said to "break" (the book's constant, used for the ALiBi paper's ordering)
BREAK = 1.10
#: the margins of the declared analysis (book/analysis.md), on the log scale: "slightly worse" is worse by less than
#: 10 %, "clearly worse" a growth at least 10 % larger, "stays flat" a growth within 5 % of 1 either way
SLIGHTLY, CLEARLY, FLAT = math.log(1.10), math.log(1.10), math.log(1.05)
#: the evaluation mode every claim is decided in, and the mode that checks it (book/analysis.md)
PRIMARY, SENSITIVITY = "sliding", "nonoverlapping"
#: the decision rule of every verdict, in words (the declared analysis, book/analysis.md, says it at length)
RULE = ("Seeds are the samples; perplexities are compared on the log scale (a level is a log perplexity, a growth "
        "is ppl(L') / ppl(L) and its log the difference of losses). Each comparison is a paired t-test over the "
        "seeds (a one-sample test against a line), two-sided at alpha = 0.05, i.e. one-sided at 2.5 % in the "
        "claimed direction; a difference counts only when resolved and at least 1 % (the floor, log 1.01). Each "
        "claim's words are a test with a margin fixed in advance: 'slightly worse' is resolved and below 10 %; "
        "'degrades least' is the signed log growth below every other encoding's; 'clearly worse' is a growth at "
        "least 10 % larger (the interval's lower end above log 1.10); 'stays flat' is an equivalence (two one-sided "
        "tests, the 90 % interval inside +-log 1.05); 'holds to about twice' is below a growth of 1.10 at 2x and "
        "above it at 4x. A part holds when every comparison behind it holds (an intersection-union test); it does "
        "not hold when one counts against it after Holm's correction over the part; a directional part whose "
        "remaining comparisons are equivalent within the floor reads 'equal within 1 %'; otherwise it is not "
        "resolved, inside the floor or for too few seeds (the smallest effect resolved with 80 % power is printed). "
        "Sliding windows are the primary mode; non-overlapping windows the sensitivity analysis; a part whose two "
        "modes resolve opposite ways is 'mode-dependent'. Accuracies are compared seed by seed with Fisher's exact "
        "test. The verdicts are about this evaluation text: a paired bootstrap over its documents and a crossed seed "
        "x document model are reported beside the t-tests.")


@dataclass(frozen=True)
class Quantity:
    """One label's per-seed value on the log scale: ``level`` (loss at ``length``), ``growth`` (log of
    ppl(length) / ppl(train)) or ``flatness`` (the size of that log growth, whichever its sign)."""

    kind: str
    label: str
    length: int

    def __str__(self) -> str:
        what = {"level": "log ppl", "growth": "log growth", "flatness": "|log growth|"}[self.kind]
        return f"{self.label} {what} at {self.length}"


@dataclass(frozen=True)
class Test:
    """``a`` against ``b`` (a :class:`Quantity`, or a line given as a ratio, compared with ``log(b)``), read as the
    claim's words say (``reading``, with its ``margin`` on the log scale; book/analysis.md):

    * ``"direction"``: ``a`` below (``want="<"``) or above (``">"``) ``b``, by at least the floor;
    * ``"slightly"``: ``a`` above ``b`` by at least the floor and by less than ``margin`` (``want=">"``);
    * ``"clearly"``: ``a`` above ``b`` by more than ``margin`` (``want=">"``);
    * ``"equivalent"``: ``a`` within ``margin`` of ``b`` either way (``want="="``; two one-sided tests).
    """

    a: Quantity
    b: Quantity | float
    want: str
    reading: str = "direction"
    margin: float = 0.0


def values(df: pd.DataFrame, mode: str, q: Quantity) -> pd.Series:
    """The per-seed values of ``q`` (nats) in ``mode``."""
    if q.kind == "level":
        return seed_values(df, mode, q.label, q.length, "loss")
    g = log_growth(df, mode, q.label, q.length)
    return g.abs() if q.kind == "flatness" else g


def run_test(df: pd.DataFrame, mode: str, test: Test, *, alpha: float = ALPHA) -> Comparison:
    """The t-test behind ``test`` on the log scale (:func:`~posenc_lab.lab.verdicts.statistics.compare_design`)."""
    b = math.log(test.b) if isinstance(test.b, (int, float)) else values(df, mode, test.b)
    return compare_design(values(df, mode, test.a), b, alpha=alpha, scale="log")


def _fmt(values: pd.Series) -> str:
    values = values.dropna()
    if values.empty:
        return "n/a"
    return f"{values.mean():.3f} ± {values.std():.3f}" if len(values) > 1 else f"{values.mean():.3f}"


def _setting(df: pd.DataFrame, mode: str, judged_len: int):
    df = df[df.eval_mode == mode]
    lengths = sorted(df["eval_len"].unique())
    n = judged_len if judged_len in lengths else lengths[-1]
    labels = sorted(name for name in df["label"].unique() if not Label.parse(name).finetuned)
    runs = [name for name in labels if not seed_values(df, mode, name, n).isna().all()]
    # one label per encoding: the label without a strategy, or with the strategy "none" (the model as trained)
    encodings = [name for name in runs if Label.parse(name).as_trained]
    return df, lengths, int(df["train_len"].iloc[0]), n, runs, encodings


def claim_1b_tests(df, mode: str, judged_len: int, reading: str = "growth") -> list[Test]:
    """Claim 1b, "ALiBi is the most stable beyond the training length", as tests of ALiBi against every other
    encoding that runs at ``judged_len``.

    The article says ALiBi "在外推中表现最稳定" ("performs most stably in extrapolation"), against encodings that
    degrade. The declared reading (``"growth"``) is "degrades least": ALiBi's signed log growth below every other
    encoding's. The size of the log growth, ``|log(ppl(L') / ppl(L))|`` (``"flatness"``), is kept as a sensitivity
    reading: it scores a perplexity that falls with length as unstable, which is not what the article means."""
    _, _, _, n, _, encodings = _setting(df, mode, judged_len)
    return [Test(Quantity(reading, "alibi", n), Quantity(reading, c, n), "<") for c in encodings if c != "alibi"]


def _ordering(df, lengths, train, n) -> dict:
    beyond = [length for length in lengths if train < length <= n] or [length for length in lengths if length > train]
    if not beyond:
        return {}
    first, last = beyond[0], beyond[-1]
    g = lambda name, length: Quantity("growth", name, length)  # noqa: E731
    two = first < last  # an order needs two lengths past the training length ("no data" with one)
    holds_to = [length for length in beyond if length == 2 * train]
    broken_by = [length for length in beyond if length == 4 * train]
    return {"beyond": beyond, "parts": {
        "sinusoidal breaks first, then rotary": [Test(g("sinusoidal", first), BREAK, ">")]
        + [Test(g("sinusoidal", first), g(o, first), ">") for o in ("rope/none", "t5", "alibi")]
        + [Test(g("rope/none", last), BREAK, ">")] if two else [],
        "T5 holds to about 2x": [Test(g("t5", length), BREAK, "<") for length in holds_to]
        + [Test(g("t5", length), BREAK, ">") for length in broken_by] if holds_to and broken_by else [],
        "ALiBi stays flat": [Test(g("alibi", length), 1.0, "=", "equivalent", FLAT) for length in beyond],
    }}


def claim_specs(rows, mode: str, *, judged_len: int = 2048) -> list[dict]:
    """The claims as tests (book/analysis.md), judged at ``judged_len`` (the article's 4x of 512) in one mode: per
    claim ``id``, ``claim``, ``criterion``, ``numbers`` (mean ± std over seeds, for reading) and ``parts`` (name ->
    tests; an empty list where a part cannot be judged). Fine-tuned rows (``+ft``) had more training: not schemes."""
    df, lengths, train, n, runs, encodings = _setting(frame(rows), mode, judged_len)
    ppl = lambda name, length=n: seed_values(df, mode, name, length)  # noqa: E731
    g = lambda name, length=n: ppl(name, length) / ppl(name, train)  # noqa: E731
    lvl = lambda name: Quantity("level", name, n)  # noqa: E731

    def most_accurate(name, rivals):
        return [Test(lvl(name), lvl(s), "<") for s in rivals] if name in runs else []

    rivals = [s for s in runs if s not in ("rope/ntk", "rope/dynamic-ntk")]
    grown = lambda name: Quantity("growth", name, n)  # noqa: E731
    out = [{"id": "1", "claim": "1. ALiBi is slightly worse than RoPE at the training length but the most stable beyond it",
            "criterion": f"(a) ALiBi's perplexity at {train} above RoPE's (no scaling) by at least 1 % and by less than "
                         f"10 %; (b) ALiBi degrades least: its log growth log(ppl({n}) / ppl({train})) below that of "
                         f"every other encoding that can run at {n}",
            "numbers": f"at {train}: ALiBi {_fmt(ppl('alibi', train))}, RoPE {_fmt(ppl('rope/none', train))}; growth to "
                       f"{n}: " + ", ".join(f"{c} {_fmt(g(c))}" for c in sorted(encodings, key=lambda c: g(c).mean())),
            "parts": {"a (slightly worse at training length)": [
                          Test(Quantity("level", "alibi", train), Quantity("level", "rope/none", train), ">", "slightly",
                               SLIGHTLY)],
                      "b (most stable)": claim_1b_tests(df, mode, n)}},
           {"id": "2", "claim": "2. RoPE with NTK-aware scaling is the most accurate of all schemes past the training length",
            "criterion": f"ntk (and, separately, dynamic-ntk) has a lower perplexity at {n} than every other scheme that "
                         f"runs there: every encoding and every RoPE strategy without fine-tuning; (ours, not the "
                         f"article's) the same test for yarn",
            "numbers": f"at {n}: " + ", ".join(f"{s} {_fmt(ppl(s))}" for s in sorted(runs, key=lambda s: ppl(s).mean())),
            "parts": {"ntk most accurate": most_accurate("rope/ntk", rivals),
                      "dynamic-ntk most accurate": most_accurate("rope/dynamic-ntk", rivals),
                      "yarn most accurate (ours)": most_accurate("rope/yarn", [s for s in runs if s != "rope/yarn"])}},
           {"id": "3", "claim": "3. T5's bias extrapolates clearly worse than RoPE and ALiBi",
            "criterion": f"T5's log growth log(ppl({n}) / ppl({train})) above RoPE's (no scaling), and above ALiBi's, "
                         f"by more than log 1.10",
            "numbers": f"growth to {n}: T5 {_fmt(g('t5'))}, RoPE {_fmt(g('rope/none'))}, ALiBi {_fmt(g('alibi'))}",
            "parts": {"clearly worse than RoPE": [Test(grown("t5"), grown("rope/none"), ">", "clearly", CLEARLY)],
                      "clearly worse than ALiBi": [Test(grown("t5"), grown("alibi"), ">", "clearly", CLEARLY)]}}]
    order = _ordering(df, lengths, train, n)
    if order:
        beyond = order["beyond"]
        out.append({"id": "ordering",
                    "claim": "ALiBi paper's ordering: sinusoidal breaks first, then rotary, T5 holds to about 2x, ALiBi "
                             "stays flat",
                    "criterion": f"an encoding breaks at a length when its growth over the training length exceeds "
                                 f"{BREAK} (a one-sample test of the log growth against log {BREAK}); judged at "
                                 f"{', '.join(map(str, beyond))}. Sinusoidal breaks first, then rotary: the sinusoids "
                                 f"break at {beyond[0]} and grow more there than rotary, T5 and ALiBi, and rotary "
                                 f"breaks by {beyond[-1]}. T5 holds to about 2x: below {BREAK} at {2 * train} and above "
                                 f"it at {4 * train}. ALiBi stays flat: its growth within 5 % of 1 at every length "
                                 f"(two one-sided tests)",
                    "numbers": "; ".join(f"{name}: growth " + ", ".join(f"{length}: {_fmt(g(name, length))}"
                                                                        for length in beyond)
                                         for name in ("sinusoidal", "rope/none", "t5", "alibi")),
                    "parts": order["parts"]})
    return out


@dataclass(frozen=True)
class Assessed:
    """One comparison read as its :class:`Test` says: whether it counts for the claim (``for_ok`` with ``p_for`` below
    alpha) and whether it counts against it (``against_ok`` with ``p_against`` below alpha after Holm over every
    comparison of the part; ``p_against`` is the p of the case against the claim, given for every comparison)."""

    p_for: float
    for_ok: bool
    p_against: float
    against_ok: bool

    def counts_for(self, alpha: float = ALPHA) -> bool:
        """Whether the comparison counts in the claim's favour at ``alpha`` (its size and its test)."""
        return self.for_ok and self.p_for < alpha


def assess(test: Test, cmp: Comparison) -> Assessed:
    """The declared analysis's reading of one comparison (book/analysis.md): ``diff`` against the floor and the
    test's margin. A margin is tested by moving the t-test's null to it (:func:`~posenc_lab.lab.verdicts.statistics.p_against_value`);
    an equivalence by two one-sided tests (:func:`~posenc_lab.lab.verdicts.statistics.equivalence_p`)."""
    d, p, m = cmp.diff, cmp.p, test.margin
    nan = math.nan
    if math.isnan(d):
        return Assessed(nan, False, nan, False)
    if test.reading == "equivalent":
        outside = abs(d) > m
        return Assessed(equivalence_p(cmp, m), not outside, p_against_value(cmp, math.copysign(m, d)), outside)
    if test.reading == "clearly":  # want ">": the lower end above the margin; against: below it
        p_m = p_against_value(cmp, m)
        return Assessed(p_m, d > m, p_m, d < m)
    wanted = d < 0 if test.want == "<" else d > 0
    big = abs(d) >= FLOOR
    if test.reading == "slightly":  # want ">": at least the floor, and below the margin
        p_m = p_against_value(cmp, m)
        if d > m:
            return Assessed(max(p, p_m), False, p_m, True)
        return Assessed(max(p, p_m), wanted and big, p, (not wanted) and big)
    return Assessed(p, wanted and big, p, (not wanted) and big)


def judge(pairs: list, *, alpha: float = ALPHA) -> str:
    """The verdict of one claim part in one mode from its ``(Test, Comparison)`` pairs (book/analysis.md):
    ``holds`` (every comparison counts for it: an intersection-union test), ``fails`` (one counts against it after
    Holm over the part), ``equal within 1 %`` (a directional part whose comparisons that do not count are each
    equivalent within the floor), ``not resolved (inside the floor)`` (those comparisons all lie within 1 %),
    ``not resolved (too few seeds)``, or ``no data``."""
    pairs = [(t, c) for t, c in pairs if not math.isnan(c.diff)]
    if not pairs:
        return "no data"
    seen = [assess(t, c) for t, c in pairs]
    against = holm([a.p_against for a in seen])  # Holm over every comparison of the part (book/analysis.md)
    if any(a.against_ok and not math.isnan(q) and q < alpha for a, q in zip(seen, against)):
        return "fails"
    if all(a.counts_for(alpha) for a in seen):
        return "holds"
    rest = [(t, c) for (t, c), a in zip(pairs, seen) if not a.counts_for(alpha)]
    if all(t.reading == "direction" and isinstance(t.b, Quantity) for t, _ in rest) and all(
            equivalence_p(c, FLOOR) < alpha for _, c in rest):
        return "equal within 1 %"
    if all(abs(c.diff) < FLOOR for _, c in rest):
        return "not resolved (inside the floor)"
    return "not resolved (too few seeds)"


def primary_mode(rows, *, judged_len: int = 2048) -> str:
    """The mode a run's claims are decided in: :data:`PRIMARY` (sliding windows) where the run scored them at
    ``judged_len``, else :data:`SENSITIVITY`."""
    df = frame(rows)
    have = set(df.loc[df.eval_mode == PRIMARY, "eval_len"])
    return PRIMARY if judged_len in have else SENSITIVITY


def opposite(a: str, b: str) -> bool:
    """Whether two verdicts resolve opposite ways: one ``holds`` (or ``equal within``), the other ``fails``."""
    positive = lambda v: v == "holds" or v.startswith("equal within")  # noqa: E731
    return (positive(a) and b == "fails") or (a == "fails" and positive(b))


def claims(rows, mode: str, *, judged_len: int = 2048, alpha: float = ALPHA) -> list[dict]:
    """The claims of :func:`claim_specs` judged in one mode under :data:`RULE` (:func:`judge`): each with
    ``verdicts`` (part -> verdict) and ``comparisons`` (part -> list of ``(Test, Comparison)``)."""
    df = frame(rows)
    out = []
    for c in claim_specs(df, mode, judged_len=judged_len):
        tested = {part: [(t, run_test(df, mode, t, alpha=alpha)) for t in tests] for part, tests in c["parts"].items()}
        verdicts = {part: judge(pairs, alpha=alpha) for part, pairs in tested.items()}
        out.append({**c, "comparisons": tested, "verdicts": verdicts})
    return out


def decided(rows, *, modes=(PRIMARY, SENSITIVITY), judged_len: int = 2048, alpha: float = ALPHA) -> dict:
    """Each claim part decided as book/analysis.md says: its verdict in the primary mode (:func:`primary_mode`),
    or ``mode-dependent`` where the sensitivity mode resolves the opposite way (:func:`opposite`)."""
    per_mode = {mode: {f"{c['id']}: {part}": v for c in claims(rows, mode, judged_len=judged_len, alpha=alpha)
                       for part, v in c["verdicts"].items()}
                for mode in modes if mode in set(frame(rows)["eval_mode"])}
    first = primary_mode(rows, judged_len=judged_len)
    other = [m for m in per_mode if m != first]
    out = {}
    for name, v in per_mode[first].items():
        seen = [per_mode[m].get(name, "no data") for m in other]
        out[name] = "mode-dependent" if any(opposite(v, s) for s in seen) else v
    return out


def claim_1b_readings(rows, mode: str, *, judged_len: int = 2048, alpha: float = ALPHA) -> dict:
    """Claim 1b under both readings (:func:`claim_1b_tests`), each judged by :func:`judge`: ``{"degrades least
    (signed log growth, declared)": verdict, "smallest |log growth| (sensitivity)": verdict}``."""
    df = frame(rows)
    said = {}
    for name, reading in (("degrades least (signed log growth, declared)", "growth"),
                          ("smallest |log growth| (sensitivity)", "flatness")):
        tests = claim_1b_tests(df, mode, judged_len, reading)
        said[name] = judge([(t, run_test(df, mode, t, alpha=alpha)) for t in tests], alpha=alpha)
    return said


def claims_text(rows, mode: str, *, judged_len: int = 2048, width: int = 76, rule: bool = True,
                criteria: bool = True) -> str:
    """:func:`claims` as plain text wrapped at ``width``: the decision rule first (unless ``rule=False``), then each
    claim with its criterion (unless ``criteria=False``), the numbers measured, each comparison as a ratio with its
    95 % interval and p, and the verdicts."""
    lines = textwrap.wrap(f"decision rule: {RULE}", width) + [""] if rule else []
    for c in claims(rows, mode, judged_len=judged_len):
        lines += textwrap.wrap(c["claim"], width, subsequent_indent="   ")
        parts = ([("criterion", c["criterion"])] if criteria else []) + [(f"measured ({mode})", c["numbers"])]
        for name, text in parts:
            lines += textwrap.wrap(f"{name}: {text}", width, initial_indent="  ", subsequent_indent="    ")
        for part, v in c["verdicts"].items():
            lines += textwrap.wrap(f"verdict, {part}: {v}", width, initial_indent="  ", subsequent_indent="    ")
            for t, cmp in c["comparisons"][part]:
                against = f"{t.b}" if isinstance(t.b, Quantity) else f"threshold {t.b}"
                lines += textwrap.wrap(f"{t.a} {t.want} {against}: {cmp.reading()}", width,
                                       initial_indent="      ", subsequent_indent="        ")
        lines.append("")
    return "\n".join(lines).rstrip()


def comparison_table(rows, *, modes=("sliding", "nonoverlapping"), judged_len: int = 2048, alpha: float = ALPHA,
                     documents=None, resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Every comparison behind every claim part, one row per mode and test: the ratio ``exp(diff)`` with its
    back-transformed 95 % interval, ``p``, ``p holm`` (Holm over the part's comparisons in both modes, the family
    the claim is decided in) and ``reading``. With ``documents`` (per-document losses), the paired bootstrap over
    documents of the same difference (:func:`claim_bootstrap`) beside it: ``boot low``/``boot high`` and
    ``agree`` (whether the t-test and the bootstrap interval resolve the same way)."""
    df = frame(rows)
    records = []
    for mode in modes:
        for c in claims(df, mode, judged_len=judged_len, alpha=alpha):
            for part, pairs in c["comparisons"].items():
                for t, cmp in pairs:
                    low, high = cmp.interval
                    records.append({"claim": f"{c['id']}: {part}", "mode": mode, "a": str(t.a), "want": t.want,
                                    "b": str(t.b) if isinstance(t.b, Quantity) else f"threshold {t.b}",
                                    "ratio": cmp.ratio, "low": low, "high": high, "p": cmp.p, "kind": cmp.kind,
                                    "reading": cmp.reading(), "test": t})
    table = pd.DataFrame(records)
    if table.empty:
        return table
    table["p holm"] = table.groupby("claim")["p"].transform(lambda p: pd.Series(holm(p), index=p.index))
    if documents is not None:
        boot = claim_bootstrap(documents, table[["mode", "test"]].itertuples(index=False), train=int(df.train_len.iloc[0]),
                               resamples=resamples, seed=seed)
        table["boot low"], table["boot high"] = np.exp(boot["low"]), np.exp(boot["high"])
        t_side = np.where((table["p"] < alpha), np.sign(np.log(table["ratio"])), 0)
        b_side = np.where(boot["low"] > 0, 1, np.where(boot["high"] < 0, -1, 0))
        table["agree"] = t_side == b_side
    return table.drop(columns="test")


# --------------------------------------------------------------------------------------------- documents


def document_losses(documents, *, resamples: int = 2000, seed: int = 0) -> dict:
    """Each seed's loss on resampled evaluation texts: ``{(mode, label, length): array (1 + resamples, seeds)}``
    with the seeds in ``["seeds"]``. Row 0 is the text as it is; every other row draws the documents with
    replacement, one draw shared by every mode, label, length and seed (a paired bootstrap), and takes the
    token-weighted mean loss over the drawn documents."""
    df = frame(documents)
    df = df.assign(summed=df["loss"].astype(float) * df["tokens"].astype(float))
    docs = sorted(df["document"].unique())
    rng = np.random.default_rng(seed)
    weights = np.vstack([np.ones(len(docs)), rng.multinomial(len(docs), np.full(len(docs), 1 / len(docs)), resamples)])
    cells = {}
    for key, cell in df.groupby(["eval_mode", "label", "eval_len"], sort=True):
        summed = cell.pivot_table(index="seed", columns="document", values="summed", aggfunc="sum").reindex(columns=docs)
        counts = cell.pivot_table(index="seed", columns="document", values="tokens", aggfunc="sum").reindex(columns=docs)
        if summed.isna().to_numpy().any():  # a seed without a document: a partial unit, or cannot extrapolate
            continue
        losses = (weights @ summed.to_numpy(float).T) / (weights @ counts.to_numpy(float).T)
        cells[(key[0], key[1], int(key[2]))] = pd.DataFrame(losses, columns=summed.index)
    return cells


def _boot_values(cells, mode, q: Quantity, train: int):
    level = cells.get((mode, q.label, q.length))
    if q.kind == "level" or level is None:
        return level
    base = cells.get((mode, q.label, train))
    if base is None:
        return None
    g = level - base
    return g.abs() if q.kind == "flatness" else g


def claim_bootstrap(documents, tests, *, train: int, resamples: int = 2000, seed: int = 0,
                    level: float = 0.95) -> pd.DataFrame:
    """The paired bootstrap over documents of the differences that ``tests`` (pairs ``(mode, Test)``) rest on:
    per test, the observed difference on the log scale (``diff``: the mean over seeds of A minus B, over the seeds
    both have; A minus ``log(threshold)``) and the ``level`` percentile interval ``low``/``high`` over resampled
    texts (:func:`document_losses`). NaN where a quantity has no per-document losses."""
    cells = document_losses(documents, resamples=resamples, seed=seed)
    records = []
    for mode, t in tests:
        a = _boot_values(cells, mode, t.a, train)
        b = math.log(t.b) if isinstance(t.b, (int, float)) else _boot_values(cells, mode, t.b, train)
        if a is None or b is None:
            records.append({"diff": math.nan, "low": math.nan, "high": math.nan})
            continue
        if isinstance(b, float):
            d = a.mean(axis=1) - b
        else:
            shared = a.columns.intersection(b.columns)
            d = (a[shared] - b[shared]).mean(axis=1) if len(shared) > 1 else a.mean(axis=1) - b.mean(axis=1)
        d = d.to_numpy()
        low, high = np.quantile(d[1:], [(1 - level) / 2, (1 + level) / 2])
        records.append({"diff": float(d[0]), "low": float(low), "high": float(high)})
    return pd.DataFrame(records, columns=["diff", "low", "high"])


def _per_document(df: pd.DataFrame, mode: str, q: Quantity, train: int) -> pd.Series:
    """Each seed's loss on each document for ``q`` (indexed by seed and document): the level at ``q.length``, or the
    growth from ``train`` (the document's loss at ``q.length`` minus its loss at ``train``)."""
    def at(length):
        cell = df[(df.eval_mode == mode) & (df.label == q.label) & (df.eval_len == length)]
        return cell.groupby(["seed", "document"])["loss"].mean()

    return at(q.length) if q.kind == "level" else at(q.length) - at(train)


def document_model(documents, test: Test, mode: str, *, train: int) -> dict:
    """The difference ``test`` rests on, with documents as samples beside the seeds: a crossed random-effects
    model of the per-seed, per-document differences ``d[seed, document] = mu + u[seed] + v[document] + e``,
    fitted by REML with statsmodels' ``MixedLM`` (one group, a variance component for the seed and one for the
    document). Returns ``diff`` (mu), ``se`` (its standard error), ``seed_sd`` and ``document_sd`` (the components'
    standard deviations) and ``cells``; NaN where ``test`` is not between two labels' levels or growths. A
    sensitivity: no verdict rests on it (book/analysis.md)."""
    import warnings

    import statsmodels.formula.api as smf

    nan = {"diff": math.nan, "se": math.nan, "seed_sd": math.nan, "document_sd": math.nan, "cells": 0}
    if not isinstance(test.b, Quantity) or test.a.kind not in ("level", "growth"):
        return nan
    df = frame(documents)
    d = (_per_document(df, mode, test.a, train) - _per_document(df, mode, test.b, train)).dropna()
    if d.empty or d.index.get_level_values("seed").nunique() < 2:
        return nan
    data = d.rename("d").reset_index().assign(group=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = smf.mixedlm("d ~ 1", data, groups="group", re_formula="0",
                          vc_formula={"seed": "0 + C(seed)", "document": "0 + C(document)"}).fit(reml=True)
    names = list(fit.model.exog_vc.names)
    var = dict(zip(names, np.asarray(fit.vcomp, float)))
    return {"diff": float(fit.fe_params.iloc[0]), "se": float(fit.bse_fe.iloc[0]),
            "seed_sd": math.sqrt(max(var.get("seed", math.nan), 0.0)),
            "document_sd": math.sqrt(max(var.get("document", math.nan), 0.0)), "cells": len(data)}


__all__ = ["BREAK", "CLEARLY", "FLAT", "FLOOR", "PRIMARY", "RULE", "SENSITIVITY", "SLIGHTLY", "Assessed", "Quantity",
           "Test", "assess", "claim_1b_readings", "claim_1b_tests", "claim_bootstrap", "claim_specs", "claims",
           "claims_text", "comparison_table", "decided", "document_losses", "document_model", "judge", "opposite",
           "primary_mode", "run_test", "values"]

