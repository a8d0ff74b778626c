"""The two ways to install agree: environment.yml (conda) and pyproject.toml (pip)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def normalise(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def test_environment_yml_declares_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in ("test", "book"):
        wanted |= set(project["optional-dependencies"][extra])
    env_lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_reqs = {line.strip()[2:] for line in env_lines if line.startswith("      - ") and not line.strip().startswith("- -e")}
    assert {normalise(r) for r in pip_reqs} == {normalise(r) for r in wanted}


def test_the_backend_module_and_the_attention_function_do_not_collide():
    """Regression (issue 9): ``posenc_lab.attention`` was both a module and a function."""
    import importlib.util

    import posenc_lab
    import posenc_lab.backends as backends

    assert callable(posenc_lab.attention) and backends.attention is posenc_lab.attention
    assert callable(backends.choose_backend)
    assert importlib.util.find_spec("posenc_lab.attention") is None


def test_package_modules_form_layers_without_import_cycles():
    """Regression (issue 9): plots and report imported each other."""
    import ast
    import graphlib

    package = ROOT / "posenc_lab"
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    graph = {}
    for name in modules:
        deps = set()
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[name] = deps & modules
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
