"""The helpers the methods chapters (13 and 14) build their tables and figures with, against direct computations on
chapter 13's committed runs: geometric means with scipy, the grid's cells from the family's own rows, the far-byte
ratios from the gains."""

import math

import pytest
from scipy import stats

from posenc_lab.lab import results
from posenc_lab.lab.figures import plots
from posenc_lab.lab.measure import far_context
from posenc_lab.lab.verdicts import in_words, tables
from posenc_lab.lab.verdicts.statistics import label

BASE = ("alibi", "rope/none", "rope/yarn")


@pytest.fixture(scope="module")
def trained():
    rows = results.rows("recent-cpu") + [r for r in results.rows("article-cpu") if label(r) in BASE]
    return rows, list(results.load("recent-cpu")[2]["spec"]["encodings"])


def test_geometric_means_are_scipys_over_the_seeds(trained):
    rows, methods = trained
    means = tables.geometric_means(plots.growth_frame(rows))
    for mode in ("nonoverlapping", "sliding"):
        for name in (methods[0], "alibi"):
            mine = [r for r in rows if label(r) == name and r["eval_mode"] == mode and r["status"] == "ok"]
            at = {n: {r["seed"]: r["perplexity"] for r in mine if r["eval_len"] == n}
                  for n in {r["eval_len"] for r in mine}}
            for n, by_seed in at.items():
                ppl = stats.gmean(list(by_seed.values()))
                assert means.loc[(mode, name, n), "ppl"] == pytest.approx(ppl, rel=1e-12)
                growth = [by_seed[s] / at[512][s] for s in by_seed]
                assert means.loc[(mode, name, n), "own"] == pytest.approx(stats.gmean(growth), rel=1e-12)


def test_the_grid_prints_each_ratio_with_its_outcome_and_the_own_growth(trained):
    rows, methods = trained
    table = in_words.against_baselines(rows, methods)
    means = tables.geometric_means(plots.growth_frame(rows))
    names = {**in_words.NAMES, "rope/none": "RoPE"}
    for mode in ("nonoverlapping", "sliding"):
        grid = tables.versus_grid(table, means, mode, methods, names, train_len=512)
        assert list(grid.index) == [names[m] for m in methods]
        part = table[table["mode"] == mode]
        for r in part.itertuples():
            mark = {"lower": " <", "higher": " >"}.get(r.outcome, "")
            column = f"{names[r.b].removeprefix('RoPE with ')} {r.eval_len}"
            assert grid.loc[names[r.a], column] == f"{r.ratio:.2f}{mark}"
        marked = grid.drop(columns=[c for c in grid.columns if c.startswith("own")]).stack()
        assert marked.str.endswith(("<", ">")).sum() == (part["outcome"] != "not resolved").sum()
        lengths = sorted(means.loc[mode].index.get_level_values("eval_len").unique())
        assert [c for c in grid.columns if c.startswith("own")] == [f"own {n}" for n in lengths if n != 512]
        for m in methods:
            for n in lengths[1:]:
                assert grid.loc[names[m], f"own {n}"] == f"{means.loc[(mode, m, n), 'own']:.2f}"


def test_far_ratios_are_the_far_bytes_perplexity_ratio_of_finished_rows():
    gain = results.read_json("context-recent", "gain.json")
    frame = far_context.ratio_frame(gain + [{**gain[0], "status": "error", "gain": float("nan")}])
    assert len(frame) == sum(r["status"] == "ok" for r in gain)
    for r, (_, row) in zip([r for r in gain if r["status"] == "ok"], frame.iterrows()):
        assert row["ratio"] == pytest.approx(math.exp(r["far_loss_full"] - r["far_loss_reach"]), rel=1e-5)
        assert row["label"] == (r["encoding"] if r["strategy"] == "-" else f"{r['encoding']}/{r['strategy']}")


def test_the_far_ratio_figure_orders_models_by_their_mean_at_the_longest_length():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = far_context.ratio_frame(results.read_json("context-recent", "gain.json"))
    fig, ax = plt.subplots()
    plots.far_ratios(frame, ax, names={"fox": "FoX"})
    shown = [t.get_text() for t in ax.get_xticklabels()]
    means = frame[frame.eval_len == frame.eval_len.max()].groupby("label")["ratio"].mean().sort_values()
    assert shown == [{"fox": "FoX"}.get(n, n) for n in means.index]
    assert ax.get_yscale() == "log" and "512 keys" in ax.get_ylabel()
    plt.close(fig)


def test_beats_reads_sliding_windows_and_the_longest_length_in_non_overlapping_ones(trained):
    rows, methods = trained
    table = in_words.against_baselines(rows, methods)
    out = in_words.beats(table, "alibi")
    sliding = set(table.loc[table["mode"] == "sliding", "eval_len"])
    every = set(table["eval_len"])
    assert len(out) == len(methods) * len(every)
    assert set(out.loc[out["mode"] == "sliding", "eval_len"]) == sliding
    assert set(out.loc[out["mode"] == "nonoverlapping", "eval_len"]) == every - sliding
    for row in out.itertuples():
        source = table[(table["a"] == row.method) & (table["b"] == "alibi") & (table["eval_len"] == row.eval_len)
                       & (table["mode"] == row.mode)].iloc[0]
        assert row.ratio == source["ratio"]
        # the declared rule, spelled out: lower by at least 1 % and surviving Benjamini-Hochberg
        assert row.beats == (source["ratio"] <= 0.99 and source["p BH"] <= 0.05 and source["sign"] == "<")
    assert out["beats"].any() and not out["beats"].all()  # the rule separates chapter 13's methods


def test_beats_names_a_baseline_missing_from_the_table(trained):
    rows, methods = trained
    with pytest.raises(ValueError, match="no comparison with t5"):
        in_words.beats(in_words.against_baselines(rows, methods[:1]), "t5")
