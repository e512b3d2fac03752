"""bench.host_cost --launch-stand-in on CPU: both launchers timed with their stand-ins, every column measured.

A smoke run with a few calls per round; the numbers are not checked beyond being measured,
and the loader is left as it was (its lookups restored, the launcher unchanged).
"""

from __future__ import annotations

import shutil

import pytest

from bench.host_cost import launch as launch_cost
from zcomm_cuda import loader

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="bench.host_cost --launch-stand-in compiles its no-op cuLaunchKernelEx with cc")


def test_every_kernel_row_is_measured_and_the_loader_restored(capsys) -> None:
    before = {name: getattr(loader, name) for name in ("_DRIVER_KERNELS", "kernel", "current_raw_stream",
                                                       "_current_device", "_STREAMS", "_use_driver")}
    assert launch_cost.main(["--calls", "20"]) == 0
    out = capsys.readouterr().out
    rows = launch_cost.measure(20)
    assert [row["kernel"] for row in rows] == list(launch_cost.CASES)
    for row in rows:
        assert all(row[column] > 0 for column in ("cupy us", "driver us", "pack us", "ctypes call us",
                                                        "11-argument call us")), row
        assert row["kernel"] in out
    assert {name: getattr(loader, name) for name in before} == before



def test_the_one_entry_point_runs_each_mode(capsys):
    from bench import host_cost

    assert host_cost.main(["--launch-stand-in", "--calls", "5"]) == 0
    assert capsys.readouterr().out.startswith("# launch cost, Python side, no GPU")
    with pytest.raises(SystemExit, match="two modes"):
        host_cost.main(["--runtime", "--launch-stand-in"])
