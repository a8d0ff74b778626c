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

>>> from posenc_lab import BACKENDS
>>> BACKENDS
('auto', 'reference', 'sdpa', 'flex')

Causal means: query row ``r`` sees key rows ``j <= r + (n_k - n_q)`` (queries are the last rows
of the keys, as with a key/value cache). ``reach=W`` restricts every query further to the keys less
than ``W`` positions away (``i - j < W``; ``|i - j| < W`` when not causal): a sliding-window mask, as
in Longformer or Mistral, which every backend applies (the ``sdpa`` backend gives each block of
queries only the keys it can reach). A model trained at length ``L`` and run with ``reach=L`` never
looks further back than it was trained to: the baseline that using longer context must beat. ``chunk=C`` keeps only
the keys of the query's own chunk of ``C`` positions (``floor(i / C) == floor(j / C)``, Llama 4's chunked
attention): ``reference`` and ``flex`` mask the other chunks, ``sdpa`` attends chunk by chunk. A local layer of a
mix carries its own ``window`` or ``chunk`` on its encoding, which applies as ``reach`` and ``chunk`` do; with
``reach`` too the smaller window wins (:func:`~posenc_lab.backends.chunks.layer_span`). Non-causal attention is
defined for every encoding except FIRE, xPos and the one-directional (decoder) T5 bias, which refuse it with
:class:`PosencError`.

