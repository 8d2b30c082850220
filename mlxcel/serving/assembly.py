"""The mode registry: one table from a serving mode's name to its spec type and its builder.

Every caller -- the CLI's ``serve`` and ``generate``, the benchmarks, the examples, an
embedding service, the tests -- describes what to run with a spec (:mod:`mlxcel.serving.specs`) and
builds it here. :func:`assemble` (or :func:`start` and ``Stack.close``) looks the spec's mode
up and enters its builder; every builder yields the same :class:`~mlxcel.serving.stack.Stack`.

Builders are named, not imported, so that importing this module (for the specs) loads no MLX.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from mlxcel.base.errors import ConfigError
from mlxcel.serving.specs import (
    CoordinatorSpec,
    DisaggSpec,
    Generation,
    LocalSpec,
    PipelineSpec,
    StackSpec,
    StageSpec,
    TensorParallelSpec,
)
from mlxcel.serving.stack import Stack

Builder = Callable[[Any, Generation], AbstractAsyncContextManager[Stack[Any]]]


@dataclass(frozen=True)
class Mode:
    spec: type
    builder: str  # "module:function", imported when the mode is built

    def load(self) -> Builder:
        module, _, name = self.builder.partition(":")
        fn: Builder = getattr(importlib.import_module(module), name)
        return fn


MODES: dict[str, Mode] = {
    "local": Mode(LocalSpec, "mlxcel.server.run:local_stack"),  # the whole model, one engine
    "tensor-parallel": Mode(TensorParallelSpec, "mlxcel.tp.launch:tp_stack"),  # rank 0
    "pipeline": Mode(PipelineSpec, "mlxcel.pipeline.inproc:pipeline_stack"),  # in-process
    "coordinator": Mode(CoordinatorSpec, "mlxcel.pipeline.remote:coordinator_stack"),
    "stage": Mode(StageSpec, "mlxcel.pipeline.stage_node:stage_stack"),
    "router": Mode(DisaggSpec, "mlxcel.disagg.stack:router_stack"),
    "prefill": Mode(DisaggSpec, "mlxcel.disagg.worker_stack:worker_stack"),
    "decode": Mode(DisaggSpec, "mlxcel.disagg.worker_stack:worker_stack"),
}


def mode_of(spec: StackSpec) -> Mode:
    """The registry's entry for ``spec``; a spec of no mode, or of the wrong type for the mode
    it names, is a ConfigError naming the modes there are."""
    name = getattr(spec, "mode", None)
    mode = MODES.get(name) if isinstance(name, str) else None
    if mode is None or not isinstance(spec, mode.spec):
        raise ConfigError(
            "mode",
            f"{name!r} ({type(spec).__name__}) is not a serving mode; the modes are: "
            + ", ".join(MODES),
        )
    return mode


# The holder tasks of started stacks: asyncio keeps only weak references to tasks, and a
# stack its caller dropped without close() must not be collected with its node running.
_HOLDERS: set[asyncio.Task[None]] = set()


async def start(spec: StackSpec, gen: Generation | None = None) -> Stack[Any]:
    """Build the node ``spec`` describes; ``await stack.close()`` takes it down, from any task.

    The builder runs in a task of its own that holds the node open until ``close``: the
    node's task group then belongs to that task, not to whichever task called ``start`` (an
    embedding service's start-up hook may end long before its clean-up hook runs)."""
    builder = mode_of(spec).load()
    built: asyncio.Future[Stack[Any]] = asyncio.get_running_loop().create_future()
    release = asyncio.Event()

    async def hold() -> None:
        try:
            async with builder(spec, gen or Generation()) as stack:
                built.set_result(stack)
                await release.wait()
        except BaseException as exc:
            if built.done():
                raise  # the node failed while serving: close() raises it
            if isinstance(exc, asyncio.CancelledError):
                built.cancel()
                raise
            built.set_exception(exc)

    holder = asyncio.create_task(hold(), name=f"mlxcel-{spec.mode}")
    _HOLDERS.add(holder)
    holder.add_done_callback(_HOLDERS.discard)
    try:
        stack = await asyncio.shield(built)
    except BaseException:
        # The build failed, or this start was cancelled: the build is taken down whole.
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        if built.done() and not built.cancelled():
            built.exception()  # retrieved (the caller has its own error)
        raise

    def ended(task: asyncio.Task[None]) -> None:
        stack.ended()  # closed, or its node failed: a runner serving it stops too
        if not task.cancelled():
            task.exception()  # retrieved here (no "never retrieved" warning); close() raises it

    holder.add_done_callback(ended)
    stack._release = (release, holder)
    return stack


@asynccontextmanager
async def assemble(spec: StackSpec, gen: Generation | None = None) -> AsyncIterator[Stack[Any]]:
    """``async with assemble(spec, gen) as stack``: :func:`start`, then ``close`` on the way
    out (or earlier, if the block calls it)."""
    stack = await start(spec, gen)
    try:
        yield stack
    finally:
        await stack.close()


__all__ = [
    "MODES",
    "CoordinatorSpec",
    "DisaggSpec",
    "Generation",
    "LocalSpec",
    "Mode",
    "PipelineSpec",
    "StackSpec",
    "StageSpec",
    "TensorParallelSpec",
    "assemble",
    "mode_of",
    "start",
]
