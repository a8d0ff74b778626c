"""The parts a spec is composed of: the model's shape and the training recipe, which every kind of run shares (the
language-model experiment, passkey retrieval), and :class:`Composed`, what a spec made of parts can do.

A part's fields keep the names of the :class:`~posenc_lab.model.GPTConfig` and
:class:`~posenc_lab.lab.run.training.TrainConfig` fields they fill (``n_layer``, ``train_len``, ``steps``, ...), and no two
parts of a spec share a field name, so one *flat name* says where a value goes: an override
(``preset("ci", steps=10)``), a command-line flag (``--steps``) and a column of the results (``train_len``)
name the same thing.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.experiments.recipe")

from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass, replace

from posenc_lab.encodings import ENCODINGS
from posenc_lab.errors import PosencError, check_positive, unknown_name
from posenc_lab.model import GPTConfig
from posenc_lab.rope import ROPE_SCALINGS
from posenc_lab.lab.run.training import TrainConfig


def check_registered(encodings=(), strategies=()) -> None:
    """Raise a one-line :class:`~posenc_lab.errors.PosencError`, listing the valid names, unless every name in
    ``encodings`` is a registered encoding and every one in ``strategies`` a registered RoPE scaling.

    >>> check_registered(["rope", "alibi"], ["yarn"])
    >>> check_registered(["rotary"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    posenc_lab.errors.PosencError: unknown encoding 'rotary'; valid encodings: ...
    """
    for name in encodings:
        if name not in ENCODINGS:
            raise unknown_name("encoding", name, ENCODINGS)
    for name in strategies:
        if name not in ROPE_SCALINGS:
            raise unknown_name("RoPE scaling", name, ROPE_SCALINGS)

@dataclass(frozen=True)
class ModelSpec:
    """The shape of the model every encoding of a run is trained in: the fields of
    :class:`~posenc_lab.model.GPTConfig` that a run chooses. The encoding is the unit's, not the spec's, and the rest
    of :class:`~posenc_lab.model.GPTConfig` (vocabulary, MLP width) is the same in every run."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    train_len: int = 128
    backend: str = "auto"
    #: one matrix for the input embedding and the output head (see :class:`~posenc_lab.model.GPTConfig`)
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "train_len"):
            check_positive(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise PosencError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    def config(self, encoding: str) -> GPTConfig:
        """The :class:`~posenc_lab.model.GPTConfig` of ``encoding`` in this shape."""
        return GPTConfig(encoding=encoding, **asdict(self))

    def to_dict(self) -> dict:
        """The part as a plain dict; ``tie_embeddings`` only when untied (as
        :meth:`~posenc_lab.model.GPTConfig.to_dict` writes it)."""
        d = asdict(self)
        if d["tie_embeddings"]:
            del d["tie_embeddings"]
        return d


@dataclass(frozen=True)
class TrainingSpec:
    """The training recipe of every unit: the fields of :class:`~posenc_lab.lab.run.training.TrainConfig` that a run chooses.
    The seed is the unit's; the optimiser's constants (betas, weight decay, clipping, the floor of the schedule) are
    :class:`~posenc_lab.lab.run.training.TrainConfig`'s defaults in every run."""

    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100
    checkpoint_every: int = 200

    def __post_init__(self):
        for name in ("steps", "batch_size", "lr", "checkpoint_every"):
            check_positive(name, getattr(self, name))

    def config(self, seed: int) -> TrainConfig:
        """The :class:`~posenc_lab.lab.run.training.TrainConfig` of the unit with seed ``seed``."""
        return TrainConfig(seed=seed, **asdict(self))

    def to_dict(self) -> dict:
        """The part as a plain dict."""
        return asdict(self)


def _tuples(value):
    """``value`` read back from JSON: lists (at any depth) as tuples, as the specs hold them."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class Composed:
    """What a spec made of parts can do: list its flat names, take overrides by flat name, and go to and from the
    dict that ``config.json`` records (each part nested under its field's name).

    A field is a part when its default is made by a factory that returns a dataclass (``field(default_factory=
    ModelSpec)``)."""

    @classmethod
    def parts(cls) -> dict[str, type]:
        """The part fields of this kind of spec, by name, and the class of each."""
        made = {f.name: f.default_factory() for f in fields(cls) if f.default_factory is not MISSING}
        return {name: type(part) for name, part in made.items() if is_dataclass(part)}

    @classmethod
    def flat_names(cls) -> list[str]:
        """Every name a value of this kind of spec is set by: its own fields but the parts, and every part's fields."""
        parts = cls.parts()
        names = [n for f in fields(cls) for n in ([g.name for g in fields(parts[f.name])] if f.name in parts
                                                  else [f.name])]
        assert len(names) == len(set(names)), f"two parts of {cls.__name__} share a field name"
        return names

    @classmethod
    def given(cls, options) -> dict:
        """What parsed command-line ``options`` (an ``argparse.Namespace``) hold for each flat name of this kind
        of spec, ``None`` where they hold nothing; ``preset`` and ``notes`` are not options."""
        return {n: getattr(options, n, None) for n in cls.flat_names() if n not in ("preset", "notes")}

    def override(self, **flat):
        """This spec with the values of ``flat`` that are not ``None``, each in the part that holds its name
        (``steps`` in ``training``, ``eval_lengths`` in ``evaluation``, ...); a part given whole replaces it. A name
        that is neither is an error that lists the valid ones."""
        flat = {k: v for k, v in flat.items() if v is not None}
        own = {f.name for f in fields(self)}
        for name in flat:
            if name not in own and name not in self.flat_names():
                raise unknown_name("setting", name, self.flat_names())
        changed = {}
        for name, kind in self.parts().items():
            mine = {f.name: flat.pop(f.name) for f in fields(kind) if f.name in flat}
            if mine:
                changed[name] = replace(flat.pop(name, getattr(self, name)), **mine)
        return replace(self, **flat, **changed)

    def to_dict(self) -> dict:
        """The spec as a plain dict (as stored in ``config.json``): each part a dict of its own."""
        parts = self.parts()
        return {f.name: getattr(self, f.name).to_dict() if f.name in parts else getattr(self, f.name)
                for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict):
        """The spec a ``config.json`` records (:meth:`to_dict`); a field it does not name takes its default."""
        parts = cls.parts()
        return cls(**{k: parts[k](**{n: _tuples(v) for n, v in value.items()}) if k in parts else _tuples(value)
                      for k, value in d.items()})
