"""The results table summarised over seeds, and the claims judged against the noise (``python -m posenc_lab report``).

The tidy table (one row per encoding, strategy, seed, length and mode) is a ``pandas.DataFrame``;
summaries are its group-bys. The tests live in :mod:`posenc_lab.lab.verdicts.statistics` and the claims in
:mod:`posenc_lab.lab.verdicts.claims`; this module re-exports the names the chapters use (``report.verdict``,
``report.claims``, ``report.RULE``, ...). Every verdict follows one decision rule, :data:`~posenc_lab.lab.verdicts.claims.RULE`:
seeds are the samples, perplexities are compared on the log scale, a difference counts only when
it is resolved and at least a 1 % ratio of perplexities, in either direction, and the two
evaluation modes of a claim are one family. The spread over the documents of the evaluation text
is reported apart: :func:`document_bootstrap` for levels, :func:`~posenc_lab.lab.verdicts.claims.claim_bootstrap` for the
differences the claims rest on.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.verdicts.tables")

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from posenc_lab.errors import PosencError
from posenc_lab.lab.run.schema import migrate, migrate_unit, read_config
from posenc_lab.lab.verdicts.claims import claims, comparison_table, decided
from posenc_lab.lab.verdicts.statistics import ALPHA, adjusted, compare_design, direction, frame, seed_values


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
    """Rows, unit records and config of a run folder (or of a committed results folder), the rows (and each unit's
    rows) and the config in the current schema (:func:`~posenc_lab.lab.run.schema.migrate`,
    :func:`~posenc_lab.lab.run.schema.migrate_config`)."""
    out = Path(out)
    if not (out / "results.json").exists():
        raise PosencError(f"{out} has no results.json: is it the --out folder of a finished or partial run?")
    rows = migrate(json.loads((out / "results.json").read_text()))
    units = [migrate_unit(json.loads(p.read_text())) for p in sorted((out / "units").glob("*.json"))]
    config = read_config(out / "config.json") if (out / "config.json").exists() else {}
    return rows, units, config


def report(out: Path | str) -> str:
    """The text report of a run: a table for every evaluation mode (figures: :func:`~posenc_lab.lab.figures.files.save_report_figures`)."""
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
    if df["seed"].nunique() > 1 and (df["label"] == "alibi").any():
        text += ["", claims_table(df, documents)]
    return "\n".join(text)


def claims_table(rows, documents=None, *, judged_len: int = 2048) -> str:
    """The claims' comparisons as Markdown: per claim part and mode, each comparison's ratio [95 % interval], p,
    Holm's p over the part's comparisons in both modes, and (with ``documents``) the paired bootstrap interval
    over documents of the same ratio, marked ``differs`` where it resolves otherwise than the t-test; then the
    verdicts per mode and decided once from both modes (:func:`verdict_table`)."""
    df = frame(rows)
    modes = tuple(m for m in ("sliding", "nonoverlapping") if m in set(df["eval_mode"]))
    judged = judged_len if judged_len in set(df["eval_len"]) else int(df["eval_len"].max())
    table = comparison_table(df, modes=modes, judged_len=judged, documents=documents)
    lines = [f"Claims judged at {judged} (log scale; ratio of perplexities or growths, 95 % interval, p):", "",
             "| claim | mode | A | B | ratio [95 %] | p | p holm | documents' bootstrap 95 % |", "|---|---|---|---|---|---|---|---|"]
    for r in table.to_dict("records"):
        boot = (f"{r['boot low']:.3f} .. {r['boot high']:.3f}" + ("" if r["agree"] else " (differs)")
                if "boot low" in r and not math.isnan(r["boot low"]) else "")
        lines.append(f"| {r['claim']} | {r['mode']} | {r['a']} {r['want']} | {r['b']} | {r['ratio']:.3f} "
                     f"[{r['low']:.3f}, {r['high']:.3f}] | {r['p']:.3g} | {r['p holm']:.3g} | {boot} |")
    verdicts = verdict_table(df, modes=modes, judged_lens=(judged,))
    verdicts.columns = [f"{m} ({n})" for m, n in verdicts.columns]
    lines += ["", "| claim | " + " | ".join(verdicts.columns) + " |", "|---" * (len(verdicts.columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(row) + " |" for name, row in verdicts.iterrows()]
    return "\n".join(lines)


def load_documents(out: Path | str) -> pd.DataFrame | None:
    """The per-document losses of a run (``documents.csv``), or None for a run that did not keep them."""
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


# --------------------------------------------------------------------------------------------- the verdicts


def verdict_table(rows, *, modes=("nonoverlapping", "sliding"), judged_lens=(2048,), alpha: float = ALPHA,
                  both: bool = True) -> pd.DataFrame:
    """Every claim's verdicts in one table: a row per claim and part, a column per (mode, judged length), and, when
    ``both`` and every mode was measured there, a column ``("decided", length)``: the claim as the declared analysis
    decides it (:func:`~posenc_lab.lab.verdicts.claims.decided`: the primary mode's verdict, or ``mode-dependent``)."""
    df = frame(rows)
    measured = {mode: set(df.loc[df.eval_mode == mode, "eval_len"]) for mode in modes}
    records = [{"claim": f"{c['id']}: {part}", "mode": mode, "judged at": length, "verdict": v}
               for mode in modes for length in judged_lens if length in measured[mode]
               for c in claims(df, mode, judged_len=length, alpha=alpha) for part, v in c["verdicts"].items()]
    if both and len(modes) > 1:
        records += [{"claim": name, "mode": "decided", "judged at": length, "verdict": v}
                    for length in judged_lens if all(length in measured[m] for m in modes)
                    for name, v in decided(df, modes=modes, judged_len=length, alpha=alpha).items()]
    table = pd.DataFrame(records).pivot(index="claim", columns=["mode", "judged at"], values="verdict")
    return table.loc[list(dict.fromkeys(r["claim"] for r in records))]


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
    and ``spread = max / min - 1`` of those means (the converged literature's models are about 2 % apart)."""
    df = frame(rows)
    train = int(df["train_len"].iloc[0])
    means = {name: float(seed_values(df, mode, name, train).mean()) for name in labels}
    missing = [name for name, v in means.items() if math.isnan(v)]
    if missing:
        raise PosencError(f"no {mode} rows at the training length ({train}) for {', '.join(missing)}")
    return {"means": means, "spread": max(means.values()) / min(means.values()) - 1, "train_len": train}


def versus(rows, pairs, *, mode, lengths=None, metric: str = "perplexity", alpha: float = ALPHA) -> pd.DataFrame:
    """Label A against label B at each length, under :data:`~posenc_lab.lab.verdicts.claims.RULE`'s test on the log scale (:func:`~posenc_lab.lab.verdicts.statistics.compare_design`:
    paired over the seeds both have when they have the same seeds). ``pairs`` is a list of ``(a, b)`` labels;
    ``mode`` one evaluation mode or several (a ``mode`` column tells them apart); ``lengths`` defaults to every
    length both were evaluated at. One row per pair and length: ``a``, ``b``, ``eval_len``, the seed means
    ``mean a`` and ``mean b``, ``ratio`` (``exp`` of the mean log difference) with ``low``/``high`` (its 95 %
    interval), ``relative`` (``ratio - 1``), ``p``, ``test`` (paired, welch) and ``sign``: ``<`` or ``>`` where the
    difference is resolved at ``alpha`` and at least 1 %, ``~`` otherwise. The table is an exploratory family:
    ``p holm``, ``p BH`` and ``survives`` (:func:`~posenc_lab.lab.verdicts.statistics.adjusted`) are computed over all its rows."""
    df = frame(rows)
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    records = []
    for m in modes:
        for a, b in pairs:
            missing = [name for name in (a, b) if not (df.label == name).any()]
            if missing:
                raise PosencError(f"no rows for {', '.join(missing)}")
            shared = set(df.loc[(df.eval_mode == m) & (df.label == a), "eval_len"]) & set(
                df.loc[(df.eval_mode == m) & (df.label == b), "eval_len"])
            for n in sorted(shared if lengths is None else shared & set(lengths)):
                va, vb = seed_values(df, m, a, n, metric), seed_values(df, m, b, n, metric)
                c = compare_design(va, vb, alpha=alpha, scale="log" if metric == "loss" else "ratio")
                records.append({"mode": m, "a": a, "b": b, "eval_len": n, "mean a": float(va.mean()),
                                "mean b": float(vb.mean()), "ratio": c.ratio, "low": c.interval[0],
                                "high": c.interval[1], "relative": c.relative, "p": c.p, "test": c.kind,
                                "sign": c.sign if c.matters else "~"})
    columns = ["mode", "a", "b", "eval_len", "mean a", "mean b", "ratio", "low", "high", "relative", "p", "test", "sign"]
    table = adjusted(pd.DataFrame(records, columns=columns), alpha=alpha)
    return table if len(modes) > 1 else table.drop(columns="mode")


#: the rows of the README's headline tables, in the order of the registry
HEADLINE_LABELS = ("nope", "sinusoidal", "learned", "rope/none", "rope/pi", "rope/ntk", "rope/dynamic-ntk", "rope/yarn",
                   "xpos", "alibi", "t5", "kerple", "fire")


def headline(rows, *, judged_len: int = 2048) -> str:
    """The README's headline: both modes' tables (mean ± std over seeds) and the claims' verdicts at
    ``judged_len`` in each mode and as the declared analysis decides them, as Markdown. The README holds
    exactly this text (a test checks it)."""
    labels = [name for name in HEADLINE_LABELS if name in set(frame(rows)["label"])]
    verdicts = verdict_table(rows, judged_lens=(judged_len,))
    lines = [f"| claim (judged at {judged_len}) | sliding (primary) | non-overlapping (sensitivity) | decided |",
             "|---|---|---|---|"]
    for claim, row in verdicts.iterrows():
        lines.append(f"| {claim} | {row[('sliding', judged_len)]} | {row[('nonoverlapping', judged_len)]} | "
                     f"{row[('decided', judged_len)]} |")
    return "\n\n".join([markdown_table(rows, "sliding", labels=labels),
                        markdown_table(rows, "nonoverlapping", labels=labels), "\n".join(lines)])


def geometric_means(grown: pd.DataFrame) -> pd.DataFrame:
    """The seeds' geometric means of a results frame that carries each row's growth (``plots.growth_frame``):
    indexed by ``eval_mode``, ``label`` and ``eval_len``, with ``ppl`` (perplexity) and ``own`` (growth, each
    model's perplexity over its own at the training length). The methods chapters read quality at the training
    length in ``ppl`` and growth past it in ``own``."""
    logs = grown.assign(ppl=np.log(grown["perplexity"]), own=np.log(grown["growth"]))
    return np.exp(logs.groupby(["eval_mode", "label", "eval_len"])[["ppl", "own"]].mean())


#: how a cell of :func:`versus_grid` marks a difference that counts
MARKS = {"lower": " <", "higher": " >", "not resolved": ""}


def versus_grid(table: pd.DataFrame, means: pd.DataFrame, mode: str, methods, names: dict,
                train_len: int) -> pd.DataFrame:
    """One mode of a methods-against-baselines family (``in_words.against_baselines``) as a grid: a row per method
    in ``methods``' order, a column per baseline and length holding the ratio, marked ``<`` or ``>`` where the
    difference counts (:data:`MARKS`), then each method's own growth past ``train_len`` from
    :func:`geometric_means` (``means``) in that mode, untested. ``names`` gives the printed names of methods and
    baselines (a baseline's "RoPE with " left out)."""
    part = table[table["mode"] == mode]
    part = part.assign(cell=[f"{r.ratio:.2f}{MARKS[r.outcome]}" for r in part.itertuples()], a=part["a"].map(names))
    grid = part.pivot_table(index="a", columns=["b", "eval_len"], values="cell", aggfunc="first")
    grid = grid.reindex([names[n] for n in methods])
    grid.columns = [f"{names[b].removeprefix('RoPE with ')} {n}" for b, n in grid.columns]
    own = means.loc[mode, "own"].unstack().drop(columns=train_len).rename(names)
    for n in own.columns:
        grid[f"own {n}"] = own.loc[grid.index, n].map("{:.2f}".format)
    return grid
