"""The article's claims as tests of log-scale quantities, on synthetic rows with known answers."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tables

from posenc_lab.lab.verdicts import claims, in_words, statistics, tables as report

ROOT = Path(__file__).resolve().parents[1]


def rows_from(table: dict, seeds=(0, 1, 2), **kw):
    return tables.rows_from(table, seeds, **kw)


ARTICLE_WORLD = {  # a world where every claim holds
    "alibi": (6.5, 6.4, 6.45), "rope/none": (6.4, 9.0, 15.0), "rope/ntk": (6.4, 6.3, 6.2),
    "rope/pi": (6.4, 8.0, 9.0), "t5": (6.45, 6.6, 30.0), "sinusoidal": (7.0, 20.0, 40.0),
    "learned": (6.9, math.nan, math.nan),
}


def verdicts_of(world, seeds=(0, 1, 2)):
    return {c["claim"][:2]: c["verdicts"] for c in claims.claims(rows_from(world, seeds), "nonoverlapping", judged_len=512)}


def test_the_rule_states_scale_floor_margins_and_modes():
    for words in ("log scale", "log 1.01", "Holm", "intersection-union", "two one-sided tests", "80 % power",
                  "mode-dependent", "Sliding windows are the primary mode", "Fisher's exact test"):
        assert words in claims.RULE, words


def test_claims_hold_where_they_should():
    v = verdicts_of(ARTICLE_WORLD)
    assert v["1."] == {"a (slightly worse at training length)": "holds", "b (most stable)": "holds"}
    assert v["2."] == {"ntk most accurate": "holds", "dynamic-ntk most accurate": "no data",
                       "yarn most accurate (ours)": "no data"}
    assert v["3."] == {"clearly worse than RoPE": "holds", "clearly worse than ALiBi": "holds"}
    assert v["AL"] == {"sinusoidal breaks first, then rotary": "holds", "T5 holds to about 2x": "holds",
                       "ALiBi stays flat": "holds"}


def test_claims_fail_where_they_should():
    world = dict(ARTICLE_WORLD, alibi=(6.3, 8.0, 20.0), t5=(6.45, 6.5, 6.6), **{"rope/pi": (6.4, 6.5, 6.0)})
    v = verdicts_of(world)
    assert v["1."] == {"a (slightly worse at training length)": "fails", "b (most stable)": "fails"}
    assert v["2."]["ntk most accurate"] == "fails"
    assert v["3."] == {"clearly worse than RoPE": "fails", "clearly worse than ALiBi": "fails"}
    assert v["AL"]["ALiBi stays flat"] == "fails"


def test_claim_2_is_against_every_scheme_and_rotary_must_break_after_the_sinusoids():
    assert verdicts_of(dict(ARTICLE_WORLD, **{"rope/ntk": (6.4, 6.6, 7.0)}))["2."]["ntk most accurate"] == "fails"
    never_breaks = verdicts_of(dict(ARTICLE_WORLD, **{"rope/none": (6.4, 6.4, 6.45)}))
    assert never_breaks["AL"]["sinusoidal breaks first, then rotary"] == "fails"


def test_most_stable_means_degrades_least():
    """ALiBi's perplexity falls by 10 % with length while T5's stays flat and RoPE's rises by 3 %. ALiBi degrades
    least: the claim holds. The size of the change (the sensitivity reading) would call the flat one more stable."""
    world = {"alibi": (6.5, 6.2, 5.85), "rope/none": (6.4, 6.5, 6.6), "t5": (6.45, 6.45, 6.46)}
    readings = claims.claim_1b_readings(rows_from(world), "nonoverlapping", judged_len=512)
    assert readings == {"degrades least (signed log growth, declared)": "holds",
                        "smallest |log growth| (sensitivity)": "fails"}
    assert verdicts_of(world)["1."]["b (most stable)"] == "holds"


def test_slightly_and_clearly_have_their_margins():
    """15 % worse is not "slightly worse"; a growth 4 % larger is not "clearly worse"; 30 % larger is."""
    v = verdicts_of(dict(ARTICLE_WORLD, alibi=(7.36, 7.25, 7.3)))
    assert v["1."]["a (slightly worse at training length)"] == "fails"
    v = verdicts_of(dict(ARTICLE_WORLD, t5=(6.45, 6.6, 6.45 * 6.45 / 6.5 * 1.04)))
    assert v["3."]["clearly worse than ALiBi"] == "fails"
    v = verdicts_of(dict(ARTICLE_WORLD, t5=(6.45, 6.6, 6.45 * 6.45 / 6.5 * 1.30)))
    assert v["3."]["clearly worse than ALiBi"] == "holds"


def test_t5_holds_to_about_twice_needs_both_halves():
    """Flat at 2x is half the claim: a T5 still flat at 4x has not stopped holding, and the claim fails."""
    v = verdicts_of(dict(ARTICLE_WORLD, t5=(6.45, 6.5, 6.55)))
    assert v["AL"]["T5 holds to about 2x"] == "fails"
    assert verdicts_of(ARTICLE_WORLD)["AL"]["T5 holds to about 2x"] == "holds"


def test_equal_growths_read_equal_within_the_floor_not_a_lean():
    v = verdicts_of(dict(ARTICLE_WORLD, t5=(6.5, 6.4, 6.45)))
    assert v["1."]["b (most stable)"] == "equal within 1 %"


def test_one_seed_resolves_nothing():
    v = verdicts_of(ARTICLE_WORLD, seeds=(0,))
    assert v["1."]["a (slightly worse at training length)"].startswith("not resolved")
    assert all(x.startswith("not resolved") or x == "no data" for c in v.values() for x in c.values())


def test_nothing_to_compare_is_no_data_not_a_verdict():
    v = verdicts_of({k: val for k, val in ARTICLE_WORLD.items() if k != "t5"})
    assert v["3."] == {"clearly worse than RoPE": "no data", "clearly worse than ALiBi": "no data"}


def _two_modes(sliding: dict, nonoverlapping: dict):
    return rows_from(sliding, mode="sliding") + rows_from(nonoverlapping, mode="nonoverlapping")


def test_the_primary_mode_decides_and_opposite_modes_are_mode_dependent():
    """Sliding windows decide; where non-overlapping windows resolve the other way the part is mode-dependent, and
    where they merely do not resolve it the sliding verdict stands. Every mode's verdict is kept beside it."""
    worse = dict(ARTICLE_WORLD, alibi=(6.3, 6.2, 6.25))  # ALiBi better than RoPE at the training length
    rows = _two_modes(ARTICLE_WORLD, worse)
    row = report.verdict_table(rows, judged_lens=(512,)).loc["1: a (slightly worse at training length)"]
    assert row[("sliding", 512)] == "holds" and row[("nonoverlapping", 512)] == "fails"
    assert row[("decided", 512)] == "mode-dependent"
    found = {f["part"]: f for f in in_words.findings(rows, judged_len=512)}["1: a (slightly worse at training length)"]
    assert found["verdict"] == "mode-dependent" and found["mode"] == "sliding" and "effect_sensitivity" in found
    assert "**Mode-dependent.**" in in_words.findings_markdown(rows, judged_len=512)
    unclear = dict(ARTICLE_WORLD, alibi=(6.4, 6.3, 6.35))  # equal to RoPE at the training length: not resolved
    row = report.verdict_table(_two_modes(ARTICLE_WORLD, unclear), judged_lens=(512,)).loc[
        "1: a (slightly worse at training length)"]
    assert row[("decided", 512)] == "holds"
    assert claims.decided(_two_modes(worse, ARTICLE_WORLD), judged_len=512)[
        "1: a (slightly worse at training length)"] == "mode-dependent"


