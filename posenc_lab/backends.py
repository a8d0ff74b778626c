"""One attention function, several interchangeable backends.

``attention(q, k, v, encoding)`` computes

    softmax(q_m . k_n / sqrt(d) + b[h, m, n]) v      over the keys n <= m (causal),

after the encoding's ``rotate`` hook has transformed ``q`` and ``k``; ``m`` and ``n`` are the
*positions* the caller passes (default ``0 .. n-1``), so a window that starts at position 1000, or
every second position, is scored as such by every backend. Backends:

* ``reference``: the formula above written out with einsum and softmax, in float64. The
  yardstick every other backend is tested against; O(n^2) memory.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``. No bias: its fused causal
  kernel. A bias: materialized as 4-d float masks ``(1, h, n_block, n_keys)`` with the causal mask
  folded in as ``-inf`` (the 4-d shape takes the fused CPU kernel; a 3-d one does not), one per
  block of ``BLOCK`` queries with only the keys the block can see (causal attention never computes,
  nor builds the bias of, the keys a block cannot see), built once per forward pass (the model's
  :class:`~posenc_lab.encodings.Tables` share them among the layers). Trains on every device. The
  mask has the queries' dtype: under bf16 autocast a large bias is rounded (ALiBi's gentlest head
  at distance 16k, about -62.5, to steps of 0.25), where ``flex`` computes the bias in float32.
* ``flex``: FlexAttention with the bias as a ``score_mod`` and a causal block mask: compiled on CUDA,
  no ``n x n`` tensor anywhere. On the CPU forward only, and uncompiled: torch then builds the whole
  ``n x n`` score square (a reference path, slow; ``sdpa`` is the CPU's fast one).
* ``auto``: :func:`choose_backend` (``flex`` for biases on recent CUDA GPUs, ``sdpa`` elsewhere).

Causal means: query row ``r`` sees key rows ``j <= r + (n_k - n_q)`` (queries are the last rows
of the keys, as with a key/value cache). ``reach=W`` restricts every query further to the keys less
than ``W`` positions away (``i - j < W``; ``|i - j| < W`` when not causal): a sliding-window mask, as
in Longformer or Mistral, which every backend applies (the ``sdpa`` backend gives each block of
queries only the keys it can reach). A model trained at length ``L`` and run with ``reach=L`` never
looks further back than it was trained to: the baseline that using longer context must beat. Non-causal attention is defined for every encoding except
FIRE, xPos and the one-directional (decoder) T5 bias, which refuse it with :class:`PosencError`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat

from .encodings import Encoding, NoPE, Tables
from .errors import PosencError, check_positions, unknown_name

#: the backends :func:`attention` accepts (``auto``: :func:`choose_backend`)
BACKENDS = ("auto", "reference", "sdpa", "flex")
#: queries per block of the ``sdpa`` backend's causal attention with a bias
BLOCK = 512
#: queries per block of the explicit softmax through which a learned bias trains on the CPU (each block with the keys it can see)
GRAD_BLOCK = 128
#: the largest bias mask (bytes, its blocks together) a forward pass builds once for all its layers; past it,
#: each layer builds each block of queries when it uses it
MASK_BUDGET = 2 * 2**30
_NOPE = NoPE()


def _check_inputs(q, k, v, positions) -> torch.Tensor:
    """The positions, checked against ``q, k, v``: ``(n,)`` (default ``0 .. n-1``), or ``(b, n)`` reduced to ``(n,)``
    when every row is the same. ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise PosencError(f"q, k, v must be 4-d (batch, heads, positions, head_dim); got {q.dim()}-d, {k.dim()}-d, {v.dim()}-d")
    grouped = k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0
    if q.shape[::2] != k.shape[::2] or q.shape[-1] != k.shape[-1] or not grouped or k.shape[:-1] != v.shape[:-1]:
        raise PosencError(
            f"q, k, v shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(q and k must be equal but for k's heads, which must divide q's; v may differ from k only in its last axis)"
        )
    b, n = q.shape[0], q.shape[-2]
    if positions is None:
        return torch.arange(n, device=q.device)
    if not isinstance(positions, torch.Tensor) or positions.shape not in ((n,), (b, n)):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise PosencError(f"positions must have shape ({n},) or ({b}, {n}), got {shape}")
    check_positions(positions)
    positions = positions.to(q.device)
    if positions.dim() == 2 and not torch.compiler.is_compiling() and bool((positions == positions[:1]).all()):
        return positions[0]
    return positions


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values of ``h_kv`` heads (``b h_kv n d``) for ``heads`` query heads: query head ``i`` reads key head
    ``i // (heads / h_kv)`` (grouped-query attention, Ainslie et al. 2023; multi-query when ``h_kv = 1``), the
    order of Hugging Face's ``repeat_kv``. Returns ``x`` itself when the numbers agree."""
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


