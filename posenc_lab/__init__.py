"""posenc-lab: Transformer position encodings, derived, tested and compared at lengths past training.

The public names: ``ENCODINGS`` and ``make_encoding`` (the one registry of encodings),
``attention`` (one attention function, several backends), and the modules ``rope``, ``bias``
and ``absolute`` with the formulas as pure functions.
"""

from . import absolute, bias, rope
from .backends import BACKENDS, attention
from .encodings import ENCODINGS, Encoding, make_encoding
from .errors import PosencError, PositionOutOfRange, TrainingDiverged

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "ENCODINGS", "Encoding", "PosencError", "PositionOutOfRange", "TrainingDiverged",
    "absolute", "attention", "bias", "make_encoding", "rope",
]
