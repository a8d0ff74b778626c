"""The local/global layer mixes of 2025's models: most layers attend to a local span of keys with RoPE, and every
few layers one attends to the whole sequence, with no position (NoPE) or with RoPE of a much larger base.

A mix is one encoding object whose :meth:`~posenc_lab.encodings.Encoding.for_layer` hands each layer the encoding
it attends with. A local layer's span is an attribute of its encoding: ``window = W`` (a sliding window, keys with
``i - j < W``) or ``chunk = C`` (the query's own chunk, ``floor(i / C) == floor(j / C)``), which
:func:`~posenc_lab.backends.attention` reads and every backend applies. The object itself is the local layer
(a RoPE with its span), so ``attention(q, k, v, make_encoding("gemma3", ...))`` attends as a local layer does.

The papers' spans are set for pretraining lengths of 8k to 32k tokens; here a model trains at ``L = 512``, so
every span defaults to ``L / 4`` (128 at 512): four spans fit in a training window, so the global layers are the
only path to three quarters of the context the model learns from, while a span still holds some twenty words of
bytes. The papers' own ratios (Gemma 3's window of 1,024 at 32k, Llama 4's chunk of 8,192 at 256k) would leave
spans of 16 and 2 tokens at 512, too short for a byte-level model to read a word in.
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..errors import PosencError
from .base import Encoding, NoPE
from .rotary import RoPE


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PosencError(f"{name} must be a positive integer, got {value!r}")
    return value


def _span(name: str, value, train_len: int) -> int:
    """``value``, checked, or the default span ``L / 4`` of a training length ``L`` (at least 1)."""
    return _positive_int(name, max(1, train_len // 4) if value is None else value)


def attn_temperature(positions: torch.Tensor, *, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """Llama 4's attention temperature at each position ``p`` (float64, the shape of ``positions``),
    ``tau(p) = 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``, which multiplies the queries of its NoPE
    layers (Hugging Face transformers' ``Llama4TextAttention``, where ``attn_temperature_tuning`` is set and the
    layer has no RoPE; Meta's Llama 4 announcement cites Scalable-Softmax, Nakanishi 2025, whose logits grow with
    ``log n``). It is exactly 1 while ``p + 1 < floor_scale`` and rises by a step every ``floor_scale`` positions,
    so a query far into a long sequence sharpens its softmax over the many keys it sees. Llama 4:
    ``floor_scale = 8192``, ``attn_scale = 0.1``.
    """
    steps = torch.div(positions.long() + 1, floor_scale, rounding_mode="floor").to(torch.float64)
    return 1.0 + attn_scale * torch.log1p(steps)


class NoPETemperature(NoPE):
    """NoPE with Llama 4's attention temperature (:func:`attn_temperature`): no position signal, but each query at
    position ``p`` is multiplied by ``tau(p) = 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` before the dot
    product, keys untouched (Meta's Llama 4, in its global NoPE layers).

    Shapes: ``rotate(q, k, positions)``: ``q, k`` ``b h n d``, ``positions`` ``n`` -> ``q`` scaled, ``k``;
    :meth:`temperature`: ``n`` -> ``n``.

    >>> import torch; from posenc_lab import NoPETemperature
    >>> [round(t, 4) for t in NoPETemperature(train_len=16).temperature(torch.tensor([0, 3, 7])).tolist()]
    [1.0, 1.0693, 1.1099]

    ``floor_scale`` defaults to ``L / 4`` (128 at ``L = 512``), the chunk of :class:`IRoPE`'s local layers, as
    Llama 4's ``floor_scale`` equals its ``attention_chunk_size`` (8,192): the temperature is exactly 1 on the
    first chunk and takes four steps within the training length (up to ``1 + 0.1 log 5 = 1.16`` at ``p = 511``),
    so the model trains with it, and keeps rising past it (1.35 at 4,096). Llama 4's 8,192 would keep it at
    exactly 1 throughout training at 512. ``attn_scale = 0.1`` is Llama 4's.
    """

    name, hook, variant_of = "nope-temp", "rotate", "nope"
    shape = {"train_len": "train_len"}

    def __init__(self, *, train_len: int, floor_scale: int | None = None, attn_scale: float = 0.1):
        super().__init__()
        self.train_len, self.floor_scale = train_len, _span("floor_scale", floor_scale, train_len)
        if isinstance(attn_scale, bool) or not isinstance(attn_scale, (int, float)) or attn_scale < 0:
            raise PosencError(f"attn_scale must be a number >= 0, got {attn_scale!r}")
        self.attn_scale = float(attn_scale)

    def temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """:func:`attn_temperature` at ``positions`` with this encoding's ``floor_scale`` and ``attn_scale``."""
        return attn_temperature(positions, floor_scale=self.floor_scale, attn_scale=self.attn_scale)

    def rotate(self, q, k, positions, tables=None):
        return self.rotate_one(q, positions, "q", tables), k

    def rotate_one(self, x, positions, role, tables=None):
        """Queries (``role="q"``, ``... n d``) multiplied by the temperature of their positions (``n``, or ``b n``
        for a batch of rows); keys returned as they are."""
        if role not in ("q", "k"):
            raise PosencError(f"role must be 'q' or 'k', got {role!r}")
        if role == "k":
            return x
        tau = rearrange(self.temperature(positions), "... n -> ... 1 n 1")  # (b) 1 n 1: every head, every coordinate
        return (x * tau.to(x.device, torch.promote_types(x.dtype, torch.float32))).to(x.dtype)

    def extra_repr(self):
        return f"hook={self.hook}, floor_scale={self.floor_scale}, attn_scale={self.attn_scale}"


class _LayerMix(RoPE):
    """RoPE restricted to a local span (``window`` or ``chunk``) in most layers, ``global_layer`` in every
    ``interval``-th one: layer ``l`` (from 0) is global when ``(l + 1) % interval == 0``, the rule of Gemma 3's
    ``sliding_window_pattern`` and Llama 4's ``no_rope_layer_interval`` (Hugging Face transformers)."""

    interval = 4
    interval_option = "sliding_window_pattern"  # the option that sets ``interval``, as the paper's config names it
    global_layer: Encoding

    def __init__(self, head_dim: int, *, train_len: int, interval: int, base: float, layout: str):
        super().__init__(head_dim, train_len=train_len, base=base, layout=layout)
        self.interval = _positive_int(self.interval_option, interval)

    def for_layer(self, layer: int, n_layer: int) -> Encoding:
        """The global layer for layer ``l`` with ``(l + 1) % interval == 0``, this local one otherwise. A model of
        fewer than ``interval`` layers, which that rule would leave with no global layer and so no mix, gets its
        last layer global: at 2 layers a local layer, then a global one (a single layer is the global one)."""
        if (layer + 1) % self.interval == 0 or (n_layer < self.interval and layer == n_layer - 1):
            return self.global_layer
        return self

    def set_scaling(self, method, factor=None, *, dynamic=None, **options):
        """RoPE's :meth:`~posenc_lab.encodings.RoPE.set_scaling`, applied to a global RoPE layer too."""
        super().set_scaling(method, factor, dynamic=dynamic, **options)
        if isinstance(getattr(self, "global_layer", None), RoPE):
            self.global_layer.set_scaling(method, factor, dynamic=dynamic, **options)
        return self

    def extra_repr(self):
        span = f"window={self.window}" if self.window is not None else f"chunk={self.chunk}"
        return super().extra_repr() + f", {span}, global_layer every {self.interval}th layer"


class Gemma3Layers(_LayerMix):
    """Gemma 3's local/global layers (Gemma Team 2025, arXiv 2503.19786): local layers attend within a sliding window
    with RoPE of base ``rope_local_base_freq = 10,000``, global layers attend to every key with RoPE of base
    ``rope_theta = 1,000,000``; layer ``l`` is global when ``(l + 1) % sliding_window_pattern == 0``.

    Shapes: as :class:`RoPE`'s (the object is a local layer), ``x`` ``... n d`` -> ``... n d``.

    >>> from posenc_lab import Gemma3Layers
    >>> mix = Gemma3Layers(8, train_len=16)
    >>> mix.window, [(layer.window, layer.base) for layer in (mix.for_layer(0, 4), mix.for_layer(3, 4))]
    (4, [(4, 10000.0), (None, 1000000.0)])

    Gemma 3 runs five local layers to one global (``sliding_window_pattern = 6``), the global one last in each group,
    with a window of 1,024 at a 32k pretraining length. Here the default pattern is 4 (3 : 1): a model of 4 layers
    then has layers 0-2 local and layer 3 global, where 5 : 1 would leave it no global layer at all.
    ``sliding_window`` defaults to ``L / 4`` (128 at ``L = 512``): four windows fit in a training window, so the
    global layer alone reaches the three quarters of the context past it, as Gemma's does past 1,024, while a window
    still holds some twenty words of bytes; Gemma's own ratio (1,024 at 32k) would leave 16 bytes at 512, too few
    to read a word in.
    """

    name, variant_of = "gemma3", "rope"

    def __init__(self, head_dim: int, *, train_len: int, sliding_window: int | None = None,
                 sliding_window_pattern: int = 4, rope_local_base_freq: float = 10_000.0,
                 rope_theta: float = 1_000_000.0, layout: str = "half"):
        super().__init__(head_dim, train_len=train_len, interval=sliding_window_pattern, base=rope_local_base_freq,
                         layout=layout)
        self.window = _span("sliding_window", sliding_window, train_len)
        self.global_layer = RoPE(head_dim, train_len=train_len, base=rope_theta, layout=layout)


class IRoPE(_LayerMix):
    """Llama 4's iRoPE (Meta AI 2025, the Llama 4 announcement): local layers attend with RoPE within chunks of
    ``attention_chunk_size = C`` tokens (query ``i`` sees key ``j`` when ``floor(i / C) == floor(j / C)`` and
    ``j <= i``: the first token of a chunk sees only itself), and every ``no_rope_layer_interval``-th layer attends
    to every key with no position and Llama 4's attention temperature (:class:`NoPETemperature`), 3 : 1 as in
    Llama 4: with 4 layers, layers 0-2 chunked RoPE and layer 3 global NoPE.

    Shapes: as :class:`RoPE`'s (the object is a local layer), ``x`` ``... n d`` -> ``... n d``.

    >>> from posenc_lab import IRoPE
    >>> mix = IRoPE(8, train_len=16)
    >>> mix.chunk, [type(mix.for_layer(layer, 4)).__name__ for layer in (0, 3)]
    (4, ['IRoPE', 'NoPETemperature'])

    ``attention_chunk_size`` defaults to ``L / 4`` (128 at ``L = 512``, for the reason of :class:`Gemma3Layers`'s
    window; Llama 4: 8,192 at a 256k context) and the temperature's ``floor_scale`` to the chunk, as Llama 4's two
    are equal. ``rope_theta`` stays RoPE's 10,000 (Llama 4: 500,000, chosen for chunks of 8,192): within a chunk of
    128 its slow pairs already hardly turn, and the mix then differs from ``rope`` in its layers alone. Llama 4's
    QK-norm on its RoPE layers is not a position encoding and is not part of this one.
    """

    name, variant_of = "irope", "rope"
    interval_option = "no_rope_layer_interval"

    def __init__(self, head_dim: int, *, train_len: int, attention_chunk_size: int | None = None,
                 no_rope_layer_interval: int = 4, floor_scale: int | None = None, attn_scale: float = 0.1,
                 rope_theta: float = 10_000.0, layout: str = "half"):
        super().__init__(head_dim, train_len=train_len, interval=no_rope_layer_interval, base=rope_theta,
                         layout=layout)
        self.chunk = _span("attention_chunk_size", attention_chunk_size, train_len)
        self.global_layer = NoPETemperature(train_len=train_len, attn_scale=attn_scale,
                                            floor_scale=self.chunk if floor_scale is None else floor_scale)


class RNoPESWA(_LayerMix):
    """RNoPE-SWA (Yang et al. 2025, "Rope to Nope and Back Again", arXiv 2501.18795): RoPE layers restricted to a
    sliding window interleaved with NoPE layers that attend to every key, three RoPE layers to one NoPE (layer
    ``l`` is NoPE when ``(l + 1) % sliding_window_pattern == 0``), the design of Cohere's Command A (window 4,096;
    the option names are its Hugging Face configuration's). Compare ``rope-nope`` (:class:`RoPENoPELayers`), the
    same layers without the window.

    ``sliding_window`` defaults to ``L / 4`` (128 at ``L = 512``), for the reason of :class:`Gemma3Layers`'s.

    Shapes: as :class:`RoPE`'s (the object is a local layer), ``x`` ``... n d`` -> ``... n d``.

    >>> from posenc_lab import RNoPESWA
    >>> mix = RNoPESWA(8, train_len=16)
    >>> mix.window, [mix.for_layer(layer, 4).name for layer in range(4)]
    (4, ['rnope-swa', 'rnope-swa', 'rnope-swa', 'nope'])
    """

    name, variant_of = "rnope-swa", "rope"

    def __init__(self, head_dim: int, *, train_len: int, sliding_window: int | None = None,
                 sliding_window_pattern: int = 4, base: float = 10_000.0, layout: str = "half"):
        super().__init__(head_dim, train_len=train_len, interval=sliding_window_pattern, base=base, layout=layout)
        self.window = _span("sliding_window", sliding_window, train_len)
        self.global_layer = NoPE()
