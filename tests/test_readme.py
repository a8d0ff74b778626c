"""The README and the book's landing page: short, in short sentences, their figure where they say, their generated
parts in step with the committed results, and their code runnable as written."""

import re
import sys
from pathlib import Path

import pytest

from posenc_lab.lab import readme, results
from posenc_lab.lab.experiments.families import spec_of
from posenc_lab.lab.verdicts import in_words as findings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INTRO = ROOT / "book" / "intro.md"
FIGURE = ROOT / "results" / readme.HEADLINE / "figures" / "ppl_vs_length.png"
sys.path.insert(0, str(ROOT / "book"))
import readability  # noqa: E402

#: the README's own targets, stricter than the chapters': a newcomer reads it in two minutes
README_LINES = 150
README_TARGETS = {"mean": 20.0, "share_over_40": 0.0, "longest": 40}
IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<path>[^)\s]+)\)|<img [^>]*src=\"(?P<src>[^\"]+)\"|"
                   r"^```\{(?:figure|image)\}\s+(?P<directive>\S+)", re.M)


def images(path: Path) -> list[tuple[str, str]]:
    """``(alt, target)`` of every image of a Markdown file: Markdown images, ``<img>`` tags, figure directives."""
    out = []
    for m in IMAGE.finditer(path.read_text(encoding="utf-8")):
        out.append((m.group("alt") or "", m.group("path") or m.group("src") or m.group("directive")))
    return out


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; the target is {README_LINES}"


def test_readme_sentences_are_short():
    stats = readability.measure(README)
    assert stats.meets(README_TARGETS), (
        f"README.md: mean {stats.mean:.1f} words, longest {stats.longest}; targets: mean <= 20, none over 40. "
        f"Longest: {max(stats.sentences, key=readability.words)}")


def test_landing_page_meets_the_chapters_targets():
    stats = readability.measure(INTRO)
    assert len(stats.sentences) > 30  # the whole page is measured, not only its first screen
    assert stats.meets(), f"book/intro.md: mean {stats.mean:.1f}, {100 * stats.share_over_40:.1f} % over 40, " \
                          f"longest {stats.longest}"


@pytest.mark.parametrize("page", [README, INTRO], ids=["README.md", "book/intro.md"])
def test_every_relative_image_resolves_from_its_page(page):
    found = images(page)
    assert found, f"{page.name} shows no figure"
    for alt, target in found:
        if re.match(r"[a-z]+://", target):
            continue
        assert (page.parent / target).resolve().is_file(), f"{page.name}: {target} is not a file relative to the page"
    local = [(page.parent / t).resolve() for _, t in found if not re.match(r"[a-z]+://", t)]
    assert FIGURE.resolve() in local, f"{page.name} does not show the headline figure"
    assert all(alt.strip() for alt, t in found if (page.parent / t).resolve() == FIGURE.resolve()), "no alt text"


def test_readme_relative_links_resolve():
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s#]+)\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_first_screen_is_the_answer_then_the_verdict_figure():
    """The answer in plain words first, the verdict figure under it, then the perplexity figure; the long lines with
    ratios, intervals and p-values come after both figures (the landing page) or only in the run's README."""
    for page, chapters in ((README, "## The book"), (INTRO, "## The chapters")):
        text = page.read_text(encoding="utf-8")
        answer = text.index("<!-- answer:start -->")
        assert answer < text.index("verdicts.png") < text.index("ppl_vs_length.png") < text.index(chapters)
        assert "figure" not in text[:answer].lower() and "![" not in text[:answer]  # no figure before the answer
        if "<!-- findings:start -->" in text:
            assert text.index("ppl_vs_length.png") < text.index("<!-- findings:start -->") < text.index(chapters)
    assert "<!-- findings:start -->" not in README.read_text(encoding="utf-8")
    run = (ROOT / "results" / readme.HEADLINE / "README.md").read_text(encoding="utf-8")
    assert findings.findings_markdown(readme.rows_of(readme.HEADLINE)) in run  # the long lines live there


