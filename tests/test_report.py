"""The report: summaries over seeds and the claims' verdicts, on synthetic rows with known answers."""

import math

import numpy as np
import pytest
from scipy import stats
from tables import rows_from

from posenc_lab import PosencError
from posenc_lab.lab.measure import budget
from posenc_lab.lab.verdicts import claims, statistics, tables as report


def test_summary_mean_and_std_over_seeds():
    rows = rows_from({"alibi": (2.0, 2.0, 2.0)}, seeds=(0, 1, 2), noise=0)
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


def test_document_bootstrap_brackets_the_value_and_spans_the_documents():
    rows = []
    for seed in (0, 1):
        for doc, loss in enumerate((1.0, 2.0, 3.0, 1.5)):
            rows.append({"encoding": "alibi", "strategy": "-", "seed": seed, "eval_len": 128,
                         "eval_mode": "nonoverlapping", "document": f"d{doc}", "tokens": 100 * (doc + 1),
                         "loss": loss + 0.1 * seed})
    out = report.document_bootstrap(rows, resamples=500).iloc[0]
    # by hand: token-weighted loss per seed, averaged over seeds
    by_hand = np.mean([(100 * 1.0 + 200 * 2.0 + 300 * 3.0 + 400 * 1.5) / 1000 + 0.1 * s for s in (0, 1)])
    assert out["perplexity"] == pytest.approx(math.exp(by_hand))
    assert out["low"] < out["perplexity"] < out["high"] and out["documents"] == 4
    assert out["doc_min"] == pytest.approx(math.exp(1.05)) and out["doc_max"] == pytest.approx(math.exp(3.05))


def _checkpoint_rows():
    """Two budgets: at the first T5 grows more than RoPE past L, at the second less."""
    rows = []
    growth = {100: {"t5": 2.0, "rope": 1.5, "alibi": 1.0}, 200: {"t5": 1.2, "rope": 1.6, "alibi": 1.0}}
    for step, by_enc in growth.items():
        for seed in (0, 1, 2):
            rng = np.random.default_rng(step * 10 + seed)
            for enc, g in by_enc.items():
                base = 8.0 - step / 100 + 0.05 * rng.standard_normal()
                for length, ppl in ((128, base), (512, base * g * (1 + 0.01 * rng.standard_normal()))):
                    rows.append({"encoding": enc, "strategy": "none" if enc == "rope" else "-", "seed": seed,
                                 "step": step, "tokens_seen": step * 1000, "eval_len": length,
                                 "eval_mode": "nonoverlapping", "status": "ok", "perplexity": ppl})
    return rows


def test_budget_verdicts_show_where_a_verdict_flips():
    table = budget.budget_verdicts(_checkpoint_rows())
    assert list(table.columns) == [0.1, 0.2]
    assert table.loc["3: clearly worse than RoPE"].tolist() == ["holds", "fails"]
    # one length past L (4x) cannot order "sinusoidal first, then rotary", nor test T5 up to 2x: those rows
    # are left out and named, not shown as verdicts; ALiBi's flatness needs only the lengths measured
    left_out = ["ordering: sinusoidal breaks first, then rotary", "ordering: T5 holds to about 2x"]
    assert set(left_out) <= set(table.attrs["left out"]) and not set(left_out) & set(table.index)
    assert table.loc["ordering: ALiBi stays flat"].tolist() == ["holds", "holds"]


def _ordering_rows(lengths):
    """Sinusoidal, RoPE, T5 and ALiBi with growths that make the ALiBi paper's order clear at every length."""
    growth = {"sinusoidal": 3.0, "rope": 1.6, "t5": 1.02, "alibi": 1.0}
    rows = []
    for seed in (0, 1, 2):
        rng = np.random.default_rng(seed)
        for enc, g in growth.items():
            for length in lengths:
                factor = 1.0 if length == lengths[0] else g ** math.log2(length / lengths[0]) / 2 + 0.5
                rows.append({"encoding": enc, "strategy": "none" if enc == "rope" else "-", "seed": seed,
                             "train_len": lengths[0], "eval_len": length, "eval_mode": "nonoverlapping",
                             "status": "ok", "perplexity": 8.0 * factor * (1 + 0.002 * rng.standard_normal())})
    return rows


