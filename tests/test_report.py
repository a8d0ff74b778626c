"""The report: summaries over seeds and the claims' verdicts, on synthetic rows with known answers."""

import math

import pytest

from posenc_lab import report

LENGTHS = (128, 256, 512)


def rows_from(table: dict, seeds=(0,), mode="nonoverlapping"):
    rows = []
    for name, values in table.items():
        enc, _, strategy = name.partition("/")
        for seed in seeds:
            for length, ppl in zip(LENGTHS, values):
                bump = 0.01 * seed
                rows.append({"encoding": enc, "strategy": strategy or "-", "seed": seed, "eval_len": length,
                             "eval_mode": mode, "train_len": 128, "perplexity": ppl + bump if ppl == ppl else ppl})
    return rows


def test_summary_mean_and_std_over_seeds():
    rows = rows_from({"alibi": (2.0, 2.0, 2.0)}, seeds=(0, 1, 2))
    cell = report.summarize(rows).loc[("nonoverlapping", "alibi", 256)]
    assert (round(cell["mean"], 6), round(cell["std"], 6), cell["n"]) == (2.01, 0.01, 3)
    table = report.markdown_table(rows, "nonoverlapping")
    assert "2.010 ± 0.010" in table and "mean ± std over 3 seeds" in table


def test_table_header_counts_the_seeds_of_the_rows_it_shows():
    rows = rows_from({"alibi": (2.0, 2.0, 2.0)}, seeds=(0, 1, 2)) + rows_from({"rope/yarn+ft": (3.0, 3.0, 3.0)})
    assert "over 1/3 seeds" in report.markdown_table(rows, "nonoverlapping")
    assert "over 3 seeds" in report.markdown_table(rows, "nonoverlapping", labels=["alibi"])
    only = report.markdown_table(rows, "nonoverlapping", labels=["alibi"], lengths=[512, 128])
    assert only.splitlines()[0].endswith("| 512 | 128 |")


def test_compare_resolves_only_beyond_two_standard_errors():
    assert report.compare([1.0, 1.1, 0.9], [2.0, 2.1, 1.9]).sign == "<"
    assert report.compare([1.0, 1.5, 0.5], [1.2, 1.7, 0.7]).sign == "~"  # inside the noise
    assert report.compare([1.0], [2.0]).sign == "~"  # one seed: no standard error, nothing resolved
    assert report.compare([1.2, 1.21, 1.19], 1.1).sign == ">"  # against a threshold
    c = report.compare([1.0, 2.0], [4.0, 6.0])
    assert c.se == pytest.approx(math.sqrt(0.5 / 2 + 2.0 / 2)) and c.diff == -3.5


ARTICLE_WORLD = {  # a world where every claim holds
    "alibi": (6.5, 6.4, 6.45), "rope/none": (6.4, 9.0, 15.0), "rope/ntk": (6.4, 6.6, 7.0),
    "rope/pi": (6.4, 8.0, 9.0), "t5": (6.45, 12.0, 30.0), "sinusoidal": (7.0, 20.0, 40.0),
    "learned": (6.9, math.nan, math.nan),
}


def verdicts_of(world, seeds=(0, 1, 2), jitter=0.01):
    rows = rows_from(world, seeds=seeds)
    return {c["claim"][:2]: c["verdicts"] for c in report.claims(rows, "nonoverlapping", judged_len=512)}


def test_claims_hold_where_they_should():
    v = verdicts_of(ARTICLE_WORLD)
    assert v["1."] == {"a (worse at training length)": "holds", "b (most stable)": "holds"}
    assert v["2."]["NTK best"] == "holds"
    assert v["3."] == {"worse than RoPE": "holds", "worse than ALiBi": "holds"}
    assert v["AL"]["ALiBi stays flat"] == "holds" and v["AL"]["sinusoidal breaks at the first longer length"] == "holds"


def test_claims_fail_where_they_should():
    world = dict(ARTICLE_WORLD, alibi=(6.3, 8.0, 20.0), t5=(6.45, 6.5, 6.6), **{"rope/pi": (6.4, 6.5, 6.6)})
    v = verdicts_of(world)
    assert v["1."] == {"a (worse at training length)": "fails", "b (most stable)": "fails"}
    assert v["2."]["NTK best"] == "fails"
    assert v["3."] == {"worse than RoPE": "fails", "worse than ALiBi": "fails"}
    assert v["AL"]["ALiBi stays flat"] == "fails"


def test_claims_inside_the_noise_are_not_resolved():
    """Two encodings whose seeds overlap are never declared better or worse."""
    rows = []
    for seed, (a, r) in enumerate([(6.0, 6.3), (6.6, 6.2), (6.3, 6.5)]):
        for name, ppl in (("alibi", a), ("rope/none", r)):
            enc, _, strategy = name.partition("/")
            for length in LENGTHS:
                rows.append({"encoding": enc, "strategy": strategy or "-", "seed": seed, "eval_len": length,
                             "eval_mode": "nonoverlapping", "train_len": 128, "perplexity": ppl})
    claim = report.claims(rows, "nonoverlapping", judged_len=512)[0]
    assert claim["verdicts"]["a (worse at training length)"].startswith("not resolved")


def test_one_seed_resolves_nothing_but_reports_the_direction():
    v = verdicts_of(ARTICLE_WORLD, seeds=(0,))
    assert v["1."]["a (worse at training length)"] == "not resolved (the means point to holds)"
    assert all(x.startswith("not resolved") for c in v.values() for x in c.values())


def test_claims_text_prints_the_rule_with_the_verdicts():
    text = report.claims_text(rows_from(ARTICLE_WORLD, seeds=(0, 1)), "nonoverlapping", judged_len=512)
    assert text.startswith("decision rule: A and B differ when") and "verdict, b (most stable): holds" in text


def test_nothing_to_compare_is_no_data_not_a_verdict():
    assert report.verdict([], "<") == "no data"
    world = {k: v for k, v in ARTICLE_WORLD.items() if k != "t5"}
    v = verdicts_of(world)
    assert v["3."] == {"worse than RoPE": "no data", "worse than ALiBi": "no data"}


def test_paired_comparison_removes_what_the_seeds_share():
    import pandas as pd

    a = pd.Series([10.0, 12.0, 14.0], index=[0, 1, 2])  # a big spread between seeds...
    b = a + pd.Series([0.5, 0.52, 0.48], index=[0, 1, 2])  # ...shared by b, which is always about 0.5 above
    assert report.compare(a, b).sign == "~"  # unpaired: lost in the spread between seeds
    paired = report.compare_paired(a, b)
    assert paired.sign == "<" and paired.diff == pytest.approx(-0.5)
