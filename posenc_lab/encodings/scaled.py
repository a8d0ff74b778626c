"""Scalable-Softmax (SSMax, Nakanishi 2025): attention whose logits grow with the number of keys, on any base encoding.

A softmax over ``n`` logits flattens as ``n`` grows: its largest weight tends to zero. SSMax multiplies the
logits ``z_j = q_m . k_j / sqrt(d)`` of a query that attends over ``n`` keys by ``s log n``,

    SSMax(z)_j = n^(s z_j) / sum_i n^(s z_i) = softmax((s log n) z)_j,

with ``s`` a learned scalar per head. Because the factor multiplies the whole logit (there is no bias to leave
out with NoPE or RoPE), it can multiply the query instead: every backend and a key/value cache then compute
SSMax with no change, the keys untouched.
"""

from __future__ import annotations

import math

import torch
from einops import einsum, rearrange
from torch import nn

from ..errors import PosencError, check_positive
from .base import Encoding, NoPE, Tables
from .rotary import RoPE


def causal_key_counts(positions: torch.Tensor, reach: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """The keys a query at position ``p`` sees under causal attention, in float64 (shape of ``positions``):
    ``p + 1`` over positions ``0 .. p``; ``p mod C + 1`` when attention stays within chunks of ``C`` positions
    (``chunk=C``); and at most ``W`` when it keeps only the keys less than ``W`` positions back (``reach=W``)."""
    n = positions.to(torch.float64)
    if chunk is not None:
        n = torch.remainder(n, chunk)
    n = n + 1
    return n if reach is None else n.clamp(max=reach)


def ssmax_factor(s: torch.Tensor, positions: torch.Tensor, reach: int | None = None,
                 chunk: int | None = None) -> torch.Tensor:
    """SSMax's logit factor ``s_h log n(p)``, ``n(p)`` the keys the query at ``p`` sees (:func:`causal_key_counts`:
    ``p + 1``, or fewer under a ``reach`` or a ``chunk``): ``h n`` for positions ``n``, ``b h n`` for positions
    ``b n``, in ``s``'s dtype (float32 or better).

    At ``n = e^(1/s_h)`` the factor is 1 and head ``h`` attends as plain softmax; past it, more sharply.
    """
    dtype = torch.promote_types(s.dtype, torch.float32)
    log_n = causal_key_counts(positions, reach, chunk).log().to(device=s.device, dtype=dtype)
    return einsum(s.to(dtype), log_n, "h, ... n -> ... h n")


def initial_s(train_len: int) -> float:
    """``1 / log L``: the ``s`` at which the factor ``s log n`` is 1 at the training length ``n = L``."""
    if isinstance(train_len, bool) or not isinstance(train_len, int) or train_len < 2:
        raise PosencError(f"SSMax needs a training length of at least 2 (its factor is s log n), got {train_len!r}")
    return 1.0 / math.log(train_len)


class SSMax(Encoding):
    """Scalable-Softmax (Nakanishi 2025) on a base encoding (NoPE here; RoPE in :class:`SSMaxRoPE`).

    Shapes: ``rotate(q, k, positions)``: ``q, k`` ``b h n d``, ``positions`` ``n`` -> ``q`` times ``s_h log n``,
    ``k`` as the base leaves it.

    >>> import torch; from posenc_lab import SSMax
    >>> x = torch.randn(1, 2, 16, 8)
    >>> q, k = SSMax(2, train_len=16).rotate(x, x, torch.arange(16))  # s log n = 1 at n = 16
    >>> torch.allclose(q[:, :, 15], x[:, :, 15]), torch.allclose(q[:, :, 3], x[:, :, 3] / 2), torch.equal(k, x)
    (True, True, True)

    The base's ``rotate`` hook runs first; then each query at position ``p`` of head ``h`` is multiplied by
    ``s_h log n`` (:func:`ssmax_factor`), so that the logits become ``(s_h log n) q_p . k_j / sqrt(d)`` and the
    softmax over them is the paper's ``softmax((s log n) z)``. ``n`` is the number of keys the query sees:
    ``p + 1`` under causal attention, ``min(p + 1, W)`` when attention keeps only the last ``W`` keys
    (``reach=W``), and within chunks the keys of the query's chunk (``counts_keys``: :func:`attention` hands the
    hook its ``reach`` and ``chunk``). Non-causal attention, where every query sees all the keys, is refused.

    ``s`` is one learned scalar per head, shared by the layers as the encoding is (the paper learns one per
    head and layer). ``s_init`` defaults to ``1 / log L`` (:func:`initial_s`), at which ``s log n = 1`` at the
    training length ``n = L``: at initialisation the model attends at ``L`` as with plain softmax, less sharply
    before and more sharply past it, and training moves ``s`` from there. (This is a choice of the package, not
    a value from the paper, whose Figure 1 illustrates SSMax with ``s = 0.43``. At this ``s`` the factor is
    ``log_L n``, Qwen's fixed "logn" query scaling without its floor of 1 below ``L``.)
    """

    name, hook, variant_of = "ssmax", "rotate", "nope"
    shape = {"num_heads": "num_heads", "train_len": "train_len"}
    noncausal = False
    noncausal_hint = " (SSMax counts the n = p + 1 keys a query sees causally)"
    counts_keys = True

    def __init__(self, num_heads: int, *, train_len: int, s_init: float | None = None, inner: Encoding | None = None):
        super().__init__()
        check_positive("SSMax's number of heads", num_heads)
        s_init = initial_s(train_len) if s_init is None else s_init
        if isinstance(s_init, bool) or not isinstance(s_init, (int, float)) or not math.isfinite(s_init):
            raise PosencError(f"SSMax's s_init must be a finite number, got {s_init!r}")
        self.num_heads, self.train_len = num_heads, train_len
        self.s = nn.Parameter(torch.full((num_heads,), float(s_init)))
        self.inner = NoPE() if inner is None else inner

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, shared: dict | None = None) -> Tables:
        """The base encoding's rotation tables, served as this encoding's (``s`` is read afresh at every layer)."""
        return Tables(self, positions, rotation=self.inner.tables(positions, dtype).rotation, shared=shared)

    def rotate(self, q, k, positions, tables=None, *, reach=None, chunk=None):
        return (self.rotate_one(q, positions, "q", tables, reach=reach, chunk=chunk),
                self.rotate_one(k, positions, "k", tables))

    def rotate_one(self, x, positions, role, tables=None, *, reach=None, chunk=None):
        """The base's rotation of ``x``; queries (``role="q"``, ``... h n d``) also multiplied by ``s_h log n(p)``,
        ``n(p)`` the keys each sees (``p + 1``, fewer under ``reach`` or ``chunk``: :func:`causal_key_counts`)."""
        if role not in ("q", "k"):
            raise PosencError(f"role must be 'q' or 'k', got {role!r}")
        x = self.inner.rotate_one(x, positions, role, tables)
        if role == "k":
            return x
        if x.dim() < 3 or x.shape[-3] != self.num_heads:
            raise PosencError(f"SSMax has one s per head ({self.num_heads}); the queries have shape {tuple(x.shape)}")
        compute = torch.promote_types(x.dtype, torch.float32)
        factor = rearrange(ssmax_factor(self.s.to(compute), positions, reach, chunk), "... h n -> ... h n 1")
        return (x.to(compute) * factor).to(x.dtype)

    @property
    def cacheable(self) -> bool:
        """Whether the base encoding can be served by a key/value cache (the factor is the query's own)."""
        return self.inner.cacheable

    def extra_repr(self):
        return f"heads={self.num_heads}, train_len={self.train_len}, on={self.inner.name}"


