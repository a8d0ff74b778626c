"""The backends themselves: the float64 reference, SDPA (its fused kernels, with a bias as float masks in blocks of
queries) and FlexAttention (the bias as a ``score_mod``), and the choice among them."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import einsum, repeat

from ..encodings import Encoding
from . import masks
from .chunks import sdpa_in_chunks
from .masks import _block_masks, _is_range, _query_blocks, future_mask, other_chunk, out_of_reach, score_mod

#: the backends :func:`~posenc_lab.backends.attention` accepts (``auto``: :func:`choose_backend`)
BACKENDS = ("auto", "reference", "sdpa", "flex")
#: queries per block of the ``sdpa`` backend's causal attention with a bias
BLOCK = 512
#: queries per block of the explicit softmax through which a learned bias trains on the CPU (each block with the keys it can see)
GRAD_BLOCK = 128
#: the largest bias mask (bytes, its blocks together) a forward pass builds once for all its layers; past it,
#: each layer builds each block of queries when it uses it
MASK_BUDGET = 2 * 2**30


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values of ``h_kv`` heads (``b h_kv n d``) for ``heads`` query heads: query head ``i`` reads key head
    ``i // (heads / h_kv)`` (grouped-query attention, Ainslie et al. 2023; multi-query when ``h_kv = 1``), the
    order of Hugging Face's ``repeat_kv``. Returns ``x`` itself when the numbers agree.

    Shapes: ``x`` ``b h_kv n d`` -> ``b heads n d``.

    >>> import torch; from posenc_lab import repeat_kv
    >>> k = torch.randn(1, 2, 5, 8)
    >>> repeat_kv(k, 6).shape, torch.equal(repeat_kv(k, 6)[:, 2], k[:, 0]), torch.equal(repeat_kv(k, 6)[:, 3], k[:, 1])
    (torch.Size([1, 6, 5, 8]), True, True)
    """
    if x.shape[1] == heads:
        return x
    return repeat(x, "b hk n d -> b (hk g) n d", g=heads // x.shape[1])


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


def _reference(q, k, v, encoding, q_pos, k_pos, causal, reach=None, tables=None, chunk=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = einsum(q.double(), k.double(), "b h i d, b h j d -> b h i j") * scale
    b = encoding.bias(q_pos, k_pos)
    if b is not None:
        scores = scores + b.double()
    if causal:
        scores = scores.masked_fill(future_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    if reach is not None:
        scores = scores.masked_fill(out_of_reach(q_pos, k_pos, reach, causal), float("-inf"))
    if chunk is not None:
        scores = scores.masked_fill(other_chunk(q_pos, k_pos, chunk), float("-inf"))
    weights = scores.softmax(dim=-1)
    return einsum(weights, v.double(), "b h i j, b h j d -> b h i d").to(v.dtype)


def _mask_bytes(encoding, q, k) -> int:
    heads = q.shape[1]
    return heads * q.shape[-2] * k.shape[-2] * q.element_size()


def _sdpa(q, k, v, encoding, q_pos, k_pos, causal, reach=None, tables=None, chunk=None):
    if chunk is not None:
        return sdpa_in_chunks(_sdpa, q, k, v, encoding, q_pos, k_pos, causal, reach, chunk)
    if reach is not None:
        return _sdpa_within_reach(q, k, v, encoding, q_pos, k_pos, causal, reach)
    nq, nk = q.shape[-2], k.shape[-2]
    offset = nk - nq
    if not encoding.has_bias:
        if not causal or (nq == 1 and offset >= 0):
            return F.scaled_dot_product_attention(q, k, v)
        if offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~future_mask(nq, nk, q.device))
    if q.device.type == "cpu" and encoding.needs_grad():  # needs_grad: grad mode and a learned parameter
        return _learned_bias_attention(q, k, v, encoding, q_pos, k_pos, causal, tables)
    within_budget = _mask_bytes(encoding, q, k) <= MASK_BUDGET
    spans, masks = _block_masks(encoding, q_pos, k_pos, causal, q.dtype, BLOCK, tables if within_budget else None)
    outputs = [F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys], attn_mask=mask)
               for (start, stop, keys), mask in zip(spans, masks)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _sdpa_within_reach(q, k, v, encoding, q_pos, k_pos, causal, reach):
    """``sdpa`` with a sliding-window mask: blocks of ``BLOCK`` queries, each with the keys it can reach when the
    positions are consecutive (at ``reach = BLOCK``, fewer than ``2 BLOCK`` keys per causal block and
    ``3 BLOCK`` per non-causal one, whatever the length), every key otherwise; each block's mask is the bias (if any), the causal ``-inf`` and the window's ``-inf``."""
    nq, nk = q.shape[-2], k.shape[-2]
    offset = nk - nq
    consecutive = _is_range(q_pos) and _is_range(k_pos)
    shift = int(q_pos[0] - k_pos[0]) if consecutive else 0  # query row r sits at key row r + shift
    outputs = []
    for start, stop, keys in _query_blocks(nq, nk, causal, BLOCK):
        lo, hi = 0, keys
        if consecutive:
            lo = min(max(0, shift + start - reach + 1), keys)
            if not causal:
                hi = max(lo, min(nk, shift + stop - 1 + reach))
        qp, kp = q_pos[start:stop], k_pos[lo:hi]
        if encoding.has_bias:
            mask = masks.bias_block(encoding, qp, kp, causal=causal, offset=offset + start - lo, dtype=q.dtype)
        else:
            mask = q.new_zeros(1, 1, stop - start, hi - lo)
            if causal:
                mask = mask.masked_fill(future_mask(stop - start, hi - lo, q.device, offset + start - lo), float("-inf"))
        mask = mask.masked_fill(out_of_reach(qp, kp, reach, causal), float("-inf"))
        outputs.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, lo:hi], v[:, :, lo:hi],
                                                      attn_mask=mask))
    return torch.cat(outputs, dim=2)