def test_budget_comparisons_are_one_family_with_adjusted_p():
    table = budget.budget_comparisons(_checkpoint_rows())
    assert set(table["tokens (M)"]) == {0.1, 0.2} and {"p", "p holm", "p BH", "survives"} <= set(table.columns)
    assert table["p BH"].tolist() == pytest.approx(statistics.bh(table["p"]))
    t5 = table[(table.claim == "3: clearly worse than RoPE") & (table["tokens (M)"] == 0.1)].iloc[0]
    assert t5["ratio"] == pytest.approx(2.0 / 1.5, rel=0.05)  # growth 2.0 against 1.5


def test_headline_shows_each_mode_and_the_decision():
    rows = _ordering_rows((128, 256, 512))
    rows += [dict(r, eval_mode="sliding") for r in rows]
    text = report.headline(rows, judged_len=512)
    assert "| claim (judged at 512) | sliding (primary) | non-overlapping (sensitivity) | decided |" in text
    assert "| ordering: ALiBi stays flat | holds | holds | holds |" in text


def test_an_order_needs_two_lengths_past_the_training_length():
    """With one length past L, "sinusoidal breaks first, then rotary" is not judged (no data) and "T5 holds to
    about 2x" has no 2x to be judged at; with two, the same numbers decide them: T5 here grows 2 % by 4x, so it
    has not stopped holding there, and the claim that it holds to about 2x (and no further) fails."""
    one = {c["id"]: c for c in claims.claims(_ordering_rows((128, 512)), "nonoverlapping", judged_len=512)}
    two = {c["id"]: c for c in claims.claims(_ordering_rows((128, 256, 512)), "nonoverlapping", judged_len=512)}
    assert one["ordering"]["verdicts"]["sinusoidal breaks first, then rotary"] == "no data"
    assert one["ordering"]["verdicts"]["T5 holds to about 2x"] == "no data"
    assert two["ordering"]["verdicts"]["sinusoidal breaks first, then rotary"] == "holds"
    assert two["ordering"]["verdicts"]["T5 holds to about 2x"] == "fails"
    growth = budget.budget_growth(_checkpoint_rows(), 512)
    t5 = growth[(growth.label == "t5") & (growth.step == 100)]["growth"]
    assert t5.mean() == pytest.approx(2.0, rel=0.05) and len(t5) == 3


def test_budget_curves_draw_both_panels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posenc_lab.lab.figures import plots

    fig, axes = plt.subplots(1, 2)
    plots.budget_curves(_checkpoint_rows(), axes)
    assert len(axes[0].lines) >= 3 and "growth" in axes[1].get_ylabel()
    plt.close(fig)


def _power_law_rows(laws, steps=(50, 100, 200, 300, 400, 500, 600, 700), tokens_per_step=4096, noise=0.0):
    rows = []
    for step in steps:
        t = step * tokens_per_step
        for seed in (0, 1, 2):
            rng = np.random.default_rng(step * 7 + seed)
            for enc, (floor, scale, exponent) in laws.items():
                loss = floor + scale * (t / 1e6) ** -exponent + noise * rng.standard_normal()
                rows.append({"encoding": enc, "strategy": "none" if enc == "rope" else "-", "seed": seed,
                             "step": step, "tokens_seen": t, "eval_len": 128, "eval_mode": "nonoverlapping",
                             "status": "ok", "loss": loss, "perplexity": math.exp(loss)})
    return rows


