"""The dependency rule of docs/architecture.md, read from the imports of every file (ast, nothing imported):
eagle31 <- benchmarks <- experiments; the command lines over eagle31; no import circle inside eagle31.

An import inside a function counts like one at the top of the module, and so does one under
`if TYPE_CHECKING:`: a lazy or annotation-only import that closes a circle hides the circle at start-up,
not in the design."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the library may never import: the layers over it
OVER_THE_LIBRARY = ("benchmarks", "experiments", "scripts", "data_prep", "train", "tests", "eagle31_cli")
# the folders outside the library that use it through its public API only
CLIENTS = ("benchmarks", "experiments", "scripts", "data_prep", "train", "eagle31_cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


LIBRARY = {module_name(p): p for p in python_files("eagle31")}


def imported_names(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, the names taken from it, line) for every import of `path`, relative ones made absolute, wherever
    it sits (module top, a function, a branch, `if TYPE_CHECKING:`)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            out.append((module, [alias.name for alias in node.names], node.lineno))
    return out


def library_modules_imported(path: Path) -> set[str]:
    """The eagle31 modules `path` imports: `from pkg import submodule` is an edge to the submodule, `from
    module import name` to the module (a package's own __init__ runs for any of its submodules anyway)."""
    edges = set()
    for module, names, _ in imported_names(path):
        targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in LIBRARY]
        if len(targets) < len(names) or not names:  # some names are attributes of `module` itself
            targets.append(module)
        for target in targets:
            while target and target not in LIBRARY:  # `import eagle31.a.b` where b is not a module
                target = target.rpartition(".")[0]
            if target and target != module_name(path):
                edges.add(target)
    return edges


def test_the_files_are_found():
    assert {
        "eagle31.pipeline",
        "eagle31.eval.acceptance",
        "eagle31.kernels.causal",
        "eagle31.data.regenerate.pool",
    } <= set(LIBRARY)
    assert python_files("benchmarks") and python_files("experiments")


@pytest.mark.parametrize("folder, never", [("eagle31", OVER_THE_LIBRARY), ("benchmarks", ("experiments",))])
def test_imports_point_one_way(folder, never):
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {module}"
        for p in python_files(folder)
        for module, _, line in imported_names(p)
        if module.split(".")[0] in never
    ]
    assert not bad, bad


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the eagle31 module it is bound to: `import eagle31.io` binds `eagle31`, `import eagle31.io as
    x` binds `x` to eagle31.io, `from eagle31 import io` binds `io`."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "eagle31":
                    aliases[a.asname or "eagle31"] = a.name if a.asname else "eagle31"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "eagle31":
            aliases |= {
                a.asname or a.name: f"{node.module}.{a.name}"
                for a in node.names
                if f"{node.module}.{a.name}" in LIBRARY
            }
    return aliases


def private_attribute(chain: list[str], module: str) -> str | None:
    """The dotted use of `chain` (attributes read in order from `module`) up to its first private name, while it
    walks through eagle31 modules (`eagle31.io._unique_sibling`, `x._lock`), or None."""
    for name in chain:
        if is_private(name):
            return f"{module}.{name}"
        if f"{module}.{name}" not in LIBRARY:
            return None  # a name of the module, not a module: what lies beyond is that object's own
        module = f"{module}.{name}"
    return None


def private_uses(path: Path) -> list[str]:
    """Where `path` reaches a private name (`_x`, not a dunder) of eagle31: imported, or as an attribute of one of
    its modules, through a module path (`eagle31.io._x`) or a name bound to a module (`import eagle31.io as x`)."""
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for module, names, line in imported_names(path):
        if module.split(".")[0] != "eagle31":
            continue
        if any(is_private(part) for part in module.split(".")):
            bad.append(f"{line}: {module}")
        bad += [f"{line}: {module}.{n}" for n in names if is_private(n)]
    aliases = module_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            use = isinstance(base, ast.Name) and base.id in aliases and private_attribute(chain[::-1], aliases[base.id])
            if use:
                bad.append(f"{node.lineno}: {use}")
    return list(dict.fromkeys(bad))  # `a._b.c` and its inner `a._b` are one use


@pytest.mark.parametrize("folder", CLIENTS)
def test_the_layers_over_the_library_use_no_private_name_of_it(folder):
    bad = [f"{p.relative_to(ROOT)}:{use}" for p in python_files(folder) for use in private_uses(p)]
    assert not bad, bad


def test_a_private_name_is_found_through_a_module_path_or_a_module_alias(tmp_path, monkeypatch):
    client = tmp_path / "benchmarks" / "report.py"
    client.parent.mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    uses = {
        "import eagle31.io\neagle31.io._unique_sibling(p)\n": ["2: eagle31.io._unique_sibling"],
        "import eagle31.io as x\nx._unique_sibling(p).name\n": ["2: eagle31.io._unique_sibling"],
        "from eagle31 import io\nio._unique_sibling\n": ["2: eagle31.io._unique_sibling"],
        "import eagle31\neagle31.eval.acceptance._x\n": ["2: eagle31.eval.acceptance._x"],
        "from eagle31.io import _unique_sibling\n": ["1: eagle31.io._unique_sibling"],
        # public names of eagle31, and what an object of it holds, are not the library's private names
        "import eagle31.io\neagle31.io.atomic_dir(p)\neagle31.io.__name__\n": [],
        "import eagle31.config\neagle31.config.DrafterConfig._fields\n": [],
        "import os\nos.path._x\n": [],
    }
    for source, expected in uses.items():
        client.write_text(source)
        assert private_uses(client) == expected, source


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_the_library_modules():
    graph = {name: library_modules_imported(path) for name, path in LIBRARY.items()}
    assert any("eagle31.eval.acceptance" in edges for edges in graph.values())  # the graph is read at all
    assert not circles(graph), circles(graph)


def test_a_type_checking_import_is_an_edge(tmp_path, monkeypatch):
    module = tmp_path / "eagle31" / "m.py"
    module.parent.mkdir()
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eagle31.config import DrafterConfig\n"
        "def f():\n    from eagle31.loss import ttt_loss\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [m for m, _, _ in imported_names(module)] == ["typing", "eagle31.config", "eagle31.loss"]


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