@pytest.mark.parametrize("doc", list(readme.DOCUMENTS))
def test_generated_blocks_are_the_generators_output(doc):
    """No hand-typed number: each generated block is what ``python -m posenc_lab.lab.readme`` writes today."""
    held = readme.generated_blocks((ROOT / doc).read_text(encoding="utf-8"))
    assert {"run", "answer", "prose", "far"} <= set(held), f"{doc} lacks a generated block"
    want = readme.blocks(readme.DOCUMENTS[doc])
    for name, body in held.items():
        assert body == want[name], f"{doc}: block {name!r} differs from the results: run python -m posenc_lab.lab.readme"


def test_answer_block_is_exactly_answer_markdown_of_the_headline_run():
    for page in (README, INTRO):
        held = readme.generated_blocks(page.read_text(encoding="utf-8"))["answer"]
        assert held == findings.answer_markdown(readme.rows_of(readme.HEADLINE))
        assert len(held.splitlines()) == 12  # a header, a rule and the ten claim parts, one row each
    detail = readme.generated_blocks(INTRO.read_text(encoding="utf-8"))["findings"]
    assert detail == findings.findings_markdown(readme.rows_of(readme.HEADLINE))


def test_readme_says_where_each_claim_is_judged_without_a_single_length():
    """Not every claim is judged at 2,048 (claim 1a at 512, the ALiBi paper's ordering at 1,024 too), and not every
    line is a ratio of perplexities: the pages must not say otherwise."""
    for page in (README, INTRO):
        text = page.read_text(encoding="utf-8")
        assert "Each claim is judged at 2,048" not in text and "Every claim is judged at 2,048" not in text
        assert "a ratio of perplexities, or growth factors" not in text
    assert "at 1,024" in INTRO.read_text(encoding="utf-8") and "512 itself" in INTRO.read_text(encoding="utf-8")


def test_headline_run_is_chosen_by_its_recipe_and_the_other_recipe_is_named():
    """The declared analysis's rule: of the two recipes with the same bytes, the one with more optimiser steps; the
    run block names the verdicts the other recipe decides otherwise (book/analysis.md)."""
    from posenc_lab.lab import results

    ours, other = (spec_of(results.load(r)[2]).training for r in (readme.HEADLINE, readme.OTHER_RECIPE))
    assert ours.steps > other.steps and ours.steps * ours.batch_size == other.steps * other.batch_size
    side = findings.side_by_side({r: readme.rows_of(r) for r in (readme.HEADLINE, readme.OTHER_RECIPE)})
    differ = [readme.SHORT[p] for p in side.index if not side.loc[p, ("all runs", "same verdict")]]
    block = readme.run_block()
    assert "more optimiser steps" in block and all(name in block for name in differ)


def test_fill_replaces_only_the_blocks_and_refuses_an_unknown_name():
    text = "intro\n<!-- a:start -->\nold\n<!-- a:end -->\nkept\n<!-- b:start -->\n<!-- b:end -->\n"
    filled = readme.fill(text, {"a": "new", "b": "two\nlines"})
    assert filled == ("intro\n<!-- a:start -->\nnew\n<!-- a:end -->\nkept\n"
                      "<!-- b:start -->\ntwo\nlines\n<!-- b:end -->\n")
    assert readme.generated_blocks(filled) == {"a": "new", "b": "two\nlines"}
    assert readme.fill(filled, {"a": "new", "b": "two\nlines"}) == filled
    with pytest.raises(KeyError, match="no generated block named 'a'"):
        readme.fill(text, {"b": ""})


