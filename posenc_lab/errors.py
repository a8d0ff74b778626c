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
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise PosencError(f"{name} must be a positive number, got {value!r}")


def check_even(name: str, value: int) -> None:
    check_positive(name, value)
    if value % 2:
        raise PosencError(f"{name} must be even (dimensions are rotated in pairs), got {value}")
