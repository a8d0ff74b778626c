"""The claims' verdicts for a reader: several runs side by side, and each claim in words with the comparison it
rests on (the README's and chapter 10's first screen)."""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.verdicts.in_words")

import math
import re

import pandas as pd

from posenc_lab.lab.verdicts.claims import (PRIMARY, Quantity, SENSITIVITY, Test, assess, claims, opposite,
                                            primary_mode, values)
from posenc_lab.lab.verdicts.statistics import ALPHA, Comparison, frame, holm, smallest_resolved



def deciding(pairs: list) -> tuple:
    """The comparison a verdict rests on, of ``(Test, Comparison)`` pairs: the one that counts against the claim
    most strongly (a ``fails`` rests on it); else, of the comparisons that do not count for the claim, the one with
    the largest ``p`` (the weakest link of a part that needs every comparison); else, when all count for it, the
    closest one, the smallest difference (:func:`~posenc_lab.lab.verdicts.claims.assess`)."""
    seen = [(t, c, assess(t, c)) for t, c in pairs if not math.isnan(c.diff)]
    if not seen:
        return (None, None)
    against = [(t, c, a) for t, c, a in seen if a.against_ok and a.p_against < c.alpha]
    if against:
        t, c, _ = min(against, key=lambda x: x[2].p_against)
        return t, c
    short = [(t, c, a) for t, c, a in seen if not a.counts_for(c.alpha)]
    if not short:  # every comparison holds: the one nearest to not holding (its difference, or its margin)
        t, c, _ = min(seen, key=lambda x: x[0].margin - abs(x[1].diff) if x[0].reading == "equivalent"
                      else abs(x[1].diff))
        return t, c
    t, c, _ = max(short, key=lambda x: -1 if math.isnan(x[2].p_for) else x[2].p_for)
    return t, c


def part_verdicts(rows, *, judged_len: int = 2048, alpha: float = ALPHA) -> dict[str, dict]:
    """Every claim part of a run as the declared analysis decides it (book/analysis.md): ``{part: {"verdict": the
    decision, "mode": the primary mode, "primary": its verdict there, "sensitivity": its verdict in the other mode
    (or None), "pairs": {mode: [(Test, Comparison), ...]}}}``."""
    df = frame(rows)
    first = primary_mode(df, judged_len=judged_len)
    modes = [first] + [m for m in (PRIMARY, SENSITIVITY) if m != first and m in set(df["eval_mode"])]
    per_mode = {m: {f"{c['id']}: {part}": (c["verdicts"][part], c["comparisons"][part])
                    for c in claims(df, m, judged_len=judged_len, alpha=alpha) for part in c["verdicts"]}
                for m in modes}
    out = {}
    for part, (v, pairs) in per_mode[first].items():
        other = per_mode[modes[1]][part][0] if len(modes) > 1 and part in per_mode[modes[1]] else None
        out[part] = {"verdict": "mode-dependent" if other is not None and opposite(v, other) else v, "mode": first,
                     "primary": v, "sensitivity": other,
                     "pairs": {m: per_mode[m][part][1] for m in modes if part in per_mode[m]}}
    return out


def side_by_side(runs: dict, *, judged_len: int = 2048, alpha: float = ALPHA) -> pd.DataFrame:
    """Every claim's verdict in several runs (``{name: rows}``: two recipes, two domains): per run the verdict the
    declared analysis decides (:func:`part_verdicts`) and the comparison it rests on in the primary mode
    (:func:`deciding`: ``A / B = ratio [95 % interval], p``); then ``same verdict`` across the runs."""
    table = {}
    for name, rows in runs.items():
        parts = part_verdicts(rows, judged_len=judged_len, alpha=alpha)
        table[(name, "verdict")] = {part: p["verdict"] for part, p in parts.items()}
        effects = {}
        for part, p in parts.items():
            t, cmp = deciding(p["pairs"][p["mode"]])
            if t is None:
                effects[part] = "no data"
                continue
            against = t.b.label if isinstance(t.b, Quantity) else f"{t.b:g}"
            effects[part] = f"{t.a.label} / {against} = {cmp.reading()} ({p['mode']})"
        table[(name, "rests on")] = effects
    side = pd.DataFrame(table)
    side.columns = pd.MultiIndex.from_tuples(side.columns)
    side[("all runs", "same verdict")] = side.xs("verdict", axis=1, level=1).nunique(axis=1) == 1
    return side


