"""PaTH (Yang et al. 2025): position as Householder-like transforms read from the tokens, accumulated between a key
and the query that reads it.

Every token ``t`` of a layer's input ``x_t`` gives each head a transform

    H_t = I - beta_t w_t w_t^T,     w_t = normalize(U V x_t),     beta_t = 2 sigmoid(a . x_t + c)  in (0, 2),

with ``V`` (``r x d_model``) and ``U`` (``h d x r``) a low-rank projection (``r = 32``, as in the authors'
layer) and ``a, c`` one gate per head. Query ``i`` and key ``j <= i`` are scored with the transforms of the tokens
after the key, up to the query, the latest one next to the query:

    logit_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)       (the key's own token and earlier ones: none).

Every ``beta`` at 0 gives ``q_i . k_j``: NoPE. ``beta = 2`` makes ``H_t`` a reflection (orthogonal); ``beta = 1`` a
projection that removes ``w_t`` from the key. Fixed vectors (the same ``w, beta`` at every token) give
``(H)^(i-j)``: a score that depends on ``i - j`` alone, as RoPE's (two reflections in a row are a rotation). The
order (the latest transform next to the query) is the authors' reference (``naive_path_attn`` in
fla-org/flash-linear-attention); the package checks it against an explicit product in float64
(tests/test_path.py).

:func:`path_logits` computes the products without forming a matrix: for each query it walks back from its own key
to the first, applying one ``H_t`` a key (``u <- H_t u``, ``O(d)`` per pair), ``O(n^2 d)`` per head in all, in
``n`` steps that each move every query at once: the definition, which the ``reference`` backend follows. Its autograd
keeps every step, too much memory to train on (a 4-layer, 128-wide model at 512 tokens and batch 8 did not fit in
20 GB); :func:`path_logits_blocked` gives the same numbers block by block, in ``2 block + n / block`` steps, and
the ``sdpa`` and ``flex`` backends use it. A key/value cache keeps each token's ``w, beta``
(``KVCache.continue_householder``), so a new query walks back through the cached tokens
as a whole forward pass does.

:class:`PaTHFoX` adds FoX's forget gates (the paper's PaTH-FoX): the two terms reach attention through their own
hooks, ``householder`` and ``decay``, and the backends add them as they add either alone.

Departures from the authors' layer (``PaTHAttention`` in fla-org/flash-linear-attention): no short convolution
over ``w`` (theirs, kernel 3 with SiLU, reads the two tokens before; here ``w_t`` reads ``x_t`` alone, so a cache
needs no convolution state), no QK-norm; one transform per query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from ..errors import PosencError
from .base import Encoding
from .forgetting import log_forget


def householder_vectors(x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, gate: torch.Tensor,
                        gate_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_t = normalize(U V x_t)`` (``b h n d``) and ``beta_t = 2 sigmoid(a . x_t + c)`` (``b h n``) of the layer's
    input ``x`` (``b n d_model``), with ``V`` = ``down`` (``r d_model``), ``U`` = ``up`` (``h d r``), ``a`` = ``gate``
    (``h d_model``) and ``c`` = ``gate_bias`` (``h``); float32 at least (float64 for float64 inputs)."""
    work = torch.promote_types(x.dtype, torch.float32)
    low = einsum(x, down.to(x.dtype), "b n m, r m -> b n r")
    w = einsum(low, up.to(x.dtype), "b n r, h d r -> b h n d").to(work)
    logits = einsum(x, gate.to(x.dtype), "b n m, h m -> b h n").to(work)
    return F.normalize(w, dim=-1), 2 * torch.sigmoid(logits + rearrange(gate_bias.to(work), "h -> 1 h 1"))


