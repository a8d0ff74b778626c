"""The key/value caches of incremental decoding: :class:`KVCache` (every key kept, rotated once) and
:class:`SinkCache` (attention sinks and a rolling window, StreamingLLM)."""

from __future__ import annotations

import torch

from ..encodings.forgetting import forget_sums
from ..errors import PosencError


def shown(positions: torch.Tensor) -> str:
    """A few positions, for an error message."""
    return str(positions.tolist()) if positions.numel() <= 8 else f"{positions.flatten()[:8].tolist()} ..."


class KVCache:
    """One layer's key/value cache for incremental decoding: keys, values and their positions so far.

    Shapes: ``attention(q, k, v, encoding, cache=cache)`` with the new tokens' ``q, k, v`` ``b h n d``; the cache
    holds ``k, v`` ``b h n_cached d`` and ``positions`` ``n_cached``.

    >>> import torch; from posenc_lab import KVCache, RoPE, attention
    >>> rope, (q, k, v), cache = RoPE(8, train_len=16), torch.randn(3, 1, 2, 6, 8), KVCache()
    >>> steps = [attention(q[:, :, [i]], k[:, :, [i]], v[:, :, [i]], rope, cache=cache) for i in range(6)]
    >>> len(cache), torch.allclose(torch.cat(steps, dim=2), attention(q, k, v, rope), atol=1e-6)
    (6, True)

    Keys are stored rotated, once, when they enter (RoPE, xPos): a cache never re-rotates them. That
    is why dynamic NTK in its ``"sequence"`` form (every key re-rotated with the current base) cannot
    be served by a cache at all: re-rotating the cached keys of the first layer would not be enough,
    because every deeper layer's keys and values were computed from the earlier layers' outputs
    under the old base.

    A decay-gated encoding (FoX) also keeps each cached token's running sum of log forget values
    (:meth:`continue_sums`): a new query's decay to a cached key is the difference of the two sums.
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
        self.check_continues(positions)
        if self.k is None:
            self.k, self.v, self.positions = k, v, positions
        else:
            self.k, self.v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
            self.positions = torch.cat([self.positions, positions])
        return self.k, self.v, self.positions

    def check_continues(self, positions: torch.Tensor) -> None:
        """Raise :class:`PosencError` unless ``positions`` (``n``) rise and start after the last cached one. The causal
        mask works by index (a query sees the keys cached before it), which is causality in positions only while the
        positions rise: a cache holding ``8, 9, 5`` would let the token at 5 see those at 8 and 9. Gaps are fine."""
        last = None if self.positions is None or not len(self) else self.positions[-1:]
        run = positions if last is None else torch.cat([last.to(positions.device), positions])
        if run.numel() > 1 and not bool((run.diff() > 0).all()):
            held, after = "a KVCache's positions", ""
            if last is not None:
                held, after = f"a KVCache holds positions up to {int(last)}: new positions", " and after the last cached"
            raise PosencError(f"{held} must be increasing{after} (its causal mask works by index), got "
                              f"{shown(positions)}: pass positions=None to continue from the cache, or use a new cache")

    #: the running sums ``c_t`` of the cached tokens' log forget values (``b h n``), for a decay-gated encoding (FoX)
    sums: torch.Tensor | None = None

    def continue_sums(self, decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The running sums ``c_t = c_{t-1} + log f_t`` of the new tokens' log forget values ``decay`` (``b h n``),
        continuing from the last cached token's, and appended to the cache's (after :meth:`append` has added their
        keys); returns the new tokens' sums and every cached token's."""
        held = 0 if self.sums is None else self.sums.shape[-1]
        if held != len(self) - decay.shape[-1]:
            raise PosencError(f"the cache holds {len(self) - decay.shape[-1]} earlier tokens but the log forget sums "
                              f"of {held}: hand the decays to every call, from the first token on, or use a new cache")
        new = forget_sums(decay, None if self.sums is None else self.sums[..., -1])
        self.sums = new if self.sums is None else torch.cat([self.sums, new], dim=-1)
        return new, self.sums

    #: PaTH's transforms ``(w, beta)`` of the cached tokens (``b h n d``, ``b h n``)
    householder: tuple[torch.Tensor, torch.Tensor] | None = None

    def continue_householder(self, w: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PaTH's transforms of the new tokens, ``w`` (``b h n d``) and ``beta`` (``b h n``), appended to the cached
        tokens' (after :meth:`append` has added their keys); returns every cached token's: a new query's logit to a
        cached key reads the transforms of every token between them."""
        held = 0 if self.householder is None else self.householder[1].shape[-1]
        if held != len(self) - beta.shape[-1]:
            raise PosencError(f"the cache holds {len(self) - beta.shape[-1]} earlier tokens but the transforms of "
                              f"{held}: hand PaTH's transforms to every call, from the first token on, or use a new "
                              "cache")
        if self.householder is not None:
            w = torch.cat([self.householder[0], w], dim=-2)
            beta = torch.cat([self.householder[1], beta], dim=-1)
        self.householder = (w, beta)
        return self.householder


class SinkCache:
    """A rolling key/value cache with attention sinks (Xiao et al. 2024, StreamingLLM): the first ``sinks``
    tokens stay, and of the rest only the last ``window``.

    Shapes: ``attention(q, k, v, encoding, cache=cache)`` with the new tokens' ``q, k, v`` ``b h n d`` (one token
    at a time past the capacity); the cache holds ``k, v`` ``b h (sinks + window) d`` at most.

    >>> import torch; from posenc_lab import RoPE, SinkCache, attention
    >>> rope, (q, k, v), cache = RoPE(8, train_len=16), torch.randn(3, 1, 2, 9, 8), SinkCache(window=3, sinks=1)
    >>> for i in range(9): out = attention(q[:, :, [i]], k[:, :, [i]], v[:, :, [i]], rope, cache=cache)
    >>> cache.k.shape, cache.seen, out.shape
    (torch.Size([1, 2, 4, 8]), 9, torch.Size([1, 2, 1, 8]))

    Positions are the slots *within the cache* (``0 .. size - 1``), not the tokens' positions in the stream, so a
    stream of any length never shows the encoding a distance or a position beyond ``sinks + window``.

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
