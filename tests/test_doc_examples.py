"""Every ``Example::`` in sokpy's docstrings runs as it is written: each block is a script of
its own, run at 2 ranks (the examples are collective calls) in an empty working folder.
An example shows what it prints or asserts what it computes; a fragment that needs names it
does not define fails here."""

import ast
import re
import textwrap

import pytest
from conftest import ROOT, run_mpi

BLOCK = re.compile(r"Example::\n\n((?:[ \t]+\S.*\n|[ \t]*\n)+)")


def docstring_examples():
    found = []
    for path in sorted((ROOT / "sokpy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True) or ""
                for i, m in enumerate(BLOCK.finditer(doc + "\n")):
                    where = f"{path.relative_to(ROOT).with_suffix('')}:{getattr(node, 'name', 'module')}"
                    found.append((f"{where}:{i}" if i else where, textwrap.dedent(m.group(1)).strip() + "\n"))
    return found


EXAMPLES = docstring_examples()


def test_examples_are_found():
    assert len(EXAMPLES) >= 40, len(EXAMPLES)


@pytest.mark.parametrize("code", [c for _, c in EXAMPLES], ids=[w for w, _ in EXAMPLES])
def test_docstring_example_runs_at_two_ranks(tmp_path, code):
    script = tmp_path / "example.py"
    script.write_text(code)
    run_mpi(2, script, cwd=tmp_path, timeout=180)
