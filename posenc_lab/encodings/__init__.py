"""Every position encoding as one object with the three hooks of a Transformer, and the registry.

An encoding enters a Transformer in at most one of three places:

============  =====================================================  ====================================
hook          what it does                                            encodings
============  =====================================================  ====================================
``embed``     adds a vector to each token embedding                   sinusoidal, learned
``rotate``    transforms queries and keys before the dot product      rope (+ scalings), xpos, fope, ssmax
``bias``      adds ``b[h, i, j]`` to each attention logit             alibi, t5, kerple, fire
(none)        nothing                                                 nope
============  =====================================================  ====================================

Two encodings read the tokens themselves (``reads_tokens``), each through a hook of its own: ``decay`` (FoX's
forget gates, read from the layer's input: ``sum_{l=j+1}^{i} log f_l`` added to each logit) and ``token_bias``
(CoPE's bias, computed from the queries and keys); every layer of a model has its own parameters
(:meth:`Encoding.for_layer`). PaTH (module ``householder``) reads the layer's input too, through ``householder``:
transforms accumulated between a key and its query, in place of ``q . k``. Stick-breaking attention (module
``stickbreaking``) changes the weighting itself (``weighting``, ``weights``): no position signal, and a
stick-breaking process over the keys in place of the softmax.

The attention backends (:mod:`posenc_lab.backends`) only need to know how to consume a bias:
as a tensor (``bias``), as a per-distance table (``distance_bias``) or as a FlexAttention
``score_mod``. A model asks its encoding once per forward pass for the :class:`Tables` its layers
share (:meth:`Encoding.tables`). ``ENCODINGS`` maps each name to its class; :func:`make_encoding`
builds one from the model's shape:

>>> from posenc_lab import ENCODINGS, ALiBi, make_encoding
>>> ENCODINGS["alibi"] is ALiBi, make_encoding("rope", head_dim=64, train_len=512).name
(True, 'rope')

The classes live by hook in the modules ``base`` (the hooks, NoPE),
``embedded``, ``rotary``, ``biases``, ``randomized``, ``fourier`` (FoPE), ``scaled`` (SSMax, whose factor
``s log n`` multiplies the queries), ``forgetting`` (FoX), ``contextual`` (CoPE), ``adaptive`` (DAPE: a network of
the logits and a base bias, through ``token_bias``), and the local/global layer mixes
of 2025's models in ``mixes`` (whose local layers carry their own ``window`` or ``chunk``); all are documented here.
:func:`rope_from_hf` (module ``huggingface``) builds the RoPE of a Hugging Face config's RoPE dict, by its
``rope_type``.
"""

from __future__ import annotations

import inspect

from ..errors import PosencError, check_heads, unknown_name
from .adaptive import DAPE, DAPEALiBi, DAPEFire, DAPEKerple, DAPELayer
from .base import Encoding, NoPE, Tables, position_span
from .biases import T5, ALiBi, Fire, Kerple
from .contextual import CoPE, CoPELayer
from .embedded import Learned, Sinusoidal, SinusoidalSmall
from .fourier import FoPE
from .forgetting import FoX, FoXLayer
from .householder import PaTH, PaTHFoX, PaTHLayer
from .huggingface import HF_ROPE_TYPES, rope_from_hf
from .mixes import Gemma3Layers, IRoPE, NoPETemperature, RNoPESWA, attn_temperature
from .randomized import RandomizedLearned, RandomizedRoPE
from .rotary import DYNAMIC_FORMS, PartialRoPE, PRoPE, RoPE, RoPEBase500, RoPEBase500k, RoPENoPELayers, XPos
from .scaled import SSMax, SSMaxRoPE
from .stickbreaking import StickBreaking

__all__ = [
    "DYNAMIC_FORMS", "ENCODINGS", "HF_ROPE_TYPES", "PRIMARY", "ALiBi", "CoPE", "CoPELayer", "DAPE", "DAPEALiBi",
    "DAPEFire", "DAPEKerple", "DAPELayer", "Encoding", "Fire", "FoPE",
    "FoX", "FoXLayer", "Gemma3Layers", "IRoPE", "Kerple", "Learned", "NoPE", "NoPETemperature", "PRoPE", "PartialRoPE",
    "RNoPESWA", "RandomizedLearned", "RandomizedRoPE", "RoPE", "RoPEBase500", "RoPEBase500k", "RoPENoPELayers", "SSMax",
    "SSMaxRoPE", "Sinusoidal", "SinusoidalSmall", "T5", "Tables", "XPos", "attn_temperature", "make_encoding",
    "position_span", "rope_from_hf", "strategies_of", "PaTH", "PaTHFoX", "PaTHLayer", "StickBreaking",
]


