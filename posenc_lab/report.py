"""The results table summarised over seeds, and the claims judged against the noise (``python -m posenc_lab report``).

The tidy table (one row per encoding, strategy, seed, length and mode) is a ``pandas.DataFrame``;
summaries are its group-bys. Every verdict on a claim uses one decision rule, :data:`RULE`: seeds
are the samples, and a difference is *resolved* only when it exceeds two standard errors of the
difference of means. A difference inside the noise is reported as *not resolved*, never as holds
or fails; with a single seed nothing can be resolved, and the direction alone is reported.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import PosencError

RULE = ("A and B differ when |mean(A) - mean(B)| > 2 * sqrt(sd(A)^2/n(A) + sd(B)^2/n(B)), with the seeds as "
        "samples (two standard errors of the difference); otherwise the comparison is not resolved. Two "
        "strategies applied to the same trained model are compared seed by seed (paired): the standard error "
        "is that of the per-seed differences. With one seed there is no standard error and nothing is "
        "resolved. With three seeds, two standard errors is a lenient bar (roughly a 10-20 % chance per "
        "comparison that pure noise passes it), so a claim that needs several comparisons to hold is the "
        "safer reading.")
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
    ``mean ± std`` over seeds (the header says how many)."""
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
        lines.append(f"| {name} | " + " | ".join("" if pd.isna(v) else v for v in row) + " |")
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
    return "\n".join(text)


# --------------------------------------------------------------------------------------------- the noise


@dataclass(frozen=True)
class Comparison:
    """``mean(A) - mean(B)``, its standard error, and whether it is resolved under :data:`RULE`
    (``z`` standard errors; the rule's 2 unless a caller asks for stricter)."""

    diff: float
    se: float
    n: tuple[int, int]
    z: float = 2.0

    @property
    def resolved(self) -> bool:
        return min(self.n) > 1 and not math.isnan(self.se) and abs(self.diff) > self.z * self.se

    @property
    def sign(self) -> str:
        """``"<"``, ``">"`` (A below / above B, resolved) or ``"~"`` (not resolved)."""
        return ("<" if self.diff < 0 else ">") if self.resolved else "~"


def compare(a, b, *, z: float = 2.0) -> Comparison:
    """Compare two samples (values over seeds) under :data:`RULE`; ``b`` may be a number (a threshold)."""
    a = np.asarray(a, dtype=float)
    b_values = np.asarray([b] if np.isscalar(b) else b, dtype=float)
    a, b_values = a[~np.isnan(a)], b_values[~np.isnan(b_values)]
    if not len(a) or not len(b_values):
        return Comparison(math.nan, math.nan, (len(a), len(b_values)), z)
    var_a = a.var(ddof=1) / len(a) if len(a) > 1 else math.nan
    if np.isscalar(b):
        return Comparison(a.mean() - float(b), math.sqrt(var_a) if len(a) > 1 else math.nan, (len(a), math.inf), z)
    var_b = b_values.var(ddof=1) / len(b_values) if len(b_values) > 1 else math.nan
    return Comparison(a.mean() - b_values.mean(), math.sqrt(var_a + var_b), (len(a), len(b_values)), z)


def compare_paired(a: pd.Series, b: pd.Series, *, z: float = 2.0) -> Comparison:
    """Compare two samples indexed by seed, seed by seed: the mean and standard error of ``a - b`` over the
    seeds both have (for two strategies applied to the same trained model)."""
    diff = (a - b).dropna()
    if diff.empty:
        return Comparison(math.nan, math.nan, (0, 0), z)
    se = diff.std(ddof=1) / math.sqrt(len(diff)) if len(diff) > 1 else math.nan
    return Comparison(float(diff.mean()), se, (len(diff), len(diff)), z)


_compare = compare


def verdict(comparisons: list[Comparison], want: str) -> str:
    """``holds`` when every comparison is resolved in direction ``want`` (``"<"`` or ``">"``), ``fails``
    when one is resolved against it, ``not resolved`` otherwise; ``(direction: ...)`` is added when
    nothing is resolved, so a single-seed run still says which way the means point; ``no data`` when
    there is nothing to compare."""
    comparisons = [c for c in comparisons if not math.isnan(c.diff)]
    if not comparisons:
        return "no data"
    if any(c.resolved and c.sign != want for c in comparisons):
        return "fails"
    if all(c.resolved and c.sign == want for c in comparisons):
        return "holds"
    leaning = all((c.diff < 0) == (want == "<") for c in comparisons if not math.isnan(c.diff))
    return f"not resolved (the means point to {'holds' if leaning else 'fails'})"


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


