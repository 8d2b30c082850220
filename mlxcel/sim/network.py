"""An in-memory cluster network on virtual time, with seeded faults.

It stands in for :mod:`mlxcel.net`: a message sent from one host reaches another after the
link's latency plus its size over the bandwidth, carrying the sender's *authenticated*
identity, as a cluster connection does. A host without the cluster secret never gets a
message delivered (its handshakes fail) and gets none delivered to it. Faults, all drawn from
the scenario's seeded RNG: loss, extra delay, duplication, reordering, partitions (and
heals). Connections to a host that is down fail; a crash resets every connection of that host,
which its peers learn as a lost peer, like a TCP reset.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Protocol

from mlxcel.base.errors import ConnectFailed
from mlxcel.base.messages import Activation, Bundle, Message, RunResult, StepActivation
from mlxcel.sim.clock import Scheduler
from mlxcel.wire.handshake_fields import Failure


class Host(Protocol):
    identity: str
    up: bool
    has_secret: bool

    def receive(self, msg: Message, source: str) -> None: ...
    def send_failed(self, dest: str, msg: Message, reason: str) -> None: ...
    def peer_lost(self, identity: str) -> None: ...


@dataclass
class Link:
    latency: float = 0.0005  # seconds, one way
    bandwidth: float = 1.25e9  # bytes per second (10 Gbit/s)
    loss: float = 0.0  # probability a message is lost


@dataclass
class Faults:
    """What the network does wrong right now (the scenario switches these on and off)."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0  # probability of an extra delay of up to ``delay_max``
    delay_max: float = 0.5
    reorder: float = 0.0  # probability a message skips the link's FIFO order


def size_of(msg: Message) -> int:
    """Bytes on the wire, roughly: a header plus any tensor."""
    if isinstance(msg, Bundle):
        return 96 + sum(size_of(m) for m in msg.items)
    if isinstance(msg, Activation | StepActivation):
        return 96 + msg.hidden.nbytes
    if isinstance(msg, RunResult) and msg.logits is not None:
        return 96 + msg.logits.nbytes
    return 96


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


