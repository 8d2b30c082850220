"""The layers stay layers: no import cycles, nothing below the surfaces imports them, and no
module grows past ~500 lines. Checked on the source (lazy imports inside functions count)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mlxcel"
SURFACES = ("mlxcel.cli", "mlxcel.server", "mlxcel.bench", "mlxcel.config")
# Layers that must never reach up into a surface.
BELOW = (
    "mlxcel.bus",
    "mlxcel.messages",
    "mlxcel.effects",
    "mlxcel.fsm",
    "mlxcel.adapter",
    "mlxcel.endpoint",
    "mlxcel.wire",
    "mlxcel.net",
    "mlxcel.runtime",
    "mlxcel.pipeline",
    "mlxcel.tp",
    "mlxcel.sim",
    "mlxcel.frontend",
)  # mlxcel.runner is a surface itself: the library API that serves HTTP


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


# Every message is defined in one module (a rule of the house that outweighs the size smell).
ONE_PLACE = {"messages.py"}


def test_no_module_over_500_lines() -> None:
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert {n: s for n, s in sizes.items() if s > 500 and n not in ONE_PLACE} == {}


# The base every core may stand on: data, tables, effects, errors -- no I/O, no clock.
PURE_BASE = {
    "mlxcel.messages", "mlxcel.effects", "mlxcel.fsm", "mlxcel.deadlines", "mlxcel.errors",
    "mlxcel.error_codes", "mlxcel.tensor", "mlxcel.membership", "mlxcel.handoff",
    "mlxcel.defaults", "mlxcel.sampling_params",
}  # fmt: skip
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
        "mlxcel.model_config",
    },
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
        assert _closure(mods, core) - PURE_BASE - own == set(), core
    third_party: dict[str, set[str]] = {}
    for m in set().union(*(_closure(mods, c) | {c} for c in CORES)):
        path = PKG.parent / (m.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            )  # fmt: skip
            for n in names:
                top = n.split(".")[0]
                if top and top != "mlxcel" and top not in sys.stdlib_module_names:
                    third_party.setdefault(m, set()).add(top)
    assert third_party == {}


def test_the_engine_network_and_wire_never_reach_up_into_the_roles() -> None:
    """runtime, net, wire and the bus sit under every role: none of them imports a role
    package (the KV handoff's digest and parts live in ``mlxcel.handoff`` for that)."""
    roles = ("mlxcel.pipeline", "mlxcel.disagg", "mlxcel.bringup", "mlxcel.tp", "mlxcel.sim")
    base = ("mlxcel.runtime", "mlxcel.net", "mlxcel.wire", "mlxcel.bus", "mlxcel.messages",
            "mlxcel.effects", "mlxcel.fsm", "mlxcel.adapter", "mlxcel.endpoint")  # fmt: skip
    upward = {
        m: sorted(d for d in deps if d.startswith(roles))
        for m, deps in _modules().items()
        if m.startswith(base)
    }
    assert {m: d for m, d in upward.items() if d} == {}
