"""Sphinx helper: the built book carries its own plotly.js, so the explorable figures draw offline.

The figures of :mod:`posenc_lab.lab.figures.interactive` are a ``<div>`` and a script that calls ``Plotly.newPlot``;
this extension copies the plotly.js bundled with the installed ``plotly`` package into the build's
``_static`` and loads it in every page's head, before any figure's script runs. No CDN is used.

A chapter's first figure also carries plotly.js inline, for the notebook opened offline
(:func:`posenc_lab.lab.figures.interactive.library`). The page already has the head's copy, so this extension drops
the inline one from the page: about 5 MB less per chapter page.
"""

from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx

NAME = "plotly.min.js"
MARK = "data-posenc-plotlyjs"  # posenc_lab.lab.figures.interactive.LIBRARY_MARK
_INLINE = re.compile(rf"<script {MARK}>.*?</script>\n?", re.DOTALL)


def _copy(app: Sphinx, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    from plotly.offline import get_plotlyjs

    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / NAME).write_text(get_plotlyjs(), encoding="utf-8")


def _drop_inline_copies(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    for raw in list(doctree.findall(nodes.raw)):
        text = raw.astext()
        if raw.get("format") == "html" and MARK in text:
            raw.replace_self(nodes.raw("", _INLINE.sub("", text), format="html", classes=raw.get("classes", [])))


def setup(app: Sphinx) -> dict:
    app.add_js_file(NAME)
    app.connect("doctree-resolved", _drop_inline_copies)
    app.connect("build-finished", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
