"""The bias as the attention backends consume it: the causal and sliding-window masks, the bias laid out as a
float mask (a per-distance table written as a Toeplitz matrix, or the pairwise bias) in blocks of queries, and
the bias as a FlexAttention ``score_mod``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange

from ..encodings import Encoding, Tables
from ..errors import PosencError, check_positions


def future_mask(nq: int, nk: int, device, offset: int | None = None) -> torch.Tensor:
    """``True`` where key ``j`` lies after query row ``r``: ``j > r + offset`` (default offset ``nk - nq``)."""
    offset = nk - nq if offset is None else offset
    rows = torch.arange(nq, device=device) + offset
    return rearrange(torch.arange(nk, device=device), "j -> 1 j") > rearrange(rows, "i -> i 1")


def _distance_range(q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest signed distance ``i - j`` between a query and a key position: values, which
    ``torch.compile`` cannot read (its callers build the bias pairwise there instead of sizing a table)."""
    return int(q_pos.min() - k_pos.max()), int(q_pos.max() - k_pos.min())


def _is_range(positions: torch.Tensor) -> bool:
    """``positions`` are consecutive integers ``p0, p0 + 1, ...`` (not decidable under ``torch.compile``)."""
    if torch.compiler.is_compiling() or positions.numel() == 0:
        return False
    n = positions.shape[-1]
    return int(positions[-1] - positions[0]) == n - 1 and bool((positions.diff() == 1).all())