#: each claim part as its source states it, in words
STATEMENTS = {
    "1: a (slightly worse at training length)": "ALiBi is slightly worse than RoPE at the training length (the article).",
    "1: b (most stable)": "ALiBi is the most stable encoding past the training length: it degrades least (the article).",
    "2: ntk most accurate": "RoPE with NTK-aware scaling is the most accurate past the training length (the article).",
    "2: dynamic-ntk most accurate": "RoPE with dynamic NTK is the most accurate past the training length (the article).",
    "2: yarn most accurate (ours)": "RoPE with YaRN is the most accurate past the training length (our question).",
    "3: clearly worse than RoPE": "T5's bias extrapolates clearly worse than RoPE (the article).",
    "3: clearly worse than ALiBi": "T5's bias extrapolates clearly worse than ALiBi (the article).",
    "ordering: sinusoidal breaks first, then rotary": "The sinusoids break first, then RoPE (the ALiBi paper).",
    "ordering: T5 holds to about 2x": "T5 holds to about twice the training length, and no further (the ALiBi paper).",
    "ordering: ALiBi stays flat": "ALiBi stays flat (the ALiBi paper).",
}
NAMES = {"nope": "NoPE", "sinusoidal": "the sinusoids", "learned": "the learned table", "rope/none": "RoPE",
         "rope/pi": "RoPE with PI", "rope/ntk": "RoPE with NTK", "rope/dynamic-ntk": "RoPE with dynamic NTK",
         "rope/yarn": "RoPE with YaRN", "alibi": "ALiBi", "t5": "T5", "xpos": "xPos", "kerple": "KERPLE",
         "fire": "FIRE", "ssmax": "SSMax", "ssmax-rope": "SSMax on RoPE", "nope-temp": "Llama 4's temperature",
         "irope": "iRoPE", "gemma3": "Gemma 3's layers", "rnope-swa": "RNoPE-SWA", "fope": "FoPE", "fox": "FoX",
         "cope": "CoPE", "stick-breaking": "stick-breaking", "path": "PaTH", "path-fox": "PaTH with FoX",
         "dape-alibi": "DAPE on ALiBi", "dape-kerple": "DAPE on KERPLE", "dape-fire": "DAPE on FIRE"}


def _name(label: str) -> str:
    return NAMES.get(label, label)


def _of(label: str) -> str:
    name = _name(label)
    return name + ("'" if name.endswith("s") else "'s")


def growth_factor(df: pd.DataFrame, mode: str, label: str, length: int, *, alpha: float = ALPHA) -> tuple:
    """``label``'s growth from the training length to ``length`` in ``mode``: ``(factor, low, high)``, the
    exponentiated mean log growth over the seeds and its ``1 - alpha`` t-interval."""
    from posenc_lab.lab.verdicts.statistics import compare

    c = compare(values(df, mode, Quantity("growth", label, length)).to_numpy(), 0.0, alpha=alpha, scale="log")
    return c.ratio, *c.interval


def _pct(x: float) -> str:
    return f"{100 * x:.2g} %" if abs(x) < 0.1 else f"{100 * x:.0f} %"


_NUMBERS = {2: "Two", 3: "Three", 4: "Four", 5: "Five", 6: "Six", 7: "Seven", 8: "Eight", 9: "Nine", 10: "Ten"}


def effect_in_words(test: Test, cmp: Comparison, train: int, df: pd.DataFrame | None = None,
                    mode: str | None = None) -> str:
    """One comparison as a reader says it. A level: ``ALiBi's perplexity at 512 is 0.90 times RoPE's [0.86, 0.95]``.
    A growth against a growth: each encoding's growth factor with its interval (from ``df`` in ``mode``), then the
    difference of their log growths in nats with its interval; never "X times the growth". A growth against a line:
    the growth factor and the line. An equivalence: the growth factor with its 90 % interval and the margin."""
    low, high = cmp.interval
    a = test.a
    if not isinstance(test.b, Quantity):  # a one-sample test of a growth against a line
        b = float(test.b)
        if test.reading == "equivalent":
            from posenc_lab.lab.verdicts.statistics import compare

            lo, hi = compare(values(df, mode, a).to_numpy(), math.log(b), alpha=2 * cmp.alpha, scale="log").interval
            return (f"{_of(a.label)} perplexity changes by a factor of {cmp.ratio * b:.3f} from {train} to "
                    f"{a.length:,} [90 % interval {lo * b:.3f}, {hi * b:.3f}]; flat means within "
                    f"{_pct(math.exp(test.margin) - 1)}")
        return (f"{_of(a.label)} perplexity changes by a factor of {cmp.ratio * b:.3f} from {train} to {a.length:,} "
                f"[{low * b:.3f}, {high * b:.3f}] (the break is {b:.2f})")
    if a.kind == "level":
        return f"{_of(a.label)} perplexity at {a.length:,} is {cmp.ratio:.2f} times {_of(test.b.label)} [{low:.2f}, {high:.2f}]"
    what = "|log growth|" if a.kind == "flatness" else "log growth"
    grown = ""
    if df is not None and a.kind == "growth":
        (ga, la, ha), (gb, lb, hb) = (growth_factor(df, mode, q.label, q.length) for q in (a, test.b))
        grown = (f"{_of(a.label)} perplexity grows by a factor of {ga:.3g} [{la:.3g}, {ha:.3g}] from {train} to "
                 f"{a.length:,}, {_of(test.b.label)} by {gb:.3g} [{lb:.3g}, {hb:.3g}]; ")
    return (f"{grown}the {what}s differ by {cmp.diff:+.3f} nats [{cmp.low:+.3f}, {cmp.high:+.3f}] "
            f"({_name(a.label)} minus {_name(test.b.label)})")


