"""The figures that the notebooks and ``report`` share, drawn with seaborn. Each function draws on a given ``Axes``.

One theme (:func:`use_theme`). Every line of these figures has a fixed style per encoding and RoPE
strategy (:func:`style`): a distinct colour, solid lines for encodings and dashed lines for RoPE's
strategies, and a marker, so that no two curves of one figure look alike. :func:`color` keeps the
older tab20 colour of each name for the figures that ask for it. The headline figures
(:func:`perplexity_vs_length`, :func:`growth`) draw the seeds' mean with a band from the lowest to
the highest seed; the other figures draw a band of one standard deviation over seeds
(``errorbar="sd"``). With a single seed there is no band.
The PNGs of a run's folder and of the README are written by :mod:`posenc_lab.lab.figures.files`.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("figures", "posenc_lab.lab.figures.plots")


import numpy as np
import pandas as pd

from posenc_lab.encodings import ENCODINGS
from posenc_lab.rope import ROPE_SCALINGS
from posenc_lab.lab.verdicts.statistics import frame, label
from posenc_lab.lab.labels import Label

# one fixed colour per curve, the same in every figure: encodings first, then RoPE's strategies (tab20), then
# what was added later (tab20b, tab20c), so that a new name never changes the colour of an old one
_FIRST = ("nope", "sinusoidal", "sinusoidal-small", "learned", "xpos", "alibi", "t5", "kerple", "fire")
_FIRST_SCALINGS = ("none", "pi", "ntk", "dynamic-ntk", "yarn")
# the names that came next, in the order that gave them their colours; anything newer follows them
_SECOND = ("rope-partial", "p-rope", "rope-b500", "rope-b500k", "rope-nope", "rope-random", "learned-random",
           "rope/llama3", "rope/llama3+ft")
_ORDER = list(_FIRST) + [f"rope/{s}" for s in _FIRST_SCALINGS] + [f"rope/{s}+ft" for s in _FIRST_SCALINGS]
_ORDER += list(_SECOND)
_ORDER += [n for n in ENCODINGS if not ENCODINGS[n].has_strategies and n not in _ORDER]  # RoPE: its strategies below
_ORDER += [f"rope/{s}{ft}" for ft in ("", "+ft") for s in ROPE_SCALINGS if f"rope/{s}{ft}" not in _ORDER]


def use_theme() -> None:
    """The book's seaborn theme (white grid, notebook context)."""
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)


def color(name: str):
    """The fixed colour of an encoding or ``rope/<strategy>`` (tab20 for the first twenty names, then tab20b and
    tab20c)."""
    import matplotlib

    key = name if name in _ORDER else Label.parse(name).encoding
    index = _ORDER.index(key) if key in _ORDER else len(_ORDER)
    colours = sum((matplotlib.colormaps[m].colors for m in ("tab20", "tab20b", "tab20c")), ())
    return colours[index % len(colours)]


def palette(names) -> dict:
    """The fixed colour (:func:`color`) of each of ``names``, as a ``palette`` for seaborn."""
    return {name: color(name) for name in names}


# distinct colours (no pale pair of one hue in the same figure): the article's five encodings and RoPE's strategies
# first, so that the headline figures never share a colour; names past these cycle through the rest
_DISTINCT = {
    "rope/none": "#1f77b4", "alibi": "#2ca02c", "t5": "#d62728", "sinusoidal": "#ff7f0e", "nope": "#555555",
    "rope/pi": "#9467bd", "rope/ntk": "#000000", "rope/dynamic-ntk": "#17becf", "rope/yarn": "#e377c2",
    "rope/llama3": "#7f7f00", "xpos": "#8c564b", "kerple": "#bcbd22", "fire": "#393b79", "learned": "#aa3377",
    "sinusoidal-small": "#ffbb78",
    # the methods of 2024-26, drawn beside ALiBi, RoPE and YaRN (chapter 13)
    "fox": "#d95f02", "cope": "#7570b3", "ssmax": "#a6761d", "ssmax-rope": "#1b9e77", "fope": "#e6ab02",
    "nope-temp": "#666666", "irope": "#8e0152", "gemma3": "#01665e", "rnope-swa": "#5e3c99",
    # past the fixed bias and the softmax (chapter 14), each family in one hue
    "stick-breaking": "#b2182b", "path": "#f46d43", "path-fox": "#fdae61", "dape-kerple": "#762a83",
    "dape-alibi": "#9970ab", "dape-fire": "#40004b",
}
_SPARE = ("#66a61e", "#e6ab02", "#a6761d", "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#666666")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h", "*", "<", ">", "p")
_MARKER = {"nope": "v", "sinusoidal": "D", "learned": "P", "rope/none": "o", "xpos": "X", "alibi": "s", "t5": "^",
           "kerple": "h", "fire": "*", "rope/pi": "<", "rope/ntk": ">", "rope/dynamic-ntk": "p", "rope/yarn": "d"}
