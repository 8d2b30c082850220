"""Bring-up scenarios: a ``--pp-auto`` coordinator and 2-16 ``--pp-peer`` processes on the
simulated network, discovering by a static list or by beacons, with seeded faults.

The cores are the production ones (:class:`PushCore`, :class:`PeerCore`); beacons travel as
real signed datagrams over a lossy simulated UDP. Faults: lost and delayed messages, a peer
that crashes between phases (and restarts), a coordinator that crashes, a peer with another
cluster secret or another checkpoint, skewed clocks. :func:`check` holds every run to the
protocol's promise: **a bring-up activates every stage or none** (a crash during activation,
the documented exception, is the only excuse), a successful one plans exactly the peers in
address order with contiguous layers, and every party ends within its documented bounds.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass, field
from typing import Any

from mlxcel import __version__
from mlxcel.base.effects import Effect
from mlxcel.base.messages import Message
from mlxcel.bringup.beacon import BeaconGate, beacon_key, make_beacon
from mlxcel.bringup.peer_core import PeerCore, PeerFacts
from mlxcel.bringup.protocol import (
    DISCOVERY_WINDOW,
    FRAME_BOUND,
    PUSH_WINDOW,
    Activated,
    ModelIdentity,
    PeerState,
    Phase,
    PushDone,
)
from mlxcel.bringup.push_core import PushConfig, PushCore
from mlxcel.bringup.service import PeerService, PushService
from mlxcel.pipeline.cluster_config import parse_cluster_toml
from mlxcel.pipeline.partition import LayerCosts, auto_split
from mlxcel.reactor.bus import Node
from mlxcel.reactor.faults import Fault, FaultPlan
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.network import Link, SimNetwork
from mlxcel.sim.process import SimEndpoint, SimProcess, logged_errors

COORDINATOR = "10.0.0.1:19000"
SECRET = b"simulated cluster secret, 32 by."
OTHER_SECRET = b"another cluster's secret, 32 byt."
BRINGUP_FAULTS = (
    "drop",
    "delay",
    "duplicate",
    "crash-peer",
    "crash-coordinator",
    "other-secret",
    "other-model",
    "skew",
    "tight-memory",
)
# A fault that may legitimately make a bring-up fail (the others must never).
SPOILERS = frozenset(
    {"crash-peer", "crash-coordinator", "other-secret", "other-model", "skew", "tight-memory"}
)


class PeerWatch:
    """The peer core as its adapter sees it; notes each attempt it committed to."""

    def __init__(self, core: PeerCore, host: PeerHost) -> None:
        self._core, self._host = core, host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        effects = self._core.handle(msg, source, now)
        core = self._core
        if core.state is PeerState.COMMITTED and core.offer is not None:
            self._host.committed_in.add(core.offer.attempt)
        return effects


class PeerHost(SimProcess):
    """A ``--pp-peer`` process: the production :class:`PeerService` and :class:`PeerCore`,
    announcing itself with real signed beacons over a lossy simulated UDP."""

    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        facts: PeerFacts,
        key: bytes,
        target: PushHost,
        skew: float = 0.0,
    ) -> None:
        super().__init__(identity, sched, net, skew)
        self.facts, self.key, self.target = facts, key, target
        self.activations: list[tuple[int, str, float]] = []  # (attempt, node id, when)
        self.committed_in: set[int] = set()
        self.ended: str | None = None
        self.crashed_at: list[float] = []
        self.boot()

    @property
    def core(self) -> PeerCore | None:
        return self.service.peer if self.service is not None else None

    def build(self, node: Node, endpoint: SimEndpoint) -> PeerService:
        svc = PeerService(node, endpoint, PeerCore(self.facts, self.now()), self._announce)
        svc.core = PeerWatch(svc.peer, self)
        return svc

    def started(self, service: PeerService) -> None:
        service.attach()
        service.result.add_done_callback(lambda f, svc=service: self._ended(svc, f))

    def _announce(self) -> None:
        nonce = bytes(self.net.rng.getrandbits(8) for _ in range(16))
        datagram = make_beacon(
            self.key, __version__, "mlxcel-cluster", self.identity, self.now(), nonce
        )
        self.target.datagram(datagram, self.identity.rpartition(":")[0])

    def _ended(self, svc: PeerService, result: asyncio.Future[Activated]) -> None:
        if svc is not self.service or result.cancelled():
            return
        exc = result.exception()
        if exc is None:
            offer = svc.peer.offer
            assert offer is not None
            node_id = result.result().node_id
            self.activations.append((offer.attempt, node_id, self.sched.now))
            self.sched.trace("activated", self.identity, node_id)
            return
        self.ended = str(exc)
        self.sched.trace("peer-ended", self.identity)
        self.kill()  # the process exits

    def on_crash(self) -> None:
        self.crashed_at.append(self.sched.now)

    def restart(self) -> None:
        if self.ended is None:  # a peer that gave up for good stays ended
            super().restart()


class PushHost(SimProcess):
    """A ``--pp-auto`` coordinator's push: the production :class:`PushService` and
    :class:`PushCore`; its process starts at :meth:`begin`."""

    def __init__(self, identity: str, sched: Scheduler, net: SimNetwork, cfg: PushConfig) -> None:
        super().__init__(identity, sched, net)
        self.cfg = cfg
        self.done: PushDone | None = None
        self.done_at: float | None = None
        self.crashed_in: Phase | None = None
        self.udp_loss = 0.0
        self.begun = False
        self.last_core: PushCore | None = None  # what the checks read once it is gone

    @property
    def core(self) -> PushCore | None:
        return self.service.push if self.service is not None else self.last_core

    def begin(self) -> None:
        """The coordinator process starts: its push (and discovery window) begins now."""
        self.begun = True
        self.boot()

    def build(self, node: Node, endpoint: SimEndpoint) -> PushService:
        core = self.last_core = PushCore(self.cfg, self.now())
        return PushService(node, endpoint, core, verify=self._verify)

    def started(self, service: PushService) -> None:
        service.result.add_done_callback(self._done)
        service.attach()

    def _done(self, result: asyncio.Future[PushDone]) -> None:
        if not result.cancelled() and result.exception() is None:
            self.done, self.done_at = result.result(), self.sched.now
            self.sched.trace("push-done", self.done.ok)

    def datagram(self, data: bytes, source_ip: str) -> None:
        """A UDP beacon on its way here: lost with the network's drop rate, else delivered."""
        if self.net.rng.random() < max(self.udp_loss, self.net.faults.drop):
            return
        self.sched.after(self.net.link.latency, self._beacon, data, source_ip)

    def _beacon(self, data: bytes, source_ip: str) -> None:
        svc = self.service
        if svc is not None:  # nobody listens on the discovery port before the process starts
            self.call(svc.feed, svc.push.beacon(data, source_ip, self.now(), self.now()))

    async def _verify(self, address: str, deadline: float) -> None:
        """The push's liveness check: a handshake over the simulated network."""
        await self.net.handshake(self.identity, address, self.loop_time(deadline))

    def crash(self) -> None:
        if self.done is None:  # a push that has finished is no longer running
            super().crash()

    def on_crash(self) -> None:
        self.crashed_in = self.service.push.phase if self.service is not None else None


