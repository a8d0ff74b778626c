"""The article's claims and the ALiBi paper's ordering, as tests of per-seed log-scale quantities.

A claim part is a list of :class:`Test`: a quantity of one label (a log perplexity at a length, a log
growth, or the size of a log growth) against another label's or against a threshold, wanted below
or above. The same tests are judged by t-tests over the seeds (:func:`claims`) and by a paired
bootstrap over the documents of the evaluation text (:func:`claim_bootstrap`), so that the two read
exactly the same differences.
"""

from __future__ import annotations

from .extras import require

require("lab", "posenc_lab.claims")

import math
import textwrap
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .stats import ALPHA, FLOOR, Comparison, compare_design, frame, holm, log_growth, seed_values, verdict

#: perplexity growth above which an encoding is said to "break" (ALiBi paper's ordering)
BREAK = 1.10
#: the decision rule of every verdict, in words
RULE = ("Seeds are the samples, and perplexities are compared on the log scale: a level is a log perplexity (the "
        "mean loss in nats per byte), a growth is log(ppl(L') / ppl(L)). A comparison of A and B is a two-sided "
        "t-test at alpha = 0.05 (scipy.stats): paired, on the per-seed differences, when A and B were measured on "
        "the same seeds (two RoPE strategies of one trained model, or two encodings trained with the same seed, "
        "which see the same batches); Welch's test when the seeds differ; a one-sample test against a threshold. "
        "Each is reported as a ratio of perplexities (or growths) with its back-transformed 95 % interval and p. "
        "One floor, on one scale, in both directions: a difference counts for or against a claim only when it is "
        "resolved and at least 1 % as a ratio of perplexities (|difference of log perplexities| >= log 1.01); a "
        "resolved difference under 1 % reads 'resolved, under 1 %' and decides nothing. Gains from far context "
        "(nats per byte) are judged as the perplexity ratios exp(gain). A claim part holds when every comparison "
        "behind it counts in its favour (each at alpha: all must hold); it fails when one counts against it "
        "after Holm's correction over that part's comparisons; otherwise it is not resolved, and the direction "
        "of the means is named. Families: Holm within each claim part; the two evaluation modes of the same "
        "models are one family, so a claim is decided once from both modes' comparisons together (holds only "
        "if it holds in both, fails if a comparison of either mode counts against it after Holm over both), "
        "and each mode's own verdict is shown beside it; the exploratory grids (far-context gains, the variants "
        "table, the checkpoints) carry Holm- and Benjamini-Hochberg-adjusted p-values beside the raw ones. "
        "Accuracies are compared seed by seed with Fisher's exact test, never with a t-test on accuracies. With "
        "one seed nothing is resolved. The verdicts are about this evaluation text; a paired bootstrap over its "
        "documents of the same differences is reported beside the t-tests.")


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
    """``a`` against ``b`` (a :class:`Quantity`, or a threshold given as a ratio, compared with ``log(b)``),
    wanted ``"<"`` or ``">"``."""

    a: Quantity
    b: Quantity | float
    want: str


def values(df: pd.DataFrame, mode: str, q: Quantity) -> pd.Series:
    """The per-seed values of ``q`` (nats) in ``mode``."""
    if q.kind == "level":
        return seed_values(df, mode, q.label, q.length, "loss")
    g = log_growth(df, mode, q.label, q.length)
    return g.abs() if q.kind == "flatness" else g


def run_test(df: pd.DataFrame, mode: str, test: Test, *, alpha: float = ALPHA) -> Comparison:
    """The t-test behind ``test`` on the log scale (:func:`~posenc_lab.stats.compare_design`)."""
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
    labels = sorted(name for name in df["label"].unique() if "+ft" not in name)
    runs = [name for name in labels if not seed_values(df, mode, name, n).isna().all()]
    # one label per encoding: the label without a strategy, or with the strategy "none" (the model as trained)
    encodings = [name for name in runs if name.partition("/")[2] in ("", "none")]
    return df, lengths, int(df["train_len"].iloc[0]), n, runs, encodings


