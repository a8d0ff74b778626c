"""scripts/merge_seeds.py adds a seed only when every encoding finished it on the kind of device (a GPU or a CPU)
the committed run's seeds trained on."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("merge_seeds", ROOT / "scripts" / "merge_seeds.py")
merge_seeds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_seeds)

H100, H200, CPU = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu (x86_64, 1 threads)"


def run_folder(path: Path, seeds, units: dict[str, str]) -> Path:
    """A run folder of encodings alibi and t5 with ``seeds`` in its spec and one unit per ``name -> device``."""
    (path / "units").mkdir(parents=True)
    config = {"corpus": {"sha256": "c"}, "evaluation_text": {"sha256": "e"},
              "spec": {"encodings": ["alibi", "t5"], "seeds": seeds, "other_seeds": seeds, "model": {}}}
    (path / "config.json").write_text(json.dumps(config))
    for name, device in units.items():
        encoding, seed = name.split("-s")
        row = {"encoding": encoding, "strategy": "-", "seed": int(seed), "eval_len": 512, "mode": "sliding",
               "status": "ok", "loss": 1.0, "perplexity": 2.718, "device": device, "schema": 3}
        (path / "units" / f"{name}.json").write_text(json.dumps({"rows": [row]}))
    return path


@pytest.fixture
def committed(tmp_path):
    return run_folder(tmp_path / "committed", [0], {"alibi-s0": H200, "t5-s0": H200})


def merge(committed: Path, other: Path, seed: int = 5):
    return merge_seeds.main([str(committed), str(other), "--seeds", str(seed)])


def test_a_seed_of_gpu_units_joins_a_gpu_run(committed, tmp_path):
    other = run_folder(tmp_path / "other", [5], {"alibi-s5": H100, "t5-s5": H100})
    assert merge(committed, other) == 0
    config = json.loads((committed / "config.json").read_text())
    assert config["spec"]["seeds"] == [0, 5] and config["merged"] == [{"seeds": [5], "spec_differences": {}}]
    assert {r["seed"] for r in json.loads((committed / "results.json").read_text())} == {0, 5}


def test_a_seed_whose_units_ran_on_a_gpu_and_a_cpu_is_not_merged(committed, tmp_path):
    other = run_folder(tmp_path / "other", [5], {"alibi-s5": H100, "t5-s5": CPU})
    with pytest.raises(SystemExit, match="more than one kind of device .*alibi: gpu, t5: cpu"):
        merge(committed, other)
    assert sorted(p.name for p in (committed / "units").iterdir()) == ["alibi-s0.json", "t5-s0.json"]


def test_a_seed_trained_wholly_on_a_cpu_does_not_join_a_gpu_run(committed, tmp_path):
    other = run_folder(tmp_path / "other", [5], {"alibi-s5": CPU, "t5-s5": CPU})
    with pytest.raises(SystemExit, match="seed 5 ran on a cpu, the committed run's seeds on a gpu"):
        merge(committed, other)


def test_a_unit_without_a_device_or_with_two_kinds_is_refused(tmp_path):
    unit = tmp_path / "u.json"
    unit.write_text(json.dumps({"rows": [{"seed": 5}]}))
    with pytest.raises(SystemExit, match="does not name its device"):
        merge_seeds.device_kind(unit)
    unit.write_text(json.dumps({"rows": [{"device": H100}, {"device": CPU}]}))
    with pytest.raises(SystemExit, match="not one kind"):
        merge_seeds.device_kind(unit)


def test_an_unfinished_seed_is_not_merged(committed, tmp_path):
    other = run_folder(tmp_path / "other", [5], {"alibi-s5": H100})
    with pytest.raises(SystemExit, match="not finished for t5"):
        merge(committed, other)


def test_the_committed_headline_runs_seeds_all_trained_on_gpus():
    from posenc_lab.lab.run.units import collect_rows

    for run in ("article-long-b4", "prose-long-b4"):
        assert merge_seeds.kind_of({r.get("device") for r in collect_rows(ROOT / "results" / run)}, run) == "gpu"