@dataclass
class BringupRun:
    sched: Scheduler
    coordinator: PushHost
    peers: list[PeerHost]
    n_layers: int
    faults: list[str]
    static: bool
    started: float = 0.0
    spoiled: set[str] = field(default_factory=set)


def build_bringup(rng: random.Random, seed: int, n_peers: int, faults: list[str]) -> BringupRun:
    sched = Scheduler()
    net = SimNetwork(sched, rng, Link(latency=rng.choice([0.0002, 0.001, 0.01])))
    n_layers = n_peers * rng.randint(1, 3) + rng.randint(0, 3)
    costs = LayerCosts(tuple(rng.choice([1000, 1000, 1200]) for _ in range(n_layers)), 500, 500, 0)
    model = ModelIdentity(f"{seed:064x}", n_layers)
    static = rng.random() < 0.5
    octets = rng.sample(range(2, 250), n_peers)  # address order differs from creation order
    addresses = [f"10.0.2.{o}:19001" for o in octets]
    cfg = PushConfig(
        attempt=rng.getrandbits(63),
        n_peers=n_peers,
        coordinator=COORDINATOR,
        version=__version__,
        cluster_name="mlxcel-cluster",
        model=model,
        costs=costs,
        peers=tuple(addresses) if static else (),
        gate=None if static else BeaconGate(beacon_key(SECRET), __version__, "mlxcel-cluster"),
    )
    push = PushHost(COORDINATOR, sched, net, cfg)
    net.add(push)
    run = BringupRun(sched, push, [], n_layers, faults, static)
    odd = rng.randrange(n_peers)  # the peer a "other-*" or "skew" fault picks
    # Every simulated peer holds the same checkpoint: split it once per stage count and memory.
    split = functools.cache(
        lambda n, mem: [(p.start, p.end) for p in auto_split(costs, n, list(mem) if mem else None)]
    )
    for i, addr in enumerate(addresses):
        ident = model
        if "other-model" in faults and i == odd:
            ident = ModelIdentity(f"{seed + 1:064x}", n_layers)
        facts = PeerFacts(
            __version__,
            "mlxcel-cluster",
            ident,
            lambda n, k, memory: split(n, tuple(memory) if memory else None)[k],
            parse_cluster_toml,
            addr.rpartition(":")[0],
            19001,
            beacons=not static,
            memory=_memory(rng, costs.total, n_peers, "tight-memory" in faults),
        )
        key = beacon_key(OTHER_SECRET if "other-secret" in faults and i == odd else SECRET)
        skew = 0.0
        if "skew" in faults and i == odd:
            skew = rng.choice([-1, 1]) * rng.uniform(61.0, 300.0)
        elif rng.random() < 0.3:
            skew = rng.uniform(-20.0, 20.0)  # harmless
        host = PeerHost(addr, sched, net, facts, key, push, skew)
        if "other-secret" in faults and i == odd:
            host.has_secret = False
        net.add(host)
        run.peers.append(host)
    return run


