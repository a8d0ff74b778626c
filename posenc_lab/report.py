"""The results table summarised over seeds, as text and as figures (``python -m posenc_lab report``)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from .errors import PosencError


def label(row: dict) -> str:
    """``rope/yarn`` for a RoPE strategy, the encoding's name otherwise."""
    return row["encoding"] if row["strategy"] in ("-", "", None) else f"{row['encoding']}/{row['strategy']}"


def summarize(rows: list[dict], metric: str = "perplexity") -> dict:
    """``{mode: {label: {eval_len: (mean, std, n)}}}`` over seeds; NaN (cannot extrapolate) kept as NaN."""
    groups: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        groups[r["eval_mode"]][label(r)][int(r["eval_len"])].append(float(r[metric]))
    summary = {}
    for mode, by_label in groups.items():
        summary[mode] = {}
        for name, by_len in by_label.items():
            summary[mode][name] = {}
            for length, values in sorted(by_len.items()):
                mean = statistics.fmean(values)
                std = statistics.stdev(values) if len(values) > 1 and not math.isnan(mean) else 0.0
                summary[mode][name][length] = (mean, std, len(values))
    return summary


def _fmt(cell) -> str:
    mean, std, n = cell
    if math.isnan(mean):
        return "cannot extrapolate"
    return f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"


def markdown_table(rows: list[dict], mode: str, metric: str = "perplexity") -> str:
    """One Markdown table: a row per encoding (and RoPE strategy), a column per evaluation length."""
    summary = summarize(rows, metric)
    if mode not in summary:
        raise PosencError(f"no rows for evaluation mode {mode!r}")
    lengths = sorted({length for cells in summary[mode].values() for length in cells})
    seeds = max(cell[2] for cells in summary[mode].values() for cell in cells.values())
    head = f"| {metric} ({mode}{', mean ± std over seeds' if seeds > 1 else ''}) | " + " | ".join(map(str, lengths)) + " |"
    lines = [head, "|---" * (len(lengths) + 1) + "|"]
    for name in sorted(summary[mode]):
        cells = summary[mode][name]
        lines.append(f"| {name} | " + " | ".join(_fmt(cells[length]) if length in cells else "" for length in lengths) + " |")
    return "\n".join(lines)


def load(out: Path | str) -> tuple[list[dict], list[dict], dict]:
    """Rows, unit records and config of a run folder (or of a committed results folder)."""
    out = Path(out)
    if not (out / "results.json").exists():
        raise PosencError(f"{out} has no results.json: is it the --out folder of a finished or partial run?")
    rows = json.loads((out / "results.json").read_text())
    units = [json.loads(p.read_text()) for p in sorted((out / "units").glob("*.json"))]
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    return rows, units, config


def report(out: Path | str) -> str:
    """The text report of a run: a table for every evaluation mode (figures: :func:`plots.save_report_figures`)."""
    rows, units, config = load(out)
    if not rows:
        raise PosencError(f"{out} has no finished unit yet")
    modes = sorted({r["eval_mode"] for r in rows})
    first = rows[0]
    text = [f"# {Path(out).name}: preset {first['preset']}, corpus {first['corpus']} "
            f"(sha256 {first['corpus_sha256'][:12]}, Python {first['python']}), trained at {first['train_len']}, "
            f"device {first['device']}, torch {first['torch']}, commit {first['git_commit'][:12]}", ""]
    for mode in modes:
        text += [markdown_table(rows, mode), ""]
    text.append("bits per byte = loss / ln 2; perplexity = exp(loss), per byte.")
    return "\n".join(text)


# --------------------------------------------------------------------------------------------- claims

def _mean(summary_mode: dict, name: str, length: int) -> float:
    cell = summary_mode.get(name, {}).get(length)
    return cell[0] if cell else math.nan


def breaking_length(summary_mode: dict, name: str, tolerance: float = 1.10) -> int | None:
    """The first evaluation length whose perplexity exceeds ``tolerance`` times the one at the training length."""
    cells = summary_mode.get(name, {})
    lengths = sorted(cells)
    if not lengths:
        return None
    base = cells[lengths[0]][0]
    for length in lengths[1:]:
        if math.isnan(cells[length][0]) or cells[length][0] > tolerance * base:
            return length
    return None