def test_readme_example_runs_as_written():
    """The README's "use one encoding in your own model" block, executed alone in a fresh namespace."""
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), flags=re.M | re.S)
    assert len(blocks) == 1 and len(blocks[0].splitlines()) <= 5
    namespace = {"__name__": "readme"}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    import torch

    from posenc_lab import ALiBi, attention

    from posenc_lab import RoPE

    q, k, v, pos = (namespace[n] for n in ("q", "k", "v", "pos"))
    assert namespace["q_rot"].shape == q.shape and namespace["k_rot"].shape == k.shape
    alibi = attention(q, k, v, ALiBi(num_heads=8), backend="reference")
    assert torch.allclose(namespace["out_alibi"], alibi, atol=1e-5)
    yarn = attention(q, k, v, RoPE(64, train_len=512, scaling="yarn", factor=2.0), positions=pos, backend="reference")
    assert torch.allclose(namespace["out_rope"], yarn, atol=1e-5)  # the rotated queries and keys reach attention


def test_far_block_numbers_recomputed_from_the_gain_rows():
    """The far-context sentences' ratios, from the committed gain rows with plain numpy, paired by seed and
    exponentiated: first each model's own gain (ALiBi's and RoPE's far loss with full attention against the same model
    limited to the reach), then ALiBi with full attention against RoPE limited to the reach, and both limited."""
    import math

    import numpy as np

    text = readme.far_block()

    def ratio(by, seeds, a, a_loss, b, b_loss):
        return math.exp(np.mean([by[(*a, s)][a_loss] - by[(*b, s)][b_loss] for s in seeds]))

    for name, _ in readme.CONTEXTS.values():
        rows = [r for r in results.read_json(name, "gain.json")
                if r["eval_len"] == readme.FAR_LEN and r["status"] == "ok"]
        by = {(r["encoding"], r["strategy"], r["seed"]): r for r in rows}
        seeds = sorted({r["seed"] for r in rows})
        alibi, rope = ("alibi", "-"), ("rope", "none")
        part = text.split(f"(`{name}`)")[1].split("(`")[0]
        own = ratio(by, seeds, alibi, "far_loss_full", alibi, "far_loss_reach")
        assert f"full attention is {own:.3f} times its own" in part  # ALiBi's own gain comes first
        assert f"{ratio(by, seeds, rope, 'far_loss_full', rope, 'far_loss_reach'):.2f} times its own window's" in part
        assert f"{ratio(by, seeds, alibi, 'far_loss_full', rope, 'far_loss_reach'):.3f} times the window's" in part
        assert f"already {ratio(by, seeds, alibi, 'far_loss_reach', rope, 'far_loss_reach'):.3f}" in part
        assert part.index("times its own with") < part.index("times the window's")


@pytest.mark.parametrize("block, ch", list(readme.METHOD_BLOCKS.items()))
def test_far_bytes_that_help_a_broken_limited_form_carry_chapter_13s_caveat(block, ch):
    """Where the far bytes help a method whose far bytes, limited to the reach, score worse on every seed and length
    than its whole windows at the training length, the README line says so, with those numbers recomputed here."""
    import math

    from posenc_lab.lab.measure.far_context import far_context_family

    line = readme.methods_far_line(ch)
    family = far_context_family(readme.methods_far_rows(ch))
    helped = set(family[(family["question"] == "uses the far context") & (family["verdict"] == "holds")
                        & (family["survives"] != "none")]["label"])
    if not helped:  # then there is nothing to repair, and the line must not say so
        assert block != "recent", "chapter 13's committed runs have a method the far bytes help"
        assert "repairs" not in line and "Helped by the far bytes: none." in line
        return
    gain = [r for r in results.read_json(ch.far, "gain.json") if r["status"] == "ok"]
    train = [r for r in readme.rows_of(ch.run) if r["eval_mode"] == "nonoverlapping" and r["eval_len"] == 512]
    for method in helped:
        ours = [r for r in gain if r["encoding"] == method]
        limited = [math.exp(r["far_loss_reach"]) for r in ours]
        logs = [math.log(r["perplexity"]) for r in train if r["encoding"] == method]
        at_train = math.exp(sum(logs) / len(logs))
        # both sides the seeds' geometric mean: at each length for the far bytes, at 512 for the whole windows
        per_length = {}
        for r in ours:
            per_length.setdefault(r["eval_len"], []).append(r["far_loss_reach"])
        means = [math.exp(sum(v) / len(v)) for v in per_length.values()]
        assert all(len(v) == 3 for v in per_length.values())
        said = f"{findings.NAMES[method]} {min(means):.1f} to {max(means):.1f} against {at_train:.2f}"
        assert (said in line) == (min(limited) > at_train), said
    assert "geometric means" in line and "on every seed and length" in line
    assert "repairs a broken 512-key form" in line
    assert line.index("Helped by the far bytes") < line.index("repairs") < line.index("Hurt by them")


