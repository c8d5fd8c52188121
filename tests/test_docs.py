"""Every Python example in README.md and docs/*.md runs (at 1 rank, and the README's at 2), and
every `pip install` line there (and in the Makefile and launch/) installs the distribution
sokpy-embeddings, with extras that setup.cfg declares."""

import configparser
import re

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
    if re.search(r"^(from|import) (torchrec|fbgemm_gpu)", code, re.M) and not _torchrec_imports():
        pytest.skip("the example needs torchrec (launch/install-torchrec; make test installs it)")
    # As `python example.py` in an empty folder, in the one-rank pool (a fresh process per
    # example paid Python's, torch's and sokpy's start-up 14 times over). Temporary folders the
    # example makes go under that folder, which pytest removes, not under /tmp.
    script = tmp_path / "example.py"
    script.write_text(f"import tempfile\ntempfile.tempdir = {str(tmp_path)!r}\n{code}")
    run_mpi(1, script, cwd=tmp_path, timeout=300)


def _torchrec_imports() -> bool:
    try:
        import torchrec.models.dlrm  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or installed and broken
        return False
    return True


def test_readme_example_runs_on_two_ranks(tmp_path):
    code = next(c for p, _, c in BLOCKS if p.name == "README.md")
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    run_mpi(2, script)


# ---- install lines ---------------------------------------------------------------------------
# The distribution is sokpy-embeddings (`sokpy` on PyPI is someone else's project); the module
# stays `sokpy`. Every `pip install` line a user may copy names the distribution, and every extra
# it asks for (also `-e ".[...]"` in a checkout) is one that setup.cfg declares.

DIST = "sokpy-embeddings"
INSTALL_SOURCES = [*PAGES, ROOT / "Makefile", *sorted(p for p in (ROOT / "launch").iterdir() if p.is_file())]
# A requirement or a local path, with its extras: sokpy-embeddings[cuda12,mpi], ".[test]", torch==2.13.0.
REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*|\.)?(?:\[(?P<extras>[^\]]*)\])?")
# Bracketed extras of our package anywhere in a page, also in prose and comments outside a pip
# install command: sokpy-embeddings[cuda13], and a quoted checkout ".[test,cuda13]".
OUR_EXTRAS = re.compile(r"(?:(?<![\w./-])(?P<name>sokpy(?:[-_.]embeddings)?)|(?<=[\"'])\.)\[(?P<extras>[^\]\s]*)\]")


def setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def declared_extras():
    return set(setup_cfg()["options.extras_require"])


def normalized(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def install_requirements(text):
    """``(line number, line, requirement)`` for each package or path that a ``pip install`` on
    a line of ``text`` installs: the words after it up to a closing backtick, a shell comment or
    the end of the command, without options and quotes."""
    for number, line in enumerate(text.splitlines(), 1):
        for rest in re.split(r"\bpip install\b", line)[1:]:
            command = re.split(r"`|\s#|;|&&|\|\||\)", rest)[0]
            for word in command.split():
                word = word.strip("\"'")
                if word and not word.startswith(("-", "$")):
                    yield number, line, word


INSTALLS = [
    (path, number, line, word)
    for path in INSTALL_SOURCES
    for number, line, word in install_requirements(path.read_text())
]


def test_setup_cfg_names_the_distribution():
    assert setup_cfg()["metadata"]["name"] == DIST


def test_install_lines_are_found():
    words = {w for *_, w in INSTALLS}
    assert f"{DIST}[mpi]" in words and f"{DIST}[cuda12,mpi]" in words and f"{DIST}[cuda13,mpi]" in words, words
    assert {p.name for p, *_ in INSTALLS} >= {"README.md", "gpu.md", "horovod.md", "install-horovod"}


def test_install_lines_name_sokpy_embeddings_and_declared_extras():
    extras = declared_extras()
    wrong = []
    for path, number, line, word in INSTALLS:
        req = REQUIREMENT.match(word)
        name = req["name"] or ""
        ours = name == "." or normalized(name) in ("sokpy", DIST)
        where = f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        if ours and name != "." and name != DIST:
            wrong.append(f"{where}\n    installs {name!r}, which on PyPI is another project: write {DIST!r}")
        if ours and req["extras"] is not None:
            unknown = {e.strip() for e in req["extras"].split(",")} - extras
            if unknown:
                wrong.append(f"{where}\n    extras {sorted(unknown)} are not in setup.cfg ({sorted(extras)})")
    assert not wrong, "\n".join(wrong)


def test_every_bracketed_extra_of_ours_in_the_docs_exists():
    extras = declared_extras()
    wrong = []
    for path in INSTALL_SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in OUR_EXTRAS.finditer(line):
                where = f"{path.relative_to(ROOT)}:{number}: {match[0]}"
                if match["name"] not in (None, DIST):
                    wrong.append(f"{where}: the distribution is {DIST!r}")
                unknown = {e.strip() for e in match["extras"].split(",")} - extras
                if unknown:
                    wrong.append(f"{where}: extras {sorted(unknown)} are not in setup.cfg")
    assert not wrong, "\n".join(wrong)


def test_cuda_extras():
    """cuda12 and cuda13 bring CuPy, NCCL and NVRTC for their CUDA; ``cuda`` stays the CUDA 12 set."""
    cfg = setup_cfg()["options.extras_require"]
    names = {
        k: {normalized(re.split(r"[<>=!~ ;\[]", r.strip())[0]) for r in cfg[k].split("\n") if r.strip()} for k in cfg
    }
    assert names["cuda12"] == {"cupy-cuda12x", "nvidia-nccl-cu12", "nvidia-cuda-nvrtc-cu12"}
    assert names["cuda13"] == {"cupy-cuda13x", "nvidia-nccl-cu13", "nvidia-cuda-nvrtc"}
    assert names["cuda"] == names["cuda12"]


@pytest.mark.parametrize("cuda", ["12.8", "13.0", None])
def test_device_error_names_a_declared_extra(monkeypatch, cuda):
    from sokpy.backends import backend as backends

    monkeypatch.setattr(backends.torch.version, "cuda", cuda)
    req = REQUIREMENT.match(backends._pip_extra())
    assert req["name"] == DIST and set(req["extras"].split(",")) <= declared_extras(), backends._pip_extra()
    if cuda:
        assert req["extras"] == f"cuda{cuda.split('.')[0]}"
