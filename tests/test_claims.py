"""The article's claims as tests of log-scale quantities, on synthetic rows with known answers."""

import math
from pathlib import Path

import numpy as np
import pytest
import tables
from tables import LENGTHS

from posenc_lab import claims, findings, report

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


def test_the_rule_states_scale_floor_and_families():
    for words in ("log scale", "log 1.01", "in both directions", "Holm", "one family", "Benjamini-Hochberg",
                  "Fisher's exact test"):
        assert words in report.RULE, words


def test_claims_hold_where_they_should():
    v = verdicts_of(ARTICLE_WORLD)
    assert v["1."] == {"a (worse at training length)": "holds", "b (most stable)": "holds"}
    assert v["2."] == {"ntk most accurate": "holds", "dynamic-ntk most accurate": "no data",
                       "yarn most accurate (ours)": "no data"}
    assert v["3."] == {"worse than RoPE": "holds", "worse than ALiBi": "holds"}
    assert v["AL"] == {"sinusoidal breaks first": "holds", "then rotary": "holds", "T5 holds to 2x": "holds",
                       "ALiBi stays flat": "holds"}


def test_claims_fail_where_they_should():
    world = dict(ARTICLE_WORLD, alibi=(6.3, 8.0, 20.0), t5=(6.45, 6.5, 6.6), **{"rope/pi": (6.4, 6.5, 6.0)})
    v = verdicts_of(world)
    assert v["1."] == {"a (worse at training length)": "fails", "b (most stable)": "fails"}
    assert v["2."]["ntk most accurate"] == "fails"
    assert v["3."] == {"worse than RoPE": "fails", "worse than ALiBi": "fails"}
    assert v["AL"]["ALiBi stays flat"] == "fails"


def test_claim_2_is_against_every_scheme_and_then_rotary_is_judged():
    assert verdicts_of(dict(ARTICLE_WORLD, **{"rope/ntk": (6.4, 6.6, 7.0)}))["2."]["ntk most accurate"] == "fails"
    assert verdicts_of(dict(ARTICLE_WORLD, **{"rope/none": (6.4, 6.4, 6.45)}))["AL"]["then rotary"] == "fails"


def test_most_stable_means_the_smallest_change_either_way():
    """ALiBi's perplexity falls by 10 % with length while a rival's rises by 3 %: signed, ALiBi grows least;
    by the size of the change the rival is the more stable, and the claim fails."""
    world = {"alibi": (6.5, 6.2, 5.85), "rope/none": (6.4, 6.5, 6.6), "t5": (6.45, 9.0, 12.0)}
    rows = rows_from(world)
    readings = claims.claim_1b_readings(rows, "nonoverlapping", judged_len=512)
    assert readings == {"smallest |log growth| (the book's)": "fails", "smallest log growth (signed)": "holds"}
    assert verdicts_of(world)["1."]["b (most stable)"] == "fails"


def test_one_seed_resolves_nothing_but_reports_the_direction():
    v = verdicts_of(ARTICLE_WORLD, seeds=(0,))
    assert v["1."]["a (worse at training length)"] == "not resolved (the means point to holds)"
    assert all(x.startswith("not resolved") or x == "no data" for c in v.values() for x in c.values())


def test_nothing_to_compare_is_no_data_not_a_verdict():
    v = verdicts_of({k: val for k, val in ARTICLE_WORLD.items() if k != "t5"})
    assert v["3."] == {"worse than RoPE": "no data", "worse than ALiBi": "no data"}


