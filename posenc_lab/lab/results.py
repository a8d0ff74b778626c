"""The committed results, from a checkout or from the data distribution alike.

The repository keeps its measured results under ``results/`` (one folder per run, and
``results/benchmarks``), marked by the file ``results/POSENC_RESULTS.md``. The package wheel carries
code only; the results travel as a second, data-only distribution, ``posenc-lab-results`` (built from
``packaging/results`` of the same repository), so that a notebook opened alone -- on Colab -- reads
exactly the committed numbers after one install line::

    pip install "posenc-lab[lab,book] @ git+https://github.com/posenc-lab/posenc-lab" \
        "posenc-lab-results @ git+https://github.com/posenc-lab/posenc-lab#subdirectory=packaging/results"

    from posenc_lab.lab import results
    rows, units, config = results.load("article-cpu")
    bench = results.benchmark("cpu-long-eval")

:func:`root` finds the results: ``$POSENC_LAB_RESULTS`` if set, else the first ``results/`` holding the marker
in the working directory or above it, or above the package's own location (a checkout, an editable install),
else the installed ``posenc_lab_results``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posenc_lab.errors import PosencError
from posenc_lab.lab.run.schema import is_context_run, migrate, migrate_config, migrate_unit, read_config, trained_as

#: the file that marks a folder of committed results
MARKER = "POSENC_RESULTS.md"
#: the install line of the data distribution (the Colab cell of every chapter uses it)
DATA_INSTALL = ("pip install 'posenc-lab-results @ "
                "git+https://github.com/posenc-lab/posenc-lab#subdirectory=packaging/results'")

#: the committed runs and what made each (``make`` targets in the repository)
RUNS = {
    "cpu": "make results-cpu: 4 layers, trained at 128 bytes, one seed, evaluated to 16x",
    "cpu-finetune": "make results-cpu: RoPE fine-tuned briefly at 4x with pi, ntk and yarn",
    "article-cpu": "make results-article: the article's lengths (trained at 512, judged at 2048), three seeds",
    "article-long": "make results-long: the article's five encodings with article-cpu's model and recipe and four "
                    "times its training tokens, three seeds",
    "article-long-b4": "make results-long-b4: article-long's model, tokens and evaluation in batches of 4 for 5,600 "
                       "steps (twice the optimiser steps), five seeds (3 and 4 added by scripts/device_seeds.sh and "
                       "scripts/merge_seeds.py); the recipe with more optimiser steps",
    "article-long-b4-cpu": "make results-long-b4-cpu: ALiBi and T5 with seed 0 of article-long-b4 trained again on a "
                           "CPU, to set the device's effect beside the seed-to-seed spread",
    "prose-long-b4": "make results-prose: article-long-b4's recipe on English prose (Jane Austen's novels and the "
                     "World English Bible), five seeds (3 and 4 added as for article-long-b4)",
    "prose-long": "make results-prose: article-long's recipe (batch 8, 2,800 steps) on the same English prose, three "
                  "seeds",
    "retrieval-cpu": "make results-retrieval: passkey retrieval at 1x to 8x the training length",
    "retrieval-digits-cpu": "make results-tasks: five digits copied in order (one shared alphabet), 1x to 8x the "
                            "training length, the article's five encodings, three seeds",
    "retrieval-multikey-cpu": "make results-tasks TASKS=multikey: the named key among three distractors of the same "
                              "kind, 1x to 8x the training length, the article's five encodings, three seeds "
                              "(untied embeddings, 8,000 steps)",
    "amplitude-cpu": "make results-amplitude: the small-amplitude sinusoids (sinusoidal-small), article-cpu's "
                     "recipe, seed 0",
    "variants-cpu": "make results-variants: what today's models run (chapter 12): partial rotary, p-RoPE, bases 500 and "
                    "500,000, a NoPE layer, randomized RoPE and learned positions, and plain RoPE (with Llama 3's "
                    "scaling) with article-cpu's recipe, three seeds",
    "recent-cpu": "make results-recent: what 2024-26 added (chapter 13): SSMax on NoPE and on RoPE, Llama 4's "
                  "temperature, iRoPE, Gemma 3's and RNoPE-SWA's local/global layers, FoPE, FoX and CoPE with "
                  "article-cpu's recipe, three seeds",
    "past-softmax-cpu": "make results-past-softmax: past the fixed bias and the softmax (chapter 14): stick-breaking "
                        "attention, PaTH and DAPE on KERPLE with article-cpu's recipe, three seeds",
    "retrieval-digits-recent": "make results-digits-recent: retrieval-digits-cpu's task and recipe for FoX, CoPE, SSMax "
                               "on RoPE and Gemma 3's layers (1 : 1 in the 2-layer model), three seeds",
    "retrieval-digits-past-softmax": "make results-digits-past-softmax: retrieval-digits-cpu's task and recipe for "
                                     "stick-breaking, PaTH and DAPE on KERPLE (chapter 14), three seeds",
    "context-cpu": "make results-context: article-cpu's models of every seed, no retraining: the gain from context "
                   "past 512 bytes, a passkey in Python (which digit was chosen is not recorded), streams "
                   "with and without attention sinks",
    "context-long": "make results-context-long: context-cpu's measurements on article-long's models (the article's "
                    "five encodings, four times the training tokens), every seed, no retraining",
    "context-long-b4": "make results-context-long-b4: context-long's measurements on article-long-b4's models (the "
                       "headline recipe), every seed, no retraining",
    "context-prose-long-b4": "make results-context-prose: the gain from context and the streams on prose-long-b4's "
                             "models (English prose), every seed, no retraining; no passkey (it plants Python)",
    "context-variants": "make results-context-variants: the gain from context past 512 bytes on variants-cpu's models, "
                        "every seed, no retraining (no passkey, no streams)",
    "context-recent": "make results-context-recent: the gain from context past 512 bytes on recent-cpu's models "
                      "(chapter 13), every seed (no passkey, no streams)",
    "context-past-softmax": "make results-context-past-softmax: the gain from context past 512 bytes on "
                            "past-softmax-cpu's models (chapter 14), every seed (no passkey, no streams)",
}
#: the tables of a context run (``python -m posenc_lab context``); every other run has ``results.json``
CONTEXT_TABLES = ("gain.json", "passkey.json", "stream.json")


def _marked(folder: Path) -> Path | None:
    return folder if (folder / MARKER).is_file() else None


def _upward(start: Path) -> Path | None:
    """The first ``results/`` with the marker in ``start`` or a folder above it (or ``start`` itself, if marked)."""
    for folder in (start, *start.parents):
        found = _marked(folder) or _marked(folder / "results")
        if found:
            return found
    return None


def root() -> Path:
    """The folder of the committed results (see the module's docstring for the order of the places searched)."""
    explicit = os.environ.get("POSENC_LAB_RESULTS")
    if explicit:
        if not _marked(Path(explicit)):
            raise PosencError(f"POSENC_LAB_RESULTS={explicit} has no {MARKER}: it is not a folder of committed results")
        return Path(explicit)
    found = _upward(Path.cwd().resolve()) or _upward(Path(__file__).resolve().parent)
    if found:
        return found
    try:
        import posenc_lab_results
    except ImportError:
        raise PosencError(f"no committed results here (no results/{MARKER} in {Path.cwd()} or above, nor above the "
                          f"package) and posenc-lab-results is not installed: {DATA_INSTALL}") from None
    return Path(posenc_lab_results.__file__).resolve().parent


def _checkout_root() -> Path:
    return root()


def folder(name: str) -> Path:
    """The folder of committed results ``name`` (a run of :data:`RUNS`, or ``benchmarks``)."""
    base = root()
    if (base / name).is_dir():
        return base / name
    known = ", ".join([*RUNS, "benchmarks"])
    raise PosencError(f"no committed results named {name!r} in {base}; known: {known}")


def _read_json(node):
    return json.loads(node.read_text())


def load(name: str) -> tuple[list[dict], list[dict], dict]:
    """Rows, unit records and config of a committed run, as :func:`~posenc_lab.lab.verdicts.tables.load` returns them for a run folder."""
    node = folder(name)
    if not (node / "results.json").is_file() and (node / CONTEXT_TABLES[0]).is_file():
        raise PosencError(f"{name!r} is a context run: read its tables with results.rows({name!r}) or "
                          f"results.read_json({name!r}, 'gain.json')")
    rows = migrate(_read_json(node / "results.json"))
    units_dir = node / "units"
    units = [migrate_unit(_read_json(p)) for p in sorted(units_dir.iterdir(), key=lambda p: p.name)
             if p.name.endswith(".json")]
    config = read_config(node / "config.json")
    return rows, units, config


def rows(name: str) -> list[dict]:
    """Every row of committed run ``name``: ``results.json`` (in the current schema,
    :func:`~posenc_lab.lab.run.schema.migrate`), or a context run's three tables one after the other."""
    node = folder(name)
    if (node / "results.json").is_file():
        return migrate(_read_json(node / "results.json"))
    if (node / CONTEXT_TABLES[0]).is_file():
        return [r for table in CONTEXT_TABLES if (node / table).is_file() for r in _read_json(node / table)]
    raise PosencError(f"committed run {name!r} has neither results.json nor gain.json")


def benchmark(name: str) -> dict:
    """A committed benchmark result, ``results/benchmarks/<name>.json``."""
    node = folder("benchmarks") / f"{name}.json"
    if not node.is_file():
        raise PosencError(f"no committed benchmark {name!r} in results/benchmarks")
    return _read_json(node)


def read_json(name: str, path: str):
    """Any other committed JSON file of run ``name`` (e.g. a retrieval run's ``grid.json``); ``results.json`` in the
    current schema, as :func:`rows` reads it."""
    data = _read_json(folder(name) / path)
    return migrate(data) if Path(path).name == "results.json" else data


def export_models(run_dir: str | Path, name: str, encodings, *, seed: int = 0, root: str | Path | None = None) -> list[Path]:
    """Copy the final weights of ``encodings`` (one seed) from a run folder into the committed results, as
    float16 (half the size; the chapters' diagnostics do not need more), under ``results/<name>/models``."""
    import torch

    dest = Path(root or _checkout_root()) / name / "models"
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for encoding in encodings:
        state = torch.load(Path(run_dir) / "models" / f"{encoding}-s{seed}.pt", map_location="cpu", weights_only=True)
        half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
        written.append(dest / f"{encoding}-s{seed}.pt")
        torch.save(half, written[-1])
    return written


def model(name: str, encoding: str, *, seed: int = 0, **options):
    """The committed trained model ``encoding`` (seed ``seed``) of run ``name``, in float32 and eval mode.

    ``options`` are passed to the encoding (e.g. ``scaling="yarn"`` for RoPE)."""
    _, _, config = load_config_only(name)
    node = folder(name) / "models" / f"{encoding}-s{seed}.pt"
    if not node.is_file():
        raise PosencError(f"run {name!r} has no committed model for {encoding} seed {seed}")
    return _build(config, node.read_bytes(), encoding, options)


def model_from_run(run_dir: str | Path, encoding: str, *, seed: int = 0, **options):
    """The trained model ``encoding`` (seed ``seed``) of a run folder (``--out`` of ``python -m posenc_lab run`` or
    of ``python -m posenc_lab retrieval``), in float32 and eval mode; ``options`` as in :func:`model`."""
    run_dir = Path(run_dir)
    path = run_dir / "models" / f"{encoding}-s{seed}.pt"
    if not (run_dir / "config.json").is_file():
        raise PosencError(f"{run_dir} has no config.json: is it the --out folder of a run?")
    if not path.is_file():
        raise PosencError(f"{run_dir} has no trained model for {encoding} seed {seed} ({path} is missing)")
    return _build(read_config(run_dir / "config.json"), path.read_bytes(), encoding, options)


def _build(config: dict, weights: bytes, encoding: str, options: dict):
    import io

    import torch

    from posenc_lab.model import GPT

    config = migrate_config(config)
    cfg = model_shape(config).config(trained_as(encoding, config))
    recorded = config["spec"].get("encoding_options", {})
    cfg.encoding_options = {**recorded.get(encoding, {}), **options}
    net = GPT(cfg)
    state = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return net.eval()


def model_shape(config: dict):
    """The shape every model of a run was trained in, from its ``config.json`` (of any schema version): a
    :class:`~posenc_lab.lab.experiments.recipe.ModelSpec`, the same part in every kind of run. The whole spec is
    :func:`~posenc_lab.lab.experiments.families.spec_of`."""
    from posenc_lab.lab.experiments.recipe import ModelSpec

    spec = migrate_config(config).get("spec", {})
    if is_context_run(config) or "model" not in spec:  # a context run measures another run's models
        raise PosencError("this config.json records no model of its own: is it a context run? Read the run it names")
    return ModelSpec(**spec["model"])


def load_config_only(name: str) -> tuple[None, None, dict]:
    """``(None, None, config)`` of a committed run: its ``config.json`` alone, without reading the rows."""
    return None, None, read_config(folder(name) / "config.json")