Logits that read the tokens themselves go through the same three backends in :mod:`~posenc_lab.backends.tokens`,
with ``b h i j`` masks: CoPE's bias from the queries and keys, and a decay, ``decay=``, the log forget values
``log f_t`` (``b h n``) that a decay-gated layer's :meth:`~posenc_lab.encodings.Encoding.decay` computes from its
input (FoX), whose sums ``sum_{l=j+1}^{i} log f_l`` are added to the logits (causal attention only; a
:class:`KVCache` keeps each cached token's running sum). An encoding with a ``decay`` hook refuses a call without.
A padding mask, ``real_keys`` (``b n_keys``, True for a real token), differs from row to row too and goes the same
way: a padded key gets weight zero on every backend.

The package holds :func:`attention` and its checks; the backends in :mod:`~posenc_lab.backends.kernels`, the
masks and the bias in the forms they consume in :mod:`~posenc_lab.backends.masks`, the key/value caches in
:mod:`~posenc_lab.backends.cache`, a layer's span and attention within chunks in :mod:`~posenc_lab.backends.chunks`.
"""

from __future__ import annotations

import torch

from ..encodings import Encoding, NoPE, Tables
from ..encodings.forgetting import forget_sums
from ..errors import PosencError, check_positions, unknown_name
from .cache import KVCache, SinkCache, shown
from .chunks import layer_span
from .kernels import (BACKENDS, BLOCK, GRAD_BLOCK, MASK_BUDGET, _BACKEND_FNS, _reference, choose_backend,
                      first_kernel_that_compiles, flex_available, repeat_kv)
from .masks import bias_block, bias_mask, bias_tensor, future_mask, other_chunk, out_of_reach, score_mod, toeplitz
from .tokens import TOKEN_BACKENDS

__all__ = ["BACKENDS", "BLOCK", "GRAD_BLOCK", "MASK_BUDGET", "KVCache", "SinkCache", "attention", "bias_block",
           "bias_mask", "bias_tensor", "choose_backend", "first_kernel_that_compiles", "flex_available",
           "future_mask", "other_chunk", "out_of_reach", "repeat_kv", "score_mod", "toeplitz", "_reference"]

_NOPE = NoPE()


def _check_inputs(q, k, v, positions) -> torch.Tensor:
    """The positions, checked against ``q, k, v``: ``(n,)`` (default ``0 .. n-1``), or ``(b, n)`` reduced to ``(n,)``
    when every row is the same, as ``(1, n)`` always is (Hugging Face's ``position_ids`` for a whole batch). ``k`` and
    ``v`` may have fewer heads than ``q`` (grouped-query attention)."""
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
    if not isinstance(positions, torch.Tensor) or positions.shape not in ((n,), (b, n), (1, n)):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise PosencError(f"positions must have shape ({n},) or ({b}, {n}) (or (1, {n}): one row for the whole "
                          f"batch), got {shape}")
    check_positions(positions)
    positions = positions.to(q.device)
    if positions.shape == (1, n):
        return positions[0]
    if positions.dim() == 2 and not torch.compiler.is_compiling() and bool((positions == positions[:1]).all()):
        return positions[0]
    return positions


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
    decay: torch.Tensor | None = None,
    chunk: int | None = None,
    real_keys: torch.Tensor | None = None,
    householder: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of ``q, k, v`` (``b h n d``) with ``encoding``'s rotation and bias; returns ``b h n d_v``.

    Shapes: ``q`` ``b h n d``, ``k`` ``b h_kv n d``, ``v`` ``b h_kv n d_v``, ``positions`` ``n`` or ``b n`` ->
    ``b h n d_v``.

    >>> import torch, torch.nn.functional as F; from posenc_lab import ALiBi, attention, bias_tensor
    >>> (q, k, v), alibi = torch.randn(3, 1, 4, 6, 8), ALiBi(4)
    >>> mask = bias_tensor(alibi, torch.arange(6), causal=True)  # h n n, -inf on the future keys
    >>> out = attention(q, k, v, alibi)
    >>> out.shape, torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6)
    (torch.Size([1, 4, 6, 8]), True)

    ``k, v`` may have ``h_kv`` heads dividing ``h`` (grouped-query attention, :func:`repeat_kv`). ``positions``: the
    tokens' absolute positions, ``n`` (default ``0 .. n-1``) or ``b n`` (Hugging Face's ``position_ids``: the same as
    attending row by row). ``tables``: the encoding's :meth:`~posenc_lab.encodings.Encoding.tables` at this very
    ``positions`` tensor, built once per forward pass for every layer. ``causal=False`` attends both ways (FIRE, xPos,
    the one-directional T5 bias and the encodings that read the tokens refuse it).

    ``cache``: with a :class:`KVCache` ``q, k, v`` are the *new* tokens, appended, each query attending to the cached
    keys up to its own position; a :class:`SinkCache` takes its slots as positions and rotates every key anew.
    ``reach=W`` keeps the keys less than ``W`` positions back (a sliding window), ``chunk=C`` those in the query's
    chunk of ``C`` positions, as an encoding's own ``window`` and ``chunk`` do
    (:func:`~posenc_lab.backends.chunks.layer_span`). ``decay``: the tokens' log forget values ``b h n`` (FoX's):
    logit ``(i, j)`` gets ``sum_{l=j+1}^{i} log f_l``.

    ``real_keys``: a padding mask, ``(b, n_keys)`` bool, True where the key is a real token and False where it is
    padding (Hugging Face's ``attention_mask`` as bool; the opposite of ``torch.nn.MultiheadAttention``'s
    ``key_padding_mask``). ``n_keys`` counts every key attended: with a :class:`KVCache`, the cached ones and the new
    ones. Padded keys get weight zero in every backend (a per-row mask: the backends of
    :mod:`~posenc_lab.backends.tokens`); a query that sees no real key (a padded query before a row's first real
    token) gets zeros. A :class:`SinkCache` refuses it (it drops and renumbers tokens).

    ``householder``: PaTH's transforms ``(w, beta)`` (``b h n d``, ``b h n``) of the new tokens, which its
    :meth:`~posenc_lab.encodings.Encoding.householder` reads from the layer's input: logit ``(i, j)`` is then
    ``q_i^T H_i ... H_{j+1} k_j / sqrt(d)`` (a :class:`KVCache` keeps every cached token's). An encoding whose weights
    are not a softmax (:attr:`~posenc_lab.encodings.Encoding.weighting`: stick-breaking) has them written out by
    ``reference`` and ``sdpa``; ``flex`` refuses it.
    """
    encoding = _NOPE if encoding is None else encoding
    reach, chunk = _check_options(backend, reach, encoding, chunk)
    _check_heads(encoding, q)
    if (decay is not None or householder is not None or encoding.reads_tokens or real_keys is not None
            or encoding.weighting != "softmax"):
        # FoX's decays, CoPE's gates, PaTH's transforms: logits that read the tokens; a padding mask: a mask that
        # differs row by row; stick-breaking: weights written out, row by row
        if chunk is not None and (decay is not None or householder is not None or encoding.reads_tokens):
            raise PosencError(f"encoding {encoding.name!r} reads the tokens: attention within chunks is not available to it")
        return _attend_tokens(q, k, v, encoding, backend, causal, positions, cache, reach, tables, decay, chunk,
                              real_keys, householder)
    if isinstance(cache, SinkCache):
        return _attend_sink_cache(q, k, v, encoding, backend, causal, positions, cache, reach, chunk)
    if tables is not None and not tables.serves(encoding, positions):
        raise PosencError("tables serve the encoding and the positions tensor they were built for "
                          "(tables = encoding.tables(positions)): pass that very tensor, or no tables")
    if cache is not None:
        return _attend_cache(q, k, v, encoding, backend, causal, positions, cache, reach, tables, chunk)
    positions = _check_inputs(q, k, v, positions)
    if positions.dim() == 2 and (encoding.has_bias or reach is not None or chunk is not None):
        # a bias, a window or chunks read the positions of every pair: one row at a time, each with its own table
        return torch.cat([attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], encoding, backend=backend, causal=causal,
                                    positions=positions[i], reach=reach, chunk=chunk) for i in range(q.shape[0])])
    if not causal and not encoding.noncausal:
        raise PosencError(f"encoding {encoding.name!r} has no non-causal form{encoding.noncausal_hint}: use causal=True")
    backend = choose_backend(encoding, q.device) if backend == "auto" else backend
    _check_flex(backend, q.device)
    q, k = _rotate(encoding, q, k, positions, tables, reach, chunk)
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    return _BACKEND_FNS[backend](q, k, v, encoding, positions, positions, causal, reach, tables, chunk=chunk)


