"""The architecture of docs/architecture.md, checked on the sources.

Every import statement of the packages (module level, ``TYPE_CHECKING`` blocks and
function bodies alike) is read with ``ast`` and resolved to the module it names; then:

* layers only import downwards: ``zcomm_cuda`` < ``zcomm.quant`` < ``zcomm`` (collectives)
  < ``zero_runtime`` < ``bench``;
* ``zcomm_cuda`` is a leaf, imported only by the CUDA backend module of ``zcomm.quant``, and
  that module itself is imported by nothing (the backend registry loads it by name, lazily);
* across packages only public modules are imported (no ``_private`` module of another
  top-level package; inside a package its own internals are fair game, so the collectives
  may share ``zcomm.quant``'s leaf helpers such as ``_env``);
* no import cycles inside a package, ``TYPE_CHECKING``-only ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("zcomm_cuda", "zcomm", "zero_runtime", "bench")

# (module prefix, layer); the longest matching prefix wins
LAYERS = (("zcomm_cuda", 0), ("zcomm.quant", 1), ("zcomm", 2), ("zero_runtime", 3), ("bench", 4))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


SOURCES = _sources()


def _is_package(module: str) -> bool:
    return SOURCES[module].name == "__init__.py"


def _imports(module: str) -> list[str]:
    """The modules that ``module`` imports (``from pkg import name`` counts ``pkg.name`` where
    that is a module of ours, else ``pkg``)."""
    tree = ast.parse(SOURCES[module].read_text())
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.append(candidate if candidate in SOURCES else target)
    return [name for name in found if name.split(".")[0] in PACKAGES]


IMPORTS = {module: _imports(module) for module in SOURCES}


def _layer_of(module: str) -> int:
    best = None
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    assert best is not None, module
    return best[1]


def _package_of(module: str) -> str:
    return module.split(".")[0]


def test_the_sources_are_found():
    assert {"zcomm", "zcomm.quant", "zero_runtime", "zcomm_cuda", "bench"} <= set(SOURCES)


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_layers_only_import_downwards(module):
    upward = [name for name in IMPORTS[module] if _layer_of(name) > _layer_of(module)]
    assert not upward, f"{module} (layer {_layer_of(module)}) imports higher layers: {upward}"


def test_zcomm_cuda_is_a_leaf_imported_only_by_the_cuda_backend():
    # bench tools that read the kernels' sources without a GPU (bench.kernels --static) may import it too
    importers = sorted({m for m, names in IMPORTS.items() for n in names
                        if n.split(".")[0] == "zcomm_cuda" and not m.startswith(("zcomm_cuda", "bench."))})
    assert importers and all(m.startswith("zcomm.quant.backends") and "cuda" in m for m in importers), importers
    for module in importers:
        static = [m for m, names in IMPORTS.items() if module in names and not m.startswith("zcomm.quant.backends")]
        assert not static, f"{module} must be loaded lazily by the registry, but {static} import it"


def _is_private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_other_packages_internals_are_not_imported(module):
    own = _package_of(module)
    private = [name for name in IMPORTS[module] if _package_of(name) != own and _is_private(name)]
    assert not private, f"{module} imports internals of another package: {private}"


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles_inside_a_package(package):
    """Package ``__init__`` re-exports are left out: importing a package's submodule from
    inside it is how Python works, not a design cycle."""
    members = [m for m in SOURCES if m.split(".")[0] == package and not _is_package(m)]
    graph = {m: {n for n in IMPORTS[m] if n in members} for m in members}
    cycles = [c for m in members if (c := _cycle_from(m, graph))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_contract_modules_have_one_name():
    """Each package keeps its contracts in a module called ``_contract`` (none is ``_api``),
    so that a reader looks for them in one place."""
    assert [m for m in SOURCES if m.rsplit(".", 1)[-1] == "_api"] == []
    assert {"zcomm._contract", "zcomm.quant._contract", "zero_runtime._contract"} <= set(SOURCES)


def test_isort_knows_every_test_helper_imported_by_bare_name():
    """pyproject's known-first-party lists each helper module under tests/ (imported by bare name),
    so ruff sorts them with this repository's imports ([tool.ruff.lint.isort])."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["isort"]
                 ["known-first-party"])
    helpers = {path.stem for path in [*REPO.glob("tests/*.py"), *REPO.glob("tests/*/*.py")]
               if not path.stem.startswith("test_") and path.stem not in ("conftest", "__init__")}
    imported = {name for name in helpers if any(
        f"from {name} import" in text or f"import {name}\n" in text
        for text in (path.read_text() for path in REPO.glob("tests/**/test_*.py")))}
    assert imported - listed == set(), f"add to [tool.ruff.lint.isort] known-first-party: {sorted(imported - listed)}"


def test_test_files_have_unique_names():
    """pytest imports test files without packages by their base name: two of one name in different
    folders stop the whole suite's collection."""
    names = sorted(path.name for path in REPO.glob("tests/**/test_*.py"))
    assert not {name for name in names if names.count(name) > 1}
