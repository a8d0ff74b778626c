"""FoX, the Forgetting Transformer (Lin et al. 2025): a forget gate per head and token whose logarithms, summed
from a key to the query, are added to the attention logit -- a learned ALiBi whose slope follows the input.

With ``x_t`` the layer's input at token ``t``, head ``h`` has the forget gate

    f_t = sigmoid(w_f . x_t + b_f)                       (one scalar per head and token)

and the logit of query ``i`` and key ``j <= i`` gets

    D_ij = sum_{l=j+1}^{i} log f_l = c_i - c_j,          c_t = sum_{l<=t} log f_l .

A constant gate ``f`` gives ``D_ij = -(i - j) (-log f)``: ALiBi with slope ``-log f``. The gate reads the layer's
input, which the attention function does not see: the model asks the layer's encoding for its decays
(:meth:`~posenc_lab.encodings.Encoding.decay`) and hands them to :func:`~posenc_lab.backends.attention`, which
turns their running sums into ``D`` on every backend, and keeps each cached token's ``c_t`` in a key/value cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from ..errors import PosencError
from .base import Encoding


def log_forget(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``log f_t = log sigmoid(w_f . x_t + b_f)`` of every head and token (``b h n``, float32), from the layer's input
    ``x`` (``b n d_model``), the gates' weights ``w_f`` (``h d_model``) and biases ``b_f`` (``h``)."""
    logits = einsum(x, weight.to(x.dtype), "b n d, h d -> b h n")
    return F.logsigmoid(logits.float() + rearrange(bias.float(), "h -> 1 h 1"))


def forget_sums(log_f: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """The running sums ``c_t = c_start + sum_{l<=t} log f_l`` (``b h n``) of the log forget values ``log_f``
    (``b h n``); ``start`` (``b h``): the sum of the tokens before them (a key/value cache's last), 0 without."""
    sums = log_f.float().cumsum(dim=-1)
    return sums if start is None else sums + rearrange(start, "b h -> b h 1")


def decay_bias(c_q: torch.Tensor, c_k: torch.Tensor) -> torch.Tensor:
    """``D_ij = c_i - c_j = sum_{l=j+1}^{i} log f_l`` (``b h i j``) from the running sums of the queries ``c_q``
    (``b h i``) and of the keys ``c_k`` (``b h j``); at most 0 for every key at or before its query."""
    return rearrange(c_q, "b h i -> b h i 1") - rearrange(c_k, "b h j -> b h 1 j")


class FoXLayer(Encoding):
    """One layer's forget gates (Lin et al. 2025): ``f_t = sigmoid(w_f . x_t + b_f)``, one scalar per head and token,
    read from the layer's input by :meth:`~posenc_lab.encodings.Encoding.decay`. ``w_f`` starts normal with standard deviation 0.02 and ``b_f`` at
    ``gate_bias`` (0: the paper's code initialises its data-dependent gate as any linear layer, so every gate starts
    near 1/2). Causal attention only: ``D_ij`` sums the gates between a key and a later query. The gate is the whole
    position signal, as in the paper's basic FoX (no RoPE beside it); "FoX (Pro)"'s output gate, output norm,
    QK-norm and key/value shift are not position encodings and are not built here. Like every encoding parameter,
    ``w_f`` takes no weight decay here (the authors' code decays it and exempts ``b_f`` only)."""

    name, hook = "fox", "decay"
    reads_tokens = True
    noncausal = False

    def __init__(self, num_heads: int, d_model: int, *, gate_bias: float = 0.0):
        super().__init__()
        self.w_f = nn.Parameter(0.02 * torch.randn(num_heads, d_model))  # h d_model
        self.b_f = nn.Parameter(torch.full((num_heads,), float(gate_bias)))  # h

    @property
    def num_heads(self) -> int:
        """One forget gate per head."""
        return self.w_f.shape[0]

    def decay(self, x):
        if x.dim() != 3 or x.shape[-1] != self.w_f.shape[-1]:
            raise PosencError(f"FoX's gates read the layer's input (b, n, {self.w_f.shape[-1]}), got {tuple(x.shape)}")
        return log_forget(x, self.w_f, self.b_f)

    def extra_repr(self) -> str:
        heads, d_model = self.w_f.shape
        return f"hook=decay, {heads} heads x {d_model}"


class FoX(FoXLayer):
    """FoX, the Forgetting Transformer (Lin et al. 2025): every layer its own forget gates (:class:`FoXLayer`), no
    other position signal.

    Shapes: ``decay(x)``: the layer's input ``x`` ``b n d_model`` -> ``log f`` ``b h n``, which
    ``attention(q, k, v, fox, decay=...)`` reads (``fox(x)`` alone is refused: call ``decay``).

    >>> import torch; from posenc_lab import FoX
    >>> log_f = FoX(2, 16).decay(torch.randn(1, 5, 16))
    >>> log_f.shape, bool((log_f < 0).all())
    (torch.Size([1, 2, 5]), True)

    This object holds the first layer's gates, and ``n_layer - 1`` more, which
    :meth:`for_layer` hands to the other layers; ``decay`` alone (outside a model) is the first layer's.
    ``gate_bias`` starts every gate's ``b_f`` (0, the paper's).
    """

    variant_of = "alibi"  # ALiBi with a slope that each token sets
    shape = {"num_heads": "num_heads", "d_model": "d_model", "n_layer": "n_layer"}

    def __init__(self, num_heads: int, d_model: int, *, n_layer: int = 1, gate_bias: float = 0.0):
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise PosencError(f"FoX needs a positive number of layers, got n_layer={n_layer!r}")
        super().__init__(num_heads, d_model, gate_bias=gate_bias)
        self.later = nn.ModuleList(FoXLayer(num_heads, d_model, gate_bias=gate_bias) for _ in range(n_layer - 1))

    def for_layer(self, layer: int, n_layer: int) -> Encoding:
        if n_layer != len(self.later) + 1:
            raise PosencError(f"this FoX has gates for {len(self.later) + 1} layers, the model has {n_layer}: "
                              f"build it with n_layer={n_layer}")
        return self if layer == 0 else self.later[layer - 1]
