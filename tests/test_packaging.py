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
