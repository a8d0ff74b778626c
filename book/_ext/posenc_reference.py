"""Sphinx helpers for the package reference (book/reference): loaded through ``sphinx: local_extensions``.

* Docstrings name other objects the way the code does, relative to the package (``:func:`rope.apply_rope```,
  ``:class:`KVCache```, ``:meth:`Encoding.tables```), so that they read well in ``help()`` too. Sphinx resolves
  only names relative to the current module or fully qualified ones; a reference it cannot resolve is tried
  again as ``posenc_lab.<name>`` and then as the unique documented object whose full name ends in
  ``.<name>``. A name that matches nothing, or several objects, stays a warning (``-n`` fails the build).
* The registries (``ENCODINGS``, ``ROPE_SCALINGS``, ``BACKENDS``, ...) are documented without their
  values (``autodoc_default_options: no-value``): a dict of classes prints as a wall of reprs. Their keys
  (or a tuple's names, or a long string such as the decision rule), read from the live object, are appended
  to the doc comment instead, so the page never lists a stale name.
* A method whose only docstring would be inherited from torch (``nn.Module.forward``) is left out.
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

PACKAGE = "posenc_lab"


def _resolve(app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.Element):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not target:
        return None
    domain = env.get_domain("py")
    reftype = node["reftype"]
    # 1. relative to the package: rope.ROPE_SCALINGS -> posenc_lab.rope.ROPE_SCALINGS
    if not target.startswith(PACKAGE + "."):
        qualified = f"{PACKAGE}.{target}"
        if domain.find_obj(env, None, None, qualified, reftype, 0):
            return domain.resolve_xref(env, node["refdoc"], app.builder, reftype, qualified, node, contnode)
    # 2. a name a package re-exports: posenc_lab.attention -> posenc_lab.backends.attention,
    #    posenc_lab.backends.toeplitz -> posenc_lab.backends.masks.toeplitz
    full = target if target.startswith(PACKAGE + ".") else f"{PACKAGE}.{target}"
    parent, _, short = full.rpartition(".")
    if parent:
        import importlib

        try:
            obj = getattr(importlib.import_module(parent), short, None)
        except ImportError:
            obj = None
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if module and qualname and domain.find_obj(env, None, None, f"{module}.{qualname}", reftype, 0):
            return domain.resolve_xref(env, node["refdoc"], app.builder, reftype, f"{module}.{qualname}", node, contnode)
    # 3. the one documented object whose full name ends in .target (Encoding.tables, KVCache)
    matches = [name for name in domain.objects if name.startswith(PACKAGE + ".") and name.endswith("." + target)]
    if len(matches) == 1:
        return domain.resolve_xref(env, node["refdoc"], app.builder, reftype, matches[0], node, contnode)
    return None


def _rst_text(text: str) -> str:
    """``text`` as plain reStructuredText: the characters that start markup escaped."""
    return re.sub(r"([\\*`|_])", r"\\\1", text)


def _registry_keys(app: Sphinx, what: str, name: str, obj, options, lines: list[str]) -> None:
    """Append what ``no-value`` hides and a reader needs: a registry's keys, a tuple's names, a rule's words."""
    if what != "data" or not name.startswith(PACKAGE + "."):
        return
    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        lines.extend(["", "Keys: " + ", ".join(f"``{k}``" for k in obj) + "."])
    elif isinstance(obj, (tuple, list)) and obj and all(isinstance(v, str) for v in obj):
        lines.extend(["", "Values: " + ", ".join(f"``{v}``" for v in obj) + "."])
    elif isinstance(obj, str) and len(obj) > 40:
        lines.extend(["", _rst_text(obj)])


def _own_docstring(app: Sphinx, what: str, name: str, obj, skip: bool, options) -> bool | None:
    """Skip a method whose only docstring would be inherited from outside the package (``nn.Module.forward``'s)."""
    import inspect

    if not callable(obj) or getattr(obj, "__doc__", None) or skip:
        return None
    owner = getattr(obj, "__qualname__", "").rsplit(".", 1)[0]
    if owner == getattr(obj, "__qualname__", "") or not getattr(obj, "__module__", "").startswith(PACKAGE):
        return None
    module = inspect.getmodule(obj)
    cls = getattr(module, owner, None)
    if not inspect.isclass(cls):
        return None
    inherited = [base for base in cls.__mro__[1:] if name in vars(base) and getattr(vars(base)[name], "__doc__", None)]
    if inherited and not inherited[0].__module__.startswith(PACKAGE):
        return True
    return None


def setup(app: Sphinx) -> dict:
    app.connect("autodoc-skip-member", _own_docstring)
    app.connect("missing-reference", _resolve)
    app.connect("autodoc-process-docstring", _registry_keys)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
