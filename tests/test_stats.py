"""The tests every verdict is made of: log-scale t-tests, one symmetric floor, families, exact tests of accuracies."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sp

from posenc_lab import PosencError
from posenc_lab.lab.verdicts import statistics as stats


def test_welch_runs_on_log_perplexities_computed_by_hand():
    a, b = np.array([3.0, 3.4, 2.8, 3.1]), np.array([4.0, 5.2, 3.7])
    la, lb = np.log(a), np.log(b)
    va, vb = la.var(ddof=1) / 4, lb.var(ddof=1) / 3
    t = (la.mean() - lb.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 2)  # Welch-Satterthwaite
    c = stats.compare(a, b)
    assert c.kind == "welch" and c.t == pytest.approx(t) and c.df == pytest.approx(df)
    assert c.p == pytest.approx(sp.ttest_ind(la, lb, equal_var=False).pvalue)
    assert c.ratio == pytest.approx(math.exp(la.mean() - lb.mean()))
    half = sp.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert c.interval == pytest.approx((math.exp(la.mean() - lb.mean() - half), math.exp(la.mean() - lb.mean() + half)))
    assert c.relative == pytest.approx(c.ratio - 1)
    # losses in nats are log perplexities already: the same test
    same = stats.compare(la, lb, scale="log")
    assert same.p == pytest.approx(c.p) and same.ratio == pytest.approx(c.ratio)


def test_paired_test_is_scipys_on_the_per_seed_log_ratios():
    a = pd.Series([10.0, 12.0, 14.0])
    b = a * pd.Series([1.05, 1.052, 1.048])  # about 5 % above, seed by seed
    c = stats.compare_paired(a, b)
    assert c.kind == "paired" and c.p == pytest.approx(sp.ttest_rel(np.log(a), np.log(b)).pvalue)
    assert c.ratio == pytest.approx(math.exp(np.mean(np.log(a / b))))
    assert c.sign == "<" and c.matters
    assert stats.compare(a.to_numpy(), b.to_numpy()).sign == "~"  # unpaired: lost in the spread between seeds
    assert stats.compare_design(a, b).kind == "paired" and stats.compare_design(a, b.iloc[:2]).kind == "welch"


def test_a_threshold_is_compared_on_the_log_scale_too():
    growth = [1.2, 1.21, 1.19]
    c = stats.compare(growth, 1.1)
    assert c.kind == "threshold" and c.sign == ">"
    assert c.p == pytest.approx(sp.ttest_1samp(np.log(growth), math.log(1.1)).pvalue)
    assert stats.compare([1.0], [2.0]).sign == "~"  # one seed: no test
    with pytest.raises(PosencError, match="compare_counts"):
        stats.compare([0.0, 0.5], [0.2, 0.3])  # accuracies are not ratios


def _simulate(effect, trials, comparisons=1, seeds=3, rng_seed=0, shared=0.3, spread=0.02):
    """Log perplexities near log 8 for ``1 + comparisons`` encodings over ``seeds`` seeds: a seed effect all share
    (same batches) plus a spread of their own (log scale), the first encoding ``effect`` lower (a ratio of
    ``exp(-effect)``). Returns the fraction of trials whose verdict on "the first is below every other" is holds,
    and is fails."""
    rng = np.random.default_rng(rng_seed)
    holds = fails = 0
    for _ in range(trials):
        logs = math.log(8) + shared * spread * rng.standard_normal(seeds) + spread * rng.standard_normal((1 + comparisons, seeds))
        logs[0] -= effect
        series = [pd.Series(np.exp(v), index=range(seeds)) for v in logs]
        v = stats.verdict([stats.compare_design(series[0], s) for s in series[1:]], "<")
        holds += v == "holds"
        fails += v == "fails"
    return holds / trials, fails / trials


def test_the_rule_calls_a_difference_between_equal_encodings_at_most_5_percent_of_the_time():
    for comparisons, trials in ((1, 2000), (4, 1000)):
        holds, fails = _simulate(0.0, trials, comparisons=comparisons)
        assert holds + fails <= 0.05, (comparisons, holds, fails)
    # Welch's test on log perplexities whose spread grows with the level, as raw perplexities' does
    rng = np.random.default_rng(1)
    called = sum(stats.compare(np.exp(3 + 0.2 * rng.standard_normal(3)), np.exp(3 + 0.2 * rng.standard_normal(3))).resolved
                 for _ in range(2000)) / 2000
    assert called <= 0.05


def test_the_rule_resolves_a_clear_log_scale_difference():
    holds, fails = _simulate(math.log(1.2), 500, comparisons=4)  # a ratio of 1/1.2 against each of 4
    assert holds >= 0.95 and fails == 0
    holds, fails = _simulate(math.log(1.1), 500, comparisons=1)  # a ratio of 1/1.1 against one: measured 0.80
    assert holds >= 0.75 and fails == 0


def test_the_floor_is_symmetric_a_resolved_0_2_percent_difference_decides_nothing_either_way():
    a = pd.Series([8.00, 8.50, 9.00])
    b = a * pd.Series([1.002, 1.0021, 1.0019])  # resolved (paired), a ratio of 0.998
    c = stats.compare_design(a, b)
    assert c.resolved and not c.matters and c.reading().endswith("resolved, under 1 %")
    assert stats.verdict([c], "<") == "not resolved (resolved, under 1 %)"  # cannot make it hold
    assert stats.verdict([c], ">") == "not resolved (resolved, under 1 %)"  # nor fail
    big = stats.compare_design(a, a * pd.Series([1.02, 1.021, 1.019]))
    assert stats.verdict([big], "<") == "holds" and stats.verdict([big], ">") == "fails"
    assert stats.FLOOR == pytest.approx(math.log(1.01))


def test_fails_needs_holm_adjusted_significance():
    def comp(p):
        return stats.Comparison(diff=0.1, low=0.05, high=0.15, t=3.0, df=2.0, p=p, n=(3, 3), kind="paired")

    assert stats.verdict([comp(0.03), comp(0.5), comp(0.6)], "<").startswith("not resolved")  # 0.09 after Holm
    assert stats.verdict([comp(0.01), comp(0.5), comp(0.6)], "<") == "fails"  # 0.03 after Holm


def test_holm_and_bh_match_a_hand_computation():
    p = [0.01, 0.04, 0.03, 0.005]
    # Holm, sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> kept monotone at 0.06
    assert stats.holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # BH, sorted: 0.005 x 4/1 = 0.02, 0.01 x 4/2 = 0.02, 0.03 x 4/3 = 0.04, 0.04 x 4/4 = 0.04; running min from the top
    assert stats.bh(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert stats.bh([0.5, 0.01, 0.02]) == pytest.approx([0.5, 0.03, 0.03])  # 0.02 x 3/2 = 0.03, 0.01 x 3 = 0.03
    assert stats.holm([0.4, 0.9, 0.8]) == pytest.approx([1.0, 1.0, 1.0])  # capped at 1
    out = stats.bh([math.nan, 0.02, 0.04])  # no test: not counted in m
    assert math.isnan(out[0]) and out[1:] == pytest.approx([0.04, 0.04])
    rng = np.random.default_rng(0)
    many = rng.uniform(0, 0.2, 40)
    assert stats.bh(many) == pytest.approx(sp.false_discovery_control(many, method="bh"))


def test_adjusted_names_what_survives_a_grid():
    # Holm: 0.001 x 5, 0.01 x 4 = 0.04, 0.02 x 3 = 0.06; BH: 0.03 x 5/4 = 0.0375, 0.02 x 5/3, 0.01 x 5/2, 0.5
    table = stats.adjusted(pd.DataFrame({"p": [0.001, 0.01, 0.02, 0.03, 0.5]}))
    assert table["p holm"].tolist() == pytest.approx([0.005, 0.04, 0.06, 0.06, 0.5])
    assert table["p BH"].tolist() == pytest.approx([0.005, 0.025, 0.1 / 3, 0.0375, 0.5])
    assert table["survives"].tolist() == ["holm and BH", "holm and BH", "BH", "BH", "none"]


def test_accuracies_are_compared_seed_by_seed_with_an_exact_test():
    at_1 = pd.DataFrame({"correct": [98, 99, 97], "trials": [100] * 3})
    at_4 = pd.DataFrame({"correct": [0, 0, 0], "trials": [100] * 3})  # no spread at all: an exact test still has a p
    c = stats.compare_counts(at_4, at_1)
    by_hand = max(sp.fisher_exact([[0, 100], [k, 100 - k]]).pvalue for k in (98, 99, 97))
    assert c.kind == "exact" and c.p == pytest.approx(by_hand) and c.resolved and c.sign == "<"
    assert stats.verdict([c], "<") == "holds"
    # seeds that disagree in direction resolve nothing, however strong each seed's own test
    mixed = stats.compare_counts(pd.DataFrame({"correct": [0, 100, 0], "trials": [100] * 3}), at_1)
    assert mixed.p == 1.0 and not mixed.resolved
    # a t-test on the accuracies would grow stronger as the seeds sit closer to the floor: the exact test does not
    near = pd.DataFrame({"correct": [1, 2, 1], "trials": [100] * 3})
    assert stats.compare_counts(near, at_1).p >= c.p


def test_seed_intervals_come_from_the_seeds_and_stay_between_0_and_1():
    seeds = [0.83, 0.60, 0.79]
    mean, low, high = stats.seed_interval(seeds)
    half = sp.t.ppf(0.975, 2) * np.std(seeds, ddof=1) / math.sqrt(3)
    assert mean == pytest.approx(np.mean(seeds)) and high == 1.0 and low == pytest.approx(np.mean(seeds) - half)
    assert stats.seed_interval([0.0, 0.0, 0.0]) == (0.0, 0.0, 0.0)
    assert math.isnan(stats.seed_interval([0.5])[1])


def test_equal_per_seed_differences_but_for_rounding_get_no_test():
    parts = pd.Series([float(np.mean([1.0, 1.0, 0.994])), 499 / 500, 1 - 0.002])  # 0.998, reached three ways
    c = stats.compare_paired(pd.Series([1.0, 1.0, 1.0]), parts + 1.0, scale="log")
    assert math.isnan(c.p) and stats.verdict([c], "<") == "not resolved (the means point to holds)"
    assert math.isnan(stats.compare([0.998] * 3, 0.5).p)
