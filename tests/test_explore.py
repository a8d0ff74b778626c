"""The explorable figures: the numbers are the package's formulas, the sliders switch settings."""

import html as html_text
import json
import math

import pytest
import torch

from posenc_lab import bias, rope
from posenc_lab.lab.figures import interactive as explore


def visible_after(fig, step):
    return fig.layout.sliders[0].steps[step].args[0]["visible"]


def test_rope_wavelengths_are_the_strategies_wavelengths_at_each_base():
    bases, strategies = (500, 10_000), ("none", "pi", "yarn")
    fig = explore.rope_wavelengths(dim=16, train_len=64, factor=4.0, bases=bases, strategies=strategies)
    assert len(fig.data) == len(bases) * len(strategies) and len(fig.layout.sliders[0].steps) == len(bases)
    for b, base in enumerate(bases):
        shown = [i for i, v in enumerate(visible_after(fig, b)) if v]
        assert shown == list(range(b * 3, b * 3 + 3))
        for i, strategy in zip(shown, strategies):
            freqs, _ = rope.scaled_inv_freq(strategy, 16, base=float(base), train_len=64,
                                            factor=None if strategy == "none" else 4.0)
            assert fig.data[i].y == pytest.approx((2 * math.pi / freqs).tolist())
    assert [t.visible for t in fig.data] == visible_after(fig, bases.index(10_000))  # opens at b = 10,000


def test_alibi_windows_are_ln_100_over_each_slope():
    fig = explore.alibi_windows(head_counts=(4, 8))
    assert fig.data[1].y == pytest.approx((math.log(100) / bias.alibi_slopes(8)).tolist())
    assert visible_after(fig, 0) == [True, False]


def test_t5_buckets_step_where_the_bucket_changes():
    fig = explore.t5_buckets(bucket_counts=(32,), max_distances=(128,), longest=1000)
    trace = fig.data[0]
    full = bias.t5_bucket(-torch.arange(1001), bidirectional=False, num_buckets=32, max_distance=128)
    for x, y in zip(trace.x, trace.y):  # each point: the first distance of its bucket
        assert full[x - 1] == y and (x == 1 or full[x - 2] != y or x - 1 == 1000)
    assert set(trace.y) == set(full.tolist())


def test_html_is_deterministic_and_draws_with_the_pages_plotly():
    fig = explore.alibi_windows(head_counts=(2, 4))
    a, b = explore.html(fig, "fig-a"), explore.html(explore.alibi_windows(head_counts=(2, 4)), "fig-a")
    assert a == b and '<div id="fig-a"' in a and 'Plotly.newPlot("fig-a"' in a
    assert "if (window.Plotly)" in a and "http" not in a  # no CDN: without a Plotly, the div says so
    assert explore.LIBRARY_MARK not in a
    spec = json.loads(a.split("var spec = ", 1)[1].split(";\n", 1)[0])
    assert len(spec["data"]) == 2 and spec["layout"]["sliders"][0]["steps"][1]["label"] == "4"


def test_library_is_the_installed_plotly_js_inline():
    from plotly.offline import get_plotlyjs

    lib = explore.library()
    assert lib.startswith(f"<script {explore.LIBRARY_MARK}>if (!window.Plotly) {{") and get_plotlyjs() in lib
    assert lib.count("</script>") == 1 and "<script src" not in lib  # one script, nothing fetched
    fig = explore.alibi_windows(head_counts=(2,))
    assert explore.html(fig, "f", with_library=True) == lib + explore.html(fig, "f")


def test_show_embeds_plotly_js_in_the_first_figure_of_a_kernel_only(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    monkeypatch.setattr(explore, "_library_shown", False)  # a fresh kernel
    explore.show(explore.alibi_windows(head_counts=(2,)), "fig-b")
    explore.show(explore.alibi_windows(head_counts=(4,)), "fig-c")
    assert len(shown) == 2 and '<div id="fig-b"' in shown[0].data and '<div id="fig-c"' in shown[1].data
    assert [explore.LIBRARY_MARK in s.data for s in shown] == [True, False]


def test_an_explorable_figure_is_an_image_with_alt_text():
    fig = explore.t5_buckets()
    text = explore.html(fig, "fig-x")
    assert 'role="img"' in text and f'aria-label="{html_text.escape(explore.alt_text(fig))}"' in text
    assert explore.alt_text(fig) == ("Interactive figure: T5's bucket of each distance (causal); bucket against "
                                     "distance m - n + 1; a slider sets buckets.")
    assert 'aria-label="a &quot;quoted&quot; label"' in explore.html(fig, "fig-y", alt='a "quoted" label')


def test_plain_rope_wavelengths_name_no_strategy():
    fig = explore.rope_wavelengths(dim=32, train_len=512, strategies=("none",))
    assert "strategies" not in fig.layout.title.text and {t.name for t in fig.data} == {"RoPE"}
