"""The generated parts of the README and of the book's landing page, and a README for each headline run, all
from the committed results: no number in them is typed by hand.

    python -m posenc_lab.lab.readme           # rewrite the generated blocks and results/<run>/README.md
    python -m posenc_lab.lab.readme --check   # exit 1 when a generated text differs from the committed one

A generated block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``: ``answer`` (the first screen's
table in plain words, :func:`~posenc_lab.lab.verdicts.in_words.answer_markdown` of the headline run), ``findings`` (each claim
with its ratio, interval, p and modes, :func:`~posenc_lab.lab.verdicts.in_words.findings_markdown`), ``prose`` (the verdicts that
differ on English prose), ``far`` (what the bytes past the training length do, on both texts), ``recent`` (the
methods of 2024-26: their quality at the training length, their growth past it, and the tests against ALiBi and RoPE
with YaRN), ``run`` (why the headline run is the one shown) and ``cpu`` (how long the headline run takes on two CPU
cores). The tests check that README.md, book/intro.md and every run's README equal what this module writes
(``tests/test_readme.py``, ``tests/test_results.py``).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from posenc_lab.lab import results
from posenc_lab.lab.experiments.families import spec_of
from posenc_lab.lab.labels import Label
from posenc_lab.lab.verdicts import claims, in_words, tables
from posenc_lab.lab.verdicts.statistics import frame

#: the run the README and the landing page show
HEADLINE = "article-long-b4"
#: the other recipe with the same model and tokens (batch 8 for 2,800 steps)
OTHER_RECIPE = "article-long"
#: the headline recipe on English prose
PROSE = "prose-long-b4"
#: the runs that get a generated ``results/<run>/README.md``
RUN_READMES = (HEADLINE, OTHER_RECIPE, PROSE)
#: the encodings the two recipes are compared on at the training length (NoPE, far behind in both, is left out)
COMPARED = ("sinusoidal", "rope/none", "alibi", "t5")
#: the documents that hold generated blocks, relative to the repository, each with the base of its links to the
#: committed results (the book leaves results/ out of its pages, so its landing page links to the repository)
REPOSITORY = "https://github.com/posenc-lab/posenc-lab/blob/main/"
DOCUMENTS = {"README.md": "", "book/intro.md": REPOSITORY}

# a block's body is its lines between the markers, each ending in a newline (empty before the first fill)
_BLOCK = re.compile(r"(<!-- (?P<name>[\w-]+):start -->\n)(?P<body>.*?)(<!-- (?P=name):end -->)", re.S)


@lru_cache(maxsize=None)
def _load(run: str):
    return results.load(run)


def rows_of(run: str) -> list[dict]:
    """The rows of a committed run, loaded once per process."""
    return _load(run)[0]


def mean_loss_at_train_len(run: str, labels=COMPARED, *, mode: str = "nonoverlapping") -> float:
    """:func:`~posenc_lab.lab.verdicts.in_words.mean_loss_at_train_len` of committed run ``run``."""
    return in_words.mean_loss_at_train_len(rows_of(run), labels, mode=mode)


def _spec(run: str):
    return spec_of(_load(run)[2])


def _recipe(run: str) -> str:
    training = _spec(run).training
    return f"batch {training.batch_size} × {training.steps:,} steps"


def _tokens(run: str) -> str:
    spec = _spec(run)
    return f"{spec.training.steps * spec.training.batch_size * spec.model.train_len / 1e6:.1f} M bytes"


def _corpus(run: str) -> str:
    corpus = _load(run)[2].get("corpus", {}).get("corpus")
    return {"stdlib": "Python source", "prose": "English prose"}.get(corpus, f"the {corpus} corpus")


def _names(labels) -> str:
    names = [in_words.NAMES.get(x, x) for x in labels]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


_SEEDS = {1: "one seed", 2: "two seeds", 3: "three seeds", 4: "four seeds", 5: "five seeds", 10: "ten seeds"}


@lru_cache(maxsize=None)
def run_block() -> str:
    """Which run the first screen shows, and why (the declared analysis's rule: the recipe with more optimiser steps
    for the same bytes), with the verdicts the other recipe decides otherwise."""
    spec = _spec(HEADLINE)
    model = spec.model
    seeds = _SEEDS.get(len(spec.seeds), f"{len(spec.seeds)} seeds")
    side = in_words.side_by_side({HEADLINE: rows_of(HEADLINE), OTHER_RECIPE: rows_of(OTHER_RECIPE)})
    differ = [part for part in side.index if not side.loc[part, ("all runs", "same verdict")]]
    other = (f"Under `{OTHER_RECIPE}` ({_recipe(OTHER_RECIPE)}, {_SEEDS.get(len(_spec(OTHER_RECIPE).seeds))}), "
             + (f"{len(differ)} of the {len(side)} verdicts {'differs' if len(differ) == 1 else 'differ'}. "
                f"{changed_verdicts(side, differ, OTHER_RECIPE, HEADLINE)}" if differ
                else "every verdict is the same."))
    return (f"The headline run is `{HEADLINE}`: a {model.n_layer}-layer, {model.d_model}-wide byte model "
            f"trained at {model.train_len} on {_tokens(HEADLINE)} of {_corpus(HEADLINE)} ({_recipe(HEADLINE)}), "
            f"{seeds}. Of the two recipes with the same bytes, it takes more optimiser steps. {other}")


@lru_cache(maxsize=None)
def answer_block() -> str:
    """The first screen's answer: exactly :func:`~posenc_lab.lab.verdicts.in_words.answer_markdown` of the headline run."""
    return in_words.answer_markdown(rows_of(HEADLINE))