#: the order of names in legends: encodings (RoPE among them), then RoPE's strategies
_LEGEND = ["nope", "sinusoidal", "learned", "rope/none", "xpos", "alibi", "t5", "kerple", "fire"]


def style(name: str) -> dict:
    """The fixed look of an encoding or ``rope/<strategy>`` in every line figure: ``color``, ``dashes`` (solid for an
    encoding, dashed for a RoPE strategy other than ``none``, dotted for a fine-tuned one) and ``marker``."""
    if name in _DISTINCT:
        colour = _DISTINCT[name]
    else:
        index = _ORDER.index(name) if name in _ORDER else len(_ORDER)
        colour = _SPARE[index % len(_SPARE)]
    index = _ORDER.index(name) if name in _ORDER else len(_ORDER)
    dashes = (1.5, 1.5) if Label.parse(name).finetuned else "" if Label.parse(name).as_trained else (5, 2)
    return {"color": colour, "dashes": dashes, "marker": _MARKER.get(name, _MARKERS[index % len(_MARKERS)])}


def _ordered(names) -> list[str]:
    """Encodings first, then RoPE's strategies, each in the registry's order."""
    names = list(dict.fromkeys(names))
    rank = {n: i for i, n in enumerate(_LEGEND + [n for n in _ORDER if n not in _LEGEND])}
    return sorted(names, key=lambda n: (not Label.parse(n).as_trained, rank.get(n, len(rank)), n))


def _styled_lines(data, x, y, names, ax, *, errorbar, markersize=5, lw=1.6):
    import seaborn as sns

    looks = {n: style(n) for n in names}
    sns.lineplot(data=data, x=x, y=y, hue="label", hue_order=names, style="label", style_order=names,
                 palette={n: v["color"] for n, v in looks.items()}, dashes={n: v["dashes"] for n, v in looks.items()},
                 markers={n: v["marker"] for n, v in looks.items()}, markersize=markersize, lw=lw,
                 errorbar=errorbar, err_kws={"alpha": 0.15}, ax=ax)


_MODE = {"nonoverlapping": "non-overlapping"}
#: the seeds' range, lowest to highest seed (seaborn's percentile interval of width 100)
SEED_RANGE = ("pi", 100)


def growth_frame(rows, *, reference: int | None = None) -> pd.DataFrame:
    """The results with ``growth = ppl(eval_len) / ppl(reference)`` per seed, mode and label (``reference``: the
    training length). Rows that cannot extrapolate have NaN growth."""
    df = frame(rows)
    reference = reference or int(df["train_len"].iloc[0])
    base = df[df.eval_len == reference].set_index(["eval_mode", "label", "seed"])["perplexity"]
    keys = pd.MultiIndex.from_frame(df[["eval_mode", "label", "seed"]])
    return df.assign(growth=df["perplexity"].to_numpy() / base.reindex(keys).to_numpy())


def _headline_names(df, labels):
    present = set(df.loc[df["perplexity"].notna(), "label"])
    if labels is None:
        labels = [n for n in present if not Label.parse(n).finetuned]
    return _ordered([n for n in labels if n in present])