def claims(rows: list[dict], mode: str) -> list[dict]:
    """The article's three claims and the ALiBi paper's ordering, each judged from ``rows`` in one evaluation mode.

    Every verdict states its criterion and the numbers it used, so a reader can disagree with the
    criterion without having to trust the conclusion.
    """
    s = summarize(rows, "perplexity")[mode]
    lengths = sorted({int(r["eval_len"]) for r in rows})
    train, longest = lengths[0], lengths[-1]
    out = []

    def growth(name):
        return _mean(s, name, longest) / _mean(s, name, train)

    alibi_t, rope_t = _mean(s, "alibi", train), _mean(s, "rope/none", train)
    candidates = [n for n in s if not n.startswith("rope/") or n == "rope/none"]
    candidates = [n for n in candidates if not math.isnan(_mean(s, n, longest))]
    most_stable = min(candidates, key=growth)
    out.append({
        "claim": "1. ALiBi is slightly worse than RoPE at the training length but the most stable beyond it",
        "criterion": f"(a) ALiBi's perplexity at {train} above RoPE's; (b) ALiBi has the smallest growth "
                     f"ppl({longest}) / ppl({train}) of all encodings that can run at {longest}",
        "numbers": f"at {train}: ALiBi {alibi_t:.3f}, RoPE {rope_t:.3f}; growth: "
                   + ", ".join(f"{n} {growth(n):.2f}" for n in sorted(candidates, key=growth)),
        "holds": {"a": alibi_t > rope_t, "b": most_stable == "alibi"},
    })
    beyond = [n for n in lengths if n > train]
    strategies = [n for n in s if n.startswith("rope/")]
    best = {n: min(strategies, key=lambda x: _mean(s, x, n)) for n in beyond}
    ntk_wins = sum(best[n] in ("rope/ntk", "rope/dynamic-ntk") for n in beyond)
    out.append({
        "claim": "2. RoPE with NTK-style scaling is the most accurate RoPE strategy past the training length",
        "criterion": "ntk or dynamic-ntk has the lowest perplexity among RoPE's strategies at every length beyond training",
        "numbers": "best strategy per length: " + ", ".join(f"{n}: {best[n].split('/')[1]} ({_mean(s, best[n], n):.3f})" for n in beyond),
        "holds": {"all lengths": ntk_wins == len(beyond), "lengths won": f"{ntk_wins} of {len(beyond)}"},
    })
    t5_g, rope_g, alibi_g = growth("t5"), growth("rope/none"), growth("alibi")
    out.append({
        "claim": "3. T5's bias extrapolates clearly worse than RoPE and ALiBi",
        "criterion": f"T5's growth ppl({longest}) / ppl({train}) above both RoPE's (no scaling) and ALiBi's",
        "numbers": f"growth: T5 {t5_g:.2f}, RoPE {rope_g:.2f}, ALiBi {alibi_g:.2f}; at {longest}: T5 "
                   f"{_mean(s, 't5', longest):.3f}, RoPE {_mean(s, 'rope/none', longest):.3f}, ALiBi {_mean(s, 'alibi', longest):.3f}",
        "holds": {"worse than RoPE": t5_g > rope_g, "worse than ALiBi": t5_g > alibi_g},
    })
    order = {n: breaking_length(s, n) for n in ("sinusoidal", "rope/none", "t5", "alibi")}
    never = longest * 2
    ranked = sorted(order, key=lambda n: order[n] or never)
    out.append({
        "claim": "ALiBi paper's ordering: sinusoidal breaks first, then rotary, T5 holds to about 2x, ALiBi stays flat",
        "criterion": "breaking length = first length whose perplexity exceeds 1.1x the training-length perplexity; "
                     "order by breaking length",
        "numbers": ", ".join(f"{n}: {order[n] or f'never (to {longest})'}" for n in ranked),
        "holds": {"ALiBi never breaks": order["alibi"] is None,
                  "sinusoidal first": order["sinusoidal"] is not None and order["sinusoidal"] == min(v or never for v in order.values()),
                  "T5 holds to 2x": order["t5"] is None or order["t5"] > 2 * train},
    })
    return out


def claims_text(rows: list[dict], mode: str, width: int = 76) -> str:
    """:func:`claims` as plain text, wrapped at ``width`` characters."""
    import textwrap

    lines = []
    for c in claims(rows, mode):
        verdict = "; ".join(f"{k}: {'holds' if v is True else 'does not hold' if v is False else v}" for k, v in c["holds"].items())
        lines += textwrap.wrap(c["claim"], width, subsequent_indent="   ")
        for name, text in (("criterion", c["criterion"]), (f"measured ({mode})", c["numbers"]), ("verdict", verdict)):
            lines += textwrap.wrap(f"{name}: {text}", width, initial_indent="  ", subsequent_indent="    ")
        lines.append("")
    return "\n".join(lines).rstrip()