def _rotate(encoding, q, k, positions, tables, reach=None, chunk=None):
    """The encoding's ``rotate`` hook, handed the ``reach`` and ``chunk`` this call applies when it counts the keys
    each query sees (``counts_keys``: SSMax's ``log n``)."""
    if encoding.counts_keys:
        return encoding.rotate(q, k, positions, tables, reach=reach, chunk=chunk)
    return encoding.rotate(q, k, positions, tables)


def _rotate_query(encoding, q, positions, tables, reach=None, chunk=None):
    """``rotate_one`` of the queries, handed ``reach`` and ``chunk`` as :func:`_rotate` does."""
    if encoding.counts_keys:
        return encoding.rotate_one(q, positions, "q", tables, reach=reach, chunk=chunk)
    return encoding.rotate_one(q, positions, "q", tables)


def _check_heads(encoding: Encoding, q: torch.Tensor) -> None:
    """An encoding with one slope, bias column, gate or scale per head must have one per query head: a bias of fewer
    heads would broadcast (every head the same slope) or fail deep inside a backend."""
    built = encoding.num_heads
    heads = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if built is not None and heads is not None and built != heads:
        raise PosencError(f"{type(encoding).__name__} was built for {built} head{'s' if built != 1 else ''} but the "
                          f"queries have {heads}: build it with num_heads={heads}")


def _check_options(backend: str, reach, encoding: Encoding, chunk) -> tuple[int | None, int | None]:
    """Check the options; return the ``(reach, chunk)`` the call applies (:func:`.chunks.layer_span`)."""
    if backend not in BACKENDS:
        raise unknown_name("attention backend", backend, BACKENDS)
    if reach is not None and (isinstance(reach, bool) or not isinstance(reach, int) or reach < 1):
        raise PosencError(f"reach must be a positive integer (the keys a query may attend to), got {reach!r}")
    return layer_span(encoding, reach, chunk)


def _check_flex(backend: str, device: torch.device) -> None:
    if backend == "flex" and not flex_available(device):
        raise PosencError(f"FlexAttention is not available on {device} with torch {torch.__version__}")


