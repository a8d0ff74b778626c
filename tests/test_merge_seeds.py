"""scripts/merge_seeds.py adds a seed only when every encoding finished it on one kind of device."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("merge_seeds", ROOT / "scripts" / "merge_seeds.py")
merge_seeds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_seeds)


def run_folder(path: Path, seeds, units: dict[str, str]) -> Path:
    """A run folder of encodings alibi and t5 with ``seeds`` in its spec and one unit per ``name -> device``."""
    (path / "units").mkdir(parents=True)
    config = {"corpus": {"sha256": "c"}, "evaluation_text": {"sha256": "e"},
              "spec": {"encodings": ["alibi", "t5"], "seeds": seeds, "other_seeds": seeds, "model": {}}}
    (path / "config.json").write_text(json.dumps(config))
    for name, device in units.items():
        (path / "units" / f"{name}.json").write_text(json.dumps({"rows": [{"device": device, "seed": 5}]}))
    return path


def test_a_seed_whose_units_ran_on_a_gpu_and_a_cpu_is_not_merged(tmp_path):
    committed = run_folder(tmp_path / "committed", [0], {})
    other = run_folder(tmp_path / "other", [5], {"alibi-s5": "NVIDIA H100 80GB HBM3",
                                                 "t5-s5": "cpu (x86_64, 1 threads)"})
    with pytest.raises(SystemExit, match="more than one kind of device .*alibi: gpu, t5: cpu"):
        merge_seeds.main([str(committed), str(other), "--seeds", "5"])
    assert not list((committed / "units").iterdir())  # nothing copied


def test_a_seed_on_two_gpus_of_one_kind_passes_the_device_check(tmp_path):
    other = run_folder(tmp_path / "other", [5], {"alibi-s5": "NVIDIA H100 80GB HBM3", "t5-s5": "NVIDIA H200"})
    assert {merge_seeds.device_kind(other / "units" / f"{e}-s5.json") for e in ("alibi", "t5")} == {"gpu"}


def test_an_unfinished_seed_is_not_merged(tmp_path):
    committed = run_folder(tmp_path / "committed", [0], {})
    other = run_folder(tmp_path / "other", [5], {"alibi-s5": "NVIDIA H100 80GB HBM3"})
    with pytest.raises(SystemExit, match="not finished for t5"):
        merge_seeds.main([str(committed), str(other), "--seeds", "5"])
