"""posttrain's own imports point down the layers, and no two files (nor two packages) import each other.

Every import of a posttrain module (at module level or inside a function, read with `ast`) is checked against
the declared layer order below: a module may import its own package and anything in a lower or the same layer,
never a higher one. Two files importing each other (directly, at any level) are a circle, and a file importing
another's private `_name` is flagged (make it public where it belongs). A package or
top-level module that is not in LAYERS fails the test too, so a new one has to be placed in the order. Outside
cli/, an import of a posttrain module inside a function says why it is not at module level (`# lazy: ...`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"

# Low to high. `posttrain/__init__.py` (the package itself) is below everything.
LAYERS = [
    {"config", "distributed", "compile_cache", "loading", "workers"},
    {"data", "models", "rewards", "tools"},
    {"algorithms"},
    {"sampling"},
    {"training"},
    {"agent"},
    {"rollout"},
    {"serve"},
    {"rl", "eval"},
    {"distill", "demo"},
    {"cli"},
    {"api"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, mod: str, is_package: bool, known: set[str]) -> set[str]:
    """The posttrain modules `tree` imports anywhere (a `from X import name` counts X.name when it is a
    module, else X)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_package else 0)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            subs = [f"{base_name}.{a.name}" for a in node.names]
            names = [s for s in subs if s in known] or [base_name]
            if len(names) < len(subs):
                names.append(base_name)
        else:
            continue
        for name in names:
            while name and name not in known:  # `import posttrain.a.b.func`-like spellings: the module part
                name = name.rpartition(".")[0]
            if name.startswith("posttrain"):
                out.add(name)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(f, root): f for f in root.rglob("*.py")}
    known = set(files)
    graph = {}
    for mod, f in files.items():
        targets = imported_modules(ast.parse(f.read_text()), mod, f.name == "__init__.py", known)
        # importing a package one lives in only runs that package's __init__ (re-exports): not an arrow
        graph[mod] = {t for t in targets if t != mod and not mod.startswith(t + ".")}
    return graph


