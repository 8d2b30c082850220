"""The layers stay layers: no import cycles, nothing below the surfaces imports them, and no
module grows past ~500 lines. Checked on the source (lazy imports inside functions count)."""

from __future__ import annotations

import ast
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


def test_no_module_over_500_lines() -> None:
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert {n: s for n, s in sizes.items() if s > 500} == {}
