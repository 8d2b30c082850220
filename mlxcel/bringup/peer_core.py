"""The ``--pp-peer`` side of the assignment protocol, as a pure core.

It waits for an offer, checks it in the documented order, and walks Accepted -> Committed ->
Active with the coordinator that made the offer, or back to waiting on Abort, on a phase that
does not come within 60 s, or when that coordinator's connection closes. A refusal of the
protocol version, the mlxcel version, the model or the layer range ends the peer (``PeerEnded``):
a retry against the same coordinator cannot succeed. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxcel.base.effects import Effect, Send, Warn
from mlxcel.base.errors import IllegalTransition, OfferRefused, PartitionError
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
from mlxcel.bringup.protocol import (
    ASSIGNMENT_WAIT,
    BEACON_EVERY,
    FINAL,
    PEER_TABLE,
    PHASE_WAIT,
    PROTOCOL,
    Activated,
    Announce,
    ModelIdentity,
    PeerEnded,
    PeerEvent,
    PeerState,
    Refusal,
    weights_mismatch,
)


@dataclass(frozen=True)
class PeerFacts:
    """What the peer checks an offer against."""

    version: str
    cluster_name: str
    model: ModelIdentity
    # The layer range this peer derives for (stages, index, the stages' memory figures when
    # the offered cluster carries them) from its own checkpoint.
    derive_range: Callable[[int, int, list[float] | None], tuple[int, int]]
    # The offered cluster TOML, validated (pipeline.cluster_config.parse_cluster_toml): raises
    # ValueError naming the first problem.
    parse_cluster: Callable[[str], Any]
    listen_ip: str  # may be unspecified (0.0.0.0): then only the port is checked
    listen_port: int
    beacons: bool = False  # mdns discovery: announce until committed
    memory: int = 0  # the bytes this peer can hold, said in every acceptance (0: not said)
    assignment_wait: float = ASSIGNMENT_WAIT
    phase_wait: float = PHASE_WAIT


class PeerCore:
    def __init__(self, facts: PeerFacts, now: float) -> None:
        self.facts = facts
        self.state = PeerState.WAITING
        self.offer: AssignOffer | None = None
        self.coordinator: str | None = None  # identity of the coordinator of ``offer``
        self.refusals: deque[tuple[str, Refusal]] = deque(maxlen=64)  # the latest (source, code)
        self._wait_until = now + facts.assignment_wait
        self._phase_until: float | None = None
        self._announce_at: float | None = now if facts.beacons else None
        self._ranges: dict[tuple[Any, ...], tuple[int, int]] = {}
        self._parsed: dict[str, Any] = {}

    # --- the core interface --------------------------------------------------------------------
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        if isinstance(msg, AssignOffer):
            return self._offer(msg, source, now)
        attempt = getattr(msg, "attempt", None)
        held = self.offer
        if (
            isinstance(msg, AssignAbort)
            and held is not None
            and source == self.coordinator
            and attempt == held.attempt + 1
        ):
            # The coordinator re-planned by memory (attempt + 1) and failed before its second
            # offer reached this peer: its Abort ends what this peer holds all the same.
            attempt = held.attempt
        if source != self.coordinator or held is None or attempt != held.attempt:
            if isinstance(msg, AssignCommit | AssignActivate):
                # Not from the coordinator of the current offer: nothing to commit or activate.
                event = PeerEvent.COMMIT if isinstance(msg, AssignCommit) else PeerEvent.ACTIVATE
                code = Refusal.NOT_ACCEPTED if event is PeerEvent.COMMIT else Refusal.NOT_COMMITTED
                return [self._refuse(source, msg.attempt, code, f"{code} for this attempt", False)]
            return [Warn("debug", f"assignment: ignoring {type(msg).__name__} from {source}")]
        if isinstance(msg, AssignCommit):
            return self._move(PeerEvent.COMMIT, source, msg.attempt, now)
        if isinstance(msg, AssignActivate):
            return self._move(PeerEvent.ACTIVATE, source, msg.attempt, now)
        if isinstance(msg, AssignAbort):
            if self.state is PeerState.ACTIVE:
                return [Warn("warning", f"assignment: Abort after Activate ignored: {msg.summary}")]
            out = self._move(PeerEvent.ABORT, source, msg.attempt, now)
            return [Warn("warning", f"assignment aborted by {source}: {msg.summary}"), *out]
        return [Warn("debug", f"assignment: ignoring {type(msg).__name__} from {source}")]

    def next_timer(self) -> float | None:
        if self.state in (PeerState.ACTIVE, PeerState.ENDED):
            return None
        times = [self._wait_until if self.state is PeerState.WAITING else self._phase_until]
        if self._announce_at is not None and self.state in (PeerState.WAITING, PeerState.ACCEPTED):
            times.append(self._announce_at)
        return min(t for t in times if t is not None)

    def on_timer(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if self.state is PeerState.WAITING and now >= self._wait_until:
            self.state = PEER_TABLE.next(self.state, PeerEvent.WAIT_TIMEOUT)
            wait = self.facts.assignment_wait
            return [PeerEnded(f"no stage assignment arrived within {wait:g} s")]
        if self._phase_until is not None and now >= self._phase_until:
            phase = self.state.value
            out += self._back_to_waiting(PeerEvent.PHASE_TIMEOUT, now)
            out.append(
                Warn(
                    "warning",
                    f"assignment: {phase} for {self.facts.phase_wait:g} s "
                    "without the next phase; waiting for an assignment again",
                )
            )
        if self._announce_at is not None and now >= self._announce_at:
            if self.state in (PeerState.WAITING, PeerState.ACCEPTED):
                out.append(Announce())
            self._announce_at = now + BEACON_EVERY
        return out

    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
        # An answer that cannot reach the coordinator: its retries or deadlines settle it.
        return [Warn("debug", f"assignment: answer to {send.dest} not delivered: {reason}")]

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        if identity != self.coordinator or self.state not in (
            PeerState.ACCEPTED,
            PeerState.COMMITTED,
        ):
            return []
        out = self._back_to_waiting(PeerEvent.COORDINATOR_LOST, now)
        return [
            Warn(
                "warning",
                f"assignment: lost the coordinator {identity} before Activate; "
                "waiting for an assignment again",
            ),
            *out,
        ]

    # --- offers --------------------------------------------------------------------------------
    def _offer(self, offer: AssignOffer, source: str, now: float) -> list[Effect]:
        if self.state in (PeerState.ACCEPTED, PeerState.COMMITTED) and source != self.coordinator:
            return [
                self._refuse(
                    source,
                    offer.attempt,
                    Refusal.BUSY,
                    f"{Refusal.BUSY} (the coordinator at {self.coordinator})",
                    False,
                )
            ]
        held = self.offer
        if held is not None and source == self.coordinator and offer.attempt == held.attempt - 1:
            # A late copy of the first offer of a bring-up that re-planned by memory: the one
            # held supersedes it.
            return [Warn("debug", f"assignment: superseded offer from {source} ignored")]
        if held is not None and source == self.coordinator and offer.attempt == held.attempt:
            if offer != held:
                # One bring-up offering this peer a second stage: it is listed under two
                # addresses (0.0.0.0 answers on every local IP). Refused at once, keeping the
                # first; the coordinator then fails and aborts every peer.
                return [
                    self._refuse(
                        source,
                        offer.attempt,
                        Refusal.ADDRESS,
                        f"{Refusal.ADDRESS}: this peer already accepted {held.node_id} of this "
                        f"bring-up and is offered {offer.node_id} too: is it listed under two "
                        "addresses?",
                        False,
                    )
                ]
        if self.offer == offer and source == self.coordinator:
            # A repeat of the offer we hold (a retry, or a late copy over a new connection):
            # answered again while accepting, and changes nothing once committed.
            if self.state is PeerState.ACCEPTED:
                return [
                    Send(
                        source,
                        AssignAccepted(PROTOCOL, offer.attempt, offer.node_id, self.facts.memory),
                    )
                ]
            return [Warn("debug", f"assignment: repeated offer from {source} ignored")]
        try:
            self._check(offer, source)
        except OfferRefused as exc:
            final = exc.code in FINAL
            event = PeerEvent.OFFER_FINAL if final else PeerEvent.OFFER_REFUSED
            try:
                nxt = PEER_TABLE.next(self.state, event)
            except IllegalTransition as ill:
                return [self._refuse(source, offer.attempt, Refusal(ill.code), str(ill), False)]
            out: list[Effect] = [self._refuse(source, offer.attempt, exc.code, str(exc), final)]
            if final:
                self.state = nxt
                out.append(
                    PeerEnded(f"stage assignment refused: {exc} (the offer came from {source})")
                )
            else:
                out += self._back_to_waiting(event, now)
                out.append(
                    Warn("warning", f"assignment from {source} refused: {exc}; waiting again")
                )
            return out
        try:
            self.state = PEER_TABLE.next(self.state, PeerEvent.OFFER_OK)
        except IllegalTransition as ill:
            return [self._refuse(source, offer.attempt, Refusal(ill.code), str(ill), False)]
        self.offer, self.coordinator = offer, source
        self._phase_until = now + self.facts.phase_wait
        return [
            Send(source, AssignAccepted(PROTOCOL, offer.attempt, offer.node_id, self.facts.memory)),
            Warn(
                "info",
                f"assignment: accepted {offer.node_id} (layers {offer.layers[0]}-"
                f"{offer.layers[1] - 1} of {offer.n_layers}) from {source}",
            ),
        ]

    def _check(self, o: AssignOffer, source: str) -> None:
        f = self.facts
        # Who is offering comes first: a refusal that ends this peer answers only a sender that
        # is the coordinator its offer names (the identity its handshake bound), never a member
        # speaking for another.
        if o.coordinator != source:
            raise OfferRefused(
                Refusal.COORDINATOR,
                f"{Refusal.COORDINATOR}: the offer names {o.coordinator}, the handshake bound "
                f"{source}",
            )
        if o.protocol != PROTOCOL:
            raise OfferRefused(
                Refusal.PROTOCOL,
                f"{Refusal.PROTOCOL}: the coordinator speaks "
                f"version {o.protocol}, this peer version {PROTOCOL}",
            )
        if o.mlxcel_version != f.version:
            raise OfferRefused(
                Refusal.VERSION,
                f"{Refusal.VERSION}: the coordinator runs "
                f"mlxcel {o.mlxcel_version}, this peer {f.version}",
            )
        if o.cluster_name != f.cluster_name:
            raise OfferRefused(
                Refusal.CLUSTER_NAME,
                f"{Refusal.CLUSTER_NAME}: offered "
                f"{o.cluster_name!r}, this peer is in {f.cluster_name!r}",
            )
        if (o.model_sha256, o.n_layers) != (f.model.sha256, f.model.n_layers):
            raise OfferRefused(
                Refusal.MODEL,
                f"{Refusal.MODEL}: the coordinator's checkpoint "
                f"is {o.model_sha256[:12]} ({o.n_layers} layers), this peer's "
                f"{f.model.short}: the same model folder on every host?",
            )
        differ = weights_mismatch(o.weights, f.model.weights, "the coordinator's")
        if differ is not None:
            raise OfferRefused(Refusal.MODEL, f"{Refusal.MODEL}: {differ}")
        if not 0 <= o.stage < o.n_stages or len(o.layers) != 2:
            raise OfferRefused(
                Refusal.LAYER_RANGE,
                f"{Refusal.LAYER_RANGE}: stage {o.stage} of "
                f"{o.n_stages} with layers {tuple(o.layers)} is not a stage",
            )
        try:
            mine = self._derive(o.n_stages, o.stage, self._memory_of(o.cluster_toml))
        except (PartitionError, ValueError, IndexError) as exc:
            raise OfferRefused(Refusal.LAYER_RANGE, f"{Refusal.LAYER_RANGE}: {exc}") from None
        if tuple(o.layers) != mine:
            raise OfferRefused(
                Refusal.LAYER_RANGE,
                f"{Refusal.LAYER_RANGE}: offered layers "
                f"{tuple(o.layers)} for stage {o.stage} of {o.n_stages}, this "
                f"peer derives {mine}",
            )
        if o.node_id != f"stage-{o.stage}":
            raise OfferRefused(
                Refusal.NODE_ID,
                f"{Refusal.NODE_ID}: offered {o.node_id!r} for "
                f"stage {o.stage} (expected 'stage-{o.stage}')",
            )
        cfg = self._parse(o.cluster_toml)
        stages = cfg.stages
        if len(stages) != o.n_stages or not 0 <= o.stage < len(stages):
            raise OfferRefused(
                Refusal.CLUSTER_TOML,
                f"{Refusal.CLUSTER_TOML}: {len(stages)} "
                f"stages listed for stage {o.stage} of {o.n_stages}",
            )
        me = stages[o.stage]
        if me.id != o.node_id or (me.layers or "") != f"{o.layers[0]}-{o.layers[1] - 1}":
            raise OfferRefused(
                Refusal.CLUSTER_TOML,
                f"{Refusal.CLUSTER_TOML}: stage {o.stage} "
                f"is {me.id!r} (layers {me.layers}) there, offered {o.node_id!r}",
            )
        specific = f.listen_ip not in ("0.0.0.0", "::")
        if me.port != f.listen_port or (specific and me.host != f.listen_ip):
            raise OfferRefused(
                Refusal.ADDRESS,
                f"{Refusal.ADDRESS}: the offered cluster puts "
                f"{o.node_id} at {me.address}, this peer listens on "
                f"{f.listen_ip}:{f.listen_port}",
            )
        if o.coordinator != source or cfg.coordinator.address != source:
            raise OfferRefused(
                Refusal.COORDINATOR,
                f"{Refusal.COORDINATOR}: the offer names "
                f"{o.coordinator} (cluster: {cfg.coordinator.address}), the "
                f"handshake bound {source}",
            )

    def _derive(self, n_stages: int, index: int, memory: list[float] | None) -> tuple[int, int]:
        key = (n_stages, index, tuple(memory or ()))  # a retried offer asks again: split once
        if key not in self._ranges:
            if len(self._ranges) >= 64:
                self._ranges.clear()
            self._ranges[key] = self.facts.derive_range(n_stages, index, memory)
        return self._ranges[key]

    def _memory_of(self, text: str) -> list[float] | None:
        """The stages' memory figures of an offered cluster (None: it has none, or it is not
        valid TOML -- which the cluster check refuses in its turn)."""
        try:
            return self._parse(text).memory
        except OfferRefused:
            return None

    def _parse(self, text: str) -> Any:
        if text in self._parsed:
            return self._parsed[text]
        if len(self._parsed) >= 4:
            self._parsed.clear()
        try:
            self._parsed[text] = cfg = self.facts.parse_cluster(text)
        except ValueError as exc:
            raise OfferRefused(Refusal.CLUSTER_TOML, f"{Refusal.CLUSTER_TOML}: {exc}") from None
        return cfg

    # --- later phases ------------------------------------------------------------------------
    def _move(self, event: PeerEvent, source: str, attempt: int, now: float) -> list[Effect]:
        if event is PeerEvent.COMMIT and self.state is PeerState.ACTIVE:
            return [Warn("debug", f"assignment: late Commit from {source} ignored")]
        try:
            nxt = PEER_TABLE.next(self.state, event)
        except IllegalTransition as ill:
            return [self._refuse(source, attempt, Refusal(ill.code), str(ill), False)]
        if event is PeerEvent.ABORT:
            return self._back_to_waiting(event, now)
        assert self.offer is not None
        first = nxt is not self.state
        self.state = nxt
        if event is PeerEvent.COMMIT:
            if first:
                self._phase_until = now + self.facts.phase_wait
            return [Send(source, AssignCommitted(attempt))]
        self._phase_until = None
        out: list[Effect] = [Send(source, AssignActivated(attempt))]
        if first:
            o = self.offer
            out.append(Activated(o.node_id, source, o.cluster_toml))
        return out

    def _back_to_waiting(self, event: PeerEvent, now: float) -> list[Effect]:
        was = self.state
        self.state = PEER_TABLE.next(self.state, event)
        self.offer = self.coordinator = None
        self._phase_until = None
        if was is not PeerState.WAITING:
            # A bring-up that got somewhere restarts the 600 s wait; refused offers do not,
            # so nobody can keep a peer waiting forever by offering what it refuses.
            self._wait_until = now + self.facts.assignment_wait
        return []

    def _refuse(self, dest: str, attempt: int, code: Refusal, reason: str, final: bool) -> Send:
        self.refusals.append((dest, code))
        # Only the coordinator of the current offer gets an outbox of its own; refusals to
        # anyone else go out on one-off connections, so claimed identities cannot pile up.
        return Send(
            dest, AssignRefused(attempt, str(code), reason, final), peer=dest == self.coordinator
        )