def test_a_run_without_sliding_windows_is_decided_in_non_overlapping_ones():
    rows = rows_from(ARTICLE_WORLD)
    assert claims.primary_mode(rows, judged_len=512) == "nonoverlapping"
    assert {f["mode"] for f in in_words.findings(rows, judged_len=512)} == {"nonoverlapping"}


def test_equivalence_is_statsmodels_two_one_sided_tests():
    from statsmodels.stats.weightstats import DescrStatsW, ttost_paired

    from posenc_lab.lab.verdicts.statistics import compare, compare_paired, equivalence_p

    rng = np.random.default_rng(3)
    a, b = rng.normal(0.0, 0.01, 5), rng.normal(0.004, 0.01, 5)
    c = compare_paired(pd.Series(a), pd.Series(b), scale="log")
    m = math.log(1.01)
    assert equivalence_p(c, m) == pytest.approx(ttost_paired(a, b, -m, m)[0], rel=1e-10)
    one = compare(a, 0.0, scale="log")
    assert equivalence_p(one, m) == pytest.approx(DescrStatsW(a).ttost_mean(-m, m)[0], rel=1e-10)


def test_power_is_statsmodels_smallest_effect_at_the_observed_spread():
    from statsmodels.stats.power import TTestIndPower, TTestPower

    from posenc_lab.lab.verdicts.statistics import compare, compare_paired, smallest_resolved

    rng = np.random.default_rng(4)
    a, b = rng.normal(1.0, 0.03, 5), rng.normal(1.02, 0.03, 5)
    c = compare_paired(pd.Series(a), pd.Series(b), scale="log")
    d = TTestPower().solve_power(effect_size=None, nobs=5, alpha=0.05, power=0.8, alternative="two-sided")
    assert smallest_resolved(c) == pytest.approx(d * np.std(a - b, ddof=1), rel=1e-8)
    w = compare(a, b[:4], scale="log")
    d = TTestIndPower().solve_power(effect_size=None, nobs1=5, ratio=4 / 5, alpha=0.05, power=0.8)
    pooled = w.se / math.sqrt(1 / 5 + 1 / 4)
    assert smallest_resolved(w) == pytest.approx(d * pooled, rel=1e-8)
    assert smallest_resolved(c, power=0.9) > smallest_resolved(c)


