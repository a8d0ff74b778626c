"""CoPE, contextual position encoding (Golovneva et al. 2024): a query counts only the keys its gates let through,
and the count is the position it reads its position embedding at.

For query ``i`` and key ``j <= i`` of one head (``d`` the head dimension):

    g_ij = sigmoid(q_i . k_j / sqrt(d))                  (the attention logit, through a sigmoid)
    p_ij = min(sum_{t=j}^{i} g_it, P - 1)                 (a fractional position, capped)
    e[p] = (1 - w) e[floor p] + w e[ceil p],   w = p - floor p
    logit_ij = q_i . k_j / sqrt(d) + q_i . e[p_ij]

``e[0 .. P-1]`` are learned position embeddings of the head dimension, shared by the heads of a layer (each head
counts with its own gates). This is the paper's listing: the gates read the logits scaled by ``1 / sqrt(d)`` and
``q_i . e[p_ij]`` is added unscaled. The authors' released code, by default, adds ``q_i . e[p_ij]`` before the
division by ``sqrt(d)`` (so the term is ``q_i . e[p_ij] / sqrt(d)``); its gates, like these, read ``q_i . k_j /
sqrt(d)``. The two are one model up to the scale of ``e``, but Adam moves an unscaled term ``sqrt(d)`` times faster.
Every gate at 1 gives ``p_ij = i - j + 1``: a relative position embedding. The bias
depends on the queries and keys, so the attention backends compute it from them
(:meth:`~posenc_lab.encodings.Encoding.token_bias`); the keys a query does not see have gate 0.
"""

from __future__ import annotations

import math

import torch
from einops import einsum
from torch import nn

from ..errors import PosencError
from .base import Encoding


def contextual_positions(gates: torch.Tensor, cap: float) -> torch.Tensor:
    """``p_ij = min(sum_{t=j}^{i} g_it, cap)`` (``... i j``) from the gates ``g`` (``... i j``, 0 on the keys a query
    does not see, so that the sum from ``j`` to the last key is the sum from ``j`` to ``i``): a suffix sum over the
    keys."""
    return gates.flip(-1).cumsum(dim=-1).flip(-1).clamp(max=cap)


def interpolate(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``z_i(p_ij) = (1 - w) z_i[floor p] + w z_i[ceil p]`` with ``w = p - floor p`` (``b h i j``), from
    ``z_i[k] = q_i . e[k]`` at the integer positions (``logits``, ``b h i P``): the dot product with the interpolated
    embedding, computed from ``P`` dot products per query instead of one per pair. At an integer ``p`` it is
    ``z_i[p]`` exactly."""
    floor = p.detach().floor()
    w = p - floor  # the gradient reaches the gates through w, as through the interpolation itself
    low = logits.gather(-1, floor.long())
    high = logits.gather(-1, p.detach().ceil().long())
    return (1 - w) * low + w * high


def cope_bias(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """CoPE's term ``q_i . e[p_ij]`` (``b h i j``) for queries ``q`` (``b h i d``), keys ``k`` (``b h j d``), the
    position embeddings ``table`` (``P d``) and ``hidden`` (``i j``, True where query ``i`` does not see key ``j``):
    the gates read the scaled logits ``q_i . k_j / sqrt(d)``, positions are capped at ``P - 1``. Computed in float32
    at least (a count in bfloat16 would move in steps of 0.25 past 32), float64 for float64 inputs."""
    work = torch.promote_types(q.dtype, torch.float32)
    q, k = q.to(work), k.to(work)
    logits = einsum(q, k, "b h i d, b h j d -> b h i j") / math.sqrt(q.shape[-1])
    gates = torch.sigmoid(logits).masked_fill(hidden, 0.0)
    p = contextual_positions(gates, table.shape[0] - 1)
    return interpolate(einsum(q, table.to(q.dtype), "b h i d, p d -> b h i p"), p)


class CoPELayer(Encoding):
    """One layer's CoPE (Golovneva et al. 2024): ``npos_max`` position embeddings ``e[0 .. npos_max-1]`` of the head
    dimension, shared by the layer's heads, starting at zero (as in the paper's code), so that a new model starts
    as NoPE; :meth:`token_bias` is :func:`cope_bias`. Causal attention only (a query counts the keys up to itself)."""

    name, hook = "cope", "token_bias"
    reads_tokens = True
    noncausal = False

    def __init__(self, head_dim: int, *, npos_max: int = 64):
        if isinstance(npos_max, bool) or not isinstance(npos_max, int) or npos_max < 2:
            raise PosencError(f"CoPE needs npos_max >= 2 position embeddings, got {npos_max!r}")
        super().__init__()
        self.table = nn.Parameter(torch.zeros(npos_max, head_dim))  # P d

    def token_bias(self, q, k, hidden, q_pos=None, k_pos=None):
        return cope_bias(q, k, self.table, hidden)

    def extra_repr(self) -> str:
        return f"hook=token_bias, npos_max={self.table.shape[0]}"


class CoPE(CoPELayer):
    """CoPE, contextual position encoding (Golovneva et al. 2024), every layer with its own position embeddings
    (:class:`CoPELayer`).

    Shapes: ``token_bias(q, k, hidden)``: ``q`` ``b h i d``, ``k`` ``b h j d``, ``hidden`` ``i j`` -> ``b h i j``;
    :func:`~posenc_lab.backends.attention` calls it (``cope(x)`` alone is refused).

    >>> import torch; from posenc_lab import CoPE
    >>> q, hidden = torch.randn(1, 2, 5, 8), torch.ones(5, 5, dtype=torch.bool).triu(1)
    >>> b = CoPE(8).token_bias(q, q, hidden); b.shape, b.abs().max().item()  # embeddings start at zero: NoPE
    (torch.Size([1, 2, 5, 5]), 0.0)

    This object holds the first layer's, and ``n_layer - 1`` more, which :meth:`for_layer`
    hands to the other layers; alone (outside a model) it is the first layer's. ``npos_max``: the number of
    position embeddings, the cap of ``p`` plus one: 64 is the package's choice (a count past 63 gates is read as 63,
    so no position is unseen at any length); the released code's default is the block size plus one.
    """

    variant_of = "t5"  # a learned relative term per (contextual) distance, capped as T5 caps its buckets
    shape = {"head_dim": "head_dim", "n_layer": "n_layer"}

    def __init__(self, head_dim: int, *, n_layer: int = 1, npos_max: int = 64):
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise PosencError(f"CoPE needs a positive number of layers, got n_layer={n_layer!r}")
        super().__init__(head_dim, npos_max=npos_max)
        self.later = nn.ModuleList(CoPELayer(head_dim, npos_max=npos_max) for _ in range(n_layer - 1))

    def for_layer(self, layer: int, n_layer: int) -> Encoding:
        if n_layer != len(self.later) + 1:
            raise PosencError(f"this CoPE has position embeddings for {len(self.later) + 1} layers, the model has "
                              f"{n_layer}: build it with n_layer={n_layer}")
        return self if layer == 0 else self.later[layer - 1]
