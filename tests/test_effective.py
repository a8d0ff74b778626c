"""The effective context length (RULER, NoLiMa): each expected value below is worked out by hand from the table
it is computed on."""

import math

import pandas as pd
import pytest

from posenc_lab import PosencError
from posenc_lab.lab.measure import effective_length


def retrieval_rows(cells, *, task="digits", encoding="alibi", strategy="-", seed=0, train_len=128):
    """Rows of a retrieval run: ``cells`` maps a length to a list of ``(correct, trials)``, one per depth, or to
    the string ``cannot extrapolate``."""
    rows = []
    for length, depths in cells.items():
        if depths == "cannot extrapolate":
            depths = [(0, 0)]
            status = "cannot extrapolate"
        else:
            status = "ok"
        for i, (correct, trials) in enumerate(depths):
            rows.append({"task": task, "encoding": encoding, "strategy": strategy, "seed": seed,
                         "train_len": train_len, "eval_len": length, "depth": i / max(1, len(depths) - 1),
                         "status": status, "trials": trials, "correct": correct,
                         "accuracy": correct / trials if trials else math.nan, "train_accuracy": 1.0})
    return rows


def gain_rows(gains, *, encoding="rope", strategy="yarn", seed=0, train_len=512):
    """Rows of a context run's gain table: ``gains`` maps a length to the far-context gain (nats), or to ``None``
    for a length the model cannot run at."""
    return [{"encoding": encoding, "strategy": strategy, "seed": seed, "train_len": train_len, "eval_len": n,
             "reach": train_len, "status": "ok" if g is not None else "cannot extrapolate",
             "gain": g if g is not None else math.nan} for n, g in gains.items()]


def only(table, column="effective_len"):
    assert len(table) == 1
    value = table[column].iloc[0]
    return None if pd.isna(value) else value


# --------------------------------------------------------------------------------------------- the rules


def test_the_first_failure_stops_the_count_even_if_a_longer_length_keeps_again():
    assert effective_length.first_failure(128, [(128, True), (256, True), (512, False), (1024, True)]) == 256


def test_the_effective_length_is_L_itself_when_the_first_longer_length_fails():
    assert effective_length.first_failure(128, [(1024, True), (256, False), (512, True)]) == 128
    assert effective_length.first_failure(512, []) == 512


def test_a_model_that_keeps_everywhere_reaches_the_longest_evaluated_length():
    assert effective_length.first_failure(128, [(512, True), (128, True), (1024, True), (256, True)]) == 1024


def test_the_score_is_pooled_over_depths_and_compared_with_the_seeds_own_score_at_L():
    # at L: (50 + 30) / 200 = 0.40, so keeping needs 0.34; at 256: (40 + 30) / 200 = 0.35 keeps;
    # at 512: (10 + 56) / 200 = 0.33 fails although one depth is higher than at L
    rows = retrieval_rows({128: [(50, 100), (30, 100)], 256: [(40, 100), (30, 100)],
                           512: [(10, 100), (56, 100)], 1024: [(100, 100), (100, 100)]})
    table = effective_length.retrieval_seeds(rows)
    assert only(table, "score_at_L") == pytest.approx(0.40)
    assert only(table) == 256


def test_a_score_of_exactly_85_percent_of_the_score_at_L_keeps_it():
    # 140 / 500 at L; 85 % of it is 119 / 500 exactly (in floating point 119/500 < 0.85 * 140/500)
    keeps = retrieval_rows({128: [(140, 500)], 256: [(119, 500)], 512: [(118, 500)]})
    assert only(effective_length.retrieval_seeds(keeps)) == 256


def test_one_window_under_85_percent_fails():
    # 100 / 100 at L needs 85 / 100: 84 fails at the first longer length, so the effective length is L
    rows = retrieval_rows({128: [(100, 100)], 256: [(84, 100)], 512: [(100, 100)]})
    assert only(effective_length.retrieval_seeds(rows)) == 128


def test_a_length_the_model_cannot_run_at_is_a_failure():
    rows = retrieval_rows({128: [(90, 100)], 256: [(90, 100)], 512: "cannot extrapolate"}, encoding="learned")
    assert only(effective_length.retrieval_seeds(rows)) == 256


# --------------------------------------------------------------------------------------------- chance at L


def test_a_score_at_L_that_is_chance_is_flagged_and_has_no_effective_length():
    # multikey: chance is copying one of the four keys, 1/4. 130 / 500 = 0.26 is 0.5 standard errors above it
    # (sd = sqrt(0.25 * 0.75 / 500) = 0.019): not above chance, although it "keeps" 100 % of itself at 1024
    rows = retrieval_rows({128: [(130, 500)], 256: [(130, 500)], 1024: [(130, 500)]}, task="multikey")
    table = effective_length.retrieval_seeds(rows)
    assert bool(table["at_chance"].iloc[0]) and table["p_chance"].iloc[0] > 0.05
    assert only(table) is None


def test_a_low_score_clearly_above_chance_still_gets_an_effective_length():
    # 150 / 500 = 0.30 is 2.6 standard errors above 1/4 (one-sided p about 0.005); 85 % of it is 127.5 / 500
    rows = retrieval_rows({128: [(150, 500)], 256: [(128, 500)], 512: [(127, 500)]}, task="multikey")
    table = effective_length.retrieval_seeds(rows)
    assert not table["at_chance"].iloc[0] and table["p_chance"].iloc[0] < 0.01
    assert only(table) == 256