def _check_cache(cache, k: torch.Tensor, v: torch.Tensor, hint: str = "") -> None:
    """The new keys and values have the batch, heads and sizes of those the cache holds (else one sentence, not a
    failed concatenation)."""
    if cache.k is None:
        return
    if cache.k.shape[0] != k.shape[0]:
        raise PosencError(f"the cache holds a batch of {cache.k.shape[0]} sequences, the new tokens come in a "
                          f"batch of {k.shape[0]}: use a new cache{hint} for another batch")
    held, new = (cache.k.shape[1], cache.k.shape[-1], cache.v.shape[-1]), (k.shape[1], k.shape[-1], v.shape[-1])
    if held != new:
        raise PosencError(f"the cache holds keys and values of {held[0]} heads (sizes {held[1]} and {held[2]}), the "
                          f"new ones have {new[0]} (sizes {new[1]} and {new[2]}): use a new cache{hint} for another "
                          "shape")


def _check_slots(q, k, v, positions, cache: SinkCache) -> None:
    """A sink cache numbers the tokens by their slots in the cache: positions, where given, must be those slots (it
    would otherwise ignore them)."""
    checked = _check_inputs(q, k, v, positions)
    if positions is None:
        return
    slots = cache.next_positions(q.shape[-2], q.device)
    if not bool((checked == slots).all()):
        raise PosencError(f"a SinkCache numbers its tokens by their slots in the cache (next: {int(slots[0])} to "
                          f"{int(slots[-1])}), got positions {shown(checked)}: pass positions=None")


def _attend_sink_cache(q, k, v, encoding, backend, causal, positions, cache: SinkCache, reach, chunk=None):
    """:func:`attention` with a :class:`SinkCache`: every cached key rotated anew at its slot."""
    _check_slots(q, k, v, positions, cache)
    if chunk is not None:
        raise PosencError("a sink cache renumbers the positions as its slots, where chunks of positions have no "
                          "meaning: attend within chunks with a KVCache (or none)")
    if not causal:
        raise PosencError("a sink cache serves causal attention only")
    if not encoding.cacheable:
        raise PosencError("this encoding changes the rotation or positions of keys already seen (dynamic NTK's "
                          "'sequence' form, a PI / NTK / YaRN factor that follows the length, LongRoPE's choice of "
                          "factors by the length, randomized positions): a sink cache cannot serve it")
    _check_cache(cache, k, v)
    backend = "sdpa" if backend == "auto" else backend
    _check_flex(backend, q.device)
    return _BACKEND_FNS[backend](*_sink_step(q, k, v, encoding, cache, reach, chunk), causal, reach)


def _sink_step(q, k, v, encoding, cache: SinkCache, reach=None, chunk=None) -> tuple:
    """The new tokens appended to a :class:`SinkCache` and every cached key rotated anew at its slot: ``(q, k, v,
    encoding, q_pos, k_pos)`` as a backend takes them, keys and values repeated for the query heads."""
    k_all, v_all = cache.append(k, v)
    k_pos = torch.arange(k_all.shape[-2], device=q.device)
    q_pos = k_pos[k_all.shape[-2] - q.shape[-2]:]
    q, k_all = _rotate_query(encoding, q, q_pos, None, reach, chunk), encoding.rotate_one(k_all, k_pos, "k")
    heads = q.shape[1]
    return q, repeat_kv(k_all, heads), repeat_kv(v_all, heads), encoding, q_pos, k_pos


def _check_cacheable(encoding: Encoding) -> None:
    """A :class:`KVCache` keeps each key as rotated when it entered: refuse an encoding whose rotation of those keys
    would change with the length."""
    if not encoding.cacheable:
        raise PosencError("this encoding's rotation of the keys already cached changes with the length (dynamic "
                          "NTK in its 'sequence' form, a PI / NTK / YaRN factor that follows the length, LongRoPE's "
                          "choice of factors by the length, or randomized positions), which a key/value cache cannot "
                          "serve: fix the factor (factor=...), use dynamic='cache', or run without a cache")


