"""Attention whose logits read the tokens themselves, on every backend: a decay computed from the layer's input
(FoX's forget gates) and a bias computed from the queries and keys (CoPE).

For query row ``i`` and key row ``j`` of head ``h``, the logit is

    q_i . k_j / sqrt(d)  +  b_h(m_i, n_j)  +  (c_i - c_j)  +  t_ij ,

with ``b`` the encoding's position bias (if it has one), ``c`` the running sums of the log forget values handed to
:func:`~posenc_lab.backends.attention` (``decay``; :func:`~posenc_lab.encodings.forgetting.decay_bias`) and ``t``
the encoding's :meth:`~posenc_lab.encodings.Encoding.token_bias`; the keys a query does not see (after it, out of
``reach``, in another ``chunk``, or padding: ``keep``, :func:`~posenc_lab.backends.attention`'s ``real_keys``) are
``-inf``. These terms differ from one batch row to the next, so every mask is ``b h i j``; a padding mask alone comes
here for the same reason. A query that sees no key at all (a padded query before the first real token) gets zeros,
not the NaN of a softmax over nothing. Backends:

* ``reference``: the logits above written out in float64 (the sums, the bias and the gates too).
* ``sdpa``: blocks of ``BLOCK`` queries, each with the keys it can see and its ``b h i j`` mask built as it is used
  (a layer's decays are its own: nothing to share among layers); on the CPU under gradients, the explicit softmax
  in blocks of ``GRAD_BLOCK`` queries (SDPA has no CPU kernel with a mask gradient), as the learned biases train.
* ``flex``: a ``score_mod`` adding ``c[b, h, i] - c[b, h, j]`` from the captured sums (no ``n x n`` tensor for the
  decay) and the token bias materialised once and gathered pair by pair.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

from ..encodings import Encoding
from ..encodings.forgetting import decay_bias
from ..encodings.householder import path_logits, path_logits_blocked
from ..errors import PosencError
from . import kernels, masks
from .masks import _query_blocks, future_mask, other_chunk, out_of_reach


def _hidden(q_pos, k_pos, nq: int, nk: int, causal: bool, reach, offset: int, device, chunk=None,
            keep=None) -> torch.Tensor:
    """``True`` (``i j``) where query row ``i`` does not see key row ``j``: after it (when causal), ``reach`` or more
    positions away, or in another chunk of ``chunk`` positions; with ``keep`` (``b j``, False for padding),
    ``b 1 i j``, the padded keys hidden too."""
    hidden = future_mask(nq, nk, device, offset) if causal else torch.zeros(nq, nk, dtype=torch.bool, device=device)
    if reach is not None:
        hidden = hidden | out_of_reach(q_pos, k_pos, reach, causal)
    if chunk is not None:
        hidden = hidden | other_chunk(q_pos, k_pos, chunk)
    return hidden if keep is None else hidden | rearrange(~keep, "b j -> b 1 1 j")


def _seeing(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask`` with the rows of queries that see no key set to 0 (a finite softmax), and those rows (``... i 1``,
    True where the query sees nothing), whose outputs are then set to 0."""
    blind = torch.isneginf(mask).all(dim=-1, keepdim=True)
    return mask.masked_fill(blind, 0.0), blind


def token_mask(encoding: Encoding, q, k, c_q, c_k, q_pos, k_pos, *, causal: bool, reach=None,
               offset: int | None = None, chunk=None, keep=None) -> torch.Tensor:
    """The additive mask ``b h i j`` (``q``'s dtype) of queries ``q`` (``b h i d``) against keys ``k`` (``b h j d``):
    the encoding's position bias, the decay ``c_i - c_j`` (``c_q``: ``b h i``, ``c_k``: ``b h j``; None without), the
    encoding's token bias, and ``-inf`` on the keys each query does not see (``offset``: query row ``r`` sits at key
    row ``r + offset``, default ``n_k - n_q``; ``chunk`` and the padding mask ``keep``, ``b j``: ``_hidden``)."""
    nq, nk = q.shape[-2], k.shape[-2]
    offset = nk - nq if offset is None else offset
    hidden = _hidden(q_pos, k_pos, nq, nk, causal, reach, offset, q.device, chunk, keep)
    mask = q.new_zeros(1, 1, nq, nk)
    if encoding.has_bias:
        mask = mask + encoding.bias(q_pos, k_pos).to(q.dtype)  # h i j
    if c_q is not None:
        mask = mask + decay_bias(c_q, c_k).to(q.dtype)
    extra = encoding.token_bias(q, k, hidden, q_pos, k_pos)
    if extra is not None:
        mask = mask + extra.to(q.dtype)
    return mask.masked_fill(hidden, float("-inf"))