def findings(rows, *, judged_len: int = 2048, alpha: float = ALPHA) -> list[dict]:
    """Each claim part for a reader, as the declared analysis decides it (:func:`part_verdicts`): ``claim`` (as its
    source states it), ``verdict``, ``mode`` (the primary mode), ``primary`` and ``sensitivity`` (the verdict in each
    mode), ``effect`` (the comparison it rests on in the primary mode, :func:`deciding`, in words), its ``p``,
    ``p_holm`` (Holm over the part's comparisons in that mode), ``resolves`` (the smallest difference, as a ratio
    minus 1, its test resolves with 80 % power at the seeds' spread) and ``seeds``; for a mode-dependent part,
    ``effect_sensitivity`` too."""
    df = frame(rows)
    train = int(df["train_len"].iloc[0])
    out = []
    for part, p in part_verdicts(df, judged_len=judged_len, alpha=alpha).items():
        mode, pairs = p["mode"], p["pairs"][p["mode"]]
        t, cmp = deciding(pairs)
        if t is None:
            out.append({"part": part, "claim": STATEMENTS.get(part, part), "verdict": p["verdict"], "mode": mode,
                        "primary": p["primary"], "sensitivity": p["sensitivity"], "effect": "no data",
                        "p": math.nan, "p_holm": math.nan, "resolves": math.nan, "seeds": 0, "comparisons": 0})
            continue
        k = next(i for i, (_, c) in enumerate(pairs) if c is cmp)
        judged = [assess(t_, c) for t_, c in pairs]
        p_holm = holm([a.p_against for a in judged])[k]
        said = assess(t, cmp)
        p_value = said.p_against if p["primary"] == "fails" else said.p_for
        record = {"part": part, "claim": STATEMENTS.get(part, part), "verdict": p["verdict"], "mode": mode,
                  "primary": p["primary"], "sensitivity": p["sensitivity"],
                  "effect": effect_in_words(t, cmp, train, df, mode), "p": p_value, "p_holm": p_holm,
                  "resolves": math.expm1(smallest_resolved(cmp)), "seeds": cmp.n[0],
                  "comparisons": len(pairs)}
        if p["verdict"] == "mode-dependent":
            other = [m for m in p["pairs"] if m != mode][0]
            t2, c2 = deciding(p["pairs"][other])
            record["effect_sensitivity"] = effect_in_words(t2, c2, train, df, other)
        out.append(record)
    return out


def verdict_in_words(verdict: str) -> str:
    """A verdict as the first screen says it: ``holds`` -> ``Holds``; ``fails`` -> ``Does not hold``; ``equal within
    1 %`` -> ``Equal within 1 %``; ``not resolved (too few seeds)`` -> ``Not resolved: too few seeds``; ``not resolved
    (inside the floor)`` -> ``Not resolved: the difference is under 1 %``; ``mode-dependent`` -> ``Mode-dependent``."""
    if verdict.startswith("not resolved"):
        if "floor" in verdict or "under 1 %" in verdict:
            return "Not resolved: the difference is under 1 %"
        if "few seeds" in verdict:
            return "Not resolved: too few seeds"
        return "Not resolved"
    return {"holds": "Holds", "fails": "Does not hold"}.get(verdict, verdict[0].upper() + verdict[1:])


MODE_WORDS = {"sliding": "sliding windows", "nonoverlapping": "non-overlapping windows"}


