"""The ``--pp-auto N`` side of the assignment protocol, as a pure core.

It resolves N peers (a static list, or beacons judged by :class:`BeaconGate` for up to 30 s;
a beaconing peer counts only once an authenticated handshake with its advertised address
succeeded, so a replayed beacon cannot stand in for a peer that left), plans the cluster, then
drives every peer through Offer -> Commit -> Activate: it commits only once every peer
accepted and activates only once every peer committed. Peers accept with the memory they can
hold; once every peer said it, the model is split again by those figures and offered again
(a new attempt) -- or, when it cannot fit them, the bring-up fails with the figures before
anything was committed. A dry run stops there: it aborts its offers and returns the plan.
Any refusal, a peer that cannot be reached for good (another secret, an identity it does not
own), or a phase deadline fails the bring-up: every peer that accepted or committed gets Abort
with the summary and goes back to waiting, so a failed bring-up starts no stage anywhere.
Offers are repeated every 0.5 s to a peer that has not answered (it may not be listening yet),
Commit and Activate every second; the peer answers repeats again, so a lost frame costs one
retry.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from mlxcel.base.effects import Effect, Send, Warn
from mlxcel.base.errors import BeaconRejected, IllegalTransition, PartitionError
from mlxcel.base.messages import (
    AssignAbort,
    AssignAccepted,
    AssignActivate,
    AssignActivated,
    AssignCommit,
    AssignCommitted,
    AssignOffer,
    AssignRefused,
    Message,
)
from mlxcel.bringup.plan import BringupPlan, make_plan
from mlxcel.bringup.protocol import (
    DISCOVERY_WINDOW,
    FRAME_BOUND,
    HANDSHAKE_BOUND,
    OFFER_RETRY,
    PHASE_RETRY,
    PHASE_TABLE,
    PROTOCOL,
    PUSH_WINDOW,
    STEP_TABLE,
    VERIFY_AGAIN,
    BeaconCheck,
    ModelIdentity,
    PeerAnswer,
    PeerStep,
    Phase,
    PhaseEvent,
    PushDone,
    Rejection,
    Verify,
)
from mlxcel.pipeline.partition import LayerCosts, human_bytes


@dataclass(frozen=True)
class PushConfig:
    attempt: int  # random per bring-up: answers to another attempt are stale
    n_peers: int
    coordinator: str  # control address (IP:port), the identity the handshake binds
    version: str
    cluster_name: str
    model: ModelIdentity
    costs: LayerCosts
    peers: tuple[str, ...] = ()  # static discovery; empty: beacons
    # Judges a beacon datagram (bringup.beacon.BeaconGate, built on the cluster's beacon key):
    # None with static peers.
    gate: BeaconCheck | None = None
    secret_file: str | None = None
    discovery_window: float = DISCOVERY_WINDOW
    push_window: float = PUSH_WINDOW
    # Resolve the peers, offer, plan by their memory, then abort: nothing is committed.
    dry_run: bool = False


@dataclass
class Peer:
    address: str
    node_id: str
    step: PeerStep = PeerStep.UNANSWERED
    why: str = ""  # what went wrong, for the summary
    retry_at: float = 0.0
    memory: int = 0  # the bytes it said it can hold (0: not said)


@dataclass
class Outcome:
    ok: bool
    summary: str
    plan: BringupPlan | None = None
    at: float = 0.0


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PushCore:
    def __init__(self, cfg: PushConfig, now: float) -> None:
        self.cfg = cfg
        self.phase = Phase.DISCOVERING
        self.started = now
        self.found: list[str] = []
        self.checking: set[str] = set()  # beaconed addresses whose handshake is under way
        self.dropped: dict[str, str] = {}  # address -> why its check failed (for the summary)
        self._check_again: dict[str, float] = {}  # address -> when it may be checked again
        self.gate = cfg.gate
        self.plan: BringupPlan | None = None
        self.by_memory = False  # the plan offered now is split by the peers' memory
        self.attempt = cfg.attempt  # the offer round answers must carry (one more if replanned)
        self.peers: dict[str, Peer] = {}
        self.outcome: Outcome | None = None
        self.push_start = now
        self._deadline = now + (cfg.discovery_window if not cfg.peers else 0.0)
        if cfg.peers:
            self.found = list(dict.fromkeys(cfg.peers))

    # --- the core interface --------------------------------------------------------------------
    def start(self, now: float) -> list[Effect]:
        """Static discovery starts pushing at once; beacons wait for ``beacon``."""
        if self.cfg.peers:
            return self._resolved(now)
        return [
            Warn(
                "info",
                f"discovery: listening for {self.cfg.n_peers} peers' beacons "
                f"for {self.cfg.discovery_window:g} s",
            )
        ]

    def beacon(self, datagram: bytes, source_ip: str, now: float, wall: float) -> list[Effect]:
        if self.phase is not Phase.DISCOVERING or self.gate is None:
            return []
        try:
            address = self.gate.check(datagram, source_ip, wall)
        except BeaconRejected as exc:
            # another cluster on the same network is not an anomaly: note it quietly
            kind = "debug" if exc.why is Rejection.CLUSTER else "diagnostic"
            return [Warn(kind, f"discovery: {exc}")]
        if address in self.found or address in self.checking:
            return []
        if now < self._check_again.get(address, now):
            return []
        self.checking.add(address)
        return [
            Warn("debug", f"discovery: beacon from {address}; checking that it answers"),
            Verify(address, min(now + HANDSHAKE_BOUND, self._deadline)),
        ]

    def verified(self, address: str, why: str | None, now: float) -> list[Effect]:
        """The handshake with a beaconed ``address`` succeeded (``why`` None) or failed."""
        if address not in self.checking:
            return []
        self.checking.discard(address)
        if self.phase is not Phase.DISCOVERING:
            return []
        if why is not None:
            self.dropped[address] = why
            self._check_again[address] = now + VERIFY_AGAIN
            return [
                Warn(
                    "discovery-drop",
                    f"discovery: dropping {address}: its beacon is genuine but nothing holding "
                    f"the secret answers there ({why}); a peer that left, or a replayed beacon",
                )
            ]
        self.dropped.pop(address, None)
        self.found.append(address)
        out: list[Effect] = [
            Warn("info", f"discovery: peer {address} ({len(self.found)} of {self.cfg.n_peers})")
        ]
        if len(self.found) == self.cfg.n_peers:
            out += self._resolved(now)
        return out

    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        peer = self.peers.get(source)
        attempt = getattr(msg, "attempt", None)
        if peer is None or attempt != self.attempt or self.outcome is not None:
            return [Warn("debug", f"assignment: ignoring {type(msg).__name__} from {source}")]
        if isinstance(msg, AssignRefused):
            return self._peer_failed(peer, f"refused: {msg.reason}", now)
        answer = {
            AssignAccepted: PeerAnswer.ACCEPTED,
            AssignCommitted: PeerAnswer.COMMITTED,
            AssignActivated: PeerAnswer.ACTIVATED,
        }.get(type(msg))
        if answer is None:
            return [Warn("debug", f"assignment: ignoring {type(msg).__name__} from {source}")]
        if isinstance(msg, AssignAccepted) and msg.protocol != PROTOCOL:
            return self._peer_failed(
                peer,
                f"assignment protocol mismatch: it speaks version "
                f"{msg.protocol}, this coordinator {PROTOCOL}",
                now,
            )
        try:
            peer.step = STEP_TABLE.next(peer.step, answer)
        except IllegalTransition as ill:
            return [Warn("diagnostic", f"assignment: {source}: {ill}")]
        if isinstance(msg, AssignAccepted):
            peer.memory = max(0, msg.memory)
        peer.why = ""  # it answered: an earlier failed send is no "last attempt" any more
        return self._advance(now)

    def next_timer(self) -> float | None:
        if self.outcome is not None:
            return None
        retries = [p.retry_at for p in self.peers.values() if self._waiting_on(p)]
        return min([self._deadline, *retries])

    def on_timer(self, now: float) -> list[Effect]:
        if self.outcome is not None:
            return []
        if now >= self._deadline:
            return self._fail(PhaseEvent.DEADLINE, self._deadline_summary(), now)
        out: list[Effect] = []
        for p in self.peers.values():
            if self._waiting_on(p) and now >= p.retry_at:
                out += self._send_phase(p, now)
        return out

    def undeliverable(
        self, send: Send, reason: str, now: float, final: bool = False
    ) -> list[Effect]:
        peer = self.peers.get(send.dest)
        if peer is None or self.outcome is not None or isinstance(send.msg, AssignAbort):
            return []
        if final and self.phase is not Phase.ACTIVATING:
            # another secret, an identity it does not own: retrying cannot help. (While
            # activating, a peer that already activated serves the transport channel on that
            # port, so a repeated Activate fails its handshake: its answer decides, or the
            # deadline does.)
            return self._peer_failed(peer, f"cannot be reached: {reason}", now)
        if peer.why != reason:  # a new reason: say it once, at info; repeats go to debug
            peer.why = reason
            return [Warn("info", f"assignment: {peer.node_id} at {peer.address}: {reason}")]
        return [Warn("debug", f"assignment: {peer.node_id} at {peer.address}: {reason}")]

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        peer = self.peers.get(identity)
        if peer is None or self.outcome is not None or self.phase is Phase.ACTIVATING:
            # An activated peer closes the assignment channel at once: its close may be seen
            # before its Activated answer is read. Activation is settled by answers and the
            # deadline, never by a closed connection.
            return []
        if peer.step in (PeerStep.ACCEPTED, PeerStep.COMMITTED):
            # The peer drops its acceptance when our connection closes: start over is not ours.
            return self._peer_failed(peer, "connection lost before activation", now)
        return []

    # --- phases ------------------------------------------------------------------------------
    def _resolved(self, now: float) -> list[Effect]:
        c = self.cfg
        if is_loopback(c.coordinator):
            remote = [a for a in self.found if not is_loopback(a)]
            if remote:
                return self._fail(
                    PhaseEvent.PEER_FAILED,
                    (
                        f"the coordinator's control address {c.coordinator} is loopback but peer(s) "
                        f"{', '.join(remote)} are not: stages could not reply to it (serve on a "
                        "reachable --host or give --cluster-control-addr)"
                    ),
                    now,
                )
        try:
            self.plan = make_plan(c.cluster_name, c.coordinator, self.found, c.costs, c.secret_file)
        except PartitionError as exc:
            return self._fail(PhaseEvent.PEER_FAILED, f"cannot plan the cluster: {exc}", now)
        self.phase = PHASE_TABLE.next(self.phase, PhaseEvent.PEERS_FOUND)
        self.push_start = now
        self._deadline = now + c.push_window - FRAME_BOUND  # the offer phase ends 10 s early
        self.peers = {a.address: Peer(a.address, a.node_id) for a in self.plan.stages}
        out: list[Effect] = []
        for p in self.peers.values():
            out += self._send_phase(p, now)
        return out

    def _waiting_on(self, p: Peer) -> bool:
        want = {
            Phase.OFFERING: PeerStep.UNANSWERED,
            Phase.COMMITTING: PeerStep.ACCEPTED,
            Phase.ACTIVATING: PeerStep.COMMITTED,
        }.get(self.phase)
        return p.step is want

    def _send_phase(self, p: Peer, now: float) -> list[Effect]:
        a = self.attempt
        if self.phase is Phase.OFFERING:
            msg: Message = self._offer_for(p)
            p.retry_at = now + OFFER_RETRY
        elif self.phase is Phase.COMMITTING:
            msg, p.retry_at = AssignCommit(a), now + PHASE_RETRY
        else:
            msg, p.retry_at = AssignActivate(a), now + PHASE_RETRY
        return [Send(p.address, msg, deadline=min(now + FRAME_BOUND, self._deadline))]

    def _offer_for(self, p: Peer) -> AssignOffer:
        assert self.plan is not None
        c, st = self.cfg, next(s for s in self.plan.stages if s.address == p.address)
        return AssignOffer(
            PROTOCOL,
            self.attempt,
            c.version,
            c.cluster_name,
            c.model.sha256,
            c.model.n_layers,
            len(self.plan.stages),
            st.index,
            (st.start, st.end),
            st.node_id,
            c.coordinator,
            self.plan.body(),
            c.model.weights,
        )

    @staticmethod
    def all_reached(steps: set[PeerStep], step: PeerStep) -> bool:
        """Every peer took ``step``: the phase may end (the simulator plants a bug here)."""
        return steps == {step}

    def _advance(self, now: float) -> list[Effect]:
        steps = {p.step for p in self.peers.values()}
        target = {
            Phase.OFFERING: (PeerStep.ACCEPTED, PhaseEvent.ALL_ACCEPTED),
            Phase.COMMITTING: (PeerStep.COMMITTED, PhaseEvent.ALL_COMMITTED),
            Phase.ACTIVATING: (PeerStep.ACTIVE, PhaseEvent.ALL_ACTIVE),
        }.get(self.phase)
        if target is None:
            return []
        if not self.all_reached(steps, target[0]):
            return []
        if self.phase is Phase.OFFERING and not self.by_memory:
            return self._by_memory(now)
        self.phase = PHASE_TABLE.next(self.phase, target[1])
        if self.phase is Phase.DONE:
            return self._finish(True, self._done_summary(), now)
        if self.phase is Phase.COMMITTING:
            self._deadline = self.push_start + self.cfg.push_window
        else:  # activating: one frame window for the Activate round
            self._deadline = now + FRAME_BOUND
        out: list[Effect] = []
        for p in self.peers.values():
            out += self._send_phase(p, now)
        return out

    def _by_memory(self, now: float) -> list[Effect]:
        """Every peer accepted the first offer and said what it can hold: split the model by
        those figures and offer again, or fail with them if it cannot fit. (A peer that did
        not say -- an older mlxcel -- leaves the first split as it is.)"""
        c = self.cfg
        memory = {p.address: p.memory for p in self.peers.values()}
        if c.dry_run and not all(memory.values()):
            return self._dry_run_done(now)
        if not all(memory.values()):
            self.by_memory = True
            return self._advance(now)
        try:
            plan = make_plan(
                c.cluster_name, c.coordinator, self.found, c.costs, c.secret_file, memory
            )
        except PartitionError as exc:
            return self._fail(
                PhaseEvent.PEER_FAILED,
                f"bring-up failed: the model does not fit these peers' memory: {exc}; "
                "no stage was started",
                now,
            )
        self.plan, self.by_memory = plan, True
        if c.dry_run:
            return self._dry_run_done(now)
        self.attempt = c.attempt + 1
        out: list[Effect] = [
            Warn("info", "assignment: split by the peers' memory: " + self._stages_text())
        ]
        for p in self.peers.values():
            p.step = STEP_TABLE.next(p.step, PeerAnswer.REPLANNED)
            out += self._send_phase(p, now)
        return out

    def _dry_run_done(self, now: float) -> list[Effect]:
        """A dry run has its plan: the peers are told to wait again, nothing is committed."""
        self.phase = PHASE_TABLE.next(self.phase, PhaseEvent.PLANNED)
        summary = "dry run: planned " + self._stages_text()
        out: list[Effect] = [
            Send(p.address, AssignAbort(self.attempt, summary), deadline=now + FRAME_BOUND)
            for p in self.peers.values()
        ]
        return out + self._finish(True, summary, now)

    def _peer_failed(self, peer: Peer, why: str, now: float) -> list[Effect]:
        peer.step, peer.why = PeerStep.FAILED, why
        return self._fail(PhaseEvent.PEER_FAILED, self._failure_summary(), now)

    def _fail(self, event: PhaseEvent, summary: str, now: float) -> list[Effect]:
        self.phase = PHASE_TABLE.next(self.phase, event)
        out: list[Effect] = []
        if self.peers and event is not PhaseEvent.ALL_ACTIVE:
            for p in self.peers.values():
                # A peer that has not answered yet may have accepted (its answer on the way):
                # it is told too, within one handshake's time, not a frame's.
                if p.step in (PeerStep.UNANSWERED, PeerStep.ACCEPTED, PeerStep.COMMITTED):
                    unanswered = p.step is PeerStep.UNANSWERED
                    deadline = now + (HANDSHAKE_BOUND if unanswered else FRAME_BOUND)
                    out.append(
                        Send(p.address, AssignAbort(self.attempt, summary), deadline=deadline)
                    )
        return out + self._finish(False, summary, now)

    def _finish(self, ok: bool, summary: str, now: float) -> list[Effect]:
        self.outcome = Outcome(ok, summary, self.plan, now)
        return [PushDone(ok, summary)]

    # --- summaries ---------------------------------------------------------------------------
    def _done_summary(self) -> str:
        return "bring-up complete: " + self._stages_text()

    def _stages_text(self) -> str:
        assert self.plan is not None
        return ", ".join(
            f"{a.node_id}={a.address} (layers {a.layers}"
            + (f", {human_bytes(a.bytes)} of {human_bytes(a.memory)}" if a.memory else "")
            + ")"
            for a in self.plan.stages
        )

    def _failure_summary(self) -> str:
        failed = [p for p in self.peers.values() if p.step is PeerStep.FAILED]
        behind = [
            p for p in self.peers.values() if p.step in (PeerStep.UNANSWERED, PeerStep.ACCEPTED)
        ]
        parts = [f"{p.node_id} at {p.address} {p.why}" for p in failed]
        text = "bring-up failed: " + "; ".join(parts)
        if self.phase is not Phase.ACTIVATING:
            missing = sorted({p.node_id for p in failed} | {p.node_id for p in behind})
            text += f"; not committed: {', '.join(missing)}; no stage was started"
        return text + self._running()

    def _deadline_summary(self) -> str:
        if self.phase is Phase.DISCOVERING:
            return (
                f"bring-up failed: discovered {len(self.found)} of {self.cfg.n_peers} peers "
                f"within {self.cfg.discovery_window:g} s"
                + (f" ({', '.join(self.found)})" if self.found else "")
                + "".join(f"; dropped {a}: {why}" for a, why in self.dropped.items())
                + "; are they beaconing to this host's discovery port with the same secret? "
                "No stage was started"
            )
        late = [p for p in self.peers.values() if self._waiting_on(p)]
        names = ", ".join(
            f"{p.node_id} at {p.address}" + (f" (last attempt: {p.why})" if p.why else "")
            for p in late
        )
        what = {
            Phase.OFFERING: "did not accept",
            Phase.COMMITTING: "did not commit",
            Phase.ACTIVATING: "did not confirm activation",
        }[self.phase]
        text = f"bring-up failed: {names} {what} in time"
        if self.phase is not Phase.ACTIVATING:
            missing = sorted(
                p.node_id for p in self.peers.values() if p.step is not PeerStep.COMMITTED
            )
            text += f"; not committed: {', '.join(missing)}; no stage was started"
        return text + self._running()

    def progress(self, now: float) -> str:
        """What it still waits for, and for how long (logged every few seconds)."""
        if self.phase is Phase.DISCOVERING:
            found = f" ({', '.join(self.found)})" if self.found else ""
            return (
                f"discovery: {len(self.found)} of {self.cfg.n_peers} peers{found} after "
                f"{now - self.started:.0f} s of {self.cfg.discovery_window:g} s; listening for "
                "beacons"
            )
        late = ", ".join(f"{p.node_id} at {p.address}" for p in self.peers.values()
                         if self._waiting_on(p))  # fmt: skip
        what = {Phase.OFFERING: "accept", Phase.COMMITTING: "commit"}.get(self.phase, "activate")
        return (
            f"assignment: waiting for {late or 'no peer'} to {what} "
            f"({now - self.push_start:.0f} s of {self.cfg.push_window:g} s)"
        )

    def _running(self) -> str:
        """During activation, peers that already activated keep serving their stage."""
        up = [p.node_id for p in self.peers.values() if p.step is PeerStep.ACTIVE]
        return f"; already activated (their stages run): {', '.join(up)}" if up else ""