def toeplitz(table: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """``M[h, r, c] = table[h, r - c + nk - 1]`` (``h x nq x nk``) from a per-distance table of ``nq + nk - 1``
    entries, written in one pass: the reversed table viewed with strides ``(1, 1)`` is the Hankel matrix
    ``R[r' + c]``, and taking its rows in reverse order gives the Toeplitz one (no ``nq x nk`` index tensor),
    laid out row by row, as SDPA reads a mask fastest."""
    reversed_ = table.flip(-1).contiguous()
    hankel = reversed_.as_strided((table.shape[0], nq, nk), (reversed_.stride(0), 1, 1))
    return hankel.index_select(1, torch.arange(nq - 1, -1, -1, device=table.device))


def bias_block(encoding: Encoding, q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, offset: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The ``(1, h, n_q, n_k)`` float mask: the bias, and ``-inf`` on the keys after each query when ``causal``.

    A distance-only bias is read from its per-distance table (``h x`` the distances that occur); for
    consecutive positions (every forward pass of the model) the mask is that table laid out as a
    Toeplitz matrix (:func:`toeplitz`), with the causal ``-inf`` written into the table's negative
    distances, otherwise one gather. FIRE, whose bias also depends on the query position, is
    evaluated at every pair, and so is every bias under ``torch.compile`` (which cannot read the
    positions to size a table, and fuses the pairwise formula instead).
    """
    nq, nk = q_pos.shape[-1], k_pos.shape[-1]
    if encoding.distance_only_at(q_pos) and not torch.compiler.is_compiling():
        lo, hi = _distance_range(q_pos, k_pos)
        table = encoding.distance_bias(torch.arange(lo, hi + 1, device=q_pos.device)).to(dtype)  # h d
        if _is_range(q_pos) and _is_range(k_pos):
            if causal:  # key c is after query r exactly when the distance is below this threshold
                cut = int(q_pos[0] - k_pos[0]) - offset - lo
                table = torch.cat([table.new_full((table.shape[0], max(cut, 0)), float("-inf")), table[:, max(cut, 0):]], 1)
            mask = toeplitz(table, nq, nk)
        else:
            index = rearrange(q_pos, "i -> i 1") - rearrange(k_pos, "j -> 1 j") - lo  # nq nk
            if causal:
                table = torch.cat([table, table.new_full((table.shape[0], 1), float("-inf"))], dim=1)
                index = index.masked_fill(future_mask(nq, nk, q_pos.device, offset), table.shape[1] - 1)
            mask = table[:, index]
    else:
        mask = encoding.bias(q_pos, k_pos).to(dtype)
        if causal:
            mask = mask.masked_fill(future_mask(nq, nk, q_pos.device, offset), float("-inf"))
    return rearrange(mask, "h i j -> 1 h i j")


def bias_mask(encoding: Encoding, q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool,
              dtype: torch.dtype, tables: Tables | None = None) -> torch.Tensor | None:
    """The whole ``(1, h, n_q, n_k)`` mask of :func:`bias_block` the ``sdpa`` backend uses, or None without a bias.

    With the ``tables`` of a forward pass, the first layer that asks builds it and the others share it (the
    backends never write to it); without, it is built here, and is the caller's."""
    if not encoding.has_bias:
        return None

    def build():
        return bias_block(encoding, q_pos, k_pos, causal=causal, offset=k_pos.shape[-1] - q_pos.shape[-1], dtype=dtype)

    if tables is None:
        return build()
    return tables.shared(("mask", causal, dtype, q_pos.shape[-1], k_pos.shape[-1]), build)


def bias_tensor(encoding: Encoding, positions: torch.Tensor, *, causal: bool = False) -> torch.Tensor | None:
    """The bias ``b[h, i, j]`` (``h n n``) of self-attention over ``positions`` (``n``), as the ``sdpa`` backend uses
    it, with ``-inf`` on the future keys when ``causal``; for positions ``b n``, one table per row (``b h n n``).
    Add it to the scores, or pass it as ``attn_mask`` to ``scaled_dot_product_attention`` (``b h n n``, or
    ``rearrange(t, "h i j -> 1 h i j")``). None for an encoding without a bias.

    Shapes: ``positions`` ``n`` -> ``h n n``; ``b n`` -> ``b h n n``.

    >>> import torch; from posenc_lab import ALiBi, bias_tensor
    >>> b = bias_tensor(ALiBi(2), torch.arange(4), causal=True)
    >>> b.shape, b[0, 3, :3].tolist(), b[0, 0, 1].item()
    (torch.Size([2, 4, 4]), [-0.1875, -0.125, -0.0625], -inf)
    """
    check_positions(positions)
    if positions.dim() == 2:
        rows = [bias_tensor(encoding, row, causal=causal) for row in positions]
        return None if rows[0] is None else torch.stack(rows)
    if positions.dim() != 1:
        raise PosencError(f"positions must have shape (n,) or (b, n), got {tuple(positions.shape)}")
    mask = bias_mask(encoding, positions, positions, causal=causal, dtype=torch.float32)
    return None if mask is None else mask[0]

def out_of_reach(q_pos: torch.Tensor, k_pos: torch.Tensor, reach: int, causal: bool) -> torch.Tensor:
    """``True`` (``n_q x n_k``) where key position ``j`` is ``reach`` or more positions from query position ``i``:
    ``i - j >= reach`` when causal (keys after the query are :func:`future_mask`'s), ``|i - j| >= reach`` otherwise."""
    distance = rearrange(q_pos, "i -> i 1") - rearrange(k_pos, "j -> 1 j")
    return distance >= reach if causal else distance.abs() >= reach


def other_chunk(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int) -> torch.Tensor:
    """``True`` (``n_q x n_k``) where key position ``j`` lies in another chunk of ``chunk`` positions than query
    position ``i``: ``floor(i / C) != floor(j / C)`` (Llama 4's chunked attention)."""
    def chunk_of(p):
        return torch.div(p, chunk, rounding_mode="floor")

    return rearrange(chunk_of(q_pos), "i -> i 1") != rearrange(chunk_of(k_pos), "j -> 1 j")

def _block_masks(encoding, q_pos, k_pos, causal, dtype, size, tables):
    """The blocks of ``size`` queries, ``(start, stop, keys)``, and the mask of each (:func:`bias_block`, with only
    the keys the block can see when causal: about half the causal square). With a forward pass's ``tables``,
    the first layer builds every block and the others share them; without, each block is built as it is used
    (and freed after it)."""
    nq, nk = q_pos.shape[-1], k_pos.shape[-1]
    spans = list(_query_blocks(nq, nk, causal, size))

    def build(span):
        start, stop, keys = span
        return bias_block(encoding, q_pos[start:stop], k_pos[:keys], causal=causal, offset=nk - nq + start, dtype=dtype)

    if tables is None:
        return spans, map(build, spans)
    return spans, tables.shared(("blocks", causal, dtype, size, nq, nk), lambda: [build(span) for span in spans])


def _query_blocks(nq: int, nk: int, causal: bool, size: int):
    """``(start, stop, keys)`` of each block of ``size`` queries: a causal block never needs the keys after
    its last query (queries are the last ``nq`` of the ``nk`` keys)."""
    for start in range(0, nq, size):
        stop = min(start + size, nq)
        yield start, stop, (nk - nq + stop if causal else nk)


def _is_arange(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Keys at ``0 .. n_k-1`` and queries the last ``n_q`` of them: then an index *is* a position."""
    if torch.compiler.is_compiling():
        return False
    nq, nk = q_pos.shape[-1], k_pos.shape[-1]
    expected = torch.arange(nk, device=k_pos.device)
    return torch.equal(k_pos, expected) and torch.equal(q_pos, expected[nk - nq:])


def score_mod(encoding: Encoding, q_pos: torch.Tensor, k_pos: torch.Tensor) -> Callable | None:
    """The encoding's bias as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``.

    When the positions are ``0 .. n-1`` the indices are the positions; otherwise the positions are
    looked up (``q_pos[q_idx]``, ``k_pos[kv_idx]``). An encoding's own :meth:`~posenc_lab.encodings.Encoding.score_mod`
    comes first (ALiBi's slopes, FIRE's normaliser and MLP); otherwise distance-only biases become a lookup in a small
    per-distance table (not under ``torch.compile``, which cannot read the positions to size it), and any other bias
    is built once and gathered pair by pair. Every gathered index is clamped: a ``score_mod`` is evaluated on masked-out
    positions too, where a distance can fall outside the table.
    """
    if not encoding.has_bias:
        return None
    nq, nk = q_pos.shape[-1], k_pos.shape[-1]
    offset = nk - nq
    if _is_arange(q_pos, k_pos):
        def positions(q_idx, kv_idx):
            return q_idx + offset, kv_idx
    else:
        def positions(q_idx, kv_idx):
            return q_pos[q_idx], k_pos[kv_idx]

    own = encoding.score_mod(positions)
    if own is not None:
        return own
    if encoding.distance_only and not torch.compiler.is_compiling():  # compiled: no table sized from values
        lo, hi = _distance_range(q_pos, k_pos)
        table = encoding.distance_bias(torch.arange(lo, hi + 1, device=q_pos.device))  # h d
        size = hi - lo + 1

        def by_distance(score, b, h, q_idx, kv_idx):
            i, j = positions(q_idx, kv_idx)
            return score + table[h, (i - j - lo).clamp(0, size - 1)]

        return by_distance
    whole = encoding.bias(q_pos, k_pos)  # h i j: any other bias, gathered pair by pair

    def gathered(score, b, h, q_idx, kv_idx):
        return score + whole[h, q_idx, kv_idx]

    return gathered