def findings_markdown(rows, *, judged_len: int = 2048) -> str:
    """:func:`findings` as a Markdown list, one line a claim part, every line in the primary mode with the
    sensitivity mode's verdict beside it (the README's and chapter 10's first screen)."""
    lines = []
    for f in findings(rows, judged_len=judged_len):
        if f["effect"] == "no data":
            lines.append(f"- {f['claim']} **No data.** This run cannot judge it.")
            continue
        effect = f["effect"][0].upper() + f["effect"][1:]
        holm_said = f", {f['p_holm']:.2g} after Holm" if f["primary"] == "fails" and f["comparisons"] > 1 else ""
        power = (f" {_NUMBERS.get(f['seeds'], f['seeds'])} seeds resolve a difference of {_pct(f['resolves'])} with 80 % power."
                 if not math.isnan(f["resolves"]) else "")
        mode, other = MODE_WORDS[f["mode"]], f["sensitivity"]
        beside = f"; in {MODE_WORDS[SENSITIVITY if f['mode'] == PRIMARY else PRIMARY]}: " \
                 f"{verdict_in_words(other).lower()}" if other else ""
        line = (f"- {f['claim']} **{verdict_in_words(f['verdict'])}.** {effect}, p = {f['p']:.2g}{holm_said}."
                f"{power} ({mode}{beside}.)")
        if f["verdict"] == "mode-dependent":
            line += f" In {MODE_WORDS[f['mode']]} it {_verb(f['primary'])}; in the other mode it " \
                    f"{_verb(other)}: {f['effect_sensitivity']}."
        lines.append(line)
    return "\n".join(lines)


def _verb(verdict: str) -> str:
    return {"holds": "holds", "fails": "does not hold"}.get(verdict, "is " + verdict_in_words(verdict).lower())


# ------------------------------------------------------------------------------------------ the answer in plain words


def _change(factor: float) -> str:
    """A growth factor as a reader says it: ``falls 1.4 %``, ``rises 7 %``, ``grows 8.9-fold``."""
    if factor < 1:
        return f"falls {_pct(1 - factor)}"
    return f"rises {_pct(factor - 1)}" if factor < 2 else f"grows {_times(factor)}-fold"


def _against(ratio: float) -> str:
    """A ratio of two perplexities as a reader says it: ``9.4 % below``, ``39 % above``, ``3.1 times``."""
    if ratio < 1:
        return f"{_pct(1 - ratio)} below"
    return f"{_pct(ratio - 1)} above" if ratio < 2 else f"{_times(ratio)} times"


def _times(x: float) -> str:
    """A multiple in two significant digits, never in exponent notation: ``3.1``, ``21``, ``150``."""
    return f"{x:.2g}" if x < 10 else f"{x:,.0f}" if x >= 100 else f"{x:.0f}"


def size_in_words(test: Test, cmp: Comparison, train: int, df: pd.DataFrame, mode: str) -> str:
    """The size of the comparison a verdict rests on, in plain words, every number computed from ``cmp`` (and, for a
    growth, from the seeds' growth factors in ``df``): a level is a percentage above or below the other perplexity
    (``ALiBi's perplexity at 512 is 9.4 % below RoPE's``), or a multiple past 2; a growth is how the perplexity
    changes from the training length (``T5's perplexity rises 6.6 % from 512 to 2,048``); a margin the claim's
    words set is said beside it."""
    a = test.a
    if not isinstance(test.b, Quantity):  # a growth against a line
        b = float(test.b)
        said = f"{_of(a.label)} perplexity {_change(cmp.ratio * b)} from {train} to {a.length:,}"
        if test.reading == "equivalent":
            return f"{said}; flat means within {_pct(math.exp(test.margin) - 1)}"
        return f"{said}; a rise of more than {_pct(b - 1)} counts as breaking"
    if a.kind == "level":
        said = f"{_of(a.label)} perplexity at {a.length:,} is {_against(cmp.ratio)} {_of(test.b.label)}"
        if test.reading == "slightly":
            said += f"; slightly worse means 1 % to {_pct(math.exp(test.margin) - 1)} above"
        return said
    ga, gb = (growth_factor(df, mode, q.label, q.length)[0] for q in (a, test.b))
    said = (f"{_of(a.label)} perplexity {_change(ga)} from {train} to {a.length:,}, "
            f"{_of(test.b.label)} {_change(gb)}")
    if test.reading == "clearly" and cmp.ratio > 1:  # worse, but is it clearly worse?
        said += (f"; {_of(a.label)} growth is {_against(cmp.ratio)} {_of(test.b.label)}, and clearly worse means at "
                 f"least {_pct(math.exp(test.margin) - 1)} above")
    return said


#: the ALiBi paper's "the sinusoids break first, then RoPE": "first" says which breaks more at one length
FIRST_BREAK = "ordering: sinusoidal breaks first, then rotary"