def claim_1b_tests(df, mode: str, judged_len: int, reading: str = "flatness") -> list[Test]:
    """Claim 1b, "ALiBi is the most stable beyond the training length", as tests of ALiBi against every other
    encoding that runs at ``judged_len``.

    The article says ALiBi "在外推中表现最稳定" ("performs most stably in extrapolation"). Stable means its
    perplexity changes least with length, in either direction, so the book's reading (``"flatness"``) compares
    the size of the log growth, ``|log(ppl(L') / ppl(L))|``. The other reading (``"growth"``) compares the signed log
    growth, "degrades least"; it rewards a perplexity that falls with length, which in non-overlapping windows is
    partly a scoring effect (later windows' bytes see more context on average), not the encoding."""
    _, _, _, n, _, encodings = _setting(df, mode, judged_len)
    return [Test(Quantity(reading, "alibi", n), Quantity(reading, c, n), "<") for c in encodings if c != "alibi"]


def _ordering(df, lengths, train, n) -> dict:
    beyond = [length for length in lengths if train < length <= n] or [length for length in lengths if length > train]
    if not beyond:
        return {}
    first, last = beyond[0], beyond[-1]
    g = lambda name, length: Quantity("growth", name, length)  # noqa: E731
    two = first < last  # an order needs two lengths past the training length ("no data" with one)
    return {"beyond": beyond, "parts": {
        "sinusoidal breaks first": [Test(g("sinusoidal", first), BREAK, ">")]
        + [Test(g("sinusoidal", first), g(o, first), ">") for o in ("rope/none", "t5", "alibi")] if two else [],
        "then rotary": [Test(g("rope/none", last), BREAK, ">"), Test(g("rope/none", first), g("sinusoidal", first), "<")]
        if two else [],
        "T5 holds to 2x": [Test(g("t5", length), BREAK, "<") for length in beyond if length <= 2 * train],
        "ALiBi stays flat": [Test(g("alibi", length), BREAK, "<") for length in beyond],
    }}


