"""The host work of a training step, counted in Python function calls, per configuration.

At world size 1 on a GPU a step is host-bound, so what qwZ and qgZ add to stage 3 is the
Python work their collectives do per unit and per bucket. Counted here (deterministic on any
machine) on a model of many small Linear layers, each its own stage-3 unit and gradient
bucket (as the Linear layers of the 160M GPT are with the runtime's defaults; the shape of
``bench.host_cost --runtime``):

* on the training thread, a qwZ or qgZ step enters no more Python functions than a stage-3
  step: the runtime holds zcomm's prepared calls (no prologue, plan look-up or spec per call);
* on zcomm's CPU worker, each quantized collective's chain (on CUDA it runs on the training
  thread) enters a bounded number of zcomm functions per unit or bucket.

Each bound is today's count with a little slack; a change that adds work per unit must raise
it on purpose. Timing is ``bench.host_cost --runtime``'s job.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zcomm
import zero_runtime
from zero_workloads import make_optimizer

ZCOMM_DIR = str(Path(zcomm.__file__).resolve().parent) + os.sep

LAYERS, WIDTH = 8, 16
HOST_BOUND = {"zcomm_stage3_fuse_numel": 0, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1}
CONFIGS = {
    "zero3": {},
    "zero3+qwz": {"zero_quantized_weights": True},
    "zero3+qgz": {"zero_quantized_gradients": True},
    "zeropp": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
}
# zcomm's functions (files of the zcomm package) on the worker, per collective call (today: 12 per
# gather, 19 per bucket)
MAX_CHAIN_CALLS = {"gather": 16, "reduce": 24}
OPS = {"gather": "all_gather_q8", "reduce": "reduce_scatter_q4"}  # comm_stats' names
# resolved once per unit or bucket, never per step (the plain collectives of zero3 run zcomm's prologue
# per call: in zeropp, where every collective of the step is quantized, none may run)
ONCE = ("prepare_all_gather_q8", "prepare_reduce_scatter_q4_coalesced", "_make_plan", "_plan_of_call", "plan_kernels",
        "group_size_for", "__post_init__")
PROLOGUE = ("prologue", "prologue_coalesced", "_check_tensors", "resolve_group")


class _Counter:
    """Python "call" events per (thread, file:function) while ``on``; installed in this thread and
    in threads started later (zcomm's worker starts at the first collective of a new group)."""

    def __init__(self) -> None:
        self.on = False
        self.done = False
        self.main = threading.get_ident()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.zcomm_on_worker = 0  # calls of functions of the zcomm package on the worker
        self.collectives: dict[str, int] = {}  # zcomm's collective calls in the step, by comm_stats' name

    def __call__(self, frame, event, arg) -> None:
        if self.done:
            sys.setprofile(None)
            return
        if self.on and event == "call":
            thread = "main" if threading.get_ident() == self.main else "worker"
            code = frame.f_code
            self.calls[(thread, f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")] += 1
            self.zcomm_on_worker += thread == "worker" and ZCOMM_DIR in code.co_filename


def _step_calls(zero: dict) -> collections.Counter[tuple[str, str]]:
    """The calls of one training step after two warm-up steps, with ``zero`` on the host-bound shape."""
    counter = _Counter()
    sys.setprofile(counter)
    threading.setprofile(counter)
    try:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        torch.manual_seed(0)
        layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
        model, opt = zero_runtime.initialize(torch.nn.Sequential(*layers), make_optimizer(),
                                             {"zero_optimization": {"stage": 3, **HOST_BOUND, **zero}})
        x = torch.randn(2, WIDTH)
        for step in range(3):
            zcomm.reset_comm_stats()
            counter.on = step == 2
            opt.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
            counter.on = False
        counter.collectives = {op: stats.calls for op, stats in zcomm.comm_stats().items()}
        opt.close()
    finally:
        counter.done = True
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        dist.destroy_process_group()
    return counter


@pytest.fixture(scope="module")
def counters() -> dict[str, _Counter]:
    return {name: _step_calls(zero) for name, zero in CONFIGS.items()}


@pytest.fixture(scope="module")
def calls(counters) -> dict[str, collections.Counter[tuple[str, str]]]:
    return {name: counter.calls for name, counter in counters.items()}


def _total(counts: collections.Counter[tuple[str, str]], thread: str, files: tuple[str, ...] = ()) -> int:
    return sum(n for (t, fn), n in counts.items() if t == thread and (not files or fn.startswith(files)))


@pytest.mark.parametrize("name", ["zero3+qwz", "zero3+qgz", "zeropp"])
def test_quantized_steps_add_no_calls_on_the_training_thread(calls, name):
    main, base = _total(calls[name], "main"), _total(calls["zero3"], "main")
    extra = {fn: n - calls["zero3"].get(("main", fn), 0) for (t, fn), n in calls[name].items()
             if t == "main" and n > calls["zero3"].get(("main", fn), 0)}
    assert main <= base, f"{name}: {main} calls per step on the training thread, zero3 {base}; beyond zero3: {extra}"
    once = ONCE + PROLOGUE if name == "zeropp" else ONCE
    assert not [fn for (t, fn) in calls[name] if fn.rsplit(":", 1)[1] in once], "resolved per step, not once"


@pytest.mark.parametrize("name, kind", [("zero3+qwz", "gather"), ("zero3+qgz", "reduce")])
def test_each_quantized_chain_enters_a_bounded_number_of_functions(counters, name, kind):
    """Counted by what the step did (comm_stats' calls, zcomm's files), not by the names of the
    functions that run a chain."""
    counter = counters[name]
    chains = counter.collectives.get(OPS[kind], 0)
    assert chains == LAYERS, f"{counter.collectives}: one {kind} per unit or bucket expected"
    per_chain = counter.zcomm_on_worker / chains
    listing = sorted((n, fn) for (t, fn), n in counter.calls.items() if t == "worker")
    assert per_chain <= MAX_CHAIN_CALLS[kind], f"{per_chain} zcomm calls per {kind} chain: {listing}"


def test_stage3_gathers_and_reduces_once_per_unit(calls):
    """The shape is what the bounds assume: one forward gather and one bucket per Linear."""
    counts = calls["zero3"]
    assert counts[("main", "_plain.py:__call__")] == 2 * LAYERS


def test_stage3_step_stays_within_its_calls(calls):
    """Stage 3's own host path, which every configuration runs: 1496 calls per step today (torch's
    module calls and AdamW included), 1652 while parameters and trace positions were looked up by
    Python-level hashes, every module output went through a pytree walk and the optimizer step read
    its properties per unit."""
    main = _total(calls["zero3"], "main")
    assert main <= 1550, f"{main} calls per step on the training thread: {calls['zero3'].most_common(30)}"