def _schedule(run: BringupRun, rng: random.Random) -> None:
    net, sched, plan = run.coordinator.net, run.sched, FaultPlan()
    start = run.started = rng.uniform(0.0, 5.0)  # peers may start first, or later
    sched.at(start, run.coordinator.begin)
    for kind in run.faults:
        if kind == "drop":  # short outages: the retries must carry the bring-up through
            t0 = rng.uniform(start, start + 8.0)
            on = functools.partial(setattr, net.faults, "drop", rng.uniform(0.2, 0.9))
            off = functools.partial(setattr, net.faults, "drop", 0.0)
            plan.add(Fault("drop", on, off), t0, t0 + rng.uniform(0.5, 4.0))
        elif kind == "delay":
            net.faults.delay, net.faults.delay_max = rng.uniform(0.1, 0.5), 1.0
        elif kind == "duplicate":
            net.faults.duplicate = rng.uniform(0.1, 0.4)
        elif kind == "crash-peer":
            victim = rng.choice(run.peers)
            t = rng.uniform(start, start + 3.0)
            plan.add(
                Fault(f"crash {victim.identity}", victim.crash, victim.restart),
                t,
                t + rng.uniform(0.5, 20.0),
            )
        elif kind == "crash-coordinator":  # for good: every peer must give up, cleanly
            plan.add(
                Fault("crash coordinator", run.coordinator.crash),
                rng.uniform(start, start + 3.0),
                None,
            )
    plan.install(sched.at)


