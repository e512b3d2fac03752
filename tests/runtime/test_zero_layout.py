"""The plan of ``zero_runtime`` itself: its sub-packages, public surface and import graph.

Read from the source with ``ast`` (nothing is imported but ``zcomm``, for its public names),
so a ``TYPE_CHECKING`` import or one inside a function counts like any other: such an
import hides a cycle in the design even when it cannot fail at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import zcomm
import zcomm.quant
import zcomm.quant.cpu_kernels

PACKAGE = Path(__file__).resolve().parents[2] / "zero_runtime"
# Public modules, by dotted name under zero_runtime ("__init__" is the package itself).
PUBLIC_MODULES = {"__init__", "config", "optimizer", "estimate", "lr_schedules", "activation_checkpointing",
                  "tiled_linear", "offload", "offload.cpu_adam", "offload.swap_file", "checkpoint", "checkpoint.export",
                  "comm"}
# The sub-packages named for a concern; their __init__ imports nothing (see test below).
CONCERNS = ("offload", "checkpoint", "comm")
# Public modules of zcomm the runtime may import names from, with the names they export.
ZCOMM_API = {"zcomm": set(zcomm.__all__), "zcomm.quant": set(zcomm.quant.__all__),
             "zcomm.quant.cpu_kernels": set(zcomm.quant.cpu_kernels.__all__)}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_name(path): ast.parse(path.read_text(), filename=str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _package_parts(name: str) -> list[str]:
    """The package a module's relative imports start from."""
    if name == "__init__":
        return []
    is_package = (PACKAGE / name.replace(".", "/") / "__init__.py").exists()
    return name.split(".") if is_package else name.split(".")[:-1]


def _runtime_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The runtime modules ``name`` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = _package_parts(name)
            anchor = base[: len(base) - node.level + 1]
            target = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{target}.{alias.name}" if target else alias.name
                found.add(candidate if candidate in known else (target or "__init__"))
        elif isinstance(node, ast.ImportFrom):
            assert not (node.module and node.module.split(".")[0] == "zero_runtime"), \
                f"{name}: absolute import of its own package ({node.module}); use a relative one"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] != "zero_runtime", f"{name} imports {alias.name}"
    return found - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _runtime_imports(name, tree, set(modules)) for name, tree in modules.items()}


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


def test_import_resolution_finds_sub_packages():
    graph = _graph()
    assert "offload._params" in graph["optimizer"] and "comm._plan" in graph["checkpoint._sharded"]
    assert graph["offload._optimizer"] >= {"offload._params", "offload.swap_file", "config", "_partition"}


def test_no_import_cycles_even_for_type_checking():
    """A package's ``__init__`` runs before any of its modules: an edge into ``config`` is an
    edge into ``config/__init__.py`` and counts like any other."""
    graph = _graph()
    assert all(target in graph for targets in graph.values() for target in targets), graph
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_contracts_import_no_implementation():
    assert _graph()["_contract"] == set()


def test_only_the_documented_modules_are_public():
    public = {name for name in _modules() if not any(part.startswith("_") for part in name.split("."))}
    assert public | {"__init__"} == PUBLIC_MODULES


def test_concern_packages_import_nothing():
    """So that reading one module of a sub-package (the configuration reads ``offload._config``)
    never loads the rest of it."""
    modules = _modules()
    for package in CONCERNS:
        body = modules[package].body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{package}/__init__.py is more than a docstring"



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


def test_every_config_field_has_its_docstring():
    """``ZeroConfig`` documents each field right below it (a string after the annotation)."""
    tree = _modules()["config._zero_config"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ZeroConfig")
    body = cls.body
    fields = [i for i, node in enumerate(body) if isinstance(node, ast.AnnAssign)]
    assert len(fields) > 25
    bare = [body[i].target.id for i in fields
            if not (i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and isinstance(body[i + 1].value, ast.Constant)
                    and isinstance(body[i + 1].value.value, str))]
    assert bare == []


def test_the_config_reader_does_not_build_configs():
    """The DeepSpeed JSON reader maps keys and refuses what DeepSpeed would not run; the typed
    config imports it, never the other way."""
    graph = _graph()
    assert "config._zero_config" not in graph["config._deepspeed_json"]
    assert "config._deepspeed_json" in graph["config._zero_config"]
