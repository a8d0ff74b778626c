"""xPos (Sun et al. 2022): RoPE with a per-pair exponential decay with distance (derived in chapter 7).

Query pair ``i`` at position ``m`` is scaled by ``zeta_i ** (m / scale_base)`` and key pair ``i`` at ``n`` by
``zeta_i ** (-n / scale_base)``, on top of RoPE's rotation (:mod:`~posenc_lab.rope`), so the score carries
``zeta_i ** ((m - n) / scale_base)``.
"""

from __future__ import annotations

import torch

from .errors import check_even, check_positive
from .rope import rope_angles, rotate


def xpos_zeta(dim: int, gamma: float = 0.4) -> torch.Tensor:
    """xPos per-pair decay base ``zeta_i = (2 i / d + gamma) / (1 + gamma)`` (Sun et al. 2022).

    For ``i = 0 .. d/2 - 1`` it lies in ``[gamma / (1 + gamma), (1 + gamma - 2/d) / (1 + gamma)]``, inside (0, 1):
    every pair decays, the fast-turning ones (small ``i``) most."""
    check_even("xPos head dimension", dim)
    return (torch.arange(0, dim, 2, dtype=torch.float64) / dim + gamma) / (1 + gamma)


def apply_xpos(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scale_base: float = 512.0,
    gamma: float = 0.4,
    layout: str = "half",
    centre: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """xPos: RoPE with query pair ``i`` at ``m`` scaled by ``zeta_i ** (m / scale_base)`` and key pair at ``n`` by ``zeta_i ** (-n / scale_base)``.

    The score then carries ``zeta_i ** ((m - n) / scale_base)``, a decay with distance that still
    depends on ``m - n`` only. Positions are centred first (by default on the middle of the sequence;
    ``centre`` fixes it, as a key/value cache must): that changes no score but keeps the two powers
    inside float32's range at long lengths.
    """
    check_positive("xPos scale_base", scale_base)
    angles = rope_angles(positions, inv_freq)
    p = positions.to(torch.float64)
    if centre is not None:
        centred = p - centre
    else:
        centred = p - torch.div(p.max() + p.min(), 2, rounding_mode="floor") if p.numel() else p
    scale = xpos_zeta(q.shape[-1], gamma).to(p.device) ** (centred[..., None] / scale_base)  # ... n f
    cos, sin = angles.cos(), angles.sin()
    return rotate(q, cos * scale, sin * scale, layout), rotate(k, cos / scale, sin / scale, layout)
