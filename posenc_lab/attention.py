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
* ``auto``: :func:`choose_backend` (``flex`` for biases on recent CUDA GPUs, ``sdpa`` elsewhere).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

from .encodings import Encoding, NoPE, position_span
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
    """FlexAttention is importable and can run on ``device``: CUDA of compute capability 8.0+ (Ampere
    and later; older GPUs such as the T4 fall back to SDPA), or the CPU (forward only, unfused)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def _learned_bias(encoding: Encoding) -> bool:
    return encoding.has_bias and any(p.requires_grad for p in encoding.parameters())


def choose_backend(encoding: Encoding, device: torch.device) -> str:
    """The default backend for ``encoding`` on ``device``.

    * no bias (NoPE, absolute, RoPE, xPos): ``sdpa``, whose causal path is FlashAttention on CUDA;
    * a bias on CUDA with FlexAttention: ``flex`` (no ``n x n`` tensor) -- except while training a
      *learned* bias (T5, KERPLE, FIRE): gradients into tensors captured by a ``score_mod`` are slow,
      so training materializes the bias once per forward at the (short) training length and uses
      ``sdpa``, whose backward returns the bias gradient directly;
    * everything on the CPU: ``sdpa`` (FlexAttention has no backward there and is unfused).
    """
    if not encoding.has_bias or device.type != "cuda" or not flex_available(device):
        return "sdpa"
    if torch.is_grad_enabled() and _learned_bias(encoding):
        return "sdpa"
    return "flex"


def bias_tensor(encoding: Encoding, positions: torch.Tensor) -> torch.Tensor | None:
    """The materialized ``h n n`` bias, built from the per-distance table when the bias is distance-only.

    Built once per forward (:meth:`Encoding.per_forward`), so that the layers of one forward pass
    share one bias (and one node in the autograd graph).
    """
    if not encoding.has_bias:
        return None
    return encoding.per_forward("_bias_cache", positions, lambda: _materialize(encoding, positions))


def _materialize(encoding: Encoding, positions: torch.Tensor) -> torch.Tensor:
    if encoding.distance_only:
        table = encoding.distance_bias(position_span(positions))  # h d
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
    n = position_span(positions)
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


@functools.lru_cache(maxsize=32)
def _causal_block_mask(n: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n, device=device)


@functools.lru_cache(maxsize=None)
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # compiled on CUDA (the fused kernel); eager on the CPU, where it only runs forward anyway
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


# kernel options tried in turn on CUDA: the defaults, then smaller tiles (a table gather inside a
# score_mod has run out of shared memory with the default tiles on Hopper)
FLEX_KERNEL_OPTIONS = (None, {"BLOCK_M": 64, "BLOCK_N": 64})
_flex_options_that_work: dict[str, dict | None] = {}
_flex_failed: set[str] = set()


def _flex(q, k, v, encoding, positions, causal):
    n = q.shape[-2]
    block_mask = _causal_block_mask(n, str(q.device)) if causal else None
    mod = score_mod(encoding, positions)
    fn = _flex_fn(q.device.type)
    key = f"{encoding.name}@{q.device}"
    if torch.compiler.is_compiling():  # inside a compiled model: the outer compile builds the kernel
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=mod, block_mask=block_mask,
                              kernel_options=_flex_options_that_work.get(key))
    if q.device.type != "cuda":
        with warnings.catch_warnings():  # on the CPU FlexAttention runs unfused by design (forward only)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return fn(q, k, v, score_mod=mod, block_mask=block_mask)
    return first_kernel_that_compiles(
        key,
        lambda options: fn(q, k, v, score_mod=mod, block_mask=block_mask, kernel_options=options),
        lambda: _sdpa(q, k, v, encoding, positions, causal),
    )


def first_kernel_that_compiles(key: str, call: Callable, fallback: Callable):
    """``call(kernel_options)`` with the first of ``FLEX_KERNEL_OPTIONS`` that works, remembered per ``key``;
    if none does, warn once and use ``fallback()`` from then on (no repeated compile attempts)."""
    if key in _flex_failed:
        return fallback()
    candidates = [_flex_options_that_work[key]] if key in _flex_options_that_work else FLEX_KERNEL_OPTIONS
    errors = []
    for options in candidates:
        try:
            out = call(options)
            _flex_options_that_work[key] = options
            return out
        except Exception as err:  # a kernel that does not compile on this GPU: try the next tiles
            errors.append(f"{options}: {type(err).__name__}: {str(err)[:200]}")
    _flex_failed.add(key)
    warnings.warn(f"FlexAttention failed for {key} ({'; '.join(errors)}); falling back to SDPA with a "
                  "materialized bias", RuntimeWarning, stacklevel=3)
    return fallback()


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
