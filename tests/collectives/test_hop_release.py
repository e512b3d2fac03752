"""A CPU chain's hop tensors are kept while gloo holds them, and the exit waits for gloo to let go
([Note: hop release] in zcomm._hop_release).

gloo's worker thread may drop the last reference to a finished hop's ``Work`` after the
chain's ``wait()`` returned; releasing the hop's tensors then takes the GIL, and if the
interpreter is finalizing by then the process aborts (``std::terminate``). A stand-in
collective here plays gloo: it keeps C++ references to the hop's tensors (views, which hold
their base) after its ``wait()`` returned, and another thread drops them later. The chain's
handle completes at once; the tensors are kept until a later chain finds them let go; at
exit the process waits for them before it finalizes (checked in a subprocess, with the
release on a daemon thread, which the exit does not join). One real gloo hop checks the
counts zcomm reads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zcomm import _chain_runner, _hop_release
from zcomm._torch_compat import all_gather_single

REPO = Path(__file__).resolve().parents[2]


class _LateRelease:
    """A collective whose ``Work`` is done at once while "its thread" keeps C++ references to the tensors until
    :meth:`let_go`."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self.calls = 0

    def __call__(self, received: torch.Tensor, send: torch.Tensor, *, group: object, async_op: bool) -> object:
        assert async_op and group == "group"
        self.calls += 1
        self.kept += [received.view(-1), send.view(-1)]  # C++ references to both TensorImpls, as a gloo Work holds
        return _DoneWork()

    def let_go(self) -> None:
        self.kept.clear()


class _DoneWork:
    def wait(self) -> bool:
        return True


@pytest.fixture()
def worker(monkeypatch):
    monkeypatch.setattr(_hop_release, "_KEPT", [])
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


def _chain(collective, made: list, hops: int = 2, fail: bool = False):
    """A chain of ``hops`` hops through ``collective``; the weak references of its tensors go to ``made``."""

    def chain() -> None:
        send = torch.ones(16)
        made.append(weakref.ref(send))
        for _ in range(hops):
            received = torch.empty(16)
            made.append(weakref.ref(received))
            _hop_release.start_hop(collective, received, send, "group").wait()
            send = received
        if fail:
            raise ValueError("the chain failed")

    return chain


def _alive(made: list) -> int:
    return sum(ref() is not None for ref in made)


@pytest.mark.parametrize("async_op", (False, True))
def test_tensors_gloo_holds_are_kept_until_a_later_chain_finds_them_let_go(worker, async_op) -> None:
    late, made = _LateRelease(), []
    handle = _chain_runner.run_chain(_chain(late, made), [torch.empty(1)], async_op, worker)
    if handle is not None:
        handle.wait()  # completes with "gloo" still holding the tensors: nothing waits for it
    assert late.calls == 2 and len(_hop_release._KEPT) == 4 and _alive(made) == 3
    late.let_go()
    assert _alive(made) == 3  # kept by zcomm now, until a chain ends
    released, after = _LateRelease(), []
    _chain_runner.run_chain(_chain(released, after), [torch.empty(1)], False, worker)
    assert _hop_release._KEPT == [(t, b) for t, b in _hop_release._KEPT if t.numel() == 16]  # the new chain's
    assert _alive(made) == 0 and len(_hop_release._KEPT) == 4  # the first chain's dropped, the second's kept
    released.let_go()
    _chain_runner.run_chain(_chain(_LateRelease(), [], hops=0), [torch.empty(1)], False, worker)
    assert _hop_release._KEPT == [] and _alive(after) == 0
    assert worker.submit(lambda: list(_hop_release._CHAIN.hops)).result() == []


def test_tensors_let_go_before_the_chain_ends_are_not_kept(worker) -> None:
    made = []

    class Prompt(_LateRelease):
        def __call__(self, received, send, **kwargs):  # noqa: ANN001, ANN202 - lets go before the chain ends
            work = super().__call__(received, send, **kwargs)
            self.let_go()
            return work

    _chain_runner.run_chain(_chain(Prompt(), made), [torch.empty(1)], False, worker)
    assert _hop_release._KEPT == [] and _alive(made) == 0


def test_a_failed_chain_keeps_its_held_tensors_and_raises_its_error(worker) -> None:
    late, made = _LateRelease(), []
    with pytest.raises(ValueError, match="the chain failed"):
        _chain_runner.run_chain(_chain(late, made, fail=True), [torch.empty(1)], False, worker)
    assert len(_hop_release._KEPT) == 4 and worker.submit(lambda: list(_hop_release._CHAIN.hops)).result() == []
    late.let_go()


def test_the_exit_wait_returns_once_gloo_lets_go(worker) -> None:
    late, made = _LateRelease(), []
    _chain_runner.run_chain(_chain(late, made), [torch.empty(1)], False, worker)
    threading.Timer(0.2, late.let_go).start()
    started = time.monotonic()
    _hop_release._wait_for_gloo()
    assert time.monotonic() - started >= 0.15 and not late.kept
    assert _hop_release._KEPT == [] and _alive(made) == 0


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, threading, time
    import torch
    state = {"released": False}
    # registered before zcomm's handler, so it runs after it (atexit is last in, first out)
    atexit.register(lambda: print("released before the exit ended:", state["released"], flush=True))
    from concurrent.futures import ThreadPoolExecutor
    from zcomm import _chain_runner, _hop_release
    kept = []

    def collective(received, send, *, group, async_op):
        kept.extend([received.view(-1), send.view(-1)])
        return type("Done", (), {"wait": lambda self: True})()

    def let_go():
        time.sleep(0.3)
        state["released"] = True  # before the release: the exit wait may end, and print, the moment it happens
        kept.clear()

    def chain():
        _hop_release.start_hop(collective, torch.empty(8), torch.ones(8), "group").wait()

    _chain_runner.run_chain(chain, [torch.empty(1)], False, ThreadPoolExecutor(max_workers=1))
    threading.Thread(target=let_go, daemon=True).start()  # the exit does not join it, as it does not join gloo's
""")


def test_the_process_waits_at_exit_for_gloo_to_let_go(tmp_path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "released before the exit ended: True" in result.stdout, result.stdout + result.stderr


def test_a_real_gloo_hop_is_let_go_by_the_next_chain_end_or_the_exit_wait(gloo_world, worker) -> None:
    """On gloo the counts start_hop notes fall back once gloo has let go of the hop: a later chain's end or
    the exit wait leaves nothing kept."""
    made = []

    def chain() -> None:
        send, received = torch.ones(8), torch.empty(8)
        made.extend([weakref.ref(send), weakref.ref(received)])
        _hop_release.start_hop(all_gather_single, received, send, dist.group.WORLD).wait()

    for _ in range(20):
        _chain_runner.run_chain(chain, [torch.empty(1)], False, worker)
    # (Whether each kept tensor is still held cannot be asserted here: gloo may let go at any moment.)
    _hop_release._wait_for_gloo()
    assert _hop_release._KEPT == [] and _alive(made) == 0
