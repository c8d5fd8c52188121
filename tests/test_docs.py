"""Every Python example in README.md and docs/*.md runs (at 1 rank, and the README's at 2)."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT, run_mpi

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page, i, code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


def test_docs_have_examples():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p.relative_to(ROOT)}-{i}" for p, i, _ in BLOCKS])
def test_example_runs(tmp_path, page, index, code):
    script = tmp_path / "example.py"
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, f"{page.name} example {index} failed:\n{res.stdout}\n{res.stderr}"


def test_readme_example_runs_on_two_ranks(tmp_path):
    code = next(c for p, _, c in BLOCKS if p.name == "README.md")
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    run_mpi(2, script)