def _attend_cache(q, k, v, encoding, backend, causal, positions, cache: KVCache, reach, tables, chunk=None):
    """:func:`attention` with a :class:`KVCache`: the new keys rotated once, as they enter the cache."""
    if positions is None:
        positions = cache.next_positions(q.shape[-2], q.device)
    positions = _check_inputs(q, k, v, positions)
    if positions.dim() == 2:
        raise PosencError("a KVCache keeps one row of positions for the whole batch: pass positions of shape "
                          "(n,), or rows that are all the same")
    if backend == "auto":  # one query row against a growing cache: a small mask; no kernel to recompile per length
        backend = "sdpa"
    _check_cacheable(encoding)
    if not causal and not encoding.noncausal:
        raise PosencError(f"encoding {encoding.name!r} has no non-causal form: use causal=True")
    _check_flex(backend, q.device)
    _check_cache(cache, k, v, " (model.new_cache())")
    q = _rotate_query(encoding, q, positions, tables, reach, chunk)
    k_all, v_all, k_pos = cache.append(encoding.rotate_one(k, positions, "k", tables), v, positions)
    heads = q.shape[1]
    return _BACKEND_FNS[backend](q, repeat_kv(k_all, heads), repeat_kv(v_all, heads), encoding, positions, k_pos,
                                 causal, reach, tables, chunk=chunk)


def _check_real_keys(real_keys, q, k, cache) -> torch.Tensor | None:
    """The padding mask, checked: bool, ``(b, n_keys)`` with ``n_keys`` the keys attended (a :class:`KVCache`'s
    cached keys and the new ones), on ``q``'s device."""
    if real_keys is None:
        return None
    if isinstance(cache, SinkCache):
        raise PosencError("a sink cache drops tokens and renumbers the rest: it cannot follow a padding mask "
                          "(real_keys); decode a padded batch with a KVCache")
    keys = k.shape[-2] + (len(cache) if cache is not None else 0)
    expected = (q.shape[0], keys)
    if not isinstance(real_keys, torch.Tensor) or real_keys.dtype != torch.bool or tuple(real_keys.shape) != expected:
        got = (f"{real_keys.dtype} {tuple(real_keys.shape)}" if isinstance(real_keys, torch.Tensor)
               else type(real_keys).__name__)
        raise PosencError(f"real_keys must be a bool tensor of shape {expected} (batch, keys attended: cached and new), "
                          f"True for a real token; got {got} (Hugging Face's attention_mask: pass attention_mask.bool())")
    return real_keys.to(q.device)


def _check_householder(householder, q) -> None:
    """PaTH's ``(w, beta)``: one unit vector ``w`` (``b h n d``) and one ``beta`` (``b h n``) per batch row, query head
    and new token."""
    b, h, n, d = q.shape
    if (not isinstance(householder, tuple) or len(householder) != 2
            or tuple(householder[0].shape) != (b, h, n, d) or tuple(householder[1].shape) != (b, h, n)):
        got = (tuple(tuple(t.shape) for t in householder) if isinstance(householder, tuple)
               else type(householder).__name__)
        raise PosencError(f"householder must be (w, beta) of shapes {(b, h, n, d)} and {(b, h, n)}, one per batch "
                          f"row, query head and new token; got {got}")


