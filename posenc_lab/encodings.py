"""Every position encoding as one object with the three hooks of a Transformer, and the registry.

An encoding enters a Transformer in at most one of three places:

============  =====================================================  ==============================
hook          what it does                                            encodings
============  =====================================================  ==============================
``embed``     adds a vector to each token embedding                   sinusoidal, learned
``rotate``    transforms queries and keys before the dot product      rope (+ scalings), xpos
``bias``      adds ``b[h, i, j]`` to each attention logit             alibi, t5, kerple, fire
(none)        nothing                                                 nope
============  =====================================================  ==============================

The attention backends (:mod:`posenc_lab.attention`) only need to know how to consume a bias:
as a tensor (``bias``), as a per-distance table (``distance_bias``) or as a FlexAttention
``score_mod``. ``ENCODINGS`` maps each name to its class; :func:`make_encoding` builds one from
the model's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import absolute, bias, rope
from .errors import PosencError, check_even, unknown_name


def position_span(positions: torch.Tensor) -> int:
    """``max(positions) + 1``, the size of the tables an encoding needs for ``positions``.

    Under ``torch.compile``, where reading a tensor's value would break the graph, positions are the
    model's ``0 .. n-1`` and the span is their number.
    """
    if torch.compiler.is_compiling():
        return positions.shape[-1]
    return int(positions.max()) + 1 if positions.numel() else 0


_CACHE_SLOTS = ("_cache", "_bias_cache")


class Encoding(nn.Module):
    """Base class: every hook defaults to "do nothing" (which is NoPE)."""

    name = "nope"
    hook = "none"
    #: True when the bias depends on the distance ``i - j`` only (then ``distance_bias`` is defined)
    distance_only = False

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` is ``b n d_model``; returns the embeddings with position information added."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q, k`` are ``b h n d``; returns them transformed."""
        return q, k

    @property
    def has_bias(self) -> bool:
        return self.hook == "bias"

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """``b[h, i, j]`` for every head, query and key position, or None."""
        return None

    def distance_bias(self, max_distance: int) -> torch.Tensor:
        """``b[h, d]`` for distances ``d = 0 .. max_distance - 1`` (only when ``distance_only``)."""
        raise NotImplementedError(f"{self.name} has no per-distance bias")

    def extra_repr(self) -> str:
        return f"hook={self.hook}"

    def per_forward(self, slot: str, positions: torch.Tensor, compute: Callable):
        """``compute()`` once per forward pass: reused while the same ``positions`` tensor comes back
        (the next layer), recomputed for a new one, after a parameter update or a change of grad
        mode. Bypassed under ``torch.compile``, which fuses the work instead."""
        if torch.compiler.is_compiling():
            return compute()
        key = (tuple(p._version for p in self.parameters()), torch.is_grad_enabled())
        cached = self.__dict__.get(slot)
        if cached is not None and cached[0] is positions and cached[1] == key:
            return cached[2]
        value = compute()
        self.__dict__[slot] = (positions, key, value)
        return value

    def __getstate__(self):
        # per-forward caches (tables, biases with their autograd graph) are not part of the encoding
        return {k: v for k, v in self.__dict__.items() if k not in _CACHE_SLOTS}


class NoPE(Encoding):
    """No position signal at all (Kazemnejad et al. 2023): a causal mask alone still lets a model infer position."""


class Sinusoidal(Encoding):
    """Fixed sinusoids added to the token embeddings (Vaswani et al. 2017); see :func:`absolute.sinusoidal_encoding`.

    The table is multiplied by ``scale``. Its entries have RMS ``1/sqrt(2)``, while our token
    embeddings start at std 0.02 (GPT-2); unscaled, the position signal would swamp the tokens.
    The default ``0.02 * sqrt(2)`` gives the sinusoids the RMS of a freshly initialised learned
    table, so sinusoidal and learned start on equal terms. (Vaswani et al. instead multiply the
    embeddings by ``sqrt(d_model)``; ``scale=1`` gives the unscaled table.)
    """

    name, hook = "sinusoidal", "embed"

    def __init__(self, d_model: int, *, base: float = 10000.0, scale: float = 0.02 * 2**0.5):
        super().__init__()
        check_even("d_model for sinusoidal positions", d_model)
        self.d_model, self.base, self.scale = d_model, base, scale

    def embed(self, x, positions):
        return x + (self.scale * absolute.sinusoidal_encoding(positions, self.d_model, self.base)).to(x.dtype)


