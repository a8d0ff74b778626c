"""The newer methods' tables, recomputed apart from the package: chapters 13's and 14's perplexity tables against their
baselines with scipy's paired t-test and Benjamini-Hochberg, and the retrieval family with scipy's Fisher test per seed."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from posenc_lab.lab import readme

ROOT = Path(__file__).resolve().parents[1]
FLOOR, ALPHA = np.log(1.01), 0.05


def lv(df, mode, name, n):
    c = df[(df.eval_mode == mode) & (df.label == name) & (df.eval_len == n)].set_index("seed")["loss"]
    return c.sort_index()


@pytest.mark.parametrize("ch", list(readme.METHOD_BLOCKS.values()))
def test_the_newer_methods_against_their_baselines_agree_with_scipy(ch):
    """A methods chapter's table and the README's line (chapter 13's ``recent-cpu``, chapter 14's
    ``past-softmax-cpu``): each method against ALiBi and RoPE with YaRN of its base run (``article-cpu``: the same
    batches, seed by seed), recomputed with scipy's paired t-test on the log scale and scipy's Benjamini-Hochberg over
    the whole table, with the symmetric 1 % floor."""
    from posenc_lab.lab.verdicts import in_words

    frames = []
    for run in (ch.run, ch.base):
        df = pd.read_csv(ROOT / "results" / run / "results.csv")
        frames.append(df.assign(label=np.where(df.strategy == "-", df.encoding, df.encoding + "/" + df.strategy)))
    df = pd.concat(frames)
    rows, methods = readme.methods_rows(ch)
    mine = []
    for b in in_words.BASELINES:
        for a in methods:
            for mode in ("nonoverlapping", "sliding"):
                lengths = sorted(set(df[(df.label == a) & (df.eval_mode == mode)].eval_len)
                                 & set(df[(df.label == b) & (df.eval_mode == mode)].eval_len))
                for n in lengths:
                    x, y = lv(df, mode, a, n), lv(df, mode, b, n)
                    assert list(x.index) == list(y.index) == [0, 1, 2]
                    d = (x - y).mean()
                    mine.append({"a": a, "b": b, "mode": mode, "eval_len": n, "d": d,
                                 "p": stats.ttest_rel(x, y).pvalue})
    mine = pd.DataFrame(mine)
    mine["q"] = stats.false_discovery_control(mine["p"], method="bh")
    counted = (mine["q"] < ALPHA) & (mine["d"].abs() >= FLOOR)
    mine["outcome"] = np.where(counted, np.where(mine["d"] < 0, "lower", "higher"), "not resolved")
    theirs = in_words.against_baselines(rows, methods)
    key = ["a", "b", "mode", "eval_len"]
    both = mine.merge(theirs, on=key, suffixes=("", " package"), validate="one_to_one")
    lengths = sum(df[(df.label == "alibi") & (df.eval_mode == mode)].eval_len.nunique()
                  for mode in ("nonoverlapping", "sliding"))
    assert len(both) == len(mine) == len(theirs) == len(methods) * len(in_words.BASELINES) * lengths
    assert (both["test"] == "paired").all()
    assert both["p"].to_numpy() == pytest.approx(both["p package"].to_numpy(), rel=1e-9)
    wrong = both[both["outcome"] != both["outcome package"]]
    assert wrong.empty, wrong[key + ["outcome", "outcome package"]]


def test_retrieval_against_baselines_is_fishers_test_per_seed_then_bh_as_scipy_computes_it():
    """Hand-made counts: each seed's 2x2 table by scipy.stats.fisher_exact, the largest p when every seed points
    the same way (1 otherwise), BH over the grid by scipy.stats.false_discovery_control."""
    import numpy as np
    from scipy import stats as st

    from posenc_lab.lab.verdicts import in_words

    correct = {  # (label, eval_len) -> correct out of 100, seeds 0-2
        ("cope", 32): (100, 99, 100), ("cope", 64): (80, 60, 95), ("cope", 128): (30, 35, 28),
        ("alibi", 32): (88, 85, 91), ("alibi", 64): (86, 83, 90), ("alibi", 128): (75, 60, 79),
        ("rope/yarn", 32): (99, 98, 100), ("rope/yarn", 64): (52, 62, 41), ("rope/yarn", 128): (5, 10, 2)}
    rows = [{"encoding": label.split("/")[0], "strategy": label.split("/")[1] if "/" in label else "-", "seed": s,
             "train_len": 32, "eval_len": n, "depth": 0.5, "status": "ok", "correct": c[s], "trials": 100,
             "train_accuracy": 1.0} for (label, n), c in correct.items() for s in range(3)]
    family = in_words.retrieval_against_baselines(rows, ["cope"])
    assert len(family) == 3 * 2 + 2  # two baselines at three lengths, itself at 1x at two
    expected = []
    for r in family.itertuples():
        other = ("cope", 32) if r.against == "itself at L" else (r.against, r.eval_len)
        a, b = correct[("cope", r.eval_len)], correct[other]
        ps = [st.fisher_exact([[a[s], 100 - a[s]], [b[s], 100 - b[s]]]).pvalue for s in range(3)]
        diffs = [(a[s] - b[s]) / 100 for s in range(3)]
        same_way = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
        expected.append(max(ps) if same_way else 1.0)
        assert r.difference == pytest.approx(np.mean(diffs)) and (r.low, r.high) == pytest.approx((min(diffs), max(diffs)))
    np.testing.assert_allclose(family["p"], expected, rtol=1e-12)
    np.testing.assert_allclose(family["p BH"], st.false_discovery_control(expected, method="bh"), rtol=1e-12)
    for (_, r), p_bh in zip(family.iterrows(), family["p BH"]):
        counts = p_bh < 0.05 and abs(r["difference"]) >= 0.01
        assert r["outcome"] == (("higher" if r["difference"] > 0 else "lower") if counts else "not resolved")
    by = family.set_index(["against", "multiple"])["outcome"]
    assert by[("alibi", 1)] == "higher" and by[("alibi", 4)] == "lower" and by[("rope/yarn", 4)] == "higher"
    assert by[("itself at L", 2)] == "not resolved"  # seed 2's 95 against 100 alone is not resolved
    learned, not_learned = in_words.learned_methods(rows + [{**rows[0], "encoding": "fox", "train_accuracy": 0.0}],
                                                    ["cope", "fox"])
    assert learned == ["cope"] and not_learned == ["fox"]