def first_in_words(df: pd.DataFrame, mode: str, length: int) -> str:
    """What "break first" means at ``length`` (the first judged length past training), said after the size of the
    sinusoids' growth against RoPE's: where both growths are past the break (:data:`~posenc_lab.lab.verdicts.claims.BREAK`),
    "first" is the larger growth there; otherwise it says which is past it."""
    from posenc_lab.lab.verdicts.claims import BREAK

    sinusoids, rope = (growth_factor(df, mode, label, length)[0] for label in ("sinusoidal", "rope/none"))
    if min(sinusoids, rope) > BREAK:
        return f"; both are past the break ({BREAK:.2f}) at {length:,}, so first means the larger growth there"
    if sinusoids > BREAK:
        return f"; at {length:,} only the sinusoids are past the break ({BREAK:.2f})"
    return f"; at {length:,} neither is past the break ({BREAK:.2f})"


def _source(statement: str) -> tuple[str, str]:
    """A claim as :data:`STATEMENTS` says it, split into its words and its source: ``("ALiBi stays flat", "the ALiBi
    paper")``."""
    found = re.fullmatch(r"(?P<claim>.*?)\s*\((?P<source>[^()]*)\)\.?", statement)
    return (found["claim"], found["source"]) if found else (statement.rstrip("."), "")


def answer_table(rows, *, judged_len: int = 2048, alpha: float = ALPHA) -> pd.DataFrame:
    """The first screen's answer: one row per claim part, in plain words, from :func:`findings`' verdicts and the
    comparison each rests on (:func:`deciding`, primary mode). Columns: ``claim`` (as its source states it),
    ``source``, ``answer`` (:func:`verdict_in_words`: Holds, Does not hold, Mode-dependent, Equal within 1 %, Not
    resolved and why) and ``size`` (:func:`size_in_words`; for a mode-dependent part, in the primary mode, named).
    No number in it is typed by hand."""
    df = frame(rows)
    train = int(df["train_len"].iloc[0])
    out = []
    for part, p in part_verdicts(df, judged_len=judged_len, alpha=alpha).items():
        claim, source = _source(STATEMENTS.get(part, part))
        t, cmp = deciding(p["pairs"][p["mode"]])
        if t is None:
            out.append({"claim": claim, "source": source, "answer": "No data", "size": "This run cannot judge it"})
            continue
        size = size_in_words(t, cmp, train, df, p["mode"])
        if part == FIRST_BREAK and isinstance(t.b, Quantity) and t.b.label == "rope/none":
            size += first_in_words(df, p["mode"], t.a.length)
        if p["verdict"] == "mode-dependent":
            size += f" (in {MODE_WORDS[p['mode']]})"
        out.append({"claim": claim, "source": source, "answer": verdict_in_words(p["verdict"]),
                    "size": size[0].upper() + size[1:]})
    return pd.DataFrame(out, columns=["claim", "source", "answer", "size"])