def layer_of(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def problems(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, targets in sorted(graph.items()):
        top = layer_of(mod)
        if top is not None and top not in RANK:
            out.append(f"UNRANKED {mod}: put '{top}' into LAYERS")
        for t in sorted(targets):
            ttop = layer_of(t)
            if ttop is not None and ttop != top and ttop in RANK and (top is None or RANK.get(top, 99) < RANK[ttop]):
                out.append(f"UP {mod} -> {t}")
            if mod in graph.get(t, ()) and mod < t:
                out.append(f"CIRCLE {mod} <-> {t}")
    return out


def package_circles(graph: dict[str, set[str]]) -> list[str]:
    """Pairs of packages (or top-level modules) that import each other, file by file (a layer may hold several
    packages, so the layer check alone lets two of one layer import each other)."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for mod, targets in graph.items():
        for t in targets:
            a, b = layer_of(mod), layer_of(t)
            if a and b and a != b:
                arrows.setdefault((a, b), []).append(f"{mod} -> {t}")
    return [f"PACKAGES {a} <-> {b}: {sorted(arrows[a, b])[0]}; {sorted(arrows[b, a])[0]}"
            for a, b in sorted(arrows) if a < b and (b, a) in arrows]


def private_imports(root: Path) -> list[str]:
    """`from posttrain.X import _name` in another file: a private helper used as a public one."""
    out = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("posttrain"):
                out += [f"PRIVATE {module_name(f, root)} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_posttrain_imports_point_down_and_no_two_files_import_each_other():
    graph = import_graph(PACKAGE)
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the walk saw the package
    assert problems(graph) == []
    assert package_circles(graph) == []
    assert private_imports(PACKAGE) == []


def test_the_check_finds_upward_imports_circles_and_unranked_packages(tmp_path):
    root = tmp_path / "posttrain"
    files = {
        "__init__.py": "",
        "models/__init__.py": "from posttrain.models.core import f\n",
        "models/core.py": "def f():\n    from posttrain.training import trainer  # upward, inside a function\n",
        "training/__init__.py": "",
        "training/trainer.py": "from posttrain.models import core\nfrom . import loop\n",
        "training/loop.py": "import posttrain.training.trainer\n",
        "data/__init__.py": "from posttrain.data import a\n",
        "data/a.py": "from posttrain.data.b import g\nfrom posttrain.data import b\n",
        "data/b.py": "def g():\n    from posttrain.data.a import h\n",
        "newpkg/__init__.py": "from posttrain.models import core\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    found = problems(import_graph(root))
    assert "UP posttrain.models.core -> posttrain.training.trainer" in found
    assert "CIRCLE posttrain.models.core <-> posttrain.training.trainer" in found
    assert "CIRCLE posttrain.training.loop <-> posttrain.training.trainer" in found  # relative import resolved
    assert "CIRCLE posttrain.data.a <-> posttrain.data.b" in found
    assert any(p.startswith("UNRANKED posttrain.newpkg") for p in found)
    assert not any("posttrain.data.a <-> posttrain.data " in p or p.endswith("-> posttrain.data") for p in found)
    found = package_circles(import_graph(root))
    assert found == ["PACKAGES models <-> training: posttrain.models.core -> posttrain.training.trainer; "
                     "posttrain.training.trainer -> posttrain.models.core"]
    (root / "training" / "run.py").write_text("def f():\n    from posttrain.training.loop import _helper\n")
    assert private_imports(root) == ["PRIVATE posttrain.training.run imports posttrain.training.loop._helper"]


@pytest.mark.parametrize("mod, imports", [("posttrain.models.weights", "posttrain.training.optim"),
                                          ("posttrain.algorithms.preference", "posttrain.training.trainer")])
def test_each_former_upward_import_would_be_caught(mod, imports):
    graph = import_graph(PACKAGE)
    graph[mod] = graph[mod] | {imports}
    assert f"UP {mod} -> {imports}" in problems(graph)


# Function-local imports of posttrain's own modules hide the arrows between files; each one that stays says why
# with a `# lazy: ...` comment on its line or the line above (an import cycle, or a module kept light).
# cli/ is not checked: every subcommand imports inside `run` so that `posttrain --help` answers at once.
# Files exempt from the check (none today).
LOCAL_IMPORTS_ALLOWED: set[str] = set()


def unmarked_local_imports(root: Path, allowed=frozenset()) -> list[str]:
    """`path:line` of each function-local import of a posttrain module without a `# lazy:` comment (on its line,
    or alone on the line above)."""
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith("cli/") or rel in allowed:
            continue
        text = f.read_text()
        lines = text.splitlines()
        found = set()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    own = node.level > 0 or (node.module or "").split(".")[0] == "posttrain"
                elif isinstance(node, ast.Import):
                    own = any(a.name.split(".")[0] == "posttrain" for a in node.names)
                else:
                    continue
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                if own and "# lazy:" not in lines[node.lineno - 1] and not above.startswith("# lazy:"):
                    found.add(node.lineno)
        out += [f"{rel}:{n}" for n in sorted(found)]
    return out


def test_function_local_imports_of_posttrain_say_why_they_are_lazy():
    assert unmarked_local_imports(PACKAGE, LOCAL_IMPORTS_ALLOWED) == []
    assert all((PACKAGE / name).is_file() for name in LOCAL_IMPORTS_ALLOWED)


def test_the_check_finds_unmarked_local_imports(tmp_path):
    root = tmp_path / "posttrain"
    files = {
        "a.py": "import json\n\ndef f():\n    import numpy\n    from posttrain.b import g\n    return g\n",
        "b.py": ("def g():\n    # lazy: a imports this module\n    from posttrain import a\n"
                 "    from . import c  # lazy: c is heavy\n    import posttrain.c\n"),
        "c.py": "class C:\n    def m(self):\n        def inner():\n            from .a import f\n        return inner\n",
        "cli/main.py": "def run():\n    from posttrain.a import f\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert unmarked_local_imports(root) == ["a.py:5", "b.py:5", "c.py:4"]
    assert unmarked_local_imports(root, {"a.py", "c.py"}) == ["b.py:5"]
