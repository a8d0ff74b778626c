"""Exact-match accuracy of the retrieval runs: Wilson intervals, and the tables by length, distance and seed.

A grid cell of a retrieval run counts ``correct`` windows out of ``trials``. Windows scored by one trained
model are not independent samples of its encoding, so the tables keep two intervals apart: the Wilson
interval of the pooled windows (how precisely these models' accuracy is known) and the interval from the
seeds (:func:`~posenc_lab.lab.verdicts.statistics.seed_interval`, how another seed would do).
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.accuracy")

import math

from posenc_lab.errors import PosencError
from posenc_lab.lab.run.schema import CONTENT_KEY_LEN

def wilson(correct: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % for ``z = 1.96``)."""
    if trials == 0:
        return math.nan, math.nan
    p = correct / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    # at p = 0 and p = 1 the interval ends exactly at 0 and 1; rounding must not put it past p (0.9999... < 1)
    low = 0.0 if correct == 0 else max(0.0, min(p, centre - half))
    high = 1.0 if correct == trials else min(1.0, max(p, centre + half))
    return low, high


def frame(rows):
    """The retrieval rows as a DataFrame with a ``label`` column (``rope/yarn``, ``alibi``, ...)."""
    from posenc_lab.lab.verdicts.statistics import frame as results_frame

    return results_frame(rows)


def with_wilson(table):
    """Add ``ci_low`` and ``ci_high``, the Wilson 95 % interval of ``correct`` out of ``trials`` on each row, to
    the DataFrame ``table`` (in place; also returned)."""
    intervals = [wilson(int(c), int(t)) for c, t in zip(table["correct"], table["trials"])]
    table["ci_low"], table["ci_high"] = zip(*intervals) if intervals else ((), ())
    return table


#: the exact match at the training length, at the end of training, from which a model counts as having learned its
#: task: below it, what it does past the training length says nothing about extrapolation
LEARNED = 0.95


def by_length(rows):
    """Exact-match accuracy per label and length: ``accuracy``, the mean of the seeds' accuracies (each pooled over
    depths), with ``ci_low``/``ci_high`` its 95 % interval from the seeds (:func:`~posenc_lab.lab.verdicts.statistics.seed_interval`) and
    ``per_seed`` the seeds' accuracies; ``wilson_low``/``wilson_high`` the Wilson interval of all windows pooled,
    which is the precision of these trained models' pooled score, not an interval for the encoding. A DataFrame
    indexed by ``(label, eval_len)``; ``train_accuracy`` is the lowest over the seeds (a label counts as learned
    when every seed learned its task, :data:`LEARNED`)."""
    from posenc_lab.lab.verdicts.statistics import seed_interval

    df = frame(rows)
    pooled = df.groupby(["label", "eval_len"]).agg(correct=("correct", "sum"), trials=("trials", "sum"),
                                                   status=("status", "first"), train_accuracy=("train_accuracy", "min"))
    with_wilson(pooled)
    pooled = pooled.rename(columns={"ci_low": "wilson_low", "ci_high": "wilson_high"})
    seeds = df.groupby(["label", "eval_len", "seed"]).agg(correct=("correct", "sum"), trials=("trials", "sum"))
    per_seed = (seeds["correct"] / seeds["trials"].where(seeds["trials"] > 0)).groupby(["label", "eval_len"])
    intervals = per_seed.apply(lambda x: seed_interval(x.to_numpy()))
    pooled["accuracy"] = [intervals.loc[i][0] for i in pooled.index]
    pooled["ci_low"] = [intervals.loc[i][1] for i in pooled.index]
    pooled["ci_high"] = [intervals.loc[i][2] for i in pooled.index]
    pooled["per_seed"] = [tuple(round(float(v), 3) for v in per_seed.get_group(i)) for i in pooled.index]
    return pooled