def answer_markdown(rows, *, judged_len: int = 2048) -> str:
    """:func:`answer_table` as a Markdown table: the claim and its source, our answer, its size in words (the
    README's, the landing page's and chapter 10's first screen)."""
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| claim | our answer | its size |", "|---|---|---|"]
    for r in answer_table(rows, judged_len=judged_len).itertuples():
        claim = f"{r.claim} ({r.source})" if r.source else r.claim
        lines.append(f"| {cell(claim)} | **{cell(r.answer)}** | {cell(r.size)} |")
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
    subset), in each mode: :func:`~posenc_lab.lab.verdicts.tables.versus` (a paired t-test over the seeds on the log scale,
    when both were trained with the same seeds and batches), every row one exploratory family. Adds ``outcome``:
    ``lower`` or ``higher`` (perplexity against the baseline) where the difference is at least 1 % and survives
    Benjamini-Hochberg at ``alpha`` over the whole table, ``not resolved`` otherwise."""
    from posenc_lab.lab.verdicts.tables import versus

    return judged(versus(rows, [(m, b) for b in baselines for m in methods], mode=modes, lengths=lengths, alpha=alpha))


def judged(table: pd.DataFrame) -> pd.DataFrame:
    """A :func:`~posenc_lab.lab.verdicts.tables.versus` table with ``outcome``: ``lower`` or ``higher`` where the difference is at
    least 1 % and survives Benjamini-Hochberg over the table, ``not resolved`` otherwise."""
    counts = (table["sign"] != "~") & (table["survives"] != "none")
    return table.assign(outcome=table["sign"].map({"<": "lower", ">": "higher"}).where(counts, "not resolved"))


def beats(table: pd.DataFrame, baseline: str = "alibi", *, mode: str = "sliding",
          fallback: str = "nonoverlapping") -> pd.DataFrame:
    """Whether each method of :func:`against_baselines`' ``table`` beats ``baseline`` at each length: its perplexity
    is lower by at least 1 % and the difference survives Benjamini-Hochberg over the whole table (``outcome`` is
    ``lower``), read in ``mode``'s windows, or in ``fallback``'s at a length ``mode`` did not evaluate (the row's
    ``mode`` says which). One row per method and length, in the table's order, with ``ratio``, ``low``, ``high``,
    ``p BH``, ``outcome`` and ``beats``.

    >>> import pandas as pd
    >>> t = pd.DataFrame({"mode": ["sliding", "nonoverlapping", "nonoverlapping"], "a": ["m"] * 3,
    ...                   "b": ["alibi"] * 3, "eval_len": [512, 512, 8192], "ratio": [0.95, 0.9, 0.97],
    ...                   "low": [0.9] * 3, "high": [0.99] * 3, "p BH": [0.01] * 3,
    ...                   "outcome": ["lower", "lower", "not resolved"]})
    >>> beats(t)[["eval_len", "mode", "beats"]].values.tolist()
    [[512, 'sliding', True], [8192, 'nonoverlapping', False]]
    """
    against = table[table["b"] == baseline]
    if against.empty:
        raise ValueError(f"the table has no comparison with {baseline}")
    chosen = []
    for (method, length), cell in against.groupby(["a", "eval_len"], sort=False):
        for wanted in (mode, fallback):
            row = cell[cell["mode"] == wanted]
            if not row.empty:
                chosen.append(row.iloc[0])
                break
    out = pd.DataFrame(chosen)[["a", "eval_len", "mode", "ratio", "low", "high", "p BH", "outcome"]]
    return out.rename(columns={"a": "method"}).assign(beats=lambda d: d["outcome"] == "lower").reset_index(drop=True)


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
    :data:`~posenc_lab.lab.measure.accuracy.LEARNED` at the end of training), and which did not: ``(learned, not_learned)``."""
    from posenc_lab.lab.measure.accuracy import LEARNED, by_length

    table = by_length(rows)
    lowest = table.groupby(level="label")["train_accuracy"].min()
    learned = [m for m in methods if m in lowest.index and lowest[m] >= LEARNED]
    return learned, [m for m in methods if m not in learned]


def retrieval_against_baselines(rows, methods, *, baselines=BASELINES, floor: float = 0.01,
                                alpha: float = ALPHA) -> pd.DataFrame:
    """The exact match of each of ``methods`` in a retrieval run's ``rows`` against each of ``baselines`` at every
    length, and against itself at the training length at every longer one. Chapter 9's rule for counts
    (:func:`~posenc_lab.lab.verdicts.statistics.compare_counts`: Fisher's exact test per seed, resolved when every seed's test is
    resolved the same way, ``p`` the largest of theirs); the whole grid one exploratory family, adjusted by Holm and
    Benjamini-Hochberg (:func:`~posenc_lab.lab.verdicts.statistics.adjusted`). ``outcome``: ``higher`` or ``lower`` where the mean
    difference is at least ``floor`` and survives Benjamini-Hochberg at ``alpha``, ``not resolved`` otherwise.
    Columns: ``method``, ``against``, ``multiple`` (of the training length), ``eval_len``, ``difference`` (the mean
    over seeds), ``low``/``high`` (the smallest and largest seed's), ``seeds``, ``p``, ``p holm``, ``p BH``,
    ``survives``, ``outcome``. Pass the methods that learned the task (:func:`learned_methods`): a method that did not
    says nothing about extrapolation."""
    from posenc_lab.lab.measure.accuracy import frame as retrieval_frame, seed_counts
    from posenc_lab.lab.verdicts.statistics import adjusted, compare_counts

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


# --------------------------------------------------------------------------------------------- beside the verdicts