def path_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                offset: int | None = None) -> torch.Tensor:
    """``s_rj = q_r^T H_{m} H_{m-1} ... H_{j+1} k_j`` (``b h i j``, unscaled) with ``m = r + offset`` the key row of
    query row ``r`` (default ``offset = n_k - n_q``: the queries are the last rows of the keys), ``H_t = I - beta_t
    w_t w_t^T`` from ``w`` (``b h n_k d``) and ``beta`` (``b h n_k``), one per key row; 0 for the keys after a
    query. Computed in float32 at least.

    Each query walks back from its own key: ``u_{r,m} = q_r``, ``u_{r,j-1} = H_j u_{r,j}``, and ``s_rj = u_{r,j} .
    k_j`` (``H`` is symmetric, so ``u_{r,j} = H_{j+1} ... H_m q_r``)."""
    nq, nk = q.shape[-2], k.shape[-2]
    offset = nk - nq if offset is None else offset
    work = torch.promote_types(q.dtype, torch.float32)
    q, k, w, beta = q.to(work), k.to(work), w.to(work), beta.to(work)
    own = torch.arange(nq, device=q.device) + offset  # the key row of each query
    last = min(nk, nq + offset)  # keys from here on come after every query
    u = torch.zeros_like(q)  # b h i d
    columns = []
    for j in range(last - 1, -1, -1):
        u = torch.where(rearrange(own == j, "i -> i 1"), q, u)  # the query at key row j starts its walk here
        columns.append(einsum(u, k[:, :, j], "b h i d, b h d -> b h i"))
        w_j = w[:, :, j]  # b h d
        along = einsum(u, w_j, "b h i d, b h d -> b h i") * rearrange(beta[:, :, j], "b h -> b h 1")
        u = u - rearrange(along, "b h i -> b h i 1") * rearrange(w_j, "b h d -> b h 1 d")
    scores = torch.stack(columns[::-1], dim=-1) if columns else q.new_zeros(*q.shape[:-1], 0)
    return F.pad(scores, (0, nk - scores.shape[-1]))