@lru_cache(maxsize=None)
def findings_block() -> str:
    """The claims in words: exactly :func:`~posenc_lab.lab.verdicts.in_words.findings_markdown` of the headline run."""
    return in_words.findings_markdown(rows_of(HEADLINE))


#: each claim part in a few words, for the line on prose
SHORT = {
    "1: a (slightly worse at training length)": "ALiBi slightly worse than RoPE at the training length",
    "1: b (most stable)": "ALiBi the most stable",
    "2: ntk most accurate": "NTK the most accurate",
    "2: dynamic-ntk most accurate": "dynamic NTK the most accurate",
    "2: yarn most accurate (ours)": "YaRN the most accurate",
    "3: clearly worse than RoPE": "T5 clearly worse than RoPE",
    "3: clearly worse than ALiBi": "T5 clearly worse than ALiBi",
    "ordering: sinusoidal breaks first, then rotary": "the sinusoids break first, then RoPE",
    "ordering: T5 holds to about 2x": "T5 holds to about 2x",
    "ordering: ALiBi stays flat": "ALiBi stays flat",
}


def _verdict_plain(verdict: str, plural: bool) -> str:
    """A verdict as a sentence's verb: ``holds`` (``hold`` for several parts), ``does not hold`` (``do not hold``),
    ``is not resolved (too few seeds)`` (``are ...``), ``is mode-dependent``."""
    said = in_words.verdict_in_words(verdict).lower()
    if said in ("holds", "does not hold"):
        return {"holds": "hold", "does not hold": "do not hold"}[said] if plural else said
    if said.startswith("not resolved: "):
        said = f"not resolved ({said.removeprefix('not resolved: ')})"
    return ("are " if plural else "is ") + said


def changed_verdicts(side, parts: list[str], there: str, here: str) -> str:
    """The verdicts of ``parts`` that differ between runs ``there`` and ``here`` (the headline run) of a
    :func:`~posenc_lab.lab.verdicts.in_words.side_by_side` table, one sentence per change: ``There "T5 holds to about 2x" holds;
    in the headline run it does not hold.``"""
    groups: dict[tuple[str, str], list[str]] = {}
    for part in parts:
        groups.setdefault((side.loc[part, (there, "verdict")], side.loc[part, (here, "verdict")]), []).append(part)
    said = []
    for (a, b), these in groups.items():
        plural = len(these) > 1
        names = _listed([f'"{SHORT.get(x, x)}"' for x in these])
        said.append(f"There {names} {_verdict_plain(a, plural)}; in the headline run "
                    f"{'they' if plural else 'it'} {_verdict_plain(b, plural)}.")
    return " ".join(said)


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


@lru_cache(maxsize=None)
def _prose_side():
    return in_words.side_by_side({HEADLINE: rows_of(HEADLINE), PROSE: rows_of(PROSE)})


def prose_block(base: str = "") -> str:
    """The verdicts that differ on English prose (:func:`~posenc_lab.lab.verdicts.in_words.side_by_side`), grouped by the prose verdict."""
    side = _prose_side()
    differ = [part for part in side.index if not side.loc[part, ("all runs", "same verdict")]]
    lines = [f"On English prose (`{PROSE}`: the same recipe on Jane Austen's novels and the World English Bible), "
             f"{len(differ)} of the {len(side)} verdicts {'differs' if len(differ) == 1 else 'differ'}."]
    groups: dict[str, list[str]] = {}
    for part in differ:
        verdict = in_words.verdict_in_words(side.loc[part, (PROSE, "verdict")]).split(" (")[0]
        groups.setdefault(verdict, []).append(SHORT.get(part, part))
    for verdict, parts in groups.items():
        lines.append(f"{verdict} on prose: {_listed(parts)}.")
    lines.append(f"Its tables: [results/{PROSE}/README.md]({base}results/{PROSE}/README.md).")
    return " ".join(lines)


#: the far-context experiments (chapter 9) on the headline's models and on its prose twin's, with the text's name
CONTEXTS = {HEADLINE: ("context-long-b4", "Python"), PROSE: ("context-prose-long-b4", "English prose")}
#: the length at which the README reads them (the claims' judged length, 4x)
FAR_LEN = 2048


def _read(cell) -> str:
    """How a far-context verdict reads: its p after Benjamini-Hochberg over the run's grid, and whether it stands."""
    if "under 1 %" in cell["verdict"]:
        return f"resolved but under 1 %, p = {cell['p BH']:.2g} after Benjamini-Hochberg"
    standing = "" if cell["survives"] != "none" else ", not resolved"
    return f"p = {cell['p BH']:.2g} after Benjamini-Hochberg{standing}"


def _paired_ratio(by: dict, seeds, a: tuple, a_loss: str, b: tuple, b_loss: str) -> float:
    """``exp(mean over seeds of (a's a_loss - b's b_loss))``: a ratio of far-byte perplexities, paired by seed."""
    return math.exp(statistics.fmean(by[(*a, s)][a_loss] - by[(*b, s)][b_loss] for s in seeds))


