"""A simulated process: a production :class:`~mlxcel.reactor.bus.Node` and role service on the
virtual loop, reaching the others through a :class:`SimEndpoint` on the simulated network.

What a scenario builds here is what ``serve`` builds: the role's service (a
:class:`~mlxcel.reactor.adapter.CoreAdapter`) subscribes its core to the node's bus and carries out
its effects -- outboxes, bundling, timers, failed sends told back -- with the code that runs
over sockets. The simulator supplies only the clock (the virtual loop, and a host's skewed
clock), the fabric (this endpoint over :class:`~mlxcel.sim.network.SimNetwork`) and the
compute (each role's subclass). A crash cancels the process's life: its node closes as a
killed process's would, its connections reset; a restart builds everything anew.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from loguru import logger

from mlxcel.base.errors import BusError, ConnectFailed, SendFailed
from mlxcel.base.messages import LOCAL, Bundle, Message
from mlxcel.reactor.adapter import CoreAdapter
from mlxcel.reactor.bus import Node
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.network import SimNetwork, size_of


class SimEndpoint:
    """The :class:`~mlxcel.reactor.endpoint.Endpoint` of one incarnation of a simulated process.

    A first send to a peer dials it: a handshake round trip, refused by a dead port or by a
    host without the secret, unanswered across a partition until the send's deadline. Once
    connected, a send is written at once (``send_now``) and travels with the link's latency
    and the network's faults; a reset or a crash on either side drops the connection.
    """

    def __init__(self, proc: SimProcess) -> None:
        self.proc = proc
        self.identity = proc.identity
        self.alive = True
        self.connected: set[str] = set()
        self._lost: list[Callable[[str], None]] = []
        self._inbound: collections.deque[tuple[Message, str]] = collections.deque()
        self._wake: asyncio.Event | None = None
        self.wire_bytes = 0

    # --- what the adapter calls -----------------------------------------------------------
    def send_now(self, dest: str, msg: Message) -> bool:
        if not self.alive:
            raise SendFailed("the process is down", unsent=True)
        if dest not in self.connected:
            return False
        self._write(dest, msg)
        return True

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        net = self.proc.net
        if dest not in self.connected:
            try:
                await net.handshake(self.identity, dest, deadline)
            except ConnectFailed as exc:
                raise SendFailed(str(exc), unsent=True) from exc
            if not self.alive:
                raise SendFailed("the process is down", unsent=True)
            self.connected.add(dest)
            other = getattr(net.hosts.get(dest), "endpoint", None)
            if other is not None:
                other.connected.add(self.identity)  # the connection serves both ways
        if not self.alive:
            raise SendFailed("the process is down", unsent=True)
        self._write(dest, msg)

    def reset(self, dest: str) -> None:
        if self.alive:
            self.proc.net.reset_link(self.identity, dest)

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        self._lost.append(callback)

    def _write(self, dest: str, msg: Message) -> None:
        for item in msg.items if isinstance(msg, Bundle) else (msg,):
            self.proc.check_send(dest, item)
        self.wire_bytes += size_of(msg)
        self.proc.net.send(self.identity, dest, msg)

    # --- what the network calls -----------------------------------------------------------
    def deliver(self, msg: Message, source: str) -> None:
        """A message off the wire, onto the node's bus in arrival order (the connection
        reader's backpressure: when a subscriber is full, what follows waits behind it)."""
        node = self.proc.node
        if node is None or node.bus.closed:
            return
        if node.bus.hears(type(msg), source):  # what its core must be handed, one by one
            self.proc.delivered += len(msg.items) if isinstance(msg, Bundle) else 1
        if not self._inbound:
            try:
                if node.bus.publish_now(msg, source=source):
                    return
            except BusError:
                return
        self._inbound.append((msg, source))
        if self._wake is None:
            self._wake = asyncio.Event()
            node.spawn(self._pump(node), name=f"{self.identity}.inbound")
        self._wake.set()

    async def _pump(self, node: Node) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._inbound:
                msg, source = self._inbound[0]
                await node.bus.publish(msg, source=source)
                self._inbound.popleft()

    def lost(self, identity: str) -> None:
        self.connected.discard(identity)
        for cb in list(self._lost):
            cb(identity)


class Counted:
    """A core as its adapter sees it, counting the messages it is handed (the conservation
    invariant: what the network delivered to a process reaches its core)."""

    def __init__(self, core: Any, proc: SimProcess) -> None:
        self._core, self._proc = core, proc

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if name != "handle_bundle":
            return attr

        def handle_bundle(items: tuple[Message, ...], source: str, now: float) -> Any:
            self._proc.handed += len(items) if source != LOCAL else 0
            return attr(items, source, now)

        return handle_bundle

    def handle(self, msg: Message, source: str, now: float) -> Any:
        self._proc.handed += source != LOCAL
        return self._core.handle(msg, source, now)