def logits(q, k, householder=None, *, walk=False):
    """``q k^T / sqrt(d)`` (``b h i j``), or with ``householder = (w, beta)`` of the key rows PaTH's
    ``q_i^T H_i ... H_{j+1} k_j / sqrt(d)``, in ``q``'s dtype: block by block for a whole sequence
    (:func:`~posenc_lab.encodings.householder.path_logits_blocked`), or with ``walk`` (the reference) one key a step
    (:func:`~posenc_lab.encodings.householder.path_logits`)."""
    if householder is None:
        return einsum(q, k, "b h i d, b h j d -> b h i j") / math.sqrt(q.shape[-1])
    # the logits are linear in q: the scale goes on q (in the walk's float32 at least), not on the n x n logits
    scaled = q.to(torch.promote_types(q.dtype, torch.float32)) / math.sqrt(q.shape[-1])
    path = path_logits(scaled, k, *householder) if walk else path_logits_blocked(scaled, k, *householder)
    return path.to(q.dtype)


def reference(q, k, v, encoding, q_pos, k_pos, causal, reach=None, c_q=None, c_k=None, *, chunk=None, keep=None,
              householder=None):
    """``softmax(q k^T / sqrt(d) + mask) v`` (:func:`token_mask`) with every term in float64; PaTH's logits in place
    of ``q k^T / sqrt(d)`` with ``householder``, the encoding's :meth:`~posenc_lab.encodings.Encoding.weights` in
    place of the softmax (stick-breaking)."""
    q64, k64 = q.double(), k.double()
    c_q, c_k = (None, None) if c_q is None else (c_q.double(), c_k.double())
    scores = logits(q64, k64, None if householder is None else tuple(t.double() for t in householder), walk=True)
    mask, blind = _seeing(token_mask(encoding, q64, k64, c_q, c_k, q_pos, k_pos, causal=causal, reach=reach,
                                     chunk=chunk, keep=keep))
    weights = encoding.weights(scores + mask, k.shape[-2] - q.shape[-2])
    out = einsum(weights, v.double(), "b h i j, b h j d -> b h i d")
    return out.masked_fill(blind, 0.0).to(v.dtype)


def _explicit(encoding, q, k, v, c_q) -> bool:
    """Whether the mask needs its gradient on the CPU (the explicit softmax then)."""
    inputs = [t for t in (q, k, v, c_q) if t is not None]
    return q.device.type == "cpu" and torch.is_grad_enabled() and (
        encoding.needs_grad() or any(t.requires_grad for t in inputs))


def _written_out(encoding, q, k, v, mask, scores=None, offset=None):
    """Attention with its weights written out: ``softmax(q k^T / sqrt(d) + mask) v``, or the encoding's own
    :meth:`~posenc_lab.encodings.Encoding.weights` (stick-breaking) of ``scores + mask`` (``scores``: PaTH's logits,
    ``q k^T / sqrt(d)`` without), query row ``r`` at key row ``r + offset``."""
    if scores is None and encoding.weighting == "softmax":
        return kernels._softmax_attention(q, k, v, mask)
    scores = (logits(q, k) if scores is None else scores) + mask
    return torch.matmul(encoding.weights(scores, offset), v)


