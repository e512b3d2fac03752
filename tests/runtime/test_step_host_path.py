"""The host work of a training step, counted in Python function calls, per configuration.

At world size 1 on a GPU a step is host-bound, so what qwZ and qgZ add to stage 3 is the
Python work their collectives do per unit and per bucket. Counted here (deterministic on any
machine) on a model of many small Linear layers, each its own stage-3 unit and gradient
bucket (as the Linear layers of the 160M GPT are with the runtime's defaults; the shape of
``bench.runtime_host_cost``):

* on the training thread, a qwZ or qgZ step enters no more Python functions than a stage-3
  step: the runtime holds zcomm's prepared calls (no prologue, plan look-up or spec per call);
* on zcomm's CPU worker, each quantized collective's chain (on CUDA it runs on the training
  thread) enters a bounded number of zcomm functions per unit or bucket.

Each bound is today's count with a little slack; a change that adds work per unit must raise
it on purpose. Timing is ``bench.runtime_host_cost``'s job.
"""

from __future__ import annotations

import collections
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import zero_runtime
from zero_workloads import make_optimizer

LAYERS, WIDTH = 8, 16
HOST_BOUND = {"zcomm_stage3_fuse_numel": 0, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1}
CONFIGS = {
    "zero3": {},
    "zero3+qwz": {"zero_quantized_weights": True},
    "zero3+qgz": {"zero_quantized_gradients": True},
    "zeropp": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
}
# zcomm's chain functions on the worker, per collective call (today: 10 per gather, 18 per bucket)
CHAIN_FILES = ("all_gather_q8.py", "reduce_scatter_q4.py", "cpu.py", "_cpu_float_bits.py", "topology.py")
MAX_CHAIN_CALLS = {"gather": 14, "reduce": 20}
# resolved once per unit or bucket, never per step (the plain collectives of zero3 run zcomm's prologue
# per call: in zeropp, where every collective of the step is quantized, none may run)
ONCE = ("prepare_all_gather_q8", "prepare_reduce_scatter_q4_coalesced", "_make_plan", "_make_shape", "cached_plan",
        "group_size_for", "__post_init__")
PROLOGUE = ("prologue", "prologue_once", "prologue_coalesced", "_check_tensors", "resolve_group")


class _Counter:
    """Python "call" events per (thread, file:function) while ``on``; installed in this thread and
    in threads started later (zcomm's worker starts at the first collective of a new group)."""

    def __init__(self) -> None:
        self.on = False
        self.done = False
        self.main = threading.get_ident()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if self.done:
            sys.setprofile(None)
            return
        if self.on and event == "call":
            thread = "main" if threading.get_ident() == self.main else "worker"
            code = frame.f_code
            self.calls[(thread, f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")] += 1


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
            counter.on = step == 2
            opt.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
            counter.on = False
        opt.close()
    finally:
        counter.done = True
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        dist.destroy_process_group()
    return counter.calls


@pytest.fixture(scope="module")
def calls() -> dict[str, collections.Counter[tuple[str, str]]]:
    return {name: _step_calls(zero) for name, zero in CONFIGS.items()}


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


@pytest.mark.parametrize("name, kind, entry", [("zero3+qwz", "gather", "all_gather_q8.py:_chain"),
                                               ("zero3+qgz", "reduce", "reduce_scatter_q4.py:_chain")])
def test_each_quantized_chain_enters_a_bounded_number_of_functions(calls, name, kind, entry):
    chains = calls[name][("worker", entry)]
    assert chains == LAYERS, f"{chains} {kind} chains per step, one per unit or bucket expected"
    per_chain = _total(calls[name], "worker", CHAIN_FILES) / chains
    listing = sorted((n, fn) for (t, fn), n in calls[name].items() if t == "worker")
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