@pytest.mark.parametrize("block, ch", [(b, ch) for b, ch in readme.METHOD_BLOCKS.items() if ch.digits])
def test_recent_digits_line_names_exactly_the_family_outcomes(block, ch):
    """Each method the digits line puts under 'higher' or 'lower' against ALiBi and against YaRN carries that outcome
    in chapter 13's family at exactly the lengths named, and every counted difference of the family is named."""
    line = readme.methods_digits_line(ch)
    rows, methods = readme.methods_digits_rows(ch)
    learned, not_learned = findings.learned_methods(rows, methods)
    family = findings.retrieval_against_baselines(rows, learned)
    names = [findings.NAMES.get(m, m) for m in not_learned]
    listed = " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "none"  # "a, b and c"
    assert "not learned: " + listed + ". " in line
    assert "higher is better" in line and " higher:" not in line and " lower:" not in line
    for baseline, name in (("alibi", "ALiBi"), ("rope/yarn", "RoPE with YaRN")):
        part = line.split(f"Against {name}, ")[1].split(".")[0]
        for outcome, words in (("higher", "more accurate"), ("lower", "less accurate")):
            said = part.split(f"{words}: ")[1].split("; less accurate")[0]
            named = {(n, int(k)) for n, ks in re.findall(r"([^;()]+?) \(at ([^)]*)\)", said)
                     for k in re.findall(r"(\d+)x", ks)}
            these = family[(family["against"] == baseline) & (family["outcome"] == outcome)]
            expected = {(findings.NAMES.get(m, m), int(k)) for m, k in zip(these["method"], these["multiple"])}
            assert {(n.strip(), k) for n, k in named} == expected, (baseline, outcome)