# --------------------------------------------------------------------------------------------- the bias as a mask


def future_mask(nq: int, nk: int, device, offset: int | None = None) -> torch.Tensor:
    """``True`` where key ``j`` lies after query row ``r``: ``j > r + offset`` (default offset ``nk - nq``)."""
    offset = nk - nq if offset is None else offset
    rows = torch.arange(nq, device=device) + offset
    return rearrange(torch.arange(nk, device=device), "j -> 1 j") > rearrange(rows, "i -> i 1")


def _distance_range(q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest signed distance ``i - j`` between a query and a key position.

    Under ``torch.compile``, where reading values would break the graph, the positions are taken to be
    the model's: keys ``0 .. n_k-1`` and the queries the last ``n_q`` of them (as with a key/value cache).
    """
    if torch.compiler.is_compiling():
        return 1 - q_pos.shape[-1], k_pos.shape[-1] - 1
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
    ``rearrange(t, "h i j -> 1 h i j")``). None for an encoding without a bias."""
    check_positions(positions)
    if positions.dim() == 2:
        rows = [bias_tensor(encoding, row, causal=causal) for row in positions]
        return None if rows[0] is None else torch.stack(rows)
    if positions.dim() != 1:
        raise PosencError(f"positions must have shape (n,) or (b, n), got {tuple(positions.shape)}")
    mask = bias_mask(encoding, positions, positions, causal=causal, dtype=torch.float32)
    return None if mask is None else mask[0]


# --------------------------------------------------------------------------------------------- backends


def out_of_reach(q_pos: torch.Tensor, k_pos: torch.Tensor, reach: int, causal: bool) -> torch.Tensor:
    """``True`` (``n_q x n_k``) where key position ``j`` is ``reach`` or more positions from query position ``i``:
    ``i - j >= reach`` when causal (keys after the query are :func:`future_mask`'s), ``|i - j| >= reach`` otherwise."""
    distance = rearrange(q_pos, "i -> i 1") - rearrange(k_pos, "j -> 1 j")
    return distance >= reach if causal else distance.abs() >= reach


def _reference(q, k, v, encoding, q_pos, k_pos, causal, reach=None, tables=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = einsum(q.double(), k.double(), "b h i d, b h j d -> b h i j") * scale
    b = encoding.bias(q_pos, k_pos)
    if b is not None:
        scores = scores + b.double()
    if causal:
        scores = scores.masked_fill(future_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    if reach is not None:
        scores = scores.masked_fill(out_of_reach(q_pos, k_pos, reach, causal), float("-inf"))
    weights = scores.softmax(dim=-1)
    return einsum(weights, v.double(), "b h i j, b h j d -> b h i d").to(v.dtype)


def _mask_bytes(encoding, q, k) -> int:
    heads = q.shape[1]
    return heads * q.shape[-2] * k.shape[-2] * q.element_size()


def _sdpa(q, k, v, encoding, q_pos, k_pos, causal, reach=None, tables=None):
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
            mask = bias_block(encoding, qp, kp, causal=causal, offset=offset + start - lo, dtype=q.dtype)
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
    per-distance table, and any other bias is built once and gathered pair by pair. Every gathered index is clamped: a ``score_mod`` is evaluated on masked-out
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
    if encoding.distance_only:
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


def _reach_block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, reach: int):
    """FlexAttention's block mask of the keys within ``reach`` positions (and not after the query, when causal)."""
    from torch.nn.attention.flex_attention import create_block_mask

    nq, nk = q_pos.shape[-1], k_pos.shape[-1]
    offset = nk - nq

    def within(b, h, q_idx, kv_idx):
        distance = q_pos[q_idx] - k_pos[kv_idx]
        if causal:
            return (distance < reach) & (q_idx + offset >= kv_idx)
        return distance.abs() < reach

    return create_block_mask(within, None, None, nq, nk, device=str(q_pos.device))


def _flex(q, k, v, encoding, q_pos, k_pos, causal, reach=None, tables=None):
    nq, nk = q.shape[-2], k.shape[-2]
    if reach is not None:
        block_mask = _reach_block_mask(q_pos, k_pos, causal, reach)
    else:
        block_mask = _causal_block_mask(nq, nk, str(q.device)) if causal else None
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
        lambda: _sdpa(q, k, v, encoding, q_pos, k_pos, causal, reach, tables),
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


class KVCache:
    """One layer's key/value cache for incremental decoding: keys, values and their positions so far.

    Keys are stored rotated, once, when they enter (RoPE, xPos): a cache never re-rotates them. That
    is why dynamic NTK in its ``"sequence"`` form (every key re-rotated with the current base) cannot
    be served by a cache at all: re-rotating the cached keys of the first layer would not be enough,
    because every deeper layer's keys and values were computed from the earlier layers' outputs
    under the old base.
    """

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def next_positions(self, n: int, device) -> torch.Tensor:
        """The positions of ``n`` new tokens: they continue from the last cached one (from 0 when empty)."""
        start = 0 if self.positions is None else int(self.positions[-1]) + 1
        return torch.arange(start, start + n, device=device)

    def append(self, k, v, positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append the new keys, values (``b h n d``) and positions (``n``); returns everything cached."""
        if self.k is None:
            self.k, self.v, self.positions = k, v, positions
        else:
            self.k, self.v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
            self.positions = torch.cat([self.positions, positions])
        return self.k, self.v, self.positions


class SinkCache:
    """A rolling key/value cache with attention sinks (Xiao et al. 2024, StreamingLLM): the first ``sinks``
    tokens stay, and of the rest only the last ``window``; positions are the slots *within the cache*
    (``0 .. size - 1``), not the tokens' positions in the stream, so a stream of any length never shows
    the encoding a distance or a position beyond ``sinks + window``.

    Keys are stored *before* rotation and rotated with their slot positions at every step (a slot's
    position changes as the window rolls); biases are computed on the slots too. ``sinks=0`` is a
    plain rolling window. Tokens past the capacity must come one at a time (each sees its own
    window); a stream shorter than the capacity is attended exactly as with :class:`KVCache`.
    """

    def __init__(self, window: int, sinks: int = 0):
        for name, value, low in (("window", window, 1), ("sinks", sinks, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PosencError(f"the sink cache's {name} must be an integer >= {low}, got {value!r}")
        self.window, self.sinks = window, sinks
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.seen = 0  # tokens of the stream so far

    @property
    def capacity(self) -> int:
        """The most tokens the cache holds: ``sinks + window``."""
        return self.sinks + self.window

    def __len__(self) -> int:
        """The slot the next token will take (the cache is trimmed to ``capacity`` after each token)."""
        held = 0 if self.k is None else self.k.shape[-2]
        return min(held, self.capacity - 1)

    def next_positions(self, n: int, device) -> torch.Tensor:
        """The slots of ``n`` new tokens (within the capacity)."""
        return torch.arange(len(self), len(self) + n, device=device)

    def append(self, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new (unrotated) keys and values; keep the sinks and the last ``window``; return them."""
        held = 0 if self.k is None else self.k.shape[-2]
        n = k.shape[-2]
        if n > 1 and held + n > self.capacity:
            raise PosencError(f"a sink cache of {self.capacity} slots holds {held}: past its capacity, feed the "
                              f"tokens one at a time (got {n})")
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
        self.seen += n
        if self.k.shape[-2] > self.capacity:
            keep = torch.cat([torch.arange(self.sinks), torch.arange(self.k.shape[-2] - self.window, self.k.shape[-2])])
            self.k, self.v = self.k[:, :, keep.to(self.k.device)], self.v[:, :, keep.to(self.v.device)]
        return self.k, self.v


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    encoding: Encoding | None = None,
    *,
    backend: str = "auto",
    causal: bool = True,
    positions: torch.Tensor | None = None,
    cache: KVCache | SinkCache | None = None,
    reach: int | None = None,
    tables: Tables | None = None,
) -> torch.Tensor:
    """Attention of ``q, k, v`` (``b h n d``) with ``encoding``'s rotation and bias; returns ``b h n d_v``.

    ``k`` and ``v`` may have ``h_kv`` heads for any ``h_kv`` dividing ``h`` (grouped-query attention; ``h_kv = 1``
    is multi-query): query head ``i`` attends with key head ``i // (h / h_kv)`` (:func:`repeat_kv`), and a
    :class:`KVCache` stores the ``h_kv`` heads only. Half-precision inputs give an output of their dtype.

    ``positions`` (``n`` integers, default ``0 .. n-1``) are the absolute positions of the tokens.
    Positions ``b n`` (Hugging Face's ``position_ids``) give each batch row its own: the same result as
    attending row by row. ``tables``: the encoding's :meth:`~posenc_lab.encodings.Encoding.tables` at this
    very ``positions`` tensor, which a model builds once per forward pass and hands to every layer (its
    rotation tables, and the bias mask the first layer builds for the others); without them, everything
    is computed here.
    ``causal=False`` attends to keys on both sides (``|i - j|`` for ALiBi and KERPLE, the
    bidirectional buckets for a T5 bias built with ``bidirectional=True``); FIRE and the
    one-directional T5 bias have no non-causal form and refuse it.

    With a :class:`KVCache`, ``q, k, v`` are the *new* tokens (default positions: continuing the
    cache): their keys and values are appended, and the new queries attend to every cached key
    (causally: each to the keys up to its own position), through the same backends.

    ``reach=W`` (a positive integer) lets each query attend only to the keys less than ``W`` positions
    away (a sliding-window mask; ``None``: every key). With a :class:`SinkCache` the positions are the
    cache's slots (``positions`` and ``tables`` are ignored) and every key is rotated anew at each step.
    """
    _check_options(backend, reach)
    encoding = _NOPE if encoding is None else encoding
    if isinstance(cache, SinkCache):
        return _attend_sink_cache(q, k, v, encoding, backend, causal, cache, reach)
    if tables is not None and not tables.serves(encoding, positions):
        raise PosencError("tables serve the encoding and the positions tensor they were built for "
                          "(tables = encoding.tables(positions)): pass that very tensor, or no tables")
    if cache is not None:
        return _attend_cache(q, k, v, encoding, backend, causal, positions, cache, reach, tables)
    positions = _check_inputs(q, k, v, positions)
    if positions.dim() == 2 and (encoding.has_bias or reach is not None):
        # a bias or a window read the positions of every pair: one row at a time, each with its own table
        return torch.cat([attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], encoding, backend=backend, causal=causal,
                                    positions=positions[i], reach=reach) for i in range(q.shape[0])])
    if not causal and not encoding.noncausal:
        raise PosencError(f"encoding {encoding.name!r} has no non-causal form{encoding.noncausal_hint}: use causal=True")
    if backend == "auto":
        backend = choose_backend(encoding, q.device)
    _check_flex(backend, q.device)
    q, k = encoding.rotate(q, k, positions, tables)
    heads = q.shape[1]
    return _BACKEND_FNS[backend](q, repeat_kv(k, heads), repeat_kv(v, heads), encoding, positions, positions, causal,
                                 reach, tables)


