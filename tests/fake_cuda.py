"""A fake CUDA machine on which the runtime's device discipline is checked without a GPU.

[Note: fake CUDA] Three layers, each of which turns a class of GPU-only failure into an
error on a CPU machine:

* ``FakeTensorMode`` makes every tensor a fake one (shape, dtype, device; no data). A
  model built under it on ``cuda`` has fake CUDA parameters, so everything the runtime
  derives from them is fake CUDA too. Mixing a CPU tensor (other than a 0-dim scalar, which
  CUDA accepts too) with a CUDA one raises ``FakeTensorDeviceMismatchError``, and every host
  read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``) raises, since there is no value.
* The process group is torch's ``FakeProcessGroup`` registered as a backend for ``cuda``
  only (``FAKE_NCCL``), as NCCL is, so ``initialize`` sees an NCCL-like group. It moves no
  data. Under ``FakeTensorMode`` collectives never reach it (the mode answers them itself),
  so the device check of a collective's tensors is the audit's:
* ``DeviceAudit`` records every operator that takes a CUDA tensor and returns a CPU one (a
  device-to-host copy such as ``.cpu()``, which a fake tensor would otherwise allow), and
  every collective (``c10d`` operator) given a tensor that is not on CUDA: inside
  ``fake_cuda`` every group is a ``FAKE_NCCL`` group, on which NCCL would refuse it.

A CPU-only build of torch lacks two C++ pieces fake CUDA tensors need on their way through
torch (a CUDA device guard for the Python bindings and CUDA hooks for the autograd engine's
stream bookkeeping); ``fake_cuda_shim.cpp`` supplies no-op ones (it computes and
allocates nothing, see its header). It must be loaded before torch is imported, so the
cases run in a fresh interpreter: ``python tests/fake_cuda.py SHIM OUT CASES``
(SHIM is ``-`` on a machine with a usable CUDA build, which needs no shim; CASES names a
module whose ``CASES``, ``WORLD`` and ``RANK`` say what to run, in which world, as which
rank), which writes one JSON object with each case's observations or traceback to OUT.
The runtime's sanctioned host reads (``zero_runtime._host_sync``) cannot run on fake
tensors; a case that expects them scripts their answers and counts them
(``fake_cuda(flags=...)``).

[Note: fake CUDA streams] With the shim, ``torch.cuda``'s Python stream API (``Stream``,
``Event``, ``current_stream``, ``set_stream``, ``stream``, the current device and its
capability) and CUDA futures (``torch.futures.Future(devices=...)``) do not exist either;
``fake_cuda`` stands in for them with objects that order nothing (events are always
complete) and records the devices they are asked for, so the asynchronous paths (zcomm's
side streams, the DDP hook) run their code as on a GPU. What they would order on a GPU is not checked here:
stream ordering needs a GPU (``make gpu-check``). zcomm's quantization runs on its
``reference`` backend (``ZCOMM_BACKEND``): the ``cuda`` backend's kernels need a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

SHIM_SOURCE = Path(__file__).with_name("fake_cuda_shim.cpp")
FAKE_NCCL = "zero_fake_nccl"


class ShimUnavailable(RuntimeError):
    """The shim cannot be built here (no C++ compiler, or it failed)."""


def build_shim(out_dir: Path) -> Path:
    """Compile the shim against the imported torch (call from a process that imported it)."""
    import torch
    from torch.utils import cpp_extension

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise ShimUnavailable(f"no C++ compiler (g++/c++) on PATH to build {SHIM_SOURCE}")
    out = out_dir / "fake_cuda_shim.so"
    command = [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *[f"-I{path}" for path in cpp_extension.include_paths()], str(SHIM_SOURCE),
               *[f"-L{path}" for path in cpp_extension.library_paths()],
               *[f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths()],
               "-lc10", "-ltorch_cpu", "-o", str(out)]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode:
        raise ShimUnavailable(f"building the fake CUDA shim failed:\n{built.stderr[-4000:]}")
    return out


def run_cases(shim: Path | None, out: Path, timeout: float, cases: str = "zero_fake_cuda_cases") -> dict[str, Any]:
    """Run every case of the module ``cases`` (importable from tests/ or its folders) in a fresh
    interpreter; their results by name."""
    here = Path(__file__).resolve()
    repo = here.parents[1]
    # The cases and the helpers they import live in tests/ and its folders, as pytest finds them.
    tests = repo / "tests"
    folders = sorted(str(p) for p in tests.iterdir() if p.is_dir() and not p.name.startswith("_"))
    path = [str(repo), str(tests), *folders, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "ZCOMM_BACKEND": "reference"}
    done = subprocess.run([sys.executable, str(here), str(shim or "-"), str(out), cases],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode or not out.exists():
        raise RuntimeError(f"the fake-CUDA driver failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n"
                           f"{done.stderr[-8000:]}")
    return json.loads(out.read_text())


_BUILT: dict[str, Path] = {}  # the shim, built into the first caller's folder (pytest keeps it for the session)


def run_on_fake_machine(root: Path, cases: str, timeout: float = 900) -> dict[str, Any]:
    """The results of ``run_cases`` for the module ``cases``, the shim built into ``root`` where
    torch is a CPU build; skips (pytest) where the fake machine cannot run."""
    import pytest
    import torch

    if torch.version.hip is not None:
        pytest.skip("a ROCm build of torch: the fake CUDA machine is built for CUDA and CPU-only builds")
    shim = None  # a real CUDA runtime carries fake CUDA tensors by itself
    if torch.version.cuda is None:
        try:
            if "shim" not in _BUILT:  # once per process
                _BUILT["shim"] = build_shim(root)
            shim = _BUILT["shim"]
        except ShimUnavailable as err:
            pytest.skip(f"the fake CUDA machine cannot be built here: {err}")
    elif not torch.cuda.is_available():
        pytest.skip("a CUDA build of torch without a usable GPU: neither the shim (CPU-only builds) nor a "
                    "real CUDA runtime can carry fake CUDA tensors through autograd")
    return run_cases(shim, root / "results.json", timeout=timeout, cases=cases)


def case_ok(results: dict[str, Any], name: str) -> dict[str, Any]:
    """The observations of the case ``name``, failing the test with its traceback if it raised."""
    case = results[name]
    assert case["error"] is None, f"case {name} failed:\n{case['error']}"
    return case


class HostReads:
    """Stands in for ``zero_runtime._host_sync``'s reads: answers from a script, records the
    device of each value it is asked about, and counts the calls."""

    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.devices: list[str] = []

    def __call__(self, value):
        self.devices.append(str(value.device))
        assert self.answers, "the runtime read a device value on the host more often than the case expects"
        return self.answers.pop(0)


def _device_audit():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class DeviceAudit(TorchDispatchMode):
        """Records copies from the GPU to the host, and collectives on tensors off the GPU."""

        def __init__(self) -> None:
            super().__init__()
            self.transfers: list[str] = []
            self.host_collectives: list[str] = []
            self.collectives: list[str] = []  # the name of every collective seen, in order

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if func.namespace == "c10d":
                self.collectives.append(func.__name__)
                if any(t.device.type != "cuda" for t in inputs):
                    self.host_collectives.append(f"{func} on {_devices(inputs)}")
            result = func(*args, **(kwargs or {}))
            outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cuda" for t in inputs) and any(t.device.type == "cpu" for t in outputs):
                self.transfers.append(f"{func}: {_devices(inputs)} -> {_devices(outputs)}")
            return result

    return DeviceAudit()


def _devices(tensors) -> str:
    return ",".join(sorted({str(t.device) for t in tensors}))


@contextlib.contextmanager
def fake_cuda(flags: list | None = None) -> Iterator[dict[str, Any]]:
    """Fake tensors and the device audit for the block. With ``flags``, the runtime's host
    reads (``_host_sync.read_flag`` and ``read_counts``) answer them in order; without, they
    are left alone (any host read then raises). Yields a dict whose ``transfers``,
    ``host_collectives``, ``collectives`` (each ``c10d`` operator's name, in order),
    ``host_reads`` (devices of the values read) and ``streams`` ([Note: fake CUDA streams])
    fill in as the block runs."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    probe: dict[str, Any] = {"host_reads": [], "streams": []}
    audit = _device_audit()
    with contextlib.ExitStack() as stack:
        if flags is not None:
            from zero_runtime import _host_sync

            reads = HostReads(flags)
            for name in ("read_flag", "read_counts"):
                stack.callback(setattr, _host_sync, name, getattr(_host_sync, name))
                setattr(_host_sync, name, reads)
            probe["host_reads"] = reads.devices
        if torch.version.cuda is None:
            from fake_cuda_streams import stand_in_for_cuda_streams

            stack.enter_context(stand_in_for_cuda_streams(probe["streams"]))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(audit)
        probe["transfers"] = audit.transfers
        probe["host_collectives"] = audit.host_collectives
        probe["collectives"] = audit.collectives
        yield probe


def _register_fake_nccl() -> None:
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common, _backend_options):
        options = FakeProcessGroup.Options()
        options._timeout = common.timeout
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)

    dist.Backend.register_backend(FAKE_NCCL, create, extended_api=True, devices=["cuda"])


def _run(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return {"error": None, **case()}
    except BaseException:
        return {"error": traceback.format_exc()}


def main(shim: str, out: str, cases: str) -> None:
    if shim != "-":
        assert "torch" not in sys.modules, "the shim must be loaded before torch"
        ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _register_fake_nccl()
    module = importlib.import_module(cases)
    dist.init_process_group(FAKE_NCCL, store=dist.HashStore(), rank=module.RANK, world_size=module.WORLD)
    results = {name: _run(case) for name, case in module.CASES.items()}
    Path(out).write_text(json.dumps(results))
    sys.stdout.flush()
    # The shim's autograd device thread is never joined; skip interpreter teardown.
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