def test_budget_extrapolation_recovers_known_power_laws_and_their_crossing():
    laws = {"rope": (1.0, 0.6, 0.5), "t5": (1.02, 1.5, 0.45)}
    out = budget.budget_extrapolation(_power_law_rows(laws), ["rope/none", "t5"], within=0.10)
    fits = out["fits"].set_index("label")
    for name, (floor, scale, exponent) in zip(["rope/none", "t5"], laws.values()):
        assert fits.loc[name, "floor"] == pytest.approx(floor, rel=1e-3)
        assert fits.loc[name, "exponent"] == pytest.approx(exponent, rel=1e-3)
    # by hand: the first t (millions) where (1.02 + 1.5 t^-0.45) - (1 + 0.6 t^-0.5) <= log(1.1)
    grid = np.geomspace(2.8672, 2867.2, 200001)
    gap = (1.02 + 1.5 * grid ** -0.45) - (1.0 + 0.6 * grid ** -0.5)
    assert gap[0] > math.log(1.1) and gap[-1] < math.log(1.1)
    want = grid[np.argmax(gap <= math.log(1.1))]
    assert out["tokens_m"] == pytest.approx(want, rel=0.01)
    assert out["gap_now"] == pytest.approx(math.exp(1.02 + 1.5 * 2.8672 ** -0.45 - 1 - 0.6 * 2.8672 ** -0.5) - 1, rel=1e-6)


def test_budget_extrapolation_says_never_when_the_floors_differ_by_more_than_the_target():
    laws = {"rope": (1.0, 0.6, 0.5), "t5": (1.2, 1.5, 0.4)}  # floors exp(0.2) - 1 = 22 % apart
    out = budget.budget_extrapolation(_power_law_rows(laws), ["rope/none", "t5"], within=0.10)
    assert out["tokens_m"] is None and out["gap_at_horizon"] > 0.10
    with pytest.raises(PosencError, match="no checkpoint evaluations at the training length for alibi"):
        budget.budget_extrapolation(_power_law_rows(laws), ["alibi"])
    with pytest.raises(PosencError, match="a three-parameter fit needs at least 4"):
        budget.budget_extrapolation(_power_law_rows(laws, steps=(100, 200, 300)), ["t5"])


def test_budget_spread_follows_the_gap_checkpoint_by_checkpoint():
    laws = {"rope": (1.0, 0.6, 0.5), "t5": (1.02, 1.5, 0.45)}
    rows = _power_law_rows(laws)
    table = budget.budget_spread(rows, ["rope/none", "t5"])
    assert list(table.columns) == ["rope/none", "t5", "spread"] and len(table) == 8
    for t, row in table.iterrows():  # by hand: exp of each law at t, then max/min - 1
        rope, t5 = math.exp(1.0 + 0.6 * t ** -0.5), math.exp(1.02 + 1.5 * t ** -0.45)
        assert row["rope/none"] == pytest.approx(rope) and row["t5"] == pytest.approx(t5)
        assert row["spread"] == pytest.approx(max(rope, t5) / min(rope, t5) - 1)
    assert table["spread"].is_monotonic_decreasing  # t5's larger scale decays: the gap closes
    out = budget.budget_extrapolation(rows, ["rope/none", "t5"])
    assert table["spread"].iloc[-1] == pytest.approx(out["gap_now"])
    without = [r for r in rows if not (r["encoding"] == "t5" and r["step"] == 700)]
    assert len(budget.budget_spread(without, ["rope/none", "t5"])) == 7  # a checkpoint lacking a label is left out
    with pytest.raises(PosencError, match="for alibi"):
        budget.budget_spread(rows, ["alibi", "t5"])


def test_direction_reads_what_a_verdict_says():
    assert statistics.direction("holds") == "holds" and statistics.direction("no data") == "no data"
    assert statistics.direction("not resolved (the means point to fails)") == "fails"
    assert statistics.direction("not resolved (resolved, under 1 %)") == "unclear"


