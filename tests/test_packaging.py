"""Installing: environment.yml and pyproject.toml agree, the core is light, the wheels hold what they should."""

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def normalise(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def test_environment_yml_declares_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in ("test", "lab", "book"):
        wanted |= set(project["optional-dependencies"][extra])
    env_lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_reqs = {line.strip()[2:] for line in env_lines if line.startswith("      - ") and not line.strip().startswith("- -e")}
    assert {normalise(r) for r in pip_reqs} == {normalise(r) for r in wanted}


def test_the_backend_module_and_the_attention_function_do_not_collide():
    """``posenc_lab.attention`` is the function; the backends live in the subpackage ``posenc_lab.backends``."""
    import importlib.util

    import posenc_lab
    import posenc_lab.backends as backends

    assert callable(posenc_lab.attention) and backends.attention is posenc_lab.attention
    assert callable(backends.choose_backend)
    assert importlib.util.find_spec("posenc_lab.attention") is None


CORE = ["posenc_lab", "posenc_lab.encodings", "posenc_lab.rope", "posenc_lab.xpos", "posenc_lab.bias", "posenc_lab.absolute",
        "posenc_lab.backends", "posenc_lab.model", "posenc_lab.errors", "posenc_lab.lab.extras", "posenc_lab.lab.results",
        "posenc_lab.lab.measure.diagnostics"]
EXTRA_MODULES = ["matplotlib", "pandas", "scipy", "statsmodels", "seaborn", "plotly", "tqdm"]


def test_core_dependencies_are_torch_einops_numpy():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {re.split(r"[<>=]", r)[0] for r in project["dependencies"]} == {"torch", "einops", "numpy"}
    assert {"lab", "book", "test"} <= set(project["optional-dependencies"])
    assert project["requires-python"] == ">=3.11"  # the tests read TOML with tomllib


def test_importing_the_core_imports_none_of_the_extras():
    """Nothing of the extras after the core's imports; tqdm only if torch itself brought it (some builds do)."""
    probe = (f"import importlib, sys, torch, einops, numpy\nbefore = set(sys.modules)\n"
             f"for m in {CORE!r}: importlib.import_module(m)\n"
             f"print(sorted(m for m in {EXTRA_MODULES!r} if m in sys.modules and m not in before))\n"
             f"print(sorted(m for m in {EXTRA_MODULES[:-1]!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    from posenc_lab.lab import extras

    monkeypatch.setitem(extras.EXTRAS, "lab", ("tqdm", "no_such_module_posenc"))
    with pytest.raises(extras.MissingExtra) as err:
        extras.require("lab", "the runner")
    assert str(err.value) == ("the runner needs the [lab] extra (missing: no_such_module_posenc): "
                              "pip install 'posenc-lab[lab]'")


def _wheel(source: Path, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(dest)], check=True, capture_output=True, text=True)
    return next(dest.glob("*.whl"))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheels")
    return _wheel(ROOT, root / "code"), _wheel(ROOT / "packaging" / "results", root / "data")


def test_the_package_wheel_is_code_only_and_small(wheels):
    code, _ = wheels
    assert code.stat().st_size <= 1_000_000
    names = zipfile.ZipFile(code).namelist()
    modules = {n for n in names if not n.startswith("posenc_lab-")}
    assert modules == {f"posenc_lab/{p.relative_to(ROOT / 'posenc_lab').as_posix()}"
                       for p in (ROOT / "posenc_lab").rglob("*.py")}


def test_the_data_wheel_holds_every_committed_table(wheels):
    _, data = wheels
    names = set(zipfile.ZipFile(data).namelist())
    results = ROOT / "results"
    wanted = {f"posenc_lab_results/{p.relative_to(results).as_posix()}" for p in results.rglob("*")
              if p.is_file() and p.suffix in {".json", ".csv", ".pt", ".md"}}
    assert wanted and wanted <= names
    assert "posenc_lab_results/__init__.py" in names and "posenc_lab_results/POSENC_RESULTS.md" in names


def test_installed_wheels_read_the_results_outside_a_checkout(wheels, tmp_path):
    """The two wheels unpacked into a fresh folder, run from a folder without results: the data distribution
    serves results.load, as on Colab after the one install line."""
    site = tmp_path / "site"
    for wheel in wheels:
        zipfile.ZipFile(wheel).extractall(site)
    probe = ("import posenc_lab; from posenc_lab.lab import results\n"
             "rows, units, config = results.load('cpu')\n"
             "print(posenc_lab.__file__); print(results.root()); print(len(rows) > 0, len(units) > 0)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("POSENC_LAB_RESULTS", None)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    package, found, loaded = out.stdout.split("\n")[:3]
    assert package.startswith(str(site)) and found == str(site / "posenc_lab_results") and loaded == "True True"


def test_results_are_found_by_their_marker(tmp_path, monkeypatch):
    from posenc_lab import PosencError
    from posenc_lab.lab import results

    monkeypatch.delenv("POSENC_LAB_RESULTS", raising=False)
    assert results.root() == ROOT / "results"  # this checkout, from the package's location
    fake = tmp_path / "project" / "results"
    (fake / "cpu" / "units").mkdir(parents=True)
    (fake / results.MARKER).write_text("marker")
    (fake / "cpu" / "results.json").write_text(json.dumps([{"x": 1}]))
    (fake / "cpu" / "config.json").write_text("{}")
    deep = tmp_path / "project" / "notebooks" / "sub"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert results.root() == fake  # from the working directory upward, before the package's checkout
    from posenc_lab.lab.run.schema import SCHEMA_VERSION

    # read through the schema's migrations: rows and config.json
    assert results.load("cpu") == ([{"x": 1, "schema": SCHEMA_VERSION}], [], {"schema": SCHEMA_VERSION})
    monkeypatch.setenv("POSENC_LAB_RESULTS", str(tmp_path))
    with pytest.raises(PosencError, match="has no POSENC_RESULTS.md"):
        results.root()


@pytest.mark.slow
def test_a_run_with_the_lab_extra_alone_saves_its_results_and_skips_the_figures_in_one_line(tmp_path, monkeypatch,
                                                                                             capsys):
    """``pip install posenc-lab[lab]`` without the figures' extra: the run finishes, its tables are written, and the
    figures are skipped with one printed line naming the extra that draws them (simulated: the figure modules
    cannot be imported)."""
    from posenc_lab.__main__ import main
    from posenc_lab.lab.extras import EXTRAS

    for name in EXTRAS["figures"]:
        monkeypatch.setitem(sys.modules, name, None)  # import fails, find_spec finds nothing
    for name in ("posenc_lab.lab.figures.files", "posenc_lab.lab.figures.plots"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    out = tmp_path / "run"
    args = ["run", "--preset", "ci", "--encodings", "nope", "--steps", "2", "--warmup", "1", "--checkpoint-every", "2",
            "--eval-lengths", "64", "--eval-tokens", "128", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert (out / "results.csv").exists() and json.loads((out / "results.json").read_text())
    assert not (out / "figures").exists()
    skipped = [line for line in printed if "figures" in line.lower()]
    assert skipped == ["figures skipped: they need the [figures] extra (missing: matplotlib, seaborn, plotly): "
                       "pip install 'posenc-lab[figures]'"]
