"""The effective context length of every model of the book, read from the committed results.

RULER (Hsieh et al. 2024) and NoLiMa (Modarressi et al. 2025) report an *effective context length*: the longest
length whose score passes a bar. RULER's bar is one fixed score for every model (Llama-2-7B's at 4K tokens);
NoLiMa's is 85 % of the model's own short-context score. The package uses NoLiMa's share: measured against the
model's own score, the length means something for small models whose absolute scores are low. Here the short context
is the training length ``L`` and the lengths are those a committed run evaluated. Nothing is trained or evaluated
again.

**Retrieval** (the runs ``retrieval-*``, :mod:`posenc_lab.lab.experiments.retrieval`). A seed's score at a length is its exact
match pooled over the needle depths, ``correct / trials``. The seed *keeps* its score at ``L' > L`` when::

    accuracy(L') >= KEEP * accuracy(L),    KEEP = 85 / 100,

compared exactly as fractions of the integer counts, so a score at exactly 85 % keeps it.

**The far context** (the runs ``context-*``, chapter 9's measure, :mod:`posenc_lab.lab.measure.far_context`). At ``L' > L`` the gain
is the far targets' loss with attention limited to the last ``L`` keys minus their loss with full attention,
one number per seed. A seed keeps at ``L'`` when the far context does not hurt it: ``gain >= -floor``, where
``floor`` is the book's smallest difference that counts, :data:`~posenc_lab.lab.verdicts.statistics.FLOOR` (``log 1.01``, a 1 %
ratio of perplexities; ``floor=0`` reads "not negative" literally). At ``L`` itself the two attentions are the
same, so the gain is zero and ``L`` always keeps.

**The first-failure rule.** The effective length is the longest evaluated length ``L' >= L`` such that the seed
keeps at ``L'`` *and at every evaluated length between L and L'*: the lengths are read in increasing order and the
first that fails stops the count, even if a longer one keeps again. (The papers report the longest length that
passes; where scores fall with length the two agree, and where a score recovers after a failure this reading stops
earlier.) A length the model cannot run at (a learned table past its size: ``cannot extrapolate``) fails. When the
first length past ``L`` already fails, the effective length is ``L`` itself (:func:`first_failure`).

**A score at L near chance** (retrieval only). The ratio to a score that is no better than guessing means
nothing, so each seed's score at ``L`` is tested against the task's chance level (:data:`CHANCE`) by a one-sided
exact binomial test (``scipy.stats.binomtest``, ``alternative="greater"``) on its pooled windows at ``L``, at
``alpha = 0.05``. A seed whose p-value is at least ``alpha`` is flagged ``at_chance`` and has no effective length
(NaN); the summaries count the flagged seeds and leave them out.

**Over seeds.** Seeds are the samples: each seed gets its own effective length, and a label's summary is the
median (the lower of the two middle values for an even count, so it is always an evaluated length), the minimum
and the maximum over its seeds that have one (:func:`summary`). :func:`book_table` puts every committed run side
by side; ``python -m posenc_lab.lab.measure.effective_length`` prints it as markdown.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.effective_length")

import math
from fractions import Fraction

import pandas as pd
from scipy.stats import binomtest

from posenc_lab.errors import PosencError
from posenc_lab.lab import results
from posenc_lab.lab.data.tasks import DIGITS, DIGITS_LEN, MULTIKEYS, SLOTS
from posenc_lab.lab.measure.accuracy import frame as retrieval_frame
from posenc_lab.lab.measure.far_context import label_column
from posenc_lab.lab.verdicts.statistics import ALPHA, FLOOR

#: the share of its own score at the training length a model must keep (NoLiMa's 85 %), as an exact fraction
KEEP = Fraction(85, 100)

#: the exact-match score of a model that does not do what each retrieval task tests: ``content`` guesses each of
#: the four passkey bytes within its own alphabet (1/10 each); ``digits`` guesses the five digits (1/10 each);
#: ``multikey`` copies one of the ``tasks.MULTIKEYS`` keys of the window without reading the
#: name asked for (a model that copies perfectly but cannot tell names apart scores this)
CHANCE = {
    "content": math.prod(1 / len(slot) for slot in SLOTS),
    "digits": (1 / len(DIGITS)) ** DIGITS_LEN,
    "multikey": 1 / MULTIKEYS,
}

#: the name of the far-context measure in the tables
FAR_CONTEXT = "far context"

#: the columns of a per-seed table (:func:`retrieval_seeds`, :func:`gain_seeds`, :func:`run_seeds`)
SEED_COLUMNS = ["run", "measure", "label", "seed", "train_len", "evaluated", "score_at_L", "chance", "p_chance",
                "at_chance", "effective_len"]


def first_failure(train_len: int, keeps) -> int:
    """The effective length under the first-failure rule: ``keeps`` holds ``(length, kept)`` pairs, one per
    evaluated length; the lengths above ``train_len`` are read in increasing order and the last one before the
    first ``kept`` that is false is returned (``train_len`` when the first one already fails)."""
    effective = train_len
    for length, kept in sorted((int(n), bool(k)) for n, k in keeps):
        if length <= train_len:
            continue
        if not kept:
            break
        effective = length
    return effective


def chance_test(correct: int, trials: int, chance: float, *, alpha: float = ALPHA) -> tuple[bool, float]:
    """``(at_chance, p)``: the one-sided exact binomial test of ``correct`` out of ``trials`` against the
    probability ``chance`` (alternative: above chance). ``at_chance`` when ``p >= alpha``, and always when there
    are no trials (``p`` NaN)."""
    if trials <= 0:
        return True, math.nan
    p = float(binomtest(int(correct), int(trials), chance, alternative="greater").pvalue)
    return p >= alpha, p


def _share(cell) -> Fraction:
    return Fraction(int(cell["correct"]), int(cell["trials"]))


def _retrieval_seed(cells: pd.DataFrame, train_len: int, chance: float, alpha: float) -> dict:
    """One label and seed of a retrieval run: ``cells`` holds its correct and trials per length (depths pooled)
    and whether every cell ran (``ok``)."""
    if train_len not in cells.index:
        raise PosencError(f"no score at the training length {train_len}: evaluated {sorted(cells.index)}")
    base = cells.loc[train_len]
    flagged, p = chance_test(int(base["correct"]), int(base["trials"]) if base["ok"] else 0, chance, alpha=alpha)
    score = _share(base) if base["trials"] > 0 else Fraction(0)

    def kept(n) -> bool:  # exact: a score of exactly KEEP times the score at L keeps it
        cell = cells.loc[n]
        return bool(cell["ok"]) and cell["trials"] > 0 and _share(cell) >= KEEP * score

    effective = math.nan if flagged else first_failure(train_len, [(n, kept(n)) for n in cells.index])
    return {"evaluated": tuple(int(n) for n in cells.index), "score_at_L": float(score), "chance": chance,
            "p_chance": p, "at_chance": flagged, "effective_len": effective}


def retrieval_seeds(rows, *, alpha: float = ALPHA, run: str = "") -> pd.DataFrame:
    """Per label and seed of a retrieval run's rows (``results.json``, one task): the score at the training length
    (depths pooled), the chance test of it, and the effective length (the module's rules;
    :data:`SEED_COLUMNS`)."""
    df = retrieval_frame(rows)
    tasks = set(df["task"]) if "task" in df else {"content"}
    if len(tasks) != 1:
        raise PosencError(f"the rows of one retrieval run hold one task, got {sorted(tasks)}")
    task = tasks.pop()
    df = df.assign(ok=df["status"] == "ok")
    cells = df.groupby(["label", "seed", "eval_len"]).agg(correct=("correct", "sum"), trials=("trials", "sum"),
                                                         ok=("ok", "all"), train_len=("train_len", "first"))
    out = []
    for (label, seed), mine in cells.groupby(level=["label", "seed"]):
        mine = mine.droplevel(["label", "seed"]).sort_index()
        train_len = int(mine["train_len"].iloc[0])
        out.append({"run": run, "measure": task, "label": label, "seed": int(seed), "train_len": train_len,
                    **_retrieval_seed(mine, train_len, CHANCE[task], alpha)})
    return _seed_frame(out)


def gain_seeds(rows, *, floor: float = FLOOR, run: str = "") -> pd.DataFrame:
    """Per label and seed of a context run's gain rows (``gain.json``): the effective length at which the far
    context past the training length does not hurt (``gain >= -floor`` at every evaluated length up to it; the
    module's rules; :data:`SEED_COLUMNS`, with the chance columns empty)."""
    df = pd.DataFrame(list(rows))
    if df.empty:
        raise PosencError("no gain rows")
    df = df.assign(label=label_column)
    df["kept"] = (df["status"] == "ok") & (pd.to_numeric(df["gain"], errors="coerce") >= -floor)
    out = []
    for (label, seed), mine in df.groupby(["label", "seed"]):
        if mine["eval_len"].duplicated().any():
            raise PosencError(f"{label} seed {seed} has two gain rows at one length: rows of two runs mixed?")
        train_len = int(mine["train_len"].iloc[0])
        out.append({"run": run, "measure": FAR_CONTEXT, "label": label, "seed": int(seed), "train_len": train_len,
                    "evaluated": (train_len, *sorted(int(n) for n in mine["eval_len"])), "score_at_L": math.nan,
                    "chance": math.nan, "p_chance": math.nan, "at_chance": False,
                    "effective_len": first_failure(train_len, zip(mine["eval_len"], mine["kept"]))})
    return _seed_frame(out)


def _seed_frame(records: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(records, columns=SEED_COLUMNS)
    table["effective_len"] = table["effective_len"].astype("Int64")  # NaN stays missing; lengths stay integers
    return table


def retrieval_runs() -> list[str]:
    """The committed retrieval runs (:data:`~posenc_lab.lab.results.RUNS` named ``retrieval-*``)."""
    return [name for name in results.RUNS if name.startswith("retrieval-")]


def context_runs() -> list[str]:
    """The committed context runs (:data:`~posenc_lab.lab.results.RUNS` named ``context-*``), which measure the gain."""
    return [name for name in results.RUNS if name.startswith("context-")]


def run_seeds(name: str, *, alpha: float = ALPHA, floor: float = FLOOR) -> pd.DataFrame:
    """The per-seed effective lengths of committed run ``name``: :func:`retrieval_seeds` for a retrieval run,
    :func:`gain_seeds` for a context run."""
    if name in context_runs():
        return gain_seeds(results.read_json(name, "gain.json"), floor=floor, run=name)
    if name in retrieval_runs():
        rows, _, _ = results.load(name)
        return retrieval_seeds(rows, alpha=alpha, run=name)
    raise PosencError(f"{name!r} is neither a retrieval nor a context run; known: "
                      f"{', '.join(retrieval_runs() + context_runs())}")


def book_seeds(runs=None, *, alpha: float = ALPHA, floor: float = FLOOR) -> pd.DataFrame:
    """The per-seed effective lengths of ``runs`` (every committed retrieval and context run by default), one
    table."""
    names = list(runs) if runs is not None else retrieval_runs() + context_runs()
    return pd.concat([run_seeds(n, alpha=alpha, floor=floor) for n in names], ignore_index=True)


def _lower_median(values: pd.Series) -> float:
    ordered = values.dropna().sort_values().tolist()
    return math.nan if not ordered else ordered[(len(ordered) - 1) // 2]


def summary(per_seed: pd.DataFrame) -> pd.DataFrame:
    """Per run, measure and label of a per-seed table: ``seeds`` (how many), ``at_chance`` (how many flagged),
    and over the others the ``median`` (lower median: always an evaluated length), ``low`` and ``high`` of the
    effective length, with the run's ``train_len``."""
    def one(g: pd.DataFrame) -> pd.Series:
        lengths = g["effective_len"].astype(float)
        return pd.Series({"train_len": int(g["train_len"].iloc[0]), "seeds": len(g),
                          "at_chance": int(g["at_chance"].sum()), "median": _lower_median(lengths),
                          "low": lengths.min(), "high": lengths.max()})

    groups = per_seed.groupby(["run", "measure", "label"], sort=False)
    return pd.DataFrame({key: one(g) for key, g in groups}).T.rename_axis(["run", "measure", "label"])


def _cell(r: pd.Series) -> str:
    seeds, flagged = int(r["seeds"]), int(r["at_chance"])
    if flagged == seeds:
        return f"at chance ({flagged}/{seeds})"
    text = f"{int(r['median'])}"
    if r["low"] != r["high"]:
        text += f" [{int(r['low'])}–{int(r['high'])}]"
    return text + (f" ({flagged}/{seeds} at chance)" if flagged else "")


def column_title(run: str, measure: str, train_len: int) -> str:
    """The title of a run's column in :func:`book_table`: the measure, the run and its training length."""
    return f"{measure} ({run}, L={train_len})"


def book_table(runs=None, *, alpha: float = ALPHA, floor: float = FLOOR, per_seed: pd.DataFrame | None = None
               ) -> pd.DataFrame:
    """One row per label (encoding, or ``encoding/strategy``) and one column per run (its measure, the run and
    its ``L``, :func:`column_title`): the effective length in bytes over the seeds, ``median [min–max]`` (one value
    when the seeds agree), with the count of seeds whose score at ``L`` was at chance; empty where the run did not
    measure the label. ``per_seed`` (from :func:`book_seeds`) is read instead of the committed runs when given."""
    per_seed = book_seeds(runs, alpha=alpha, floor=floor) if per_seed is None else per_seed
    table = summary(per_seed).reset_index()
    table["column"] = [column_title(r["run"], r["measure"], int(r["train_len"])) for _, r in table.iterrows()]
    table["cell"] = table.apply(_cell, axis=1)
    wide = table.pivot(index="label", columns="column", values="cell")
    return wide[list(dict.fromkeys(table["column"]))].fillna("").rename_axis(index="label", columns=None)


def markdown_table(table: pd.DataFrame | None = None) -> str:
    """:func:`book_table` (of every committed run unless ``table`` is given) as a markdown table."""
    table = book_table() if table is None else table
    lines = ["| label | " + " | ".join(table.columns) + " |", "|---" * (len(table.columns) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(row) + " |" for label, row in table.iterrows()]
    return "\n".join(lines)


#: the rules of :func:`book_table`, in one paragraph (printed under the table)
RULES = ("Effective length in bytes: per seed, the longest evaluated length L' >= L such that the seed keeps its "
         "score at every evaluated length from L to L' (the first failure stops; L when the first longer one fails). "
         "Retrieval: exact match (depths pooled) >= 85 % of the seed's own at L; a seed whose score at L is not "
         "above chance (one-sided binomial test, alpha 0.05) is counted 'at chance' and left out. Far context: "
         "gain >= -log 1.01 nats. Cells: median [min–max] over the seeds.")


def main(argv=None) -> int:
    """``python -m posenc_lab.lab.measure.effective_length [RUN ...] [--per-seed]``: the effective lengths of the committed runs (every
    retrieval and context run unless named) as a markdown table, or every seed's with ``--per-seed``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m posenc_lab.lab.measure.effective_length", description=main.__doc__)
    parser.add_argument("runs", nargs="*", help="committed retrieval or context runs (default: all of them)")
    parser.add_argument("--per-seed", action="store_true", help="print every seed's row instead of the summary")
    args = parser.parse_args(argv)
    seeds = book_seeds(args.runs or None)
    if args.per_seed:
        print(seeds.to_string(index=False))
    else:
        print(markdown_table(book_table(per_seed=seeds)))
        print()
        print(RULES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
