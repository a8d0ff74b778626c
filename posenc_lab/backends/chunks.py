"""A layer's own span of keys, and attention within chunks.

A local layer of a mix (:mod:`posenc_lab.encodings`) carries its span on its encoding: ``window = W`` (keys with
``i - j < W``) or ``chunk = C`` (Llama 4's chunked attention: keys with ``floor(i / C) == floor(j / C)``, and not
after the query when causal). :func:`layer_span` combines it with the caller's ``reach``; the ``sdpa`` backend
attends chunk by chunk (:func:`sdpa_in_chunks`), ``reference`` and ``flex`` mask the keys of other chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..encodings import Encoding
from ..errors import PosencError
from .masks import _is_range, bias_block, future_mask, other_chunk, out_of_reach


def layer_span(encoding: Encoding, reach: int | None, chunk: int | None) -> tuple[int | None, int | None]:
    """The ``(reach, chunk)`` one call of attention applies: the smaller of ``reach`` and the encoding's own
    ``window`` (a window within a window is the smaller one), and ``chunk`` or the encoding's own ``chunk`` (the two
    must agree: chunks of two sizes are chunks of neither). A ``reach`` and a chunk both apply: a query sees the
    keys of its chunk that are within reach."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise PosencError(f"chunk must be a positive integer (the positions of one chunk), got {chunk!r}")
    if encoding.window is not None:
        reach = encoding.window if reach is None else min(reach, encoding.window)
    if encoding.chunk is not None and chunk is not None and chunk != encoding.chunk:
        raise PosencError(f"this layer attends within chunks of {encoding.chunk} positions; chunk={chunk} would "
                          "split them differently: leave chunk unset")
    return reach, encoding.chunk if encoding.chunk is not None else chunk


def chunk_rows(q_first: int, nq: int, k_first: int, nk: int, chunk: int):
    """``(q_start, q_stop, k_start, k_stop)``: the rows of the queries (consecutive positions from ``q_first``) and of
    the keys (from ``k_first``) in each chunk of ``chunk`` positions that holds a query."""
    for c in range(q_first // chunk, (q_first + nq - 1) // chunk + 1):
        lo, hi = c * chunk, (c + 1) * chunk
        yield (max(lo, q_first) - q_first, min(hi, q_first + nq) - q_first,
               min(max(lo - k_first, 0), nk), min(max(hi - k_first, 0), nk))


def sdpa_in_chunks(sdpa, q, k, v, encoding, q_pos, k_pos, causal, reach, chunk):
    """The ``sdpa`` backend (``sdpa(q, k, v, encoding, q_pos, k_pos, causal, reach)``) within chunks. For consecutive
    positions (every forward pass of the model, and a key/value cache) each chunk is attended on its own, its
    queries against its keys: the causal square of one chunk, FlashAttention's fused path where there is no bias
    and no reach, ``n C`` scores in all instead of ``n^2``. For other positions, and under ``torch.compile``
    (which cannot read them), one mask over every pair (:func:`sdpa_masked`)."""
    if not (_is_range(q_pos) and _is_range(k_pos)):
        return sdpa_masked(q, k, v, encoding, q_pos, k_pos, causal, reach, chunk)
    rows = chunk_rows(int(q_pos[0]), q.shape[-2], int(k_pos[0]), k.shape[-2], chunk)
    outputs = [sdpa(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], encoding, q_pos[qa:qb], k_pos[ka:kb], causal, reach)
               for qa, qb, ka, kb in rows]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def sdpa_masked(q, k, v, encoding, q_pos, k_pos, causal, reach, chunk):
    """SDPA with one ``(1, h | 1, n_q, n_k)`` float mask: the bias (if any), ``-inf`` on the keys after each query
    (when ``causal``), out of ``reach`` and in another chunk."""
    nq, nk = q.shape[-2], k.shape[-2]
    if encoding.has_bias:
        mask = bias_block(encoding, q_pos, k_pos, causal=causal, offset=nk - nq, dtype=q.dtype)
    else:
        mask = q.new_zeros(1, 1, nq, nk)
        if causal:
            mask = mask.masked_fill(future_mask(nq, nk, q.device), float("-inf"))
    blocked = other_chunk(q_pos, k_pos, chunk)  # nq nk
    if reach is not None:
        blocked = blocked | out_of_reach(q_pos, k_pos, reach, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.masked_fill(blocked, float("-inf")))
