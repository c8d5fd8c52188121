"""Every ``Example`` block in sokpy's docstrings runs as it is written, whatever its heading
(``Example::``, ``Example (any number of ranks)::``, ``Example (``sokrun -np 2 ...``)::``): each
block is a script of its own, run at 2 ranks (the examples are collective calls; ``-np N`` in
the heading sets another count) in an empty working folder, with the environment variables its
heading names (``SOKPY_EMULATE_DEVICE=1 python ...``). An example shows what it prints or
asserts what it computes; a fragment that needs names it does not define fails here."""

import ast
import re
import textwrap

import pytest
from conftest import ROOT, run_mpi

# A literal block introduced by a line that starts with "Example" and ends with "::".
BLOCK = re.compile(r"(?m)^[ \t]*(Examples?\b[^\n]*)::[ \t]*\n\n((?:[ \t]+\S.*\n|[ \t]*\n)+)")
# Any line of a docstring that opens an example, however it is written: the test below checks
# that BLOCK finds a block under each of them.
HEADING = re.compile(r"(?m)^[ \t]*Examples?\b.*::[ \t]*$")
ENV = re.compile(r"\b([A-Z][A-Z0-9_]*)=(\w+)")
RANKS = re.compile(r"-np\s+(\d+)")


def docstrings():
    """``(where, docstring)`` of every module, class and function in the package."""
    for path in sorted((ROOT / "sokpy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(ROOT).with_suffix('')}:{getattr(node, 'name', 'module')}"
                yield where, ast.get_docstring(node, clean=True) or ""


def docstring_examples():
    """``(id, code, ranks, env)`` of every Example block."""
    found = []
    for where, doc in docstrings():
        for i, m in enumerate(BLOCK.finditer(doc + "\n")):
            heading = m.group(1)
            ranks = RANKS.search(heading)
            env = dict(ENV.findall(heading))
            code = textwrap.dedent(m.group(2)).strip() + "\n"
            found.append((f"{where}:{i}" if i else where, code, int(ranks.group(1)) if ranks else 2, env or None))
    return found


EXAMPLES = docstring_examples()


def test_examples_are_found():
    assert len(EXAMPLES) >= 50, len(EXAMPLES)
    ids = {w for w, *_ in EXAMPLES}
    # The package's front door and examples under a heading of their own are among them.
    assert {"sokpy/__init__:module", "sokpy/nn/modules:module", "sokpy/testing/emulated:module"} <= ids


def test_every_example_heading_has_a_block():
    """An ``Example...::`` line that BLOCK does not pick up (no blank line after it, say)
    would be an example that never runs."""
    missed = [where for where, doc in docstrings() if len(HEADING.findall(doc)) != len(BLOCK.findall(doc + "\n"))]
    assert not missed, missed


def test_headings_are_read():
    examples = {w: (r, e) for w, _, r, e in EXAMPLES}
    assert examples["sokpy/testing/emulated:module"] == (2, {"SOKPY_EMULATE_DEVICE": "1"})
    assert examples["sokpy/__init__:module"] == (2, None)  # sokrun -np 2
    assert examples["sokpy/nn/modules:module"] == (2, None)  # any number of ranks
    heading = "Example (``FOO_BAR=7 sokrun -np 3 python x.py``)::\n\n    pass\n"
    assert BLOCK.match(heading).group(1) == "Example (``FOO_BAR=7 sokrun -np 3 python x.py``)"
    assert ENV.findall(heading) == [("FOO_BAR", "7")] and RANKS.search(heading).group(1) == "3"


@pytest.mark.parametrize("code,ranks,env", [e[1:] for e in EXAMPLES], ids=[e[0] for e in EXAMPLES])
def test_docstring_example_runs(tmp_path, code, ranks, env):
    script = tmp_path / "example.py"
    script.write_text(code)
    run_mpi(ranks, script, cwd=tmp_path, timeout=180, env=env)
