"""The asyncio side of a role core: feed it the bus and a timer, carry out its effects.

A core (see :mod:`mlxcel.effects`) decides and never waits. :class:`CoreAdapter` is the one
place where a role touches the loop: it subscribes the core to its message classes, asks it
``next_timer()`` after every call and runs ``on_timer(now)`` when that time comes, and
carries out the effects -- sends go through per-destination outboxes, so a slow or dead
destination delays only what goes to it, never a handler. Role-specific effects (compute,
local delivery) are left to the subclass's ``apply``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from loguru import logger

from mlxcel.bus import Envelope, Node, Origin
from mlxcel.deadlines import deadline_in
from mlxcel.effects import Effect, ResetPeer, Send, Warn
from mlxcel.endpoint import Endpoint, SendFailed
from mlxcel.errors import MlxcelError, QueueFull
from mlxcel.messages import BUNDLED, MAX_BUNDLE, Bundle, Message
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.wire.codec import tensor_bytes

BUNDLE_TENSOR_BYTES = 1 << 20  # larger tensors (prompt chunks) travel alone
OUTBOX_SIZE = 1024  # messages queued for one peer before they are dropped
STRANGER_OUTBOX = 64  # refusals to non-peers, all together
LOCAL_OUTBOX = 4096  # results on their way to the frontend (it drains them at once)


class Core(Protocol):
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]: ...
    def on_timer(self, now: float) -> list[Effect]: ...
    def next_timer(self) -> float | None: ...
    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]: ...
    def peer_lost(self, identity: str, now: float) -> list[Effect]: ...


class CoreAdapter:
    def __init__(
        self, node: Node, endpoint: Endpoint, core: Core, name: str, send_budget: float
    ) -> None:
        self.node = node
        self.endpoint = endpoint
        self.core = core
        self.name = name
        self.send_budget = send_budget
        self.loop = asyncio.get_running_loop()
        self.limiter = WarningLimiter(self.loop.time)
        self.dropped_sends = 0
        self.expired_sends = 0
        # A send's own deadline replaces the budget instead of only shortening it (a transfer
        # bounded by its lease may take longer than the budget, which bounds the rest).
        self.deadline_overrides_budget = False
        self._outboxes: dict[str, asyncio.Queue[Send]] = {}
        self._timer_changed = asyncio.Event()
        self._sending = 0  # sends on their way out of an outbox
        # Roles that speak Bundle (the pipeline) set this: what piled up in one peer's outbox
        # while the reactor was busy goes out as one Bundle.
        self.bundles = False

    def now(self) -> float:
        return self.loop.time()

    def subscribe(self, classes: Iterable[type[Message]], origin: Origin, maxsize: int) -> None:
        for cls in classes:
            self.node.bus.subscribe(
                cls,
                self._on_message,
                maxsize=maxsize,
                name=f"{self.name}.{cls.__name__}",
                origin=origin,
            )

    def start(self) -> None:
        """Arm the timer and listen for lost peers (call once, on a running node)."""
        self.node.spawn(self._timer(), name=f"{self.name}.timer", critical=True)
        self.endpoint.on_peer_lost(self._peer_lost)

    async def _on_message(self, env: Envelope[Any]) -> None:
        msg, now = env.msg, self.now()
        if isinstance(msg, Bundle):
            bundle = getattr(self.core, "handle_bundle", None)
            if bundle is not None:  # a core that batches decides once, after every item
                self.feed(bundle(msg.items, env.source, now))
            else:
                for item in msg.items:
                    self.feed(self.core.handle(item, env.source, now))
            return
        self.feed(self.core.handle(msg, env.source, now))

    def _peer_lost(self, identity: str) -> None:
        self.feed(self.core.peer_lost(identity, self.now()))

    def feed(self, effects: list[Effect]) -> None:
        """Carry out ``effects`` in order, without waiting on anything."""
        for effect in effects:
            if isinstance(effect, Send):
                self._queue_send(effect)
            elif isinstance(effect, ResetPeer):
                self.endpoint.reset(effect.dest)
            elif isinstance(effect, Warn):
                if effect.kind in ("debug", "info", "warning"):
                    logger.log(effect.kind.upper(), "{}", effect.text)
                else:
                    self.limiter.warn(effect.kind, effect.text)
            else:
                self.apply(effect)
        self._timer_changed.set()

    def apply(self, effect: Effect) -> None:
        raise NotImplementedError(f"{self.name}: no handler for {type(effect).__name__}")

    async def _timer(self) -> None:
        while True:
            self._timer_changed.clear()
            when = self.core.next_timer()
            if when is not None and when <= self.now():
                try:
                    self.feed(self.core.on_timer(self.now()))
                except Exception:  # a core bug must not take the node down; say so loudly
                    logger.exception("{}: timer handling failed", self.name)
                    await asyncio.sleep(0.1)  # and do not spin on it
                await asyncio.sleep(0)  # let the loop breathe between bursts
                continue
            try:
                async with asyncio.timeout_at(when):
                    await self._timer_changed.wait()
            except TimeoutError:
                pass

    # --- outboxes -----------------------------------------------------------------------------
    def _queue_send(self, send: Send) -> None:
        key = send.dest if send.peer else "*"
        box = self._outboxes.get(key)
        if box is None:
            box = self._outboxes[key] = asyncio.Queue(OUTBOX_SIZE if send.peer else STRANGER_OUTBOX)
            self.node.spawn(self._drain(box, send.peer), name=f"{self.name}.out:{key}")
        try:
            box.put_nowait(send)
        except asyncio.QueueFull:
            self._failed(send, f"the outbox for {send.dest} is full")

    def _failed(self, send: Send, reason: str, exc: BaseException | None = None) -> None:
        self.dropped_sends += 1
        self.feed(self.undeliverable(send, reason, exc))

    def undeliverable(self, send: Send, reason: str, exc: BaseException | None) -> list[Effect]:
        """Tell the core; a role whose core needs more than the reason (``exc``) overrides."""
        return self.core.undeliverable(send, reason, self.now())

    def discard_queued(self, drop: Callable[[Send], bool]) -> int:
        """Remove queued sends for which ``drop`` is true (a role that finished early does not
        want what it queued before); returns how many."""
        dropped = 0
        for box in self._outboxes.values():
            keep = []
            while not box.empty():
                s = box.get_nowait()
                if drop(s):
                    dropped += 1
                else:
                    keep.append(s)
            for s in keep:
                box.put_nowait(s)
        return dropped

    async def flush(self, deadline: float) -> bool:
        """Wait until every queued send went out (or failed), up to ``deadline``: a role that
        is about to close its node lets its last answers leave first."""
        while any(not box.empty() for box in self._outboxes.values()) or self._sending:
            if self.now() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def _expired(self, send: Send) -> bool:
        if send.deadline is not None and send.deadline <= self.now():
            self.expired_sends += 1  # its exchange is over: do not hold the line
            return True
        return False

    def _more(self, box: asyncio.Queue[Send], first: Send) -> tuple[list[Send], Send | None]:
        """``first`` and whatever is queued behind it that may share its Bundle, and the first
        queued send that may not (it goes next, on its own turn)."""
        sends = [first]
        if not (self.bundles and first.peer and type(first.msg) in BUNDLED):
            return sends, None
        room = BUNDLE_TENSOR_BYTES - tensor_bytes(first.msg)
        while len(sends) < MAX_BUNDLE and not box.empty():
            nxt = box.get_nowait()
            if self._expired(nxt):
                continue
            size = tensor_bytes(nxt.msg) if type(nxt.msg) in BUNDLED else room + 1
            if size > room:
                return sends, nxt
            sends.append(nxt)
            room -= size
        return sends, None

    async def _drain(self, box: asyncio.Queue[Send], peer: bool) -> None:
        budget = self.send_budget if peer else 1.0
        held: Send | None = None
        while True:
            if held is None:
                first = await box.get()
            else:  # it waited outside the box: counted as sending, so flush() waits for it
                first, held = held, None
                self._sending -= 1
            if self._expired(first):
                continue
            sends, held = self._more(box, first)
            self._sending += held is not None
            deadline = deadline_in(budget)
            ends = [s.deadline for s in sends if s.deadline is not None]
            if len(ends) == len(sends):  # the bundle is worth sending while any item is
                over = self.deadline_overrides_budget
                deadline = max(ends) if over else min(deadline, max(ends))
            msg = first.msg if len(sends) == 1 else Bundle(tuple(s.msg for s in sends))
            self._sending += 1
            try:
                await self.endpoint.send(first.dest, msg, deadline)
            except (SendFailed, MlxcelError) as exc:
                for s in sends:
                    self._failed(s, str(exc), exc)
            finally:
                self._sending -= 1
                if not peer:
                    # A refusal to someone who is not a peer travels on a one-off connection:
                    # addresses a member claims cannot pile up here.
                    self.endpoint.reset(first.dest)


class LocalOutbox:
    """What a role hands this node's frontend (``Deliver``): queued without waiting, so a core
    call never blocks, and published on the bus in order."""

    def __init__(self, node: Node, name: str) -> None:
        self.node = node
        self.name = name
        self._queue: asyncio.Queue[Message] = asyncio.Queue(LOCAL_OUTBOX)

    def start(self) -> None:
        self.node.spawn(self._run(), name=f"{self.name}.local", critical=True)

    def put(self, msg: Message) -> None:
        try:
            self._queue.put_nowait(msg)
        except asyncio.QueueFull:
            logger.error("{}: local outbox full; dropping {}", self.name, type(msg).__name__)

    async def _run(self) -> None:
        while True:
            msg = await self._queue.get()
            try:
                await self.node.bus.publish(msg, deadline=deadline_in(30))
            except QueueFull:
                logger.error(
                    "{}: the frontend stayed full; dropped a {}", self.name, type(msg).__name__
                )
