"""One check of the ``[Note: name]`` comments over the whole tree: every note is defined
once, and every reference names a note that exists.

A note is the ``[Note: name]`` that opens its line (of a comment or a docstring, in Python,
CUDA or the Makefile) and explains what follows it; a reference is any other mention, in
code ("see [Note: name]", also where "see" ends the line before, and "[Note: name] in
``module``") or in the docs. Names are compared
with their whitespace collapsed, since a name may wrap across lines.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Where notes may be defined, and where they may be referenced as well.
CODE_DIRS = ("zcomm", "zcomm_cuda", "zero_runtime", "bench", "tests")
CODE_SUFFIXES = (".py", ".cu", ".cuh")
REFERENCING = ("README.md", "docs", "Makefile")
NOTE = re.compile(r"\[Note: ([^\]]+)\]")
# The opening of a line before a note: spaces and a comment marker (#, //, *) or nothing.
OPENING = re.compile(r"^\s*(#|//|\*|/\*)?\s*$")
# A reference that wraps so that its note opens the next line: "see" ends the line before.
SEE = re.compile(r"\bsee\s*(#|//|\*)?\s*$", re.IGNORECASE)
COMMENT_MARKERS = ("#", "//", "*")


def _code_files() -> list[Path]:
    files = [REPO / "Makefile"]
    for top in CODE_DIRS:
        files += [p for p in sorted((REPO / top).rglob("*"))
                  if p.suffix in CODE_SUFFIXES and "results" not in p.parts and p != Path(__file__).resolve()]
    return files


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _mentions(path: Path):
    """(name, is_definition, line number) of every note mentioned in ``path``."""
    text = path.read_text()
    for match in NOTE.finditer(text):
        name = " ".join(word for word in match.group(1).split() if word not in COMMENT_MARKERS)
        line_start = text.rfind("\n", 0, match.start()) + 1
        opens_line = bool(OPENING.match(text[line_start:match.start()]))
        after_see = SEE.search(text[max(0, match.start() - 40):match.start()]) is not None
        in_module = text.startswith("] in ", match.end() - 1)
        yield name, opens_line and not after_see and not in_module, text.count("\n", 0, match.start()) + 1


def _notes() -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    defined: dict[str, list[str]] = {}
    referenced = []
    for path in _code_files():
        where = str(path.relative_to(REPO))
        for name, is_definition, line in _mentions(path):
            if is_definition:
                defined.setdefault(name, []).append(f"{where}:{line}")
            else:
                referenced.append((name, f"{where}:{line}"))
    for path in _doc_files():
        referenced += [(name, f"{path.relative_to(REPO)}:{line}") for name, _, line in _mentions(path)]
    return defined, referenced


def test_the_notes_are_found_in_every_package_and_the_kernels():
    defined, _ = _notes()
    places = {where.split("/")[0] for wheres in defined.values() for where in wheres}
    assert {"zcomm", "zcomm_cuda", "zero_runtime", "bench"} <= places, places
    assert any(where.endswith((".cu:", ".cuh:")) or ".cu" in where for wheres in defined.values() for where in wheres)


def test_every_note_is_defined_once():
    defined, _ = _notes()
    twice = {name: wheres for name, wheres in defined.items() if len(wheres) > 1}
    assert twice == {}


def test_every_reference_resolves():
    defined, referenced = _notes()
    dangling = sorted(f"{where}: [Note: {name}]" for name, where in referenced if name not in defined)
    assert dangling == []


def test_the_pattern_tells_definitions_from_references(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text('# [Note: a thing] why\nx = 1  # see\n# [Note: a\n#   thing]\n"""[Note: other] in ``y``"""\n')
    assert [(n, d) for n, d, _ in _mentions(sample)] == [("a thing", True), ("a thing", False), ("other", False)]
