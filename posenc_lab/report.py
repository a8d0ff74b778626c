"""The results table summarised over seeds, as text and as figures (``python -m posenc_lab report``)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from .errors import PosencError


def label(row: dict) -> str:
    """``rope/yarn`` for a RoPE strategy, the encoding's name otherwise."""
    return row["encoding"] if row["strategy"] in ("-", "", None) else f"{row['encoding']}/{row['strategy']}"


def summarize(rows: list[dict], metric: str = "perplexity") -> dict:
    """``{mode: {label: {eval_len: (mean, std, n)}}}`` over seeds; NaN (cannot extrapolate) kept as NaN."""
    groups: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        groups[r["eval_mode"]][label(r)][int(r["eval_len"])].append(float(r[metric]))
    summary = {}
    for mode, by_label in groups.items():
        summary[mode] = {}
        for name, by_len in by_label.items():
            summary[mode][name] = {}
            for length, values in sorted(by_len.items()):
                mean = statistics.fmean(values)
                std = statistics.stdev(values) if len(values) > 1 and not math.isnan(mean) else 0.0
                summary[mode][name][length] = (mean, std, len(values))
    return summary


def _fmt(cell) -> str:
    mean, std, n = cell
    if math.isnan(mean):
        return "cannot extrapolate"
    return f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"


def markdown_table(rows: list[dict], mode: str, metric: str = "perplexity") -> str:
    """One Markdown table: a row per encoding (and RoPE strategy), a column per evaluation length."""
    summary = summarize(rows, metric)
    if mode not in summary:
        raise PosencError(f"no rows for evaluation mode {mode!r}")
    lengths = sorted({length for cells in summary[mode].values() for length in cells})
    seeds = max(cell[2] for cells in summary[mode].values() for cell in cells.values())
    head = f"| {metric} ({mode}{', mean ± std over seeds' if seeds > 1 else ''}) | " + " | ".join(map(str, lengths)) + " |"
    lines = [head, "|---" * (len(lengths) + 1) + "|"]
    for name in sorted(summary[mode]):
        cells = summary[mode][name]
        lines.append(f"| {name} | " + " | ".join(_fmt(cells[length]) if length in cells else "" for length in lengths) + " |")
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


def report(out: Path | str, *, figures: bool = True) -> str:
    """The text report of a run (tables for every mode); with ``figures``, also writes PNGs under ``out/figures``."""
    rows, units, config = load(out)
    if not rows:
        raise PosencError(f"{out} has no finished unit yet")
    modes = sorted({r["eval_mode"] for r in rows})
    first = rows[0]
    text = [f"# {Path(out).name}: preset {first['preset']}, corpus {first['corpus']} "
            f"(sha256 {first['corpus_sha256'][:12]}, Python {first['python']}), trained at {first['train_len']}, "
            f"device {first['device']}, torch {first['torch']}, commit {first['git_commit'][:12]}", ""]
    for mode in modes:
        text += [markdown_table(rows, mode), ""]
    text.append("bits per byte = loss / ln 2; perplexity = exp(loss), per byte.")
    if figures:
        from . import plots

        written = plots.save_report_figures(rows, units, Path(out) / "figures")
        text += ["", "figures: " + ", ".join(str(p) for p in written)]
    return "\n".join(text)
