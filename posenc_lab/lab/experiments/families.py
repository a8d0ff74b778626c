"""The kinds of run -- a language model, a retrieval task -- and which one a run folder holds.

Every kind keeps its spec in its own module (:mod:`~posenc_lab.lab.experiments.language_model`,
:mod:`~posenc_lab.lab.experiments.retrieval`); a reader of a run folder that does not know its kind asks
:func:`spec_of`. A context run measures a language-model run and has no models of its own.
"""

from __future__ import annotations

from posenc_lab.errors import PosencError
from posenc_lab.lab.experiments.language_model import Spec
from posenc_lab.lab.experiments.retrieval import RetrievalSpec
from posenc_lab.lab.run.schema import is_context_run, migrate_config


def spec_of(config: dict) -> Spec | RetrievalSpec:
    """The spec a run's ``config.json`` records (of any schema version): a
    :class:`~posenc_lab.lab.experiments.retrieval.RetrievalSpec` for a retrieval run (its config describes the task
    under ``task``), else a language-model :class:`~posenc_lab.lab.experiments.language_model.Spec`.

    >>> from posenc_lab.lab.experiments.language_model import PRESETS
    >>> spec_of({"schema": 3, "spec": PRESETS["ci"].to_dict()}) == PRESETS["ci"]
    True
    """
    if is_context_run(config):
        raise PosencError("a context run's config.json records the run it measures, not a spec of its own")
    kind = RetrievalSpec if "task" in config else Spec
    return kind.from_dict(migrate_config(config)["spec"])
