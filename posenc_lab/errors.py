"""The errors posenc_lab raises for bad input, and the checks that raise them.

Every check here turns what would be a traceback from deep inside torch into one
sentence that names the problem and, where there is a list of valid choices, the list.
"""

from __future__ import annotations

from collections.abc import Iterable


class PosencError(ValueError):
    """Bad input to posenc_lab: the message says what is wrong and how to fix it."""


class PositionOutOfRange(PosencError):
    """A position lies past the end of a learned position table."""


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite."""


def unknown_name(kind: str, name: str, valid: Iterable[str]) -> PosencError:
    """The error for a name that is not in a registry, listing the valid names."""
    return PosencError(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(sorted(valid))}")


def check_positive(name: str, value) -> None:
    """Raise :class:`PosencError` unless ``value`` is a positive number (a bool is not a number here)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise PosencError(f"{name} must be a positive number, got {value!r}")


def check_even(name: str, value: int) -> None:
    """Raise :class:`PosencError` unless ``value`` is a positive even number (dimensions are rotated in pairs)."""
    check_positive(name, value)
    if value % 2:
        raise PosencError(f"{name} must be even (dimensions are rotated in pairs), got {value}")


def check_positions(positions) -> None:
    """Raise :class:`PosencError` unless ``positions`` hold signed integers: floats are not positions, and
    unsigned ones wrap around when subtracted (``0 - 1 = 255`` in ``uint8``), so every distance would be wrong."""
    dtype = positions.dtype
    if dtype.is_floating_point or dtype.is_complex or not dtype.is_signed:
        raise PosencError(f"positions must be signed integers (torch.long, torch.int32, ...), got {dtype}")