def test_no_correct_window_at_L_is_chance_for_every_task():
    for task in ("content", "digits", "multikey"):
        table = effective_length.retrieval_seeds(retrieval_rows({128: [(0, 100)], 256: [(0, 100)]}, task=task))
        assert bool(table["at_chance"].iloc[0]) and only(table) is None


def test_the_chance_levels_are_the_guesses_each_task_allows():
    assert effective_length.CHANCE == pytest.approx({"content": 1e-4, "digits": 1e-5, "multikey": 0.25})


# --------------------------------------------------------------------------------------------- the far context


def test_the_far_context_keeps_while_the_gain_is_not_below_minus_one_percent():
    floor = math.log(1.01)
    rows = gain_rows({1024: 0.02, 2048: -floor, 8192: -floor - 1e-6})
    assert only(effective_length.gain_seeds(rows)) == 2048
    assert only(effective_length.gain_seeds(rows, floor=0.0)) == 1024  # "not negative" read literally


def test_a_far_context_that_hurts_at_the_first_length_gives_L():
    rows = gain_rows({1024: -0.05, 2048: 0.1, 8192: 0.1})
    assert only(effective_length.gain_seeds(rows)) == 512


def test_a_model_that_cannot_run_past_L_has_effective_length_L():
    rows = gain_rows({1024: None, 2048: None}, encoding="learned", strategy="-")
    assert only(effective_length.gain_seeds(rows)) == 512


def test_two_gain_rows_for_one_seed_and_length_are_refused():
    with pytest.raises(PosencError, match="two runs mixed"):
        effective_length.gain_seeds(gain_rows({1024: 0.1}) * 2)


# --------------------------------------------------------------------------------------------- over seeds


def per_seed_table():
    """Four seeds of rope/yarn: effective lengths 256, 1024, 512 and one at chance; two seeds of alibi that agree."""
    rows = [{"run": "r", "measure": "digits", "label": "rope/yarn", "seed": s, "train_len": 128, "at_chance": n is None,
             "effective_len": n} for s, n in enumerate([256, 1024, 512, None])]
    rows += [{"run": "r", "measure": "digits", "label": "alibi", "seed": s, "train_len": 128, "at_chance": False,
              "effective_len": 256} for s in range(2)]
    table = pd.DataFrame(rows)
    table["effective_len"] = table["effective_len"].astype("Int64")
    return table


def test_the_seeds_are_summarised_by_median_min_and_max_without_the_seeds_at_chance():
    s = effective_length.summary(per_seed_table()).loc[("r", "digits", "rope/yarn")]
    assert (s["seeds"], s["at_chance"], s["median"], s["low"], s["high"]) == (4, 1, 512, 256, 1024)


def test_the_median_of_an_even_count_is_the_lower_middle_length():
    two = per_seed_table().query("label == 'rope/yarn' and seed in (0, 1)")
    assert effective_length.summary(two).loc[("r", "digits", "rope/yarn"), "median"] == 256


def test_the_table_cell_shows_median_range_and_the_seeds_at_chance():
    table = effective_length.book_table(per_seed=per_seed_table())
    column = effective_length.column_title("r", "digits", 128)
    assert table.loc["rope/yarn", column] == "512 [256–1024] (1/4 at chance)"
    assert table.loc["alibi", column] == "256"
    assert "| rope/yarn | 512 [256–1024] (1/4 at chance) |" in effective_length.markdown_table(table)


# --------------------------------------------------------------------------------------------- the committed runs


def test_the_book_table_has_every_label_of_every_run_and_only_evaluated_lengths():
    seeds = effective_length.book_seeds()
    table = effective_length.book_table(per_seed=seeds)
    assert set(seeds["run"]) == set(effective_length.retrieval_runs() + effective_length.context_runs())
    for run in effective_length.retrieval_runs():
        rows, _, _ = effective_length.results.load(run)
        labels = {r["encoding"] if r["strategy"] == "-" else f"{r['encoding']}/{r['strategy']}" for r in rows}
        column = effective_length.column_title(run, rows[0].get("task", "content"), rows[0]["train_len"])
        assert all(table.loc[label, column] for label in labels), run
    for run in effective_length.context_runs():
        rows = effective_length.results.read_json(run, "gain.json")
        labels = {r["encoding"] if r["strategy"] == "-" else f"{r['encoding']}/{r['strategy']}" for r in rows}
        column = effective_length.column_title(run, effective_length.FAR_CONTEXT, rows[0]["train_len"])
        assert all(table.loc[label, column] for label in labels), run
        lengths = {r["eval_len"] for r in rows} | {rows[0]["train_len"]}
        assert set(seeds.loc[seeds["run"] == run, "effective_len"].dropna()) <= lengths, run
    measured = seeds.dropna(subset=["effective_len"])
    assert all(n in evaluated for n, evaluated in zip(measured["effective_len"], measured["evaluated"]))
    assert (seeds["effective_len"].isna() == seeds["at_chance"]).all()