def test_claim_bootstrap_on_two_documents_by_hand():
    """Two documents, A and B: resampling two documents with replacement draws (d0, d0), (d0, d1) or (d1, d1),
    and A and B are always drawn together, so the differences are only the three the draws give by hand."""
    docs = []
    for name, losses in (("alibi", (1.0, 2.0)), ("t5", (1.2, 2.1))):
        for doc, tokens, loss in zip(("d0", "d1"), (100, 300), losses):
            docs.append({"encoding": name, "strategy": "-", "seed": 0, "eval_len": 128, "eval_mode": "sliding",
                         "document": doc, "tokens": tokens, "loss": loss})
    test = claims.Test(claims.Quantity("level", "alibi", 128), claims.Quantity("level", "t5", 128), "<")
    cells = claims.document_losses(docs, resamples=4000, seed=1)
    d = (cells[("sliding", "alibi", 128)] - cells[("sliding", "t5", 128)])[0].to_numpy()
    mixed = (100 * 1.0 + 300 * 2.0) / 400 - (100 * 1.2 + 300 * 2.1) / 400
    assert d[0] == pytest.approx(mixed)  # row 0: the documents as they are
    assert set(np.round(d, 9)) == set(np.round([-0.2, mixed, -0.1], 9))  # never A of one draw with B of another
    assert np.mean(np.isclose(d[1:], mixed)) == pytest.approx(0.5, abs=0.03)
    out = claims.claim_bootstrap(docs, [("sliding", test)], train=128, resamples=4000, seed=1).iloc[0]
    assert out["diff"] == pytest.approx(mixed) and out["low"] == pytest.approx(-0.2) and out["high"] == pytest.approx(-0.1)


def test_comparison_table_prints_the_bootstrap_beside_the_t_test():
    rows = rows_from(ARTICLE_WORLD)
    docs = [{"encoding": r["encoding"], "strategy": r["strategy"], "seed": r["seed"], "eval_len": r["eval_len"],
             "eval_mode": r["eval_mode"], "document": doc, "tokens": 100,
             "loss": math.log(r["perplexity"]) + (0.01 if doc == "d0" else -0.01)}
            for r in rows if r["perplexity"] == r["perplexity"] for doc in ("d0", "d1", "d2")]
    table = claims.comparison_table(rows, modes=("nonoverlapping",), judged_len=512, documents=docs, resamples=200)
    first = table.iloc[0]
    assert first["claim"] == "1: a (slightly worse at training length)" and first["low"] < first["ratio"] < first["high"]
    # every document moves both labels alike here: the bootstrap has nothing to resample but the ratio itself
    assert first["boot low"] == pytest.approx(first["ratio"]) == first["boot high"]
    assert {"p holm", "agree"} <= set(table.columns)
    text = claims.claims_text(rows, "nonoverlapping", judged_len=512)
    assert text.startswith("decision rule: Seeds are the samples") and "ratio" in text and "p = " in text


