"""Figures a reader can explore: a slider instead of a paragraph (plotly).

Each builder returns a ``plotly`` figure whose slider switches between precomputed settings (no
server, no kernel: it works in a static page). :func:`show` puts one in a notebook: on Colab through
plotly's own renderer; elsewhere as a ``<div>`` and a script that draws it with ``Plotly``. Nothing
is loaded from the network. The first figure a kernel shows carries plotly.js itself (:func:`library`),
so a saved notebook opened offline draws every figure in it. The built book loads its own copy of
plotly.js on every page and drops the embedded one (``book/_ext/posenc_plotly.py``). The numbers
drawn are the package's formulas: :func:`rope.scaled_inv_freq`, :func:`bias.alibi_slopes`,
:func:`bias.t5_bucket`.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("figures", "posenc_lab.lab.figures.interactive")

import json
import math
import sys

import torch

from posenc_lab import bias, rope

# The attribute that marks the embedded plotly.js, so that the book build can find and drop it.
LIBRARY_MARK = "data-posenc-plotlyjs"

_library_shown = False  # whether this kernel has already put plotly.js into a notebook output


def library() -> str:
    """plotly.js, inline, as one ``<script>`` marked with ``LIBRARY_MARK``: the copy the installed ``plotly``
    package bundles, about 5 MB. It defines ``window.Plotly`` only where the page has none yet."""
    from plotly.offline import get_plotlyjs

    return f"<script {LIBRARY_MARK}>if (!window.Plotly) {{\n{get_plotlyjs()}\n}}</script>\n"


def _slider(fig, steps: list[str], groups: list[list[int]], prefix: str, active: int = 0):
    """A slider whose step ``k`` shows the traces ``groups[k]`` and hides the others."""
    n = len(fig.data)
    fig.update_layout(sliders=[{
        "active": active, "currentvalue": {"prefix": prefix}, "pad": {"t": 40},
        "steps": [{"label": label, "method": "update",
                   "args": [{"visible": [i in group for i in range(n)]}]} for label, group in zip(steps, groups)],
    }])
    for i, trace in enumerate(fig.data):
        trace.visible = i in groups[active]
    return fig


def rope_wavelengths(*, dim: int = 32, train_len: int = 512, factor: float = 4.0,
                     bases=(100, 500, 2_000, 10_000, 50_000, 500_000),
                     strategies=("none", "pi", "ntk", "yarn", "llama3")):
    """RoPE's wavelength per pair (log scale) for every strategy at ``factor``, with a slider over the base; the
    training length and ``factor x`` it are drawn as lines (a pair below the first turns fully in training)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    groups = []
    for base in bases:
        group = []
        for strategy in strategies:
            freqs, _ = rope.scaled_inv_freq(strategy, dim, base=float(base), train_len=train_len,
                                            factor=None if strategy == "none" else factor)
            group.append(len(fig.data))
            fig.add_trace(go.Scatter(x=list(range(dim // 2)), y=rope.wavelengths(freqs).tolist(), mode="lines+markers",
                                     name="RoPE" if strategies == ("none",) else strategy, legendgroup=strategy))
        groups.append(group)
    for length, text in ((train_len, "L"), (factor * train_len, f"{factor:g} L")):
        fig.add_hline(y=length, line_dash="dot", line_color="grey", annotation_text=text)
    scaled = [name for name in strategies if name != "none"]
    fig.update_layout(title=f"wavelength of each pair, d = {dim}" + (f", strategies at s = {factor:g}" if scaled else ""),
                      xaxis_title="pair i (fast to slow)", yaxis_title="wavelength (positions)", yaxis_type="log",
                      height=460, margin={"l": 60, "r": 20, "t": 60, "b": 40})
    return _slider(fig, [f"{b:,}" for b in bases], groups, "base b = ", active=bases.index(10_000) if 10_000 in bases else 0)


def alibi_windows(*, head_counts=(2, 4, 8, 12, 16, 32), train_len: int = 512, share: float = 0.01):
    """Each ALiBi head's window, the distance where its bias factor falls to ``share`` (``ln(1/share) / mu_h``),
    on a log scale, with a slider over the number of heads; the training length as a line."""
    import plotly.graph_objects as go

    fig = go.Figure()
    groups = []
    for heads in head_counts:
        mu = bias.alibi_slopes(heads)
        groups.append([len(fig.data)])
        fig.add_trace(go.Bar(x=list(range(heads)), y=(math.log(1 / share) / mu).tolist(), name=f"H = {heads}",
                             hovertemplate="head %{x}: %{y:.1f} positions<extra></extra>"))
    fig.add_hline(y=train_len, line_dash="dot", line_color="grey", annotation_text=f"L = {train_len}")
    fig.update_layout(title=f"where each head's weight factor falls to {share:.0%}", xaxis_title="head h",
                      yaxis_title="distance m - n (positions)", yaxis_type="log", showlegend=False, height=440,
                      margin={"l": 60, "r": 20, "t": 60, "b": 40})
    return _slider(fig, [str(h) for h in head_counts], groups, "heads H = ",
                   active=head_counts.index(8) if 8 in head_counts else 0)


def t5_buckets(*, bucket_counts=(8, 16, 32, 64), max_distances=(32, 128, 512), longest: int = 2048):
    """T5's causal bucket of every distance ``0 .. longest`` (log distance axis), one curve per ``max_distance``,
    with a slider over the number of buckets."""
    import plotly.graph_objects as go

    fig = go.Figure()
    groups = []
    distance = torch.arange(longest + 1)
    for buckets in bucket_counts:
        group = []
        for top in max_distances:
            if top <= buckets // 2:
                continue
            group.append(len(fig.data))
            b = bias.t5_bucket(-distance, bidirectional=False, num_buckets=buckets, max_distance=top)
            # the step function through the first distance of each bucket (and the last distance)
            keep = torch.cat([torch.tensor([0]), (b.diff() != 0).nonzero().flatten() + 1, torch.tensor([longest])])
            fig.add_trace(go.Scatter(x=(distance[keep] + 1).tolist(), y=b[keep].tolist(), mode="lines+markers",
                                     line_shape="hv", name=f"max_distance {top}", legendgroup=str(top),
                                     customdata=distance[keep].tolist(),
                                     hovertemplate="from distance %{customdata}: bucket %{y}<extra></extra>"))
        groups.append(group)
    fig.update_layout(title="T5's bucket of each distance (causal)", xaxis_title="distance m - n + 1",
                      xaxis_type="log", yaxis_title="bucket", height=440, margin={"l": 60, "r": 20, "t": 60, "b": 40})
    return _slider(fig, [str(b) for b in bucket_counts], groups, "buckets = ",
                   active=bucket_counts.index(32) if 32 in bucket_counts else 0)


def alt_text(fig) -> str:
    """The figure's text for readers who cannot see it: its title, its axes and its slider."""
    layout = fig.layout
    parts = [f"Interactive figure: {layout.title.text or 'untitled'}"]
    if layout.xaxis.title.text and layout.yaxis.title.text:
        parts.append(f"{layout.yaxis.title.text} against {layout.xaxis.title.text}")
    if layout.sliders:
        parts.append(f"a slider sets {layout.sliders[0].currentvalue.prefix.strip(' =:')}")
    return "; ".join(parts) + "."


def html(fig, name: str, *, with_library: bool = False, alt: str | None = None) -> str:
    """The figure as a ``<div id=name>`` (an image to assistive technology, labelled ``alt`` or
    :func:`alt_text`) and a script that draws it with the page's ``Plotly``; with ``with_library``,
    :func:`library` comes first. Where the page has no ``Plotly``, the div says so in one line (no CDN is
    tried). Deterministic: the same figure gives the same text (``name`` is the div's id)."""
    import html as markup

    import plotly.io as pio

    spec = json.loads(pio.to_json(fig, validate=True, pretty=False))
    payload = json.dumps({"data": spec["data"], "layout": spec["layout"]}, sort_keys=True)
    label = markup.escape(alt or alt_text(fig), quote=True)
    return ((library() if with_library else "")
            + f'<div id="{name}" class="posenc-explore" role="img" aria-label="{label}" '
            f'style="width:100%;min-height:460px"></div>\n'
            f'<script>(function () {{\n'
            f'  var spec = {payload};\n'
            f'  if (window.Plotly) {{ Plotly.newPlot("{name}", spec.data, spec.layout, {{responsive: true}}); }}\n'
            f'  else {{ document.getElementById("{name}").textContent = '
            f'"plotly.js is not loaded: run this notebook\'s first interactive figure to draw this one."; }}\n'
            f'}})();</script>')


def show(fig, name: str, *, alt: str | None = None) -> None:
    """Display ``fig`` in a notebook: plotly's own renderer on Colab, :func:`html` everywhere else. The first
    figure shown in a kernel carries plotly.js (:func:`library`); the later ones use that copy."""
    global _library_shown
    if "google.colab" in sys.modules:
        fig.show()
        return
    from IPython.display import HTML, display

    display(HTML(html(fig, name, with_library=not _library_shown, alt=alt)))
    _library_shown = True