class SimNetwork:
    def __init__(self, sched: Scheduler, rng: random.Random, link: Link | None = None) -> None:
        self.sched = sched
        self.rng = rng
        self.link = link or Link()
        self.faults = Faults()
        self.hosts: dict[str, Host] = {}
        self.partitions: list[tuple[frozenset[str], frozenset[str]]] = []
        self._fifo: dict[tuple[str, str], float] = {}  # link -> last arrival time
        self._epochs: dict[tuple[str, str], int] = {}  # host pair -> connections reset so far
        self.sent = 0
        self.bundles = 0
        self.delivered = 0
        self.lost = 0
        self.refused = 0  # messages from or to a host without the secret
        self.bytes = 0
        self.in_flight = 0
        self.max_in_flight = 0

    def add(self, host: Host) -> None:
        self.hosts[host.identity] = host

    def cut(self, a: frozenset[str], b: frozenset[str]) -> None:
        self.partitions.append((a, b))
        self.sched.trace("partition", sorted(a), sorted(b))

    def heal(self) -> None:
        self.partitions.clear()
        self.sched.trace("heal")

    def parted(self, src: str, dst: str) -> bool:
        return any((src in a and dst in b) or (src in b and dst in a) for a, b in self.partitions)

    def send(self, src: str, dst: str, msg: Message) -> None:
        sender = self.hosts[src]
        if not sender.up:
            return
        self.sent += 1
        self.bundles += isinstance(msg, Bundle)
        receiver = self.hosts.get(dst)
        if receiver is None or not receiver.up:
            # Nobody listens there: the dial fails after a round trip.
            why = "connection refused" if receiver is not None else "no such host"
            self.sched.after(2 * self.link.latency, sender.send_failed, dst, msg, why)
            return
        if not (sender.has_secret and receiver.has_secret):
            self.refused += 1
            self.sched.trace("refused", src, dst, type(msg).__name__)
            self.sched.after(
                2 * self.link.latency, sender.send_failed, dst, msg, "handshake refused"
            )
            return
        rng, f = self.rng, self.faults
        if self.parted(src, dst) or rng.random() < self.link.loss or rng.random() < f.drop:
            self.lost += 1
            self.sched.trace("lost", src, dst, type(msg).__name__)
            return
        size = size_of(msg)
        self.bytes += size
        arrive = self.sched.now + self.link.latency + size / self.link.bandwidth
        if rng.random() < f.delay:
            arrive += rng.uniform(0, f.delay_max)
        key = (src, dst)
        if rng.random() < f.reorder:
            arrive += rng.uniform(0, 10 * self.link.latency)  # may overtake or be overtaken
        else:
            arrive = max(arrive, self._fifo.get(key, 0.0))  # a stream keeps its order
            self._fifo[key] = arrive
        self._post(arrive, src, dst, msg)
        if rng.random() < f.duplicate:
            self._post(arrive + rng.uniform(0, f.delay_max), src, dst, msg)

    def _post(self, when: float, src: str, dst: str, msg: Message) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        conn = (getattr(self.hosts[dst], "incarnation", 0), self._epochs.get(_pair(src, dst), 0))
        self.sched.at(when, self._arrive, src, dst, msg, conn)

    def _arrive(self, src: str, dst: str, msg: Message, conn: tuple[int, int]) -> None:
        self.in_flight -= 1
        host = self.hosts[dst]
        now_conn = (getattr(host, "incarnation", 0), self._epochs.get(_pair(src, dst), 0))
        if not host.up or now_conn != conn or self.parted(src, dst):
            self.lost += 1  # the connection it travelled on died (a crash or a reset)
            return
        self.delivered += 1
        self.sched.trace(
            "msg",
            src,
            dst,
            type(msg).__name__,
            getattr(msg, "request_id", ""),
            getattr(msg, "nonce", ""),
        )
        host.receive(msg, src)

    async def handshake(self, src: str, dst: str, deadline: float) -> None:
        """An authenticated handshake of ``src`` with ``dst`` (a dial, a probe, a bring-up
        check): answered after a round trip by a live holder of the secret, refused after one
        by a dead port or another secret, unanswered across a partition until ``deadline``
        (the loop's clock). Raises :class:`ConnectFailed` saying which."""
        await asyncio.sleep(2 * self.link.latency)
        peer, me = self.hosts.get(dst), self.hosts.get(src)
        if peer is None or not peer.up or not getattr(peer, "accepting", True):
            raise ConnectFailed(f"connecting to {dst}: connection refused")
        if self.parted(src, dst):  # SYNs go nowhere until the deadline
            await asyncio.sleep(max(0.0, deadline - self.sched.now))
            raise ConnectFailed(f"connecting to {dst}: timed out")
        if not (peer.has_secret and (me is None or me.has_secret)):
            raise ConnectFailed(f"handshake with {dst} failed", failure=Failure.SECRET_MISMATCH)

    def reset_link(self, closer: str, peer: str) -> None:
        """``closer`` closes its connections with ``peer`` on purpose: what is in flight
        between them is lost, and ``peer`` (not ``closer``) sees a lost peer."""
        self.sched.trace("reset", closer, peer)
        key = _pair(closer, peer)
        self._epochs[key] = self._epochs.get(key, 0) + 1
        self._drop(closer, peer)
        self._drop(peer, closer)
        other = self.hosts.get(peer)
        if other is not None and other.up:
            self.sched.after(self.link.latency, other.peer_lost, closer)

    def reset_connections(self, identity: str) -> None:
        """``identity`` crashed or restarted: each peer sees its connection drop."""
        for other in self.hosts.values():
            if other.identity != identity:
                self._drop(other.identity, identity)
                if other.up:
                    self.sched.after(self.link.latency, other.peer_lost, identity)

    def _drop(self, host: str, peer: str) -> None:
        """``host`` forgets its connection with ``peer`` (the next send dials anew)."""
        drop = getattr(self.hosts.get(host), "connection_dropped", None)
        if drop is not None:
            drop(peer)
