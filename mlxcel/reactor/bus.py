"""The typed message bus and the Node that owns it.

One bus per process, owned by a :class:`Node`. Handlers subscribe by message class; each
subscription has its own bounded queue drained by its own task in the node's TaskGroup, and a
declared overflow policy:

* ``Overflow.BLOCK``: the publisher waits (up to its deadline) for room. Backpressure flows
  back to whoever published -- ultimately a socket that stops reading.
* ``Overflow.DROP``: a full queue drops the new message and counts it. For traffic that may be
  lost (beacons, stats), so a slow consumer never stalls a reader.

Every message is delivered inside an :class:`Envelope` naming its source: ``LOCAL`` for
messages published in this process, the peer's authenticated identity for messages that came
over the network. A handler that raises is logged and counted; the node keeps running.

One subscription may take several classes: they share its queue, so its handler sees them
in the order the queue took them. A subscription whose handler is synchronous (``sync=True``,
as every role adapter's is) is called inside ``publish`` when it is the message's only
subscriber, nothing waits ahead of the message (its queue empty, its handler not running)
and no synchronous handler -- nor a role adapter's ``feed``, see :func:`handling` -- is on
this thread's stack, whatever bus it belongs to: the message takes no queue and no task
switch (what a socket reader's messages mostly meet). Anything else waits in the queue, in
the order the queue took it; so no handler is re-entered, and nothing a handler or a feed
publishes -- over the in-memory fabric to another node's bus too -- runs a handler inside it.

One exception: a *leaf* subscription (``leaf=True``) is a synchronous handler that publishes
nothing and calls nothing back -- it only hands the message to a queue of its own, as the
frontend hands a token to its request's stream. Running it inside a feed cannot reorder
anything, so it is called inline whenever nothing waits ahead of the message: a result goes
from the role that produced it to the stream that waits for it with no queue of the bus and
no task switch in between.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from loguru import logger

from mlxcel.base.deadlines import until
from mlxcel.base.errors import BusError, DeadlineExceeded, QueueFull
from mlxcel.base.messages import LOCAL, Message

M = TypeVar("M", bound=Message)


class Overflow(enum.Enum):
    BLOCK = "block"
    DROP = "drop"


class Origin(enum.Enum):
    """Which publishers a subscription hears: this process, the network, or both."""

    ANY = "any"
    LOCAL = "local"  # published in this process (source LOCAL)
    REMOTE = "remote"  # arrived from a peer (source = its identity)

    def admits(self, source: str) -> bool:
        if self is Origin.ANY:
            return True
        return (source == LOCAL) == (self is Origin.LOCAL)


@dataclass(frozen=True, slots=True)
class Envelope(Generic[M]):
    msg: M
    source: str = LOCAL


Handler = Callable[[Envelope[Any]], Awaitable[None]]
SyncHandler = Callable[[Envelope[Any]], None]


class _Stack(threading.local):
    depth = 0  # synchronous handlers and feeds on this thread's stack (they never await)


_stack = _Stack()


@contextmanager
def handling() -> Iterator[None]:
    """Mark synchronous work that reacts to messages (a role adapter's ``feed``): what it
    publishes, on any bus of this thread, is queued rather than handled inside it."""
    _stack.depth += 1
    try:
        yield
    finally:
        _stack.depth -= 1


class Subscription:
    """One handler's bounded inbox and the counters an operator needs to see it."""

    def __init__(
        self,
        bus: Bus,
        classes: tuple[type[Message], ...],
        handler: Handler | SyncHandler,
        maxsize: int,
        policy: Overflow,
        name: str,
        origin: Origin = Origin.ANY,
        sync: bool = False,
        leaf: bool = False,
    ) -> None:
        if maxsize < 1:
            raise BusError(f"subscription {name!r}: maxsize must be >= 1")
        self.bus = bus
        self.classes = classes
        self.handler = handler
        self.sync = sync
        self.leaf = leaf  # publishes nothing: may run inside another handler or a feed
        self.policy = policy
        self.name = name
        self.origin = origin
        self.queue: asyncio.Queue[Envelope[Any]] = asyncio.Queue(maxsize)
        self.delivered = 0
        self.inline = 0  # of those delivered, how many inside a publish
        self.dropped = 0
        self.failed = 0
        self._running = False  # a synchronous handler is on the stack
        self._removed = False  # unsubscribed (or the bus closed): called no more
        self._task: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        return self.queue.qsize()

    def _deliver_inline(self, env: Envelope[Any]) -> bool:
        """Run a synchronous handler on ``env`` now, if nothing waits ahead of it and no
        synchronous handler is running (see the module docstring); False: queue it."""
        nested = _stack.depth and not self.leaf
        if not self.sync or self._running or self._removed or nested or self.queue.qsize():
            return False  # (what waits in the queue goes first)
        if self._call(env):
            self.inline += 1
        return True

    def _call(self, env: Envelope[Any]) -> bool:
        """A synchronous handler on ``env``; False: it raised (logged and counted). A
        CancelledError from it is its own failure: nothing can cancel a plain function."""
        self._running = True
        _stack.depth += 1
        try:
            result = self.handler(env)
            if inspect.isawaitable(result):  # e.g. a lambda returning a coroutine
                getattr(result, "close", lambda: None)()
                raise BusError(f"sync handler {self.name} returned an awaitable")
            self.delivered += 1
            return True
        except (Exception, asyncio.CancelledError):
            self._failed(env)
            return False
        finally:
            _stack.depth -= 1
            self._running = False

    def _failed(self, env: Envelope[Any]) -> None:
        """One labelled line (the node keeps serving; ``handler_errors`` counts it); the
        traceback goes to DEBUG, for whoever debugs the handler."""
        self.failed += 1
        self.bus.handler_errors[self.name] += 1
        exc = sys.exc_info()[1]
        logger.error(
            "handler {} failed on {}: {}: {}",
            self.name,
            type(env.msg).__name__,
            type(exc).__name__,
            exc,
        )
        logger.opt(exception=True).debug("handler {}: traceback", self.name)

    def _offer_now(self, env: Envelope[Any], alone: bool) -> bool:
        """Deliver (``alone``: the message's only subscriber) or queue ``env`` without
        waiting; False: a full queue dropped it."""
        if alone and self._deliver_inline(env):
            return True
        try:
            self.queue.put_nowait(env)
        except asyncio.QueueFull:
            self.dropped += 1
            logger.debug("bus: {} full, dropped {}", self.name, type(env.msg).__name__)
            return False
        return True

    async def _offer(self, env: Envelope[Any], deadline: float | None, alone: bool) -> bool:
        if self.policy is Overflow.DROP or not self.queue.full():
            return self._offer_now(env, alone)  # room now (or dropped): no wait, no deadline
        if deadline is None:
            raise BusError(f"{self.name}: blocking publish needs a deadline")
        try:
            async with until(deadline, f"publish to {self.name}"):
                await self.queue.put(env)
        except DeadlineExceeded:
            raise QueueFull(f"subscription {self.name!r} stayed full past the deadline") from None
        return True

    async def _drain(self) -> None:
        while True:
            env = await self.queue.get()
            if self._removed:  # by its own handler, mid-backlog: the cancel lands later
                return
            if self.sync:
                self._call(env)
                continue
            try:
                await self.handler(env)  # type: ignore[misc]
                self.delivered += 1
            except asyncio.CancelledError:
                raise
            except Exception:
                self._failed(env)

    def unsubscribe(self) -> None:
        self.bus._remove(self)


class Bus:
    """Routes each published message to every subscription of its exact class."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._subs: dict[type[Message], list[Subscription]] = {}
        self.handler_errors: Counter[str] = Counter()
        self.unrouted: Counter[str] = Counter()
        self.closed = False

    def subscribe(
        self,
        cls: type[M] | tuple[type[Message], ...],
        handler: Callable[[Envelope[M]], Awaitable[None]] | Callable[[Envelope[M]], None],
        *,
        maxsize: int = 64,
        policy: Overflow = Overflow.BLOCK,
        name: str | None = None,
        origin: Origin = Origin.ANY,
        sync: bool = False,
        leaf: bool = False,
    ) -> Subscription:
        """Subscribe ``handler`` to one message class, or to several sharing one queue.
        ``sync=True``: ``handler`` is a plain function, called inline where it can be;
        ``leaf=True`` (with ``sync``): it publishes nothing, so it is called inline inside
        other handlers and feeds too (see the module docstring)."""
        if self.closed:
            raise BusError("bus is closed")
        classes = cls if isinstance(cls, tuple) else (cls,)
        if not classes:
            raise BusError("a subscription needs at least one message class")
        for c in classes:
            if not (isinstance(c, type) and issubclass(c, Message)):
                raise BusError(f"{c!r} is not a message class")
        if sync and inspect.iscoroutinefunction(handler):
            raise BusError("a sync=True handler must be a plain function, not a coroutine")
        if leaf and not sync:
            raise BusError("leaf=True is for a synchronous handler (sync=True)")
        label = name or getattr(handler, "__qualname__", "handler")
        sub = Subscription(
            self, tuple(dict.fromkeys(classes)), handler, maxsize, policy, label, origin, sync, leaf
        )
        sub._task = self._node.spawn(sub._drain(), name=f"bus:{sub.name}")  # may refuse
        for c in sub.classes:
            self._subs.setdefault(c, []).append(sub)
        return sub

    def _remove(self, sub: Subscription) -> None:
        sub._removed = True
        for c in sub.classes:
            subs = self._subs.get(c, [])
            if sub in subs:
                subs.remove(sub)
        if sub._task is not None:
            sub._task.cancel()

    def hears(self, cls: type[Message], source: str) -> bool:
        """Whether a message of ``cls`` from ``source`` would reach any subscription."""
        return any(s.origin.admits(source) for s in self._subs.get(cls, ()))

    def subscriptions(self) -> list[Subscription]:
        """Every subscription once (one of several classes is listed under each)."""
        return list(dict.fromkeys(s for subs in self._subs.values() for s in subs))

    async def publish(
        self, msg: Message, *, source: str = LOCAL, deadline: float | None = None
    ) -> int:
        """Offer ``msg`` to every subscriber of its class whose origin filter admits
        ``source``; return how many accepted it.

        A BLOCK subscriber that stays full past ``deadline`` raises :class:`QueueFull`.
        """
        if self.closed:
            raise BusError("bus is closed")
        subs = [s for s in self._subs.get(type(msg), ()) if s.origin.admits(source)]
        if not subs:
            self.unrouted[type(msg).__name__] += 1
            return 0
        env = Envelope(msg, source)
        # Inline delivery only to a sole subscriber: with several, a handler run inside this
        # loop could publish ahead of ``msg`` to the next one, or unsubscribe it.
        alone = len(subs) == 1
        accepted = 0
        for sub in subs:
            accepted += await sub._offer(env, deadline, alone)
        return accepted

    def publish_now(self, msg: Message, *, source: str = LOCAL) -> bool:
        """``publish`` without waiting: every subscriber that admits ``source`` takes ``msg``
        now, or -- if any queue is full -- none does and the answer is False."""
        if self.closed:
            raise BusError("bus is closed")
        subs = [s for s in self._subs.get(type(msg), ()) if s.origin.admits(source)]
        if not subs:
            self.unrouted[type(msg).__name__] += 1
            return True  # delivered to nobody, as ``publish`` would
        if any(s.queue.full() and s.policy is Overflow.BLOCK for s in subs):
            return False
        env = Envelope(msg, source)
        alone = len(subs) == 1
        for sub in subs:  # a full one is a DROP subscriber: counted, as ``publish`` does
            sub._offer_now(env, alone)
        return True

    def close(self) -> None:
        self.closed = True
        for sub in self.subscriptions():
            sub._removed = True
            if sub._task is not None:
                sub._task.cancel()
        self._subs.clear()


class Node:
    """A process's (or an embedded service's) bus plus the TaskGroup that owns every task.

    Use as ``async with Node("name") as node:``. Leaving the block cancels the node's tasks
    and waits for them; a task spawned with ``critical=True`` that fails takes the node down
    (its exception surfaces from the ``async with``); any other task's failure is logged and
    counted.
    """

    def __init__(self, name: str = "mlxcel") -> None:
        self.name = name
        self.bus = Bus(self)
        self.task_errors = 0
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closers: list[Callable[[], Awaitable[None]]] = []

    async def __aenter__(self) -> Node:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, et: Any, exc: Any, tb: Any) -> bool | None:
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception:
                logger.exception("node {}: closer failed", self.name)
        self.bus.close()
        for task in list(self._tasks):
            task.cancel()
        assert self._tg is not None
        tg, self._tg = self._tg, None
        # The body's own exception propagates as itself (not wrapped in an ExceptionGroup);
        # a failed critical task surfaces as the TaskGroup's ExceptionGroup.
        await tg.__aexit__(None, None, None)
        return None

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run ``closer`` (newest first) when the node shuts down, before tasks are cancelled."""
        self._closers.append(closer)

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str | None = None, critical: bool = False
    ) -> asyncio.Task[Any]:
        if self._tg is None:
            coro.close()
            raise BusError(f"node {self.name} is not running")
        wrapped = coro if critical else self._guard(coro, name or "task")
        try:
            task = self._tg.create_task(wrapped, name=name)
        except RuntimeError:  # the task group is shutting down: nothing new may start
            wrapped.close()
            coro.close()
            raise BusError(f"node {self.name} is closing") from None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if not critical:
            # A task cancelled before it ever ran leaves ``coro`` unstarted: close it, so no
            # "coroutine was never awaited" warning reaches the operator (a no-op otherwise).
            task.add_done_callback(lambda _t: coro.close())
        return task

    async def _guard(self, coro: Coroutine[Any, Any, Any], name: str) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self.task_errors += 1
            logger.exception("node {}: task {} failed", self.name, name)
            return None
