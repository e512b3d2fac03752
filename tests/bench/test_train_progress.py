"""bench.train's progress line and its rows for engines that raise (no training run)."""

import io

import torch

from bench.train.configs import CONFIGS
from bench.train.runner import EngineFailed
from bench.train.suite import StepProgress, failed_row


class _Clock:
    def __init__(self, times):
        self.times = iter(times)

    def __call__(self):
        return next(self.times)


def test_log_gets_the_first_step_each_quarter_and_the_last_with_time_and_estimate():
    stream = io.StringIO()
    # constructed at t=0; step k ends at t = 2 + k (1 s per step after 2 s of construction and a first step)
    progress = StepProgress("tinygpt: zeropp", 8, stream=stream, clock=_Clock([0.0, *(2.0 + k for k in range(1, 9))]))
    for step in range(1, 9):
        progress(step)
    assert stream.getvalue().splitlines() == [
        "[bench.train] tinygpt: zeropp: step 1 of 8, 3.0 s so far, estimating",
        "[bench.train] tinygpt: zeropp: step 2 of 8, 4.0 s so far, ~6 s left",
        "[bench.train] tinygpt: zeropp: step 4 of 8, 6.0 s so far, ~4 s left",
        "[bench.train] tinygpt: zeropp: step 6 of 8, 8.0 s so far, ~2 s left",
        "[bench.train] tinygpt: zeropp: step 8 of 8, 10.0 s so far, ~0 s left",
    ]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_line_is_rewritten_in_place_and_ends_after_the_last_step():
    stream = _Terminal()
    progress = StepProgress("m: c", 3, stream=stream, clock=_Clock([0.0, 1.0, 2.0, 3.0]))
    for step in range(1, 4):
        progress(step)
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("~0 s left\033[K\n")


def _failure():
    try:
        try:
            raise ValueError("This op had not been implemented on CPU backend.\nmore detail")
        except ValueError as error:
            raise EngineFailed("deepspeed.initialize raised ValueError: ... (at no_impl.py:21)") from error
    except EngineFailed as failure:
        return failure


def test_deepspeed_zeropp_on_a_cpu_is_an_expected_failure_with_its_reason_once():
    row = failed_row(CONFIGS["deepspeed-zeropp"], "tinygpt", _failure(), torch.device("cpu"))
    assert row.status == "expected failure"
    assert row.note == ("DeepSpeed's ZeRO++ quantizer is CUDA-only, it has no CPU build (it raised ValueError: "
                        "This op had not been implemented on CPU backend.)")


def test_other_failures_and_gpu_failures_keep_the_whole_description():
    for config, device in (("deepspeed-z3", "cpu"), ("deepspeed-zeropp", "cuda")):
        row = failed_row(CONFIGS[config], "tinygpt", _failure(), torch.device(device))
        assert row.status == "failed" and row.note.endswith("(at no_impl.py:21)")
