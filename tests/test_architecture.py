"""The package's shape holds its rules (docs/architecture.md): every module in one layer and
no import from a lower layer to a higher one, no import circle (imports inside functions
included), MPI only in comm (and the test doubles), torch.distributed only in torch_comm (and
DDP's process group), the test doubles imported only when
asked for, and no module reading a backend setting at import."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "sokpy"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The sokpy modules ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}

# docs/architecture.md's layers, lowest first: a module (or every module of a package) may
# import its own layer and those below it. Below the public API each layer is a folder
# (a module inside it placed in a lower layer is named on its own: the longest match wins).
# Beside the layers: the job launchers (never imported by a layer) and sokpy.testing
# (imported only when asked for, tested below).
LAYERS = {
    "foundation": ["sokpy.errors", "sokpy.timing", "sokpy.backends.arrays"],
    "backend": ["sokpy.backends"],
    "storage": ["sokpy.storage"],
    "agreement": ["sokpy.exchange.collective"],
    "inputs": ["sokpy.inputs"],
    "exchange": ["sokpy.exchange"],
    "public API": [
        "sokpy.lookup",
        "sokpy.optim",
        "sokpy.tables",
        "sokpy.checkpoint",
        "sokpy.initializers",
    ],
    "modules": ["sokpy.nn"],
    "the package": ["sokpy"],  # its __init__ gathers the public names of every layer
}
BESIDE = ["sokpy.launch", "sokpy.testing"]


def _placed(name: str, places: list[str]) -> str | None:
    """The longest of ``places`` that is ``name`` or a package holding it."""
    hits = [p for p in places if name == p or (p != "sokpy" and name.startswith(p + "."))]
    return max(hits, key=len) if hits else None


def _layer(name: str) -> int | None:
    """``name``'s layer (0: the lowest), None for the modules beside the layers."""
    where = _placed(name, [m for mods in LAYERS.values() for m in mods] + BESIDE)
    assert where is not None, f"{name} is in no layer: place it in LAYERS (and docs/architecture.md)"
    if where in BESIDE:
        return None
    return next(i for i, mods in enumerate(LAYERS.values()) if where in mods)


def test_the_layers_below_the_api_are_folders():
    """The folders show the layers: at the top of the package only the public modules (the
    API, its errors, its timing and initializers); the backend, the tables' storage, the
    exchange, the launchers and the test doubles each in a folder of their own."""
    top = {name for name, path in MODULES.items() if name.count(".") == 1 and path.name != "__init__.py"}
    assert top == {"sokpy.lookup", "sokpy.errors", "sokpy.timing", "sokpy.initializers"}, sorted(top)
    for folder in (
        "sokpy.backends",
        "sokpy.storage",
        "sokpy.exchange",
        "sokpy.inputs",
        "sokpy.launch",
        "sokpy.testing",
    ):
        assert MODULES[folder].name == "__init__.py", f"{folder} is not a folder"
    # Each of those folders is one layer: LAYERS names no module inside them on its own, but
    # the two that sit one layer lower than their folder.
    inside = sorted(
        m
        for ms in LAYERS.values()
        for m in ms
        if m.startswith(("sokpy.backends.", "sokpy.storage.", "sokpy.exchange."))
    )
    assert inside == ["sokpy.backends.arrays", "sokpy.exchange.collective"], inside