def _attend_tokens(q, k, v, encoding, backend, causal, positions, cache, reach, tables, decay, chunk=None,
                   real_keys=None, householder=None):
    """:func:`attention` when the logits read the tokens (:mod:`~posenc_lab.backends.tokens`) or differ from row to
    row (a padding mask, ``real_keys``): the decay's running sums (continuing a :class:`KVCache`'s), then the backend
    with ``b h i j`` masks."""
    keep = _check_real_keys(real_keys, q, k, cache)
    if decay is None and encoding.has_decay:
        raise PosencError(f"encoding {encoding.name!r} reads the layer's input: pass decay=encoding.decay(x), the log "
                          "forget values (b, h, n) of the input x (b, n, d_model)")
    if householder is None and encoding.hook == "householder":
        raise PosencError(f"encoding {encoding.name!r} reads the layer's input: pass "
                          "householder=encoding.householder(x), its transforms (w, beta) of the input x "
                          "(b, n, d_model)")
    if householder is not None:
        _check_householder(householder, q)
    if not causal and (decay is not None or householder is not None or not encoding.noncausal):
        raise PosencError(f"encoding {encoding.name!r} has no non-causal form: a query counts or decays the keys "
                          "before it; use causal=True")
    if isinstance(cache, SinkCache):
        if householder is not None:
            raise PosencError("a sink cache drops tokens whose transforms the kept keys would need: decode PaTH "
                              "with a KVCache")
        return _attend_tokens_sink(q, k, v, encoding, backend, positions, cache, reach, decay)
    if tables is not None and not tables.serves(encoding, positions):
        raise PosencError("tables serve the encoding and the positions tensor they were built for "
                          "(tables = encoding.tables(positions)): pass that very tensor, or no tables")
    if cache is not None and positions is None:
        positions = cache.next_positions(q.shape[-2], q.device)
    positions = _check_inputs(q, k, v, positions)
    if decay is not None and (decay.dim() != 3 or decay.shape != (q.shape[0], q.shape[1], q.shape[2])):
        raise PosencError(f"decay must hold a log forget value per batch row, head and token, "
                          f"{(q.shape[0], q.shape[1], q.shape[2])}; got {tuple(decay.shape)}")
    backend = "sdpa" if backend == "auto" else backend
    _check_flex(backend, q.device)
    if positions.dim() == 2 and (cache is not None or encoding.has_bias or reach is not None or chunk is not None):
        if cache is not None:
            raise PosencError("a KVCache keeps one row of positions for the whole batch: pass positions of shape "
                              "(n,), or rows that are all the same")
        return torch.cat([_attend_tokens(q[i:i + 1], k[i:i + 1], v[i:i + 1], encoding, backend, causal, positions[i],
                                         None, reach, None, None if decay is None else decay[i:i + 1], chunk,
                                         None if keep is None else keep[i:i + 1],
                                         None if householder is None else tuple(t[i:i + 1] for t in householder))
                          for i in range(q.shape[0])])
    heads = q.shape[1]
    if cache is None:
        q, k = _rotate(encoding, q, k, positions, tables, reach, chunk)
        sums = None if decay is None else forget_sums(decay)
        return TOKEN_BACKENDS[backend](q, repeat_kv(k, heads), repeat_kv(v, heads), encoding, positions, positions,
                                      causal, reach, sums, sums, chunk=chunk, keep=keep, householder=householder)
    _check_cacheable(encoding)
    _check_cache(cache, k, v, " (model.new_cache())")
    q = _rotate_query(encoding, q, positions, tables, reach, chunk)
    k_all, v_all, k_pos = cache.append(encoding.rotate_one(k, positions, "k", tables), v, positions)
    c_q, c_k = (None, None) if decay is None else cache.continue_sums(decay)
    householder = None if householder is None else cache.continue_householder(*householder)
    return TOKEN_BACKENDS[backend](q, repeat_kv(k_all, heads), repeat_kv(v_all, heads), encoding, positions, k_pos,
                                  causal, reach, c_q, c_k, chunk=chunk, keep=keep, householder=householder)


def _attend_tokens_sink(q, k, v, encoding, backend, positions, cache: SinkCache, reach, decay):
    """CoPE with a :class:`SinkCache`: its gates count the keys the cache holds, at their slots. A decay cannot be
    served: the cache drops the tokens whose forget values the running sums of the kept ones would need."""
    if decay is not None:
        raise PosencError("a sink cache drops tokens and keeps no running sums of log forget values: decode a "
                          "decay-gated encoding (FoX) with a KVCache")
    _check_slots(q, k, v, positions, cache)
    _check_cache(cache, k, v)
    backend = "sdpa" if backend == "auto" else backend
    _check_flex(backend, q.device)
    return TOKEN_BACKENDS[backend](*_sink_step(q, k, v, encoding, cache, reach), True, reach)
