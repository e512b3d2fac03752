"""gpu-check's CUDA test stage: one pytest process per test file, several at once, crash-proof (docs/gpu-check.md).

``python -m bench.gpu_check.test_runner --out DIR [--jobs N] [-k EXPR] FILE...``: each file in its own
``pytest -v`` process, so that a test that kills its process takes no other file down, each with
``OMP_NUM_THREADS`` at its share of the cores. A process that died wrote no JUnit file, but ``-v``
names each test before it runs: the log gives the outcomes before the crash and the crashed test.
Exit status 0 when every test passed, 1 otherwise.
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

from bench.gpu_check.stages import junit_counts, junit_suites

MERGED = "cuda-tests.xml"
# pytest -v's outcome words, and the JUnit element each becomes (None: a pass)
_OUTCOMES = {"PASSED": None, "XPASS": None, "FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "skipped"}


class Crash(NamedTuple):
    """A test that ended its pytest process (``test`` None: no test was running), and the (test id,
    outcome word) of the tests that finished in that process, which wrote no JUnit file."""

    file: str
    test: str | None
    returncode: int
    finished: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.test or f"{self.file} (outside any test)"

    def describe(self) -> str:
        return f"signal {-self.returncode}" if self.returncode < 0 else f"exit status {self.returncode}"


class FileOutcome(NamedTuple):
    file: str
    xmls: tuple[Path, ...]
    crashes: tuple[Crash, ...]


def progress(log_text: str, file: str) -> tuple[list[tuple[str, str]], str | None]:
    """(test id, outcome) of the tests with an outcome in one ``pytest -v`` run's output, and the one named without."""
    done, running = [], None
    for node, *words in (line.split() for line in log_text.splitlines() if line.startswith(f"{file}::")):
        outcome = next((word for word in words if word in _OUTCOMES), None)
        if outcome is None:
            running = node
        else:
            done.append((node, outcome))
            running = None if running == node else running
    return done, running


def run_file(file: str, out: Path, *, select: str | None, scratch: Path, env: Mapping[str, str] | None = None) -> FileOutcome:
    """Run ``file`` in one ``pytest -v`` process, read from its log if it died (module docstring); the
    tests' temporary files go under ``scratch``, not into the result folder ``out``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", file).strip("_")
    log, xml = out / f"{slug}.log", out / f"{slug}.xml"
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--continue-on-collection-errors",
            f"--junitxml={xml}", f"--basetemp={scratch / slug}", *(["-k", select] if select else []), file]
    with log.open("w") as handle:
        returncode = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    check=False).returncode  # fmt: skip
    xmls = (xml,) if xml.exists() else ()
    if returncode >= 0 and xmls:
        return FileOutcome(file, xmls, ())
    done, running = progress(log.read_text(errors="replace"), file)
    return FileOutcome(file, xmls, (Crash(file, running, returncode, tuple(done)),))


def _suite(root: ElementTree.Element, name: str, cases: Sequence[tuple[str, str, str | None, str]]) -> None:
    """A suite of (classname, name, JUnit element or None for a pass, message) test cases, with its counts."""
    suite = ElementTree.SubElement(root, "testsuite", name=name, tests=str(len(cases)))
    for kind, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        suite.set(key, str(sum(case[2] == kind for case in cases)))
    for classname, test, kind, message in cases:
        case = ElementTree.SubElement(suite, "testcase", classname=classname, name=test)
        if kind is not None:
            ElementTree.SubElement(case, kind, message=message).text = message


def merge(outcomes: Sequence[FileOutcome], path: Path) -> dict[str, int]:
    """Write the merged JUnit file; return its counts."""
    root = ElementTree.Element("testsuites")
    for xml in (xml for outcome in outcomes for xml in outcome.xmls):
        root.extend(junit_suites(xml))
    crashes = [crash for outcome in outcomes for crash in outcome.crashes]
    _suite(root, "crashes", [(c.file, c.name, "failure", f"the pytest process died with {c.describe()} while running "
                              f"{c.name}; the file's later tests did not run") for c in crashes])  # fmt: skip
    _suite(root, "finished before a crash", [(c.file, node, _OUTCOMES[word], f"{word} (from the log of a run that crashed later)")
                                             for c in crashes for node, word in c.finished])  # fmt: skip
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
    with tempfile.TemporaryDirectory(prefix="zcomm-cuda-tests-") as scratch, ThreadPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(lambda f: run_file(f, args.out, select=args.select, scratch=Path(scratch), env=env), args.files))
    counts = merge(outcomes, args.out / MERGED)
    for crash in (crash for outcome in outcomes for crash in outcome.crashes):
        print(f"{crash.file}: crashed: {crash.name} ({crash.describe()})")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(f"tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped")
    # skipped holds expected failures only: under ZCOMM_GPU_CHECK=1 the tests' conftest makes a skip an error
    return 1 if counts["failures"] or counts["errors"] or not counts["tests"] else 0


if __name__ == "__main__":
    sys.exit(main())
