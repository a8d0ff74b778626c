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

The attention backends (:mod:`posenc_lab.backends`) only need to know how to consume a bias:
as a tensor (``bias``), as a per-distance table (``distance_bias``) or as a FlexAttention
``score_mod``. ``ENCODINGS`` maps each name to its class; :func:`make_encoding` builds one from
the model's shape.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable

import torch
from torch import nn

from . import absolute, bias, rope
from .errors import PosencError, PositionOutOfRange, check_even, unknown_name


def position_span(positions: torch.Tensor) -> int:
    """``max(positions) + 1``, the size of the tables an encoding needs for ``positions``.

    Under ``torch.compile``, where reading a tensor's value would break the graph, positions are the
    model's ``0 .. n-1`` and the span is their number.
    """
    if torch.compiler.is_compiling():
        return positions.shape[-1]
    return int(positions.max()) + 1 if positions.numel() else 0


_MEMO = "_memo"


def _frozen(value):
    """A copy of ``value`` that no later edit of the original reaches (tensors cloned, lists and dicts copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_frozen(v) for v in value)
    return value


def _same(a, b) -> bool:
    """Whether ``a`` and ``b`` hold the same values (tensors: dtype, shape, device and every element)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception:  # values that cannot be compared count as changed
        return False


def _version(t: torch.Tensor) -> int | None:
    """The version counter of ``t`` (bumped by every in-place change); None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


def _tensors_of(value) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(t for t in value if isinstance(t, torch.Tensor))


class _Entry:
    """One memoised value and everything it was computed from (see :meth:`Encoding.memo`)."""

    __slots__ = ("mode", "inputs", "state", "attributes", "value", "versions", "alive")

    def __init__(self, mode, inputs, encoding, value):
        self.mode = mode
        self.inputs = tuple((weakref.ref(t), t.detach().clone()) for t in inputs)
        self.state = tuple((name, weakref.ref(t), _version(t), t.data_ptr(), t.requires_grad, t.detach().clone())
                           for name, t in encoding.memo_state())
        self.attributes = _frozen(encoding.memo_attributes())
        self.value = value
        self.versions = tuple(_version(t) for t in _tensors_of(value))
        self.alive = [True]
        for t in _tensors_of(value):
            if t.requires_grad:  # a backward pass frees the graph the value carries: it may not serve again
                t.register_hook(functools.partial(_spent, self.alive))

    def serves(self, mode, inputs, encoding) -> bool:
        grad = mode[1]
        if mode != self.mode or not self.alive[0] or len(inputs) != len(self.inputs):
            return False
        if any(_version(t) != v for t, v in zip(_tensors_of(self.value), self.versions)):
            return False  # the value itself was edited in place (through a view of it)
        for t, (ref, saved) in zip(inputs, self.inputs):
            if (grad and ref() is not t) or not _same(saved, t):
                return False  # a graph is shared by one forward pass only: the very same positions tensor
        state = encoding.memo_state()
        if len(state) != len(self.state):
            return False
        for (name, t), (saved_name, ref, version, ptr, requires_grad, saved) in zip(state, self.state):
            if name != saved_name or t.requires_grad != requires_grad or not _same(saved, t):
                return False
            if grad and (ref() is not t or _version(t) != version or t.data_ptr() != ptr):
                return False  # the graph holds this very parameter, as it was
        return _same(self.attributes, encoding.memo_attributes())


def _spent(alive: list, grad):
    alive[0] = False


def _mode(tensors) -> tuple:
    device = tensors[0].device.type if tensors else "cpu"
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return torch.is_inference_mode_enabled(), autocast


class Encoding(nn.Module):
    """Base class: every hook defaults to "do nothing" (which is NoPE)."""

    name = "nope"
    hook = "none"
    #: True when the bias depends on the signed distance ``i - j`` only (then ``distance_bias`` is defined)
    distance_only = False
    #: for a variant of another encoding (a different recipe of the same idea), that encoding's name
    variant_of: str | None = None
    #: what :func:`make_encoding` hands the constructor from the model's shape: ``{argument: quantity}``, the
    #: quantities being ``d_model``, ``num_heads``, ``head_dim`` and ``train_len``
    shape: dict[str, str] = {}

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` is ``b n d_model``; returns the embeddings with position information added."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q, k`` are ``b h n d``; returns them transformed."""
        return q, k

    def rotate_one(self, x: torch.Tensor, positions: torch.Tensor, role: str) -> torch.Tensor:
        """Transform queries (``role="q"``) or keys (``role="k"``) alone: a key/value cache rotates each
        key once, when it enters the cache, and each new query at its own position."""
        return x

    def for_layer(self, layer: int, n_layer: int) -> "Encoding":
        """The encoding layer ``layer`` (of ``n_layer``) attends with: the same one in every layer, except in
        variants that leave some layers without position (:class:`RoPENoPELayers`)."""
        return self

    def forward_positions(self, positions: torch.Tensor, training: bool) -> torch.Tensor:
        """The positions a forward pass without a cache gives its tokens (``training``: in training mode):
        ``positions`` itself, except in the randomized variants (:class:`RandomizedRoPE`,
        :class:`RandomizedLearned`)."""
        return positions

    @property
    def has_bias(self) -> bool:
        """Whether the encoding enters through the ``bias`` hook."""
        return self.hook == "bias"

    #: whether a key/value cache can serve the encoding (not when every step re-rotates every key)
    cacheable = True

    #: whether the encoding has a defined form for non-causal (bidirectional) attention
    noncausal = True
    #: how to build the encoding's non-causal form, where an option gives one (said in the error otherwise)
    noncausal_hint = ""
    #: whether an experiment evaluates RoPE's extrapolation strategies on the trained model (plain RoPE; its variants
    #: are evaluated as trained)
    has_strategies = False

    def score_mod(self, positions: Callable) -> Callable | None:
        """The bias as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` of the encoding's own, given
        ``positions(q_idx, kv_idx) -> (i, j)``; None lets the backend build one from :meth:`bias` (a per-distance
        table when ``distance_only``, else the whole bias gathered), which serves any bias encoding."""
        return None

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """``b[h, i, j]`` for every head, query and key position, or None."""
        return None

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor:
        """``b[h, k]``: the bias at each signed distance ``distances[k] = m - n`` (only when ``distance_only``)."""
        raise NotImplementedError(f"{self.name} has no per-distance bias")

    def distance_only_at(self, q_pos: torch.Tensor) -> bool:
        """Whether, for these query positions, the bias depends on the distance alone."""
        return self.distance_only

    def extra_repr(self) -> str:
        return f"hook={self.hook}"

    def needs_grad(self) -> bool:
        """Whether what the encoding computes now takes part in autograd (grad mode and a learned parameter)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    def memo(self, slot: str, tensors: tuple[torch.Tensor, ...], extra, compute: Callable):
        """``compute()`` once, reused only while everything it depends on is unchanged.

        The contract: an entry serves again only if (1) the ``tensors`` (the positions) hold the same
        values, dtype and device, and, when the value carries an autograd graph, are the very same
        objects (the layers of one forward pass) and no backward pass has run through it yet; (2) every
        parameter and buffer of the encoding and its submodules holds the same values (compared with
        a private copy, which catches writes through ``.data``, ``load_state_dict``, new parameter
        objects and dtype round trips), and, with a graph, is the same object at the same version and
        storage (held by weak reference: a new tensor at a freed address never matches); (3) every
        plain attribute of the encoding and its submodules (``base``, ``factor``, ``max_distance``,
        options dicts) equals a copy taken when the value was computed, so setting one directly is
        safe; (4) ``extra``, grad mode (with a parameter that requires grad), inference mode and
        autocast are the same; and (5) the value itself has not been edited in place. It never hands
        the memoised value to a caller outside the package: :meth:`~posenc_lab.encodings.RoPE.cos_sin`,
        :meth:`~posenc_lab.encodings.RoPE.spread_tables`, :func:`~posenc_lab.backends.bias_mask` and
        :func:`~posenc_lab.backends.bias_tensor` return copies. Bypassed under ``torch.compile``, which
        fuses the work instead.
        """
        if torch.compiler.is_compiling():
            return compute()
        mode = (extra, self.needs_grad()) + _mode(tensors)
        store = self.__dict__.setdefault(_MEMO, {})
        entry = store.get(slot)
        if entry is not None and entry.serves(mode, tensors, self):
            return entry.value
        value = compute()
        store[slot] = _Entry(mode, tensors, self, value)
        return value

    def memo_state(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors a memoised value depends on: every parameter and buffer, with its name."""
        return [(f"{prefix}.{name}", t) for prefix, module in self.named_modules()
                for tensors in (module._parameters, module._buffers) for name, t in tensors.items() if t is not None]

    def memo_attributes(self) -> list[tuple[str, str, object]]:
        """The plain attributes a memoised value depends on: ``(module, name, value)`` of every public one."""
        return [(prefix, name, value) for prefix, module in self.named_modules()
                for name, value in module.__dict__.items() if name[0] != "_" and name != "training"]

    def clear_cache(self) -> None:
        """Drop every memoised table and bias (they are rebuilt on the next call)."""
        self.__dict__.pop(_MEMO, None)

    def __getstate__(self):
        # memoised tables and biases (with their autograd graph) are not part of the encoding
        return {k: v for k, v in self.__dict__.items() if k != _MEMO}


