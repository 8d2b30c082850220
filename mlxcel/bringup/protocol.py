"""The assignment protocol (version 2), as data: bounds, refusal codes, transition tables and
the effects only bring-up emits.

Coordinator -> peer, per peer::

    Offer ──► Accepted(memory) | Refused  (offer phase: ends 10 s before the push window;
                                           once every peer said what it can hold, offered
                                           again, split by memory, as a new attempt)
    Commit ──► Committed                  (only once every peer accepted)
    Activate ──► Activated                (only once every peer committed)
    Abort(summary)                        (any failure before activation: wait again)

Both sides are pure cores (:mod:`mlxcel.bringup.peer_core`, :mod:`mlxcel.bringup.push_core`)
whose legal moves are the tables below; a message that does not fit raises
:class:`~mlxcel.base.errors.IllegalTransition` from the lookup.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from mlxcel.base.fsm import Table

PROTOCOL = 2  # the assignment protocol version; anything else is refused

# Bounds (seconds).
HANDSHAKE_BOUND = 5.0  # one connect + handshake
FRAME_BOUND = 10.0  # one frame's write
PUSH_WINDOW = 60.0  # the coordinator's whole push; the offer phase ends FRAME_BOUND earlier
PHASE_WAIT = 60.0  # a peer's wait between Accepted and Commit, and Committed and Activate
ASSIGNMENT_WAIT = 600.0  # a peer's wait for any assignment
DISCOVERY_WINDOW = 30.0  # how long a coordinator listens for beacons
PROGRESS_EVERY = 5.0  # a waiting coordinator says what it waits for this often
OFFER_RETRY = 0.5  # connect + handshake + offer again, while a peer is unanswered
PHASE_RETRY = 1.0  # Commit / Activate again, while a peer has not answered
BEACON_EVERY = 1.0  # a waiting peer announces itself this often (mdns discovery)
VERIFY_AGAIN = 2.0  # an address whose check failed is not checked again for this long


class Refusal(enum.StrEnum):
    """Why a peer refused, in the order it checks. The first four end the peer."""

    PROTOCOL = "assignment protocol mismatch"
    VERSION = "mlxcel version mismatch"
    CLUSTER_NAME = "cluster name mismatch"
    MODEL = "model identity mismatch"
    LAYER_RANGE = "layer range mismatch"
    NODE_ID = "node id mismatch"
    ADDRESS = "listener address mismatch"
    COORDINATOR = "coordinator identity mismatch"
    CLUSTER_TOML = "invalid cluster TOML"
    # not checks of an offer: a later message that does not fit the peer's state
    NOT_ACCEPTED = "no accepted offer to commit"
    NOT_COMMITTED = "nothing committed to activate"
    BUSY = "busy with another coordinator's bring-up"
    SERVING = "already serving a stage"


FINAL = frozenset({Refusal.PROTOCOL, Refusal.VERSION, Refusal.MODEL, Refusal.LAYER_RANGE})


# --- the peer ---------------------------------------------------------------------------------
class PeerState(enum.Enum):
    WAITING = "waiting"
    ACCEPTED = "accepted"
    COMMITTED = "committed"
    ACTIVE = "active"  # its stage starts: terminal for the assignment protocol
    ENDED = "ended"  # refused for good, or waited 600 s for nothing: the process exits


class PeerEvent(enum.Enum):
    OFFER_OK = "offer passed every check"
    OFFER_REFUSED = "offer refused; wait again"
    OFFER_FINAL = "offer refused for good"
    COMMIT = "commit"
    ACTIVATE = "activate"
    ABORT = "abort"
    PHASE_TIMEOUT = "no next phase within 60 s"
    COORDINATOR_LOST = "the coordinator's connection closed"
    WAIT_TIMEOUT = "no assignment within 600 s"


W, A, C, X, E = (
    PeerState.WAITING,
    PeerState.ACCEPTED,
    PeerState.COMMITTED,
    PeerState.ACTIVE,
    PeerState.ENDED,
)
PEER_TABLE: Table[PeerState, PeerEvent] = Table(
    "assignment peer",
    {
        (W, PeerEvent.OFFER_OK): A,
        (W, PeerEvent.OFFER_REFUSED): W,
        (W, PeerEvent.OFFER_FINAL): E,
        (W, PeerEvent.WAIT_TIMEOUT): E,
        # An uncommitted acceptance binds nothing: the same coordinator may offer again (it
        # restarted, or its first answer was lost), and a committed peer of a coordinator that
        # starts over follows it too.
        (A, PeerEvent.OFFER_OK): A,
        (A, PeerEvent.OFFER_REFUSED): W,
        (A, PeerEvent.OFFER_FINAL): E,
        (A, PeerEvent.COMMIT): C,
        (A, PeerEvent.ABORT): W,
        (A, PeerEvent.PHASE_TIMEOUT): W,
        (A, PeerEvent.COORDINATOR_LOST): W,
        (C, PeerEvent.OFFER_OK): A,
        (C, PeerEvent.OFFER_REFUSED): W,
        (C, PeerEvent.OFFER_FINAL): E,
        (C, PeerEvent.COMMIT): C,  # a repeated Commit is answered again
        (C, PeerEvent.ACTIVATE): X,
        (C, PeerEvent.ABORT): W,
        (C, PeerEvent.PHASE_TIMEOUT): W,
        (C, PeerEvent.COORDINATOR_LOST): W,
        (X, PeerEvent.ACTIVATE): X,  # a repeated Activate is answered again
    },
    {
        PeerEvent.COMMIT: Refusal.NOT_ACCEPTED,
        PeerEvent.ACTIVATE: Refusal.NOT_COMMITTED,
        (X, PeerEvent.OFFER_OK): Refusal.SERVING,
        (X, PeerEvent.OFFER_REFUSED): Refusal.SERVING,
        (X, PeerEvent.OFFER_FINAL): Refusal.SERVING,
    },
    Refusal.NOT_ACCEPTED,
)


# --- the coordinator's push -------------------------------------------------------------------
class Phase(enum.Enum):
    DISCOVERING = "discovering"
    OFFERING = "offering"
    COMMITTING = "committing"
    ACTIVATING = "activating"
    DONE = "done"
    FAILED = "failed"


class PhaseEvent(enum.Enum):
    PEERS_FOUND = "every peer resolved"
    PLANNED = "a dry run planned the cluster (and aborted its offers)"
    ALL_ACCEPTED = "every peer accepted"
    ALL_COMMITTED = "every peer committed"
    ALL_ACTIVE = "every peer activated"
    PEER_FAILED = "a peer refused or cannot be reached"
    DEADLINE = "the phase's deadline passed"


D, OF, CM, AC, OK, F = (
    Phase.DISCOVERING,
    Phase.OFFERING,
    Phase.COMMITTING,
    Phase.ACTIVATING,
    Phase.DONE,
    Phase.FAILED,
)
PHASE_TABLE: Table[Phase, PhaseEvent] = Table(
    "assignment push",
    {
        (D, PhaseEvent.PEERS_FOUND): OF,
        (OF, PhaseEvent.PLANNED): OK,
        (D, PhaseEvent.PEER_FAILED): F,  # a plan that cannot be made (loopback rule, layers)
        (D, PhaseEvent.DEADLINE): F,
        (OF, PhaseEvent.ALL_ACCEPTED): CM,
        (OF, PhaseEvent.PEER_FAILED): F,
        (OF, PhaseEvent.DEADLINE): F,
        (CM, PhaseEvent.ALL_COMMITTED): AC,
        (CM, PhaseEvent.PEER_FAILED): F,
        (CM, PhaseEvent.DEADLINE): F,
        (AC, PhaseEvent.ALL_ACTIVE): OK,
        (AC, PhaseEvent.PEER_FAILED): F,
        (AC, PhaseEvent.DEADLINE): F,
    },
    {},
    "bringup_over",
)


class PeerStep(enum.Enum):
    """Where one peer stands, as the coordinator sees it."""

    UNANSWERED = "unanswered"
    ACCEPTED = "accepted"
    COMMITTED = "committed"
    ACTIVE = "active"
    FAILED = "failed"


class PeerAnswer(enum.Enum):
    """What a peer answered the offer with (the push core moves its step by it)."""

    ACCEPTED = "accepted"
    COMMITTED = "committed"
    ACTIVATED = "activated"
    # Not an answer: every peer said what it can hold, the coordinator split the model by it
    # and offers again (a new attempt, so a late answer to the first offer counts for nothing).
    REPLANNED = "replanned"


U, PA, PC, PX = PeerStep.UNANSWERED, PeerStep.ACCEPTED, PeerStep.COMMITTED, PeerStep.ACTIVE
# (phase, where the peer stands, its answer) -> where it stands now. Anything else is a
# message that does not fit (a stale or misdirected answer): logged, not acted on.
STEP_TABLE: Table[PeerStep, PeerAnswer] = Table(
    "assignment push peer",
    {
        (U, PeerAnswer.ACCEPTED): PA,
        (PA, PeerAnswer.ACCEPTED): PA,
        (PA, PeerAnswer.REPLANNED): U,
        (PA, PeerAnswer.COMMITTED): PC,
        (PC, PeerAnswer.COMMITTED): PC,
        (PC, PeerAnswer.ACTIVATED): PX,
        (PX, PeerAnswer.ACTIVATED): PX,
        # late copies of earlier answers change nothing
        (PC, PeerAnswer.ACCEPTED): PC,
        (PX, PeerAnswer.ACCEPTED): PX,
        (PX, PeerAnswer.COMMITTED): PX,
    },
    {},
    "unexpected_answer",
)


# --- effects only bring-up emits (the shared ones are in mlxcel.base.effects) ----------------------
@dataclass(frozen=True, slots=True)
class Announce:
    """Peer: send one discovery beacon now."""


@dataclass(frozen=True, slots=True)
class Activated:
    """Peer: write the cluster TOML and start stage ``node_id`` (``coordinator``: who sent it)."""

    node_id: str
    coordinator: str
    cluster_toml: str


@dataclass(frozen=True, slots=True)
class PeerEnded:
    """Peer: the process ends (``reason`` is the operator's line)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Verify:
    """Coordinator: complete an authenticated handshake with ``address`` (a beacon named it)
    by ``deadline``; answer with ``PushCore.verified``. A beacon proves the secret, not that
    the peer is alive: a captured one can be replayed from its address after it left."""

    address: str
    deadline: float


@dataclass(frozen=True, slots=True)
class PushDone:
    """Coordinator: the bring-up ended. ``ok``: every peer activated."""

    ok: bool
    summary: str


# --- what both cores check: model identity and beacons ---------------------------------------


@dataclass(frozen=True)
class ModelIdentity:
    sha256: str  # the shape: config.json, weight file names and sizes, layer count
    n_layers: int
    weights: str = ""  # content digest of the weight files; "" when not computed (trusted)

    @property
    def short(self) -> str:
        return f"{self.sha256[:12]} ({self.n_layers} layers)"


def weights_mismatch(theirs: str, ours: str, whose: str) -> str | None:
    """Why two weight digests do not name the same weights (None: they do, or one side did
    not compute its digest and so vouches for its copy)."""
    if not theirs or not ours or theirs == ours:
        return None
    return (
        f"model weights differ: {whose} weights have digest {theirs[:16]}, this node's "
        f"{ours[:16]} (same config and file sizes, other values: copy the same checkpoint to "
        "every host; --trust-weights skips this check)"
    )


class Rejection(enum.Enum):
    MALFORMED = "not a beacon"
    BAD_MAC = "invalid MAC (another cluster secret?)"
    SKEW = "clock skew beyond 60 s"
    REPLAY = "replayed nonce"
    VERSION = "another mlxcel version"
    ADDRESS = "advertised address is not the datagram's source"
    CLUSTER = "another cluster name"
    FULL = "replay cache full"


class BeaconCheck(Protocol):
    """What the coordinator's core asks of a beacon: its advertised address, or
    BeaconRejected."""

    def check(self, datagram: bytes, source_ip: str, wall: float) -> str: ...
