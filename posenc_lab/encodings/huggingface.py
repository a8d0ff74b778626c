"""Hugging Face's RoPE types by their names: a model config's RoPE dict as a :class:`~posenc_lab.encodings.RoPE`.

Each ``rope_type`` of ``transformers.modeling_rope_utils`` that the package implements maps onto a scaling of
:data:`~posenc_lab.rope.ROPE_SCALINGS`:

===========  =================  ===========================================================================
rope_type    scaling            training length ``train_len``, factor and options
===========  =================  ===========================================================================
``default``  ``none``           ``max_position_embeddings``
``linear``   ``pi``             ``max_position_embeddings``; ``factor``
``dynamic``  ``dynamic-ntk``    ``max_position_embeddings``; ``factor`` is the slope ``k`` of
                                ``s = 1 + k (n / L - 1)`` (:func:`~posenc_lab.rope.dynamic_ntk_factor`)
``yarn``     ``yarn``           ``original_max_position_embeddings``; ``factor``, ``beta_fast``, ``beta_slow``,
                                ``truncate``; the attention factor from ``attention_factor``, ``mscale`` and
                                ``mscale_all_dim``
``longrope`` ``longrope``       ``original_max_position_embeddings``; ``short_factor``, ``long_factor``,
                                ``factor`` and ``attention_factor``
``llama3``   ``llama3``         ``original_max_position_embeddings``; ``factor``, ``low_freq_factor``,
                                ``high_freq_factor``
===========  =================  ===========================================================================

>>> from posenc_lab import HF_ROPE_TYPES, rope_from_hf
>>> HF_ROPE_TYPES["linear"], rope_from_hf({"rope_type": "linear", "factor": 2.0}, 64, max_position_embeddings=4096)
('pi', RoPE(head_dim=64, layout=half, base=10000.0, scaling=pi))

``tests/test_golden.py`` checks every type against the frequencies and attention factors transformers computes
(``scripts/hf_rope_golden.py`` writes them).
"""

from __future__ import annotations

import math

from .. import rope
from ..errors import PosencError, unknown_name
from .rotary import DYNAMIC_FORMS, RoPE

#: every Hugging Face ``rope_type`` :func:`rope_from_hf` builds, with the package's scaling for it
HF_ROPE_TYPES = {"default": "none", "linear": "pi", "dynamic": "dynamic-ntk", "yarn": "yarn", "longrope": "longrope",
                 "llama3": "llama3"}
# each type's keys besides rope_type, rope_theta and partial_rotary_factor: (required, optional), as transformers
# validates them
_KEYS = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "yarn": ({"factor"}, {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
                          "mscale_all_dim", "truncate"}),
    "longrope": ({"short_factor", "long_factor"}, {"original_max_position_embeddings", "attention_factor", "factor"}),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor"}, {"original_max_position_embeddings"}),
}
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
#: transformers' default ``rope_theta``
DEFAULT_THETA = 10000.0