class SimProcess:
    """One host's process. Subclasses build the role service (:meth:`build`) and model its
    compute; the scenario reads ``service`` and the host's records."""

    def __init__(self, identity: str, sched: Scheduler, net: SimNetwork, skew: float = 0.0) -> None:
        self.identity = identity
        self.sched = sched
        self.net = net
        self.skew = skew  # this host's clock at true time 0
        self.rate = 1.0  # how fast this host's clock runs (a drifting oscillator)
        self.up = False
        self.has_secret = True
        self.incarnation = 0
        self.errors: list[str] = []
        self.node: Node | None = None
        self.endpoint: SimEndpoint | None = None
        self.service: Any = None
        self._life: asyncio.Task[Any] | None = None
        # This incarnation's messages off the network for its core, and those handed to it.
        self.delivered = 0
        self.handed = 0

    # --- the host's clock ---------------------------------------------------------------------
    def now(self) -> float:
        return self.skew + self.sched.now * self.rate

    def loop_time(self, t: float) -> float:
        return (t - self.skew) / self.rate

    # --- life -------------------------------------------------------------------------------
    def boot(self) -> None:
        """Start the process: its node and service are built on the loop's next turn."""
        self.up = True
        self.incarnation += 1
        self.delivered = self.handed = 0
        self.endpoint = SimEndpoint(self)
        self._life = self.sched.spawn(self._live(self.endpoint), name=f"{self.identity}.life")

    async def _live(self, endpoint: SimEndpoint) -> None:
        async with Node(self.identity) as node:
            self.node = node
            await self.prepare(node)
            service = self.build(node, endpoint)
            service.clock = self
            service.core = Counted(service.core, self)
            self.service = service
            self.started(service)
            await asyncio.Event().wait()  # until the process is killed

    async def prepare(self, node: Node) -> None:
        """Before the service is built: what it stands on (a node's engine, started)."""

    def build(self, node: Node, endpoint: SimEndpoint) -> CoreAdapter:
        raise NotImplementedError

    def started(self, service: Any) -> None:
        """After the service is built (attach it, start what it runs)."""

    def crash(self) -> None:
        """The process dies (a fault): what dies with it goes (:meth:`on_crash`), then
        :meth:`kill`. A process that is down stays down."""
        if self.up:
            self.sched.trace("crash", self.identity)
            self.on_crash()
            self.kill()

    def on_crash(self) -> None:
        """What dies with the process besides its node: its compute, its clients' waits."""

    def restart(self) -> None:
        """The process starts again from nothing (a process that is up is left alone)."""
        if not self.up:
            self.sched.trace("restart", self.identity)
            self.boot()

    def kill(self) -> None:
        """The process ends at once: nothing more leaves or arrives, its node closes (its
        tasks are cancelled, its timers die with its bus) and every peer's connection with it
        resets."""
        if not self.up:
            return
        self.up = False
        if self.endpoint is not None:
            self.endpoint.alive = False
        if self.node is not None:
            self.node.bus.close()
        if self._life is not None:
            self._life.cancel()
        self.node, self.service, self.endpoint = None, None, None
        self.net.reset_connections(self.identity)

    # --- what the network and the endpoint call -------------------------------------------
    @property
    def accepting(self) -> bool:
        return self.service is not None

    def receive(self, msg: Message, source: str) -> None:
        if self.up and self.endpoint is not None:
            self.endpoint.deliver(msg, source)

    def send_failed(self, dest: str, msg: Message, reason: str) -> None:
        """Only an endpoint's dial learns of a refusal; a write is lost silently."""

    def peer_lost(self, identity: str) -> None:
        if self.up and self.endpoint is not None:
            self.endpoint.lost(identity)

    def connection_dropped(self, identity: str) -> None:
        if self.endpoint is not None:
            self.endpoint.connected.discard(identity)

    def check_send(self, dest: str, msg: Message) -> None:
        """A hook for invariants on what this host sends."""

    def conservation(self) -> list[str]:
        """Every message the network delivered to this live process was handed to its core,
        or still waits in its inboxes."""
        if self.node is None or self.endpoint is None:
            return []
        waiting = sum(sub.depth for sub in self.node.bus.subscriptions())
        waiting += sum(
            len(m.items) if isinstance(m, Bundle) else 1 for m, _ in self.endpoint._inbound
        )
        if self.delivered == self.handed + waiting:
            return []
        return [
            f"{self.identity}: the network delivered {self.delivered} message(s) for its core, "
            f"which was handed {self.handed} ({waiting} still queued)"
        ]

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a service entry point; a raise is a bug the harness reports."""
        try:
            fn(*args)
        except Exception as exc:
            self.errors.append(f"{self.identity}: {fn.__name__} raised {type(exc).__name__}: {exc}")


@contextmanager
def logged_errors() -> Iterator[list[str]]:
    """What the production code logs at ERROR or above while a scenario runs (a handler or a
    timer that raised, a runner that gave up): each is a bug, reported as a violation."""
    errors: list[str] = []

    def sink(message: Any) -> None:
        rec = message.record
        exc = rec["exception"]
        why = f" ({exc.type.__name__}: {exc.value})" if exc is not None and exc.type else ""
        errors.append(f"logged {rec['level'].name}: {rec['message']}{why}")

    handler = logger.add(sink, level="ERROR", format="{message}")
    try:
        yield errors
    finally:
        logger.remove(handler)


RUNNER_BUGS = ("runner-drop-delivery",)


@contextmanager
def runner_bugs(inject: frozenset[str]) -> Iterator[None]:
    """A bug planted in the production effect runner for one scenario (``--inject``): with
    ``runner-drop-delivery`` the first message an adapter takes off the network never
    reaches its core. The invariants must notice; the replay line plants it again."""
    if "runner-drop-delivery" not in inject:
        yield
        return
    original = CoreAdapter._on_message
    dropped: list[object] = []

    def dropping(self: CoreAdapter, env: Any) -> None:
        if not dropped and env.source != LOCAL:
            dropped.append(env.msg)
            return
        original(self, env)

    CoreAdapter._on_message = dropping  # type: ignore[method-assign]
    try:
        yield
    finally:
        CoreAdapter._on_message = original  # type: ignore[method-assign]
