"""Stick-breaking attention (Tan et al. 2025): the softmax replaced by a stick-breaking process over the keys, from
the nearest back, and no position encoding at all.

For query ``i`` and key ``j < i`` of one head (``d`` the head dimension):

    z_ij = q_i . k_j / sqrt(d)
    beta_ij = sigmoid(z_ij)                                  (the share of what is left of the stick that j takes)
    A_ij = beta_ij  prod_{j<k<i} (1 - beta_ik)               (what the nearer keys k left over, times that share)
    o_i = sum_{j<i} A_ij v_j .

The key nearest the query breaks its share off first, so equal logits give weights that fall geometrically with the
distance, ``A_ij = beta (1 - beta)^(i-j-1)``: a recency bias that comes from the weighting itself, with nothing added
to the logits. The weights are at least 0 and sum to at most 1 (what is left of the stick, ``1 - sum_j A_ij``, is
dropped, so a query can attend to nothing). They are computed in log space,

    log A_ij = log sigmoid(z_ij) - sum_{j<k<i} softplus(z_ik)        (log(1 - sigmoid(z)) = -softplus(z)),

a sum over the keys after ``j`` (a cumulative sum from the query back), with no product of many numbers below one.

This is the paper's equation: a query attends to the keys strictly before it, and the remainder is dropped. The
authors' kernel (shawntan/stickbreaking-attention) offers ``attend_current`` (the query's own key first in line,
``j <= i``), which ``attend_current=True`` builds here; their layers add the remainder times the query's own value
(the kernel's tests) or times a learned vector per head, and normalise each head's output (GroupNorm) -- neither is
built here: the model around every encoding is the same.

The weights are not a softmax of the logits, so the attention backends compute them explicitly
(:attr:`~posenc_lab.encodings.Encoding.weighting`, :meth:`~posenc_lab.encodings.Encoding.weights`): ``reference``
in float64, ``sdpa`` in blocks of queries in the working dtype; ``flex`` refuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import PosencError
from .base import Encoding


def own_key(nq: int, nk: int, offset: int, device=None) -> torch.Tensor:
    """``True`` (``i j``) where key row ``j`` is query row ``i``'s own token: query row ``r`` sits at key row
    ``r + offset``."""
    rows = torch.arange(nq, device=device)[:, None] + offset
    return rows == torch.arange(nk, device=device)[None, :]


def stick_breaking_weights(logits: torch.Tensor, offset: int | None = None, *,
                           attend_current: bool = False) -> torch.Tensor:
    """The stick-breaking weights ``A_ij = sigmoid(z_ij) prod_{j<k<i} (1 - sigmoid(z_ik))`` (``... i j``) of the
    logits ``z`` (``... i j``, ``-inf`` on the keys a query does not see, the later ones included), in log space.

    Query row ``r`` sits at key row ``r + offset`` (default ``n_k - n_q``, the queries being the last rows of the
    keys): its own key is left out unless ``attend_current``. A hidden key takes nothing (``sigmoid(-inf) = 0``) and
    leaves the stick whole (``softplus(-inf) = 0``), so a mask of ``-inf`` is all the process needs to know."""
    nq, nk = logits.shape[-2:]
    if not attend_current:
        offset = nk - nq if offset is None else offset
        logits = logits.masked_fill(own_key(nq, nk, offset, logits.device), float("-inf"))
    log_beta = F.logsigmoid(logits)
    log_rest = -F.softplus(logits)  # log(1 - beta)
    # sum over the keys after j: the suffix sums, shifted by one key (the last key has none after it)
    after = F.pad(log_rest.flip(-1).cumsum(dim=-1).flip(-1)[..., 1:], (0, 1))
    return torch.exp(log_beta + after)


class StickBreaking(Encoding):
    """Stick-breaking attention (Tan et al. 2025): no position signal enters the logits; the weights are the
    stick-breaking process of :func:`stick_breaking_weights`, the nearest key first. ``attend_current``: whether a
    query's own key takes the first share (the authors' kernel option; False, the paper's equation). No parameters.
    Causal attention only (the stick is broken from the query back).

    Shapes: ``weights(logits, offset)``: ``logits`` ``b h i j`` -> ``b h i j``; in
    :func:`~posenc_lab.backends.attention`, ``q, k, v`` ``b h n d`` as for any encoding.

    >>> import torch; from posenc_lab import StickBreaking
    >>> w = StickBreaking().weights(torch.zeros(1, 4, 4).masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf")), 0)
    >>> w[0, 3].tolist()  # equal logits: halves, from the nearest key back; the query's own key takes nothing
    [0.125, 0.25, 0.5, 0.0]
    """

    name, hook = "stick-breaking", "none"
    weighting = "stick-breaking"
    variant_of = "nope"  # nothing enters the logits: the weighting alone orders the keys
    noncausal = False

    def __init__(self, *, attend_current: bool = False):
        if not isinstance(attend_current, bool):
            raise PosencError(f"attend_current must be True or False, got {attend_current!r}")
        super().__init__()
        self.attend_current = attend_current

    def weights(self, logits: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        return stick_breaking_weights(logits, offset, attend_current=self.attend_current)

    def extra_repr(self) -> str:
        return f"weighting=stick-breaking, attend_current={self.attend_current}"