def _check_options(backend: str, reach) -> None:
    if backend not in BACKENDS:
        raise unknown_name("attention backend", backend, BACKENDS)
    if reach is not None and (isinstance(reach, bool) or not isinstance(reach, int) or reach < 1):
        raise PosencError(f"reach must be a positive integer (the keys a query may attend to), got {reach!r}")


def _check_flex(backend: str, device: torch.device) -> None:
    if backend == "flex" and not flex_available(device):
        raise PosencError(f"FlexAttention is not available on {device} with torch {torch.__version__}")


def _check_batch(cache, k: torch.Tensor, hint: str = "") -> None:
    if cache.k is not None and cache.k.shape[0] != k.shape[0]:
        raise PosencError(f"the cache holds a batch of {cache.k.shape[0]} sequences, the new tokens come in a "
                          f"batch of {k.shape[0]}: use a new cache{hint} for another batch")


def _attend_sink_cache(q, k, v, encoding, backend, causal, cache: SinkCache, reach):
    """:func:`attention` with a :class:`SinkCache`: every cached key rotated anew at its slot."""
    _check_inputs(q, k, v, None)
    if not causal:
        raise PosencError("a sink cache serves causal attention only")
    if not encoding.cacheable:
        raise PosencError("this encoding changes the rotation or positions of keys already seen (dynamic NTK's "
                          "'sequence' form, a PI / NTK / YaRN factor that follows the length, randomized "
                          "positions): a sink cache cannot serve it")
    _check_batch(cache, k)
    backend = "sdpa" if backend == "auto" else backend
    _check_flex(backend, q.device)
    k_all, v_all = cache.append(k, v)
    k_pos = torch.arange(k_all.shape[-2], device=q.device)
    q_pos = k_pos[k_all.shape[-2] - q.shape[-2]:]
    q, k_all = encoding.rotate_one(q, q_pos, "q"), encoding.rotate_one(k_all, k_pos, "k")
    heads = q.shape[1]
    return _BACKEND_FNS[backend](q, repeat_kv(k_all, heads), repeat_kv(v_all, heads), encoding, q_pos, k_pos,
                                 causal, reach)