def claims(rows, mode: str, *, judged_len: int = 2048, z: float = 2.0) -> list[dict]:
    """The article's three claims and the ALiBi paper's ordering, judged at ``judged_len`` in one mode.

    ``judged_len`` is the article's 4x of 512 (2048); the claims speak of "beyond training", and each
    verdict names the length it used. Every verdict states its criterion, the numbers (mean ± std
    over seeds) and the decision rule, so a reader can disagree with the criterion without having to
    trust the conclusion. ``z`` is the rule's number of standard errors (2).
    """
    df = frame(rows)

    def compare(a, b):
        return _compare(a, b, z=z)

    df = df[df.eval_mode == mode]
    lengths = sorted(df["eval_len"].unique())
    train = int(df["train_len"].iloc[0])
    if judged_len not in lengths:
        judged_len = lengths[-1]
    n = judged_len
    out = []

    def g(name):
        return growth(df, mode, name, n)

    candidates = [name for name in sorted(df["label"].unique())
                  if (not name.startswith("rope/") or name == "rope/none") and not g(name).isna().all()]
    others = [c for c in candidates if c != "alibi"]
    out.append({
        "id": "1",
        "claim": "1. ALiBi is slightly worse than RoPE at the training length but the most stable beyond it",
        "criterion": f"(a) ALiBi's perplexity at {train} above RoPE's (no scaling); (b) ALiBi's growth "
                     f"ppl({n}) / ppl({train}) below that of every other encoding that can run at {n}",
        "numbers": f"at {train}: ALiBi {_fmt(seed_values(df, mode, 'alibi', train))}, RoPE "
                   f"{_fmt(seed_values(df, mode, 'rope/none', train))}; growth to {n}: "
                   + ", ".join(f"{c} {_fmt(g(c))}" for c in sorted(candidates, key=lambda c: g(c).mean())),
        "verdicts": {
            "a (worse at training length)": verdict([compare(seed_values(df, mode, "alibi", train),
                                                             seed_values(df, mode, "rope/none", train))], ">"),
            "b (most stable)": verdict([compare(g("alibi"), g(c)) for c in others], "<"),
        },
    })
    strategies = sorted(name for name in df["label"].unique() if name.startswith("rope/") and "+ft" not in name)
    ntk = min(("rope/ntk", "rope/dynamic-ntk"), key=lambda s: seed_values(df, mode, s, n).mean())
    rivals = [s for s in strategies if s not in ("rope/ntk", "rope/dynamic-ntk")]
    out.append({
        "id": "2",
        "claim": "2. RoPE with NTK-style scaling is the most accurate RoPE strategy past the training length",
        "criterion": f"the better of ntk and dynamic-ntk ({ntk.split('/')[1]} here) has a lower perplexity at {n} "
                     f"than every other strategy without fine-tuning (paired by seed: one trained model per seed)",
        "numbers": f"at {n}: " + ", ".join(f"{s.split('/')[1]} {_fmt(seed_values(df, mode, s, n))}" for s in
                                          sorted(strategies, key=lambda s: seed_values(df, mode, s, n).mean())),
        "verdicts": {"NTK best": verdict([compare_paired(seed_values(df, mode, ntk, n), seed_values(df, mode, s, n),
                                                         z=z) for s in rivals], "<")},
    })
    out.append({
        "id": "3",
        "claim": "3. T5's bias extrapolates clearly worse than RoPE and ALiBi",
        "criterion": f"T5's growth ppl({n}) / ppl({train}) above RoPE's (no scaling) and above ALiBi's",
        "numbers": f"growth to {n}: T5 {_fmt(g('t5'))}, RoPE {_fmt(g('rope/none'))}, ALiBi {_fmt(g('alibi'))}",
        "verdicts": {"worse than RoPE": verdict([compare(g("t5"), g("rope/none"))], ">"),
                     "worse than ALiBi": verdict([compare(g("t5"), g("alibi"))], ">")},
    })
    beyond = [length for length in lengths if length > train]
    if not beyond:
        return out

    def breaks(name, length):  # growth above BREAK (resolved), below it (resolved), or unresolved
        return compare(growth(df, mode, name, length), BREAK)

    def first_break(name):
        for length in beyond:
            c = breaks(name, length)
            if c.resolved and c.diff > 0:
                return length
        return None

    order = {name: first_break(name) for name in ("sinusoidal", "rope/none", "t5", "alibi")}
    out.append({
        "id": "ordering",
        "claim": "ALiBi paper's ordering: sinusoidal breaks first, then rotary, T5 holds to about 2x, ALiBi stays flat",
        "criterion": f"an encoding breaks at a length when its growth over the training length exceeds {BREAK} "
                     f"(resolved against the threshold by the same rule); judged at {', '.join(map(str, beyond))}",
        "numbers": "; ".join(f"{name}: breaks at {order[name] or 'no length'} (growth "
                             + ", ".join(f"{length}: {_fmt(growth(df, mode, name, length))}" for length in beyond) + ")"
                             for name in order),
        "verdicts": {
            "ALiBi stays flat": verdict([breaks("alibi", length) for length in beyond], "<"),
            "sinusoidal breaks at the first longer length": verdict([breaks("sinusoidal", beyond[0])], ">"),
            "T5 holds to 2x": verdict([breaks("t5", length) for length in beyond if length <= 2 * train], "<"),
        },
    })
    return out


def claims_text(rows, mode: str, *, judged_len: int = 2048, width: int = 76) -> str:
    """:func:`claims` as plain text wrapped at ``width``, the decision rule first."""
    lines = textwrap.wrap(f"decision rule: {RULE}", width) + [""]
    for c in claims(rows, mode, judged_len=judged_len):
        lines += textwrap.wrap(c["claim"], width, subsequent_indent="   ")
        for name, text in (("criterion", c["criterion"]), (f"measured ({mode})", c["numbers"])):
            lines += textwrap.wrap(f"{name}: {text}", width, initial_indent="  ", subsequent_indent="    ")
        for part, v in c["verdicts"].items():
            lines += textwrap.wrap(f"verdict, {part}: {v}", width, initial_indent="  ", subsequent_indent="    ")
        lines.append("")
    return "\n".join(lines).rstrip()


def verdict_table(rows, *, modes=("nonoverlapping", "sliding"), judged_lens=(2048,), z: float = 2.0) -> pd.DataFrame:
    """Every claim's verdicts in one table: a row per claim and part, a column per (mode, judged length)."""
    records = [{"claim": f"{c['id']}: {part}", "mode": mode, "judged at": length, "verdict": v}
               for mode in modes for length in judged_lens
               for c in claims(rows, mode, judged_len=length, z=z) for part, v in c["verdicts"].items()]
    table = pd.DataFrame(records).pivot(index="claim", columns=["mode", "judged at"], values="verdict")
    return table.loc[list(dict.fromkeys(r["claim"] for r in records))]


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
