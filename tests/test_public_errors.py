"""One exception type per kind of misuse across the public API (single process, no group).

The kinds: a wrong type is a ``TypeError``, a wrong value (arguments or config) a
``ValueError``, a call in the wrong state or order (no process group yet, ``step()`` before
``backward()``) a ``RuntimeError``. Here: the state error every entry point shares, a missing
``torch.distributed`` process group, and the units ``MemoryReport`` prints.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import zcomm
import zero_runtime

_ENTRY_POINTS = {
    "all_gather_q8": lambda: zcomm.all_gather_q8(torch.empty(8), torch.empty(8)),
    "reduce_scatter_q4": lambda: zcomm.reduce_scatter_q4(torch.empty(8), torch.empty(8)),
    "all_reduce_q4": lambda: zcomm.all_reduce_q4(torch.empty(8)),
    "prepare_all_reduce_q4": lambda: zcomm.prepare_all_reduce_q4(torch.empty(8)),
    "initialize": lambda: zero_runtime.initialize(torch.nn.Linear(2, 2), functools.partial(torch.optim.SGD, lr=0.1),
                                                  {"zero_optimization": {"stage": 2}}),
    "Init": lambda: zero_runtime.Init().__enter__(),
}


@pytest.mark.parametrize("name", sorted(_ENTRY_POINTS))
def test_no_process_group_is_the_same_runtime_error_everywhere(name):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        _ENTRY_POINTS[name]()


def test_memory_report_prints_units():
    report = zero_runtime.MemoryReport(parameters=3 * 2**20, gradients=1024, optimizer_states=0,
                                       offloaded_optimizer_states=2**21)
    text = str(report)
    assert "model-state bytes" in text
    assert "parameters" in text and "3.000 MiB  (3,145,728 bytes)" in text
    assert "total" in text and f"({3 * 2**20 + 1024:,} bytes)" in text
    assert "offloaded_optimizer_states" in text and "2.000 MiB  (2,097,152 bytes)" in text
    assert len(text.splitlines()) == 1 + len(report._fields) + 1  # a header, every field and the total