def _gain_in_words(cell, who: str) -> str:
    """What a "uses the far context" verdict says about ``who``'s gain from the far bytes."""
    if "under 1 %" in cell["verdict"]:
        return f"{who} gains less than 1 % from the far bytes"
    if cell["survives"] == "none":
        return f"whether the far bytes help {who} is not resolved"
    return f"the far bytes help {who}" if cell["verdict"] == "holds" else f"the far bytes hurt {who}"


@lru_cache(maxsize=None)
def far_block() -> str:
    """Does a model use the bytes past its training length? For each text at :data:`FAR_LEN`: first each model's own
    gain, ALiBi's and plain RoPE's far bytes with full attention against the same model limited to its last
    training-length keys; then the comparison, ALiBi with full attention against RoPE limited to those keys, and
    how much of that difference is already there with both limited (:func:`~posenc_lab.lab.measure.far_context.far_context_family`,
    seeds as samples, each run's grid adjusted as one family; the limited-to-limited ratio is a plain paired mean,
    untested)."""
    from posenc_lab.lab.measure.far_context import far_context_family

    lines = []
    for name, text in CONTEXTS.values():
        rows = results.read_json(name, "gain.json")
        grid = far_context_family(rows).set_index(["question", "label", "eval_len"])
        alibi_own = grid.loc[("uses the far context", "alibi", FAR_LEN)]
        rope = grid.loc[("uses the far context", "rope/none", FAR_LEN)]
        versus = grid.loc[("beats the window", "alibi", FAR_LEN)]
        reach = rows[0]["reach"]
        ok = [r for r in rows if r["eval_len"] == FAR_LEN and r["status"] == "ok"]
        by = {(r["encoding"], r["strategy"], r["seed"]): r for r in ok}
        seeds = sorted({r["seed"] for r in ok})
        within = _paired_ratio(by, seeds, ("alibi", "-"), "far_loss_reach", ("rope", "none"), "far_loss_reach")
        if versus["survives"] == "none" or "under 1 %" in versus["verdict"]:
            outcome = f"neither ALiBi nor RoPE's {reach}-key window is ahead"
        else:
            outcome = f"ALiBi is ahead of RoPE's {reach}-key window" if versus["ratio"] < 1 else \
                f"RoPE's {reach}-key window is ahead of ALiBi"
        share = math.log(within) / math.log(versus["ratio"]) if versus["ratio"] != 1 else 0.0
        where = (f"most of that difference is there within {reach} keys" if share > 0.5
                 else "most of that difference comes from the far bytes")
        lines.append(
            f"On {text} (`{name}`) at {FAR_LEN:,} bytes, ALiBi's far-byte perplexity with full attention is "
            f"{alibi_own['ratio']:.3f} times its own with {reach} keys ({_read(alibi_own)}). So "
            f"{_gain_in_words(alibi_own, 'ALiBi')}. Plain RoPE's is {rope['ratio']:.2f} times its own window's "
            f"({_read(rope)}): {_gain_in_words(rope, 'RoPE')}. Compared with each other, {outcome}: ALiBi's far-byte "
            f"perplexity is {versus['ratio']:.3f} times the window's ({_read(versus)}). With both limited to {reach} "
            f"keys the ratio is already {within:.3f}, so {where}.")
    reach = results.read_json(next(iter(CONTEXTS.values()))[0], "gain.json")[0]["reach"]
    seeds = sorted({r["seed"] for name, _ in CONTEXTS.values() for r in results.read_json(name, "gain.json")})
    return (f"Does a model use the bytes past its training length? Chapter 9 scores the bytes past position {reach} "
            f"of each window twice: with full attention, and with attention limited to the last {reach} keys. "
            f"It reads {_SEEDS.get(len(seeds), f'{len(seeds)} seeds')} of the headline runs' models "
            f"({_seed_range(seeds)}), where the verdicts above read {_SEEDS.get(len(_spec(HEADLINE).seeds))}. "
            + " ".join(lines))


