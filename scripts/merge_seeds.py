"""Add the finished seeds of a second run of a preset to a committed run, and rebuild its tables.

    python scripts/merge_seeds.py results/article-long-b4 runs/article-long-b4-seeds --seeds 3,4

A seed is merged only when every encoding of the committed run finished it on the kind of device the committed
run's seeds trained on (a GPU, or a CPU: book/analysis.md); a row's ``device`` names the device, not the precision
it trained in. The two runs must share the corpus
(its SHA-256), the evaluation text (its SHA-256) and the recipe: the spec may differ only in its seeds and in how the
arithmetic ran (``backend``, ``compile``), and those differences are recorded in the committed ``config.json`` under
``merged``, beside the seeds they apply to. Each row keeps its own ``device``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from posenc_lab.lab.run.units import collect_rows, write_atomic, write_table

#: spec fields that may differ between the merged runs: how the same arithmetic ran, not what was trained
HOW = {"compile"}
MODEL_HOW = {"backend"}


def differences(base: dict, other: dict) -> dict:
    """The spec fields in which ``other`` differs from ``base``, as ``{field: [base's, other's]}``; raise where a
    difference is more than the seeds or how the arithmetic ran."""
    found = {}
    for key in sorted(set(base) | set(other)):
        a, b = base.get(key), other.get(key)
        if a == b or key in ("seeds", "other_seeds"):
            continue
        if key == "model":
            for field in sorted(set(a) | set(b)):
                if a.get(field) != b.get(field):
                    if field not in MODEL_HOW:
                        sys.exit(f"the runs differ in model.{field}: {a.get(field)!r} against {b.get(field)!r}")
                    found[f"model.{field}"] = [a.get(field), b.get(field)]
        elif key in HOW:
            found[key] = [a, b]
        else:
            sys.exit(f"the runs differ in {key}: {a!r} against {b!r}")
    return found


def kind_of(devices: set, where) -> str:
    """``"cpu"`` or ``"gpu"``: the one kind of device the rows of ``where`` name (a row's ``device`` is ``cpu (...)``
    on a CPU and the card's name on a GPU); exit where a row names none or the rows name two kinds."""
    if not devices or any(not d for d in devices):
        sys.exit(f"{where}: a row does not name its device")
    kinds = {"cpu" if d.startswith("cpu") else "gpu" for d in devices}
    if len(kinds) != 1:
        sys.exit(f"{where} records {sorted(devices)} as its devices: not one kind")
    return kinds.pop()


def device_kind(unit: Path) -> str:
    """The kind of device (:func:`kind_of`) every row of a unit record ran on."""
    return kind_of({row.get("device") for row in json.loads(unit.read_text())["rows"]}, unit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("committed", type=Path, help="the committed run folder (results/<run>)")
    p.add_argument("other", type=Path, help="the run folder that holds the new seeds")
    p.add_argument("--seeds", required=True, help="the seeds to merge, e.g. 3,4")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    base, other = (json.loads((f / "config.json").read_text()) for f in (args.committed, args.other))
    for key in ("corpus", "evaluation_text"):
        if base[key] != other[key]:
            sys.exit(f"the runs differ in their {key}: {base[key]} against {other[key]}")
    how = differences(base["spec"], other["spec"])
    encodings = base["spec"]["encodings"]
    committed_kind = kind_of({row.get("device") for row in collect_rows(args.committed)}, args.committed)
    for seed in seeds:
        missing = [e for e in encodings if not (args.other / "units" / f"{e}-s{seed}.json").exists()]
        if missing:
            sys.exit(f"seed {seed} is not finished for {', '.join(missing)}: not merged")
        if seed in base["spec"]["seeds"]:
            sys.exit(f"seed {seed} is in the committed run already")
        kinds = {e: device_kind(args.other / "units" / f"{e}-s{seed}.json") for e in encodings}
        if len(set(kinds.values())) > 1:
            sys.exit(f"seed {seed} ran on more than one kind of device "
                     f"({', '.join(f'{e}: {k}' for e, k in kinds.items())}): not merged")
        if set(kinds.values()) != {committed_kind}:
            sys.exit(f"seed {seed} ran on a {kinds[encodings[0]]}, the committed run's seeds on a {committed_kind}: "
                     "not merged")
    for seed in seeds:
        for e in encodings:
            shutil.copy2(args.other / "units" / f"{e}-s{seed}.json", args.committed / "units" / f"{e}-s{seed}.json")
    spec = base["spec"]
    spec["seeds"] = sorted(set(spec["seeds"]) | set(seeds))
    spec["other_seeds"] = sorted(set(spec["other_seeds"]) | set(seeds))
    base.setdefault("merged", []).append({"seeds": seeds, "spec_differences": how})
    write_atomic(args.committed / "config.json", json.dumps(base, indent=1))
    write_table(args.committed, collect_rows(args.committed))
    print(f"{args.committed}: seeds {spec['seeds']}; merged {seeds}" + (f" (ran with {how})" if how else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