def test_no_module_imports_a_higher_layer():
    names = list(LAYERS)
    upward = []
    for name, deps in GRAPH.items():
        mine = _layer(name)
        for dep in deps:
            theirs = _layer(dep)
            if theirs is None:
                if mine is not None and mine < len(names) - 1:  # beside the layers: only the package imports them
                    upward.append(f"{name} ({names[mine]}) -> {dep} (beside the layers)")
            elif mine is not None and theirs > mine:
                upward.append(f"{name} ({names[mine]}) -> {dep} ({names[theirs]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_the_import_graph_has_no_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node, path):
        state[node] = 1
        for dep in sorted(GRAPH[node] - {"sokpy"}):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_calls_outside_a_lookup_route_through_the_service():
    """Checkpoints, tables and optimizers find their keys' owners and send rows to them through
    the exchange layer's routing service (sokpy.exchange.routing), never through the lookup
    plan."""
    users = sorted(
        f"{name} -> {dep}"
        for name, deps in GRAPH.items()
        if name.startswith(("sokpy.checkpoint", "sokpy.tables", "sokpy.optim"))
        for dep in deps
        if dep == "sokpy.exchange.plan" or dep.startswith("sokpy.exchange.plan.")
    )
    assert not users, "the lookup plan imported outside a lookup:\n" + "\n".join(users)


def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore stays in its module: what another module needs is
    public (dunder names, such as ``__version__``, are not private)."""
    crossing = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                crossing += [f"{name}: from {'.' * node.level}{node.module or ''} import {p}" for p in private]
    assert not crossing, "private names imported across modules:\n" + "\n".join(crossing)


def test_mpi_only_in_comm_and_the_test_doubles():
    users = {
        name
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any("mpi4py" in (a.name if isinstance(node, ast.Import) else node.module or "") for a in node.names)
    }
    allowed = {"sokpy.backends.comm"} | {m for m in MODULES if m.startswith("sokpy.testing")}
    assert users and users <= allowed, f"mpi4py imported outside comm: {sorted(users - allowed)}"


def test_torch_distributed_only_in_its_communicator_and_ddps_group():
    """torch.distributed is TorchComm's transport: only backends/torch_comm.py talks to it
    (and torch_world.py, which joins its world), beside sokpy.nn's process_group (which
    starts DDP's group)."""

    def uses(node) -> bool:
        if isinstance(node, ast.Import):
            return any(a.name.startswith("torch.distributed") for a in node.names)
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            return module.startswith("torch.distributed") or (
                module == "torch" and "distributed" in {a.name for a in node.names}
            )
        return False

    users = {name for name, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text())) if uses(node)}
    assert users == {"sokpy.backends.torch_comm", "sokpy.backends.torch_world", "sokpy.nn.process_group"}, sorted(users)


def test_the_test_doubles_are_imported_only_when_asked_for():
    """No layer imports sokpy.testing: the runtime builds the emulated device through the
    registry of backends, which sokpy.testing registers itself with. Only the package above
    every layer imports it, inside the registry's finder (when SOKPY_EMULATE_DEVICE=1 asks)."""
    importers = {name for name, deps in GRAPH.items() if any(d.startswith("sokpy.testing") for d in deps)}
    importers = {m for m in importers if not m.startswith("sokpy.testing")}
    assert importers <= {"sokpy"}, sorted(importers)
    tree = ast.parse(MODULES["sokpy"].read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("testing" in (getattr(n, "module", "") or "") for n in top)
    assert not any("testing" in a.name for n in top for a in n.names)


def test_no_module_reads_a_backend_setting_at_import():
    for name, path in MODULES.items():
        if name.startswith("sokpy.testing"):
            continue
        tree = ast.parse(path.read_text())
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(stmt):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    assert not node.value.startswith(("SOKPY_EMULATE", "SOKPY_BACKEND")), (
                        f"{name} reads {node.value} at import; the backend object decides at init"
                    )


def test_the_install_lists_every_package():
    """A non-editable install (a wheel) holds only the packages setup.cfg names: every folder
    of sokpy/ with an __init__.py must be among them."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].replace("\n", ",").split(",") if p.strip()}
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert folders <= listed, f"setup.cfg [options] packages misses {sorted(folders - listed)}"


def test_no_module_is_over_400_lines():
    """Small modules with one concern each: a module that grows past 400 lines is split (the
    kernels themselves, cuda_src/, are not Python modules and are not counted)."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"