@pytest.mark.parametrize("block, ch", list(readme.METHOD_BLOCKS.items()))
def test_recent_quality_and_growth_numbers_recomputed_from_the_results_table(block, ch):
    """The recent block's quality at 512 (each method over RoPE's and ALiBi's perplexity there) and growth (each
    model's perplexity at every longer length over its own at 512), recomputed with pandas from the committed rows:
    the seeds' geometric mean in non-overlapping windows. Every name with numbers in the two lines is checked, and
    every method (and the baselines' growth) appears; the recipe's caveat carries the run's layers, steps and bytes;
    the claim that no method grows less than ALiBi is checked against the same table."""
    import numpy as np
    import pandas as pd

    names = {**findings.NAMES, "rope/none": "RoPE"}
    new = results.rows(ch.run)
    methods = sorted({r["encoding"] for r in new})
    base = [r for r in results.rows(ch.base) if (r["encoding"], r["strategy"]) in
            {("alibi", "-"), ("rope", "none"), ("rope", "yarn"), ("nope", "-")}]
    df = pd.DataFrame(new + base)
    df = df[(df["eval_mode"] == "nonoverlapping") & (df["status"] == "ok")]
    df["who"] = np.where(df["strategy"].isin(["-", ""]), df["encoding"], df["encoding"] + "/" + df["strategy"])
    assert set(df.groupby("who")["seed"].nunique()) == {3}  # every geometric mean is over the same three seeds
    ppl = np.exp(df.pivot_table(index="who", columns="eval_len", values="perplexity",
                                aggfunc=lambda x: np.log(x).mean()))
    rope, alibi = ppl.loc["rope/none", 512], ppl.loc["alibi", 512]

    block = readme.generated_blocks(README.read_text(encoding="utf-8"))[block]
    quality = block.split("- Quality at the training length")[1].split("\n")[0]
    growth = block.split("- Growth past the training length")[1].split("\n")[0]

    # a name with its numbers follows ": ", ", " or " and " (no name holds a comma or a colon)
    pair = re.compile(r"(?:: |, | and )([^,:]+?) (\d\.\d\d)/(\d\.\d\d)(?![/\d])")
    said = {n: (a, b) for n, a, b in pair.findall(quality.split("The others")[1])}
    best = ppl.loc[methods, 512].idxmin()
    assert f"{names[best]} has the lowest perplexity, {ppl.loc[best, 512] / rope:.2f} of RoPE's and " \
           f"{ppl.loc[best, 512] / alibi:.2f} of ALiBi's" in quality
    expected = {names[m]: (f"{ppl.loc[m, 512] / rope:.2f}", f"{ppl.loc[m, 512] / alibi:.2f}")
                for m in methods if m != best}
    assert said == expected
    assert f"ALiBi is already {alibi / rope:.2f} times RoPE at 512" in quality
    assert f"NoPE, {ch.nope_is}, {ppl.loc['nope', 512] / rope:.2f} times" in quality
    config = results.load(ch.run)[2]["spec"]
    tokens = config["training"]["steps"] * config["training"]["batch_size"] * config["model"]["train_len"]
    assert (f"({config['model']['n_layer']} layers, {config['training']['steps']} steps on {tokens / 1e6:.1f} M "
            "bytes)") in quality

    own = ppl.div(ppl[512], axis=0)[[1024, 2048, 8192]]
    triple = re.compile(r"(?:: |, | and )([^,:]+?) (\d\.\d\d)/(\d\.\d\d)/(\d\.\d\d)")
    said = {n: tuple(g) for n, *g in triple.findall(growth)}
    expected = {names[m]: tuple(f"{own.loc[m, n]:.2f}" for n in own.columns)
                for m in methods + ["alibi", "rope/none", "rope/yarn"]}
    assert said == expected
    assert "at 1,024/2,048/8,192 over its own at 512" in growth
    flat = [names[m] for m in own.sort_values(8192).index if own.loc[m].max() <= 1.01 and m != "nope"]
    band = growth.split("At most 1 % at any length")[1].split(". ")[0]
    assert [n for n, *_ in triple.findall(band)] == flat  # least growth to 8,192 first

    tests = block.split("- The tests, at 8,192")[1].split("\n")[0]
    grows_less = [m for m in methods if (own.loc[m] < own.loc["alibi"]).any()]
    assert ("No method grows less than ALiBi at any length" in tests) == (not grows_less)
    assert f"RoPE with YaRN grows {own.loc['rope/yarn', 8192]:.2f} times by 8,192" in tests
    # the methods the tested line puts lower than YaRN at 8,192: is most of each gap (log scale) YaRN's growth?
    lower = tests.split("Against RoPE with YaRN at 8,192, lower: ")[1].split(";")[0]
    by_name = {names[m]: m for m in methods}
    shares = [np.log(own.loc[by_name[n], 8192] / own.loc["rope/yarn", 8192])
              / np.log(ppl.loc[by_name[n], 8192] / ppl.loc["rope/yarn", 8192])
              for n in re.findall(r"([^,]+?) \(\d\.\d\d\)(?:, |$)", lower)]
    assert shares
    assert ("for each method lower than it there, most of the gap is that growth" in tests) == (min(shares) > 0.5)


def test_no_page_says_the_rules_came_before_every_verdict():
    """The declared analysis was written before the fourth and fifth seeds were read, after three-seed verdicts had
    been published: the first pages say so, in chapter 10's words, and none says the rules preceded the verdicts."""
    pages = [README, INTRO, ROOT / "notebooks" / "00_tour.md", ROOT / "book" / "glossary.md"]
    for page in pages:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        assert not re.search(r"fixed before (the|these) (verdicts|answers)", text), page.name
        assert "declared before the fourth and fifth" in text, page.name
    for page in pages[:3]:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        assert "after three-seed" in text and "Chapter 10" in text, page.name


