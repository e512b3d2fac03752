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
stream bookkeeping); ``zero_fake_cuda_shim.cpp`` supplies no-op ones (it computes and
allocates nothing, see its header). It must be loaded before torch is imported, so the
cases run in a fresh interpreter: ``python tests/runtime/zero_fake_cuda.py SHIM OUT`` (SHIM is
``-`` on a machine with a usable CUDA build, which needs no shim), which writes one JSON
object with each case's observations or traceback to OUT. The runtime's sanctioned host
reads (``zero_runtime._host_sync.read_flag``) cannot run on fake tensors; a case that expects
them scripts their answers and counts them (``fake_cuda(flags=...)``).
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

SHIM_SOURCE = Path(__file__).with_name("zero_fake_cuda_shim.cpp")
FAKE_NCCL = "zero_fake_nccl"
WORLD, RANK = 2, 0


class ShimUnavailable(RuntimeError):
    """The shim cannot be built here (no C++ compiler, or it failed)."""


def build_shim(out_dir: Path) -> Path:
    """Compile the shim against the imported torch (call from a process that imported it)."""
    import torch
    from torch.utils import cpp_extension

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise ShimUnavailable(f"no C++ compiler (g++/c++) on PATH to build {SHIM_SOURCE}")
    out = out_dir / "zero_fake_cuda_shim.so"
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


def run_cases(shim: Path | None, out: Path, timeout: float) -> dict[str, Any]:
    """Run every case of ``zero_fake_cuda_cases`` in a fresh interpreter; their results by name."""
    here = Path(__file__).resolve()
    repo = here.parents[2]
    # The script's own folder comes first on sys.path (its cases and workloads live there).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(here), str(shim or "-"), str(out)],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode or not out.exists():
        raise RuntimeError(f"the fake-CUDA driver failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n"
                           f"{done.stderr[-8000:]}")
    return json.loads(out.read_text())


class HostReads:
    """Stands in for ``zero_runtime._host_sync.read_flag``: answers from a script, checks the
    flag it is asked about lives on the fake GPU, and counts the calls."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = list(answers)
        self.devices: list[str] = []

    def __call__(self, flag) -> bool:
        self.devices.append(str(flag.device))
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

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if func.namespace == "c10d" and any(t.device.type != "cuda" for t in inputs):
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
def fake_cuda(flags: list[bool] | None = None) -> Iterator[dict[str, Any]]:
    """Fake tensors and the device audit for the block. With ``flags``, ``read_flag`` answers
    them in order; without, it is left alone (any host read then raises). Yields a dict whose
    ``transfers``, ``host_collectives`` and ``host_reads`` (devices of the flags read) fill in
    as the block runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    probe: dict[str, Any] = {"host_reads": []}
    audit = _device_audit()
    with contextlib.ExitStack() as stack:
        if flags is not None:
            from zero_runtime import _host_sync

            reads = HostReads(flags)
            original = _host_sync.read_flag
            _host_sync.read_flag = reads
            stack.callback(setattr, _host_sync, "read_flag", original)
            probe["host_reads"] = reads.devices
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(audit)
        probe["transfers"] = audit.transfers
        probe["host_collectives"] = audit.host_collectives
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


def main(shim: str, out: str) -> None:
    if shim != "-":
        assert "torch" not in sys.modules, "the shim must be loaded before torch"
        ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _register_fake_nccl()
    dist.init_process_group(FAKE_NCCL, store=dist.HashStore(), rank=RANK, world_size=WORLD)
    import zero_fake_cuda_cases

    results = {name: _run(case) for name, case in zero_fake_cuda_cases.CASES.items()}
    Path(out).write_text(json.dumps(results))
    sys.stdout.flush()
    # The shim's autograd device thread is never joined; skip interpreter teardown.
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