def rope_from_hf(rope_parameters: dict | None, head_dim: int, *, max_position_embeddings: int,
                 rope_theta: float | None = None, partial_rotary_factor: float | None = None,
                 original_max_position_embeddings: int | None = None, layout: str = "half",
                 dynamic: str = "sequence") -> RoPE:
    """The :class:`RoPE` encoding of a Hugging Face config's RoPE dict, with transformers' frequencies and attention
    factor.

    ``rope_parameters``: ``config.rope_parameters`` (transformers 5: ``rope_type``, ``rope_theta``, the type's own
    keys and perhaps ``partial_rotary_factor``) or ``config.rope_scaling`` (4.x: ``type`` or ``rope_type`` and the
    type's keys, with ``rope_theta`` and ``partial_rotary_factor`` passed here as the config holds them); None or
    ``{}`` is plain RoPE. ``rope_type`` is one of ``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope``,
    ``llama3`` (``HF_ROPE_TYPES`` maps them to the package's names). As transformers does:

    * a key of the dict wins over the same argument here (they must agree when both are given), ``rope_theta``
      defaults to 10,000 and the rotary dimension is ``int(head_dim * partial_rotary_factor)``;
    * ``original_max_position_embeddings`` defaults to ``max_position_embeddings``; given here (Phi-3 keeps it
      beside the dict), it wins over the dict's;
    * ``yarn``: a ``factor`` of None is ``max_position_embeddings / original_max_position_embeddings``;
      ``beta_fast``/``beta_slow`` unset or 0 are 32 and 1; the attention factor is ``attention_factor`` if set,
      else :func:`~posenc_lab.rope.yarn_mscale_ratio` when both ``mscale`` and ``mscale_all_dim`` are set and
      non-zero, else ``0.1 ln s + 1``. DeepSeek's models also multiply their softmax scale by
      ``(0.1 mscale_all_dim ln s + 1)^2``: a step of their attention, not of the rotation, left to the caller;
    * ``longrope``: a ``factor`` of None is the same ratio, and the long factors serve a sequence whose
      ``max(positions) + 1`` exceeds ``original_max_position_embeddings``;
    * ``dynamic``: transformers rotates each forward pass with the base for ``max(positions) + 1``, the
      ``"sequence"`` form (the default here; no key/value cache can serve it); ``dynamic="cache"`` gives each
      position the base of its own length, what transformers computes for tokens decoded one at a time. (transformers
      also keeps the base of a longer earlier call until a call shorter than ``max_position_embeddings``; the package
      derives each call's base from that call alone.)

    For positions ``(b, n)``, the length-following types choose per row (as attending row by row does), where
    transformers takes the largest position of the whole batch. An unknown ``rope_type``, a missing required key
    or a key the type does not read is a :class:`PosencError` naming what is allowed.

    >>> from posenc_lab import rope_from_hf
    >>> rope = rope_from_hf({"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
    ...                      "original_max_position_embeddings": 8192}, 128, max_position_embeddings=32768)
    >>> rope.scaling, rope.factor, rope.train_len, rope.base, round(rope.frequencies()[1], 4)
    ('yarn', 4.0, 8192, 500000.0, 1.1386)
    """
    params = dict(rope_parameters or {})
    kind = _rope_type(params)
    if kind not in HF_ROPE_TYPES:
        raise unknown_name("Hugging Face rope_type", kind, HF_ROPE_TYPES)
    required, optional = _KEYS[kind]
    missing = sorted(required - params.keys())
    if missing:
        raise PosencError(f"Hugging Face rope_type {kind!r} needs the keys {', '.join(sorted(required))}; "
                          f"missing: {', '.join(missing)}")
    unread = sorted(params.keys() - required - optional - _COMMON)
    if unread:
        allowed = sorted(required | optional | _COMMON)
        raise PosencError(f"Hugging Face rope_type {kind!r} does not read the keys {', '.join(unread)}; its keys: "
                          f"{', '.join(allowed)}")
    if dynamic not in DYNAMIC_FORMS:
        raise unknown_name("dynamic-NTK form", dynamic, DYNAMIC_FORMS)
    theta = _one_of(params, "rope_theta", rope_theta, DEFAULT_THETA)
    partial = _one_of(params, "partial_rotary_factor", partial_rotary_factor, 1.0)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise PosencError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    rotary_dim = int(head_dim * partial)
    original = original_max_position_embeddings or params.get("original_max_position_embeddings") \
        or max_position_embeddings
    common = {"base": float(theta), "layout": layout, "rotary_dim": rotary_dim}
    if kind == "default":
        return RoPE(head_dim, train_len=max_position_embeddings, **common)
    if kind == "linear":
        return RoPE(head_dim, train_len=max_position_embeddings, scaling="pi", factor=params["factor"], **common)
    if kind == "dynamic":
        return RoPE(head_dim, train_len=max_position_embeddings, scaling="dynamic-ntk", dynamic=dynamic,
                    slope=params["factor"], **common)
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        factor = max_position_embeddings / original
    if kind == "llama3":
        return RoPE(head_dim, train_len=original, scaling="llama3", factor=factor, original_len=original,
                    low_freq_factor=params["low_freq_factor"], high_freq_factor=params["high_freq_factor"], **common)
    if kind == "longrope":
        return RoPE(head_dim, train_len=original, scaling="longrope", factor=factor,
                    short_factor=list(params["short_factor"]), long_factor=list(params["long_factor"]),
                    mscale=params.get("attention_factor"), **common)
    return RoPE(head_dim, train_len=original, scaling="yarn", factor=factor,
                beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
                truncate=params.get("truncate", True), mscale=hf_yarn_attention_factor(params, factor), **common)


def hf_yarn_attention_factor(params: dict, factor: float) -> float:
    """The attention factor transformers gives YaRN with ``params`` and the factor ``s``: ``attention_factor`` if
    set, :func:`~posenc_lab.rope.yarn_mscale_ratio` when ``mscale`` and ``mscale_all_dim`` are both set and
    non-zero (one of them alone is ignored), else :func:`~posenc_lab.rope.yarn_attention_factor`."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return rope.yarn_mscale_ratio(factor, mscale, mscale_all_dim)
    return rope.yarn_attention_factor(factor)


def _rope_type(params: dict) -> str:
    """The dict's ``rope_type`` (or its 4.x spelling ``type``; the two must agree), ``default`` when absent."""
    kinds = {params[key] for key in ("rope_type", "type") if params.get(key) is not None}
    if len(kinds) > 1:
        raise PosencError(f"the RoPE dict names two types: rope_type={params['rope_type']!r} and "
                          f"type={params['type']!r}")
    return kinds.pop() if kinds else "default"


def _one_of(params: dict, key: str, given, default):
    """The dict's ``key``, or ``given``, or ``default``; the dict and ``given`` must agree when both are set."""
    inside = params.get(key)
    if inside is not None and given is not None and not math.isclose(float(inside), float(given), rel_tol=1e-12):
        raise PosencError(f"{key} is {inside!r} in the RoPE dict but {given!r} as an argument: pass one of them")
    return inside if inside is not None else given if given is not None else default
