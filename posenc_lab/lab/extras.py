"""The optional extras of the package, and the one-line error for a missing one.

``pip install posenc-lab`` brings the core (torch, einops, numpy). The experiment's modules need the ``lab``
extra, the figures the ``figures`` extra (the ``book`` extra adds the book's tools to them); a module that needs one calls :func:`require` first, so
that a missing dependency reads as the install line that fixes it.
"""

from __future__ import annotations

import importlib.util

#: the third-party modules each extra brings (import names)
EXTRAS = {
    "lab": ("tqdm", "pandas", "scipy", "statsmodels"),
    "figures": ("matplotlib", "seaborn", "plotly"),
}


class MissingExtra(ImportError):
    """A part of posenc_lab needs an extra that is not installed."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str = "this part of posenc_lab") -> None:
    """Raise :class:`MissingExtra` naming the install line unless every module of ``extra`` is importable."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(f"{what} needs the [{extra}] extra (missing: {', '.join(absent)}): "
                           f"pip install 'posenc-lab[{extra}]'")