def test_verdicts_side_by_side_say_which_changed():
    """Two runs that differ only in how much sinusoidal grows: its part of the ordering changes, ALiBi's does not."""
    a = _ordering_rows((128, 256, 512))
    b = [dict(r, perplexity=r["perplexity"] / 3 if r["encoding"] == "sinusoidal" and r["eval_len"] > 128
              else r["perplexity"]) for r in a]
    side = report.verdicts_side_by_side({"short": a, "long": b}, mode="nonoverlapping", judged_len=512)
    assert list(side.columns) == ["short", "long", "same verdict", "same direction"]
    first = side.loc["ordering: sinusoidal breaks first, then rotary"]
    assert first["short"] == "holds" and first["long"] != "holds" and not first["same verdict"]
    assert side.loc["ordering: ALiBi stays flat", "same verdict"]
    assert (side.loc["2: ntk most accurate", ["short", "long"]] == "no data").all()  # no strategies in these rows


def test_spread_at_training_length_is_max_over_min_of_the_seed_means():
    rows = [{"encoding": enc, "strategy": "-", "seed": seed, "train_len": 64, "eval_len": 64,
             "eval_mode": "nonoverlapping", "status": "ok", "perplexity": base + 0.1 * seed}
            for enc, base in (("alibi", 5.0), ("t5", 6.0)) for seed in (0, 1, 2)]
    out = report.spread_at_training_length(rows, ["alibi", "t5"])
    assert out["means"] == pytest.approx({"alibi": 5.1, "t5": 6.1})
    assert out["spread"] == pytest.approx(6.1 / 5.1 - 1) and out["train_len"] == 64
    with pytest.raises(PosencError, match="sinusoidal"):
        report.spread_at_training_length(rows, ["alibi", "sinusoidal"])


def test_versus_is_the_paired_t_test_by_hand_and_names_the_resolved_side():
    rows = [{"encoding": enc, "strategy": "-", "seed": seed, "train_len": 64, "eval_len": n,
             "eval_mode": "sliding", "status": "ok", "perplexity": base + 0.1 * seed + (0.05 * seed ** 2 if enc == "a" else 0)}
            for enc, base in (("a", 5.0), ("b", 6.0)) for seed in (0, 1, 2, 3) for n in (64, 128)]
    rows += [dict(r, encoding="c", eval_len=64) for r in rows if r["encoding"] == "b" and r["eval_len"] == 64]
    out = report.versus(rows, [("a", "b"), ("c", "b")], mode="sliding")
    assert list(out[["a", "eval_len"]].itertuples(index=False, name=None)) == [("a", 64), ("a", 128), ("c", 64)]
    d = np.array([math.log((5.0 + 0.1 * s + 0.05 * s * s) / (6.0 + 0.1 * s)) for s in range(4)])  # log ratios
    t = d.mean() / (d.std(ddof=1) / math.sqrt(4))
    first = out.iloc[0]
    assert first["test"] == "paired" and first["sign"] == "<"
    assert first["p"] == pytest.approx(2 * stats.t.sf(abs(t), 3))
    assert first["ratio"] == pytest.approx(math.exp(d.mean())) and first["relative"] == pytest.approx(first["ratio"] - 1)
    half = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert (first["low"], first["high"]) == pytest.approx((math.exp(d.mean() - half), math.exp(d.mean() + half)))
    assert out["p holm"].tolist() == pytest.approx(statistics.holm(out["p"]), nan_ok=True) and "p BH" in out
    two = rows + [dict(r, eval_mode="nonoverlapping") for r in rows]
    both = report.versus(two, [("a", "b")], mode=("sliding", "nonoverlapping"))  # one family over both modes
    assert sorted(set(both["mode"])) == ["nonoverlapping", "sliding"] and len(both) == 4
    assert both["p holm"].tolist() == pytest.approx(statistics.holm(both["p"]), nan_ok=True)
    assert out.iloc[2]["sign"] == "~" and math.isnan(out.iloc[2]["p"])  # identical values: no spread, no test
    assert report.versus(rows, [("a", "b")], mode="sliding", lengths=[128])["eval_len"].tolist() == [128]
    with pytest.raises(PosencError, match="no rows for zz"):
        report.versus(rows, [("a", "zz")], mode="sliding")


