"""Every claim verdict of the committed headline runs, recomputed from their results.csv under the declared analysis
(book/analysis.md) with numpy, pandas, scipy.stats and statsmodels only, against the package's verdict table (which
the generated per-run READMEs and chapter 10 print).

The rule, written out here without the package's claims/findings/stats code: per-seed values on the log scale
(a level is the loss in nats, a log growth is loss(L') - loss(512)); two labels are compared by scipy's paired t-test
over the seeds, a log growth and a line (the break, growth 1.10) by a one-sample t-test; two-sided at 0.05; a
difference counts only at |d| >= log 1.01. "slightly" and "clearly" are tests against the margin log 1.10, "stays
flat" a TOST against +-log 1.05. A part fails when a comparison counts against it after Holm over every comparison
of the part, holds when every comparison counts for it, and is
otherwise equal within 1 % (TOST within the floor) or not resolved (inside the floor, or too few seeds). Both
modes are judged; decided is the sliding verdict unless the two modes resolve opposite ways (mode-dependent). Also
checked: the TOST p against statsmodels' ttost_paired, and the package's 80 %-power smallest resolved effect against
statsmodels' TTestPower (and scipy's noncentral t)."""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from posenc_lab.lab.verdicts import tables

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("article-long-b4", "article-long", "prose-long-b4", "prose-long")
ALPHA, FLOOR, L, N = 0.05, math.log(1.01), 512, 2048
BREAK = SLIGHT = CLEAR = math.log(1.10)
FLAT = math.log(1.05)
MODES = ("sliding", "nonoverlapping")


def results(run):
    df = pd.read_csv(ROOT / "results" / run / "results.csv")
    return df.assign(label=np.where(df.strategy == "-", df.encoding, df.encoding + "/" + df.strategy))


def level(df, mode, name, n):
    return df[(df.eval_mode == mode) & (df.label == name) & (df.eval_len == n)].set_index("seed")["loss"].sort_index()


def growth(df, mode, name, n):
    return level(df, mode, name, n) - level(df, mode, name, L)


def p_of(a, b, null=0.0, alternative="two-sided"):
    """p of mean(a - b) = null: paired over the seeds when b is a Series, one-sample against the line b otherwise."""
    if isinstance(b, pd.Series):
        assert list(a.index) == list(b.index), "a paired comparison needs the same seeds"
        return float(stats.ttest_rel(a - null, b, alternative=alternative).pvalue)
    return float(stats.ttest_1samp(a, b + null, alternative=alternative).pvalue)


def tost(a, b, m):
    """Two one-sided tests of |mean(a - b)| < m at once: the larger one-sided p."""
    return max(p_of(a, b, -m, "greater"), p_of(a, b, m, "less"))


@dataclass
class Cmp:
    kind: str  # "direction", "slightly", "clearly" or "equivalent"
    a: pd.Series
    b: object  # a Series (paired) or a number (a line, on the log scale)
    want: str = ""  # "<" or ">" for a direction

    @property
    def present(self):
        return len(self.a) > 0 and (not isinstance(self.b, pd.Series) or len(self.b) > 0)

    @property
    def d(self):
        return float(np.mean(self.a - self.b))

    def p(self, null=0.0):
        return p_of(self.a, self.b, null)

    def counts_for(self):
        d = self.d
        if self.kind == "direction":
            return self.p() < ALPHA and abs(d) >= FLOOR and (d < 0 if self.want == "<" else d > 0)
        if self.kind == "slightly":  # counts above 0, and the 95 % interval's upper end below log 1.10
            return FLOOR <= d < SLIGHT and max(self.p(), self.p(SLIGHT)) < ALPHA
        if self.kind == "clearly":  # the 95 % interval's lower end above log 1.10
            return d > CLEAR and self.p(CLEAR) < ALPHA
        return abs(d) < FLAT and tost(self.a, self.b, FLAT) < ALPHA  # equivalent: the 90 % interval inside +-m

    def against_p(self):
        """The p of the case against the claim (every comparison has one: Holm counts them all) and whether this
        comparison's estimate lies on the side against the claim, by at least the floor or beyond the margin."""
        d = self.d
        if self.kind == "direction":
            return self.p(), (d > 0 if self.want == "<" else d < 0) and abs(d) >= FLOOR
        if self.kind == "slightly":  # counts below 0, or worse but not slightly (lower end above log 1.10)
            return (self.p(SLIGHT), True) if d > SLIGHT else (self.p(), d < 0 and abs(d) >= FLOOR)
        if self.kind == "clearly":  # worse but not clearly (the upper end below log 1.10), or better
            return self.p(CLEAR), d < CLEAR
        return self.p(math.copysign(FLAT, d)), abs(d) > FLAT  # the 95 % interval wholly outside +-m


