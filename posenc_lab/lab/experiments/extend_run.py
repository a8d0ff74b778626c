"""Extending a finished run: the evaluations a spec adds (a new length or sliding stride), measured on the
final weights the run kept, without training.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.experiments.extend_run")

import json
import time
from pathlib import Path

import torch

from posenc_lab.encodings import ENCODINGS
from posenc_lab.errors import PosencError
from posenc_lab.model import GPT
from posenc_lab.lab.data.corpora import Corpus, EvalText, evaluation_text, load_corpus
from posenc_lab.lab.experiments.language_model import Spec
from posenc_lab.lab.measure.perplexity_grid import PlainRotation, evaluate_all
from posenc_lab.lab.run import distributed
from posenc_lab.lab.run.schema import SCHEMA_VERSION, migrate_config, migrate_unit
from posenc_lab.lab.run.units import collect_rows, resolve_device, run_context, write_atomic, write_table
from posenc_lab.lab.labels import Label

# the columns of a row that an evaluation measures; the others are the unit's (its training) or the machine's
_MEASURED = ("eval_len", "eval_mode", "stride", "status", "loss", "perplexity", "bits_per_byte", "tokens", "eval_seconds")
# the columns an extension writes from its own machine and commit
_MACHINE = ("device", "torch", "python", "posenc_lab", "git_commit", "schema")


def _evaluation_key(row: dict) -> tuple[int, str, int | None]:
    stride = row.get("stride")
    return int(row["eval_len"]), row["eval_mode"], int(stride) if row["eval_mode"] == "sliding" else None


def _device_kind(device: str) -> str:
    return device.split(" ")[0].split(":")[0]  # "cpu (x86_64, 2 threads)" -> cpu; "cuda:0 (H200)" -> cuda


def extend(spec: Spec, out: Path | str, *, corpus: Corpus | str = "stdlib", device: str | None = None,
           progress: bool = True, log=print) -> list[dict]:
    """Add to a finished run the evaluations that ``spec`` asks for and its units lack, from the final
    weights the run kept (``out/models``), without training; returns the rows of the whole table.

    For a length or a sliding stride added to a preset after its run was made. ``spec`` must describe
    the same experiment apart from its evaluations (model, recipe, seeds, corpus and evaluation text
    equal: a new sliding window may not need more lead-in than the run's text has), it may only add
    evaluations, and it must run on the kind of device the run was evaluated on (a CUDA device
    evaluates in bfloat16, a CPU in float32: the rows of one table must not mix them). The new rows
    carry the unit's training fields and the extension's own machine and commit; each extended unit
    records what was added, by which commit, in how many seconds, and what was not (``extended``).
    Fine-tuned strategies (``+ft``) are not extended: their weights are not kept.

    Every unit is checked before any is written. While an extension is in progress ``config.json``
    names the spec it is extending to (``extending``): ``run`` refuses the folder until an
    ``extend`` with that spec has finished, and an interrupted ``extend`` continues where it stopped.
    One process only (not under ``torchrun``).
    """
    if distributed.active():
        raise PosencError("run --extend in one process (not under torchrun): it evaluates a few models")
    out = Path(out)
    config_path = out / "config.json"
    if not config_path.exists():
        raise PosencError(f"{out} holds no run to extend (no config.json)")
    previous = migrate_config(json.loads(config_path.read_text()))
    device = resolve_device(device)
    corpus = load_corpus(corpus) if isinstance(corpus, str) else corpus
    text = evaluation_text(corpus, spec.evaluation.eval_tokens, lead_in=spec.evaluation.lead_in())
    config = json.loads(json.dumps({"schema": SCHEMA_VERSION, "spec": spec.to_dict(), "corpus": corpus.describe(),
                                    "evaluation_text": text.describe()}))
    _check_same_experiment(out, config, previous)
    common = run_context(spec, corpus, device)
    plans = _plans(out, spec.evaluation.evaluations(), common)
    if plans:
        write_atomic(config_path, json.dumps({**previous, "extending": config["spec"]}, indent=1))
    for plan in plans:
        _extend_unit(spec, out, text, device, progress, common, plan, log)
    if any(plan["not_extended"] for plan in plans):
        log("fine-tuned strategies (+ft) were not extended: their weights are not kept")
    write_atomic(config_path, json.dumps(config, indent=1))
    rows = collect_rows(out)
    write_table(out, rows)
    return rows


def _check_same_experiment(out: Path, config: dict, previous: dict) -> None:
    """Refuse a folder whose run differs from ``config`` in more than its evaluations, or that is being extended
    to another spec."""
    if previous.get("extending") not in (None, config["spec"]):
        raise PosencError(f"{out} is being extended to another spec (config.json 'extending'): finish that "
                          "extension first, with the same options")
    free = {"eval_lengths", "sliding", "notes"}
    new, old = _settings(config["spec"]), _settings(previous["spec"])
    differ = sorted(k for k in new if k not in free and new[k] != old.get(k))
    if differ:
        raise PosencError(f"{out} holds a different experiment ({', '.join(differ)} differ): extending adds "
                          "evaluations only")
    for part in ("corpus", "evaluation_text"):
        if config[part] != previous.get(part):
            raise PosencError(f"{out} was evaluated on a different {part.replace('_', ' ')} (a new sliding window "
                              "that needs more lead-in changes the text): re-run the experiment instead")


def _settings(spec: dict) -> dict:
    """Every setting of a recorded spec by its flat name (``steps``, not ``training``), to name what differs."""
    return {name: v for key, value in spec.items()
            for name, v in (value.items() if isinstance(value, dict) else [(key, value)])}


def _plans(out: Path, wanted: list, common: dict) -> list[dict]:
    """What each unit of ``out`` lacks of the ``wanted`` evaluations, by strategy, checked against this machine
    (``common``, :func:`~posenc_lab.lab.run.units.run_context`); every unit is checked before any is written."""
    paths = sorted((out / "units").glob("*.json"))
    missing_models = [p.stem for p in paths if not (out / "models" / f"{p.stem}.pt").exists()]
    if missing_models:
        raise PosencError(f"{out} kept no final weights for {', '.join(missing_models)} (models/): cannot extend")
    plans = []
    for path in paths:
        unit = migrate_unit(json.loads(path.read_text()))
        kinds = {_device_kind(r["device"]) for r in unit["rows"]}
        if kinds != {_device_kind(common["device"])}:
            raise PosencError(f"{path.stem} was evaluated on {', '.join(sorted(kinds))}, this extension would run "
                              f"on {common['device']}: extend on the same kind of device (--device)")
        strategies = list(dict.fromkeys(r["strategy"] for r in unit["rows"]))
        todo, not_extended = {}, []
        for strategy in strategies:
            have = {_evaluation_key(r) for r in unit["rows"] if r["strategy"] == strategy}
            dropped = have - set(wanted)
            if dropped:
                raise PosencError(f"{path.stem} {strategy} has evaluations the new spec drops "
                                  f"({sorted(dropped, key=str)}): extending only adds")
            missing = [e for e in wanted if e not in have]
            if Label("rope", strategy).finetuned:
                not_extended += [[strategy, *e] for e in missing]
            else:
                todo[strategy] = missing
        if any(todo.values()):
            plans.append({"path": path, "unit": unit, "strategies": strategies, "todo": todo,
                          "not_extended": not_extended, "wanted": wanted})
    return plans


def _extend_unit(spec: Spec, out: Path, text: EvalText, device, progress, common: dict, plan: dict, log) -> None:
    """Evaluate one unit's kept weights at the evaluations its ``plan`` lacks, and rewrite its unit file."""
    path, unit, strategies, todo = plan["path"], plan["unit"], plan["strategies"], plan["todo"]
    encoding, seed = unit["encoding"], unit["seed"]
    t0 = time.perf_counter()
    log(f"extending {path.stem}: {sum(map(len, todo.values()))} evaluations")
    model = GPT(spec.model.config(encoding))
    state = torch.load(out / "models" / f"{encoding}-s{seed}.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.to(device).eval()
    plain = PlainRotation(model, encoding)  # the 'none' strategy's new rows, reused as a run reuses them
    for strategy in strategies:
        if not todo.get(strategy):
            continue
        if strategy != "-":
            model.encoding.set_scaling(strategy)
        base = {k: v for k, v in next(r for r in unit["rows"] if r["strategy"] == strategy).items()
                if k not in _MEASURED}
        base.update({k: common[k] for k in _MACHINE})  # the training is the unit's; the evaluation is ours
        evaluated, per_position, docs = evaluate_all(model, spec, text, device, progress, f"{path.stem} {strategy}",
                                                     same_as=plain.same_as, evaluations=todo[strategy])
        if strategy == "none":
            plain.remember(evaluated, per_position, docs)
        unit["rows"] += [{**base, **r} for r in evaluated]
        unit["documents"] = unit.get("documents", []) + [
            {"encoding": encoding, "seed": seed, "strategy": strategy, **d} for d in docs]
        unit.setdefault("per_position", {}).setdefault(strategy, {}).update(per_position)
    if ENCODINGS[encoding].has_strategies:
        model.encoding.set_scaling("none")
    order = {e: i for i, e in enumerate(plan["wanted"])}
    unit["rows"].sort(key=lambda r: (strategies.index(r["strategy"]), order[_evaluation_key(r)]))
    unit["extended"] = unit.get("extended", []) + [{
        "commit": common["git_commit"], "seconds": round(time.perf_counter() - t0, 1),
        "evaluations": [list(e) for e in dict.fromkeys(e for v in todo.values() for e in v)],
        "not_extended": plan["not_extended"]}]
    write_atomic(path, json.dumps(unit))
