"""One attention function, several interchangeable backends.

``attention(q, k, v, encoding)`` computes

    softmax(q_m . k_n / sqrt(d) + b[h, m, n]) v      over the keys n <= m (causal),

after the encoding's ``rotate`` hook has transformed ``q`` and ``k``. Backends:

* ``reference``: the formula above written out with einsum and softmax, in float64. The
  yardstick every other backend is tested against; O(n^2) memory.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``; a bias is materialized as a
  float mask (O(n^2) memory), no bias takes the fused causal kernel. Trains on every device.
* ``flex``: FlexAttention with the bias as a ``score_mod`` and a causal block mask: no ``n x n``
  tensor anywhere. CUDA, or forward only on CPU.
* ``auto``: ``flex`` for bias encodings on CUDA when FlexAttention is available, else ``sdpa``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

from .encodings import Encoding, NoPE
from .errors import PosencError, unknown_name

BACKENDS = ("auto", "reference", "sdpa", "flex")
_NOPE = NoPE()


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise PosencError(f"q, k, v must be 4-d (batch, heads, positions, head_dim); got {q.dim()}-d, {k.dim()}-d, {v.dim()}-d")
    if q.shape != k.shape or k.shape[:-1] != v.shape[:-1]:
        raise PosencError(
            f"q, k, v shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(q and k must be equal; v may differ only in its last axis)"
        )


def flex_available(device: torch.device) -> bool:
    """FlexAttention is importable and runs on ``device`` (CUDA; CPU forward-only)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return device.type in ("cuda", "cpu")


def choose_backend(encoding: Encoding, device: torch.device, *, needs_grad: bool = False) -> str:
    """The default backend: FlexAttention for biases on CUDA, SDPA everywhere else."""
    if encoding.has_bias and device.type == "cuda" and flex_available(device):
        return "flex"
    return "sdpa"


def bias_tensor(encoding: Encoding, positions: torch.Tensor) -> torch.Tensor | None:
    """The materialized ``h n n`` bias, built from the per-distance table when the bias is distance-only."""
    if not encoding.has_bias:
        return None
    if encoding.distance_only:
        table = encoding.distance_bias(int(positions.max()) + 1)  # h d
        d = (rearrange(positions, "i -> i 1") - rearrange(positions, "j -> 1 j")).clamp(min=0)
        return table[:, d]
    return encoding.bias(positions, positions)


def causal_mask(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _reference(q, k, v, encoding, positions, causal):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = einsum(q.double(), k.double(), "b h i d, b h j d -> b h i j") * scale
    b = encoding.bias(positions, positions)
    if b is not None:
        scores = scores + b.double()
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], q.device), float("-inf"))
    weights = scores.softmax(dim=-1)
    return einsum(weights, v.double(), "b h i j, b h j d -> b h i d").to(v.dtype)


def _sdpa(q, k, v, encoding, positions, causal):
    b = bias_tensor(encoding, positions)
    if b is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    mask = b.to(q.dtype)
    if causal:
        mask = mask.masked_fill(~causal_mask(q.shape[-2], q.device), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def score_mod(encoding: Encoding, positions: torch.Tensor) -> Callable | None:
    """The encoding's bias as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``.

    Distance-only biases become a lookup in a small ``h x n`` table; every index is clamped,
    because a ``score_mod`` is evaluated on masked-out (future) positions too, where
    ``q_idx - kv_idx`` is negative.
    """
    if not encoding.has_bias:
        return None
    n = int(positions.max()) + 1
    if encoding.name == "alibi":
        slopes = encoding.slopes.to(positions.device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

        return alibi
    if encoding.distance_only:
        table = encoding.distance_bias(n)  # h d

        def by_distance(score, b, h, q_idx, kv_idx):
            return score + table[h, (q_idx - kv_idx).clamp(0, n - 1)]

        return by_distance
    if encoding.name == "fire":
        c, threshold = encoding.fire.params()
        first, last = encoding.fire.mlp[0], encoding.fire.mlp[2]
        w1, b1 = first.weight[:, 0], first.bias  # hidden
        w2, b2 = last.weight, last.bias  # heads x hidden, heads

        def fire(score, b, h, q_idx, kv_idx):
            d = (q_idx - kv_idx).clamp(min=0).to(c.dtype)
            x = torch.log1p(c * d) / torch.log1p(c * torch.maximum(threshold, q_idx.to(c.dtype)))
            hidden = torch.relu(w1 * x + b1)
            return score + (w2[h] * hidden).sum() + b2[h]

        return fire
    raise PosencError(f"no FlexAttention score_mod for encoding {encoding.name!r}")


def _flex(q, k, v, encoding, positions, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[-2]
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n,
                                       device=q.device)
    return flex_attention(q, k, v, score_mod=score_mod(encoding, positions), block_mask=block_mask)


_BACKEND_FNS = {"reference": _reference, "sdpa": _sdpa, "flex": _flex}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    encoding: Encoding | None = None,
    *,
    backend: str = "auto",
    causal: bool = True,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q, k, v`` (``b h n d``) with ``encoding``'s rotation and bias; returns ``b h n d_v``.

    ``positions`` (``n``, default ``0 .. n-1``) are the absolute positions of the tokens; pass the
    same tensor to every layer so that the encoding's tables are computed once per forward.
    """
    if backend not in BACKENDS:
        raise unknown_name("attention backend", backend, BACKENDS)
    _check_qkv(q, k, v)
    encoding = _NOPE if encoding is None else encoding
    if positions is None:
        positions = torch.arange(q.shape[-2], device=q.device)
    elif positions.shape != (q.shape[-2],):
        raise PosencError(f"positions must have shape ({q.shape[-2]},), got {tuple(positions.shape)}")
    if backend == "auto":
        backend = choose_backend(encoding, q.device)
    if backend == "flex" and not flex_available(q.device):
        raise PosencError(f"FlexAttention is not available on {q.device} with torch {torch.__version__}")
    q, k = encoding.rotate(q, k, positions)
    return _BACKEND_FNS[backend](q, k, v, encoding, positions, causal)