class Learned(Encoding):
    """A learned vector per position up to the training length (GPT-2); past it, :class:`PositionOutOfRange`."""

    name, hook = "learned", "embed"

    def __init__(self, d_model: int, *, max_len: int):
        super().__init__()
        self.table = absolute.LearnedPositions(max_len, d_model)

    def embed(self, x, positions):
        return x + self.table(positions).to(x.dtype)


class RoPE(Encoding):
    """Rotary embedding with an extrapolation strategy (``scaling``) chosen at any time, e.g. at evaluation.

    ``scaling`` is a key of :data:`rope.ROPE_SCALINGS`; with ``factor=None`` the factor follows the
    sequence length (``max(1, n / train_len)``). ``dynamic-ntk`` is applied position-wise
    (:func:`rope.dynamic_ntk_angles`), as a model generating with a key/value cache sees it.
    """

    name, hook = "rope", "rotate"

    def __init__(self, head_dim: int, *, train_len: int, base: float = 10000.0, layout: str = "half",
                 scaling: str = "none", factor: float | None = None, **scaling_options):
        super().__init__()
        check_even("RoPE head dimension", head_dim)
        if layout not in rope.LAYOUTS:
            raise unknown_name("RoPE layout", layout, rope.LAYOUTS)
        self.head_dim, self.train_len, self.base, self.layout = head_dim, train_len, base, layout
        self.set_scaling(scaling, factor, **scaling_options)
        self._cache: tuple | None = None

    def set_scaling(self, method: str, factor: float | None = None, **options) -> "RoPE":
        """Switch the extrapolation strategy (no retraining); checks the arguments at once."""
        if method == "dynamic-ntk" and factor is not None:
            raise PosencError("dynamic-ntk derives its factor from the sequence length; use 'ntk' for a fixed factor")
        seq_len = self.train_len if method == "dynamic-ntk" else None
        rope.scaled_inv_freq(method, self.head_dim, base=self.base, train_len=self.train_len,
                             seq_len=seq_len, factor=factor, **options)
        self.scaling, self.factor, self.scaling_options = method, factor, options
        self._cache = None
        return self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos`` and ``sin`` tables (``n d/2``), attention factor included; built once per forward."""
        return self.per_forward("_cache", positions, lambda: self._cos_sin(positions))

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = position_span(positions)
        if self.scaling == "dynamic-ntk":
            angles, factor = rope.dynamic_ntk_angles(positions, self.head_dim, base=self.base, train_len=self.train_len), 1.0
        else:
            freqs, factor = rope.scaled_inv_freq(self.scaling, self.head_dim, base=self.base, train_len=self.train_len,
                                                 seq_len=max(n, 1), factor=self.factor, **self.scaling_options)
            angles = rope.rope_angles(positions, freqs)
        return (angles.cos() * factor).to(torch.float32), (angles.sin() * factor).to(torch.float32)

    def rotate(self, q, k, positions):
        cos, sin = self.cos_sin(positions)
        return rope.rotate(q, cos, sin, self.layout), rope.rotate(k, cos, sin, self.layout)

    def extra_repr(self):
        return f"head_dim={self.head_dim}, layout={self.layout}, base={self.base}, scaling={self.scaling}"


class XPos(Encoding):
    """xPos (Sun et al. 2022): RoPE plus a per-pair exponential decay with distance; see :func:`rope.apply_xpos`."""

    name, hook = "xpos", "rotate"

    def __init__(self, head_dim: int, *, base: float = 10000.0, scale_base: float = 512.0, gamma: float = 0.4,
                 layout: str = "half"):
        super().__init__()
        check_even("xPos head dimension", head_dim)
        self.freqs = rope.inv_freq(head_dim, base)
        self.scale_base, self.gamma, self.layout = scale_base, gamma, layout

    def rotate(self, q, k, positions):
        return rope.apply_xpos(q, k, positions, self.freqs, scale_base=self.scale_base, gamma=self.gamma,
                               layout=self.layout)


class _BiasEncoding(Encoding):
    hook = "bias"
    distance_only = True

    def distance_bias(self, max_distance: int) -> torch.Tensor:
        d = torch.arange(max_distance, device=self._device())
        return self.bias(d, torch.zeros(1, dtype=d.dtype, device=d.device))[:, :, 0]

    def _device(self) -> torch.device:
        return next(iter(self.parameters()), torch.empty(0)).device


class ALiBi(_BiasEncoding):
    """ALiBi (Press et al. 2022): ``b[h, i, j] = -m_h |i - j|`` with fixed slopes :func:`bias.alibi_slopes`."""

    name = "alibi"

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("slopes", bias.alibi_slopes(num_heads).to(torch.float32), persistent=False)

    def _device(self):
        return self.slopes.device

    def bias(self, q_pos, k_pos):
        return bias.alibi_bias(self.slopes, q_pos, k_pos)


class T5(_BiasEncoding):
    """T5 relative bias (Raffel et al. 2020): a learned scalar per head and log-spaced distance bucket."""

    name = "t5"

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False):
        super().__init__()
        self.table = bias.T5Bias(num_heads, num_buckets=num_buckets, max_distance=max_distance,
                                 bidirectional=bidirectional)
        self.distance_only = not bidirectional

    def bias(self, q_pos, k_pos):
        return self.table(q_pos, k_pos)


class Kerple(_BiasEncoding):
    """KERPLE-log (Chi et al. 2022): ``b[h, i, j] = -r1_h ln(1 + r2_h |i - j|)``, ``r1, r2`` learned."""

    name = "kerple"

    def __init__(self, num_heads: int, **options):
        super().__init__()
        self.kernel = bias.KerpleLog(num_heads, **options)

    def bias(self, q_pos, k_pos):
        return self.kernel(q_pos, k_pos)


class Fire(_BiasEncoding):
    """FIRE (Li et al. 2023): a learned MLP of the progressively normalised distance; depends on ``i`` too."""

    name = "fire"
    distance_only = False
    distance_bias = Encoding.distance_bias

    def __init__(self, num_heads: int, *, train_len: int = 512, **options):
        super().__init__()
        options.setdefault("init_threshold", float(train_len))
        self.fire = bias.FIRE(num_heads, **options)

    def bias(self, q_pos, k_pos):
        return self.fire(q_pos, k_pos)


ENCODINGS: dict[str, type[Encoding]] = {
    cls.name: cls for cls in (NoPE, Sinusoidal, Learned, RoPE, XPos, ALiBi, T5, Kerple, Fire)
}

# how each encoding is built from the model's shape: (d_model, num_heads, head_dim, train_len) -> kwargs
_SHAPE_ARGS: dict[str, Callable[[int, int, int, int], dict]] = {
    "nope": lambda d, h, hd, L: {},
    "sinusoidal": lambda d, h, hd, L: {"d_model": d},
    "learned": lambda d, h, hd, L: {"d_model": d, "max_len": L},
    "rope": lambda d, h, hd, L: {"head_dim": hd, "train_len": L},
    "xpos": lambda d, h, hd, L: {"head_dim": hd},
    "alibi": lambda d, h, hd, L: {"num_heads": h},
    "t5": lambda d, h, hd, L: {"num_heads": h},
    "kerple": lambda d, h, hd, L: {"num_heads": h},
    "fire": lambda d, h, hd, L: {"num_heads": h, "train_len": L},
}


def make_encoding(name: str, *, d_model: int, num_heads: int, train_len: int, **options) -> Encoding:
    """Build encoding ``name`` for a model of width ``d_model`` with ``num_heads`` heads, trained at ``train_len``."""
    if name not in ENCODINGS:
        raise unknown_name("encoding", name, ENCODINGS)
    bias.check_heads(num_heads)
    if d_model % num_heads:
        raise PosencError(f"d_model {d_model} is not divisible by the number of heads {num_heads}")
    kwargs = _SHAPE_ARGS[name](d_model, num_heads, d_model // num_heads, train_len)
    try:
        return ENCODINGS[name](**kwargs, **options)
    except TypeError as err:
        raise PosencError(f"encoding {name!r} got an unexpected option: {err}") from None