def test_side_by_side_recipes_agree_with_each_run_and_an_independent_t_test():
    """The recipes' side-by-side table holds each committed run's own decided verdicts, rests each on one of the
    claim's comparisons, and its numbers are scipy's paired t-test on the log perplexities."""
    import numpy as np
    from scipy import stats as scipy_stats

    from posenc_lab.lab.verdicts import claims, statistics, tables as report

    runs = {name: report.load(ROOT / "results" / name)[0] for name in ("article-long", "article-long-b4")}
    side = in_words.side_by_side(runs)
    for name, rows in runs.items():
        assert side[(name, "verdict")].to_dict() == claims.decided(rows)
    assert list(side[("all runs", "same verdict")]) == [
        side.loc[c, ("article-long", "verdict")] == side.loc[c, ("article-long-b4", "verdict")] for c in side.index]
    # T5's growth to 2,048 against plain RoPE's (sliding), independently: a paired t-test on the log growths
    df = statistics.frame(runs["article-long-b4"])
    sliding = df[df.eval_mode == "sliding"]

    def log_growth(label):
        ppl = {n: sliding[(sliding.label == label) & (sliding.eval_len == n)].sort_values("seed").perplexity.to_numpy()
               for n in (512, 2048)}
        return np.log(ppl[2048] / ppl[512])

    t5, rope = log_growth("t5"), log_growth("rope/none")
    expected = scipy_stats.ttest_rel(t5, rope)
    text = side.loc["3: clearly worse than RoPE", ("article-long-b4", "rests on")]
    assert text.startswith(f"t5 / rope/none = ratio {np.exp((t5 - rope).mean()):.3f}") and "(sliding)" in text
    assert f"p = {expected.pvalue:.3g}" in text


def test_deciding_prefers_a_comparison_resolved_against_the_claim():
    from posenc_lab.lab.verdicts.statistics import compare_design

    quiet = compare_design(np.array([1.0, 1.02, 0.99]), np.array([1.0, 1.01, 1.0]))
    against = compare_design(np.array([2.0, 2.1, 2.05]), np.array([1.0, 1.02, 1.01]))
    a = claims.Quantity("level", "a", 512)
    tests = [(claims.Test(a, a, "<"), quiet), (claims.Test(a, a, "<"), against)]
    assert in_words.deciding(tests)[1] is against
    assert in_words.deciding(tests[:1])[1] is quiet


def test_findings_say_each_decided_verdict_with_the_comparison_it_rests_on():
    rows = report.load(ROOT / "results" / "article-long")[0]
    found = in_words.findings(rows)
    assert [f["verdict"] for f in found] == list(claims.decided(rows).values())
    side = in_words.side_by_side({"run": rows})
    for f in found:
        rests_on = side.loc[f["part"], ("run", "rests on")]
        assert f["mode"] in rests_on and f["mode"] == "sliding"
    text = in_words.findings_markdown(rows)
    assert text.count("\n") == len(found) - 1 and "seeds resolve a difference of" in text
    assert all("(sliding windows" in line for line in text.splitlines())  # one mode printed on every line
    assert in_words.verdict_in_words("not resolved (too few seeds)") == "Not resolved: too few seeds"
    assert in_words.verdict_in_words("equal within 1 %") == "Equal within 1 %"


def test_effect_in_words_reads_a_level_and_a_line():
    from posenc_lab.lab.verdicts.statistics import compare_design

    c = compare_design(np.array([2.0, 2.02, 1.98]), np.array([2.2, 2.21, 2.19]))
    level = claims.Test(claims.Quantity("level", "alibi", 512), claims.Quantity("level", "rope/none", 512), "<")
    assert in_words.effect_in_words(level, c, 512).startswith(f"ALiBi's perplexity at 512 is {c.ratio:.2f} times RoPE's")
    line = claims.Test(claims.Quantity("growth", "t5", 1024), 1.1, "<")
    assert f"changes by a factor of {c.ratio * 1.1:.3f} from 512 to 1,024" in in_words.effect_in_words(line, c, 512)


