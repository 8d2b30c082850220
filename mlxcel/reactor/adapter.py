"""The asyncio side of a role core: feed it the bus and a timer, carry out its effects.

A core (see :mod:`mlxcel.base.effects`) decides and never waits. :class:`CoreAdapter` is the one
place where a role touches the loop: it subscribes the core to its message classes, asks it
``next_timer()`` after every call and runs ``on_timer(now)`` when that time comes, and
carries out the effects -- sends go through per-destination outboxes, so a slow or dead
destination delays only what goes to it, never a handler. Role-specific effects (compute,
local delivery) are left to the subclass's ``apply``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from loguru import logger

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.effects import Effect, ResetPeer, Send, Warn
from mlxcel.base.errors import BusError, MlxcelError, QueueFull, SendFailed
from mlxcel.base.messages import BUNDLED, MAX_BUNDLE, Bundle, Message
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.reactor.bus import Envelope, Node, Origin, handling
from mlxcel.reactor.endpoint import Endpoint
from mlxcel.wire.codec import tensor_bytes

BUNDLE_TENSOR_BYTES = 1 << 20  # larger tensors (prompt chunks) travel alone
OUTBOX_SIZE = 1024  # messages queued for one peer before they are dropped
STRANGER_OUTBOX = 64  # refusals to non-peers, all together
MAX_OUTBOXES = 4096  # destinations with an outbox at once; a send to one more fails
OUTBOX_IDLE = 30.0  # an outbox empty this long is removed, its task ends
LOCAL_WAIT = 30.0  # a frontend inbox full this long is reported (its results keep waiting)


class Core(Protocol):
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]: ...
    def on_timer(self, now: float) -> list[Effect]: ...
    def next_timer(self) -> float | None: ...
    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]: ...
    def peer_lost(self, identity: str, now: float) -> list[Effect]: ...


class HostClock(Protocol):
    """A host's own clock, where it is not the loop's (the simulator's skewed hosts)."""

    def now(self) -> float: ...
    def loop_time(self, t: float) -> float: ...


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
        self.limiter = WarningLimiter(self.loop.time, schedule=self.loop.call_later)
        self.dropped_sends = 0
        self.expired_sends = 0
        # A send's own deadline replaces the budget instead of only shortening it (a transfer
        # bounded by its lease may take longer than the budget, which bounds the rest).
        self.deadline_overrides_budget = False
        self._outboxes: dict[str, asyncio.Queue[Send]] = {}
        # The core's next timer, armed on the loop: re-armed only when the time it names
        # changes (most calls leave it as it was), never a task woken per message.
        self._timer_at: float | None = None
        self._timer_handle: asyncio.TimerHandle | None = None
        self._timer_live = False  # from start() until the node closes
        self._sending = 0  # sends on their way out of an outbox
        # Failed sends, until the core is told (``_failed``): during a feed() only once the
        # outermost one has carried out everything, so its reaction cannot overtake what it
        # decided before.
        self._feeding = 0
        self._deferred: list[tuple[Send, str, BaseException | None]] = []
        self._busy: set[str] = set()  # outboxes whose drain holds a send
        # Roles that speak Bundle (the pipeline) set this: what piled up in one peer's outbox
        # while the reactor was busy goes out as one Bundle.
        self.bundles = False
        # A role whose sends may expire before the exchange they belong to does (the router:
        # a prompt's send waits 5 s, its request minutes) sets this: an expired send is then
        # told to the core as undeliverable (never sent), not only counted.
        self.report_expired = False
        # The host's clock, when it is not the loop's: everything the core is told and every
        # deadline it names is in this clock; only arming a loop timer converts.
        self.clock: HostClock | None = None

    def now(self) -> float:
        return self.loop.time() if self.clock is None else self.clock.now()

    def _loop_at(self, t: float) -> float:
        return t if self.clock is None else self.clock.loop_time(t)

    @property
    def timer_due(self) -> float | None:
        """When the loop timer for the core's next timer fires (None: none is armed)."""
        return self._timer_at

    @property
    def destinations(self) -> list[str]:
        """The destinations that have an outbox now (each with its queue and task)."""
        return sorted(self._outboxes)

    @property
    def running(self) -> bool:
        """Started and its node not closing: what a timer or a callback from another thread
        checks (the bus closes before any task is cancelled, so this turns false at once)."""
        return self._timer_live and not self.node.bus.closed

    def subscribe(self, classes: Iterable[type[Message]], origin: Origin, maxsize: int) -> None:
        """One inbox for ``classes``: the core sees them in the order the inbox took them, and
        a message that finds it empty reaches the core inside its publisher's call (no task
        switch; see :mod:`mlxcel.reactor.bus` for when)."""
        classes = tuple(classes)
        self.node.bus.subscribe(
            classes,
            self._on_message,
            maxsize=maxsize,
            name=f"{self.name}.{'|'.join(c.__name__ for c in classes)}",
            origin=origin,
            sync=True,
        )

    def start(self) -> None:
        """Arm the timer and listen for lost peers (call once, on a running node)."""
        # The timer lives as long as the node: its closing (the task's end) disarms it.
        lifetime = self.node.spawn(asyncio.Event().wait(), name=f"{self.name}.timer")
        lifetime.add_done_callback(self._stop_timer)
        self._timer_live = True
        self._rearm()
        self.endpoint.on_peer_lost(self._peer_lost)

    def _on_message(self, env: Envelope[Any]) -> None:
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
        if not self.running:  # the node is closing its connections: nobody left to tell
            return
        self.feed(self.core.peer_lost(identity, self.now()))

    def feed(self, effects: list[Effect]) -> None:
        """Carry out ``effects`` in order, without waiting on anything; then tell the core of
        the sends that failed meanwhile (even when an effect raised)."""
        self._feeding += 1
        # What this publishes (the in-memory fabric hands it to another node's bus) is queued
        # there, not handled inside this feed: a reply cannot overtake the rest of what this
        # feed decided.
        try:
            with handling():
                try:
                    self._carry_out(effects)
                finally:
                    if self._feeding == 1:
                        self._tell_failures()
        finally:
            self._feeding -= 1
        self._rearm()

    def _tell_failures(self) -> None:
        """The deferred failures, one after another, each reaction carried out in turn (its
        own failures join the end of the line: a loop, never a recursion)."""
        told = 0
        while self._deferred:
            send, reason, exc = self._deferred.pop(0)
            told += 1
            if told > OUTBOX_SIZE:  # a core that answers each failure with another
                logger.error("{}: failed sends keep failing; dropped", self.name)
                self._deferred.clear()
                return
            self.dropped_sends += 1
            self._carry_out(self.undeliverable(send, reason, exc))

    def _carry_out(self, effects: list[Effect]) -> None:
        sends: list[Send] = []  # a run of sends, handed over together (they may bundle)
        for effect in effects:
            if isinstance(effect, Send):
                sends.append(effect)
                continue
            if sends:
                self._send(sends)
                sends = []
            if isinstance(effect, ResetPeer):
                self.endpoint.reset(effect.dest)
            elif isinstance(effect, Warn):
                if effect.kind in ("debug", "info", "warning"):
                    logger.log(effect.kind.upper(), "{}", effect.text)
                else:
                    self.limiter.warn(effect.kind, effect.text)
            else:
                self.apply(effect)
        if sends:
            self._send(sends)

    def apply(self, effect: Effect) -> None:
        raise NotImplementedError(f"{self.name}: no handler for {type(effect).__name__}")

    def _rearm(self) -> None:
        if not self.running:
            self._stop_timer()
            return
        when = self.core.next_timer()
        if when == self._timer_at:
            return
        if self._timer_handle is not None:
            self._timer_handle.cancel()
        self._timer_at = when
        self._timer_handle = (
            None if when is None else self.loop.call_at(self._loop_at(when), self._fire)
        )

    def _fire(self) -> None:
        due = self._timer_at
        self._timer_handle, self._timer_at = None, None
        if not self.running:  # the node began closing after this call was scheduled
            self._stop_timer()
            return
        # At least the time the core asked for: a host clock converted to the loop's and back
        # may round below it, and a core told "not yet" would ask for the same time again.
        now = self.now() if due is None else max(self.now(), due)
        try:
            self.feed(self.core.on_timer(now))  # feed() arms the next one
        except Exception:  # a core bug must not take the node down; say so loudly
            logger.exception("{}: timer handling failed", self.name)
            if self.running:  # and do not spin on it: retry later, in place of any timer
                if self._timer_handle is not None:  # a nested feed() may have armed one
                    self._timer_handle.cancel()
                self._timer_at = self.now() + 0.1
                self._timer_handle = self.loop.call_at(self._loop_at(self._timer_at), self._fire)

    def _stop_timer(self, _lifetime: object = None) -> None:
        self._timer_live = False
        if self._timer_handle is not None:
            self._timer_handle.cancel()
            self._timer_handle, self._timer_at = None, None

    # --- outboxes -----------------------------------------------------------------------------
    def _send(self, sends: list[Send]) -> None:
        """Each destination's sends, in order: written at once where its outbox is empty and
        idle and the endpoint can write without waiting (most sends: no task wakes for
        them), queued behind what its outbox holds otherwise."""
        now = getattr(self.endpoint, "send_now", None)
        by_dest: dict[str, list[Send]] = {}
        for s in sends:
            key = s.dest if s.peer else "*"
            if key not in by_dest and (now is None or not s.peer or not self._idle(key)):
                self._queue_send(s)
            else:
                by_dest.setdefault(key, []).append(s)
        for items in by_dest.values():
            while items:
                first = items.pop(0)
                if self._expired(first):
                    continue
                group = [first]
                room = self._room(first)
                while room is not None and items and len(group) < MAX_BUNDLE:
                    if self._expired(items[0]):
                        items.pop(0)
                        continue
                    room = self._joins(items[0], room)
                    if room is not None:
                        group.append(items.pop(0))
                msg = first.msg if len(group) == 1 else Bundle(tuple(g.msg for g in group))
                try:
                    if now(first.dest, msg):
                        self._written(group)
                        continue
                except SendFailed as exc:
                    for g in group:
                        self._failed(g, str(exc), exc)
                    continue
                for g in group + items:  # not now: the outbox keeps the order
                    self._queue_send(g)
                items.clear()

    def _written(self, sends: list[Send]) -> None:
        """Tell the core of the written sends it asked to hear of -- on a later turn, so the
        effects it answers with never jump ahead of the rest of the batch being carried out;
        over a network, once they have mostly left the host (``Endpoint.settled``)."""
        told = [s for s in sends if s.notify]
        hook = getattr(self.core, "sent", None)
        if told and hook is not None:
            self.node.spawn(self._tell_written(hook, told), name=f"{self.name}.written")

    async def _tell_written(
        self, hook: Callable[[Send, float], list[Effect]], told: list[Send]
    ) -> None:
        settled = getattr(self.endpoint, "settled", None)
        if settled is not None:
            await settled(told[0].dest)
        if not self.running:
            return
        now = self.now()
        effects: list[Effect] = []
        for s in told:
            effects += hook(s, now)
        self.feed(effects)

    def _idle(self, key: str) -> bool:
        """Nothing waits in the outbox for ``key`` or is on its way out of it."""
        box = self._outboxes.get(key)
        return key not in self._busy and (box is None or box.empty())

    def _queue_send(self, send: Send) -> None:
        key = send.dest if send.peer else "*"
        box = self._outboxes.get(key)
        if box is None:
            if len(self._outboxes) >= MAX_OUTBOXES:
                self.limiter.warn(
                    "noise",
                    f"{self.name}: {MAX_OUTBOXES} destinations have sends queued; "
                    f"not queueing for {send.dest}",
                )
                self._failed(send, f"{MAX_OUTBOXES} destinations already have sends queued")
                return
            box = self._outboxes[key] = asyncio.Queue(OUTBOX_SIZE if send.peer else STRANGER_OUTBOX)
            self.node.spawn(self._drain(key, box, send.peer), name=f"{self.name}.out:{key}")
        try:
            box.put_nowait(send)
        except asyncio.QueueFull:
            self._failed(send, f"the outbox for {send.dest} is full")

    def _failed(self, send: Send, reason: str, exc: BaseException | None = None) -> None:
        """Tell the core ``send`` failed: at the end of the ``feed()`` under way, if any."""
        self._deferred.append((send, reason, exc))
        if not self._feeding:
            self.feed([])

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
            self.expired_sends += 1  # do not hold the line for it
            if self.report_expired:
                self._failed(
                    send, f"not sent before its deadline: the queue for {send.dest} did not move"
                )
            return True
        return False

    def _room(self, first: Send) -> int | None:
        """Tensor bytes left in ``first``'s Bundle; None: it travels alone."""
        if not (self.bundles and first.peer and type(first.msg) in BUNDLED):
            return None
        return BUNDLE_TENSOR_BYTES - tensor_bytes(first.msg)

    def _joins(self, nxt: Send, room: int) -> int | None:
        """The room left once ``nxt`` joins a Bundle with ``room``; None: it may not."""
        if type(nxt.msg) not in BUNDLED:
            return None
        size = tensor_bytes(nxt.msg)
        return room - size if size <= room else None

    def _more(self, box: asyncio.Queue[Send], first: Send) -> tuple[list[Send], Send | None]:
        """``first`` and whatever is queued behind it that may share its Bundle, and the first
        queued send that may not (it goes next, on its own turn)."""
        sends = [first]
        room = self._room(first)
        while room is not None and len(sends) < MAX_BUNDLE and not box.empty():
            nxt = box.get_nowait()
            if self._expired(nxt):
                continue
            room = self._joins(nxt, room)
            if room is None:
                return sends, nxt
            sends.append(nxt)
        return sends, None

    async def _drain(self, key: str, box: asyncio.Queue[Send], peer: bool) -> None:
        budget = self.send_budget if peer else 1.0
        held: Send | None = None
        while True:
            if held is None:
                self._busy.discard(key)
                if box.empty():
                    try:
                        # Awaited inline (not wait_for, which on 3.11 takes the item in a task
                        # of its own: the box would look idle while the item is on its way,
                        # and a later send could overtake it, or flush() return before it).
                        async with asyncio.timeout(OUTBOX_IDLE):
                            first = await box.get()
                    except TimeoutError:
                        if box.empty():  # idle: a destination nobody sends to costs nothing
                            if self._outboxes.get(key) is box:
                                del self._outboxes[key]
                            return
                        first = box.get_nowait()
                else:
                    first = box.get_nowait()
                self._busy.add(key)  # until it waits again: nothing may pass it meanwhile
            else:  # it waited outside the box: counted as sending, so flush() waits for it
                first, held = held, None
                self._sending -= 1
            if self._expired(first):
                continue
            sends, held = self._more(box, first)
            self._sending += held is not None
            deadline = self.now() + budget
            ends = [s.deadline for s in sends if s.deadline is not None]
            if len(ends) == len(sends):  # the bundle is worth sending while any item is
                over = self.deadline_overrides_budget
                deadline = max(ends) if over else min(deadline, max(ends))
            msg = first.msg if len(sends) == 1 else Bundle(tuple(s.msg for s in sends))
            self._sending += 1
            try:
                await self.endpoint.send(first.dest, msg, self._loop_at(deadline))
            except (SendFailed, MlxcelError) as exc:
                for s in sends:
                    self._failed(s, str(exc), exc)
            else:
                self._written(sends)
            finally:
                self._sending -= 1
                if not peer:
                    # A refusal to someone who is not a peer travels on a one-off connection:
                    # addresses a member claims cannot pile up here.
                    self.endpoint.reset(first.dest)


class LocalOutbox:
    """What a role hands this node's frontend (``Deliver``): in order, without waiting, and
    never dropped.

    A message goes to the bus at once (``publish_now``; the frontend's subscription is a leaf,
    so its handler runs inside that call). Only when the frontend's inbox is full -- or
    something already waits here -- does it wait here, and everything after it waits behind
    it, published in order by this outbox's task. What can wait is bounded by construction,
    not by a count: each request in flight has at most ``max_tokens + 2`` results, and the
    frontend's inbox drains on every turn of the loop.
    """

    def __init__(self, node: Node, name: str) -> None:
        self.node = node
        self.name = name
        self._queue: collections.deque[Message] = collections.deque()
        self._wake = asyncio.Event()
        self.waited = 0  # messages that could not go to the bus at once

    def start(self) -> None:
        self.node.spawn(self._run(), name=f"{self.name}.local", critical=True)

    def put(self, msg: Message) -> None:
        if self.node.bus.closed:  # the node is closing: nobody is left to read it
            return
        if not self._queue and self.node.bus.publish_now(msg):
            return
        self.waited += 1
        self._queue.append(msg)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                msg = self._queue[0]
                try:
                    await self.node.bus.publish(msg, deadline=deadline_in(LOCAL_WAIT))
                except QueueFull:  # (a BusError too: caught first, or the outbox would end)
                    # The frontend took nothing for that long: a bug, said loudly; the
                    # result still waits its turn (the request's own deadline ends it).
                    logger.error(
                        "{}: the frontend took nothing for {:g}s; {} result(s) wait",
                        self.name,
                        LOCAL_WAIT,
                        len(self._queue),
                    )
                    continue
                except BusError:  # closed meanwhile: nobody is left to read what waits
                    return
                self._queue.popleft()
