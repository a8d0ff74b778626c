"""The figures that the notebooks and ``report`` share, drawn with seaborn. Each function draws on a given ``Axes``.

One theme (:func:`use_theme`) and one fixed colour per encoding and RoPE strategy (:func:`color`) in
every figure of the book. Bands are one standard deviation over seeds (``errorbar="sd"``); with a
single seed there is no band.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .encodings import ENCODINGS
from .report import frame, label
from .rope import ROPE_SCALINGS

# one fixed colour per curve, the same in every figure: encodings first, then RoPE's strategies (tab20), then
# what was added later (tab20b), so that a new name never changes the colour of an old one
_FIRST = ("nope", "sinusoidal", "sinusoidal-small", "learned", "xpos", "alibi", "t5", "kerple", "fire")
_FIRST_SCALINGS = ("none", "pi", "ntk", "dynamic-ntk", "yarn")
_ORDER = list(_FIRST) + [f"rope/{s}" for s in _FIRST_SCALINGS] + [f"rope/{s}+ft" for s in _FIRST_SCALINGS]
_ORDER += [n for n in ENCODINGS if n != "rope" and n not in _ORDER]
_ORDER += [f"rope/{s}{ft}" for ft in ("", "+ft") for s in ROPE_SCALINGS if f"rope/{s}{ft}" not in _ORDER]


def use_theme() -> None:
    """The book's seaborn theme (white grid, notebook context)."""
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)


def color(name: str):
    """The fixed colour of an encoding or ``rope/<strategy>`` (tab20 for the first twenty names, then tab20b)."""
    import matplotlib

    key = name if name in _ORDER else name.split("/")[0]
    index = _ORDER.index(key) if key in _ORDER else len(_ORDER)
    colours = matplotlib.colormaps["tab20"].colors + matplotlib.colormaps["tab20b"].colors
    return colours[index % len(colours)]


def palette(names) -> dict:
    """The fixed colour (:func:`color`) of each of ``names``, as a ``palette`` for seaborn."""
    return {name: color(name) for name in names}


def _length_axis(ax, *, base: int = 2):
    from matplotlib.ticker import ScalarFormatter

    ax.set_xscale("log", base=base)
    ax.xaxis.set_major_formatter(ScalarFormatter())


def ppl_vs_length(rows, mode: str, ax, *, labels: list[str] | None = None, metric: str = "perplexity"):
    """Perplexity against evaluation length (log-2 axis), a line per encoding/strategy, a band of one sd over seeds."""
    import seaborn as sns

    df = frame(rows)
    df = df[(df.eval_mode == mode) & df[metric].notna()]
    names = [n for n in (labels or sorted(df["label"].unique())) if n in set(df["label"])]
    df = df[df["label"].isin(names)]
    train_len = int(df["train_len"].iloc[0])
    dashes = {n: (4, 2) if "/" in n and not n.endswith("/none") else "" for n in names}
    sns.lineplot(data=df, x="eval_len", y=metric, hue="label", hue_order=names, palette=palette(names), style="label",
                 style_order=names, dashes=dashes, markers=["o"] * len(names), markersize=4, errorbar="sd", ax=ax)
    ax.axvline(train_len, color="grey", lw=0.8, ls=":")
    _length_axis(ax)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel(f"{metric} ({mode})")
    ax.set_title(f"{mode} windows; trained at {train_len}")
    ax.legend(title=None)
    return ax


def log_bins(length: int, bins: int) -> np.ndarray:
    """Edges of log-spaced position bins over ``0 .. length``: the first positions keep their own bins."""
    edges = np.unique(np.geomspace(1, length, bins + 1).astype(int))
    edges[0] = 0
    return edges


def per_position_frame(units: list[dict], length: int, *, labels=None, strategies=("-", "none"), bins: int = 40) -> pd.DataFrame:
    """Mean loss per log-spaced position bin, one row per (label, seed, bin), for windows of ``length``."""
    edges = log_bins(length, bins)
    centres = [(a + b - 1) / 2 + 1 for a, b in zip(edges[:-1], edges[1:])]
    out = []
    for unit in units:
        for strategy, by_len in unit["per_position"].items():
            name = label({"encoding": unit["encoding"], "strategy": strategy})
            wanted = name in labels if labels else strategy in strategies
            if not wanted or str(length) not in by_len:
                continue
            curve = np.asarray(by_len[str(length)])
            for centre, a, b in zip(centres, edges[:-1], edges[1:]):
                out.append({"label": name, "seed": unit["seed"], "position": centre, "loss": curve[a:b].mean()})
    return pd.DataFrame(out, columns=["label", "seed", "position", "loss"])


