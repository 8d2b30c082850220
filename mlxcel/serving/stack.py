"""The one shape every serving mode is built into.

A mode's builder (see the registry in :mod:`mlxcel.serving.assembly`) yields a :class:`Stack`: what the
node is (``mode``, ``model_name``, ``summary``), what a :class:`~mlxcel.serving.runner.NodeRunner`
serves (``serving``), the mode's own objects for whoever needs them (``parts``: the engine, the
coordinator, the stage service...), and the same handful of verbs in every mode --
``generate``/``stream``, ``stats``, ``ready``, ``close``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from mlxcel.base.errors import NotServing

if TYPE_CHECKING:
    from mlxcel.base.messages import SamplingParams
    from mlxcel.reactor.bus import Node
    from mlxcel.serving.frontend import Delta, Frontend, Usage

P = TypeVar("P")


@dataclass
class Serving:
    """What a stack offers the runner."""

    node: Node
    frontend: Frontend | None = None  # None: no HTTP (a pipeline stage)
    inflight: Callable[[], float] = lambda: 0.0
    health: Callable[[], Awaitable[dict[str, Any]]] | None = None
    listener: Any = None  # a cluster listener to bind as a site, if any
    # Set by the stack itself when it can no longer serve (a tensor-parallel group failed, a
    # stage was told to shut down): the runner then stops as if asked to.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the stack is closed (or its node failed under it): the runner stops too.
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    # More GET routes for the HTTP API: path -> a function answering the JSON body.
    extra_get: dict[str, Callable[[], Any]] = field(default_factory=dict)
    # Which of messages.EXTENDED_SAMPLING this node applies; requests for others get a 400.
    sampling: frozenset[str] = frozenset()
    label: str = "one process"  # how this node generates, as a refusal names it
    # The nodes behind this one and their links, for /cluster, /dashboard and the per-node
    # metrics (None: this node alone).
    topology: Callable[[], Awaitable[tuple[list[dict[str, Any]], list[list[str]]]]] | None = None
    prompt_cache: Callable[[], dict[str, int]] | None = None  # its counters, for /metrics
    kv: Callable[[], dict[str, int]] | None = None  # this node's kv_tokens and kv_capacity
    # A node without a frontend drains with this: take no new work, wait for what is in
    # flight until the deadline (the loop's clock), return how much is left.
    drain: Callable[[float], Awaitable[int]] | None = None


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    usage: Usage


@dataclass
class Stack(Generic[P]):
    """A built node of any mode. ``start`` (:func:`mlxcel.serving.assembly.start`) builds it; ``close``
    takes it down (``async with assemble(spec) as stack`` does both). Its node lives in a task
    of its own (the *holder*), which leaves the builder when ``close`` releases it."""

    mode: str  # the registry's name for it
    serving: Serving
    model_name: str
    summary: str  # one line for the log: what this node runs
    parts: P  # the mode's own objects (its engine, coordinator, stage service...)
    failure: Callable[[], str | None] = lambda: None  # why it stopped serving, if it did
    # Set by assembly.start: the event that lets the holder task leave the builder, and it.
    _release: tuple[asyncio.Event, asyncio.Task[None]] | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def holder(self) -> asyncio.Task[None] | None:
        """The task that holds a started stack's builder open until ``close`` (None: the
        stack was not started by :func:`mlxcel.serving.assembly.start`)."""
        return None if self._release is None else self._release[1]

    def ended(self) -> None:
        """The node is going (closed, or failed): it is not ready, a runner serving it stops
        (``serving.closed``), and every request it was generating ends now, with an in-band
        ``server_shutting_down`` error, instead of at its deadline."""
        self._closed = True
        self.serving.closed.set()
        if self.serving.frontend is not None:
            self.serving.frontend.end_all()

    @property
    def node(self) -> Node:
        return self.serving.node

    @property
    def frontend(self) -> Frontend:
        fe = self.serving.frontend
        if self._closed:
            raise NotServing(f"this {self.mode} node is closed ({self.summary})")
        if fe is None:
            raise NotServing(
                f"a {self.mode} node serves no requests of its own ({self.summary}); "
                "send them to the node that serves the API"
            )
        return fe

    @property
    def ready(self) -> bool:
        """Built, not closed, and not stopped by a failure of its own."""
        return not self._closed and not self.serving.done.is_set() and self.failure() is None

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        stop: Sequence[str] = (),
        usage: Usage | None = None,
        cache_ns: str = "",
    ) -> AsyncIterator[Delta]:
        """Generate from a prompt (text, encoded as is, or token ids): the frontend's deltas.
        ``cache_ns``: the prompt-cache namespace (an embedding service's tenant, through
        :func:`mlxcel.base.prefix_index.cache_namespace`; "" the open one)."""
        fe = self.frontend
        ids = await fe.encode_prompt_async(prompt)
        async with aclosing(fe.stream(ids, params, stop, usage, cache_ns=cache_ns)) as deltas:
            async for d in deltas:
                yield d

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, *, stop: Sequence[str] = ()
    ) -> Completion:
        from mlxcel.serving.frontend import Usage

        usage, parts, reason = Usage(), [], None
        async with aclosing(self.stream(prompt, params, stop=stop, usage=usage)) as deltas:
            async for d in deltas:
                parts.append(d.text)
                reason = d.finish_reason
        return Completion("".join(parts), reason, usage)

    async def stats(self) -> dict[str, Any]:
        """The node at a glance: mode, readiness, requests in flight, its health answer and
        KV figures where the mode has them."""
        s = self.serving
        out: dict[str, Any] = {
            "mode": self.mode,
            "model": self.model_name,
            "ready": self.ready,
            "inflight": s.inflight(),
        }
        if s.frontend is not None:
            out["waiting"] = s.frontend.waiting
        if s.health is not None:
            out["health"] = await s.health()
        if s.kv is not None:
            out["kv"] = s.kv()
        if s.prompt_cache is not None:
            out["prompt_cache"] = s.prompt_cache()
        failure = self.failure()
        if failure:
            out["failure"] = failure
        return out

    async def close(self) -> None:
        """Take the node down (idempotent): what it was generating ends with an error, then
        its node and compute close. Raises what took it down, if it failed while serving.
        Called from one of the node's own tasks, that task is cancelled with the node."""
        self.ended()
        if self._release is None:
            return
        release, holder = self._release
        release.set()
        if holder.cancelled():
            return
        # Shielded: a caller that stops waiting (a timeout, its own cancellation, a task of
        # one of the stack's nodes torn down with it) leaves the closing to finish.
        await asyncio.shield(holder)