def _apply(u: torch.Tensor, w: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``H u = u - beta (w . u) w`` for the vectors ``u`` (``... i d``) of each block, with the block's ``w``
    (``... d``) and ``beta`` (``...``)."""
    along = einsum(u, w, "... i d, ... d -> ... i") * beta[..., None]
    return u - along[..., None] * w[..., None, :]


def path_logits_blocked(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                        block: int = 16) -> torch.Tensor:
    """:func:`path_logits` of a whole sequence (``q, k`` of the same ``n`` tokens), the same numbers in fewer and
    smaller steps: the tokens cut into blocks of ``block``, the product between a query and a key in another block
    factored as

        q_i^T H_i ... H_{j+1} k_j = qhat_i^T  M_{c'-1} ... M_{c+1}  khat_j ,

    with ``qhat_i = H_s' ... H_i q_i`` (the query walked back to its block's first token ``s'``), ``khat_j = H_{e-1}
    ... H_{j+1} k_j`` (the key carried to its block's last token ``e - 1``) and ``M_c`` the ``d x d`` product of block
    ``c``'s transforms. A block's own pairs come from the walk of :func:`path_logits` within the block, which leaves
    ``qhat``. Every block walks at once, so the steps are ``2 block + n / block`` instead of ``n``, and autograd
    keeps a fraction of the walk's memory. Computed in float32 at least."""
    b, h, n, d = q.shape
    if k.shape[-2] != n or n <= block:
        return path_logits(q, k, w, beta)
    work = torch.promote_types(q.dtype, torch.float32)
    pad = -n % block
    q, k, w = (F.pad(t.to(work), (0, 0, 0, pad)) for t in (q, k, w))
    beta = F.pad(beta.to(work), (0, pad))  # beta 0 past the end: no transform
    q, k, w = (rearrange(t, "b h (c t) d -> b h c t d", t=block) for t in (q, k, w))
    beta = rearrange(beta, "b h (c t) -> b h c t", t=block)
    c = q.shape[2]
    local = torch.arange(block, device=q.device)

    # a block's own pairs, and qhat: each query walks back to its block's first token
    u, columns = torch.zeros_like(q), []
    for t in range(block - 1, -1, -1):
        u = torch.where(rearrange(local == t, "i -> i 1"), q, u)
        columns.append(einsum(u, k[:, :, :, t], "b h c i d, b h c d -> b h c i"))
        u = _apply(u, w[:, :, :, t], beta[:, :, :, t])
    own = torch.stack(columns[::-1], dim=-1)  # b h c i j (j <= i)
    qhat = u

    # khat: each key carried to its block's last token (H_t reaches the keys before t). R: the block's transforms
    # applied to the rows of the identity, R = (H_{e-1} ... H_s)^T = M^T, so a query crosses a block as v <- R v.
    khat = torch.zeros_like(k)
    R = torch.eye(d, dtype=work, device=q.device).expand(b, h, c, d, d)
    for t in range(block):
        khat = torch.where(rearrange(local == t, "i -> i 1"), k, _apply(khat, w[:, :, :, t], beta[:, :, :, t]))
        R = _apply(R, w[:, :, :, t], beta[:, :, :, t])

    # the pairs of blocks c' > c: query block c' walked back across the blocks between, one block a step
    pairs = [own]  # pairs[m]: query blocks m .. c-1 against key blocks 0 .. c-1-m (b h c i j)
    v = qhat[:, :, 1:]  # query blocks 1 .. c-1, next to the key block before them
    for distance in range(1, c):
        pairs.append(einsum(v, khat[:, :, :c - distance], "b h c i d, b h c j d -> b h c i j"))
        if distance < c - 1:  # query blocks distance+1 .. c-1 cross key blocks 1 .. c-distance-1
            v = einsum(R[:, :, 1:c - distance], v[:, :, 1:], "b h c e f, b h c i f -> b h c i e")
    return _block_matrix(pairs)[:, :, :n, :n]


def _block_matrix(pairs: list[torch.Tensor]) -> torch.Tensor:
    """The logits of the padded sequence (``b h (c block) (c block)``) from the pairs of blocks, ``pairs[m]``
    (``b h (c - m) block block``) those of query block ``m + r`` against key block ``r``; zero where the key block is
    after the query block. Where no gradient is recorded, each distance is written into a diagonal of the block
    matrix at once. Where one is, the block rows are concatenated (an in-place write per distance would make
    autograd copy the whole gradient once for each)."""
    b, h, c, block, _ = pairs[0].shape
    if not (torch.is_grad_enabled() and any(part.requires_grad for part in pairs)):
        out = pairs[0].new_zeros(b, h, c, block, c, block)  # query block, row, key block, column
        for distance, part in enumerate(pairs):  # query block = key block + distance: the diagonal at -distance
            torch.diagonal(out, offset=-distance, dim1=2, dim2=4).copy_(rearrange(part, "b h c i j -> b h i j c"))
        return rearrange(out, "b h c i e j -> b h (c i) (e j)")
    later = pairs[0].new_zeros(b, h, block, block * (c - 1))  # the key blocks after a query block
    rows = [torch.cat([pairs[p - r][:, :, r] for r in range(p + 1)] + [later[..., :block * (c - 1 - p)]], dim=-1)
            for p in range(c)]  # query block p: key blocks 0 .. p, then zeros
    return torch.cat(rows, dim=-2)


class PaTHLayer(Encoding):
    """One layer's PaTH transforms (Yang et al. 2025), read from the layer's input by :meth:`householder`
    (:func:`householder_vectors`). The projections start normal with standard deviation 0.02 and the gates'
    biases at 0, so every ``beta`` starts near 1. Causal attention only: a key is transformed by the tokens after
    it."""

    name, hook = "path", "householder"
    reads_tokens = True
    noncausal = False

    def __init__(self, num_heads: int, d_model: int, head_dim: int, *, rank: int = 32, forget: bool = False):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise PosencError(f"PaTH needs a positive rank for its projection of w, got rank={rank!r}")
        super().__init__()
        self.down = nn.Parameter(0.02 * torch.randn(rank, d_model))  # r d_model
        self.up = nn.Parameter(0.02 * torch.randn(num_heads, head_dim, rank))  # h d r
        self.gate = nn.Parameter(0.02 * torch.randn(num_heads, d_model))  # h d_model
        self.gate_bias = nn.Parameter(torch.zeros(num_heads))  # h
        if forget:  # PaTH-FoX: FoX's forget gates beside the transforms
            self.w_f = nn.Parameter(0.02 * torch.randn(num_heads, d_model))  # h d_model
            self.b_f = nn.Parameter(torch.zeros(num_heads))  # h

    @property
    def has_decay(self) -> bool:
        """Whether the layer has FoX's forget gates too (PaTH-FoX)."""
        return hasattr(self, "w_f")

    def decay(self, x):
        """PaTH-FoX's log forget values ``log f_t / sqrt(d)`` (``b h n``), FoX's gates
        (:func:`~posenc_lab.encodings.forgetting.log_forget`) scaled as the authors' PaTH-FoX scales them (the sum
        ``c_i - c_j`` joins ``q_i^T ... k_j`` before the division by ``sqrt(d)``); None for PaTH alone."""
        if not self.has_decay:
            return None
        return log_forget(x, self.w_f, self.b_f) / self.up.shape[1] ** 0.5

    @property
    def num_heads(self) -> int:
        """One transform per head and token."""
        return self.gate.shape[0]

    def householder(self, x):
        if x.dim() != 3 or x.shape[-1] != self.down.shape[-1]:
            raise PosencError(f"PaTH's transforms read the layer's input (b, n, {self.down.shape[-1]}), got "
                              f"{tuple(x.shape)}")
        return householder_vectors(x, self.down, self.up, self.gate, self.gate_bias)

    def forward(self, x, positions=None):
        """PaTH has no hook that acts on one tensor: this raises a one-line error naming the call to make."""
        raise PosencError("PaTH cannot be called on one tensor: call attention(q, k, v, encoding, "
                          "householder=encoding.householder(x)) with the layer's input x (b, n, d_model)")

    def extra_repr(self) -> str:
        heads, head_dim, rank = self.up.shape
        return f"hook=householder, {heads} heads x {head_dim}, rank {rank}" + (", forget gates" if self.has_decay else "")


class PaTH(PaTHLayer):
    """PaTH (Yang et al. 2025): every layer its own transforms (:class:`PaTHLayer`), no other position signal. This
    object holds the first layer's, and ``n_layer - 1`` more, which :meth:`for_layer` hands to the other layers;
    alone (outside a model) it is the first layer's. ``rank``: of the projection that gives ``w`` (32, the authors').

    Shapes: ``householder(x)``: ``x`` ``b n d_model`` -> ``w`` ``b h n d``, ``beta`` ``b h n``; then
    ``attention(q, k, v, path, householder=(w, beta))`` with ``q, k, v`` ``b h n d``.

    >>> import torch; from posenc_lab import PaTH, attention
    >>> path, x = PaTH(2, 16), torch.randn(1, 5, 16)
    >>> w, beta = path.householder(x); w.shape, beta.shape, bool(((0 < beta) & (beta < 2)).all())
    (torch.Size([1, 2, 5, 8]), torch.Size([1, 2, 5]), True)
    >>> q, k, v = torch.randn(3, 1, 2, 5, 8)
    >>> attention(q, k, v, path, householder=(w, beta)).shape
    torch.Size([1, 2, 5, 8])
    """

    variant_of = "rope"  # a rotation-like transform of the score, accumulated over the tokens in between
    shape = {"num_heads": "num_heads", "d_model": "d_model", "head_dim": "head_dim", "n_layer": "n_layer"}

    def __init__(self, num_heads: int, d_model: int, head_dim: int | None = None, *, n_layer: int = 1, rank: int = 32,
                 forget: bool = False):
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise PosencError(f"PaTH needs a positive number of layers, got n_layer={n_layer!r}")
        head_dim = d_model // num_heads if head_dim is None else head_dim
        super().__init__(num_heads, d_model, head_dim, rank=rank, forget=forget)
        self.later = nn.ModuleList(PaTHLayer(num_heads, d_model, head_dim, rank=rank, forget=forget)
                                   for _ in range(n_layer - 1))

    def for_layer(self, layer: int, n_layer: int) -> Encoding:
        if n_layer != len(self.later) + 1:
            raise PosencError(f"this PaTH has transforms for {len(self.later) + 1} layers, the model has {n_layer}: "
                              f"build it with n_layer={n_layer}")
        return self if layer == 0 else self.later[layer - 1]


class PaTHFoX(PaTH):
    """PaTH-FoX (Yang et al. 2025): PaTH's transforms and FoX's forget gates in every layer, the logit

        (q_i^T H_i ... H_{j+1} k_j + sum_{l=j+1}^{i} log f_l) / sqrt(d),

    the gates' sum divided by ``sqrt(d)`` with the rest, as in the authors' reference (``naive_path_attn`` in
    fla-org/flash-linear-attention); the package's FoX adds its sum undivided. The gates start as FoX's (``w_f``
    normal with standard deviation 0.02, ``b_f`` at 0) and reach attention through the ``decay`` hook, the
    transforms through ``householder``: the backends add the two terms as they add them for each alone.

    Shapes: ``householder(x)``: ``x`` ``b n d_model`` -> ``w`` ``b h n d``, ``beta`` ``b h n``; ``decay(x)`` ->
    ``b h n``.

    >>> import torch; from posenc_lab import PaTHFoX, attention
    >>> enc, x = PaTHFoX(2, 16), torch.randn(1, 5, 16)
    >>> q, k, v = torch.randn(3, 1, 2, 5, 8)
    >>> attention(q, k, v, enc, householder=enc.householder(x), decay=enc.decay(x)).shape
    torch.Size([1, 2, 5, 8])
    """

    name = "path-fox"
    variant_of = "path"  # PaTH with a forget gate

    def __init__(self, num_heads: int, d_model: int, head_dim: int | None = None, *, n_layer: int = 1, rank: int = 32):
        super().__init__(num_heads, d_model, head_dim, n_layer=n_layer, rank=rank, forget=True)