def test_two_modes_are_one_family_decided_once():
    """Each mode alone resolves claim 1a at p just under 0.05; Holm over both modes' comparisons does not."""
    rows = []
    for mode, shift in (("nonoverlapping", 0.0), ("sliding", 0.001)):
        for seed, (a, r) in enumerate([(1.10, 1.00), (1.05, 1.00), (1.12, 1.03)]):
            for name, loss in (("alibi", a), ("rope/none", r)):
                enc, _, strategy = name.partition("/")
                rows += [{"encoding": enc, "strategy": strategy or "-", "seed": seed, "eval_len": n, "eval_mode": mode,
                          "train_len": 128, "loss": loss + shift, "perplexity": math.exp(loss + shift)} for n in LENGTHS]
    per_mode = [claims.claims(rows, m, judged_len=512)[0]["comparisons"]["a (worse at training length)"][0][1]
                for m in ("nonoverlapping", "sliding")]
    assert all(0.025 < c.p < 0.05 for c in per_mode)
    table = report.verdict_table(rows, judged_lens=(512,))
    row = table.loc["1: a (worse at training length)"]
    assert row[("nonoverlapping", 512)] == row[("sliding", 512)] == "holds"  # holds needs no correction ...
    assert row[("both modes", 512)] == "holds"  # ... and holds in both: decided once, holds
    flipped = [dict(r, loss=-r["loss"], perplexity=math.exp(-r["loss"])) for r in rows]  # now against the claim
    row = report.verdict_table(flipped, judged_lens=(512,)).loc["1: a (worse at training length)"]
    assert row[("nonoverlapping", 512)] == "fails" and row[("both modes", 512)].startswith("not resolved")


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
    assert first["claim"] == "1: a (worse at training length)" and first["low"] < first["ratio"] < first["high"]
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

    from posenc_lab import report

    runs = {name: report.load(ROOT / "results" / name)[0] for name in ("article-long", "article-long-b4")}
    side = findings.side_by_side(runs)
    for name, rows in runs.items():
        assert side[(name, "verdict")].to_dict() == claims.decided(rows)
    assert list(side[("all runs", "same verdict")]) == [
        side.loc[c, ("article-long", "verdict")] == side.loc[c, ("article-long-b4", "verdict")] for c in side.index]
    # T5's growth to 2,048 against plain RoPE's (sliding), independently: a paired t-test on the log growths
    df = report.frame(runs["article-long-b4"])
    sliding = df[df.eval_mode == "sliding"]

    def log_growth(label):
        ppl = {n: sliding[(sliding.label == label) & (sliding.eval_len == n)].sort_values("seed").perplexity.to_numpy()
               for n in (512, 2048)}
        return np.log(ppl[2048] / ppl[512])

    t5, rope = log_growth("t5"), log_growth("rope/none")
    expected = scipy_stats.ttest_rel(t5, rope)
    text = side.loc["3: worse than RoPE", ("article-long-b4", "rests on")]
    assert text.startswith(f"t5 / rope/none = ratio {np.exp((t5 - rope).mean()):.3f}") and "(sliding)" in text
    assert f"p = {expected.pvalue:.3g}" in text


def test_deciding_prefers_a_comparison_resolved_against_the_claim():
    from posenc_lab.stats import compare_design

    quiet = compare_design(np.array([1.0, 1.02, 0.99]), np.array([1.0, 1.01, 1.0]))
    against = compare_design(np.array([2.0, 2.1, 2.05]), np.array([1.0, 1.02, 1.01]))
    a = claims.Quantity("level", "a", 512)
    tests = [(claims.Test(a, a, "<"), quiet), (claims.Test(a, a, "<"), against)]
    assert findings.deciding(tests)[1] is against
    assert findings.deciding(tests[:1])[1] is quiet


def test_findings_say_each_decided_verdict_with_the_comparison_it_rests_on():
    rows = report.load(ROOT / "results" / "article-long")[0]
    found = findings.findings(rows)
    assert [f["verdict"] for f in found] == list(claims.decided(rows).values())
    side = findings.side_by_side({"run": rows})
    for f in found:
        rests_on = side.loc[f["part"], ("run", "rests on")]
        assert f"p = {f['p']:.3g}" in rests_on and f["mode"] in rests_on
    text = findings.findings_markdown(rows)
    assert text.count("\n") == len(found) - 1 and "**Holds.**" in text
    assert findings.verdict_in_words("not resolved (the means point to fails)") == "Not resolved (the means lean against it)"


def test_effect_in_words_reads_a_level_and_a_line():
    from posenc_lab.stats import compare_design

    c = compare_design(np.array([2.0, 2.02, 1.98]), np.array([2.2, 2.21, 2.19]))
    level = claims.Test(claims.Quantity("level", "alibi", 512), claims.Quantity("level", "rope/none", 512), "<")
    assert findings.effect_in_words(level, c, 512).startswith(f"ALiBi's perplexity at 512 is {c.ratio:.2f} times RoPE's")
    line = claims.Test(claims.Quantity("growth", "t5", 1024), 1.1, "<")
    assert f"changes by a factor of {c.ratio * 1.1:.3f} from 512 to 1,024" in findings.effect_in_words(line, c, 512)


def test_effect_in_words_says_flatness_as_two_sizes_and_their_difference():
    from posenc_lab.stats import compare_design

    c = compare_design(np.array([0.05, 0.051, 0.049]), np.array([0.01, 0.009, 0.011]), scale="log")
    flat = claims.Test(claims.Quantity("flatness", "alibi", 2048), claims.Quantity("flatness", "t5", 2048), "<")
    text = findings.effect_in_words(flat, c, 512, {"alibi": 0.05, "t5": 0.01})
    assert text == (f"ALiBi's |log growth| to 2,048 is 0.050 against T5's 0.010, a difference of {c.diff:+.3f} "
                    f"[{c.low:+.3f}, {c.high:+.3f}]")
    assert "times" not in text  # a ratio of two sizes of log growth is not what the test compares


def test_side_by_side_domains_hold_each_committed_runs_decided_verdicts():
    """The domains' table of chapter 10 (Python and English prose, the headline recipe) is each run's own."""
    runs = {name: report.load(ROOT / "results" / name)[0] for name in ("article-long-b4", "prose-long-b4")}
    side = findings.side_by_side(runs)
    for name, rows in runs.items():
        assert side[(name, "verdict")].to_dict() == claims.decided(rows)
