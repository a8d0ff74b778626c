"""DAPE, data-adaptive position encoding (Zheng et al. 2024): a small network reads each attention logit beside a
position bias and adds what it computes, so that the bias a query gives a key depends on what the two say.

For query ``i`` and key ``j``, with ``S_ij`` the ``H`` heads' logits ``q_i . k_j / sqrt(d)`` and ``B_ij`` the ``H``
heads' base bias (ALiBi, KERPLE or FIRE), every head's logit is

    A_ij = S_ij + B_ij + f(S, B)_ij ,
    f(S, B)_ij = W_2 LeakyReLU(W_1 [S_ij; B_ij] + c_1) + c_2 ,

``W_1`` (``D x 2H``) and ``W_2`` (``H x D``) mixing the heads: ``f`` is one two-layer network applied to the ``2H``
numbers of each query-key pair, its ``D`` (the paper's ``D_DAPE``, 32 in its runs) hidden units shared by the heads.
``f`` adds to the logits and the base bias rather than replacing them (the form of the authors' released code),
so ``W_2 = 0, c_2 = 0`` gives the base encoding back exactly. The logits ``f`` reads are the scaled ones before the
causal mask, as in the authors' released code; a pair's output depends on that pair alone, so the keys a query does
not see change none of its outputs.

DAPE v2 (Zheng et al. 2025, "process attention score as feature map") widens both maps into convolutions along the
keys of one query's row: ``kernel = t`` (3 in the paper) lets pair ``(i, j)`` read pairs ``(i, j - t//2 ..
j + t//2)``. ``kernel = 1`` is DAPE itself. The released code zeroes the entries of the keys after the query
before its first convolution, which already keeps what those keys say out of the row; here they are zeroed before
each of the two, so that a query attending with a key/value cache (its row ending at its own key, the hidden layer
padded with zeros past it) gets the same logits as in one pass over the whole window. With ``kernel = 3`` this
changes one logit of each row but the window's last from the released code's: that of the query's own key.

The bias reads the queries and keys, so the attention backends compute it from them
(:meth:`~posenc_lab.encodings.Encoding.token_bias`, handed the pairs' positions for the base bias).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum
from torch import nn

from ..errors import PosencError
from .base import Encoding
from .biases import ALiBi, Fire, Kerple

#: the slope of LeakyReLU's negative side in DAPE's network (PyTorch's default, which the released code keeps)
LEAKY_SLOPE = 0.01


def conv_keys(x: torch.Tensor, layer: nn.Conv2d) -> torch.Tensor:
    """``layer`` (a ``1 x t`` convolution, ``t`` odd) along the keys of every query row of ``x`` (``b c i j``), the
    row padded with ``t // 2`` zeros on each side: ``b c' i j``. For ``t = 1``, a linear map of the channels of each
    pair."""
    weight, bias = layer.weight.to(x.dtype), layer.bias.to(x.dtype)
    return F.conv2d(x, weight, bias, padding=(0, weight.shape[-1] // 2))


def dape_term(scores: torch.Tensor, base: torch.Tensor, hidden: torch.Tensor, inner: nn.Conv2d,
              outer: nn.Conv2d) -> torch.Tensor:
    """DAPE's ``f(S, B)`` (``b h i j``) from the logits ``scores`` (``b h i j``), the base bias ``base`` (``h i j`` or
    ``b h i j``) and ``hidden`` (``i j`` or ``b 1 i j``, True where query ``i`` does not see key ``j``): the ``2H``
    features of every pair, zero on the unseen keys, through ``inner`` (``2H -> D``), LeakyReLU, zero on the unseen
    keys again, and ``outer`` (``D -> H``). With kernels of one key (DAPE itself) it hands the work to
    :func:`dape_pairwise`, which gives the same numbers faster."""
    if inner.kernel_size[-1] == 1 and outer.kernel_size[-1] == 1:
        return dape_pairwise(scores, base, hidden, inner, outer)
    features = torch.cat([scores, base.expand(scores.shape)], dim=1).masked_fill(hidden, 0.0)  # b 2h i j
    middle = F.leaky_relu(conv_keys(features, inner), LEAKY_SLOPE).masked_fill(hidden, 0.0)  # b D i j
    return conv_keys(middle, outer)


def dape_pairwise(scores: torch.Tensor, base: torch.Tensor, hidden: torch.Tensor, inner: nn.Conv2d,
                  outer: nn.Conv2d) -> torch.Tensor:
    """:func:`dape_term` for maps of one key each (``1 x 1`` convolutions): a pair's ``f`` reads that pair alone, so
    zeroing the unseen keys' features changes only the unseen pairs, whose ``f`` is then the outer map's bias. The
    network runs over every pair unmasked and the unseen pairs are set to that bias afterwards: two passes over the
    ``b D i j`` activations fewer. The unseen pairs' logits and base bias must be finite (they are: keys are
    projections of tokens, and every base bias is finite at every pair), since they now pass through the network."""
    features = torch.cat([scores, base.expand(scores.shape)], dim=1)  # b 2h i j
    f = conv_keys(F.leaky_relu(conv_keys(features, inner), LEAKY_SLOPE, inplace=True), outer)  # b h i j
    return torch.where(hidden, outer.bias.to(f.dtype)[:, None, None], f)


class DAPELayer(Encoding):
    """One layer's DAPE: the base bias encoding ``base`` (shared with the model's other layers) and this layer's
    network ``f`` (``inner``: ``2H -> width``, ``outer``: ``width -> H``, each a convolution of ``kernel`` keys:
    1 is DAPE, 3 DAPE v2), initialised as PyTorch initialises a linear layer, as in the released code.
    :meth:`token_bias` is ``B + f(S, B)``, computed in float32 at least (float64 for float64 inputs)."""

    hook = "token_bias"
    reads_tokens = True

    def __init__(self, base: Encoding, *, width: int = 32, kernel: int = 1):
        for label, value in (("width", width), ("kernel", kernel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PosencError(f"DAPE's {label} must be a positive integer, got {value!r}")
        if kernel % 2 == 0:
            raise PosencError(f"DAPE's kernel must be odd (a pair reads kernel // 2 keys on each side), got {kernel}")
        super().__init__()
        self.base, heads = base, base.num_heads
        self.noncausal = base.noncausal  # f reads one pair (or a row's neighbours): defined both ways, as its base
        self.inner = nn.Conv2d(2 * heads, width, (1, kernel))
        self.outer = nn.Conv2d(width, heads, (1, kernel))

    @property
    def num_heads(self) -> int:
        """One logit and one base bias per head in, one bias per head out."""
        return self.base.num_heads

    #: hidden activations computed at once (elements): the queries are taken a few rows at a time past it
    CHUNK = 2**24

    def token_bias(self, q, k, hidden, q_pos=None, k_pos=None):
        if q_pos is None or k_pos is None:
            raise PosencError("DAPE's bias reads the base bias at the queries' and keys' positions: pass q_pos and k_pos")
        # query rows in chunks, so that the hidden activations (batch x width x rows x keys) stay small
        rows = max(1, self.CHUNK // max(1, q.shape[0] * self.inner.out_channels * k.shape[-2]))
        parts = [self._rows(q[:, :, i:i + rows], k, hidden[..., i:i + rows, :], q_pos[..., i:i + rows], k_pos)
                 for i in range(0, q.shape[-2], rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def _rows(self, q, k, hidden, q_pos, k_pos):
        work = torch.promote_types(q.dtype, torch.float32)
        scores = einsum(q.to(work), k.to(work), "b h i d, b h j d -> b h i j") / math.sqrt(q.shape[-1])
        base = self.base.bias(q_pos, k_pos).to(work)  # h i j (b h i j for positions b n)
        return base + dape_term(scores, base, hidden, self.inner, self.outer)

    def extra_repr(self) -> str:
        return (f"hook=token_bias, base={self.base.name}, width={self.inner.out_channels}, "
                f"kernel={self.inner.kernel_size[-1]}")


class DAPE(DAPELayer):
    """DAPE (Zheng et al. 2024) on a base bias, every layer with its own network ``f`` (:class:`DAPELayer`) and the
    base bias shared by the layers, as the package's KERPLE and FIRE are. This object holds the first layer's network
    and ``n_layer - 1`` more layers, which :meth:`for_layer` hands to the other layers; alone (outside a model) it is
    the first layer's. ``width``: ``D_DAPE`` (32, the paper's); ``kernel``: 1 (DAPE) or an odd width of the
    convolution along the keys (3: DAPE v2)."""

    def __init__(self, base: Encoding, *, n_layer: int = 1, width: int = 32, kernel: int = 1):
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise PosencError(f"DAPE needs a positive number of layers, got n_layer={n_layer!r}")
        super().__init__(base, width=width, kernel=kernel)
        self.later = nn.ModuleList(DAPELayer(base, width=width, kernel=kernel) for _ in range(n_layer - 1))

    def for_layer(self, layer: int, n_layer: int) -> Encoding:
        if n_layer != len(self.later) + 1:
            raise PosencError(f"this DAPE has networks for {len(self.later) + 1} layers, the model has {n_layer}: "
                              f"build it with n_layer={n_layer}")
        return self if layer == 0 else self.later[layer - 1]


class DAPEALiBi(DAPE):
    """DAPE on ALiBi's fixed slopes (``alibi_heads`` as for :class:`~posenc_lab.encodings.ALiBi`).

    Shapes: ``token_bias(q, k, hidden, q_pos, k_pos)``: ``q`` ``b h i d``, ``k`` ``b h j d``, ``hidden`` ``i j``,
    ``q_pos`` ``i``, ``k_pos`` ``j`` -> ``b h i j``; :func:`~posenc_lab.backends.attention` calls it.

    >>> import torch; from posenc_lab import ALiBi, DAPEALiBi
    >>> dape, q, pos, hidden = DAPEALiBi(2), torch.randn(1, 2, 5, 8), torch.arange(5), torch.ones(5, 5).triu(1).bool()
    >>> with torch.no_grad(): _ = dape.outer.weight.zero_(), dape.outer.bias.zero_()  # f = 0: ALiBi itself
    >>> b = dape.token_bias(q, q, hidden, pos, pos); b.shape, torch.allclose(b[0], ALiBi(2).bias(pos, pos))
    (torch.Size([1, 2, 5, 5]), True)
    """

    name, variant_of = "dape-alibi", "alibi"
    shape = {"num_heads": "num_heads", "n_layer": "n_layer"}

    def __init__(self, num_heads: int, *, n_layer: int = 1, width: int = 32, kernel: int = 1, **base_options):
        super().__init__(ALiBi(num_heads, **base_options), n_layer=n_layer, width=width, kernel=kernel)


class DAPEKerple(DAPE):
    """DAPE on KERPLE-log (the paper's best base), ``init_r1``, ``init_r2`` as for :class:`~posenc_lab.encodings.Kerple`.

    Shapes: ``token_bias(q, k, hidden, q_pos, k_pos)``: ``q`` ``b h i d``, ``k`` ``b h j d``, ``hidden`` ``i j``,
    ``q_pos`` ``i``, ``k_pos`` ``j`` -> ``b h i j``; :func:`~posenc_lab.backends.attention` calls it.

    >>> import torch; from posenc_lab import DAPEKerple
    >>> q, pos, hidden = torch.randn(1, 2, 5, 8), torch.arange(5), torch.ones(5, 5).triu(1).bool()
    >>> DAPEKerple(2, width=16).token_bias(q, q, hidden, pos, pos).shape
    torch.Size([1, 2, 5, 5])
    """

    name, variant_of = "dape-kerple", "kerple"
    shape = {"num_heads": "num_heads", "n_layer": "n_layer"}

    def __init__(self, num_heads: int, *, n_layer: int = 1, width: int = 32, kernel: int = 1, **base_options):
        super().__init__(Kerple(num_heads, **base_options), n_layer=n_layer, width=width, kernel=kernel)


class DAPEFire(DAPE):
    """DAPE on FIRE (its threshold starting at the training length, as :class:`~posenc_lab.encodings.Fire`'s).

    Shapes: ``token_bias(q, k, hidden, q_pos, k_pos)``: ``q`` ``b h i d``, ``k`` ``b h j d``, ``hidden`` ``i j``,
    ``q_pos`` ``i``, ``k_pos`` ``j`` -> ``b h i j``; :func:`~posenc_lab.backends.attention` calls it.

    >>> import torch; from posenc_lab import DAPEFire
    >>> q, pos, hidden = torch.randn(1, 2, 5, 8), torch.arange(5), torch.ones(5, 5).triu(1).bool()
    >>> DAPEFire(2, train_len=16, kernel=3).token_bias(q, q, hidden, pos, pos).shape  # kernel 3: DAPE v2
    torch.Size([1, 2, 5, 5])
    """

    name, variant_of = "dape-fire", "fire"
    shape = {"num_heads": "num_heads", "train_len": "train_len", "n_layer": "n_layer"}

    def __init__(self, num_heads: int, *, train_len: int = 512, n_layer: int = 1, width: int = 32, kernel: int = 1,
                 **base_options):
        super().__init__(Fire(num_heads, train_len=train_len, **base_options), n_layer=n_layer, width=width,
                         kernel=kernel)
