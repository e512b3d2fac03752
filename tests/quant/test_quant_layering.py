"""The quantization layer's imports: zcomm_cuda a leaf, backends loaded lazily, nothing from above.

* ``zcomm_cuda`` (the ``.cu`` sources and their loader) imports nothing from zcomm.
* Of the library's modules, only the cuda backend (``zcomm/quant/backends/cuda.py`` and its
  launch module ``_cuda_launch.py``) imports ``zcomm_cuda``; only the registry imports the
  backend modules, by name, when an op first runs them: ``import zcomm`` loads none of
  numba, cupy, zcomm_cuda or a backend.
* ``zcomm.quant`` imports nothing from the layers built on it (the collectives in ``zcomm``,
  ``zero_runtime``, ``bench``) but the one module listed in :data:`FROM_ABOVE`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from cuda_support import REPO

LIBRARY = ("zcomm", "zcomm_cuda", "zero_runtime", "bench")
CUDA_BACKEND = {"zcomm/quant/backends/cuda.py", "zcomm/quant/backends/_cuda_launch.py"}
# The cpu backend's thread share (ZCOMM_NUM_THREADS, torch's count) lives in zcomm/threads.py,
# beside the collectives; it is the one thing quant takes from above until it moves under quant.
FROM_ABOVE = {"zcomm.threads"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_zcomm_cuda_imports_nothing_from_zcomm():
    for path in _sources("zcomm_cuda"):
        assert not any(_within(name, "zcomm") for name in _imports(path)), path


def test_only_the_cuda_backend_imports_zcomm_cuda():
    importers = {
        str(path.relative_to(REPO))
        for package in LIBRARY
        if package != "zcomm_cuda"
        for path in _sources(package)
        if any(_within(name, "zcomm_cuda") for name in _imports(path))
    }
    assert importers == CUDA_BACKEND


def test_quant_imports_nothing_from_the_layers_above():
    above = []
    for path in _sources("zcomm/quant"):
        for name in _imports(path):
            higher = _within(name, "zcomm") and not _within(name, "zcomm.quant")
            allowed = any(_within(name, module) for module in FROM_ABOVE)
            if (higher or _within(name, "zero_runtime") or _within(name, "bench")) and not allowed:
                above.append((str(path.relative_to(REPO)), name))
    assert above == []


def test_import_zcomm_loads_no_backend():
    code = (
        "import sys, zcomm, zcomm.quant, zcomm.quant.ops, zcomm.quant.spec, zcomm.quant.wire_format\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'cupy', 'zcomm_cuda')"
        " or m.startswith('zcomm.quant.backends.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
