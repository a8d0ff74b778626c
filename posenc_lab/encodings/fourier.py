"""Fourier Position Embedding (FoPE, Hua et al. 2024): RoPE with each pair a Fourier series, its slow pairs clipped."""

from __future__ import annotations

import math

import torch
from einops import einsum

from .. import rope
from ..errors import PosencError, check_even, check_positive, unknown_name
from .base import Encoding, Tables


def floor_frequency(train_len: int) -> float:
    """FoPE's floor frequency ``omega_l = 2 pi / L``: the slowest frequency that completes a full period within the
    training length ``L`` (a pair of wavelength ``2 pi / theta_i > L`` never shows a whole turn in training)."""
    check_positive("train_len", train_len)
    return 2 * math.pi / train_len


def fope_kept_pairs(freqs: torch.Tensor, train_len: int) -> int:
    """The number of pairs FoPE keeps: those with ``theta_i >= 2 pi / L`` (:func:`floor_frequency`). RoPE's
    frequencies decrease with ``i``, so these are the fastest ``K``; the slower ones are clipped to ``theta = 0``."""
    return int((freqs >= floor_frequency(train_len)).sum())


def fope_coefficients(kept: int, sigma: float, *,
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ``K x K`` coefficient matrices ``(A, B)`` of FoPE's series, ``A[k, j]`` weighting ``cos(theta_k m)`` and
    ``B[k, j]`` weighting ``sin(theta_k m)`` in pair ``j``: each the identity (pair ``j``'s own frequency with weight
    1) plus independent normal draws of standard deviation ``sigma sqrt(2 / (K + K)) = sigma / sqrt(K)``
    (Xavier-normal with gain ``sigma`` on one ``K x K`` matrix), float64. ``sigma = 0`` gives the identity: RoPE's
    own rotation. The authors' released code draws one ``K x K`` matrix per head, as one Xavier-normal tensor whose
    fans count the heads too, so its draws are smaller: about ``0.043`` against ``sigma / sqrt(K) = 0.106`` here for
    ``sigma = 0.3``, ``K = 8`` and 4 heads (head dimension 32, ``L = 512``)."""
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma >= 0 or not math.isfinite(sigma):
        raise PosencError(f"FoPE's sigma must be a finite number >= 0, got {sigma!r}")
    std = sigma / math.sqrt(kept) if kept else 0.0
    eye = torch.eye(kept, dtype=torch.float64)
    noise = torch.randn(2, kept, kept, generator=generator, dtype=torch.float64) * std  # (A, B) k j
    return eye + noise[0], eye + noise[1]


def fope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor, cos_coef: torch.Tensor, sin_coef: torch.Tensor,
                 pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FoPE's ``C_j(m)`` and ``S_j(m)`` for every pair ``j < pairs`` (``... n pairs``, float64).

    For a kept pair ``j < K`` (``freqs`` are the ``K`` kept frequencies ``theta_k``),

        C_j(m) = sum_k A[k, j] cos(theta_k m),      S_j(m) = sum_k B[k, j] sin(theta_k m),

    the pair's rotation ``e^(i theta_j m)`` turned into a Fourier series over the kept frequencies. A clipped pair
    (``j >= K``) has ``theta_j = 0``: ``C_j = 1``, ``S_j = 0``, no position.
    """
    angles = rope.rope_angles(positions, freqs)  # ... n k
    coef = dict(device=angles.device, dtype=torch.float64)
    cos = einsum(angles.cos(), cos_coef.to(**coef), "... n k, k j -> ... n j")
    sin = einsum(angles.sin(), sin_coef.to(**coef), "... n k, k j -> ... n j")
    clipped = (*cos.shape[:-1], pairs - cos.shape[-1])
    return (torch.cat([cos, cos.new_ones(clipped)], dim=-1), torch.cat([sin, sin.new_zeros(clipped)], dim=-1))


class FoPE(Encoding):
    """Fourier Position Embedding (Hua et al. 2024): RoPE whose pairs each carry a Fourier series, with the
    frequencies too slow to complete a period in training set to zero.

    Shapes: ``fope(x, positions)`` and ``rotate_one``: ``x`` ``... n d``, ``positions`` ``n`` or ``b n`` ->
    ``... n d``; ``rotate(q, k, positions)`` -> both.

    >>> import torch; from posenc_lab import FoPE, RoPE
    >>> x = torch.randn(1, 2, 5, 8)
    >>> torch.allclose(FoPE(8, train_len=16, sigma=0.0, clip=False)(x), RoPE(8, train_len=16)(x))  # sigma 0: RoPE
    True

    RoPE multiplies pair ``j`` of the vector at position ``m`` (as the complex number ``a + i b``) by
    ``e^(i theta_j m)``, ``theta_j = base ** (-2 j / d)``. FoPE

    * clips: a frequency below the floor ``2 pi / L`` (:func:`floor_frequency`; with ``clip=False``, none) is set
      to zero, and its pair carries no position -- the pairs whose angles training never showed a whole turn of;
    * spreads each kept pair over all kept frequencies: the pair is multiplied by ``C_j(m) + i S_j(m)``
      (:func:`fope_cos_sin`), ``C_j = sum_k A[k, j] cos(theta_k m)``, ``S_j = sum_k B[k, j] sin(theta_k m)``, with
      ``A`` and ``B`` the identity plus small random coefficients (:func:`fope_coefficients`, ``sigma``; the
      authors use 0.3 to 0.6 as the model grows). The coefficients are drawn once, from the global generator,
      kept in the state dict, and not trained.

    With ``sigma = 0`` and ``clip=False`` this is RoPE; with ``sigma = 0`` and clipping, p-RoPE with the kept
    pairs. With ``sigma > 0`` a score is no longer a function of ``m - n`` alone. Unlike the authors' code,
    ``A`` and ``B`` are shared by the heads (so grouped-query keys are served) and drawn with a larger spread (see
    :func:`fope_coefficients`), a clipped pair is left exactly as it is (``C = 1, S = 0``, the zero frequency's own
    rotation; the released code sets both its cosine and its sine to 1), and the ``K`` kept frequencies always
    feed ``K`` pairs (the released code maps them onto ``min(K, d/4)`` pairs; equal here, ``K = d/4 = 8``).
    """

    name, hook, variant_of = "fope", "rotate", "rope"
    rotates_pairs = True
    rotates_alike = True
    shape = {"head_dim": "head_dim", "train_len": "train_len"}

    def __init__(self, head_dim: int, *, train_len: int, base: float = 10000.0, sigma: float = 0.3, clip: bool = True,
                 layout: str = "half"):
        super().__init__()
        check_even("FoPE head dimension", head_dim)
        check_positive("train_len", train_len)
        if layout not in rope.LAYOUTS:
            raise unknown_name("RoPE layout", layout, rope.LAYOUTS)
        if not isinstance(clip, bool):
            raise PosencError(f"FoPE's clip must be True or False, got {clip!r}")
        freqs = rope.inv_freq(head_dim, base)
        kept = fope_kept_pairs(freqs, train_len) if clip else head_dim // 2
        cos_coef, sin_coef = fope_coefficients(kept, sigma)
        self.head_dim, self.train_len, self.base, self.sigma, self.clip, self.layout = (
            head_dim, train_len, base, sigma, clip, layout)
        self.register_buffer("freqs", freqs[:kept], persistent=False)
        self.register_buffer("cos_coef", cos_coef.float())  # in the state dict: a reloaded model has the same series
        self.register_buffer("sin_coef", sin_coef.float())

    @property
    def kept_pairs(self) -> int:
        """``K``, the pairs that carry position (all ``d / 2`` with ``clip=False``)."""
        return self.freqs.shape[0]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``C`` and ``S`` (:func:`fope_cos_sin`, ``n d/2`` or ``b n d/2``) in ``dtype``."""
        cos, sin = fope_cos_sin(positions, self.freqs, self.cos_coef, self.sin_coef, self.head_dim // 2)
        return cos.to(dtype), sin.to(dtype)

    def spread_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope.spread_tables` of :meth:`cos_sin`: the tables :func:`rope.rotate_with` multiplies by."""
        return rope.spread_tables(*self.cos_sin(positions, dtype), self.layout)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, shared: dict | None = None) -> Tables:
        """The spread ``C, S`` tables of ``positions`` in float32 or better, for every layer of a forward pass
        (``shared``: as :meth:`Encoding.tables`)."""
        rotation = self.spread_tables(positions, torch.promote_types(dtype, torch.float32))
        return Tables(self, positions, rotation=rotation, shared=shared)

    def rotate(self, q, k, positions, tables=None):
        return self.rotate_one(q, positions, "q", tables), self.rotate_one(k, positions, "k", tables)

    def rotate_one(self, x, positions, role, tables=None):
        """Multiply each pair of ``x`` (``... n d``) by ``C_j(m) + i S_j(m)`` at ``positions`` (``n`` or ``b n``),
        with the forward pass's ``tables`` when they hold ``x``'s precision."""
        if role not in ("q", "k"):
            raise PosencError(f"role must be 'q' or 'k', got {role!r}")
        dtype = torch.promote_types(x.dtype, torch.float32)
        if tables is not None and tables.rotation is not None and tables.rotation[0].dtype == dtype:
            cos, sin = tables.rotation
        else:
            cos, sin = self.spread_tables(positions, dtype)
        return rope.rotate_with(x, rope.batch_tables(cos, x), rope.batch_tables(sin, x), self.layout)

    def extra_repr(self):
        return (f"head_dim={self.head_dim}, base={self.base}, sigma={self.sigma}, kept_pairs={self.kept_pairs}, "
                f"layout={self.layout}")