def by_distance(rows, edges=(0, 64, 128, 256, 512, 1024, 2048)):
    """Exact-match accuracy per label and *absolute* distance from the question back to the needle, pooled over
    lengths, depths and seeds, with its Wilson 95 % interval: a DataFrame indexed by ``(label, distance)``, where
    ``distance`` is the bin ``[a, b)`` of ``edges`` (bytes) that each grid cell's distance falls in. It separates
    "far from the question" from "long window": an encoding that fails by distance fails at the same distance
    in every window; one that fails by length fails near the question too. The last bin is open (distances past
    the last edge fall in it). The intervals count windows, pooled over seeds: they say how precisely these
    models' accuracy is known, not how another seed would do (:func:`by_seed`)."""
    import pandas as pd

    df = frame(rows)
    df = df[df["status"] == "ok"].copy()
    if "distance" not in df:  # runs of the content task made before the column existed: the same geometry
        if "task" in df and set(df["task"].dropna()) - {"content"}:
            raise PosencError("rows of the digits or multikey task without a distance column: re-run them")
        last = df["eval_len"] - 2 * CONTENT_KEY_LEN
        df["distance"] = df["eval_len"] - CONTENT_KEY_LEN - (df["depth"] * last).round().astype(int)
    labels = [f"{a}-{b}" for a, b in zip(edges[:-1], edges[1:])] + [f"{edges[-1]}+"]
    df["distance_bin"] = pd.cut(df["distance"], bins=[*edges, math.inf], right=False, labels=labels)
    pooled = df.groupby(["label", "distance_bin"], observed=True).agg(correct=("correct", "sum"),
                                                                       trials=("trials", "sum"))
    pooled = pooled[pooled["trials"] > 0]
    pooled["accuracy"] = pooled["correct"] / pooled["trials"]
    with_wilson(pooled)
    return pooled.rename_axis(["label", "distance"])


def seed_counts(rows):
    """``correct`` and ``trials`` per label, length and seed, pooled over depths, from the rows that ran (``status``
    ok): the counts :func:`~posenc_lab.lab.verdicts.statistics.compare_counts` tests, indexed by ``(label, eval_len, seed)``."""
    df = frame(rows)
    df = df[df["status"] == "ok"]
    return df.groupby(["label", "eval_len", "seed"]).agg(correct=("correct", "sum"), trials=("trials", "sum"))


def by_seed(rows):
    """Exact-match accuracy per label, length and seed (pooled over depths): the samples a comparison of
    encodings rests on, since windows scored by the same trained model are not independent samples of the
    encoding."""
    g = seed_counts(rows)
    return g["correct"] / g["trials"]


def markdown_table(rows) -> str:
    """Exact match per encoding (rows) and length (columns): the mean of the seeds' accuracies [95 % interval from
    the seeds] and each seed's accuracy; a label some seed of which did not learn its task (:data:`LEARNED`) is
    marked so in its first column."""
    table = by_length(rows)
    lengths = sorted(table.index.get_level_values("eval_len").unique())
    lines = ["| exact match, mean of the seeds [95 % interval from the seeds] (each seed) | "
             + " | ".join(map(str, lengths)) + " |",
             "|---" * (len(lengths) + 1) + "|"]
    for name in sorted(table.index.get_level_values("label").unique()):
        cells = []
        for n in lengths:
            r = table.loc[(name, n)] if (name, n) in table.index else None
            if r is None:
                cells.append("")
            elif r["status"] != "ok":
                cells.append("cannot extrapolate")
            else:
                interval = "" if math.isnan(r["ci_low"]) else f" [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
                cells.append(f"{r['accuracy']:.2f}{interval} ({', '.join(f'{v:.2f}' for v in r['per_seed'])})")
        learned = table.loc[name]["train_accuracy"].min()
        mark = (" (training accuracy unknown)" if math.isnan(learned) else
                f" (not learned: lowest seed {learned:.2f} at the end of training)" if learned < LEARNED else "")
        lines.append(f"| {name}{mark} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
