"""The figures that the notebooks and ``report`` share. Each function draws on a given ``Axes``."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from .encodings import ENCODINGS
from .report import label, summarize
from .rope import ROPE_SCALINGS

# one fixed colour per curve, the same in every figure: encodings first, then RoPE's strategies
_ORDER = [n for n in ENCODINGS if n != "rope"] + [f"rope/{s}" for s in ROPE_SCALINGS] + [f"rope/{s}+ft" for s in ROPE_SCALINGS]


def color(name: str):
    import matplotlib

    key = name if name in _ORDER else name.split("/")[0]
    index = _ORDER.index(key) if key in _ORDER else len(_ORDER)
    return matplotlib.colormaps["tab20"].colors[index % 20]


def _length_axis(ax):
    from matplotlib.ticker import ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.grid(True, alpha=0.3)


def ppl_vs_length(rows: list[dict], mode: str, ax, *, labels: list[str] | None = None, metric: str = "perplexity"):
    """Perplexity against evaluation length (log-2 length axis), one line per encoding/strategy, error bars over seeds."""
    summary = summarize(rows, metric)[mode]
    train_len = int(rows[0]["train_len"])
    for name in labels or sorted(summary):
        cells = summary[name]
        lengths = [n for n in sorted(cells) if not math.isnan(cells[n][0])]
        if not lengths:
            continue
        means = [cells[n][0] for n in lengths]
        stds = [cells[n][1] for n in lengths]
        style = "--" if "/" in name and not name.endswith("/none") else "-"
        ax.errorbar(lengths, means, yerr=stds, marker="o", ms=3, capsize=2, ls=style, label=name, color=color(name))
    ax.axvline(train_len, color="grey", lw=0.8, ls=":")
    _length_axis(ax)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel(f"{metric} ({mode})")
    ax.set_title(f"{mode} windows; trained at {train_len}")
    return ax


def per_position(units: list[dict], length: int, ax, *, strategies=("-", "none"), bins: int = 40, labels=None):
    """Mean loss at each position of a window of ``length`` (non-overlapping), over windows and seeds.

    Positions are averaged in log-spaced bins: the first positions (little context) keep their own
    bins, the far end of the window is averaged over many positions, where few windows would
    otherwise leave only noise.
    """
    curves = defaultdict(list)
    train_len = None
    for unit in units:
        train_len = train_len or int(unit["rows"][0]["train_len"])
        for strategy, by_len in unit["per_position"].items():
            name = label({"encoding": unit["encoding"], "strategy": strategy})
            wanted = name in labels if labels else strategy in strategies
            if wanted and str(length) in by_len:
                curves[name].append(np.asarray(by_len[str(length)]))
    edges = np.unique(np.geomspace(1, length, bins + 1).astype(int))
    edges[0] = 0
    for name in labels or sorted(curves):
        if name not in curves:
            continue
        mean = np.mean(curves[name], axis=0)
        centres = [(a + b - 1) / 2 + 1 for a, b in zip(edges[:-1], edges[1:])]
        binned = [mean[a:b].mean() for a, b in zip(edges[:-1], edges[1:])]
        ax.plot(centres, binned, label=name, color=color(name))
    if train_len:
        ax.axvline(train_len, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("position in the window (1 = first predicted byte)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(f"loss at each position, non-overlapping windows of {length}")
    return ax


def save_report_figures(rows: list[dict], units: list[dict], folder: Path) -> list[Path]:
    """``ppl_vs_length.png`` (a panel per mode) and ``per_position.png`` (the longest length) in ``folder``."""
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    modes = sorted({r["eval_mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        ppl_vs_length(rows, mode, ax)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    written = [folder / "ppl_vs_length.png"]
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    longest = max(int(r["eval_len"]) for r in rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    per_position(units, longest, ax)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    written.append(folder / "per_position.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written