def _seed_range(seeds: list[int]) -> str:
    """``seeds 0–2``, or ``seed 0``, or ``seeds 0, 2 and 4`` where they are not consecutive."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}–{seeds[-1]}"
    return "seeds " + _listed([str(x) for x in seeds])


@dataclass(frozen=True)
class MethodsChapter:
    """A chapter that trains newer methods with ``base``'s recipe and reads them against its baselines: the
    language-model run ``run`` (perplexity to :data:`METHODS_LEN`), its far-context run ``far`` beside ``far_base``'s
    baselines, and its digits run ``digits`` beside ``digits_base``'s (``None`` while the chapter has no digits run:
    the block then has no digits line); ``nope_is`` says what NoPE is to its methods where the README gives NoPE's
    ratio at the training length."""

    number: int
    what: str
    run: str
    base: str
    far: str
    far_base: str
    nope_is: str
    digits: str | None = None
    digits_base: str | None = None


#: the number words the README uses for a chapter's count of methods
_COUNT = dict(enumerate(("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                         "twelve")))
#: chapter 13, the methods of 2024-26
RECENT = MethodsChapter(13, "methods of 2024–26", "recent-cpu", "article-cpu", "context-recent", "context-cpu",
                        "the base of SSMax and Llama 4's temperature",
                        digits="retrieval-digits-recent", digits_base="retrieval-digits-cpu")
#: chapter 14, past the fixed bias and the softmax
PAST_SOFTMAX = MethodsChapter(14, "methods past the fixed bias and the softmax", "past-softmax-cpu", "article-cpu",
                              "context-past-softmax", "context-cpu", "the base of stick-breaking",
                              digits="retrieval-digits-past-softmax", digits_base="retrieval-digits-cpu")
#: the README's block of each methods chapter, by block name
METHOD_BLOCKS = {"recent": RECENT, "past-softmax": PAST_SOFTMAX}
#: the length at which the README reads them: the longest evaluated, sixteen times the training length
METHODS_LEN = 8192
#: the encodings of a chapter's ``base`` the README reads the newer methods against: the baselines, plain RoPE (the
#: scale at the training length), and NoPE (the base of several newer methods)
METHODS_SCALE = ("alibi", "rope/none", "rope/yarn", "nope")
#: the growth bands of the README: the first band whose top holds a method's largest growth at any length names it,
#: with the band's lowest and highest growth to :data:`METHODS_LEN` in percent (``lo``, ``hi``) or as factors
GROWTH_BANDS = ((1.01, "At most 1 % at any length"), (1.10, "{lo:.0f} to {hi:.0f} % by {n:,}"),
                (1.50, "{lo:.0f} to {hi:.0f} % by {n:,}"), (math.inf, "{lo:.2f} to {hi:.2f} times by {n:,}"))


def methods_rows(ch: MethodsChapter) -> tuple[list[dict], list[str]]:
    """The rows of ``ch.run`` and of the baselines (:data:`~posenc_lab.lab.verdicts.in_words.BASELINES`) in
    ``ch.base``, and the newer methods' labels in the run's order."""
    from posenc_lab.lab.verdicts.statistics import label

    methods = list(_spec(ch.run).encodings)
    base = [r for r in rows_of(ch.base) if label(r) in in_words.BASELINES]
    return rows_of(ch.run) + base, methods


@lru_cache(maxsize=None)
def methods_perplexity(ch: MethodsChapter):
    """Perplexity per byte by label (rows) and evaluation length (columns) of the newer methods and of
    :data:`METHODS_SCALE`: the seeds' geometric mean, non-overlapping windows (the chapter's tables)."""
    import numpy as np

    from posenc_lab.lab.verdicts.statistics import label

    rows = rows_of(ch.run) + [r for r in rows_of(ch.base) if label(r) in METHODS_SCALE]
    df = frame([r for r in rows if r["eval_mode"] == "nonoverlapping" and r["status"] == "ok"])
    return np.exp(np.log(df["perplexity"]).groupby([df["label"], df["eval_len"]]).mean().unstack())


def _ratios(values, digits: int = 2) -> str:
    return "/".join(f"{v:.{digits}f}" for v in values)


def methods_quality_line(ch: MethodsChapter) -> str:
    """Quality at the training length: each newer method's perplexity there over plain RoPE's and over ALiBi's
    (lowest first), then the recipe that ranking belongs to, with ALiBi and NoPE against RoPE at that length."""
    ppl = methods_perplexity(ch)
    spec = _spec(ch.run)
    n = spec.model.train_len
    at = ppl[n][list(spec.encodings)].sort_values()
    rope, alibi = ppl.loc["rope/none", n], ppl.loc["alibi", n]
    best, *others = at.index
    named = ", ".join(f"{in_words.NAMES.get(m, m)} {_ratios((at[m] / rope, at[m] / alibi))}" for m in others)
    return (f"Quality at the training length: at {n} bytes {in_words.NAMES.get(best, best)} has the lowest "
            f"perplexity, {at[best] / rope:.2f} of RoPE's and {at[best] / alibi:.2f} of ALiBi's. The others, over "
            f"RoPE's/ALiBi's: {named}. That ranking is one small recipe's ({spec.model.n_layer} layers, "
            f"{spec.training.steps:,} steps on {_tokens(ch.run)}). In it ALiBi is already {alibi / rope:.2f} times "
            f"RoPE at {n}, and NoPE, {ch.nope_is}, {ppl.loc['nope', n] / rope:.2f} "
            f"times. So a place at {n} says how much a method learned in {spec.training.steps:,} steps, not where "
            "it would end.")


def methods_growth(ch: MethodsChapter):
    """Growth: each newer method's and each baseline's (and plain RoPE's) perplexity at every evaluated length past
    the training length over its own at the training length, least growth to :data:`METHODS_LEN` first."""
    ppl = methods_perplexity(ch)
    n = _spec(ch.run).model.train_len
    labels = list(_spec(ch.run).encodings) + ["alibi", "rope/none", "rope/yarn"]
    return ppl.loc[labels].div(ppl.loc[labels, n], axis=0).drop(columns=n).sort_values(METHODS_LEN)


def methods_growth_line(ch: MethodsChapter) -> str:
    """Growth past the training length in :data:`GROWTH_BANDS`, each model with its growth to every length."""
    growth = methods_growth(ch)
    n = _spec(ch.run).model.train_len
    lengths = "/".join(f"{x:,}" for x in growth.columns)
    sentences = [f"Growth past the training length, each model's perplexity at {lengths} over its own at {n}."]
    band = [next(i for i, (top, _) in enumerate(GROWTH_BANDS) if g.max() <= top) for _, g in growth.iterrows()]
    for i, (_, words) in enumerate(GROWTH_BANDS):
        these = growth[[b == i for b in band]]
        if these.empty:
            continue
        far = these[METHODS_LEN]
        lo, hi = (100 * (far.min() - 1), 100 * (far.max() - 1)) if "%" in words else (far.min(), far.max())
        named = _listed([f"{in_words.NAMES.get(m, m)} {_ratios(g)}" for m, g in these.iterrows()])
        said = words.format(lo=lo, hi=hi, n=METHODS_LEN)
        if said == words.format(lo=hi, hi=hi, n=METHODS_LEN):  # one value as printed: "18 % by", not "18 to 18 %"
            said = re.sub(r"\{lo:[^}]*\} to ", "", words).format(hi=hi, n=METHODS_LEN)
        sentences.append(f"{said}: {named}.")
    return " ".join(sentences)


def methods_tests_line(ch: MethodsChapter, table) -> str:
    """The tested ratios at :data:`METHODS_LEN` (``table``: :func:`~posenc_lab.lab.verdicts.in_words.against_baselines`), after
    what makes them: a ratio there is the ratio at the training length times the ratio of the two growths. Whether
    any method grows less than ALiBi at some length (only such a method can gain on ALiBi past the training length),
    and, for each method lower than RoPE with YaRN at :data:`METHODS_LEN`, whether most of that gap (on the log
    scale) is YaRN's growth rather than the lead at the training length."""
    import numpy as np

    growth = methods_growth(ch)
    methods = list(_spec(ch.run).encodings)
    n = _spec(ch.run).model.train_len
    less = [m for m in methods if (growth.loc[m] < growth.loc["alibi"]).any()]
    alibi = (f"{_names(less)} {'grows' if len(less) == 1 else 'grow'} less than ALiBi at some length, so only "
             f"{'it' if len(less) == 1 else 'they'} can gain on it past {n}." if less else
             f"No method grows less than ALiBi at any length, so none gains on it past {n}: a lead over ALiBi at "
             f"{METHODS_LEN:,} is at most the lead at {n}.")
    lower = table[(table["b"] == "rope/yarn") & (table["eval_len"] == METHODS_LEN) & (table["outcome"] == "lower")
                  & (table["mode"] == "nonoverlapping")]["a"]
    far = methods_perplexity(ch)[METHODS_LEN]
    share = {m: np.log(growth.loc[m, METHODS_LEN] / growth.loc["rope/yarn", METHODS_LEN])
             / np.log(far[m] / far["rope/yarn"]) for m in lower}
    mostly = [m for m in methods if share.get(m, 0) > 0.5]
    yarn_growth = f"RoPE with YaRN grows {growth.loc['rope/yarn', METHODS_LEN]:.2f} times by {METHODS_LEN:,}"
    if mostly and len(mostly) == len(share):
        yarn = f"{yarn_growth}: for each method lower than it there, most of the gap is that growth."
    elif mostly:
        yarn = f"{yarn_growth}: for {_names(mostly)}, most of the gap to it there is that growth."
    else:
        yarn = f"{yarn_growth}, yet no gap to it there is mostly that growth."
    return (f"The tests, at {METHODS_LEN:,}, read both at once: a ratio there is the ratio at {n} times the ratio of "
            f"the two growths. {alibi} {yarn} "
            + " ".join(in_words.against_in_words(table, b, METHODS_LEN) for b in in_words.BASELINES)
            + " A perplexity difference counts when it is at least 1 % and a paired t-test over the seeds resolves "
              "it, at a 5 % false discovery rate over the chapter's table.")


@lru_cache(maxsize=None)
def methods_block(ch: MethodsChapter) -> str:
    """A methods chapter's block (chapter 13's methods of 2024-26 for ``recent``): quality at the training length
    and growth past it read apart, then the tested ratios to ALiBi and RoPE with YaRN at :data:`METHODS_LEN` in
    non-overlapping windows (:func:`~posenc_lab.lab.verdicts.in_words.against_baselines`: the family of the
    chapter's table), the far bytes, and the digits task where the chapter has a digits run."""
    rows, methods = methods_rows(ch)
    table = in_words.against_baselines(rows, methods)
    seeds = len(_spec(ch.run).seeds)
    lines = [f"Chapter {ch.number} trains {_COUNT[len(methods)]} {ch.what} with `{ch.base}`'s recipe "
             f"({_corpus(ch.run)}, {seeds} seeds, `{ch.run}`). It reads quality at the training length and growth "
             "past it apart (non-overlapping windows, the seeds' geometric mean):"]
    lines += [f"- {methods_quality_line(ch)}", f"- {methods_growth_line(ch)}", f"- {methods_tests_line(ch, table)}"]
    lines.append(f"- {methods_far_line(ch)}")
    if ch.digits:
        lines.append(f"- {methods_digits_line(ch)}")
    return "\n".join(lines)


def methods_far_rows(ch: MethodsChapter) -> list[dict]:
    """``ch.far``'s gain rows with ``ch.far_base``'s ALiBi, RoPE and RoPE with YaRN: the same bytes,
    and models paired by seed (trained on the same batches); the family the chapter reads."""
    base = {("alibi", "-"), ("rope", "none"), ("rope", "yarn")}
    return results.read_json(ch.far, "gain.json") + [r for r in results.read_json(ch.far_base, "gain.json")
                                                         if (r["encoding"], r["strategy"]) in base]


def _lengths(lengths) -> str:
    words = [f"{n:,}" for n in sorted(lengths)]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def methods_far_line(ch: MethodsChapter) -> str:
    """The newer methods on the bytes past the training length (:func:`~posenc_lab.lab.measure.far_context.far_context_family` over
    :func:`methods_far_rows`, one family): those better than RoPE limited to its window, those the far bytes help and
    those they hurt, each with the lengths where the verdict survives Benjamini-Hochberg."""
    from posenc_lab.lab.measure.far_context import far_context_family

    family = far_context_family(methods_far_rows(ch))
    methods = results.read_json(ch.far, "config.json")["spec"]["encodings"]
    kept = family[family["label"].isin(methods) & (family["survives"] != "none")]

    def named(question: str, verdict: str) -> str:
        rows = kept[(kept["question"] == question) & (kept["verdict"] == verdict)]
        found = [f"{in_words.NAMES.get(m, m)} (at {_lengths(rows[rows['label'] == m]['eval_len'])})"
                 for m in methods if (rows["label"] == m).any()]
        return "; ".join(found) or "none"

    reach = results.read_json(ch.far, "gain.json")[0]["reach"]
    helped = kept[(kept["question"] == "uses the far context") & (kept["verdict"] == "holds")]
    return (f"On the bytes past {reach} alone (`{ch.far}`, chapter 9's measure), better than RoPE limited to "
            f"{reach} keys: {named('beats the window', 'holds')}. Helped by the far bytes: "
            f"{named('uses the far context', 'holds')}.{methods_repair_caveat(ch, set(helped['label']))} Hurt by them: "
            f"{named('uses the far context', 'fails')}.")


def methods_repair_caveat(ch: MethodsChapter, helped) -> str:
    """The caveat chapter 13 puts on a method the far bytes help: where that method's far bytes, limited to the last
    ``reach`` keys, score a higher perplexity on every seed and length than its whole windows at the training length
    (``ch.run``, non-overlapping windows, the seeds' geometric mean), its limited form is broken, and part of the
    help repairs it. Each such method is said with the seeds' geometric mean of its limited far-byte perplexity, the
    lowest and the highest over the lengths, against that at the training length. Empty when no helped method is
    such."""
    import numpy as np

    rows = [r for r in results.read_json(ch.far, "gain.json") if r["status"] == "ok"]
    train = [r for r in rows_of(ch.run) if r["eval_mode"] == "nonoverlapping" and r["eval_len"] == r["train_len"]]
    parts = []
    for method in results.read_json(ch.far, "config.json")["spec"]["encodings"]:
        if method not in helped:
            continue
        ours = [r for r in rows if r["encoding"] == method]
        at_train = math.exp(np.mean([math.log(r["perplexity"]) for r in train if r["encoding"] == method]))
        if min(math.exp(r["far_loss_reach"]) for r in ours) > at_train:
            by_length = [math.exp(np.mean([r["far_loss_reach"] for r in ours if r["eval_len"] == n]))
                         for n in sorted({r["eval_len"] for r in ours})]
            parts.append(f"{in_words.NAMES.get(method, method)} {min(by_length):.1f} to {max(by_length):.1f} "
                         f"against {at_train:.2f}")
    if not parts:
        return ""
    reach, train_len = rows[0]["reach"], rows[0]["train_len"]
    return (f" Part of that help repairs a broken {reach}-key form (chapter 13). Limited to {reach} keys, their far "
            f"bytes score a higher perplexity than their whole {train_len:,}-byte windows do, on every seed and "
            f"length. The seeds' geometric means, lowest to highest over the lengths: {'; '.join(parts)}.")


def methods_digits_rows(ch: MethodsChapter) -> tuple[list[dict], list[str]]:
    """The rows of ``ch.digits`` and of the baselines in ``ch.digits_base`` (the same task, recipe,
    seeds and windows), and the newer methods in the run's order."""
    from posenc_lab.lab.verdicts.statistics import label

    base = [r for r in rows_of(ch.digits_base) if label(r) in in_words.BASELINES]
    return rows_of(ch.digits) + base, list(_spec(ch.digits).encodings)


def methods_digits_line(ch: MethodsChapter) -> str:
    """The newer methods on chapter 9's digits task: which did not learn it, and where each that did copies more or
    fewer digit strings than ALiBi and than RoPE with YaRN (:func:`~posenc_lab.lab.verdicts.in_words.retrieval_against_baselines`,
    the family the chapter reads), each with the lengths where the difference counts. Exact match is an accuracy, so
    more is better: the line says "more accurate" and "less accurate", never "higher" or "lower", which the lines on
    perplexity before it use the other way round."""
    rows, methods = methods_digits_rows(ch)
    learned, not_learned = in_words.learned_methods(rows, methods)
    family = in_words.retrieval_against_baselines(rows, learned)

    def named(against: str, outcome: str) -> str:
        these = family[(family["against"] == against) & (family["outcome"] == outcome)]
        found = [f"{in_words.NAMES.get(m, m)} (at {', '.join(f'{k}x' for k in these[these['method'] == m]['multiple'])})"
                 for m in learned if (these["method"] == m).any()]
        return "; ".join(found) or "none"

    def against(baseline: str, name: str) -> str:
        return (f"Against {name}, more accurate: {named(baseline, 'higher')}; less accurate: "
                f"{named(baseline, 'lower')}.")

    train_len = _spec(ch.digits).model.train_len
    return (f"On chapter 9's digits task (`{ch.digits}`: five digits copied in order, trained at {train_len} "
            f"bytes, judged at 1x to 8x), not learned: {_names(not_learned) if not_learned else 'none'}. "
            f"Exact match is the share of strings copied right, so higher is better. {against('alibi', 'ALiBi')} "
            f"{against('rope/yarn', 'RoPE with YaRN')} A difference in exact match counts when every seed's exact "
            "test finds it the same way, at a 5 % false discovery rate.")


def cpu_hours(run: str) -> dict:
    """The unit time of committed run ``run`` in hours: ``units``, ``total`` (the units' recorded seconds, training,
    evaluation and saving), ``training`` (each unit's training once) and ``evaluation`` (every row's), with the
    ``device`` the rows name."""
    rows, units, _ = _load(run)
    training = {(r["encoding"], r["seed"]): float(r["train_seconds"]) for r in rows}
    devices = {str(r["device"]) for r in rows}
    if len(devices) != 1:
        raise ValueError(f"{run} ran on several devices: {sorted(devices)}")
    return {"units": len(units), "total": sum(u["seconds"] for u in units) / 3600,
            "training": sum(training.values()) / 3600,
            "evaluation": sum(float(r["eval_seconds"] or 0) for r in rows) / 3600, "device": devices.pop()}


@lru_cache(maxsize=None)
def cpu_block() -> str:
    """How long the headline run takes on two CPU cores, from the committed record of :data:`OTHER_RECIPE`, which
    ran there on the same bytes: its unit time scaled by the headline run's number of units."""
    other = cpu_hours(OTHER_RECIPE)
    if not other["device"].startswith("cpu"):
        raise ValueError(f"{OTHER_RECIPE} ran on {other['device']}, not on a CPU")
    units = len(_load(HEADLINE)[1])
    batch = _spec(OTHER_RECIPE).training.batch_size
    threads = re.search(r"(\d+) threads?", other["device"])
    where = f"{threads.group(1)} CPU threads" if threads else other["device"]
    return (f"On two CPU cores leave `JOBS` at 1. There `{OTHER_RECIPE}`, the same bytes in batches of {batch}, took "
            f"{other['total']:.1f} hours for its {other['units']} units on {where} ({other['training']:.1f} h "
            f"training, {other['evaluation']:.1f} h evaluation). At that pace the headline run's {units} units take "
            f"about {other['total'] * units / other['units']:.1f} hours.")


@lru_cache(maxsize=None)
def blocks(base: str = "") -> dict[str, str]:
    """Every generated block by name; ``base`` goes before the links to committed results."""
    return {"run": run_block(), "answer": answer_block(), "findings": findings_block(), "prose": prose_block(base), "far": far_block(),
            **{name: methods_block(ch) for name, ch in METHOD_BLOCKS.items()}, "cpu": cpu_block()}


def generated_blocks(text: str) -> dict[str, str]:
    """The generated blocks a document holds, by name (a name may appear once per document)."""
    return {m.group("name"): m.group("body").removesuffix("\n") for m in _BLOCK.finditer(text)}


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with each generated block replaced by its value in ``values``; an unknown block name is an error."""

    def replace(m):
        name = m.group("name")
        if name not in values:
            raise KeyError(f"no generated block named {name!r}; known: {', '.join(values)}")
        return m.group(1) + values[name] + "\n" + m.group(4)

    return _BLOCK.sub(replace, text)


# ------------------------------------------------------------------------------------------ each run's README


def _encodings(df) -> list[str]:
    """The run's encodings (RoPE once, without its strategies), in the registry's order."""
    return [x for x in tables.HEADLINE_LABELS if x in set(df.label) and Label.parse(x).as_trained]


def _caveats(run: str) -> list[str]:
    rows, units, config = _load(run)
    df = frame(rows)
    train = int(df["train_len"].iloc[0])
    spread = tables.spread_at_training_length(rows, [x for x in COMPARED if x in set(df.label)])
    strict = tables.verdict_table(rows, judged_lens=(2048,), alpha=0.01)[("decided", 2048)]
    usual = tables.verdict_table(rows, judged_lens=(2048,))[("decided", 2048)]
    resolved = [c for c in usual.index if not usual[c].startswith("not resolved")]
    lost = [c for c in resolved if strict[c].startswith("not resolved")]
    text = config.get("evaluation_text", {})
    seconds = [u["seconds"] for u in units]
    devices = ", ".join(sorted(set(df["device"].astype(str))))
    out = [f"The models are short of convergence. At {train} (non-overlapping windows) {_names(spread['means'])} are "
           f"{100 * spread['spread']:.1f} % apart in perplexity. The ALiBi paper's converged models are about 2 % "
           f"apart.",
           f"{_SEEDS.get(df['seed'].nunique(), 'These seeds').capitalize()} resolve only the differences the power "
           f"column names. At alpha = 0.01, {len(lost)} of the {len(resolved)} resolved "
           f"verdicts become \"not resolved\"" + (f": {', '.join(lost)}." if lost else "."),
           f"\"Every scheme\" in claim 2 means the encodings of this run: {_names(_encodings(df))}."]
    if text:
        out.append(f"Evaluation: {text['eval_text_bytes'] / 1024:.0f} KiB from {text['eval_documents']} test "
                   f"documents, the same bytes for every encoding. Sliding windows of length L' score their last "
                   f"L'/2 bytes.")
    out.append(f"Trained and evaluated on {devices}: {len(units)} units (an encoding and a seed), median "
               f"{statistics.median(seconds):,.0f} s each, {_duration(sum(seconds))} of unit time in all.")
    return out


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} minutes" if seconds < 2 * 3600 else f"{seconds / 3600:.1f} hours"


def run_readme(run: str) -> str:
    """``results/<run>/README.md``: what made the run, the claims in words, the tables and verdicts
    (:func:`~posenc_lab.lab.verdicts.tables.headline`), the decision rule and the caveats."""
    rows, _, config = _load(run)
    corpus = config.get("corpus", {})
    what = results.RUNS[run]
    make, _, description = what.partition(": ")
    parts = [f"# {run}", "",
             "Generated by `python -m posenc_lab.lab.readme` from this folder's results; `tests/test_results.py` checks "
             "that it is in step with them.", "",
             f"Made by `{make}`: {description}.",
             f"Corpus: {corpus.get('source', corpus.get('corpus', 'unknown'))}.", ""]
    if run in (HEADLINE, OTHER_RECIPE):
        parts += [run_block(), ""]
    parts += ["## The answer", "", in_words.answer_markdown(rows), "",
              "## The claims in words", "",
              "Each line gives the comparison its verdict rests on, with its 95 % interval and p: a ratio of "
              "perplexities, growth factors with the difference of their logs, or a growth factor against its line.",
              "", in_words.findings_markdown(rows), "",
              "## Perplexity per byte and the verdicts", "",
              "Mean ± standard deviation over the seeds; lower is better. The claims are set at 2,048, the article's "
              "4x: claim 1a is judged at 512 itself, and the ALiBi paper's ordering at 1,024 and 2,048.", "", tables.headline(rows), "",
              *_beside_verdicts(run),
              "## The decision rule", "", claims.RULE, "", "The declared analysis (book/analysis.md) says it at "
              "length.", "",
              "## Caveats", "", *(f"- {c}" for c in _caveats(run)), ""]
    return "\n".join(parts)


def _beside_verdicts(run: str) -> list[str]:
    """The power of each verdict's comparison, documents as samples, and (where the seeds ran on more than one
    device) the shift between the devices' seeds, as Markdown sections of a run's README."""
    rows = rows_of(run)
    power = in_words.power_table(rows)
    out = ["## What the seeds can resolve", "",
           "Each verdict rests on one comparison in the primary mode. The last columns give the smallest difference "
           "its t-test resolves with 80 % power at the seeds' spread, as a ratio minus 1, and why a verdict is not "
           "resolved.", "",
           "| claim | verdict | comparison | difference (nats) | sd over seeds | seeds | resolves with 80 % power | why |",
           "|---|---|---|---|---|---|---|---|"]
    out += [f"| {r.claim} | {r.verdict} | {r.comparison} | {r.difference:+.4f} | {r.sd:.4f} | {r.seeds} | "
            f"{100 * math.expm1(r.resolves):.2g} % | {r.why} |" for r in power.itertuples()]
    documents = tables.load_documents(results.folder(run))
    if documents is not None:
        docs = in_words.document_table(rows, documents)
        out += ["", "## Documents as samples", "",
                "The same comparisons with the evaluation text's documents as a second sample: a crossed seed x "
                "document random-effects model (statsmodels' MixedLM, REML) beside the seeds' paired t-test. It decides "
                "nothing.", "",
                "| claim | comparison | difference, seeds | se, seeds | difference, model | se, model | seed sd | "
                "document sd |", "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['claim']} | {r['comparison']} | {r['difference']:+.4f} | {r['se seeds']:.4f} | "
                f"{r['difference model']:+.4f} | {r['se model']:.4f} | {r['seed sd']:.4f} | {r['document sd']:.4f} |"
                for r in docs.to_dict("records")]
    df = frame(rows)
    devices = df.groupby("seed")["device"].first()
    if devices.nunique() > 1:
        late = sorted(devices.index[devices != devices.iloc[0]])
        shift = in_words.seed_group_shift(rows, late)
        out += ["", "## Devices", "",
                "Seeds " + ", ".join(f"{s} ({d})" for s, d in devices.items()) + ". Where seeds ran on another "
                "device, each comparison's mean over those seeds against the others, beside the seed-to-seed spread "
                "of the per-seed differences (Welch's p of the shift).", "",
                "| claim | comparison | other seeds | seeds " + ", ".join(map(str, late)) + " | shift | seed sd | p |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['claim']} | {r['comparison']} | {r['early']:+.4f} | {r['late']:+.4f} | {r['shift']:+.4f} | "
                f"{r['seed sd']:.4f} | {r['p']:.2g} |" for r in shift.to_dict("records")]
    return out + [""]


# ------------------------------------------------------------------------------------------ writing and checking


def expected(root: Path) -> dict[Path, str]:
    """Every generated file's expected text, by path."""
    out = {root / doc: fill((root / doc).read_text(encoding="utf-8"), blocks(base)) for doc, base in DOCUMENTS.items()}
    out.update({results.folder(run) / "README.md": run_readme(run) for run in RUN_READMES})
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line: print the two recipes' losses, then write (or ``--check``) every generated file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2], help="the repository")
    args = parser.parse_args(argv)
    for run in (HEADLINE, OTHER_RECIPE):
        print(f"{run}: mean loss at the training length over {', '.join(COMPARED)} "
              f"{mean_loss_at_train_len(run):.3f} nats per byte ({_recipe(run)})")
    stale = []
    for path, text in expected(args.root).items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
            if not args.check:
                path.write_text(text, encoding="utf-8")
        print(f"{'stale' if path in stale and args.check else 'wrote' if path in stale else 'in step'}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
