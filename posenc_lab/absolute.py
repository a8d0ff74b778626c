"""Absolute position encodings: a vector added to each token embedding.

Sinusoidal (Vaswani et al. 2017), in the paper's interleaved convention and the book's notation:
``PE[m, 2i] = sin(m theta_i)``, ``PE[m, 2i+1] = cos(m theta_i)``, ``theta_i = b ** (-2i / d)`` (base ``b``).

>>> import torch; from posenc_lab import absolute
>>> table = absolute.sinusoidal_table(10, 8)  # n d
>>> table.shape, torch.allclose(table[7], absolute.sinusoidal_shift(3, 8) @ table[4])  # PE(m + 3) = M_3 PE(m)
(torch.Size([10, 8]), True)
"""

from __future__ import annotations

import torch
from einops import einsum, rearrange
from torch import nn

from .errors import PositionOutOfRange, check_even, check_positive


def sinusoidal_frequencies(dim: int, base: float = 10000.0) -> torch.Tensor:
    """``theta_i = b ** (-2i / d)`` for ``i = 0 .. d/2 - 1`` in float64 (``b`` is ``base``)."""
    check_even("sinusoidal dimension", dim)
    check_positive("sinusoidal base", base)
    return float(base) ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def sinusoidal_encoding(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """``PE[m] = (sin(m theta_0), cos(m theta_0), sin(m theta_1), ...)`` for positions ``... n``: ``... n d``, float64."""
    freqs = sinusoidal_frequencies(dim, base).to(positions.device)
    angles = einsum(positions.to(torch.float64), freqs, "... n, f -> ... n f")
    return rearrange([angles.sin(), angles.cos()], "r ... f -> ... (f r)")


def sinusoidal_table(num_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The ``num_positions x dim`` table of :func:`sinusoidal_encoding` at positions ``0 .. num_positions - 1``."""
    check_positive("num_positions", num_positions)
    return sinusoidal_encoding(torch.arange(num_positions), dim, base)


def sinusoidal_shift(offset: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The ``d x d`` matrix ``M_k`` with ``PE(n + k) = M_k PE(n)`` for every ``n`` (Vaswani et al. 2017, sec. 3.5).

    It is block-diagonal: block ``i`` is ``[[cos k theta_i, sin k theta_i], [-sin k theta_i, cos k theta_i]]``,
    from the angle-addition formulas ``sin(x + y) = sin x cos y + cos x sin y`` and
    ``cos(x + y) = cos x cos y - sin x sin y``.
    """
    w = sinusoidal_frequencies(dim, base) * offset
    c, s = w.cos(), w.sin()
    blocks = torch.stack([torch.stack([c, s], -1), torch.stack([-s, c], -1)], -2)  # f 2 2
    return torch.block_diag(*blocks)


class LearnedPositions(nn.Module):
    """A learned table of ``max_len`` position vectors (GPT-2); it has nothing to say past its end."""

    def __init__(self, max_len: int, dim: int, init_std: float = 0.02):
        super().__init__()
        check_positive("learned table length", max_len)
        self.max_len = max_len
        self.table = nn.Parameter(torch.randn(max_len, dim) * init_std)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """The learned vectors at ``positions`` (``... n -> ... n d``); :class:`PositionOutOfRange` past the table's
        end."""
        if torch.compiler.is_compiling():  # reading values would break the graph: the model's positions are 0 .. n-1
            first, last = 0, positions.shape[-1] - 1
        else:
            first, last = (int(positions.min()), int(positions.max())) if positions.numel() else (0, -1)
        if last >= self.max_len or first < 0:
            raise PositionOutOfRange(
                f"learned absolute positions exist for 0..{self.max_len - 1}, asked for position "
                f"{last if last >= self.max_len else first}: a learned table cannot extrapolate past its training length"
            )
        return self.table[positions]