class NoPE(Encoding):
    """No position signal at all (Kazemnejad et al. 2023): a causal mask alone still lets a model infer position."""


class Sinusoidal(Encoding):
    """Fixed sinusoids added to the token embeddings (Vaswani et al. 2017); see :func:`absolute.sinusoidal_encoding`.

    ``embed(x) = token_scale * x + scale * PE``. The defaults follow the recipe of the papers'
    code: Vaswani et al. (2017, sec. 3.4) multiply the token embeddings by ``sqrt(d_model)`` and add
    the unit-amplitude table (entries in ``[-1, 1]``, RMS ``1/sqrt(2)``), and so does fairseq's
    Transformer language model, which the ALiBi paper (Press et al. 2022) trained its sinusoidal
    baseline with (``embed_scale = sqrt(d)``, ``SinusoidalPositionalEmbedding``). We keep the paper's
    frequencies ``theta_i = b ** (-2i/d)`` and interleaved layout; fairseq's table uses the exponent
    ``i / (d/2 - 1)`` and ``[sin | cos]`` halves, a fixed permutation and a slightly different
    spread of frequencies, not a different amount of position signal. Our token embeddings keep the
    GPT-2 initialisation of every other encoding (std 0.02), so at initialisation the sinusoids are
    about 3x the scaled tokens; fairseq initialises tokens at std ``d ** -0.5``.

    The variant :class:`SinusoidalSmall` (``sinusoidal-small``) is the table scaled to RMS 0.02 with
    unscaled tokens, which this project used before: its position signal shrinks relative to the
    tokens as they grow during training.
    """

    name, hook = "sinusoidal", "embed"
    shape = {"d_model": "d_model"}

    def __init__(self, d_model: int, *, base: float = 10000.0, scale: float = 1.0, token_scale: float | None = None):
        super().__init__()
        check_even("d_model for sinusoidal positions", d_model)
        self.d_model, self.base, self.scale = d_model, base, scale
        self.token_scale = d_model**0.5 if token_scale is None else token_scale

    def embed(self, x, positions):
        pe = (self.scale * absolute.sinusoidal_encoding(positions, self.d_model, self.base)).to(x.dtype)
        return (x * self.token_scale if self.token_scale != 1 else x) + pe

    def extra_repr(self) -> str:
        return f"hook=embed, scale={self.scale:g}, token_scale={self.token_scale:g}"


