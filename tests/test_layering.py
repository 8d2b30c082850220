"""The layers stay layers, and the folders are the layers: no import cycles, nothing below the
surfaces imports them, the pure base imports nothing but itself and the standard library, and
the package's top holds folders only. Checked on the source (lazy imports inside functions
count)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mlxcel"
SURFACES = ("mlxcel.cli", "mlxcel.server", "mlxcel.bench", "mlxcel.config")
# Layers that must never reach up into a surface.
BELOW = (
    "mlxcel.base",
    "mlxcel.reactor",
    "mlxcel.wire",
    "mlxcel.net",
    "mlxcel.runtime",
    "mlxcel.pipeline",
    "mlxcel.tp",
    "mlxcel.sim",
    "mlxcel.serving.frontend",
)  # mlxcel.serving.runner is a surface itself: the library API that serves HTTP
# The folders, each a layer (docs/architecture.md draws them); the top holds nothing else.
FOLDERS = {
    "base", "reactor", "wire", "net", "runtime", "pipeline", "disagg", "bringup", "tp",
    "serving", "server", "config", "process", "cli", "bench", "sim",
}  # fmt: skip


def _modules() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlxcel"):
                deps.add(node.module)  # type: ignore[arg-type]
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("mlxcel"))
        out[name] = deps
    return out


def test_no_import_cycles() -> None:
    mods = _modules()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(mods[m]):
            if d not in mods:
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_nothing_below_the_surfaces_imports_them() -> None:
    upward = {
        m: sorted(d for d in deps if d.startswith(SURFACES))
        for m, deps in _modules().items()
        if m.startswith(BELOW)
    }
    assert {m: d for m, d in upward.items() if d} == {}


def test_the_top_of_the_package_is_its_folders() -> None:
    """``ls mlxcel`` shows the layers: the folders, the package's own ``__init__`` (the
    embedding API's re-exports) and ``__main__``, and nothing else."""
    top = {p.name for p in PKG.iterdir() if p.name != "__pycache__"}
    assert top == FOLDERS | {"__init__.py", "__main__.py"}
    assert all((PKG / f / "__init__.py").is_file() for f in FOLDERS)


def test_the_base_stands_on_nothing_but_itself_and_the_standard_library() -> None:
    mods = _modules()
    base = {m for m in mods if m.startswith("mlxcel.base")}
    assert {m: sorted(mods[m] - base) for m in base if mods[m] - base} == {}
    assert {m: n for m in base if (n := _third_party(m))} == {}


# Each core, and the modules of its own protocol it may add to that base.
CORES = {
    "mlxcel.pipeline.coordinator_core": {"mlxcel.pipeline.coordinator_protocol"},
    "mlxcel.pipeline.stage_core": {
        "mlxcel.pipeline.stage_protocol", "mlxcel.pipeline.stage_gate", "mlxcel.pipeline.stage_batch"
    },
    "mlxcel.disagg.router_core": {
        "mlxcel.disagg.protocol", "mlxcel.disagg.router_nodes", "mlxcel.disagg.route"
    },
    "mlxcel.disagg.prefill_core": {"mlxcel.disagg.protocol"},
    "mlxcel.disagg.decode_core": {"mlxcel.disagg.protocol"},
    "mlxcel.bringup.peer_core": {"mlxcel.bringup.protocol"},
    # The plan and the layer split are pure computations over the peers and the costs.
    "mlxcel.bringup.push_core": {
        "mlxcel.bringup.protocol", "mlxcel.bringup.plan", "mlxcel.pipeline.partition",
    },
    "mlxcel.runtime.engine_core": {"mlxcel.runtime.engine_state"},
}  # fmt: skip


def _closure(mods: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for d in mods.get(stack.pop(), ()):
            if d in mods and d not in seen:
                seen.add(d)
                stack.append(d)
    return seen


def test_every_core_is_pure() -> None:
    """A core (and all it imports, transitively) reaches only the pure base and its own
    protocol modules: no bus, network, runtime, config or surface -- and no third-party
    package (pydantic, mlx, cryptography), only the standard library."""
    mods = _modules()
    assert set(CORES) == {m for m in mods if m.endswith("_core")}, "a new core: list it"
    for core, own in CORES.items():
        reached = _closure(mods, core) - own
        assert {m for m in reached if not m.startswith("mlxcel.base")} == set(), core
    third_party = {m: n for c in CORES for m in _closure(mods, c) | {c} if (n := _third_party(m))}
    assert third_party == {}


def _third_party(module: str) -> set[str]:
    """The packages outside mlxcel and the standard library that ``module`` imports."""
    path = PKG.parent / (module.replace(".", "/") + ".py")
    if not path.is_file():
        path = path.with_suffix("") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
            else [a.name for a in node.names] if isinstance(node, ast.Import) else []
        )  # fmt: skip
        for n in names:
            top = n.split(".")[0]
            if top and top != "mlxcel" and top not in sys.stdlib_module_names:
                found.add(top)
    return found


def test_the_engine_network_and_wire_never_reach_up_into_the_roles() -> None:
    """runtime, net, wire and the bus sit under every role: none of them imports a role
    package (the KV handoff's digest and parts live in ``mlxcel.base.handoff`` for that)."""
    roles = ("mlxcel.pipeline", "mlxcel.disagg", "mlxcel.bringup", "mlxcel.tp", "mlxcel.sim")
    base = ("mlxcel.runtime", "mlxcel.net", "mlxcel.wire", "mlxcel.reactor", "mlxcel.base")
    upward = {
        m: sorted(d for d in deps if d.startswith(roles))
        for m, deps in _modules().items()
        if m.startswith(base)
    }
    assert {m: d for m, d in upward.items() if d} == {}


def test_the_embedding_api_and_the_old_module_names_resolve_without_mlx() -> None:
    """``from mlxcel import assemble, NodeRunner ...`` works, so does every module name of the
    flat layout (as the very module that moved), and none of it imports MLX."""
    code = """
import importlib, sys
import mlxcel
for name in mlxcel.__all__:
    assert getattr(mlxcel, name) is not None, name
for old, new in mlxcel._MOVED.items():
    module = importlib.import_module("mlxcel." + old)
    assert module is importlib.import_module("mlxcel." + new)
    assert module.__spec__.name == "mlxcel." + new  # it keeps its own spec
from mlxcel.assembly import assemble
from mlxcel.messages import Tensor, take_rows
assert assemble is mlxcel.assemble
assert "mlx.core" not in sys.modules, "importing the API loaded MLX"
try:
    import mlxcel.no_such_module
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("an unknown name imported")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent
    )
    assert out.returncode == 0, out.stderr
