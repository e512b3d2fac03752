"""The plan of ``zero_runtime`` itself: its public surface, its import graph, its notes.

Read from the source with ``ast`` (nothing is imported but ``zcomm``, for its public names),
so a ``TYPE_CHECKING`` import or one inside a function counts like any other: such an
import hides a cycle in the design even when it cannot fail at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import zcomm
import zcomm.quant
import zcomm.quant.cpu_kernels

PACKAGE = Path(__file__).resolve().parents[2] / "zero_runtime"
PUBLIC_MODULES = {"__init__", "config", "optimizer", "estimate", "lr_schedules", "export", "checkpointing", "cpu_adam",
                  "swap_file", "tiled_linear"}
# Public modules of zcomm the runtime may import names from, with the names they export.
ZCOMM_API = {"zcomm": set(zcomm.__all__), "zcomm.quant": set(zcomm.quant.__all__),
             "zcomm.quant.cpu_kernels": set(zcomm.quant.cpu_kernels.__all__)}
NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), filename=str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def _runtime_imports(name: str, tree: ast.Module) -> set[str]:
    """The runtime modules ``name`` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import _x
                found.update(alias.name for alias in node.names)
            elif node.level == 1:
                found.add(node.module.split(".")[0])
            elif node.module and node.module.split(".")[0] == "zero_runtime":
                assert False, f"{name}: absolute import of its own package ({node.module}); use a relative one"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] != "zero_runtime", f"{name} imports {alias.name}"
    return found - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles_even_for_type_checking():
    modules = _modules()
    graph = {name: _runtime_imports(name, tree) for name, tree in modules.items()}
    assert all(target in modules for targets in graph.values() for target in targets), graph
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_contracts_import_no_implementation():
    assert _runtime_imports("_api", _modules()["_api"]) == set()


def test_only_the_documented_modules_are_public():
    names = set(_modules())
    assert {name for name in names if not name.startswith("_")} | {"__init__"} == PUBLIC_MODULES


def test_init_only_re_exports():
    tree = _modules()["__init__"]
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body  # the docstring
    imported = set()
    for node in body:
        if isinstance(node, ast.ImportFrom):
            imported.update(alias.asname or alias.name for alias in node.names)
        else:
            assert isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"], ast.dump(node)
            exported = set(ast.literal_eval(node.value))
    assert exported == imported
    assert {"initialize", "ZeroConfig", "LossScaleConfig", "ZeroOptimizer", "MemoryReport"} <= exported


def test_zcomm_is_used_through_its_public_names_only():
    misuses = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0].startswith("zcomm"):
                allowed = ZCOMM_API.get(node.module, set())
                misuses += [f"{name}: from {node.module} import {a.name}" for a in node.names if a.name not in allowed]
            elif isinstance(node, ast.Import):
                misuses += [f"{name}: import {a.name}" for a in node.names
                            if a.name.startswith("zcomm") and a.name not in ZCOMM_API]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "zcomm":
                if node.attr not in ZCOMM_API["zcomm"]:
                    misuses.append(f"{name}: zcomm.{node.attr}")
    assert misuses == []


def test_note_names_are_unique_and_references_resolve():
    """A reference says "see [Note: name]"; any other [Note: name] is the note itself, and
    opens its line (of a docstring or a comment)."""
    defined: dict[str, str] = {}
    referenced: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE.glob("*.py")):
        text = path.read_text()
        for match in NOTE.finditer(text):
            note, before = " ".join(match.group(1).split()), text[:match.start()]
            if before.rstrip().lower().endswith("see"):
                referenced.add((note, path.name))
                continue
            assert before[before.rfind("\n") + 1:].strip(" #") == "", f"{path.name}: [Note: {note}] is mid-line"
            assert note not in defined, f"[Note: {note}] is defined in {defined[note]} and {path.name}"
            defined[note] = path.name
    assert len(defined) > 10, "too few notes found: the pattern is broken"
    dangling = sorted(f"{where}: [Note: {note}]" for note, where in referenced if note not in defined)
    assert dangling == []