def test_growth_is_said_as_growth_factors_and_a_difference_in_nats():
    """Two growths are never said as "X times the growth": each is a growth factor with its interval, and the
    comparison is the difference of their logs in nats."""
    rows = rows_from(ARTICLE_WORLD)
    df = statistics.frame(rows)
    test = claims.Test(claims.Quantity("growth", "t5", 512), claims.Quantity("growth", "rope/none", 512), ">")
    c = claims.run_test(df, "nonoverlapping", test)
    text = in_words.effect_in_words(test, c, 128, df, "nonoverlapping")
    g_t5 = in_words.growth_factor(df, "nonoverlapping", "t5", 512)[0]
    assert g_t5 == pytest.approx(30.0 / 6.45, rel=0.01)
    assert text.startswith(f"T5's perplexity grows by a factor of {g_t5:.3g}") and "nats" in text
    assert f"{c.diff:+.3f} nats" in text and "times" not in text


def test_side_by_side_domains_hold_each_committed_runs_decided_verdicts():
    """The domains' table of chapter 10 (Python and English prose, the headline recipe) is each run's own."""
    runs = {name: report.load(ROOT / "results" / name)[0] for name in ("article-long-b4", "prose-long-b4")}
    side = in_words.side_by_side(runs)
    for name, rows in runs.items():
        assert side[(name, "verdict")].to_dict() == claims.decided(rows)