def per_position(units: list[dict], length: int, ax, *, strategies=("-", "none"), bins: int = 40, labels=None):
    """Mean loss at each position of a window of ``length`` (non-overlapping), band of one sd over seeds.

    Smoothing: positions are averaged in ``bins`` log-spaced bins (the first positions keep their
    own bins; the far end of a long window is averaged over hundreds of positions), over all the
    windows of the evaluation, then over seeds.
    """
    import seaborn as sns

    df = per_position_frame(units, length, labels=labels, strategies=strategies, bins=bins)
    names = [n for n in (labels or sorted(df["label"].unique())) if n in set(df["label"])]
    sns.lineplot(data=df, x="position", y="loss", hue="label", hue_order=names, palette=palette(names),
                 errorbar="sd", ax=ax)
    train_len = int(units[0]["rows"][0]["train_len"]) if units else None
    if train_len:
        ax.axvline(train_len, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the window (1 = first predicted byte)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(f"loss at each position, non-overlapping windows of {length}")
    ax.legend(title=None)
    return ax


def training_frame(units: list[dict], *, every: int = 10) -> pd.DataFrame:
    """Training loss every ``every`` steps (the mean of those steps), one row per (encoding, seed, step)."""
    out = []
    for unit in units:
        losses = np.asarray(unit["train_losses"])
        for start in range(0, len(losses), every):
            out.append({"label": unit["encoding"], "seed": unit["seed"], "step": start + every,
                        "loss": float(losses[start:start + every].mean())})
    return pd.DataFrame(out, columns=["label", "seed", "step", "loss"])


def training_curves(units: list[dict], ax, *, labels=None, every: int = 10):
    """Training loss against step for every encoding, band of one sd over seeds."""
    import seaborn as sns

    df = training_frame(units, every=every)
    names = [n for n in (labels or sorted(df["label"].unique())) if n in set(df["label"])]
    sns.lineplot(data=df, x="step", y="loss", hue="label", hue_order=names, palette=palette(names), errorbar="sd",
                 ax=ax, lw=1)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training loss (nats, mean of {every} steps)")
    ax.legend(title=None, ncols=2)
    return ax


def save_report_figures(rows, units: list[dict], folder: Path) -> list[Path]:
    """``ppl_vs_length.png`` (a panel per mode), ``per_position.png`` (the longest length) and
    ``training_loss.png`` in ``folder``."""
    import matplotlib.pyplot as plt

    use_theme()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    df = frame(rows)
    modes = sorted(df["eval_mode"].unique())
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        ppl_vs_length(df, mode, ax)
    for ax in axes[0][:-1]:
        ax.get_legend().remove()
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    written = [folder / "ppl_vs_length.png"]
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    longest = int(df["eval_len"].max())
    fig, ax = plt.subplots(figsize=(8, 4.5))
    per_position(units, longest, ax)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    written.append(folder / "per_position.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    training_curves(units, ax)
    fig.tight_layout()
    written.append(folder / "training_loss.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def budget_curves(checkpoints, axes, *, labels=None, factor: int | None = None):
    """Two panels against training tokens seen: perplexity at the training length, and growth
    ``ppl(factor x L) / ppl(L)`` (non-overlapping windows); band of one sd over seeds."""
    import seaborn as sns

    from .report import budget_frame, budget_growth

    df = budget_frame(checkpoints)
    train = int(df["train_len"].iloc[0])
    long = factor * train if factor else int(df["eval_len"].max())
    default = [n for n in _ORDER if n in set(df["label"]) and (not n.startswith("rope/") or n == "rope/none")]
    names = [n for n in (labels or default) if n in set(df["label"])]
    short = df[(df.eval_len == train) & df.label.isin(names)].assign(tokens=lambda d: d.tokens_seen / 1e6)
    sns.lineplot(data=short, x="tokens", y="perplexity", hue="label", hue_order=names, palette=palette(names),
                 errorbar="sd", marker="o", ax=axes[0], lw=1)
    axes[0].set_ylabel(f"perplexity at {train} (training length)")
    growth = budget_growth(df, long)
    growth = growth[growth.label.isin(names)].assign(tokens=lambda d: d.tokens_seen / 1e6)
    sns.lineplot(data=growth, x="tokens", y="growth", hue="label", hue_order=names, palette=palette(names),
                 errorbar="sd", marker="o", ax=axes[1], lw=1)
    axes[1].set_ylabel(f"growth ppl({long}) / ppl({train})")
    for ax in axes:
        ax.set_xlabel("training tokens seen (millions)")
    axes[0].get_legend().remove()
    axes[1].legend(title=None, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return axes