class SSMaxRoPE(SSMax):
    """SSMax (:class:`SSMax`) on RoPE: the logits ``(s_h log(p + 1)) (R_p q) . (R_j k) / sqrt(d)``.

    ``rope_options`` go to :class:`RoPE` (``base``, ``layout``, ...). The experiment evaluates it as trained
    (no RoPE extrapolation strategy): SSMax is itself the answer to longer contexts it is compared on.

    Shapes: ``rotate(q, k, positions)``: ``q, k`` ``b h n d``, ``positions`` ``n`` -> ``q, k`` ``b h n d``.

    >>> import torch; from posenc_lab import RoPE, SSMaxRoPE
    >>> x, pos = torch.randn(1, 2, 16, 8), torch.arange(16)
    >>> q, k = SSMaxRoPE(8, num_heads=2, train_len=16).rotate(x, x, pos)
    >>> torch.equal(k, RoPE(8, train_len=16)(x, pos)), torch.allclose(q[:, :, 15], k[:, :, 15])
    (True, True)
    """

    name, variant_of = "ssmax-rope", "rope"
    rotates_pairs = True
    shape = {"head_dim": "head_dim", "num_heads": "num_heads", "train_len": "train_len"}

    def __init__(self, head_dim: int, *, num_heads: int, train_len: int, s_init: float | None = None, **rope_options):
        super().__init__(num_heads, train_len=train_len, s_init=s_init,
                         inner=RoPE(head_dim, train_len=train_len, **rope_options))