def perplexity_vs_length(rows, ax=None, *, mode: str = "sliding", labels=None, metric: str = "perplexity",
                         judged_len: int | None = 2048, legend: bool = True):
    """Perplexity against evaluation length, both axes logarithmic: a line per encoding and RoPE strategy (the
    seeds' mean), a band from the lowest to the highest seed. ``metric="growth"`` draws ppl(L') / ppl(L) instead
    (:func:`growth`). A dotted line marks the training length, a dashed one ``judged_len`` (where the claims are
    judged). Returns the ``Axes``."""
    import matplotlib.pyplot as plt

    ax = ax or plt.gca()
    df = growth_frame(rows) if metric == "growth" else frame(rows)
    df = df[(df.eval_mode == mode) & df[metric].notna()]
    if df.empty:
        raise ValueError(f"no {metric} rows in {mode!r} windows")
    names = _headline_names(df, labels)
    df = df[df["label"].isin(names)]
    train_len = int(df["train_len"].iloc[0])
    _styled_lines(df, "eval_len", metric, names, ax, errorbar=SEED_RANGE)
    ax.axvline(train_len, color="grey", lw=0.8, ls=":")
    if judged_len and judged_len in set(df["eval_len"]) and judged_len != train_len:
        ax.axvline(judged_len, color="black", lw=0.7, ls="--")
    _length_axis(ax)
    ax.set_xticks(sorted(df["eval_len"].unique()))
    _log_values(ax)
    ax.set_xlabel("evaluation length (bytes, log scale)")
    seeds = df["seed"].nunique()
    band = f"; band: {seeds} seeds' range" if seeds > 1 else ""
    if metric == "growth":
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel(f"growth ppl(L') / ppl({train_len}), log scale")
        ax.set_title(f"{_MODE.get(mode, mode)} windows{band}", fontsize=10)
    else:
        ax.set_ylabel(f"{metric} per byte, log scale")
        ax.set_title(f"{_MODE.get(mode, mode)} windows, trained at {train_len}{band}", fontsize=10)
    if legend:
        ax.legend(title=None, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        ax.get_legend().remove()
    return ax


def accuracy_vs_length(rows, ax=None, *, labels=None, legend: bool = True):
    """Exact match of a retrieval run against the window length over the training length (log scale): a line per
    label (the mean of the seeds' accuracies, each pooled over depths, :func:`~posenc_lab.lab.measure.accuracy.by_seed`), a band
    from the lowest to the highest seed, in each label's fixed look (:func:`style`). ``labels`` picks and orders the
    lines (default: every label). Returns the ``Axes``."""
    import matplotlib.pyplot as plt

    from posenc_lab.lab.measure.accuracy import by_seed, frame as retrieval_frame

    ax = ax or plt.gca()
    train_len = {int(n) for n in retrieval_frame(rows)["train_len"]}
    if len(train_len) != 1:
        raise ValueError(f"the rows must share one training length, got {sorted(train_len)}")
    df = by_seed(rows).rename("exact match").reset_index()
    df["multiple"] = df["eval_len"] / train_len.pop()
    names = list(dict.fromkeys(labels)) if labels is not None else _ordered(df["label"].unique())
    missing = sorted(set(names) - set(df["label"]))
    if missing:
        raise ValueError(f"no retrieval rows for {', '.join(missing)}")
    _styled_lines(df[df["label"].isin(names)], "multiple", "exact match", names, ax, errorbar=SEED_RANGE)
    ax.set_xscale("log", base=2)
    multiples = sorted(df["multiple"].unique())
    ax.set_xticks(multiples, [f"{m:g}x" for m in multiples])
    ax.minorticks_off()
    ax.set(xlabel="window length / training length", ylabel="exact match", ylim=(-0.03, 1.03))
    seeds = df["seed"].nunique()
    ax.set_title(f"mean of {seeds} seeds; band: their range" if seeds > 1 else "one seed", fontsize=10)
    if legend:
        ax.legend(title=None, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        ax.get_legend().remove()
    return ax


def growth(rows, ax=None, *, mode: str = "sliding", labels=None, judged_len: int | None = 2048, legend: bool = True,
           breaking: float | None = None):
    """Growth ppl(L') / ppl(L) against evaluation length L', both axes logarithmic (1 = as good as at the training
    length L), seeds' mean and range; ``breaking`` draws a horizontal line at that growth (e.g. ``report.BREAK``)."""
    ax = perplexity_vs_length(rows, ax, mode=mode, labels=labels, metric="growth", judged_len=judged_len,
                              legend=legend)
    if breaking:
        ax.axhline(breaking, color="grey", lw=0.8, ls="--")
        ax.annotate(f"growth {breaking:.2f}", (ax.get_xlim()[0], breaking), xytext=(4, 3), textcoords="offset points",
                    fontsize=7, color="dimgrey")
    return ax


def headline_figure(rows, *, metric: str = "perplexity", modes=("sliding", "nonoverlapping"), labels=None,
                    breaking: float | None = None, width: float = 12.0):
    """A panel per evaluation mode of :func:`perplexity_vs_length` (or of :func:`growth` for ``metric="growth"``),
    sharing the y axis and one legend. Returns the ``Figure``."""
    import matplotlib.pyplot as plt

    modes = [m for m in modes if m in set(frame(rows)["eval_mode"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(width, 4.6), sharey=True, squeeze=False)
    for i, (ax, mode) in enumerate(zip(axes[0], modes)):
        last = i == len(modes) - 1
        if metric == "growth":
            growth(rows, ax, mode=mode, labels=labels, legend=last, breaking=breaking)
        else:
            perplexity_vs_length(rows, ax, mode=mode, labels=labels, legend=last)
    fig.tight_layout()
    return fig


def runs_figure(runs: dict, *, mode: str = "nonoverlapping", labels=None, metric: str = "perplexity",
                width: float = 12.0):
    """A panel per run (``{title: rows}``, e.g. two domains trained with one recipe) of :func:`perplexity_vs_length`
    in one evaluation mode, both axes logarithmic, the y axis shared and one legend. Returns the ``Figure``."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(width, 4.6), sharey=True, squeeze=False)
    for i, (ax, (title, rows)) in enumerate(zip(axes[0], runs.items())):
        perplexity_vs_length(rows, ax, mode=mode, labels=labels, metric=metric, legend=i == len(runs) - 1)
        seeds = frame(rows)["seed"].nunique()
        band = f"; band: {seeds} seeds' range" if seeds > 1 else ""
        ax.set_title(f"{title}\n{_MODE.get(mode, mode)} windows{band}", fontsize=10)
    fig.tight_layout()
    return fig


def _log_values(ax):
    """A log y axis labelled with round values (1, 1.5, 2, 3, 5, 7, 10, ...) instead of powers of ten."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    ax.set_yscale("log")
    low, high = ax.get_ylim()
    steps = (1, 1.5, 2, 3, 5, 7) if high / low < 30 else (1, 2, 3, 5)
    ticks = [m * 10.0 ** e for e in range(-1, 4) for m in steps if low <= m * 10.0 ** e <= high]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


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
    dashes = {n: "" if Label.parse(n).as_trained else (4, 2) for n in names}
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
    names = _ordered([n for n in (labels or df["label"].unique()) if n in set(df["label"])])
    looks = {n: style(n) for n in names}
    sns.lineplot(data=df, x="position", y="loss", hue="label", hue_order=names, palette={n: v["color"] for n, v in looks.items()},
                 style="label", style_order=names, dashes={n: v["dashes"] for n, v in looks.items()},
                 errorbar="sd", err_kws={"alpha": 0.15}, ax=ax, lw=1.3)
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
    """Training loss against step for every encoding (:func:`style`), band of one sd over seeds."""
    import seaborn as sns

    df = training_frame(units, every=every)
    names = _ordered([n for n in (labels or df["label"].unique()) if n in set(df["label"])])
    looks = {n: style(n) for n in names}
    sns.lineplot(data=df, x="step", y="loss", hue="label", hue_order=names, palette={n: v["color"] for n, v in looks.items()},
                 style="label", style_order=names, dashes={n: v["dashes"] for n, v in looks.items()},
                 errorbar="sd", err_kws={"alpha": 0.15}, ax=ax, lw=1.3)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training loss (nats, mean of {every} steps)")
    ax.legend(title=None, ncols=2)
    return ax


def budget_curves(checkpoints, axes, *, labels=None, factor: int | None = None):
    """Two panels against training tokens seen: perplexity at the training length, and growth
    ``ppl(factor x L) / ppl(L)`` (non-overlapping windows) on a log axis (1 = no growth); band of one sd over seeds."""
    from posenc_lab.lab.measure.budget import budget_frame, budget_growth

    df = budget_frame(checkpoints)
    train = int(df["train_len"].iloc[0])
    long = factor * train if factor else int(df["eval_len"].max())
    default = [n for n in _ORDER if n in set(df["label"]) and Label.parse(n).as_trained]
    names = _ordered([n for n in (labels or default) if n in set(df["label"])])
    short = df[(df.eval_len == train) & df.label.isin(names)].assign(tokens=lambda d: d.tokens_seen / 1e6)
    _styled_lines(short, "tokens", "perplexity", names, axes[0], errorbar="sd", markersize=4, lw=1.2)
    axes[0].set_ylabel(f"perplexity at {train} (training length)")
    grown = budget_growth(df, long)
    grown = grown[grown.label.isin(names)].assign(tokens=lambda d: d.tokens_seen / 1e6)
    _styled_lines(grown, "tokens", "growth", names, axes[1], errorbar="sd", markersize=4, lw=1.2)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    _log_values(axes[1])
    axes[1].set_ylabel(f"growth ppl({long}) / ppl({train}), log scale")
    for ax in axes:
        ax.set_xlabel("training tokens seen (millions)")
    axes[0].get_legend().remove()
    axes[1].legend(title=None, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return axes


#: how each verdict is marked in :func:`verdict_figure`: marker, colour and the word in the legend
VERDICT_MARKS = {"holds": ("o", "#1a9850", "holds"), "fails": ("X", "#d73027", "does not hold"),
                 "mode-dependent": ("D", "#fdae61", "mode-dependent"),
                 "equal within 1 %": ("s", "#4575b4", "equal within 1 %")}


def verdict_figure(rows, ax=None, *, judged_len: int = 2048, floor: float = 1.01):
    """Every claim's verdict as one figure: per claim part (a row), the effect its verdict rests on as a ratio on a
    log axis with its 95 % interval (:func:`~posenc_lab.lab.verdicts.in_words.verdict_effects`), marked by verdict
    (:data:`VERDICT_MARKS`; grey and open where not resolved). The grey band is the floor (a difference under 1 %
    decides nothing); a dotted tick on a row marks its test's margin (10 % for "slightly" and "clearly", 5 % either
    way for "flat"). Returns the ``Axes``."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from posenc_lab.lab.verdicts.in_words import verdict_effects

    effects = verdict_effects(rows, judged_len=judged_len)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(effects) + 1.2))
    ax.axvspan(1 / floor, floor, color="0.85", zorder=0)
    ax.axvline(1.0, color="0.4", lw=0.8, zorder=1)
    for y, r in enumerate(effects.itertuples()):
        marker, colour, _ = VERDICT_MARKS.get(r.verdict, ("o", "0.5", "not resolved"))
        filled = r.verdict in VERDICT_MARKS
        ax.errorbar(r.ratio, y, xerr=[[r.ratio - r.low], [r.high - r.ratio]], fmt="none", ecolor=colour, lw=1.6,
                    capsize=3, zorder=2)
        ax.plot(r.ratio, y, marker=marker, ms=8, color=colour, mfc=colour if filled else "white", zorder=3,
                linestyle="none")
        if not np.isnan(r.margin):
            for m in ((r.margin, 1 / r.margin) if r.reading == "equivalent" else (r.margin,)):
                ax.plot([m, m], [y - 0.35, y + 0.35], color="0.2", ls=":", lw=1.4, zorder=2)
    ax.set_xscale("log")
    ax.set_yticks(range(len(effects)))
    ax.set_yticklabels([f"{r.claim}\n{r.what}" for r in effects.itertuples()], fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xlabel("ratio the verdict rests on (perplexity, growth factor, or growth over its line), 95 % interval")
    handles = [Line2D([], [], marker=m, color=c, ls="none", ms=7, label=word) for m, c, word in VERDICT_MARKS.values()]
    handles += [Line2D([], [], marker="o", color="0.5", mfc="white", ls="none", ms=7, label="not resolved"),
                Line2D([], [], color="0.2", ls=":", label="the test's margin"),
                Line2D([], [], color="0.85", lw=6, label="under 1 %: decides nothing")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return ax


def far_ratios(ratios, ax=None, *, names: dict | None = None, order_len: int | None = None):
    """Each seed's far-byte ratio (``far_context.ratio_frame``: perplexity with full attention over the same model's
    with the last ``reach`` keys), a column of dots per model coloured by evaluation length, on a log axis with a line
    at 1. Models are ordered by their mean ratio at ``order_len`` (default the longest length) and printed by
    ``names``. Returns the ``Axes``."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.ticker import FixedLocator, NullLocator

    ax = ax or plt.gca()
    names = names or {}
    order_len = order_len or int(ratios["eval_len"].max())
    order = ratios[ratios.eval_len == order_len].groupby("label")["ratio"].mean().sort_values().index
    sns.stripplot(data=ratios, x="label", y="ratio", hue="eval_len", order=order, dodge=True, palette="viridis",
                  size=6, jitter=0.1, ax=ax)
    ax.axhline(1, color="grey", lw=1)
    ax.set_yscale("log")
    ticks = [0.7, 1, 1.5, 2, 3]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([f"{t:g}" for t in ticks])
    ax.set(xlabel="", ylabel=f"far-byte perplexity,\nfull / last {int(ratios['reach'].iloc[0])} keys")
    ax.set_xticks(range(len(order)), [names.get(x, x).replace(" + ", " +\n") for x in order], rotation=30,
                  ha="right")
    ax.legend(title="evaluation length (bytes)", fontsize=8)
    return ax
