"""The encodings that rotate queries and keys: RoPE with its extrapolation strategies, its variants, and xPos."""

from __future__ import annotations

import torch

from .. import rope, xpos
from ..errors import PosencError, check_even, unknown_name
from .base import Encoding, NoPE, Tables, position_span


class RoPE(Encoding):
    """Rotary embedding with an extrapolation strategy (``scaling``) chosen at any time, e.g. at evaluation.

    Shapes: ``rope(x, positions)`` and ``rotate_one``: ``x`` ``... n d`` (``b h n d``), ``positions`` ``n`` or
    ``b n`` -> ``... n d``; ``rotate(q, k, positions)`` -> both rotated; ``d = head_dim``.

    >>> import torch; from posenc_lab import RoPE, apply_rope, inv_freq
    >>> rope, x = RoPE(8, train_len=16), torch.randn(1, 2, 5, 8)
    >>> rope(x).shape, torch.allclose(rope(x), apply_rope(x, torch.arange(5), inv_freq(8)))
    (torch.Size([1, 2, 5, 8]), True)

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
    rotates_pairs = True
    rotates_alike = True
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
        return self

    def frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """The frequencies (``rotary_dim / 2``, float64) and attention factor a sequence of ``seq_len`` positions
        (``0 .. seq_len - 1``; default the training length) is rotated with: those of its last position under
        dynamic NTK's ``"cache"`` form, the slow pairs of p-RoPE set to 0 (Hugging Face's ``inv_freq`` and
        ``attention_factor`` at that length, for the types :func:`~posenc_lab.encodings.rope_from_hf` builds)."""
        n = self.train_len if seq_len is None else seq_len
        reads = self.reads_span or self.scaling == "dynamic-ntk"
        freqs, factor = rope.scaled_inv_freq(self.scaling, self.rotary_dim, base=self.base, train_len=self.train_len,
                                             seq_len=n if reads else None, factor=self.factor, **self.scaling_options)
        return freqs * (torch.arange(freqs.shape[-1]) < self.kept_pairs), factor

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, shared: dict | None = None) -> Tables:
        """The spread ``cos, sin`` tables of ``positions`` (:meth:`spread_tables`) in float32 or better, for every
        layer of a forward pass (``shared``: as :meth:`Encoding.tables`)."""
        return Tables(self, positions, rotation=self.spread_tables(positions, torch.promote_types(dtype, torch.float32)),
                      shared=shared)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` tables (``n d/2``) in ``dtype``, attention factor included."""
        return self._cos_sin(positions, dtype)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reads_span and torch.compiler.is_compiling():
            # the factor is read from max(positions) + 1, a value a graph cannot hold: a graph break, not n in its place
            return _outside_the_graph(self._cos_sin, positions, dtype)
        if positions.dim() == 2 and self.reads_span:
            # the frequencies follow each row's own length: one table per row, as a loop over the rows would build
            rows = [self._cos_sin(row, dtype) for row in positions]
            return torch.stack([c for c, _ in rows]), torch.stack([s for _, s in rows])
        if self.scaling == "dynamic-ntk" and self.dynamic == "cache":
            angles = rope.dynamic_ntk_angles(positions, self.rotary_dim, base=self.base, train_len=self.train_len,
                                             **self.scaling_options)
            factor = 1.0
        else:
            seq_len = max(position_span(positions), 1) if self.reads_span else None
            freqs, factor = rope.scaled_inv_freq(self.scaling, self.rotary_dim, base=self.base, train_len=self.train_len,
                                                 seq_len=seq_len, factor=self.factor, **self.scaling_options)
            angles = rope.rope_angles(positions, freqs)
        if self.kept_pairs < self.rotary_dim // 2:  # p-RoPE: the slowest pairs do not turn
            angles = angles * (torch.arange(angles.shape[-1], device=angles.device) < self.kept_pairs)
        return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)

    def spread_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope.spread_tables` of :meth:`cos_sin`: the tables :func:`rope.rotate_with` multiplies by."""
        return rope.spread_tables(*self._cos_sin(positions, dtype), self.layout)

    def rotate(self, q, k, positions, tables=None):
        """``q, k`` (``b h n d``) each rotated at ``positions`` (``n`` or ``b n``) by :meth:`rotate_one`."""
        return self.rotate_one(q, positions, "q", tables), self.rotate_one(k, positions, "k", tables)

    def rotate_one(self, x, positions, role, tables=None):
        """Rotate ``x`` (``... n d``) at ``positions``: ``n``, or ``b n`` (one row per batch entry of ``x``), with
        the forward pass's ``tables`` when they hold ``x``'s precision, otherwise with tables computed here."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        if tables is not None and tables.rotation is not None and tables.rotation[0].dtype == dtype:
            cos, sin = tables.rotation
        else:
            cos, sin = self.spread_tables(positions, dtype)
        cos, sin = rope.batch_tables(cos, x), rope.batch_tables(sin, x)
        if self.rotary_dim == self.head_dim:
            return rope.rotate_with(x, cos, sin, self.layout)
        turned = rope.rotate_with(x[..., : self.rotary_dim], cos, sin, self.layout)
        return torch.cat([turned, x[..., self.rotary_dim :]], dim=-1)

    @property
    def reads_span(self) -> bool:
        """Whether the rotation reads the length ``max(positions) + 1`` (:func:`position_span`): a factor that follows
        the length, dynamic NTK in its ``"sequence"`` form, or LongRoPE (its factors are chosen by the length)."""
        return (self.factor_follows_length or self.scaling == "longrope"
                or (self.scaling == "dynamic-ntk" and self.dynamic == "sequence"))

    def pin_length(self, final_len: int, dynamic: str | None = None):
        """Fix a factor that follows the length at ``max(1, final_len / train_len)`` (and dynamic NTK's form at
        ``dynamic``, when given) for one generation call, so that every step of it rotates with the same factor;
        returns the function that restores the strategy as it was."""
        saved = (self.scaling, self.factor, dict(self.scaling_options), self.dynamic)
        factor = max(1.0, final_len / self.train_len) if self.factor_follows_length else self.factor
        self.set_scaling(self.scaling, factor, dynamic=dynamic or self.dynamic, **self.scaling_options)

        def restore():
            self.set_scaling(saved[0], saved[1], dynamic=saved[3], **saved[2])

        return restore

    @property
    def factor_follows_length(self) -> bool:
        """Whether the strategy's factor is ``max(1, n / train_len)`` for each call's length ``n`` (any strategy but
        ``none`` with ``factor=None``; dynamic NTK derives its own and is not counted here)."""
        return self.scaling not in ("none", "dynamic-ntk") and self.factor is None

    @property
    def cacheable(self) -> bool:
        """A cache cannot serve a rotation that changes with the length for keys already cached: dynamic NTK's
        ``"sequence"`` form, a factor that follows the length (``factor_follows_length``), or LongRoPE's choice
        of factors."""
        if self.scaling == "dynamic-ntk":
            return self.dynamic == "cache"
        return not self.reads_span

    def extra_repr(self):
        """The head dimension, layout, base and scaling (and the partial rotation where there is one)."""
        parts = f"head_dim={self.head_dim}, layout={self.layout}, base={self.base}, scaling={self.scaling}"
        if self.rotary_dim < self.head_dim:
            parts += f", rotary_dim={self.rotary_dim}"
        if self.kept_pairs < self.rotary_dim // 2:
            parts += f", kept_pairs={self.kept_pairs}"
        return parts


DYNAMIC_FORMS = ("cache", "sequence")


@torch.compiler.disable(reason="RoPE's factor follows the length max(positions) + 1, a value no graph holds: pass "
                                "factor=... (a fixed factor) to compile with fullgraph=True")
def _outside_the_graph(fn, *args):
    """``fn(*args)`` run eagerly under ``torch.compile``: a graph break, for tables that read the positions' values."""
    return fn(*args)


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
    in fewer and wider steps -- and the other ``d - r`` carry no position.

    Shapes: as :class:`RoPE`'s, ``x`` ``... n d`` -> ``... n d``.

    >>> import torch; from posenc_lab import PartialRoPE
    >>> rope, x = PartialRoPE(8, train_len=16, fraction=0.5), torch.randn(1, 2, 5, 8)
    >>> rope.rotary_dim, torch.equal(rope(x)[..., 4:], x[..., 4:])
    (4, True)

    The default ``fraction = 0.25`` is GPT-NeoX's (which truncates, ``r = int(d * fraction)``; the two agree
    whenever ``fraction * d`` is an even integer). Compare :class:`PRoPE`, which keeps only the fast frequencies.
    """

    name, variant_of = "rope-partial", "rope"

    def __init__(self, head_dim: int, *, train_len: int, fraction: float = 0.25, **options):
        check_even("RoPE head dimension", head_dim)
        rotary_dim = 2 * _fraction_of("partial rotary fraction", fraction, head_dim // 2)
        super().__init__(head_dim, train_len=train_len, rotary_dim=rotary_dim, **options)
        self.fraction = fraction


class PRoPE(RoPE):
    """p-RoPE (Barbero et al. 2024): RoPE without its lowest frequencies.

    Shapes: as :class:`RoPE`'s, ``x`` ``... n d`` -> ``... n d``.

    >>> from posenc_lab import PRoPE
    >>> [round(f, 4) for f in PRoPE(8, train_len=16, p=0.5).frequencies()[0].tolist()]
    [1.0, 0.1, 0.0, 0.0]

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
    complete a turn within a short training length; the base study's small end.

    Shapes: as :class:`RoPE`'s, ``x`` ``... n d`` -> ``... n d``.

    >>> from posenc_lab import RoPEBase500
    >>> [round(f, 4) for f in RoPEBase500(8, train_len=16).frequencies()[0].tolist()]
    [1.0, 0.2115, 0.0447, 0.0095]
    """

    name, variant_of = "rope-b500", "rope"

    def __init__(self, head_dim: int, *, train_len: int, **options):
        super().__init__(head_dim, train_len=train_len, base=options.pop("base", 500.0), **options)


class RoPEBase500k(RoPE):
    """RoPE with base 500,000 (Llama 3's base; Xiong et al. 2023 raise it for long context): the slow pairs
    turn so slowly that they never complete a turn; the base study's large end.

    Shapes: as :class:`RoPE`'s, ``x`` ``... n d`` -> ``... n d``.

    >>> from posenc_lab import RoPEBase500k
    >>> [round(f, 5) for f in RoPEBase500k(8, train_len=16).frequencies()[0].tolist()]
    [1.0, 0.03761, 0.00141, 5e-05]
    """

    name, variant_of = "rope-b500k", "rope"

    def __init__(self, head_dim: int, *, train_len: int, **options):
        super().__init__(head_dim, train_len=train_len, base=options.pop("base", 500_000.0), **options)


class RoPENoPELayers(RoPE):
    """RoPE in most layers, no position at all in every ``interval``-th one (SmolLM3's ``no_rope_layer_interval``;
    Yang et al. 2025, "Rope to Nope and Back Again").

    Shapes: as :class:`RoPE`'s, ``x`` ``... n d`` -> ``... n d``.

    >>> from posenc_lab import RoPENoPELayers
    >>> rope = RoPENoPELayers(8, train_len=16, interval=4)
    >>> [rope.for_layer(layer, 4).name for layer in range(4)]
    ['rope-nope', 'rope-nope', 'rope-nope', 'nope']

    Layer ``l`` (from 0) has no position when ``(l + 1) % interval == 0``, so with 4 layers and ``interval = 4``
    the last layer is NoPE. The rotation itself is RoPE's, strategies included; :meth:`Encoding.for_layer` hands
    the NoPE layers an encoding without hooks."""

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


class XPos(Encoding):
    """xPos (Sun et al. 2022): RoPE plus a per-pair exponential decay with distance; see :func:`xpos.apply_xpos`.

    Shapes: ``rotate(q, k, positions)``: ``q, k`` ``b h n d``, ``positions`` ``n`` -> ``q, k`` ``b h n d``. Queries
    and keys are scaled apart, so ``xpos(x)`` alone is refused: call ``rotate``.

    >>> import torch; from posenc_lab import XPos
    >>> x = torch.randn(1, 2, 5, 8)
    >>> q, k = XPos(8).rotate(x, x, torch.arange(5)); q.shape, torch.equal(q, k)
    (torch.Size([1, 2, 5, 8]), False)

    ``rotate`` centres the positions of the sequence (no score changes, the powers stay small);
    ``rotate_one`` (a key/value cache, where queries and keys are scaled at different times) uses
    the fixed centre 0, which keeps float32 finite up to about ``70 * scale_base`` positions.
    """

    name, hook = "xpos", "rotate"
    rotates_pairs = True
    shape = {"head_dim": "head_dim"}
    noncausal = False  # its decay zeta^((m - n) / tau) would grow without bound for keys after the query

    def __init__(self, head_dim: int, *, base: float = 10000.0, scale_base: float = 512.0, gamma: float = 0.4,
                 layout: str = "half"):
        super().__init__()
        check_even("xPos head dimension", head_dim)
        self.register_buffer("freqs", rope.inv_freq(head_dim, base), persistent=False)
        self.scale_base, self.gamma, self.layout = scale_base, gamma, layout

    def rotate(self, q, k, positions, tables=None):
        return xpos.apply_xpos(q, k, positions, self.freqs, scale_base=self.scale_base, gamma=self.gamma,
                               layout=self.layout)

    def rotate_one(self, x, positions, role, tables=None):
        if role not in ("q", "k"):
            raise PosencError(f"role must be 'q' or 'k', got {role!r}")
        q, k = xpos.apply_xpos(x, x, positions, self.freqs, scale_base=self.scale_base, gamma=self.gamma,
                               layout=self.layout, centre=0)
        return q if role == "q" else k
