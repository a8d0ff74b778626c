"""Score biases: a number ``b[h, m, n]`` added to the attention logit of query ``m`` and key ``n`` in head ``h``.

Conventions (the book's notation): positions are absolute token indices, ``m`` the query's and ``n``
the key's; the *distance* is ``m - n >= 0`` for the keys a causal query can see. T5 states its
buckets in terms of ``r = relative_position = key - query = n - m``, as in the original Mesh
TensorFlow code; everything else here is written in ``m - n``.
Each bias is a pure function of the positions (plus the encoding's parameters), so the same
function fills a materialized ``h x n x n`` tensor and, in :mod:`posenc_lab.backends`, a
FlexAttention ``score_mod`` that never materializes one.

>>> import torch; from posenc_lab import bias
>>> slopes = bias.alibi_slopes(4)
>>> slopes.tolist(), bias.alibi_bias(slopes, torch.arange(5), torch.arange(5)).shape
([0.25, 0.0625, 0.015625, 0.00390625], torch.Size([4, 5, 5]))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .errors import PosencError, check_heads, check_positions


def distances(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``m - n`` for every query position ``m`` and key position ``n``: shape ``nq x nk``, in int64 (no narrow type
    wraps around); signed integer positions only (:func:`check_positions`)."""
    check_positions(q_pos)
    check_positions(k_pos)
    return rearrange(q_pos.long(), "i -> i 1") - rearrange(k_pos.long(), "j -> 1 j")


# --------------------------------------------------------------------------------------------- ALiBi