def sdpa(q, k, v, encoding, q_pos, k_pos, causal, reach=None, c_q=None, c_k=None, *, chunk=None, keep=None,
         householder=None):
    """SDPA with the :func:`token_mask` of each block of queries, each block with the keys it can see. Weights
    that are not a softmax of ``q k^T / sqrt(d)`` plus the mask -- PaTH's logits (``householder``, computed once for
    every query), stick-breaking's weights -- are written out in blocks of ``GRAD_BLOCK`` queries
    (``_written_out``), in the working dtype."""
    nq, nk = q.shape[-2], k.shape[-2]
    path = None if householder is None else logits(q, k, householder)  # b h i j
    explicit = _explicit(encoding, q, k, v, c_q) or path is not None or encoding.weighting != "softmax"
    outputs = []
    for start, stop, keys in _query_blocks(nq, nk, causal, kernels.GRAD_BLOCK if explicit else kernels.BLOCK):
        rows, cols = slice(start, stop), slice(0, keys)
        qb, kb, vb = q[:, :, rows], k[:, :, cols], v[:, :, cols]
        mask, blind = _seeing(token_mask(encoding, qb, kb, None if c_q is None else c_q[..., rows],
                                         None if c_k is None else c_k[..., cols], q_pos[..., rows], k_pos[..., cols],
                                         causal=causal, reach=reach, offset=nk - nq + start, chunk=chunk,
                                         keep=None if keep is None else keep[:, cols]))
        if explicit:
            out = _written_out(encoding, qb, kb, vb, mask, None if path is None else path[:, :, rows, cols],
                               nk - nq + start)
        else:
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
        outputs.append(out.masked_fill(blind, 0.0) if keep is not None else out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def token_score_mod(encoding, q, k, q_pos, k_pos, causal, reach, c_q, c_k, chunk=None, keep=None, householder=None):
    """The logits' extra terms as a FlexAttention ``score_mod``: the encoding's position bias (its own
    :func:`~posenc_lab.backends.masks.score_mod`), the decay read from the captured sums, the token bias gathered;
    with ``householder``, PaTH's logits, materialised once and gathered, in place of the kernel's ``q . k``."""
    base = masks.score_mod(encoding, q_pos, k_pos) if encoding.has_bias else None
    hidden = _hidden(q_pos, k_pos, q.shape[-2], k.shape[-2], causal, reach, k.shape[-2] - q.shape[-2], q.device,
                     chunk, keep)
    extra = encoding.token_bias(q, k, hidden, q_pos, k_pos)  # b h i j, or None
    path = None if householder is None else logits(q, k, householder)  # b h i j

    def tokens(score, b, h, q_idx, kv_idx):
        if path is not None:
            score = path[b, h, q_idx, kv_idx]
        if base is not None:
            score = base(score, b, h, q_idx, kv_idx)
        if c_q is not None:
            score = score + (c_q[b, h, q_idx] - c_k[b, h, kv_idx])
        if extra is not None:
            score = score + extra[b, h, q_idx, kv_idx]
        return score

    return tokens


def flex(q, k, v, encoding, q_pos, k_pos, causal, reach=None, c_q=None, c_k=None, *, chunk=None, keep=None,
         householder=None):
    """FlexAttention with :func:`token_score_mod` and the causal (or within-reach, within-chunk, padded) block mask; on
    CUDA, compiled, with :func:`sdpa` as the fallback when no kernel compiles. FlexAttention gives a query that sees no
    key zeros. It computes a softmax only: other weights (stick-breaking's) are refused."""
    if encoding.weighting != "softmax":
        raise PosencError(f"FlexAttention computes a softmax, and {encoding.name!r} weighs the keys by "
                          f"{encoding.weighting}: use backend='sdpa' (or 'reference')")
    block_mask = kernels.flex_block_mask(q_pos, k_pos, causal, reach, chunk, keep)
    mod = token_score_mod(encoding, q, k, q_pos, k_pos, causal, reach, c_q, c_k, chunk, keep, householder)
    fn = kernels._flex_fn(q.device.type)
    if q.device.type != "cuda":
        with warnings.catch_warnings():  # on the CPU FlexAttention runs unfused by design (forward only)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return fn(q, k, v, score_mod=mod, block_mask=block_mask)
    return kernels.first_kernel_that_compiles(
        f"{encoding.name}+tokens@{q.device}",
        lambda options: fn(q, k, v, score_mod=mod, block_mask=block_mask, kernel_options=options),
        lambda: sdpa(q, k, v, encoding, q_pos, k_pos, causal, reach, c_q, c_k, chunk=chunk, keep=keep,
                     householder=householder),
    )


#: the backends of logits that read the tokens, by name (``auto`` is ``sdpa``)
TOKEN_BACKENDS = {"reference": reference, "sdpa": sdpa, "flex": flex}