def verdict(cs):
    """One part's verdict. Holm's correction runs over every comparison of the part (its m counts them all, as
    book/analysis.md says: "after Holm's correction over the part"); a comparison fails the part when its adjusted p
    is below alpha and its estimate lies against the claim."""
    cs = [c for c in cs if c.present]
    if not cs:
        return "no data"
    against = [c.against_p() for c in cs]
    adjusted = multipletests([q for q, _ in against], method="holm")[1]
    if any(side and q < ALPHA for (_, side), q in zip(against, adjusted)):
        return "fails"
    rest = [c for c in cs if not c.counts_for()]
    if not rest:
        return "holds"
    if all(c.kind == "direction" and isinstance(c.b, pd.Series) and tost(c.a, c.b, FLOOR) < ALPHA for c in rest):
        return "equal within 1 %"
    if all(abs(c.d) < FLOOR for c in rest):
        return "not resolved (inside the floor)"
    return "not resolved (too few seeds)"


def parts(df, mode):
    """Each claim part's comparisons in one mode, judged at N = 2048 (the orderings at the lengths in (L, N])."""
    at_n = df[(df.eval_mode == mode) & (df.eval_len == N)]
    runs = sorted(x for x in set(at_n.label) if "+ft" not in x)
    encs = [x for x in runs if "/" not in x or x == "rope/none"]
    beyond = sorted(n for n in set(df[df.eval_mode == mode].eval_len) if L < n <= N)  # here 1024 and 2048
    first, last = beyond[0], beyond[-1]
    v, g = (lambda x, n=N: level(df, mode, x, n)), (lambda x, n=N: growth(df, mode, x, n))
    D = lambda a, b, want: Cmp("direction", a, b, want)  # noqa: E731
    out = {"1: a (slightly worse at training length)": [Cmp("slightly", v("alibi", L), v("rope/none", L))],
           "1: b (most stable)": [D(g("alibi"), g(x), "<") for x in encs if x != "alibi"]}
    scaled = ("rope/ntk", "rope/dynamic-ntk")
    for s in scaled:
        out[f"2: {s[5:]} most accurate"] = [D(v(s), v(r), "<") for r in runs if r not in scaled]
    out["2: yarn most accurate (ours)"] = [D(v("rope/yarn"), v(r), "<") for r in runs if r != "rope/yarn"]
    out["3: clearly worse than RoPE"] = [Cmp("clearly", g("t5"), g("rope/none"))]
    out["3: clearly worse than ALiBi"] = [Cmp("clearly", g("t5"), g("alibi"))]
    out["ordering: sinusoidal breaks first, then rotary"] = (
        [D(g("sinusoidal", first), BREAK, ">")]
        + [D(g("sinusoidal", first), g(o, first), ">") for o in ("rope/none", "t5", "alibi")]
        + [D(g("rope/none", last), BREAK, ">")])
    out["ordering: T5 holds to about 2x"] = [D(g("t5", first), BREAK, "<"), D(g("t5", last), BREAK, ">")]
    out["ordering: ALiBi stays flat"] = [Cmp("equivalent", g("alibi", n), 0.0) for n in beyond]
    return out


def decided(sliding, nonoverlapping):
    resolved_for = lambda v: v == "holds" or v.startswith("equal within")  # noqa: E731
    if (resolved_for(sliding) and nonoverlapping == "fails") or (sliding == "fails" and resolved_for(nonoverlapping)):
        return "mode-dependent"
    return sliding


def independent(df):
    """{(part, column): verdict} for the columns ("sliding", N), ("nonoverlapping", N), ("decided", N)."""
    mine = {}
    for mode in MODES:
        mine.update({(part, (mode, N)): verdict(cs) for part, cs in parts(df, mode).items()})
    for part in parts(df, "sliding"):
        mine[(part, ("decided", N))] = decided(mine[(part, ("sliding", N))], mine[(part, ("nonoverlapping", N))])
    return mine