def claim_specs(rows, mode: str, *, judged_len: int = 2048) -> list[dict]:
    """The claims as tests, judged at ``judged_len`` (the article's 4x of 512) in one mode: per claim ``id``,
    ``claim``, ``criterion``, ``numbers`` (mean ± std over seeds, for reading) and ``parts`` (name -> tests;
    an empty list where a part cannot be judged). Fine-tuned rows (``+ft``) had more training: not schemes."""
    df, lengths, train, n, runs, encodings = _setting(frame(rows), mode, judged_len)
    ppl = lambda name, length=n: seed_values(df, mode, name, length)  # noqa: E731
    g = lambda name, length=n: ppl(name, length) / ppl(name, train)  # noqa: E731
    lvl = lambda name: Quantity("level", name, n)  # noqa: E731

    def most_accurate(name, rivals):
        return [Test(lvl(name), lvl(s), "<") for s in rivals] if name in runs else []

    rivals = [s for s in runs if s not in ("rope/ntk", "rope/dynamic-ntk")]
    out = [{"id": "1", "claim": "1. ALiBi is slightly worse than RoPE at the training length but the most stable beyond it",
            "criterion": f"(a) ALiBi's perplexity at {train} above RoPE's (no scaling); (b) the size of ALiBi's log "
                         f"growth |log(ppl({n}) / ppl({train}))| below that of every other encoding that can run at {n}",
            "numbers": f"at {train}: ALiBi {_fmt(ppl('alibi', train))}, RoPE {_fmt(ppl('rope/none', train))}; growth to "
                       f"{n}: " + ", ".join(f"{c} {_fmt(g(c))}" for c in sorted(encodings, key=lambda c: g(c).mean())),
            "parts": {"a (worse at training length)": [Test(Quantity("level", "alibi", train),
                                                            Quantity("level", "rope/none", train), ">")],
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
            "criterion": f"T5's log growth log(ppl({n}) / ppl({train})) above RoPE's (no scaling) and above ALiBi's",
            "numbers": f"growth to {n}: T5 {_fmt(g('t5'))}, RoPE {_fmt(g('rope/none'))}, ALiBi {_fmt(g('alibi'))}",
            "parts": {"worse than RoPE": [Test(Quantity("growth", "t5", n), Quantity("growth", "rope/none", n), ">")],
                      "worse than ALiBi": [Test(Quantity("growth", "t5", n), Quantity("growth", "alibi", n), ">")]}}]
    order = _ordering(df, lengths, train, n)
    if order:
        beyond = order["beyond"]
        out.append({"id": "ordering",
                    "claim": "ALiBi paper's ordering: sinusoidal breaks first, then rotary, T5 holds to about 2x, ALiBi "
                             "stays flat",
                    "criterion": f"an encoding breaks at a length when its growth over the training length exceeds "
                                 f"{BREAK} (a one-sample test of the log growth against log {BREAK}); judged at "
                                 f"{', '.join(map(str, beyond))}. Sinusoidal breaks first: it breaks at {beyond[0]} and "
                                 f"grows more there than rotary, T5 and ALiBi. Then rotary: rotary breaks by "
                                 f"{beyond[-1]} and grows less than sinusoidal at {beyond[0]}. T5 holds: below {BREAK} up "
                                 f"to {2 * train}. ALiBi stays flat: below {BREAK} everywhere",
                    "numbers": "; ".join(f"{name}: growth " + ", ".join(f"{length}: {_fmt(g(name, length))}"
                                                                        for length in beyond)
                                         for name in ("sinusoidal", "rope/none", "t5", "alibi")),
                    "parts": order["parts"]})
    return out


def claims(rows, mode: str, *, judged_len: int = 2048, alpha: float = ALPHA) -> list[dict]:
    """The claims of :func:`claim_specs` judged in one mode under :data:`RULE`: each with ``verdicts`` (part ->
    verdict) and ``comparisons`` (part -> list of ``(Test, Comparison)``)."""
    df = frame(rows)
    out = []
    for c in claim_specs(df, mode, judged_len=judged_len):
        tested = {part: [(t, run_test(df, mode, t, alpha=alpha)) for t in tests] for part, tests in c["parts"].items()}
        verdicts = {part: verdict([(cmp, t.want) for t, cmp in pairs]) for part, pairs in tested.items()}
        out.append({**c, "comparisons": tested, "verdicts": verdicts})
    return out


def decided(rows, *, modes=("sliding", "nonoverlapping"), judged_len: int = 2048, alpha: float = ALPHA) -> dict:
    """Each claim part decided once from both modes: the comparisons of every mode in one family (one call of
    :func:`~posenc_lab.stats.verdict`, so Holm runs over both modes' comparisons and "holds" needs every one of them)."""
    pooled: dict[str, list] = {}
    for mode in modes:
        for c in claims(rows, mode, judged_len=judged_len, alpha=alpha):
            for part, pairs in c["comparisons"].items():
                pooled.setdefault(f"{c['id']}: {part}", []).extend((cmp, t.want) for t, cmp in pairs)
    return {name: verdict(pairs) for name, pairs in pooled.items()}


def claim_1b_readings(rows, mode: str, *, judged_len: int = 2048, alpha: float = ALPHA) -> dict:
    """Claim 1b under both readings (:func:`claim_1b_tests`): ``{"smallest |log growth| (the book's)": verdict,
    "smallest log growth (signed)": verdict}``."""
    df = frame(rows)
    said = {}
    for name, reading in (("smallest |log growth| (the book's)", "flatness"), ("smallest log growth (signed)", "growth")):
        tests = claim_1b_tests(df, mode, judged_len, reading)
        said[name] = verdict([(run_test(df, mode, t, alpha=alpha), t.want) for t in tests])
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


__all__ = ["BREAK", "FLOOR", "RULE", "Quantity", "Test", "claim_1b_readings", "claim_1b_tests", "claim_bootstrap",
           "claim_specs", "claims", "claims_text", "comparison_table", "decided", "document_losses", "run_test",
           "values"]