def _memory(rng: random.Random, total: int, n_peers: int, tight: bool) -> int:
    """What a simulated peer says it can hold: room for the whole model and more (the split
    then follows it), nothing (an older peer: the first split stands), or -- the tight-memory
    fault -- too little for the cluster to hold the model."""
    if tight:
        return max(1, total // (2 * n_peers))
    return 0 if rng.random() < 0.25 else int(total * rng.uniform(1.0, 3.0))


def run_bringup(seed: int, n_peers: int | None = None) -> tuple[BringupRun, list[str]]:
    rng = random.Random(f"bringup:{seed}")
    n = n_peers or rng.randint(2, 16)
    faults = [BRINGUP_FAULTS[seed % len(BRINGUP_FAULTS)]]
    faults += [k for k in ("drop", "delay", "duplicate") if k not in faults and rng.random() < 0.25]
    run = build_bringup(rng, seed, n, faults)
    run.spoiled = set(faults) & SPOILERS
    if "skew" in faults and run.static:
        run.spoiled.discard("skew")  # static discovery reads no clocks
    _schedule(run, rng)

    # Past every bound: discovery, the push, a committed peer's wait, and a waiting peer's 600 s.
    # Run past every bound (discovery, the push, a committed peer's 60 s wait), or until the
    # outcome is settled: the push is over and no peer is between phases any more.
    def settled() -> bool:
        push = run.coordinator
        if push.done is None and (push.up or not push.begun):
            return False
        return not any(
            p.core is not None and p.core.state in (PeerState.ACCEPTED, PeerState.COMMITTED)
            for p in run.peers
        ) and not any(p.up is False and p.ended is None and p.crashed_at for p in run.peers)

    with logged_errors() as logged:
        run.sched.run(run.started + 700.0, settled)
        bad = check_bringup(run) + logged
        run.sched.close()
    return run, bad


def check_bringup(run: BringupRun) -> list[str]:
    bad: list[str] = []
    push = run.coordinator
    core = push.core
    if core is None:  # the coordinator never started
        return ["the coordinator never started"]
    for h in [push, *run.peers]:
        bad.extend(h.errors + h.conservation())
    attempt = core.attempt  # one more than the first when the push re-planned by memory
    activated = {p.identity: a for p in run.peers for a in p.activations}
    crashed_after_commit = any(attempt in p.committed_in and p.crashed_at for p in run.peers)
    excused = push.crashed_in is Phase.ACTIVATING or crashed_after_commit
    if activated and len(activated) != len(run.peers) and not excused:
        bad.append(f"{len(activated)} of {len(run.peers)} stages activated: {sorted(activated)}")
    if any(a[0] != attempt for a in activated.values()):
        bad.append("a stage activated for another bring-up attempt")
    if push.done is not None and push.done.ok:
        ordered = sorted(p.identity for p in run.peers)
        if sorted(activated) != ordered:
            bad.append("the coordinator reported success without every stage active")
        plan = core.plan
        assert plan is not None
        if [a.address for a in plan.stages] != ordered:
            bad.append("stage ids are not in the lexicographic order of the peer addresses")
        edges = [(a.start, a.end) for a in plan.stages]
        if (
            edges[0][0] != 0
            or edges[-1][1] != run.n_layers
            or any(x[1] != y[0] for x, y in zip(edges, edges[1:], strict=False))
        ):
            bad.append(f"the layer ranges {edges} do not cover {run.n_layers} layers")
        for p in run.peers:
            want = next(a.node_id for a in plan.stages if a.address == p.identity)
            if p.identity in activated and activated[p.identity][1] != want:
                bad.append(f"{p.identity} activated as {activated[p.identity][1]}, planned {want}")
    if push.done is not None and not push.done.ok and not excused:
        if activated:
            bad.append(f"a failed bring-up left stages running: {sorted(activated)}")
        if (
            core.phase is not Phase.ACTIVATING
            and "no stage was started" not in push.done.summary.lower()
        ):
            bad.append(f"the failure does not say that no stage started: {push.done.summary}")
    if push.up and push.done is None:
        bad.append("the coordinator never finished its push")
    bound = run.started + (0.0 if run.static else DISCOVERY_WINDOW) + PUSH_WINDOW + FRAME_BOUND
    if push.done_at is not None and push.done_at > bound + 1.0:
        bad.append(f"the push ended at {push.done_at:.1f}s, past its bound {bound:.1f}s")
    if not run.spoiled and not (push.done is not None and push.done.ok):
        why = push.done.summary if push.done else "no outcome"
        bad.append(f"a bring-up that no fault spoiled failed: {why}")
    for p in run.peers:
        state = p.core.state if p.core is not None else None
        if state in (PeerState.ACCEPTED, PeerState.COMMITTED):
            bad.append(f"{p.identity} is still {state.value} after every bound passed")
    if "other-model" in run.faults and push.done is not None and push.done.ok:
        bad.append("a peer with another checkpoint joined the cluster")
    if "tight-memory" in run.faults and push.done is not None and push.done.ok:
        bad.append("a cluster of peers that cannot hold the model was brought up")
    return bad
