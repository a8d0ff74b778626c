"""The encodings that add a bias ``b[h, i, j]`` to the attention logits: ALiBi, T5, KERPLE and FIRE."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import bias
from ..errors import PosencError
from .base import Encoding


class _BiasEncoding(Encoding):
    """A bias encoding: ``bias(q_pos, k_pos)`` is ``h i j`` for positions ``i`` and ``j``, and ``b h i j`` for
    positions ``b i`` and ``b j`` (one table per batch row; a 1-d side is shared by every row)."""

    hook = "bias"
    distance_only = True
    shape = {"num_heads": "num_heads"}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "bias" in cls.__dict__:  # every subclass's formula also serves positions of shape (b, n), row by row
            cls.bias = _per_row(cls.__dict__["bias"])

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor:
        return self.bias(distances, torch.zeros(1, dtype=distances.dtype, device=distances.device))[:, :, 0]

    def device(self) -> torch.device:
        return next(iter(self.parameters()), next(iter(self.buffers()), torch.empty(0))).device


def _per_row(bias: Callable) -> Callable:
    """``bias`` (one table ``h i j`` from 1-d positions) extended to positions ``b n``: a stack of per-row tables."""

    @functools.wraps(bias)
    def batched(self, q_pos, k_pos):
        if q_pos.dim() == 1 and k_pos.dim() == 1:
            return bias(self, q_pos, k_pos)
        if q_pos.dim() > 2 or k_pos.dim() > 2:
            raise PosencError(f"bias positions must be (n,) or (b, n), got {tuple(q_pos.shape)} and {tuple(k_pos.shape)}")
        rows = max(p.shape[0] for p in (q_pos, k_pos) if p.dim() == 2)
        q_rows, k_rows = (p.expand(rows, -1) if p.dim() == 2 else p.expand(rows, p.shape[-1]) for p in (q_pos, k_pos))
        return torch.stack([bias(self, qp, kp) for qp, kp in zip(q_rows, k_rows)])

    return batched


class ALiBi(_BiasEncoding):
    """ALiBi (Press et al. 2022): ``b[h, i, j] = -m_h |i - j|`` with fixed slopes :func:`bias.alibi_slopes`.

    Shapes: ``alibi(positions)``: ``positions`` ``n`` -> the bias ``h n n`` (the ``bias`` hook);
    ``bias(q_pos, k_pos)``: ``i``, ``j`` -> ``h i j`` (``b i``, ``b j`` -> ``b h i j``).

    >>> import torch; from posenc_lab import ALiBi
    >>> alibi = ALiBi(4)
    >>> alibi.slopes.tolist(), alibi(torch.arange(4))[0, 3, :3].tolist()
    ([0.25, 0.0625, 0.015625, 0.00390625], [-0.75, -0.5, -0.25])

    The paper defines the causal case; for non-causal attention the same ``-m_h |i - j|`` is used
    for keys on both sides of the query. ``alibi_heads=k`` puts ALiBi on the first ``k`` heads only, with the
    slopes of ``k`` heads, and slope 0 (no position) on the others (:func:`bias.partial_alibi_slopes`).
    """

    name = "alibi"

    def __init__(self, num_heads: int, *, alibi_heads: int | None = None):
        super().__init__()
        slopes = bias.alibi_slopes(num_heads) if alibi_heads is None else bias.partial_alibi_slopes(num_heads, alibi_heads)
        self.register_buffer("slopes", slopes.to(torch.float32), persistent=False)
        self.alibi_heads = num_heads if alibi_heads is None else alibi_heads

    @property
    def num_heads(self) -> int:
        """One slope per head."""
        return self.slopes.shape[0]

    def bias(self, q_pos, k_pos):
        return bias.alibi_bias(self.slopes, q_pos, k_pos)

    def score_mod(self, positions):
        slopes = self.slopes

        def alibi(score, b, h, q_idx, kv_idx):
            i, j = positions(q_idx, kv_idx)
            return score - slopes[h] * (i - j).abs()

        return alibi


class T5(_BiasEncoding):
    """T5 relative bias (Raffel et al. 2020): a learned scalar per head and log-spaced distance bucket.

    Shapes: ``t5(positions)``: ``positions`` ``n`` -> the bias ``h n n`` (the ``bias`` hook);
    ``bias(q_pos, k_pos)``: ``i``, ``j`` -> ``h i j`` (``b i``, ``b j`` -> ``b h i j``).

    >>> import torch; from posenc_lab import T5
    >>> b = T5(2)(torch.arange(6))
    >>> b.shape, torch.equal(b[:, 3, 1], b[:, 5, 3])  # one learned number per head and distance bucket
    (torch.Size([2, 6, 6]), True)

    ``bidirectional=False`` (a decoder) buckets only keys at or before the query, and is defined for
    causal attention only; ``bidirectional=True`` (the encoder) has buckets for both sides.
    """

    name = "t5"

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False):
        super().__init__()
        self.table = bias.T5Bias(num_heads, num_buckets=num_buckets, max_distance=max_distance,
                                 bidirectional=bidirectional)
        self.noncausal = bidirectional

    noncausal_hint = " (build it with bidirectional=True)"

    @property
    def num_heads(self) -> int:
        """One column of the bucket table per head."""
        return self.table.table.shape[1]  # buckets x heads

    def bias(self, q_pos, k_pos):
        return self.table(q_pos, k_pos)


class Kerple(_BiasEncoding):
    """KERPLE-log (Chi et al. 2022): ``b[h, i, j] = -r1_h ln(1 + r2_h |i - j|)``, ``r1, r2`` learned.

    The bias is symmetric in ``i, j``.

    Shapes: ``kerple(positions)``: ``positions`` ``n`` -> the bias ``h n n`` (the ``bias`` hook);
    ``bias(q_pos, k_pos)``: ``i``, ``j`` -> ``h i j`` (``b i``, ``b j`` -> ``b h i j``).

    >>> import torch; from posenc_lab import Kerple
    >>> [round(v, 4) for v in Kerple(1)(torch.arange(3))[0, 2, :2].tolist()]  # -ln 3, -ln 2 at r1 = r2 = 1
    [-1.0986, -0.6931]
    """

    name = "kerple"

    def __init__(self, num_heads: int, **options):
        super().__init__()
        self.kernel = bias.KerpleLog(num_heads, **options)

    @property
    def num_heads(self) -> int:
        """One pair ``r1, r2`` per head."""
        return self.kernel.raw_r1.shape[0]

    def bias(self, q_pos, k_pos):
        return self.kernel(q_pos, k_pos)


class Fire(_BiasEncoding):
    """FIRE (Li et al. 2023): a learned MLP of the progressively normalised distance; depends on ``m`` too.

    Shapes: ``fire(positions)``: ``positions`` ``n`` -> the bias ``h n n`` (the ``bias`` hook);
    ``bias(q_pos, k_pos)``: ``i``, ``j`` -> ``h i j`` (``b i``, ``b j`` -> ``b h i j``).

    >>> import torch; from posenc_lab import Fire
    >>> b = Fire(2, train_len=16)(torch.arange(6))
    >>> b.shape, torch.allclose(b[:, 3, 1], b[:, 5, 3])  # below the threshold L~ = 16: the distance alone
    (torch.Size([2, 6, 6]), True)

    Defined for causal attention only (its normaliser ``psi(max(L~, m))`` bounds the distance to the
    keys *before* query ``m``). While every query position is at most the threshold ``L~`` (training,
    and the first ``L~`` positions of any window), the normaliser is the constant ``psi(L~)`` and the
    bias depends on the distance alone: then it is built from a per-distance table, exactly the same
    values as pair by pair (:meth:`distance_only_at`).
    """

    name = "fire"
    distance_only = False
    shape = {"num_heads": "num_heads", "train_len": "train_len"}
    noncausal = False

    def __init__(self, num_heads: int, *, train_len: int = 512, **options):
        super().__init__()
        options.setdefault("init_threshold", float(train_len))
        self.fire = bias.FIRE(num_heads, **options)

    @property
    def num_heads(self) -> int:
        """One output of the MLP per head."""
        return self.fire.mlp[-1].out_features

    def bias(self, q_pos, k_pos):
        return self.fire(q_pos, k_pos)

    def score_mod(self, positions):
        """FIRE pair by pair (its bias depends on the query position too): the module's own normaliser and MLP."""
        c, threshold = self.fire.params()

        def fire(score, b, h, q_idx, kv_idx):
            i, j = positions(q_idx, kv_idx)
            return score + self.fire.mlp(bias.fire_input(i.reshape(1), j.reshape(1), c, threshold).reshape(1))[h]

        return fire

    def distance_only_at(self, q_pos: torch.Tensor) -> bool:
        if torch.compiler.is_compiling() or q_pos.numel() == 0:
            return False
        return float(q_pos.max()) <= float(self.fire.params()[1].detach())

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor:
        """``b[h, k]`` at signed distances ``distances[k]`` for queries at or below the threshold (see above): each
        distance is passed as a query position against a key at 0, which keeps the normaliser at ``psi(L~)`` for
        every distance up to ``L~`` (negative distances read as 0, as for any future key)."""
        return self.bias(distances, torch.zeros(1, dtype=distances.dtype, device=distances.device))[:, :, 0]
