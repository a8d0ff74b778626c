"""The package's shape, measured: the import graph's layers and the trail from the command line to a trained model.

``python scripts/architecture.py`` prints both; ``tests/test_architecture.py`` holds the limits.

* **Layers.** Every module of ``posenc_lab`` (a file; a subpackage is its ``__init__``) is a node, every import
  statement an edge, those inside functions included. A module that imports no other module of the package is on
  layer 1; any other is one layer above the highest module it imports. A cycle has no layers: it is reported.
* **The trail.** ``python -m posenc_lab run`` of a preset, traced from the start until training begins: every call
  from a function of one module to a function of another. The trail's modules are those that take part; a *return
  up* is a call from a module to one on a higher layer (a callback, or a module passed as a value, that sends the
  reader back up).
* Nodes: each file, except the core's subpackages ``encodings`` and ``backends``, one node each.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "posenc_lab"


#: the core's subpackages, each one node of the graph (their files are one idea each, read together)
UNITS = ("posenc_lab.encodings", "posenc_lab.backends")


def node(module: str) -> str:
    """The node of ``module``: itself, or the core subpackage it belongs to."""
    return next((u for u in UNITS if module == u or module.startswith(u + ".")), module)


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its file)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for stmt in ast.walk(ast.parse(path.read_text())):
            if isinstance(stmt, ast.Import):
                targets = [a.name for a in stmt.names]
            elif isinstance(stmt, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", stmt)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in stmt.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # ``import a.b.c`` of a name: its module
                    target = target.rpartition(".")[0]
                if target:
                    deps.add(node(target))
        graph.setdefault(node(name), set()).update(deps)
    return {name: deps - {name} for name, deps in graph.items()}


def layers(graph: dict[str, set[str]] | None = None) -> dict[str, int]:
    """Module -> its layer (1 = imports nothing of the package). Raises ``graphlib.CycleError`` on a cycle."""
    import graphlib

    graph = import_graph() if graph is None else graph
    layer = {}
    for module in graphlib.TopologicalSorter(graph).static_order():
        layer[module] = 1 + max((layer[d] for d in graph[module]), default=0)
    return layer


def upward_imports(graph: dict[str, set[str]], layer: dict[str, int]) -> list[tuple[str, str]]:
    """Imports from a module to one on the same or a higher layer (none where the graph has layers)."""
    return [(m, d) for m, deps in graph.items() for d in deps if layer[d] >= layer[m]]


#: the functions whose entry ends a chain of the path: the preset read, the model built, training started
PATH_ENDS = ("preset", "__init__", "train")


def trail(argv: list[str] | None = None, until: str = "train", chains: bool = False):
    """The calls between modules (caller node, callee node) that ``python -m posenc_lab`` makes for ``argv`` (a
    tiny run of the ``ci`` preset by default) from the start until the function ``until`` is entered: every module
    a reader follows from the command line to the model being trained, the preset's spec included."""
    import importlib
    import tempfile

    from posenc_lab.__main__ import main

    for module in modules():  # imported first, so that no module's body runs while the calls are traced
        importlib.import_module(module)
    calls: set[tuple[str, str]] = set()
    found: dict[str, list[str]] = {}
    done = []

    def chain(frame) -> list[str]:
        names = []
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("posenc_lab") and (not names or names[-1] != node(module)):
                names.append(node(module))
            frame = frame.f_back
        return names[::-1]

    def tracer(frame, event, arg):
        if done or event != "call":
            return None
        name = frame.f_code.co_name
        if name in PATH_ENDS and name not in found and (name != "__init__" or frame.f_globals.get("__name__") ==
                                                          "posenc_lab.model" and "GPT" in frame.f_code.co_qualname):
            found[name] = chain(frame)
        callee = frame.f_globals.get("__name__", "")
        back = frame.f_back
        if back is None or back.f_code.co_name == "<module>":  # a module's body running as it is imported
            return None
        caller = back.f_globals.get("__name__", "")
        if callee.startswith("posenc_lab") and caller.startswith("posenc_lab") and node(callee) != node(caller):
            calls.add((node(caller), node(callee)))
        if frame.f_code.co_name == until and callee.startswith("posenc_lab"):
            done.append(callee)
        return None

    with tempfile.TemporaryDirectory() as out:
        argv = argv or ["run", "--preset", "ci", "--encodings", "nope", "--steps", "1", "--warmup", "1",
                        "--checkpoint-every", "1", "--eval-lengths", "64", "--eval-tokens", "128", "--no-progress",
                        "--no-report", "--out", out]
        old = sys.gettrace()
        sys.settrace(tracer)
        try:
            main(argv)
        finally:
            sys.settrace(old)
    assert done, f"{until}() was never called"
    return (calls, [found[n] for n in PATH_ENDS if n in found]) if chains else calls


def trail_numbers(calls: set[tuple[str, str]], layer: dict[str, int]) -> tuple[int, int]:
    """(modules on the trail, returns up): the modules that take part in the calls, and the calls from a module to
    one on a higher layer (a lower module calling back into a higher one)."""
    return len({m for c in calls for m in c}), sum(layer[b] > layer[a] for a, b in calls)


def path_numbers(chains: list[list[str]], layer: dict[str, int]) -> tuple[int, int]:
    """(modules on the path, steps up): the modules on the chains, and the steps of a chain from a module to one on
    a higher layer."""
    steps = {(a, b) for c in chains for a, b in zip(c, c[1:])}
    return len({m for c in chains for m in c}), sum(layer[b] > layer[a] for a, b in steps)


if __name__ == "__main__":
    graph = import_graph()
    layer = layers(graph)
    print(f"{len(graph)} modules in {max(layer.values())} layers; "
          f"{len(upward_imports(graph, layer))} imports up")
    for depth in range(max(layer.values()), 0, -1):
        print(f"  {depth:2d}: {' '.join(sorted(m.removeprefix('posenc_lab.') for m in layer if layer[m] == depth))}")
    if "--no-trail" not in sys.argv:
        calls, chains = trail(chains=True)
        for a, b in sorted(calls, key=lambda c: (-layer[c[0]], -layer[c[1]])):
            up = "  (up)" if layer[b] > layer[a] else ""
            print(f"  call: {a.removeprefix('posenc_lab.')}({layer[a]}) -> {b.removeprefix('posenc_lab.')}({layer[b]}){up}")
        count, ups = trail_numbers(calls, layer)
        print(f"the trail from the command line to a trained model: {count} modules, {ups} returns up")
        for c in chains:
            print("  path: " + " -> ".join(f"{m.removeprefix('posenc_lab.')}({layer[m]})" for m in c))
        count, ups = path_numbers(chains, layer)
        print(f"the path (the chains on the stack): {count} modules, {ups} steps up")
