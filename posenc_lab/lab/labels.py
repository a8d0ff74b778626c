"""The label of a result: an encoding, or ``encoding/strategy`` for a RoPE extrapolation strategy (``rope/yarn``,
``rope/pi+ft`` when the model was fine-tuned with it). Every table and figure of the lab names its rows this way;
:class:`Label` is the one place that writes and reads the form."""

from __future__ import annotations

from dataclasses import dataclass

#: the strategy column of a row whose encoding has no strategies
NO_STRATEGY = "-"
#: the suffix of a strategy the model was fine-tuned with
FINETUNED = "+ft"


@dataclass(frozen=True)
class Label:
    """``Label("rope", "yarn")`` prints as ``rope/yarn``; ``Label("alibi")`` as ``alibi``.
    ``Label.parse(str(label)) == label`` for every label."""

    encoding: str
    strategy: str | None = None

    def __post_init__(self):
        if self.strategy in ("", NO_STRATEGY):
            object.__setattr__(self, "strategy", None)

    @classmethod
    def parse(cls, text: str) -> "Label":
        """The label a printed ``"encoding/strategy"`` (or a bare ``"encoding"``) stands for."""
        encoding, _, strategy = text.partition("/")
        return cls(encoding, strategy or None)

    @classmethod
    def of(cls, row) -> "Label":
        """The label of a result row (a dict or a table row with ``encoding`` and ``strategy``; a missing or NaN
        strategy is none)."""
        strategy = row["strategy"]
        return cls(row["encoding"], strategy if isinstance(strategy, str) else None)

    def __str__(self) -> str:
        return self.encoding if self.strategy is None else f"{self.encoding}/{self.strategy}"

    @property
    def as_trained(self) -> bool:
        """The model as trained: an encoding without strategies, or RoPE's ``none``."""
        return self.strategy in (None, "none")

    @property
    def finetuned(self) -> bool:
        """A strategy the model was fine-tuned with (``rope/pi+ft``)."""
        return self.strategy is not None and self.strategy.endswith(FINETUNED)