class SinusoidalSmall(Sinusoidal):
    """Sinusoids scaled to the RMS of a fresh GPT-2 embedding (``0.02 * sqrt(2) * PE``), tokens unscaled.

    The amplitude variant of :class:`Sinusoidal`: both start on equal terms with a learned table
    (std 0.02), but the position signal stays fixed while the trained token embeddings grow.
    """

    name, variant_of = "sinusoidal-small", "sinusoidal"

    def __init__(self, d_model: int, *, base: float = 10000.0):
        super().__init__(d_model, base=base, scale=0.02 * 2**0.5, token_scale=1.0)


class Learned(Encoding):
    """A learned vector per position up to the training length (GPT-2); past it, :class:`PositionOutOfRange`."""

    name, hook = "learned", "embed"
    shape = {"d_model": "d_model", "max_len": "train_len"}

    def __init__(self, d_model: int, *, max_len: int):
        super().__init__()
        self.table = absolute.LearnedPositions(max_len, d_model)

    @property
    def max_positions(self) -> int:
        """The number of positions the table has: positions ``0 .. max_positions - 1``."""
        return self.table.max_len

    def embed(self, x, positions):
        return x + self.table(positions).to(x.dtype)


class RoPE(Encoding):
    """Rotary embedding with an extrapolation strategy (``scaling``) chosen at any time, e.g. at evaluation.

    ``scaling`` is a key of :data:`rope.ROPE_SCALINGS`; with ``factor=None`` the factor follows the
    sequence length (``max(1, n / train_len)``). ``dynamic-ntk`` comes in the two forms deployed
    models use (``dynamic``):

    * ``"cache"`` (default): position-wise, the token at position ``p`` is rotated with the base for
      length ``p + 1`` (:func:`rope.dynamic_ntk_angles`): what a model generating one token at a time
      with a key/value cache computes, each key keeping the rotation it got when it entered the cache
      (a prompt counts as if it had been fed one token at a time; some implementations instead rotate
      a whole prompt with the base of its length);
    * ``"sequence"``: every position is rotated with the base for the whole current length
      (``max(positions) + 1``): what a fresh forward pass over the sequence computes.

    The tables are computed in float64 and applied in the input's precision, float32 or better.

    Two options restrict the rotation to part of the head (the variants :class:`PartialRoPE` and
    :class:`PRoPE` set them): ``rotary_dim`` rotates only the first ``rotary_dim`` coordinates, with
    frequencies ``base ** (-2 i / rotary_dim)`` over them (the full range on fewer coordinates), and
    passes the rest through; ``kept_pairs`` keeps the rotation of the ``kept_pairs`` fastest pairs and
    sets ``theta_i = 0`` for the slower ones (they carry no position).
    """

    name, hook = "rope", "rotate"
    has_strategies = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.has_strategies = cls.variant_of is None
    shape = {"head_dim": "head_dim", "train_len": "train_len"}

    def __init__(self, head_dim: int, *, train_len: int, base: float = 10000.0, layout: str = "half",
                 scaling: str = "none", factor: float | None = None, dynamic: str = "cache",
                 rotary_dim: int | None = None, kept_pairs: int | None = None, **scaling_options):
        super().__init__()
        check_even("RoPE head dimension", head_dim)
        if layout not in rope.LAYOUTS:
            raise unknown_name("RoPE layout", layout, rope.LAYOUTS)
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        check_even("RoPE rotary dimension", rotary_dim)
        if rotary_dim > head_dim:
            raise PosencError(f"RoPE rotary dimension {rotary_dim} exceeds the head dimension {head_dim}")
        kept_pairs = rotary_dim // 2 if kept_pairs is None else kept_pairs
        if isinstance(kept_pairs, bool) or not isinstance(kept_pairs, int) or not 0 <= kept_pairs <= rotary_dim // 2:
            raise PosencError(f"RoPE kept_pairs must be an integer from 0 to {rotary_dim // 2}, got {kept_pairs!r}")
        self.head_dim, self.train_len, self.base, self.layout = head_dim, train_len, base, layout
        self.rotary_dim, self.kept_pairs = rotary_dim, kept_pairs
        self.set_scaling(scaling, factor, dynamic=dynamic, **scaling_options)

    def set_scaling(self, method: str, factor: float | None = None, *, dynamic: str | None = None, **options) -> "RoPE":
        """Switch the extrapolation strategy (no retraining); checks the arguments at once."""
        if method == "dynamic-ntk" and factor is not None:
            raise PosencError("dynamic-ntk derives its factor from the sequence length; use 'ntk' for a fixed factor")
        dynamic = dynamic or getattr(self, "dynamic", "cache")
        if dynamic not in DYNAMIC_FORMS:
            raise unknown_name("dynamic-NTK form", dynamic, DYNAMIC_FORMS)
        # checked at the training length; the factor itself follows each call's length unless fixed
        rope.scaled_inv_freq(method, self.rotary_dim, base=self.base, train_len=self.train_len,
                             seq_len=self.train_len, factor=factor, **options)
        self.scaling, self.factor, self.scaling_options, self.dynamic = method, factor, options, dynamic
        self.clear_cache()
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` tables (``n d/2``) in ``dtype``, attention factor included (a copy of the memoised ones)."""
        return tuple(t.clone() for t in self._memo_cos_sin(positions, dtype))

    def _memo_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.memo(f"cos_sin/{dtype}", (positions,), dtype, lambda: self._cos_sin(positions, dtype))

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2 and self.scaling != "none" and (self.factor is None or self.scaling == "dynamic-ntk"):
            # the frequencies follow each row's own length: one table per row, as a loop over the rows would build
            rows = [self._cos_sin(row, dtype) for row in positions]
            return torch.stack([c for c, _ in rows]), torch.stack([s for _, s in rows])
        n = position_span(positions)
        if self.scaling == "dynamic-ntk" and self.dynamic == "cache":
            angles = rope.dynamic_ntk_angles(positions, self.rotary_dim, base=self.base, train_len=self.train_len)
            factor = 1.0
        else:
            freqs, factor = rope.scaled_inv_freq(self.scaling, self.rotary_dim, base=self.base, train_len=self.train_len,
                                                 seq_len=max(n, 1), factor=self.factor, **self.scaling_options)
            angles = rope.rope_angles(positions, freqs)
        if self.kept_pairs < self.rotary_dim // 2:  # p-RoPE: the slowest pairs do not turn
            angles = angles * (torch.arange(angles.shape[-1], device=angles.device) < self.kept_pairs)
        return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)

    def spread_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope.spread_tables` of :meth:`cos_sin` (a copy of the memoised ones)."""
        return tuple(t.clone() for t in self._memo_spread_tables(positions, dtype))

    def _memo_spread_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.memo(f"spread/{dtype}", (positions,), dtype,
                         lambda: rope.spread_tables(*self._memo_cos_sin(positions, dtype), self.layout))

    def rotate(self, q, k, positions):
        return self.rotate_one(q, positions, "q"), self.rotate_one(k, positions, "k")

    def rotate_one(self, x, positions, role):
        """Rotate ``x`` (``... n d``) at ``positions``: ``n``, or ``b n`` (one row per batch entry of ``x``)."""
        cos, sin = self._memo_spread_tables(positions, torch.promote_types(x.dtype, torch.float32))
        cos, sin = rope.batch_tables(cos, x), rope.batch_tables(sin, x)
        if self.rotary_dim == self.head_dim:
            return rope.rotate_with(x, cos, sin, self.layout)
        turned = rope.rotate_with(x[..., : self.rotary_dim], cos, sin, self.layout)
        return torch.cat([turned, x[..., self.rotary_dim :]], dim=-1)

    @property
    def factor_follows_length(self) -> bool:
        """Whether the strategy's factor is ``max(1, n / train_len)`` for each call's length ``n`` (any strategy but
        ``none`` with ``factor=None``; dynamic NTK derives its own and is not counted here)."""
        return self.scaling not in ("none", "dynamic-ntk") and self.factor is None

    @property
    def cacheable(self) -> bool:
        """A cache cannot serve a rotation that changes with the length for keys already cached: dynamic NTK's
        ``"sequence"`` form, or a factor that follows the length (``factor_follows_length``)."""
        if self.scaling == "dynamic-ntk":
            return self.dynamic == "cache"
        return not self.factor_follows_length

    def extra_repr(self):
        parts = f"head_dim={self.head_dim}, layout={self.layout}, base={self.base}, scaling={self.scaling}"
        if self.rotary_dim < self.head_dim:
            parts += f", rotary_dim={self.rotary_dim}"
        if self.kept_pairs < self.rotary_dim // 2:
            parts += f", kept_pairs={self.kept_pairs}"
        return parts


DYNAMIC_FORMS = ("cache", "sequence")


def _fraction_of(name: str, fraction, total: int) -> int:
    """``round(fraction * total)``, checked: ``fraction`` in (0, 1] and at least one unit kept."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise PosencError(f"{name} must be a number in (0, 1], got {fraction!r}")
    count = round(fraction * total)
    if count < 1:
        raise PosencError(f"{name} {fraction} keeps nothing of {total}")
    return count