def _attend_cache(q, k, v, encoding, backend, causal, positions, cache: KVCache, reach, tables):
    """:func:`attention` with a :class:`KVCache`: the new keys rotated once, as they enter the cache."""
    if positions is None:
        positions = cache.next_positions(q.shape[-2], q.device)
    positions = _check_inputs(q, k, v, positions)
    if positions.dim() == 2:
        raise PosencError("a KVCache keeps one row of positions for the whole batch: pass positions of shape "
                          "(n,), or rows that are all the same")
    if backend == "auto":  # one query row against a growing cache: a small mask; no kernel to recompile per length
        backend = "sdpa"
    if not encoding.cacheable:
        raise PosencError("this encoding's rotation of the keys already cached changes with the length (dynamic "
                          "NTK in its 'sequence' form, a PI / NTK / YaRN factor that follows the length, or "
                          "randomized positions), which a key/value cache cannot serve: fix the factor "
                          "(factor=...), use dynamic='cache', or run without a cache")
    if not causal and not encoding.noncausal:
        raise PosencError(f"encoding {encoding.name!r} has no non-causal form: use causal=True")
    _check_flex(backend, q.device)
    _check_batch(cache, k, " (model.new_cache())")
    q = encoding.rotate_one(q, positions, "q", tables)
    k_all, v_all, k_pos = cache.append(encoding.rotate_one(k, positions, "k", tables), v, positions)
    heads = q.shape[1]
    return _BACKEND_FNS[backend](q, repeat_kv(k_all, heads), repeat_kv(v_all, heads), encoding, positions, k_pos,
                                 causal, reach, tables)
