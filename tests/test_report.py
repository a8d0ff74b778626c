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
    mean, std, n = report.summarize(rows)["nonoverlapping"]["alibi"][256]
    assert (round(mean, 6), round(std, 6), n) == (2.01, 0.01, 3)
    assert "2.010 ± 0.010" in report.markdown_table(rows, "nonoverlapping")


ARTICLE_WORLD = {  # a world where every claim holds
    "alibi": (6.5, 6.4, 6.45), "rope/none": (6.4, 9.0, 15.0), "rope/ntk": (6.4, 6.6, 7.0),
    "rope/pi": (6.4, 8.0, 9.0), "t5": (6.45, 12.0, 30.0), "sinusoidal": (7.0, 20.0, 40.0),
    "learned": (6.9, math.nan, math.nan),
}


def test_claims_hold_where_they_should():
    verdicts = {c["claim"][:2]: c["holds"] for c in report.claims(rows_from(ARTICLE_WORLD), "nonoverlapping")}
    assert verdicts["1."] == {"a": True, "b": True}
    assert verdicts["2."]["all lengths"] is True
    assert verdicts["3."] == {"worse than RoPE": True, "worse than ALiBi": True}
    assert verdicts["AL"]["ALiBi never breaks"] and verdicts["AL"]["sinusoidal first"]


def test_claims_fail_where_they_should():
    world = dict(ARTICLE_WORLD, alibi=(6.3, 8.0, 20.0), t5=(6.45, 6.5, 6.6), **{"rope/pi": (6.4, 6.5, 6.6)})
    verdicts = {c["claim"][:2]: c["holds"] for c in report.claims(rows_from(world), "nonoverlapping")}
    assert verdicts["1."] == {"a": False, "b": False}
    assert verdicts["2."]["all lengths"] is False
    assert verdicts["3."] == {"worse than RoPE": False, "worse than ALiBi": False}
    assert verdicts["AL"]["ALiBi never breaks"] is False


def test_breaking_length():
    s = report.summarize(rows_from({"x": (1.0, 1.05, 1.2)}))["nonoverlapping"]
    assert report.breaking_length(s, "x") == 512
    assert report.breaking_length(s, "x", tolerance=1.5) is None


def test_readme_headline_tables_are_the_committed_results():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rows, _, _ = report.load(root / "results" / "cpu")
    readme = (root / "README.md").read_text()
    for mode in ("nonoverlapping", "sliding"):
        assert report.markdown_table(rows, mode) in readme, f"README's {mode} table differs from results/cpu"