def power_table(rows, *, judged_len: int = 2048, alpha: float = ALPHA) -> pd.DataFrame:
    """Beside every verdict, the comparison it rests on in the primary mode (:func:`deciding`) and what its seeds can
    resolve: ``difference`` (nats), ``sd`` (of the per-seed differences), ``seeds``, ``resolves`` (the smallest
    difference, in nats, that its two-sided t-test resolves with 80 % power at that spread:
    :func:`~posenc_lab.lab.verdicts.statistics.smallest_resolved`) and ``why`` for a verdict not resolved: ``inside the floor`` or
    ``too few seeds``."""
    from posenc_lab.lab.verdicts.statistics import FLOOR

    records = []
    for part, p in part_verdicts(rows, judged_len=judged_len, alpha=alpha).items():
        t, c = deciding(p["pairs"][p["mode"]])
        if t is None:
            continue
        why = ""
        if p["verdict"].startswith("not resolved"):
            why = "inside the floor" if abs(c.diff) < FLOOR else "too few seeds"
        against = t.b.label if isinstance(t.b, Quantity) else f"line {t.b:g}"
        records.append({"claim": part, "verdict": p["verdict"], "mode": p["mode"],
                        "comparison": f"{t.a} against {against}", "difference": c.diff,
                        "sd": c.se * math.sqrt(c.n[0]) if c.kind in ("paired", "threshold") else math.nan,
                        "seeds": c.n[0], "resolves": smallest_resolved(c), "why": why})
    return pd.DataFrame(records)


def document_table(rows, documents, *, judged_len: int = 2048, alpha: float = ALPHA) -> pd.DataFrame:
    """Documents as samples beside the seeds, for the comparison each claim part rests on in the primary mode
    (:func:`deciding`) where it is between two labels: the seeds' paired t-test (``difference``, ``se seeds``) and
    the crossed seed x document model (:func:`~posenc_lab.lab.verdicts.claims.document_model`: ``difference model``, ``se model``,
    ``seed sd``, ``document sd``). A sensitivity; no verdict rests on it."""
    from posenc_lab.lab.verdicts.claims import document_model

    df = frame(rows)
    train = int(df["train_len"].iloc[0])
    records = []
    for part, p in part_verdicts(df, judged_len=judged_len, alpha=alpha).items():
        t, c = deciding(p["pairs"][p["mode"]])
        if t is None or not isinstance(t.b, Quantity):
            continue
        m = document_model(documents, t, p["mode"], train=train)
        records.append({"claim": part, "comparison": f"{t.a} against {t.b}", "difference": c.diff, "se seeds": c.se,
                        "difference model": m["diff"], "se model": m["se"], "seed sd": m["seed_sd"],
                        "document sd": m["document_sd"]})
    return pd.DataFrame(records)


def seed_group_shift(rows, late, *, judged_len: int = 2048, alpha: float = ALPHA) -> pd.DataFrame:
    """Whether the seeds in ``late`` (trained elsewhere: another device, other kernels) differ from the others in
    the comparisons the verdicts rest on: per claim part's deciding comparison between two labels (primary mode),
    the mean per-seed difference over the other seeds and over ``late``, ``shift`` (late minus early), the
    standard deviation of the per-seed differences within the two groups (``seed sd``, pooled), and Welch's ``p``
    of the shift (scipy)."""
    from scipy import stats as st

    df = frame(rows)
    late = set(late)
    records = []
    for part, p in part_verdicts(df, judged_len=judged_len, alpha=alpha).items():
        t, c = deciding(p["pairs"][p["mode"]])
        if t is None or not isinstance(t.b, Quantity):
            continue
        d = (values(df, p["mode"], t.a) - values(df, p["mode"], t.b)).dropna()
        a, b = d[~d.index.isin(late)], d[d.index.isin(late)]
        if len(a) < 2 or len(b) < 2:
            continue
        pooled = math.sqrt(((len(a) - 1) * a.var() + (len(b) - 1) * b.var()) / (len(a) + len(b) - 2))
        records.append({"claim": part, "comparison": f"{t.a} against {t.b}", "early": float(a.mean()),
                        "late": float(b.mean()), "shift": float(b.mean() - a.mean()), "seed sd": pooled,
                        "p": float(st.ttest_ind(b, a, equal_var=False).pvalue)})
    return pd.DataFrame(records)