#: the one registry of encodings: name -> class (:func:`make_encoding` builds one from the model's shape)
ENCODINGS: dict[str, type[Encoding]] = {
    cls.name: cls for cls in (NoPE, Sinusoidal, SinusoidalSmall, Learned, RoPE, PartialRoPE, PRoPE, XPos, ALiBi, T5,
                              Kerple, Fire, RoPEBase500, RoPEBase500k, RoPENoPELayers, RandomizedRoPE,
                              RandomizedLearned, SSMax, SSMaxRoPE, FoPE, FoX, CoPE, NoPETemperature, IRoPE,
                              Gemma3Layers, RNoPESWA, StickBreaking, PaTH, PaTHFoX, DAPEALiBi, DAPEKerple, DAPEFire)
}


def strategies_of(name: str, strategies) -> tuple[str, ...]:
    """The RoPE strategies an experiment evaluates on a trained ``name``: ``strategies`` where the encoding has them
    (:attr:`Encoding.has_strategies`), ``("-",)`` (the model as trained) otherwise."""
    return tuple(strategies) if ENCODINGS[name].has_strategies else ("-",)


#: the encodings themselves, without their variants (the default of every experiment)
PRIMARY: tuple[str, ...] = tuple(name for name, cls in ENCODINGS.items() if cls.variant_of is None)


def make_encoding(name: str, *, d_model: int | None = None, num_heads: int | None = None,
                  head_dim: int | None = None, train_len: int | None = None, n_layer: int | None = None,
                  **options) -> Encoding:
    """Build encoding ``name`` from the shape of the model it goes into.

    Each encoding takes only what it uses (its class's ``shape``): RoPE and xPos the head dimension (``head_dim``,
    or ``d_model / num_heads``) and RoPE the training length, the biases the number of heads (FIRE the training
    length too), the absolute encodings ``d_model`` (the learned table ``train_len`` rows), FoX and CoPE the number
    of layers ``n_layer`` (each layer has its own gates or embeddings; default one). ``options`` go to the
    encoding's constructor (``scaling="yarn", factor=4.0`` for RoPE, ``bidirectional=True`` for T5, ...).

    >>> from posenc_lab import make_encoding
    >>> make_encoding("rope", d_model=256, num_heads=4, train_len=512, scaling="yarn", factor=4.0)
    RoPE(head_dim=64, layout=half, base=10000.0, scaling=yarn)
    """
    if name not in ENCODINGS:
        raise unknown_name("encoding", name, ENCODINGS)
    cls = ENCODINGS[name]
    if num_heads is not None:
        check_heads(num_heads)
    if head_dim is None and d_model is not None and num_heads is not None:
        if d_model % num_heads:
            raise PosencError(f"d_model {d_model} is not divisible by the number of heads {num_heads}")
        head_dim = d_model // num_heads
    known = {"d_model": d_model, "num_heads": num_heads, "head_dim": head_dim, "train_len": train_len,
             "n_layer": n_layer}
    kwargs = {arg: known[quantity] for arg, quantity in cls.shape.items() if known[quantity] is not None}
    missing = [quantity for arg, quantity in cls.shape.items() if arg not in kwargs and _required(cls, arg)]
    if missing:
        hint = " (or d_model and num_heads)" if "head_dim" in missing else ""
        raise PosencError(f"encoding {name!r} needs {', '.join(missing)}{hint}")
    try:
        return cls(**kwargs, **options)
    except TypeError as err:
        raise PosencError(f"encoding {name!r} got an unexpected option: {err}") from None


def _required(cls: type, argument: str) -> bool:
    """Whether ``cls``'s constructor has no default for ``argument``."""
    parameter = inspect.signature(cls).parameters.get(argument)
    return parameter is not None and parameter.default is inspect.Parameter.empty
