"""Randomized positions (Ruoss et al. 2023) for RoPE and for a learned table."""

from __future__ import annotations

import torch

from ..errors import PosencError, PositionOutOfRange
from .embedded import Learned
from .rotary import RoPE


class _Randomized:
    """Randomized positions (Ruoss et al. 2023): the ``n`` tokens of a window get a sorted random subset of
    ``0 .. max_position - 1`` instead of ``0 .. n - 1`` (one draw per forward pass, shared by the batch),
    so that positions up to ``max_position`` are seen in training -- and, as in the authors' code,
    at evaluation too: a model that has only ever seen gaps of about ``max_position / L`` between
    neighbours is not shown the gaps of 1 it never met. Training draws come from a generator seeded
    with the seed the encoding was built under and a counter, both kept in the state dict (a
    resumed run draws what an uninterrupted one would); evaluation draws depend on ``n`` alone (the
    same positions for every window of a length: one fixed sample, reproducible). No key/value
    cache can serve it: the positions of a whole window are drawn together."""

    cacheable = False
    EVAL_SEED = 20230526

    def _setup_draws(self, max_position: int, train_len: int):
        if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position < train_len:
            raise PosencError(f"max_position must be an integer >= the training length {train_len}, got {max_position!r}")
        self.max_position = max_position
        self.register_buffer("draws", torch.zeros((), dtype=torch.int64))
        self.register_buffer("draw_seed", torch.tensor(torch.initial_seed() % 2**62, dtype=torch.int64))

    def forward_positions(self, positions, training):
        n = positions.shape[-1]
        if n > self.max_position:
            raise PositionOutOfRange(f"{n} positions cannot be drawn from the {self.max_position} this encoding "
                                     "was trained to draw from")
        if training:
            seed = (int(self.draw_seed) * 1_000_003 + int(self.draws)) % 2**63
            self.draws += 1
        else:
            seed = self.EVAL_SEED * 1_000_003 + n
        chosen = torch.randperm(self.max_position, generator=torch.Generator().manual_seed(seed))[:n].sort().values
        return chosen.to(positions.device)


class RandomizedRoPE(_Randomized, RoPE):
    """RoPE trained with randomized positions (``_Randomized``; ``max_position`` defaults to 16 x the
    training length).

    Shapes: as :class:`RoPE`'s, ``x`` ``... n d`` -> ``... n d`` at the positions given; a model draws them with
    :meth:`forward_positions` (``n`` -> ``n``).

    >>> import torch; from posenc_lab import RandomizedRoPE
    >>> rope = RandomizedRoPE(8, train_len=4, max_position=64)
    >>> drawn = rope.forward_positions(torch.arange(4), training=False)  # the same draw for every window of 4
    >>> drawn.shape, bool((drawn.diff() > 0).all() and drawn.max() < 64)
    (torch.Size([4]), True)
    """

    name, variant_of = "rope-random", "rope"

    def __init__(self, head_dim: int, *, train_len: int, max_position: int | None = None, **options):
        super().__init__(head_dim, train_len=train_len, **options)
        self._setup_draws(16 * train_len if max_position is None else max_position, train_len)


class RandomizedLearned(_Randomized, Learned):
    """A learned table trained with randomized positions (``_Randomized``): the table has ``max_position``
    rows (default 16 x the training length), each trained only when drawn, so evaluation can run up to
    ``max_position`` positions.

    Shapes: as :class:`Learned`'s, ``x`` ``b n d_model`` -> ``b n d_model``.

    >>> import torch; from posenc_lab import RandomizedLearned
    >>> table = RandomizedLearned(8, max_len=4, max_position=64)
    >>> table.max_positions, table(torch.zeros(1, 3, 8), torch.tensor([0, 40, 63])).shape
    (64, torch.Size([1, 3, 8]))
    """

    name, variant_of = "learned-random", "learned"
    bounded = False  # its table reaches max_position, far past the training length

    def __init__(self, d_model: int, *, max_len: int, max_position: int | None = None):
        max_position = 16 * max_len if max_position is None else max_position
        super().__init__(d_model, max_len=max(max_position, max_len) if isinstance(max_position, int) else max_len)
        self._setup_draws(max_position, max_len)
