"""The errors posenc_lab raises for bad input, and the checks that raise them.

Every check here turns what would be a traceback from deep inside torch into one
sentence that names the problem and, where there is a list of valid choices, the list.
"""

from __future__ import annotations

from collections.abc import Iterable


class PosencError(ValueError):
    """Bad input to posenc_lab: the message says what is wrong and how to fix it.

    >>> from posenc_lab import PosencError, make_encoding
    >>> make_encoding("rope", head_dim=8)
    Traceback (most recent call last):
    posenc_lab.errors.PosencError: encoding 'rope' needs train_len
    >>> issubclass(PosencError, ValueError)
    True
    """


class PositionOutOfRange(PosencError):
    """A position lies past the end of a learned position table.

    >>> import torch; from posenc_lab import Learned
    >>> Learned(8, max_len=4)(torch.zeros(1, 6, 8))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    posenc_lab.errors.PositionOutOfRange: learned absolute positions exist for 0..3, asked for position 5: ...
    """


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite: a failed run, not bad input.

    >>> from posenc_lab import PosencError, TrainingDiverged
    >>> issubclass(TrainingDiverged, RuntimeError), issubclass(TrainingDiverged, PosencError)
    (True, False)
    """


def unknown_name(kind: str, name: str, valid: Iterable[str]) -> PosencError:
    """The error for a name that is not in a registry, listing the valid names."""
    return PosencError(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(sorted(valid))}")


def check_positive(name: str, value) -> None:
    """Raise :class:`PosencError` unless ``value`` is a positive number (a bool is not a number here)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise PosencError(f"{name} must be a positive number, got {value!r}")


def check_heads(num_heads) -> None:
    """Raise :class:`PosencError` unless ``num_heads`` is a positive integer."""
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0:
        raise PosencError(f"the number of heads must be a positive integer, got {num_heads!r}")


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