class PartialRoPE(RoPE):
    """Partial rotary (GPT-NeoX's ``rotary_pct``, Phi's ``partial_rotary_factor``): RoPE on a fraction of each head.

    The first ``r = 2 round(fraction * d / 2)`` coordinates of a head of size ``d`` are rotated with
    ``theta_i = base ** (-2 i / r)``, ``i < r / 2`` -- most of RoPE's range of frequencies, from one
    radian per position down to ``base ** (-(r - 2) / r)`` (RoPE's own slowest is ``base ** (-(d - 2) / d)``),
    in fewer and wider steps -- and the other ``d - r`` carry no position. The default ``fraction = 0.25``
    is GPT-NeoX's (which truncates, ``r = int(d * fraction)``; the two agree whenever ``fraction * d`` is an
    even integer). Compare :class:`PRoPE`, which keeps only the fast frequencies.
    """

    name, variant_of = "rope-partial", "rope"

    def __init__(self, head_dim: int, *, train_len: int, fraction: float = 0.25, **options):
        check_even("RoPE head dimension", head_dim)
        rotary_dim = 2 * _fraction_of("partial rotary fraction", fraction, head_dim // 2)
        super().__init__(head_dim, train_len=train_len, rotary_dim=rotary_dim, **options)
        self.fraction = fraction


class PRoPE(RoPE):
    """p-RoPE (Barbero et al. 2024): RoPE without its lowest frequencies.

    Of the ``d / 2`` pairs with ``theta_i = base ** (-2 i / d)``, the ``k = round(p * d / 2)`` fastest
    (``i < k``) rotate as in RoPE and the others get ``theta_i = 0``: no rotation, no position. The
    kept frequencies are RoPE's own, from 1 down to ``base ** (-2 (k - 1) / d)``; the slow pairs, whose
    angles hardly move within the training length and which the authors find act as semantic channels, are
    freed of position. The default ``p = 0.75`` is the authors' best on Gemma 2B. Compare
    :class:`PartialRoPE`, which keeps most of the range of frequencies on fewer coordinates.
    """

    name, variant_of = "p-rope", "rope"

    def __init__(self, head_dim: int, *, train_len: int, p: float = 0.75, **options):
        check_even("RoPE head dimension", head_dim)
        kept = _fraction_of("p-RoPE's p", p, head_dim // 2)
        super().__init__(head_dim, train_len=train_len, kept_pairs=kept, **options)
        self.p = p


class RoPEBase500(RoPE):
    """RoPE with base 500 (Liu et al. 2023; Men et al. 2024): every pair turns faster, so all of them
    complete a turn within a short training length; the base study's small end."""

    name, variant_of = "rope-b500", "rope"

    def __init__(self, head_dim: int, *, train_len: int, **options):
        super().__init__(head_dim, train_len=train_len, base=options.pop("base", 500.0), **options)


class RoPEBase500k(RoPE):
    """RoPE with base 500,000 (Llama 3's base; Xiong et al. 2023 raise it for long context): the slow pairs
    turn so slowly that they never complete a turn; the base study's large end."""

    name, variant_of = "rope-b500k", "rope"

    def __init__(self, head_dim: int, *, train_len: int, **options):
        super().__init__(head_dim, train_len=train_len, base=options.pop("base", 500_000.0), **options)


class RoPENoPELayers(RoPE):
    """RoPE in most layers, no position at all in every ``interval``-th one (SmolLM3's ``no_rope_layer_interval``;
    Yang et al. 2025, "Rope to Nope and Back Again"): layer ``l`` (from 0) has no position when
    ``(l + 1) % interval == 0``, so with 4 layers and ``interval = 4`` the last layer is NoPE. The
    rotation itself is RoPE's, strategies included; :meth:`Encoding.for_layer` hands the NoPE layers an
    encoding without hooks."""

    name, variant_of = "rope-nope", "rope"

    def __init__(self, head_dim: int, *, train_len: int, interval: int = 4, **options):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise PosencError(f"the NoPE layer interval must be a positive integer, got {interval!r}")
        super().__init__(head_dim, train_len=train_len, **options)
        self.interval = interval
        self.plain = NoPE()

    def for_layer(self, layer: int, n_layer: int) -> Encoding:
        return self.plain if (layer + 1) % self.interval == 0 else self

    def extra_repr(self):
        return super().extra_repr() + f", NoPE every {self.interval}th layer"


class _Randomized:
    """Randomized positions (Ruoss et al. 2023): the ``n`` tokens of a window get a sorted random subset of
    ``0 .. max_position - 1`` instead of ``0 .. n - 1`` (one draw per forward pass, shared by the batch),
    so that positions up to ``max_position`` are seen in training -- and, as in the authors' code,
    at evaluation too: a model that has only ever seen gaps of about ``max_position / L`` between
    neighbours is not shown the gaps of 1 it never met. Training draws come from a generator seeded
    with the seed the encoding was built under and a counter, both kept in the state dict (a
    resumed run draws what an uninterrupted one would); evaluation draws depend on ``n`` alone (the
    same positions for every window of a length: one fixed sample, reproducible). No key/value
    cache can serve it: the positions of a whole window are drawn together."""

    cacheable = False
    EVAL_SEED = 20230526

    def _setup_draws(self, max_position: int, train_len: int):
        if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position < train_len:
            raise PosencError(f"max_position must be an integer >= the training length {train_len}, got {max_position!r}")
        self.max_position = max_position
        self.register_buffer("draws", torch.zeros((), dtype=torch.int64))
        self.register_buffer("draw_seed", torch.tensor(torch.initial_seed() % 2**62, dtype=torch.int64))

    def forward_positions(self, positions, training):
        n = positions.shape[-1]
        if n > self.max_position:
            raise PositionOutOfRange(f"{n} positions cannot be drawn from the {self.max_position} this encoding "
                                     "was trained to draw from")
        if training:
            seed = (int(self.draw_seed) * 1_000_003 + int(self.draws)) % 2**63
            self.draws += 1
        else:
            seed = self.EVAL_SEED * 1_000_003 + n
        chosen = torch.randperm(self.max_position, generator=torch.Generator().manual_seed(seed))[:n].sort().values
        return chosen.to(positions.device)


class RandomizedRoPE(_Randomized, RoPE):
    """RoPE trained with randomized positions (``_Randomized``; ``max_position`` defaults to 16 x the
    training length)."""

    name, variant_of = "rope-random", "rope"

    def __init__(self, head_dim: int, *, train_len: int, max_position: int | None = None, **options):
        super().__init__(head_dim, train_len=train_len, **options)
        self._setup_draws(16 * train_len if max_position is None else max_position, train_len)


class RandomizedLearned(_Randomized, Learned):
    """A learned table trained with randomized positions (``_Randomized``): the table has ``max_position``
    rows (default 16 x the training length), each trained only when drawn, so evaluation can run up to
    ``max_position`` positions."""

    name, variant_of = "learned-random", "learned"

    def __init__(self, d_model: int, *, max_len: int, max_position: int | None = None):
        max_position = 16 * max_len if max_position is None else max_position
        super().__init__(d_model, max_len=max(max_position, max_len) if isinstance(max_position, int) else max_len)
        self._setup_draws(max_position, max_len)


class XPos(Encoding):
    """xPos (Sun et al. 2022): RoPE plus a per-pair exponential decay with distance; see :func:`rope.apply_xpos`.

    ``rotate`` centres the positions of the sequence (no score changes, the powers stay small);
    ``rotate_one`` (a key/value cache, where queries and keys are scaled at different times) uses
    the fixed centre 0, which keeps float32 finite up to about ``70 * scale_base`` positions.
    """

    name, hook = "xpos", "rotate"
    shape = {"head_dim": "head_dim"}
    noncausal = False  # its decay zeta^((m - n) / tau) would grow without bound for keys after the query

    def __init__(self, head_dim: int, *, base: float = 10000.0, scale_base: float = 512.0, gamma: float = 0.4,
                 layout: str = "half"):
        super().__init__()
        check_even("xPos head dimension", head_dim)
        self.register_buffer("freqs", rope.inv_freq(head_dim, base), persistent=False)
        self.scale_base, self.gamma, self.layout = scale_base, gamma, layout

    def rotate(self, q, k, positions):
        return rope.apply_xpos(q, k, positions, self.freqs, scale_base=self.scale_base, gamma=self.gamma,
                               layout=self.layout)

    def rotate_one(self, x, positions, role):
        if role not in ("q", "k"):
            raise PosencError(f"role must be 'q' or 'k', got {role!r}")
        q, k = rope.apply_xpos(x, x, positions, self.freqs, scale_base=self.scale_base, gamma=self.gamma,
                               layout=self.layout, centre=0)
        return q if role == "q" else k


class _BiasEncoding(Encoding):
    """A bias encoding: ``bias(q_pos, k_pos)`` is ``h i j`` for positions ``i`` and ``j``, and ``b h i j`` for
    positions ``b i`` and ``b j`` (one table per batch row; a 1-d side is shared by every row)."""

    hook = "bias"
    distance_only = True
    shape = {"num_heads": "num_heads"}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "bias" in cls.__dict__:  # every subclass's formula also serves positions of shape (b, n), row by row
            cls.bias = _per_row(cls.__dict__["bias"])

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor:
        return self.bias(distances, torch.zeros(1, dtype=distances.dtype, device=distances.device))[:, :, 0]

    def device(self) -> torch.device:
        return next(iter(self.parameters()), next(iter(self.buffers()), torch.empty(0))).device


def _per_row(bias: Callable) -> Callable:
    """``bias`` (one table ``h i j`` from 1-d positions) extended to positions ``b n``: a stack of per-row tables."""

    @functools.wraps(bias)
    def batched(self, q_pos, k_pos):
        if q_pos.dim() == 1 and k_pos.dim() == 1:
            return bias(self, q_pos, k_pos)
        if q_pos.dim() > 2 or k_pos.dim() > 2:
            raise PosencError(f"bias positions must be (n,) or (b, n), got {tuple(q_pos.shape)} and {tuple(k_pos.shape)}")
        rows = max(p.shape[0] for p in (q_pos, k_pos) if p.dim() == 2)
        q_rows, k_rows = (p.expand(rows, -1) if p.dim() == 2 else p.expand(rows, p.shape[-1]) for p in (q_pos, k_pos))
        return torch.stack([bias(self, qp, kp) for qp, kp in zip(q_rows, k_rows)])

    return batched


class ALiBi(_BiasEncoding):
    """ALiBi (Press et al. 2022): ``b[h, i, j] = -m_h |i - j|`` with fixed slopes :func:`bias.alibi_slopes`.

    The paper defines the causal case; for non-causal attention the same ``-m_h |i - j|`` is used
    for keys on both sides of the query.
    """

    name = "alibi"

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("slopes", bias.alibi_slopes(num_heads).to(torch.float32), persistent=False)

    def bias(self, q_pos, k_pos):
        return bias.alibi_bias(self.slopes, q_pos, k_pos)

    def score_mod(self, positions):
        slopes = self.slopes

        def alibi(score, b, h, q_idx, kv_idx):
            i, j = positions(q_idx, kv_idx)
            return score - slopes[h] * (i - j).abs()

        return alibi


class T5(_BiasEncoding):
    """T5 relative bias (Raffel et al. 2020): a learned scalar per head and log-spaced distance bucket.

    ``bidirectional=False`` (a decoder) buckets only keys at or before the query, and is defined for
    causal attention only; ``bidirectional=True`` (the encoder) has buckets for both sides.
    """

    name = "t5"

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False):
        super().__init__()
        self.table = bias.T5Bias(num_heads, num_buckets=num_buckets, max_distance=max_distance,
                                 bidirectional=bidirectional)
        self.noncausal = bidirectional

    noncausal_hint = " (build it with bidirectional=True)"

    def bias(self, q_pos, k_pos):
        return self.table(q_pos, k_pos)


class Kerple(_BiasEncoding):
    """KERPLE-log (Chi et al. 2022): ``b[h, i, j] = -r1_h ln(1 + r2_h |i - j|)``, ``r1, r2`` learned (symmetric in ``i, j``)."""

    name = "kerple"

    def __init__(self, num_heads: int, **options):
        super().__init__()
        self.kernel = bias.KerpleLog(num_heads, **options)

    def bias(self, q_pos, k_pos):
        return self.kernel(q_pos, k_pos)


class Fire(_BiasEncoding):
    """FIRE (Li et al. 2023): a learned MLP of the progressively normalised distance; depends on ``m`` too.

    Defined for causal attention only (its normaliser ``psi(max(L~, m))`` bounds the distance to the
    keys *before* query ``m``). While every query position is at most the threshold ``L~`` (training,
    and the first ``L~`` positions of any window), the normaliser is the constant ``psi(L~)`` and the
    bias depends on the distance alone: then it is built from a per-distance table, exactly the same
    values as pair by pair (:meth:`distance_only_at`).
    """

    name = "fire"
    distance_only = False
    shape = {"num_heads": "num_heads", "train_len": "train_len"}
    noncausal = False

    def __init__(self, num_heads: int, *, train_len: int = 512, **options):
        super().__init__()
        options.setdefault("init_threshold", float(train_len))
        self.fire = bias.FIRE(num_heads, **options)

    def bias(self, q_pos, k_pos):
        return self.fire(q_pos, k_pos)

    def score_mod(self, positions):
        """FIRE pair by pair (its bias depends on the query position too): the module's own normaliser and MLP."""
        c, threshold = self.fire.params()

        def fire(score, b, h, q_idx, kv_idx):
            i, j = positions(q_idx, kv_idx)
            return score + self.fire.mlp(bias.fire_input(i.reshape(1), j.reshape(1), c, threshold).reshape(1))[h]

        return fire

    def distance_only_at(self, q_pos: torch.Tensor) -> bool:
        if torch.compiler.is_compiling() or q_pos.numel() == 0:
            return False
        return float(q_pos.max()) <= float(self.fire.params()[1].detach())

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor:
        """``b[h, k]`` at signed distances ``distances[k]`` for queries at or below the threshold (see above): each
        distance is passed as a query position against a key at 0, which keeps the normaliser at ``psi(L~)`` for
        every distance up to ``L~`` (negative distances read as 0, as for any future key)."""
        return self.bias(distances, torch.zeros(1, dtype=distances.dtype, device=distances.device))[:, :, 0]


#: the one registry of encodings: name -> class (:func:`make_encoding` builds one from the model's shape)
ENCODINGS: dict[str, type[Encoding]] = {
    cls.name: cls for cls in (NoPE, Sinusoidal, SinusoidalSmall, Learned, RoPE, PartialRoPE, PRoPE, XPos, ALiBi, T5,
                              Kerple, Fire, RoPEBase500, RoPEBase500k, RoPENoPELayers, RandomizedRoPE,
                              RandomizedLearned)
}

def strategies_of(name: str, strategies) -> tuple[str, ...]:
    """The RoPE strategies an experiment evaluates on a trained ``name``: ``strategies`` where the encoding has them
    (:attr:`Encoding.has_strategies`), ``("-",)`` (the model as trained) otherwise."""
    return tuple(strategies) if ENCODINGS[name].has_strategies else ("-",)


#: the encodings themselves, without their variants (the default of every experiment)
PRIMARY: tuple[str, ...] = tuple(name for name, cls in ENCODINGS.items() if cls.variant_of is None)

def make_encoding(name: str, *, d_model: int | None = None, num_heads: int | None = None,
                  head_dim: int | None = None, train_len: int | None = None, **options) -> Encoding:
    """Build encoding ``name`` from the shape of the model it goes into.

    Each encoding takes only what it uses (its class's ``shape``): RoPE and xPos the head dimension (``head_dim``,
    or ``d_model / num_heads``) and RoPE the training length, the biases the number of heads (FIRE the training
    length too), the absolute encodings ``d_model`` (the learned table ``train_len`` rows). ``options`` go to the
    encoding's constructor (``scaling="yarn", factor=4.0`` for RoPE, ``bidirectional=True`` for T5, ...).
    """
    if name not in ENCODINGS:
        raise unknown_name("encoding", name, ENCODINGS)
    cls = ENCODINGS[name]
    if num_heads is not None:
        bias.check_heads(num_heads)
    if head_dim is None and d_model is not None and num_heads is not None:
        if d_model % num_heads:
            raise PosencError(f"d_model {d_model} is not divisible by the number of heads {num_heads}")
        head_dim = d_model // num_heads
    known = {"d_model": d_model, "num_heads": num_heads, "head_dim": head_dim, "train_len": train_len}
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
