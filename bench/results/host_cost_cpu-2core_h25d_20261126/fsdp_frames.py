"""The Python frames of one call of zcomm.fsdp's comms on the calling thread (the second call of each).

Run as ``PYTHONPATH=<tree> python fsdp_frames.py`` on a tree to compare; a world of one rank (gloo).
"""

from __future__ import annotations

import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist

import zcomm
import zcomm.fsdp


def frames(call: Callable[[], object]) -> int:
    call()  # the first call prepares
    entered: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call":
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return len(entered)


def main() -> None:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    group = dist.group.WORLD
    topologies = zcomm.fsdp._GroupTopologies(group, zcomm.Topology(world_size=1, local_size=1))
    common = dict(quantized=True, group_size=None, module_name="unit", layout=None)
    gather, reduce = zcomm.fsdp.ZeroppAllGather(topologies, **common), zcomm.fsdp.ZeroppReduceScatter(topologies, **common)
    x, out = torch.randn(1024), torch.empty(1024)
    print("fsdp gather comm, caller frames:", frames(lambda: gather(out, x, group)))
    print("fsdp reduce comm PREMUL_SUM, caller frames:",
          frames(lambda: reduce(out, x, group, dist._make_nccl_premul_sum(0.5))))
    print("fsdp reduce comm AVG, caller frames:", frames(lambda: reduce(out, x, group, dist.ReduceOp.AVG)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
