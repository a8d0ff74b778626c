"""The figures a run's folder and the README carry, as PNG files: ``python -m posenc_lab.lab.figures.files RUN`` writes the
headline figures of a committed run to ``results/RUN/figures`` (:func:`save_headline`); ``python -m posenc_lab
report`` writes a run's own (:func:`save_report_figures`). The drawing itself is :mod:`posenc_lab.lab.figures.plots`'s."""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("figures", "posenc_lab.lab.figures.files")

from pathlib import Path

from posenc_lab.lab.figures.plots import headline_figure, per_position, training_curves, use_theme, verdict_figure
from posenc_lab.lab.verdicts.statistics import frame


def save_headline(run: str, *, folder: Path | str | None = None, dpi: int = 120) -> list[Path]:
    """The headline figures of a committed run (:func:`headline_figure`, both modes, and :func:`verdict_figure`) as
    PNGs: ``ppl_vs_length.png``, ``growth.png`` and ``verdicts.png`` under ``results/<run>/figures`` (or ``folder``),
    for the README and the book's landing page. Returns the paths written."""
    import matplotlib.pyplot as plt

    from posenc_lab.lab import results
    from posenc_lab.lab.verdicts.claims import BREAK

    rows, _, _ = results.load(run)
    if folder is None:
        where = results.folder(run)
        if not isinstance(where, Path):
            raise ValueError(f"{run!r} is read from the installed package; pass folder= to write its figures")
        folder = where / "figures"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    use_theme()
    written = []
    for name, metric in (("ppl_vs_length.png", "perplexity"), ("growth.png", "growth")):
        fig = headline_figure(rows, metric=metric, breaking=BREAK if metric == "growth" else None)
        fig.suptitle(f"{run}: mean of the seeds, band from the lowest to the highest seed", fontsize=10, y=1.02)
        fig.savefig(folder / name, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        written.append(folder / name)
    ax = verdict_figure(rows)
    ax.set_title(f"{run}: the verdict of each claim and the effect it rests on", fontsize=10)
    ax.figure.savefig(folder / "verdicts.png", dpi=dpi, bbox_inches="tight")
    plt.close(ax.figure)
    written.append(folder / "verdicts.png")
    return written


def save_report_figures(rows, units: list[dict], folder: Path) -> list[Path]:
    """``ppl_vs_length.png`` (the headline figure, :func:`headline_figure`: a panel per mode), ``per_position.png``
    (the longest length) and ``training_loss.png`` in ``folder``."""
    import matplotlib.pyplot as plt

    use_theme()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    df = frame(rows)
    fig = headline_figure(df, modes=sorted(df["eval_mode"].unique(), reverse=True))
    written = [folder / "ppl_vs_length.png"]
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
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


def main(argv=None) -> int:
    """``python -m posenc_lab.lab.figures.files RUN [--folder DIR]``: the headline figures of a committed run
    (:func:`save_headline`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m posenc_lab.lab.figures.files", description=main.__doc__)
    parser.add_argument("run", help="a committed run, e.g. article-long")
    parser.add_argument("--folder", default=None, help="where to write (default: results/RUN/figures)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    for path in save_headline(args.run, folder=args.folder):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
