"""The mode registry and the one Stack shape: every mode is a (spec type, builder) row, every
builder yields a Stack, every caller builds through the registry, and the same verbs work
(or refuse, typed) in every mode."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxcel.base.errors import ConfigError, MlxcelError, NotServing, PartitionError
from mlxcel.base.messages import SamplingParams
from mlxcel.net.secret import ClusterSecret
from mlxcel.serving.assembly import (
    MODES,
    DisaggSpec,
    Generation,
    LocalSpec,
    PipelineSpec,
    StageSpec,
    TensorParallelSpec,
    assemble,
    mode_of,
    start,
)
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
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
    with pytest.raises(ConfigError, match=r"DisaggSpec.role: 'stage' is not one of \('router'"):
        DisaggSpec("stage", Path("m"), ClusterSecret(bytes(32), "t"), "127.0.0.1:1")

    @dataclass(frozen=True)
    class Impostor:  # names a mode, is not its spec type
        model: Path
        mode = "local"

    with pytest.raises(ConfigError, match="Impostor"):
        mode_of(Impostor(Path("m")))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a serving mode; the modes are: local, tensor"):
        mode_of(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda: Generation(parallel=0), "Generation.parallel: must be above 0, not 0"),
        (lambda: Generation(parallel=-3), "Generation.parallel"),
        (lambda: Generation(max_batch_size=0), "Generation.max_batch_size"),
        (lambda: Generation(queue_size=-1), "Generation.queue_size"),
        (lambda: Generation(request_timeout=0), "Generation.request_timeout"),
        (lambda: Generation(prefill_step_size=0), "Generation.prefill_step_size: 0 is below 16"),
        (lambda: Generation(parallel="4"), "Generation.parallel: must be a number, not '4'"),
        (lambda: PipelineSpec(Path("m"), 0), "PipelineSpec.size"),
        (lambda: PipelineSpec(Path("m"), 2, micro_batch_size=0), "micro_batch_size"),
        (lambda: TensorParallelSpec(Path("m"), 0), "TensorParallelSpec.size"),
        (lambda: TensorParallelSpec(Path("m"), 2, backend="mpi"), "TensorParallelSpec.backend"),
        (lambda: StageSpec(None, None, Path("m"), None), "StageSpec: needs its cluster"),
        (lambda: DisaggSpec("decode", Path("m"), None, "127.0.0.1:1"), "DisaggSpec.secret"),
    ],
)
def test_a_spec_with_a_bad_value_is_refused_when_written(make: object, names: str) -> None:
    """As a bad flag is: a ConfigError naming the field, before anything is built (a
    parallel of 0 once hung every request until its deadline)."""
    with pytest.raises(ConfigError, match=re.escape(names)):
        make()  # type: ignore[operator]


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
        "serving/assembly.py",
        "serving/specs.py",
        "serving/stack.py",
        "serving/runner.py",
        "server/run.py",
        "tp/launch.py",
        "pipeline/inproc.py",
        "pipeline/remote.py",
        "disagg/stack.py",
        "disagg/worker_stack.py",
        "pipeline/stage_node.py",
        "pipeline/split.py",
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


async def test_close_ends_what_is_in_flight_and_stops_a_runner_serving_it(tiny: Path) -> None:
    """close() with a request generating: the request ends at once with an in-band
    server_shutting_down error (not at its deadline), a NodeRunner serving the stack stops
    waiting, and the closed stack refuses new work with a typed error."""
    import asyncio

    from mlxcel.base.errors import EngineError
    from mlxcel.base.messages import ErrorCode
    from mlxcel.serving.runner import HttpOptions, NodeRunner

    stack = await start(LocalSpec(tiny), Generation(request_timeout=60))
    runner = NodeRunner(stack, HttpOptions(port=0))
    await runner.setup()
    await runner.start()
    waiting = asyncio.create_task(runner.wait())
    first = asyncio.Event()

    async def long_request() -> None:
        async for _ in stack.stream("close me", SamplingParams(max_tokens=4000)):
            first.set()

    req = asyncio.create_task(long_request())
    await asyncio.wait_for(first.wait(), 10)
    t0 = asyncio.get_running_loop().time()
    await stack.close()
    with pytest.raises(EngineError) as err:
        await asyncio.wait_for(req, 5)
    assert err.value.code == ErrorCode.SERVER_SHUTTING_DOWN
    assert asyncio.get_running_loop().time() - t0 < 5
    await asyncio.wait_for(waiting, 5)  # the runner saw the stack close
    await runner.stop()
    with pytest.raises(NotServing, match="this local node is closed"):
        await stack.generate("again", GREEDY)
    assert (await stack.stats())["ready"] is False


async def test_close_inside_assemble_takes_the_node_down_there(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny)) as stack:
        await stack.close()
        assert stack.holder is not None and stack.holder.done()
        with pytest.raises(NotServing):
            await stack.generate("after close", GREEDY)


async def test_close_from_one_of_the_nodes_own_tasks_does_not_wait_on_itself(tiny: Path) -> None:
    import asyncio

    stack = await start(LocalSpec(tiny))
    holder = stack.holder
    assert holder is not None

    async def closer() -> None:
        await stack.close()

    stack.node.spawn(closer(), name="closer")
    await asyncio.wait_for(asyncio.shield(holder), 10)
    assert not stack.ready


async def test_a_stack_dropped_without_close_keeps_running_until_its_holder_ends(
    tiny: Path,
) -> None:
    """asyncio holds tasks weakly: the registry keeps each holder until it ends, so a stack
    its caller dropped is not collected with its node (and compute thread) running."""
    import asyncio
    import gc

    await start(LocalSpec(tiny))  # dropped at once
    gc.collect()
    holders = [t for t in asyncio.all_tasks() if t.get_name() == "mlxcel-local"]
    assert len(holders) == 1 and not holders[0].done()
    holders[0].cancel()  # what a process's shutdown does to it
    await asyncio.gather(holders[0], return_exceptions=True)


async def test_close_survives_its_caller_giving_up_and_a_closer_on_another_node(
    tiny: Path,
) -> None:
    """close() is shielded: a caller that times out leaves the closing to finish (a later
    close() returns, it does not raise CancelledError), and a closer running on a stage's
    node -- torn down with the stack -- does not wait on itself."""
    import asyncio

    stack = await start(LocalSpec(tiny))
    closer = asyncio.create_task(stack.close())
    await asyncio.sleep(0)  # the closer waits on the holder now, which has only begun
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    assert stack.holder is not None and not stack.holder.cancelled()
    await asyncio.wait_for(stack.close(), 10)  # returns once the closing it began is done
    assert not stack.ready and stack.holder.done()

    pipeline = await start(PipelineSpec(tiny, 2))
    assert pipeline.holder is not None
    pipeline.parts.stages[0].node.spawn(pipeline.close(), name="closer")
    await asyncio.wait_for(asyncio.shield(pipeline.holder), 15)
    assert not pipeline.ready
