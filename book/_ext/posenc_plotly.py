"""Sphinx helper: the built book carries its own plotly.js, so the explorable figures draw offline.

The figures of :mod:`posenc_lab.explore` are a ``<div>`` and a script that calls ``Plotly.newPlot``;
this extension copies the plotly.js bundled with the installed ``plotly`` package into the build's
``_static`` and loads it in every page's head, before any figure's script runs. No CDN is used.
"""

from __future__ import annotations

from pathlib import Path

from sphinx.application import Sphinx

NAME = "plotly.min.js"


def _copy(app: Sphinx, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    from plotly.offline import get_plotlyjs

    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / NAME).write_text(get_plotlyjs(), encoding="utf-8")


def setup(app: Sphinx) -> dict:
    app.add_js_file(NAME)
    app.connect("build-finished", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
