"""The package's shape: the core at the top, the lab in rooms under ``posenc_lab/lab``, imports that only go down,
every name imported from the module where it lives, and a short trail from the command line to a trained model.
The numbers come from ``scripts/architecture.py``, which prints them."""

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts" / "architecture.py")
architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architecture)

#: the core: what a researcher imports (torch, einops, numpy only)
CORE = ["posenc_lab", "posenc_lab.encodings", "posenc_lab.backends", "posenc_lab.rope", "posenc_lab.xpos",
        "posenc_lab.bias", "posenc_lab.absolute", "posenc_lab.model", "posenc_lab.errors"]
MAX_LAYERS = 10
#: every module any call touches on the way (leaf checks included), and the chain of calls on the stack
TRAIL_MODULES, TRAIL_RETURNS_UP = 12, 3
PATH_MODULES, PATH_RETURNS_UP = 5, 1


@pytest.fixture(scope="module")
def graph():
    return architecture.import_graph()


def test_the_import_graph_has_layers_and_no_import_goes_up(graph):
    """No cycle (``layers`` raises on one), so no import reaches a module on its own layer or above."""
    layer = architecture.layers(graph)
    assert architecture.upward_imports(graph, layer) == []
    assert max(layer.values()) <= MAX_LAYERS, max(layer.values())


def test_a_cycle_is_found():
    """The measure can fail: two modules that import each other have no layers."""
    import graphlib

    with pytest.raises(graphlib.CycleError):
        architecture.layers({"a": {"b"}, "b": {"a"}})
    assert architecture.layers({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == {"b": 1, "a": 2, "c": 3}


def test_the_core_imports_nothing_from_the_lab(graph):
    """Nothing the core imports, directly or through others, anywhere in its files (inside functions too), is
    under ``posenc_lab/lab``."""
    reached, todo = set(CORE), list(CORE)
    while todo:
        for dep in graph[todo.pop()] - reached:
            reached.add(dep)
            todo.append(dep)
    assert reached == set(CORE), sorted(reached - set(CORE))


def test_the_lab_lives_in_rooms():
    """Besides the core, the package's top holds only ``__main__`` (the command line) and the lab's folder."""
    top = {p.stem for p in (ROOT / "posenc_lab").glob("*.py")} | {
        d.name for d in (ROOT / "posenc_lab").iterdir() if (d / "__init__.py").exists()}
    assert top == {m.removeprefix("posenc_lab.") for m in CORE[1:]} | {"__init__", "__main__", "lab"}
    rooms = {d.name for d in (ROOT / "posenc_lab" / "lab").iterdir() if (d / "__init__.py").exists()}
    assert rooms == {"data", "run", "measure", "experiments", "verdicts", "figures"}


def _bindings(module: str) -> dict[str, str]:
    """Top-level names of ``module`` -> ``"def"`` (defined there) or the module it imports them from."""
    path = architecture.modules()[module]
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = "def"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id: "def" for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out |= {a.asname or a.name: node.module for a in node.names}
    return out


def _lab_imports(text: str):
    """``(module, name)`` of every ``from posenc_lab.lab... import name`` in ``text`` (Python or Markdown)."""
    for match in re.finditer(r"^[ \t]*from (posenc_lab\.lab[\w.]*) import (?:\(([^)]*)\)|([^\n#]+))", text, re.M):
        for item in (match.group(2) or match.group(3)).split(","):
            name = item.split(" as ")[0].strip()
            if name:
                yield match.group(1), name


def test_every_lab_name_is_imported_from_where_it_lives():
    """No module re-exports another's names: each ``from posenc_lab.lab.X import name`` names the module that
    defines ``name`` (or the subpackage that holds the module ``name``), in the package, the tests, the scripts,
    the benchmarks and the chapters."""
    mods = architecture.modules()
    files = [p for d in ("posenc_lab", "tests", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    files += sorted((ROOT / "notebooks").glob("*.md")) + sorted((ROOT / "book").rglob("*.md"))
    wrong = []
    for path in files:
        for module, name in _lab_imports(path.read_text()):
            if f"{module}.{name}" in mods:
                continue
            where = _bindings(module).get(name) if module in mods else None
            if where != "def":
                wrong.append(f"{path.relative_to(ROOT)}: {name} from {module} (lives in {where})")
    assert not wrong, "\n".join(wrong)


def test_every_public_name_imports_from_where_the_readme_and_the_user_guide_import_it():
    """The ``from posenc_lab import ...`` lines of README.md and book/use.md, run as written, and every name of
    ``posenc_lab.__all__``."""
    import posenc_lab

    lines = [line for doc in ("README.md", "book/use.md") for line in (ROOT / doc).read_text().splitlines()
             if re.match(r"\s*(import torch.*; )?from posenc_lab[\w.]* import ", line)]
    assert len(lines) >= 4
    for line in lines:
        statement = re.search(r"from posenc_lab[\w.]* import [\w, ]+", line).group(0)
        exec(statement, {})
    assert all(hasattr(posenc_lab, name) for name in posenc_lab.__all__)
    for module in ("posenc_lab.rope", "posenc_lab.bias", "posenc_lab.absolute", "posenc_lab.xpos"):
        importlib.import_module(module)


@pytest.mark.slow
def test_the_trail_from_the_command_line_to_a_trained_model_is_short(graph):
    """``python -m posenc_lab run --preset ci`` (one step), traced until training starts. Every call between two
    modules: at most ``TRAIL_MODULES`` modules take part, and at most ``TRAIL_RETURNS_UP`` calls go back up to a
    higher layer. The chains on the stack when the preset is read, the model built and training started (the path
    a reader follows): at most ``PATH_MODULES`` modules and ``PATH_RETURNS_UP`` steps up."""
    layer = architecture.layers(graph)
    calls, chains = architecture.trail(chains=True)
    count, ups = architecture.trail_numbers(calls, layer)
    assert ("posenc_lab.__main__", "posenc_lab.lab.experiments.language_model") in calls
    assert count <= TRAIL_MODULES and ups <= TRAIL_RETURNS_UP, (count, ups, sorted(calls))
    count, ups = architecture.path_numbers(chains, layer)
    assert count <= PATH_MODULES and ups <= PATH_RETURNS_UP, (count, ups, chains)