def test_against_baselines_counts_only_resolved_differences_of_one_percent_and_says_them():
    """``lower``/``higher`` need a paired test resolved after Benjamini-Hochberg over the table and a 1 % difference;
    the sentence lists each outcome with its ratios, lowest first."""
    from posenc_lab.lab.verdicts import in_words

    def rows_of(enc, scale, jitter):
        return [{"encoding": enc, "strategy": "-", "seed": s, "train_len": 64, "eval_len": n, "eval_mode": "sliding",
                 "status": "ok", "perplexity": scale * (5.0 + 0.3 * s) * (1 + jitter * (-1) ** s)}
                for s in (0, 1, 2) for n in (64, 128)]

    rows = (rows_of("alibi", 1.0, 0.0) + rows_of("fox", 0.8, 0.001) + rows_of("cope", 1.25, 0.001)
            + rows_of("fope", 1.005, 0.0001) + rows_of("fire", 1.0, 0.2))
    table = in_words.against_baselines(rows, ["fox", "cope", "fope", "fire"], baselines=["alibi"], modes="sliding")
    outcome = table.set_index(["a", "eval_len"])["outcome"]
    assert outcome[("fox", 64)] == "lower" and outcome[("cope", 128)] == "higher"
    assert outcome[("fope", 64)] == "not resolved"  # resolved, but 0.5 %
    assert outcome[("fire", 64)] == "not resolved"  # 20 % swings over the seeds: nothing resolved
    said = in_words.against_in_words(table.assign(mode="sliding"), "alibi", 128, "sliding")
    assert said == ("Against ALiBi at 128, lower: FoX (0.80); higher: CoPE (1.25); not resolved: FoPE, FIRE.")
    with pytest.raises(ValueError, match="no comparison with alibi at 256"):
        in_words.against_in_words(table, "alibi", 256)


def test_accuracy_vs_length_draws_each_labels_seed_mean_and_range():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from posenc_lab.lab.figures import plots

    def row(encoding, seed, eval_len, correct):
        return {"encoding": encoding, "strategy": "-", "seed": seed, "train_len": 64, "eval_len": eval_len,
                "depth": 0.5, "status": "ok", "correct": correct, "trials": 10, "train_accuracy": 1.0}

    rows = [row(e, s, n, c) for e, base in (("alibi", 9), ("fox", 5)) for s in (0, 1, 2)
            for n, c in ((64, base), (128, base - s), (256, s))]
    fig, ax = plt.subplots()
    plots.accuracy_vs_length(rows, ax, labels=["fox", "alibi"])
    drawn = [line for line in ax.get_lines() if len(line.get_xdata())]  # the legend's handles hold no data
    colour = {matplotlib.colors.to_hex(plots.style(n)["color"]): n for n in ("fox", "alibi")}
    lines = {colour[matplotlib.colors.to_hex(line.get_color())]: line for line in drawn}
    assert len(drawn) == 2 and set(lines) == {"fox", "alibi"}
    np.testing.assert_allclose(lines["fox"].get_xdata(), [1, 2, 4])
    np.testing.assert_allclose(lines["fox"].get_ydata(), [0.5, 0.4, 0.1])  # seeds 0.5, (0.5, 0.4, 0.3), (0, .1, .2)
    np.testing.assert_allclose(lines["alibi"].get_ydata(), [0.9, 0.8, 0.1])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1x", "2x", "4x"]
    with pytest.raises(ValueError, match="no retrieval rows for cope"):
        plots.accuracy_vs_length(rows, ax, labels=["cope"])
    plt.close(fig)


def test_every_method_the_book_draws_has_a_colour_of_its_own():
    """Two lines of one figure never share a colour: every encoding and RoPE strategy the chapters draw has a fixed,
    distinct colour, the methods past the softmax included."""
    from posenc_lab.lab.figures import plots

    named = plots._DISTINCT
    assert len(set(named.values())) == len(named)
    for name in ("stick-breaking", "path", "path-fox", "dape-alibi", "dape-kerple", "dape-fire"):
        assert name in named and plots.style(name)["color"] == named[name]