def disagreements(rows):
    """Where the package's verdict table and the recomputation differ, one line each; and the recomputed verdicts."""
    df = rows.assign(label=np.where(rows.strategy == "-", rows.encoding, rows.encoding + "/" + rows.strategy))
    table = tables.verdict_table(rows, modes=MODES, judged_lens=(N,))
    mine = independent(df)
    assert len(mine) == 3 * 10 and table.shape == (10, 3)
    assert set(table.index) == {part for part, _ in mine}, sorted(set(table.index) ^ {part for part, _ in mine})
    return [f"{part} [{col[0]}]: scipy {v!r}, package {table.loc[part, col]!r}"
            for (part, col), v in mine.items() if table.loc[part, col] != v], set(mine.values())


@pytest.mark.parametrize("run", RUNS)
def test_every_claim_verdict_agrees_with_the_declared_analysis_recomputed_with_scipy(run):
    rows = pd.read_csv(ROOT / "results" / run / "results.csv")
    seeds = results(run).groupby(["label", "eval_mode", "eval_len"]).seed.apply(lambda s: tuple(sorted(s)))
    assert seeds.nunique() == 1, "every label of a headline run has every seed at every length"
    wrong, _ = disagreements(rows)
    assert not wrong, f"{run}: {len(wrong)} disagreement(s):\n" + "\n".join(wrong)


def test_the_rarer_verdicts_agree_on_a_made_up_run():
    """The committed runs never read equal within 1 %, inside the floor, mode-dependent or no data. Here they do:
    article-long-b4 without RoPE with YaRN, its non-overlapping losses shrunk to 1 % of their spread about each
    length's and seed's mean over the labels."""
    rows = pd.read_csv(ROOT / "results" / "article-long-b4" / "results.csv")
    rows = rows[(rows.encoding + "/" + rows.strategy) != "rope/yarn"].copy()
    no = rows.eval_mode == "nonoverlapping"
    mean = rows[no].groupby(["eval_len", "seed"]).loss.transform("mean")
    rows.loc[no, "loss"] = mean + 0.01 * (rows.loc[no, "loss"] - mean)
    wrong, seen = disagreements(rows)
    assert not wrong, f"{len(wrong)} disagreement(s):\n" + "\n".join(wrong)
    assert {"equal within 1 %", "not resolved (inside the floor)", "mode-dependent", "no data"} <= seen


def test_the_equivalence_p_is_statsmodels_tost():
    """ALiBi's log growth to 2048 of the headline run (sliding) against +-log 1.05: scipy's two one-sided tests
    written out above give statsmodels' ttost_paired p."""
    from statsmodels.stats.weightstats import ttost_paired

    df = results("article-long-b4")
    a, b = level(df, "sliding", "alibi", N), level(df, "sliding", "alibi", L)
    p_sm = ttost_paired(a.to_numpy(), b.to_numpy(), -FLAT, FLAT)[0]
    assert tost(a - b, 0.0, FLAT) == pytest.approx(p_sm, rel=1e-10)
    assert tost(a, b, FLAT) == pytest.approx(p_sm, rel=1e-10)


def test_the_smallest_resolved_effect_is_statsmodels_80_percent_power():
    """The package's smallest effect resolved with 80 % power, for a real comparison (ALiBi against RoPE at 2048,
    sliding, five seeds): statsmodels' TTestPower effect size times the sd of the per-seed differences, and at that
    effect scipy's noncentral t gives a power of 0.8."""
    from statsmodels.stats.power import TTestPower

    from posenc_lab.lab.verdicts.statistics import compare_paired, smallest_resolved

    df = results("article-long-b4")
    a, b = level(df, "sliding", "alibi", N), level(df, "sliding", "rope/none", N)
    n, sd = len(a), float(np.std(a - b, ddof=1))
    mde = TTestPower().solve_power(nobs=n, alpha=ALPHA, power=0.8, alternative="two-sided") * sd
    assert n == 5 and smallest_resolved(compare_paired(a, b, scale="log")) == pytest.approx(mde, rel=1e-9)
    nc, crit = mde / sd * math.sqrt(n), stats.t.ppf(1 - ALPHA / 2, n - 1)
    assert stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc) == pytest.approx(0.8, abs=1e-6)