def _softmax_attention(q, k, v, mask):
    """``softmax(q k^T / sqrt(d) + mask) v`` written out: for a mask that needs its gradient on the CPU,
    where SDPA has no fused kernel with a mask gradient and its own explicit path adds checks for
    fully masked rows (no row here is: every query sees itself)."""
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)) + mask  # b h i j
    return torch.matmul(scores.softmax(dim=-1), v)


def _learned_bias_attention(q, k, v, encoding, q_pos, k_pos, causal, tables=None):
    """A bias that needs its gradient, on the CPU: the explicit softmax (:func:`_softmax_attention`) in
    blocks of ``GRAD_BLOCK`` queries, each block with only the keys it can see when causal (about half
    the scores of one causal square), its mask blocks built from the encoding once per forward pass
    (shared by the layers through ``tables``: the gradient flows back to the bias's parameters once)."""
    spans, masks = _block_masks(encoding, q_pos, k_pos, causal, q.dtype, GRAD_BLOCK, tables)
    outputs = [_softmax_attention(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys], mask)
               for (start, stop, keys), mask in zip(spans, masks)]
    return torch.cat(outputs, dim=2)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(nq: int, nk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = nk - nq
    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx, None, None, nq, nk, device=device)


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


def _reach_block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, reach: int | None,
                      chunk: int | None = None, keep: torch.Tensor | None = None):
    """FlexAttention's block mask of the keys within ``reach`` positions (every key when None), in the query's
    own chunk of ``chunk`` positions (when given), real in their batch row (``keep``, ``b j``, when given: one mask
    per row), and not after the query, when causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    nq, nk = q_pos.shape[-1], k_pos.shape[-1]
    offset = nk - nq

    def within(b, h, q_idx, kv_idx):
        seen = q_idx + offset >= kv_idx if causal else kv_idx >= 0  # non-causal: every key
        if reach is not None or chunk is not None:  # (positions b n come here with a padding mask alone)
            i, j = q_pos[q_idx], k_pos[kv_idx]
        if reach is not None:
            seen = seen & ((i - j < reach) if causal else ((i - j).abs() < reach))
        if chunk is not None:
            seen = seen & (i // chunk == j // chunk)
        if keep is not None:
            seen = seen & keep[b, kv_idx]
        return seen

    rows = None if keep is None else keep.shape[0]
    return create_block_mask(within, rows, None, nq, nk, device=str(q_pos.device))


def flex_block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, reach=None, chunk=None, keep=None):
    """FlexAttention's block mask of the keys each query sees: within ``reach`` and its ``chunk`` and real (``keep``)
    where given, else the causal one (None: every key)."""
    if reach is not None or chunk is not None or keep is not None:
        return _reach_block_mask(q_pos, k_pos, causal, reach, chunk, keep)
    return _causal_block_mask(q_pos.shape[-1], k_pos.shape[-1], str(q_pos.device)) if causal else None


def _flex(q, k, v, encoding, q_pos, k_pos, causal, reach=None, tables=None, chunk=None):
    block_mask = flex_block_mask(q_pos, k_pos, causal, reach, chunk)
    mod = score_mod(encoding, q_pos, k_pos)
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
        lambda: _sdpa(q, k, v, encoding, q_pos, k_pos, causal, reach, tables, chunk),
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
        except torch.cuda.OutOfMemoryError:
            raise  # not a kernel problem: the caller's clear_oom turns it into one sentence
        except Exception as err:  # a kernel that does not compile on this GPU: try the next tiles
            errors.append(f"{options}: {type(err).__name__}: {str(err)[:200]}")
    _flex_failed.add(key)
    warnings.warn(f"FlexAttention failed for {key} ({'; '.join(errors)}); falling back to SDPA with a "
                  "materialized bias", RuntimeWarning, stacklevel=3)
    return fallback()


_BACKEND_FNS = {"reference": _reference, "sdpa": _sdpa, "flex": _flex}