def test_verdict_figure_draws_each_claims_interval_and_marks_its_verdict():
    """On made-up rows with known verdicts: one row per judged claim part, its ratio and 95 % interval drawn as
    an error bar, its marker the verdict's (holds, does not hold), the margins of "slightly", "clearly" and
    "flat" drawn on their rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    from posenc_lab.lab.figures import plots

    world = dict(ARTICLE_WORLD, alibi=(6.3, 8.0, 20.0))  # 1a, 1b and "stays flat" do not hold
    rows = rows_from(world)
    effects = in_words.verdict_effects(rows, judged_len=512)
    verdicts = dict(zip(effects["part"], effects["verdict"]))
    assert verdicts["1: a (slightly worse at training length)"] == "fails"
    assert verdicts["3: clearly worse than RoPE"] == "holds"
    assert (effects["low"] < effects["ratio"]).all() and (effects["ratio"] < effects["high"]).all()
    ax = plots.verdict_figure(rows, judged_len=512)
    bars = [c for c in ax.collections if isinstance(c, matplotlib.collections.LineCollection)]
    spans = sorted(tuple(np.round(seg[:, 0], 6)) for bar in bars for seg in bar.get_segments()
                   if seg[0, 1] == seg[1, 1])  # the horizontal interval of each row
    assert spans == sorted(tuple(np.round([r.low, r.high], 6)) for r in effects.itertuples())
    shapes = {m for m, _, _ in plots.VERDICT_MARKS.values()} | {"o"}
    marks = [line for line in ax.lines if line.get_marker() in shapes]
    for r, y in zip(effects.itertuples(), range(len(effects))):
        mark = next(m for m in marks if m.get_ydata()[0] == y)
        marker, colour, _ = plots.VERDICT_MARKS[r.verdict]
        assert mark.get_marker() == marker and mcolors.same_color(mark.get_color(), colour)
        assert mark.get_xdata()[0] == pytest.approx(r.ratio)
    margins = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(margins) == (effects["reading"] == "equivalent").sum() * 2 + effects["reading"].isin(
        ["slightly", "clearly"]).sum()
    plt.close(ax.figure)


def _mean_log_ratio(rows, a, b, mode="nonoverlapping", length_a=128, length_b=128):
    """exp of the mean over seeds of log(ppl_a / ppl_b), straight from made-up rows (no package code)."""
    cell = lambda label, length: {r["seed"]: r["perplexity"] for r in rows  # noqa: E731
                                  if r["eval_mode"] == mode and r["eval_len"] == length
                                  and "/".join(x for x in (r["encoding"], r["strategy"]) if x != "-") == label}
    pa, pb = cell(a, length_a), cell(b, length_b)
    return math.exp(np.mean([math.log(pa[s] / pb[s]) for s in pa]))


def test_answer_table_says_each_verdict_and_its_size_in_plain_words():
    """The first screen's table on made-up rows: one row per claim part, the verdict in words, and a size computed
    from the rows (a percentage below or above, a growth that rises, falls or grows n-fold), never a p or an
    interval."""
    world = dict(ARTICLE_WORLD, alibi=(6.3, 8.0, 20.0))  # ALiBi better at 128, then grows 3.2-fold by 512
    rows = rows_from(world)
    table = in_words.answer_table(rows, judged_len=512)
    assert list(table.columns) == ["claim", "source", "answer", "size"]
    assert len(table) == len(in_words.findings(rows, judged_len=512))
    by = dict(zip(table["claim"], zip(table["answer"], table["size"])))
    answer, size = by["ALiBi is slightly worse than RoPE at the training length"]
    below = 1 - _mean_log_ratio(rows, "alibi", "rope/none")
    assert answer == "Does not hold"
    assert size.startswith(f"ALiBi's perplexity at 128 is {in_words._pct(below)} below RoPE's")
    assert "slightly worse means 1 % to 10 % above" in size
    answer, size = by["ALiBi stays flat"]
    grown = _mean_log_ratio(rows, "alibi", "alibi", length_a=512, length_b=128)
    assert answer == "Does not hold" and grown > 3
    assert f"ALiBi's perplexity grows {in_words._times(grown)}-fold from 128 to 512" in size
    assert set(table["source"]) == {"the article", "our question", "the ALiBi paper"}
    for text in table["size"]:
        assert "p =" not in text and "[" not in text and "nats" not in text, text


def test_answer_table_names_the_lengths_and_margins_the_words_set():
    rows = rows_from(ARTICLE_WORLD)
    table = in_words.answer_table(rows, judged_len=512).set_index("claim")
    assert (table.loc[["ALiBi is slightly worse than RoPE at the training length", "ALiBi stays flat",
                       "T5 holds to about twice the training length, and no further"], "answer"] == "Holds").all()
    assert "from 128 to 256" in table.loc["The sinusoids break first, then RoPE", "size"]  # judged at 2x, not 4x
    assert "flat means within 5 %" in table.loc["ALiBi stays flat", "size"]
    assert "a rise of more than 10 % counts as breaking" in table.loc[
        "T5 holds to about twice the training length, and no further", "size"]
    t5 = table.loc["T5's bias extrapolates clearly worse than ALiBi", "size"]
    ratio = _mean_log_ratio(rows, "t5", "t5", length_a=512) / _mean_log_ratio(rows, "alibi", "alibi", length_a=512)
    assert f"T5's growth is {in_words._times(ratio)} times ALiBi's" in t5 and "at least 10 % above" in t5
    equal = in_words.answer_table(rows_from(dict(ARTICLE_WORLD, t5=(6.5, 6.4, 6.45))), judged_len=512)
    assert "Equal within 1 %" in set(equal["answer"])
    alone = in_words.answer_table(rows_from(ARTICLE_WORLD, seeds=(0,)), judged_len=512)
    assert set(alone["answer"]) <= {"Not resolved: too few seeds", "Not resolved: the difference is under 1 %",
                                    "No data"}


def test_answer_markdown_is_one_row_a_claim_and_says_a_mode_dependent_size_in_its_mode():
    worse = dict(ARTICLE_WORLD, alibi=(6.3, 6.2, 6.25))
    rows = _two_modes(ARTICLE_WORLD, worse)
    text = in_words.answer_markdown(rows, judged_len=512)
    lines = text.splitlines()
    assert lines[:2] == ["| claim | our answer | its size |", "|---|---|---|"]
    assert len(lines) == 2 + len(in_words.answer_table(rows, judged_len=512))
    row = next(line for line in lines if line.startswith("| ALiBi is slightly worse"))
    assert "(the article) | **Mode-dependent** |" in row and row.endswith("(in sliding windows) |")
