"""The mode registry and the one Stack shape: every mode is a (spec type, builder) row, every
builder yields a Stack, every caller builds through the registry, and the same verbs work
(or refuse, typed) in every mode."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxcel.assembly import (
    MODES,
    DisaggSpec,
    Generation,
    LocalSpec,
    PipelineSpec,
    assemble,
    mode_of,
    start,
)
from mlxcel.errors import ConfigError, MlxcelError, NotServing, PartitionError
from mlxcel.messages import SamplingParams
from mlxcel.net.secret import ClusterSecret
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=8)


def test_every_mode_names_a_builder_of_its_spec_that_yields_a_stack() -> None:
    assert set(MODES) == {
        "local",
        "tensor-parallel",
        "pipeline",
        "coordinator",
        "stage",
        "router",
        "prefill",
        "decode",
    }
    for name, mode in MODES.items():
        builder = mode.load()
        params = list(inspect.signature(builder).parameters.values())
        assert [p.annotation for p in params] == [mode.spec.__name__, "Generation"], name
        assert "Stack[" in inspect.signature(builder).return_annotation, name
        if name not in ("router", "prefill", "decode"):  # DisaggSpec's mode is its role
            assert mode.spec.mode == name


def test_a_spec_the_registry_does_not_know_is_refused_naming_the_modes() -> None:
    with pytest.raises(ConfigError, match="'trainer' .* the modes are: local, tensor-parallel"):
        mode_of(DisaggSpec("trainer", Path("m"), None, "127.0.0.1:1"))

    @dataclass(frozen=True)
    class Impostor:  # names a mode, is not its spec type
        model: Path
        mode = "local"

    with pytest.raises(ConfigError, match="Impostor"):
        mode_of(Impostor(Path("m")))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a serving mode"):
        mode_of(object())  # type: ignore[arg-type]


BUILDERS = {mode.builder.partition(":")[2] for mode in MODES.values()}


def _calls_to_builders(path: Path) -> list[str]:
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            hits += [f"imports {a.name}" for a in node.names if a.name in BUILDERS]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in BUILDERS:
            hits.append(f"calls {node.func.id}")  # type: ignore[attr-defined]
    return hits


def test_every_caller_builds_through_the_registry() -> None:
    """The CLI, the benches, the tools, the examples and the tests name a spec; only the
    registry names a builder."""
    found = {}
    for folder in ("mlxcel", "tools", "examples", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            hits = _calls_to_builders(path)
            if hits:
                found[str(path.relative_to(ROOT))] = hits
    assert found == {}


def test_no_function_in_the_assembly_path_is_over_60_lines() -> None:
    path = [
        "assembly.py",
        "specs.py",
        "stack.py",
        "runner.py",
        "server/run.py",
        "tp/launch.py",
        "pipeline/inproc.py",
        "pipeline/remote.py",
        "disagg/stack.py",
        "bringup/launch.py",
        "cli/serving.py",
        "cli/cluster_nodes.py",
        "cli/bringup.py",
    ]
    long = {}
    for rel in path:
        for node in ast.walk(ast.parse((ROOT / "mlxcel" / rel).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 60:
                    long[f"{rel}:{node.name}"] = lines
    assert long == {}


async def test_the_same_verbs_in_one_process_and_in_a_pipeline(tiny: Path) -> None:
    """start, ready, generate, stream, stats, close: the same calls, the same greedy text."""
    texts = []
    for spec in (LocalSpec(tiny), PipelineSpec(tiny, 2)):
        stack = await start(spec, Generation(parallel=2, max_batch_size=2))
        try:
            assert stack.ready and stack.mode == spec.mode
            done = await stack.generate("The registry", GREEDY)
            assert done.usage.completion_tokens == 8 and done.finish_reason == "length"
            streamed = [d.text async for d in stack.stream("The registry", GREEDY)]
            assert "".join(streamed) == done.text
            stats = await stack.stats()
            assert stats["mode"] == spec.mode and stats["ready"] is True
            assert stats["inflight"] == 0 and stats["waiting"] == 0
            texts.append(done.text)
        finally:
            await stack.close()
        assert not stack.ready
        await stack.close()  # idempotent
        assert (await stack.stats())["ready"] is False
    assert texts[0] == texts[1]
    # A pipeline's stats carry its coordinator's health: every stage, by id.
    async with assemble(PipelineSpec(tiny, 2)) as st:
        health = (await st.stats())["health"]
        assert health["ready"] and [s["id"] for s in health["pipeline"]["stages"]] == [
            "stage-0",
            "stage-1",
        ]


async def test_a_node_that_serves_no_requests_says_so_typed(tiny: Path) -> None:
    """A decode node has no frontend: generate and stream refuse with NotServing (an
    MlxcelError naming the mode); stats still answer."""
    secret = ClusterSecret(bytes(range(32)), "test")
    bind = f"127.0.0.31:{free_port('127.0.0.31')}"
    async with assemble(DisaggSpec("decode", tiny, secret, bind)) as node:
        assert node.serving.listener is not None and node.serving.drain is not None
        with pytest.raises(NotServing, match="a decode node serves no requests"):
            await node.generate("hello", GREEDY)
        with pytest.raises(NotServing):
            _ = node.frontend
        stats = await node.stats()
        assert stats["mode"] == "decode" and stats["ready"] and "waiting" not in stats


async def test_a_build_that_fails_raises_typed_and_leaves_nothing_running(
    tiny: Path, tmp_path: Path
) -> None:
    import threading

    before = threading.active_count()
    with pytest.raises(MlxcelError):
        await start(LocalSpec(tmp_path / "no-such-model"))
    with pytest.raises(PartitionError, match="--pp-layers: ranges cover layers 0-9"):
        await start(PipelineSpec(tiny, 2, layers="0-9"))
    assert threading.active_count() <= before


async def test_start_and_close_may_run_in_different_tasks(tiny: Path) -> None:
    """An embedding service's start-up and clean-up hooks run in tasks of their own: the
    node belongs to neither, and closes whole."""
    import asyncio

    stack = await asyncio.create_task(start(LocalSpec(tiny)))
    assert (await stack.generate("hooks", GREEDY)).usage.completion_tokens == 8
    node_tasks = set(stack.node._tasks)
    await asyncio.create_task(stack.close())
    assert not stack.ready and all(t.done() for t in node_tasks)
    await stack.close()


async def test_a_start_cancelled_midway_takes_its_build_down(tiny: Path) -> None:
    """Cancelled while loading, while the stages warm up, or just as it is ready: nothing of
    the build is left running (its threads joined, its holder task gone)."""
    import asyncio
    import threading

    before = threading.active_count()
    cancelled = 0
    for delay in (0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5):
        try:
            stack = await asyncio.wait_for(start(PipelineSpec(tiny, 2)), delay)
        except TimeoutError:
            cancelled += 1
        else:
            await stack.close()
        assert threading.active_count() <= before, delay
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("mlxcel-")] == []
    assert cancelled >= 2
