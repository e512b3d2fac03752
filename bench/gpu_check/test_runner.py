"""gpu-check's CUDA test stage: one pytest process per test file, several at once, crash-proof.

``python -m bench.gpu_check.test_runner --out DIR [--jobs N] [-k EXPR] FILE...`` runs each
file in its own ``pytest -v`` process, ``--jobs`` of them concurrently on the one GPU, each
with ``OMP_NUM_THREADS`` at its share of the cores. A test that kills its process (a
segfault, an abort) cannot take the other files down, and within its file the runner
recovers the way pytest-xdist does for a crashed worker: the crashed test is the last one
pytest announced without an outcome (``-v`` names each test before it runs), it is recorded
as a failure with the signal, and pytest runs the file again with every test that already
has an outcome and the crashed one deselected, until the file finishes or ``MAX_RUNS`` runs
were made. Nothing here needs pytest-xdist, which a GPU machine may lack.

Outputs in ``DIR``: ``<file>.log`` (all runs of a file), the JUnit XML of every run, and
``cuda-tests.xml``, their merge plus a ``crashes`` suite holding a failing test case per
crash, which the stage's verification and the report count. Exit status 0 when every test
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

from bench.gpu_check.stages import junit_counts

MAX_RUNS = 5
MERGED = "cuda-tests.xml"
_OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


class Crash(NamedTuple):
    """A test that ended its pytest process (``test`` None: no test was running), and the
    (test id, outcome word) of the tests that finished in that process, which wrote no JUnit file."""

    file: str
    test: str | None
    returncode: int
    finished: tuple[tuple[str, str], ...] = ()


class FileOutcome(NamedTuple):
    file: str
    xmls: tuple[Path, ...]
    crashes: tuple[Crash, ...]
    runs: int


def slug(file: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", file).strip("_")


def progress(log_text: str, file: str) -> tuple[list[tuple[str, str]], str | None]:
    """(test id, outcome) of the tests with an outcome in one ``pytest -v`` run's output, and the one announced without."""
    done, running = [], None
    for line in log_text.splitlines():
        if not line.startswith(f"{file}::"):
            continue
        node, *words = line.split()
        outcome = next((word for word in words if word in _OUTCOMES), None)
        if outcome is not None:
            done.append((node, outcome))
            running = None if running == node else running
        else:
            running = node
    return done, running


def _describe(returncode: int) -> str:
    return f"signal {-returncode}" if returncode < 0 else f"exit status {returncode}"


def run_file(file: str, out: Path, *, select: str | None, scratch: Path, env: Mapping[str, str] | None = None) -> FileOutcome:
    """Run ``file`` until it finishes, deselecting tests that ended their process (module docstring);
    the tests' temporary files go under ``scratch``, not into the result folder ``out``."""
    log = out / f"{slug(file)}.log"
    deselected: list[str] = []
    crashes: list[Crash] = []
    xmls: list[Path] = []
    log.write_text("")
    for attempt in range(1, MAX_RUNS + 1):
        xml = out / f"{slug(file)}.run{attempt}.xml"
        argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                f"--junitxml={xml}", f"--basetemp={scratch / f'{slug(file)}.run{attempt}'}",
                *(["-k", select] if select else []), file, *(f"--deselect={node}" for node in deselected)]  # fmt: skip
        with log.open("a") as handle:
            handle.write(f"\n$ {' '.join(argv[:3])} ... {file} (run {attempt}, {len(deselected)} deselected)\n")
            handle.flush()
            start = handle.tell()
            returncode = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, check=False).returncode  # fmt: skip
        if xml.exists():
            xmls.append(xml)
        if returncode >= 0 and xml.exists():
            break
        with log.open() as handle:
            handle.seek(start)
            done, running = progress(handle.read(), file)
        crashes.append(Crash(file, running, returncode, tuple(done)))
        if running is None:  # nothing to deselect: rerunning would crash the same way
            break
        deselected += [node for node, _ in done] + [running]
    return FileOutcome(file, tuple(xmls), tuple(crashes), attempt)


def merge(outcomes: Sequence[FileOutcome], path: Path) -> dict[str, int]:
    """Write the merged JUnit file; return its counts."""
    root = ElementTree.Element("testsuites")
    for outcome in outcomes:
        for xml in outcome.xmls:
            parsed = ElementTree.parse(xml).getroot()
            root.extend([parsed] if parsed.tag == "testsuite" else list(parsed.iter("testsuite")))
    crashes = [crash for outcome in outcomes for crash in outcome.crashes]
    suite = ElementTree.SubElement(root, "testsuite", name="crashes", tests=str(len(crashes)),
                                   failures=str(len(crashes)), errors="0", skipped="0")  # fmt: skip
    finished = ElementTree.SubElement(root, "testsuite", name="finished before a crash")
    for crash in crashes:
        for node, word in crash.finished:
            case = ElementTree.SubElement(finished, "testcase", classname=crash.file, name=node)
            kind = {"FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "skipped"}.get(word)
            if kind is not None:
                ElementTree.SubElement(case, kind, message=f"{word} (from the log of a run that crashed later)")
    finished.set("tests", str(len(finished)))
    for kind, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        finished.set(key, str(len(finished.findall(f"testcase/{kind}"))))
    for crash in crashes:
        name = crash.test or f"{crash.file} (outside any test)"
        case = ElementTree.SubElement(suite, "testcase", classname=crash.file, name=name)
        message = f"the pytest process died with {_describe(crash.returncode)} while running {name}"
        ElementTree.SubElement(case, "failure", message=message).text = message
    ElementTree.ElementTree(root).write(path, encoding="unicode")
    return junit_counts(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check.test_runner", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs and JUnit files")
    parser.add_argument("--jobs", type=int, default=4, help="test files run at once (default 4)")
    parser.add_argument("-k", dest="select", help="pytest -k expression applied to every file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    # torch's CPU threads capped at each pytest process's share of the cores
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or args.jobs) // args.jobs)), **os.environ}
    with tempfile.TemporaryDirectory(prefix="zcomm-cuda-tests-") as scratch:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            outcomes = list(pool.map(lambda f: run_file(f, args.out, select=args.select, scratch=Path(scratch), env=env),
                                     args.files))  # fmt: skip
    counts = merge(outcomes, args.out / MERGED)
    for outcome in outcomes:
        crashed = ", ".join(f"{c.test or '(outside a test)'} ({_describe(c.returncode)})" for c in outcome.crashes)
        print(f"{outcome.file}: {outcome.runs} run(s)" + (f"; crashed: {crashed}" if crashed else ""))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(f"tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped")
    # skipped holds expected failures only: under ZCOMM_GPU_CHECK=1 the tests' conftest makes a skip an error
    return 1 if counts["failures"] or counts["errors"] or not counts["tests"] else 0


if __name__ == "__main__":
    sys.exit(main())