def test_run_block_says_what_each_differing_verdict_is_under_each_recipe():
    """Each verdict the other recipe decides otherwise is named with its verdict there and in the headline run."""
    side = findings.side_by_side({r: readme.rows_of(r) for r in (readme.HEADLINE, readme.OTHER_RECIPE)})
    block = readme.run_block()
    differ = [p for p in side.index if not side.loc[p, ("all runs", "same verdict")]]
    assert differ and f"{len(differ)} of the {len(side)} verdicts differ." in block
    sentences = [s for s in block.split(". ") if s.startswith("There ")]
    for part in differ:
        there, here = (findings.verdict_in_words(side.loc[part, (run, "verdict")]).lower().split(":")[0]
                       for run in (readme.OTHER_RECIPE, readme.HEADLINE))
        sentence = next(s for s in sentences if f'"{readme.SHORT[part]}"' in s)
        before, after = sentence.split("; in the headline run ")
        stem = lambda v: v.replace("does not hold", "do not hold").replace("holds", "hold")  # noqa: E731
        assert stem(there) in stem(before) and stem(here) in stem(after), (part, sentence)


def test_far_block_says_how_many_seeds_it_reads():
    seeds = sorted({r["seed"] for name, _ in readme.CONTEXTS.values() for r in results.read_json(name, "gain.json")})
    assert seeds == [0, 1, 2]  # the far-context runs read the first three seeds of the headline runs
    assert "It reads three seeds of the headline runs' models (seeds 0–2), where the verdicts above read five seeds." \
        in readme.far_block()


def test_sinusoids_first_is_said_against_the_break_at_the_first_length():
    """"Break first": the answer row says whether both growths to 1,024 are past the break (1.10), recomputed from
    the sliding-window rows with the seeds' geometric mean."""
    import math

    rows = [r for r in readme.rows_of(readme.HEADLINE) if r["eval_mode"] == "sliding" and r["status"] == "ok"]

    def growth(encoding, strategy):
        loss = {(r["seed"], r["eval_len"]): r["loss"] for r in rows
                if r["encoding"] == encoding and r["strategy"] == strategy}
        seeds = sorted({s for s, _ in loss})
        return math.exp(sum(loss[(s, 1024)] - loss[(s, 512)] for s in seeds) / len(seeds))

    sinusoids, rope = growth("sinusoidal", "-"), growth("rope", "none")
    row = next(line for line in readme.answer_block().splitlines() if line.startswith("| The sinusoids break first"))
    assert f"grows {findings._times(sinusoids)}-fold from 512 to 1,024, RoPE's grows {findings._times(rope)}-fold" in row
    both = "both are past the break (1.10) at 1,024, so first means the larger growth there"
    assert (both in row) == (min(sinusoids, rope) > 1.10) and both in row


def test_cpu_time_recomputed_from_the_committed_rows():
    """The README's time on two CPU cores: the other recipe's recorded unit seconds, training seconds (once a unit)
    and evaluation seconds, read with the csv module, scaled by the headline run's units."""
    import csv
    import json

    folder = ROOT / "results" / readme.OTHER_RECIPE
    with open(folder / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["device"] for r in rows} == {"cpu (x86_64, 2 threads)"}
    training = {(r["encoding"], r["seed"]): float(r["train_seconds"]) for r in rows}
    evaluation = sum(float(r["eval_seconds"] or 0) for r in rows)
    units = [json.loads(p.read_text()) for p in sorted((folder / "units").glob("*.json"))]
    headline = len(list((ROOT / "results" / readme.HEADLINE / "units").glob("*.json")))
    assert len(units) == len(training) == 15 and headline == 25
    total = sum(u["seconds"] for u in units)
    block = readme.generated_blocks(README.read_text(encoding="utf-8"))["cpu"]
    assert (f"took {total / 3600:.1f} hours for its 15 units on 2 CPU threads ({sum(training.values()) / 3600:.1f} h "
            f"training, {evaluation / 3600:.1f} h evaluation)") in block
    assert f"the headline run's 25 units take about {total / 3600 * 25 / 15:.1f} hours" in block