def _geometric_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (h + 1) for h in range(n)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes ``mu_h`` (Press et al. 2022), float64.

    For ``H`` heads, ``H`` a power of two: the geometric sequence ``2^(-8/H), 2^(-16/H), ..., 2^(-8)``.
    Otherwise, as in the paper's reference code: the ``p`` slopes of the largest power of two
    ``p < H``, then the first ``H - p`` of every other slope of ``2p`` heads
    (``2^(-4/p), 2^(-12/p), ...``: the ones that interleave with the first ``p``).
    """
    check_heads(num_heads)
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric_slopes(p) + _geometric_slopes(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float64)


def partial_alibi_slopes(num_heads: int, alibi_heads: int) -> torch.Tensor:
    """ALiBi on a subset of the heads: the first ``alibi_heads`` heads get the slopes ALiBi gives that many heads
    (:func:`alibi_slopes` of ``alibi_heads``: the geometric sequence, and for a count that is not a power of two the
    paper's interleaving rule, which BLOOM and Baichuan use), the other ``num_heads - alibi_heads`` the slope 0: no
    bias, heads that see no position (NoPE heads beside ALiBi ones). ``alibi_heads = num_heads`` is ALiBi itself.
    float64."""
    check_heads(num_heads)
    if isinstance(alibi_heads, bool) or not isinstance(alibi_heads, int) or not 1 <= alibi_heads <= num_heads:
        raise PosencError(f"alibi_heads must be an integer from 1 to the number of heads ({num_heads}), got "
                          f"{alibi_heads!r}")
    return torch.cat([alibi_slopes(alibi_heads), torch.zeros(num_heads - alibi_heads, dtype=torch.float64)])


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``b[h, m, n] = -mu_h |m - n|``: a penalty linear in the distance (both sides, for non-causal attention)."""
    return -rearrange(slopes, "h -> h 1 1") * distances(q_pos, k_pos).abs()


# --------------------------------------------------------------------------------------------- T5


def t5_bucket(
    relative_position: torch.Tensor,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """T5's relative-position bucket (Raffel et al. 2020) for ``relative_position = key - query``.

    Let ``delta = -r = query - key`` (the distance ``m - n``). Bidirectional: half the buckets are for
    keys after the query (``delta < 0``, offset by ``num_buckets / 2``) and ``delta`` becomes ``|delta|``;
    causal: ``delta = max(delta, 0)``. With ``B`` buckets left per direction, distances ``delta < B/2``
    each get their own bucket; larger ones share logarithmically wider buckets,
    ``B/2 + floor(ln(delta / (B/2)) / ln(max_distance / (B/2)) * (B - B/2))``, capped at ``B - 1``.
    """
    if num_buckets < 2 or (bidirectional and num_buckets < 4):
        raise PosencError(f"num_buckets too small for T5 buckets: {num_buckets}")
    exact_part = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_distance <= exact_part:
        raise PosencError(f"T5's max_distance ({max_distance}) must exceed the distances with a bucket of their own "
                          f"({exact_part}), or the logarithmic buckets are empty")
    delta = -relative_position.long()
    bucket = torch.zeros_like(delta)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (delta < 0).long() * num_buckets
        delta = delta.abs()
    else:
        delta = delta.clamp(min=0)
    exact = num_buckets // 2
    # clamp before the log so that delta = 0 (where the exact branch is taken anyway) stays finite
    log_ratio = torch.log(delta.clamp(min=exact).double() / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(delta < exact, delta, large)


class T5Bias(nn.Module):
    """A learned bias per head and bucket: ``b[h, m, n] = table[bucket(n - m), h]``, shared by all layers as in T5."""

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False):
        super().__init__()
        check_heads(num_heads)
        t5_bucket(torch.zeros(1, dtype=torch.long), bidirectional=bidirectional, num_buckets=num_buckets,
                  max_distance=max_distance)  # checks the arguments now, not at the first forward
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.table = nn.Parameter(torch.zeros(num_buckets, num_heads))

    def buckets(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The bucket of every query-key pair, :func:`t5_bucket` of ``n - m``: shape ``nq x nk``."""
        return t5_bucket(
            -distances(q_pos, k_pos),
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The bias ``b[h, m, n] = table[bucket(n - m), h]``: shape ``h x nq x nk``."""
        return rearrange(self.table[self.buckets(q_pos, k_pos)], "i j h -> h i j")


# --------------------------------------------------------------------------------------------- KERPLE


def kerple_log_bias(r1: torch.Tensor, r2: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """KERPLE-log (Chi et al. 2022): ``b[h, m, n] = -r1_h ln(1 + r2_h |m - n|)`` with ``r1, r2 > 0``.

    A conditionally positive definite kernel turned into a bias: logarithmic, so it penalises far
    keys far less than ALiBi's linear penalty does.
    """
    d = distances(q_pos, k_pos).abs().to(r1.dtype)
    return -rearrange(r1, "h -> h 1 1") * torch.log1p(rearrange(r2, "h -> h 1 1") * d)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """The ``x`` with ``softplus(x) = y`` (for ``y > 0``): how a parameter kept positive through a softplus starts
    at ``y``."""
    return y + torch.log(-torch.expm1(-y))


class KerpleLog(nn.Module):
    """Learned KERPLE-log parameters per head, kept positive through a softplus."""

    def __init__(self, num_heads: int, *, init_r1: float = 1.0, init_r2: float = 1.0):
        super().__init__()
        check_heads(num_heads)
        # heads start from a spread of r2 around init_r2 so that they look at different ranges
        spread = torch.logspace(-1, 1, num_heads, base=2.0) if num_heads > 1 else torch.ones(1)
        self.raw_r1 = nn.Parameter(inverse_softplus(torch.full((num_heads,), init_r1)))
        self.raw_r2 = nn.Parameter(inverse_softplus(init_r2 * spread))

    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The positive parameters ``(r1, r2)`` per head: the softplus of the raw learned ones."""
        return F.softplus(self.raw_r1), F.softplus(self.raw_r2)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The bias :func:`kerple_log_bias` with the current parameters: shape ``h x nq x nk``."""
        return kerple_log_bias(*self.params(), q_pos, k_pos)


# --------------------------------------------------------------------------------------------- FIRE


#: added to FIRE's normaliser so that a learned ``c`` that underflows to 0 gives 0, not 0 / 0
FIRE_EPS = 1e-6


def fire_input(q_pos: torch.Tensor, k_pos: torch.Tensor, c: torch.Tensor, threshold: torch.Tensor,
               eps: float = FIRE_EPS) -> torch.Tensor:
    """FIRE's normalised distance ``psi(m - n) / (psi(max(L~, m)) + eps)``, ``psi(x) = ln(c x + 1)`` (Li et al. 2023).

    ``L~`` is FIRE's learned threshold (``threshold``). For the causal keys ``0 <= m - n <= m`` the
    input lies in [0, 1] at every length: that is how FIRE
    interpolates rather than extrapolates. (Future keys are clamped to distance 0; they are masked.)
    ``eps`` (:data:`FIRE_EPS`) keeps the quotient finite when ``c`` underflows to 0; for the trained
    ``c`` and ``L~`` of our runs, ``psi(L~)`` is above 1 and ``eps`` changes the input by under 1e-6.
    """
    d = distances(q_pos, k_pos).clamp(min=0).to(c.dtype)
    i = rearrange(q_pos, "i -> i 1").to(c.dtype)
    return torch.log1p(c * d) / (torch.log1p(c * torch.maximum(threshold, i)) + eps)


class FIRE(nn.Module):
    """FIRE: ``b[h, m, n] = f_theta(psi(m - n) / psi(max(L~, m)))[h]``, ``f_theta`` a 1 -> hidden -> heads ReLU MLP.

    ``c > 0`` and the threshold ``L~ > 0`` are learned (through a softplus). Our initialisation:
    ``c = 1``, ``L~ = init_threshold`` (the training length when built through the registry).
    """

    def __init__(self, num_heads: int, *, hidden: int = 32, init_c: float = 1.0, init_threshold: float = 512.0):
        super().__init__()
        check_heads(num_heads)
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, num_heads))
        self.raw_c = nn.Parameter(inverse_softplus(torch.tensor(float(init_c))))
        self.raw_threshold = nn.Parameter(inverse_softplus(torch.tensor(float(init_threshold))))

    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The positive parameters ``(c, L~)``: the softplus of the raw learned ones."""
        return F.softplus(self.raw_c), F.softplus(self.raw_threshold)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The bias ``b[h, m, n]`` for query positions ``q_pos`` and key positions ``k_pos``: shape ``h x nq x nk``,
        computed a few query rows at a time."""
        # query rows in chunks, so that the MLP's hidden activations (rows x keys x hidden) stay small
        rows = max(1, self.CHUNK // max(1, k_pos.shape[-1] * self.mlp[0].out_features))
        chunks = [self._rows(q_pos[i : i + rows], k_pos) for i in range(0, q_pos.shape[-1], rows)]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)

    #: hidden activations computed at once (elements)
    CHUNK = 2**24

    def _rows(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        x = fire_input(q_pos, k_pos, *self.params())
        return rearrange(self.mlp(rearrange(x, "i j -> i j 1")), "i j h -> h i j")
