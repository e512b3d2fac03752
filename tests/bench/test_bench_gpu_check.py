"""``make gpu-check`` on a CPU machine: refuses at once, and its parts behave as documented.

The stages themselves need a GPU; here they are replaced by small commands to check the
runner (limits, killing, missing modules, the budget), the verifiers, the report and the
skip-to-failure hook of ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

from bench.collectives import cli as collectives_cli
from bench.collectives.catalog import ALL_OPS
from bench.gpu_check import driver, report, stages, test_runner, w4
from bench.harness.checkout import REPO

PY = sys.executable


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_at_once_saying_so(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.monotonic()
    done = subprocess.run([PY, "-m", "bench.gpu_check", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == driver.EXIT_NO_GPU, done.stdout + done.stderr
    assert "no CUDA GPU" in done.stderr and "Nothing was run" in done.stderr
    assert time.monotonic() - start < 60
    assert not out.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_make_target_needs_no_venv(tmp_path):
    venv = tmp_path / "venv"
    argv = ["make", "-C", str(REPO), "gpu-check", f"GPU_PYTHON={PY}", f"VENV={venv}", f"GPU_CHECK_ARGS=--out {tmp_path / 'r'}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no CUDA GPU" in done.stderr
    assert not venv.exists()  # the target does not depend on the venv's stamp


def _stage(name: str, code: str, **kwargs) -> stages.Stage:
    return stages.Stage(name=name, title=f"{name} title", argv=(PY, "-c", code), limit_s=kwargs.pop("limit_s", 60), **kwargs)


def _far() -> float:
    return time.monotonic() + 300


def test_a_stage_passes_and_runs_from_the_checkout_with_a_clean_environment(tmp_path):
    code = "import os, sys; print(os.getcwd()); print(sys.path[1]); print(os.environ.get('ZCOMM_BACKEND')); print(os.environ['X'])"
    base = dict(os.environ, ZCOMM_BACKEND="reference", PYTHONPATH="/elsewhere")
    result = stages.run_stage(_stage("ok", code, env={"X": "given"}), tmp_path, _far(), base)
    assert result.passed and result.returncode == 0 and result.problems == ()
    lines = result.log.read_text().splitlines()
    assert lines[0].startswith(f"$ {PY} -c")
    assert lines[1:] == [str(REPO), str(REPO), "None", "given"]


def test_a_failing_command_or_failed_verification_fails_the_stage(tmp_path):
    failed = stages.run_stage(_stage("bad", "raise SystemExit(3)"), tmp_path, _far())
    assert (failed.status, failed.returncode, failed.problems) == ("failed", 3, ("exited with status 3",))
    unverified = stages.run_stage(_stage("unverified", "pass", verify=lambda out: [f"looked in {out.name}"]), tmp_path, _far())
    assert unverified.status == "failed" and unverified.problems == (f"looked in {tmp_path.name}",)
    missing = stages.run_stage(_stage("partial", "pass", missing=("tests/x.py is missing",)), tmp_path, _far())
    assert missing.status == "failed" and missing.problems == ("tests/x.py is missing",)


def test_a_stage_that_overruns_is_killed_with_its_children(tmp_path):
    code = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print(child.pid, flush=True); time.sleep(120)")  # fmt: skip
    start = time.monotonic()
    result = stages.run_stage(_stage("slow", code, limit_s=3), tmp_path, _far())
    assert result.status == "timed out" and "3 s limit" in result.problems[0]
    assert time.monotonic() - start < 30
    child = int(result.log.read_text().splitlines()[1])
    time.sleep(0.5)
    status = Path(f"/proc/{child}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_the_total_budget_caps_a_stage(tmp_path):
    result = stages.run_stage(_stage("late", "pass"), tmp_path, time.monotonic() + 0.5)
    assert result.status == "not run" and "budget" in result.problems[0]
    capped = stages.run_stage(_stage("capped", "import time; time.sleep(60)", limit_s=100), tmp_path, time.monotonic() + 2)
    assert capped.status == "timed out" and capped.seconds < 20


def test_a_stage_whose_modules_are_missing_fails_without_running(tmp_path):
    result = stages.run_stage(_stage("needy", "raise SystemExit(9)", needs=("json", "no_such_module_zcomm")), tmp_path, _far())
    assert result.status == "failed" and result.returncode is None
    assert "no_such_module_zcomm" in result.problems[0] and "installs nothing" in result.problems[0]
    assert "no_such_module_zcomm" in result.log.read_text()


def test_the_plan_fits_the_budget_and_names_missing_test_files(tmp_path, monkeypatch):
    monkeypatch.setattr(stages, "CUDA_TESTS", (*stages.CUDA_TESTS[:1], "tests/test_not_there.py"))
    plan = stages.plan(tmp_path, gpus=1)
    assert [s.name for s in plan] == ["cuda-tests", "w4", "collectives", "nccl", "driver-launcher"]
    assert sum(s.limit_s for s in plan if s.skip is None) + 15 <= stages.budget(1) <= 315
    several = stages.plan(tmp_path, gpus=2)
    assert sum(s.limit_s for s in several) + 15 <= stages.budget(2) <= 485 - 15  # gpu_lease.sh's hard limit
    tests = plan[0]
    assert tests.env == {stages.GPU_CHECK_ENV: "1", "ZCOMM_CUDA_DEVICE_CHECKS": "1"}
    assert all(s.env.get("ZCOMM_CUDA_DEVICE_CHECKS") == "1" for s in plan)
    assert "tests/test_not_there.py" not in tests.argv and stages.CUDA_TESTS[0] in tests.argv
    assert tests.missing == ("tests/test_not_there.py is missing from this checkout: its tests did not run",)


def _module_args(stage: stages.Stage, module: str) -> list[str]:
    argv = list(stage.argv)
    return argv[argv.index(module) + 1 :]


def test_the_stage_commands_are_valid_for_their_programs(tmp_path):
    by_name = {s.name: s for s in stages.plan(tmp_path, gpus=1)}
    runner_args = test_runner.build_parser().parse_args(_module_args(by_name["cuda-tests"], "bench.gpu_check.test_runner"))
    assert runner_args.jobs == stages.TEST_JOBS and runner_args.select == stages.CUDA_TESTS_SELECT
    assert runner_args.out == tmp_path / stages.TESTS_DIR
    w4_args = w4.build_parser().parse_args(_module_args(by_name["w4"], "bench.gpu_check.w4"))
    assert w4_args.device == "cuda" and w4_args.timeout < by_name["w4"].limit_s
    config = collectives_cli.parse_config(_module_args(by_name["collectives"], "bench.collectives"))
    assert (config.device, config.backend, set(config.ops)) == ("cuda", "nccl", set(ALL_OPS))
    assert "torch.distributed.run" not in by_name["collectives"].argv


def test_several_gpus_get_one_rank_each(tmp_path):
    by_name = {s.name: s for s in stages.plan(tmp_path, gpus=4)}
    assert "--nproc-per-node=4" in by_name["collectives"].argv


def test_collectives_verification(tmp_path):
    rows = [{"op": op, "size_bytes": 1024, "wrong": 0} for op in ALL_OPS if op != "all_to_all"]
    rows[0]["wrong"] = 7
    (tmp_path / "collectives.json").write_text(json.dumps(rows))
    assert stages._verify_collectives(tmp_path) == ["all_gather at 1024 B: #wrong = 7", "all_to_all: no row"]
    assert stages._verify_collectives(tmp_path / "nowhere") == ["bench.collectives wrote no collectives.json"]


def test_w4_verification(tmp_path):
    checks = [{"check": "all_gather_q8 bf16", "ok": True, "detail": "bytes identical"},
              {"check": "reduce_scatter_q4 fp32", "ok": False, "detail": "bytes DIFFER"}]
    (tmp_path / "w4.json").write_text(json.dumps({"checks": checks, "problems": ["rank 2 reported nothing"]}))
    assert stages._verify_w4(tmp_path) == ["reduce_scatter_q4 fp32: bytes DIFFER", "rank 2 reported nothing"]
    (tmp_path / "w4.json").write_text(json.dumps({"checks": [], "problems": []}))
    assert stages._verify_w4(tmp_path) == ["no check ran"]
    assert stages._verify_w4(tmp_path / "nowhere") == ["bench.gpu_check.w4 wrote no w4.json"]


def _fake_results(tmp_path: Path) -> list[stages.StageResult]:
    deadline = _far()
    return [
        stages.run_stage(_stage("first", "print('all good')"), tmp_path, deadline),
        stages.run_stage(_stage("second", "print('boom'); raise SystemExit(1)"), tmp_path, deadline),
    ]


def test_report_layout(tmp_path):
    text = report.render_check(title="today on box, Fake GPU", results=_fake_results(tmp_path), environment={"GPU": "Fake GPU"},
                         gpus=1, seconds=12, budget_s=570, command="python3 -m bench.gpu_check")  # fmt: skip
    assert text.startswith("# zcomm gpu-check: FAILED (1 of 2 stages passed)")
    for heading in ("## Stages", "## Coverage", "## Environment", "## W = 4 on one GPU", "## Collectives", "## Log tails"):
        assert heading in text
    assert "| first | first title | PASSED |" in text and "| second | second title | FAILED |" in text
    assert "- exited with status 1" in text
    assert "One GPU cannot host two NCCL ranks" in text and "**Not covered**" in text
    assert "| GPU | Fake GPU |" in text
    assert "### second: failed\n\n```\n$ " in text and "boom\n```" in text


def test_report_of_several_gpus_names_what_one_node_cannot_cover():
    lines = report.coverage(8)
    assert "8 NCCL ranks" in lines[0] and any("several nodes" in line for line in lines)


def test_driver_end_to_end_with_stand_in_stages(tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "gpu_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU 80GB")
    monkeypatch.setattr(stages, "plan", lambda out_dir, gpus: [_stage("first", "pass"), _stage("second", "raise SystemExit(1)")])
    monkeypatch.setenv("ZCOMM_BACKEND", "reference")
    out = tmp_path / "run"
    assert driver.main(["--out", str(out)]) == driver.EXIT_FAILED
    text = (out / "report.md").read_text()
    assert "FAILED (1 of 2 stages passed)" in text
    assert "`ZCOMM_BACKEND=reference` was set" in text
    assert json.loads((out / "environment.json").read_text())["torch"].startswith(torch.__version__)
    assert sorted(p.name for p in out.iterdir()) == ["environment.json", "first.log", "report.md", "second.log"]
    assert driver.main(["--out", str(tmp_path / "only"), "--only", "first"]) == driver.EXIT_PASSED


def test_default_result_folder_is_under_bench_results():
    path = driver.default_out_dir("NVIDIA H100 80GB HBM3")
    assert path.parent == REPO / "bench" / "results"
    assert path.name.startswith("gpu-check_nvidia-h100-80gb-hbm3_")


_HOOKED = '''
import pytest

@pytest.fixture
def skipping():
    pytest.skip("fixture says no")

@pytest.mark.skip(reason="mark says no")
def test_mark(): pass

@pytest.mark.skipif(True, reason="skipif says no")
def test_skipif(): pass

def test_body(): pytest.skip("body says no")

def test_fixture(skipping): pass

@pytest.mark.xfail(reason="known")
def test_xfail(): assert False

def test_ok(): pass
'''


def _pytest_outcomes(tmp_path: Path, gpu_check: str | None) -> tuple[int, dict[str, str], str]:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_hooked.py").write_text(_HOOKED)
    (tmp_path / "test_module_skip.py").write_text('import pytest\npytest.importorskip("no_such_module_zcomm")\n\ndef test_never(): pass\n')
    env = {k: v for k, v in os.environ.items() if k != stages.GPU_CHECK_ENV}
    if gpu_check is not None:
        env[stages.GPU_CHECK_ENV] = gpu_check
    xml = tmp_path / "out.xml"
    argv = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", f"--junitxml={xml}", str(tmp_path)]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    outcomes = {}
    if xml.exists():
        for case in ElementTree.parse(xml).getroot().iter("testcase"):
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return done.returncode, outcomes, done.stdout


def test_conftest_turns_every_skip_into_a_failure_under_gpu_check(tmp_path):
    code, outcomes, stdout = _pytest_outcomes(tmp_path, "1")
    assert code == 1, stdout
    assert outcomes == {
        "test_module_skip": "error",  # importorskip at collection
        "test_mark": "error",  # skip marks act in setup
        "test_skipif": "error",
        "test_body": "failure",
        "test_fixture": "error",
        "test_xfail": "skipped",  # an expected failure is not a skip
        "test_ok": "passed",
    }
    for reason in ("mark says no", "skipif says no", "body says no", "fixture says no", "could not import 'no_such_module_zcomm'"):
        assert f"ZCOMM_GPU_CHECK=1 makes every skip a failure: Skipped: {reason}" in stdout


def test_conftest_leaves_skips_alone_otherwise(tmp_path):
    code, outcomes, stdout = _pytest_outcomes(tmp_path, None)
    assert code == 0, stdout
    assert set(outcomes.values()) == {"skipped", "passed"}
    assert "1 passed, 5 skipped, 1 xfailed" in stdout


def test_conftest_rejects_an_unclear_switch(tmp_path):
    code, _, _ = _pytest_outcomes(tmp_path, "yes")
    assert code == 4  # pytest's usage error


def test_malformed_outputs_are_reported_not_raised(tmp_path):
    (tmp_path / "w4.json").write_text("{not json")
    result = stages.run_stage(_stage("w4", "pass", verify=stages._verify_w4), tmp_path, _far())
    assert result.status == "failed" and "could not be verified" in result.problems[0]
    text = report.render_check(title="t", results=[result], environment={}, gpus=1, seconds=1, budget_s=570, command="c")
    assert "could not read this stage's output" in text


def test_an_interrupted_check_takes_its_stage_down(tmp_path, monkeypatch):
    real_wait = subprocess.Popen.wait

    def wait(self, timeout=None):
        if timeout is not None and timeout > 20:  # the stage's own wait, not terminate's
            log = tmp_path / "interrupted.log"
            deadline = time.monotonic() + 30
            while len(log.read_text().splitlines()) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)  # until the stage has started and printed its pid
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        stages.run_stage(_stage("interrupted", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"), tmp_path, _far())
    pid = int((tmp_path / "interrupted.log").read_text().splitlines()[1])
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_a_failed_run_is_verified_so_that_its_outputs_name_what_failed(tmp_path):
    quiet = stages.run_stage(_stage("quiet", "raise SystemExit(1)"), tmp_path, _far())
    assert quiet.problems == ("exited with status 1",)
    names = lambda out: ["crashed its process: t.py::test_b"]  # noqa: E731
    named = stages.run_stage(_stage("named", "raise SystemExit(1)", verify=names), tmp_path, _far())
    assert named.problems == ("exited with status 1", "crashed its process: t.py::test_b")


def test_report_shows_the_w4_checks(tmp_path):
    checks = [{"check": "all_gather_q8 bf16 stages=4", "ok": True, "detail": "bytes identical"},
              {"check": "zero_runtime ZeRO++", "ok": False, "detail": "losses differ"}]
    (tmp_path / "w4.json").write_text(json.dumps({"device": "cuda", "world_size": 4, "local_size": 2, "backend": "gloo",
                                                  "seconds": 31.0, "checks": checks, "problems": ["rank 3 raised"]}))
    lines = report._checks(tmp_path / "w4.json")
    assert lines[0] == "4 ranks (2 nodes x 2) over gloo, device cuda, 31 s."
    assert "| all_gather_q8 bf16 stages=4 | ok | bytes identical |" in lines
    assert "| zero_runtime ZeRO++ | FAILED | losses differ |" in lines and lines[-1] == "- rank 3 raised"


def test_the_driver_launcher_stage_runs_last_under_the_driver_launcher(tmp_path):
    """[Note: driver-launcher stage]: one pytest over DRIVER_TESTS with ZCOMM_CUDA_LAUNCHER=driver whatever the
    caller set (the other stages run without the variable), judged by its JUnit file."""
    plan = stages.plan(tmp_path, gpus=1)
    driver = plan[-1]
    assert driver.name == "driver-launcher" and driver.missing == ()
    argv = list(driver.argv)
    assert argv[1:3] == ["-m", "pytest"] and argv[argv.index("-k") + 1] == stages.DRIVER_TESTS_SELECT
    assert f"--junitxml={tmp_path / stages.DRIVER_TESTS_XML}" in argv
    assert all(name in argv for name in stages.DRIVER_TESTS)
    caller = {"ZCOMM_CUDA_LAUNCHER": "cupy", "PATH": "/bin"}
    assert stages.stage_environment(caller, driver.env)["ZCOMM_CUDA_LAUNCHER"] == "driver"
    assert stages.stage_environment(caller, driver.env)[stages.GPU_CHECK_ENV] == "1"
    assert all("ZCOMM_CUDA_LAUNCHER" not in stages.stage_environment(caller, s.env) for s in plan[:-1])

    assert driver.junit == stages.DRIVER_TESTS_XML and stages._verify_junit(tmp_path / driver.junit) == [
        f"{stages.DRIVER_TESTS_XML} was not written: pytest died before the end (see the log)"]
    (tmp_path / stages.DRIVER_TESTS_XML).write_text(
        '<testsuites><testsuite name="pytest" tests="2" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.quant.test_x" name="test_ok" time="0.1"/>'
        '<testcase classname="tests.quant.test_x" name="test_bad" time="0.1"><failure message="no"/></testcase>'
        "</testsuite></testsuites>")
    assert stages._verify_junit(tmp_path / driver.junit) == ["failed: tests.quant.test_x::test_bad"]