def other_readings(rows, *, judged_len: int = 2048, alpha: float = ALPHA) -> pd.DataFrame:
    """Each claim part under the declared analysis and under the readings it set aside (book/analysis.md), so that a
    reader sees which verdicts a reading decides: ``claim``, ``declared`` (:func:`part_verdicts`' decision),
    ``reading`` and ``verdict`` under it. The readings: a claim without its margin ("worse" for "slightly worse" and
    for "clearly worse"); the size of the log growth for "most stable"; only the first half of "holds to about 2x";
    "below the break" for "stays flat"; non-overlapping windows as the primary mode; the first three seeds alone."""
    from posenc_lab.lab.verdicts.claims import BREAK, decided as decide, judge, run_test

    df = frame(rows)
    parts = part_verdicts(df, judged_len=judged_len, alpha=alpha)
    first = next(iter(parts.values()))["mode"] if parts else PRIMARY
    records = []

    def add(part, reading, verdict):
        records.append({"claim": part, "declared": parts[part]["verdict"], "reading": reading, "verdict": verdict})

    def rejudge(part, tests):
        return judge([(t, run_test(df, first, t, alpha=alpha)) for t in tests], alpha=alpha)

    for part, p in parts.items():
        pairs = p["pairs"][first]
        tests = [t for t, _ in pairs]
        if not tests:
            continue
        if any(t.reading in ("slightly", "clearly") for t in tests):
            add(part, "without its margin", rejudge(part, [Test(t.a, t.b, t.want) for t in tests]))
        if part == "1: b (most stable)":
            add(part, "smallest |log growth|", rejudge(part, [Test(Quantity("flatness", t.a.label, t.a.length),
                                                                  Quantity("flatness", t.b.label, t.b.length), "<")
                                                             for t in tests]))
        if part == "ordering: T5 holds to about 2x":
            add(part, "below the break at 2x only", rejudge(part, [t for t in tests if t.want == "<"]))
        if part == "ordering: ALiBi stays flat":
            add(part, "below the break", rejudge(part, [Test(t.a, BREAK, "<") for t in tests]))
    if PRIMARY in set(df["eval_mode"]) and SENSITIVITY in set(df["eval_mode"]):
        for part, v in decide(df[df.eval_mode == SENSITIVITY], modes=(SENSITIVITY,), judged_len=judged_len,
                              alpha=alpha).items():
            add(part, "non-overlapping windows primary", v)
    seeds = sorted(df["seed"].unique())
    if len(seeds) > 3:
        for part, v in decide(df[df.seed.isin(seeds[:3])], judged_len=judged_len, alpha=alpha).items():
            add(part, f"seeds {seeds[0]}-{seeds[2]} only", v)
    return pd.DataFrame(records, columns=["claim", "declared", "reading", "verdict"])


#: each claim part in a few words, for the rows of the verdict figure
SHORT = {
    "1: a (slightly worse at training length)": "1a ALiBi slightly worse than RoPE at 512",
    "1: b (most stable)": "1b ALiBi degrades least",
    "2: ntk most accurate": "2 NTK the most accurate",
    "2: dynamic-ntk most accurate": "2 dynamic NTK the most accurate",
    "2: yarn most accurate (ours)": "2 YaRN the most accurate (ours)",
    "3: clearly worse than RoPE": "3 T5 clearly worse than RoPE",
    "3: clearly worse than ALiBi": "3 T5 clearly worse than ALiBi",
    "ordering: sinusoidal breaks first, then rotary": "the sinusoids break first, then RoPE",
    "ordering: T5 holds to about 2x": "T5 holds to about 2x",
    "ordering: ALiBi stays flat": "ALiBi stays flat",
}


def verdict_effects(rows, *, judged_len: int = 2048, alpha: float = ALPHA) -> pd.DataFrame:
    """The effect each claim part's verdict rests on (:func:`deciding`, primary mode), ready to draw on a log axis:
    ``claim`` (in a few words), ``part``, ``verdict``, ``ratio`` (``exp(diff)``: a ratio of perplexities, of growth
    factors, or of a growth factor to its line) with its 95 % interval ``low``/``high``, ``margin`` (the ratio of the
    test's margin, or NaN), ``reading`` (direction, slightly, clearly, equivalent) and ``what`` (the comparison in
    words: ``A / B``)."""
    records = []
    for part, p in part_verdicts(rows, judged_len=judged_len, alpha=alpha).items():
        t, c = deciding(p["pairs"][p["mode"]])
        if t is None:
            continue
        low, high = c.interval
        if isinstance(t.b, Quantity):
            kind = "growth" if t.a.kind in ("growth", "flatness") else "perplexity"
            what = f"{kind}: {_name(t.a.label)} / {_name(t.b.label)} at {t.a.length:,}"
        elif t.reading == "equivalent":
            what = f"growth of {_name(t.a.label)} to {t.a.length:,}, within ±{100 * math.expm1(t.margin):.0f} %"
        else:
            what = f"growth of {_name(t.a.label)} to {t.a.length:,} / the break, {t.b:.2f}"
        records.append({"claim": SHORT.get(part, part), "part": part, "verdict": p["verdict"], "ratio": c.ratio,
                        "low": low, "high": high,
                        "margin": math.exp(t.margin) if t.reading != "direction" else math.nan,
                        "reading": t.reading, "what": what})
    return pd.DataFrame(records)
