"""The peer side of cluster bring-up (``PeerCore``), pinned effect list by effect list.

Every path -- each check of an offer in order, each refusal (busy, two addresses, a phase
that does not fit, an active or ended peer), each timer at its exact deadline, each ending,
and repeated, stale and foreign messages -- is compared with ``==`` against the *whole* list
of effects: the exact ``Send`` (destination, message, ``peer`` flag), the exact ``Warn`` kind
and text, and the state, offer, coordinator, refusal log and next timer the core exposes.
Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

import pytest

from mlxcel.base.effects import Effect, Send, Warn
from mlxcel.base.errors import OfferRefused, PartitionError
from mlxcel.base.messages import (
    AssignAbort,
    AssignAccepted,
    AssignActivate,
    AssignActivated,
    AssignCommit,
    AssignCommitted,
    AssignOffer,
    AssignRefused,
    BeginDrain,
)
from mlxcel.bringup.peer_core import PeerCore, PeerFacts
from mlxcel.bringup.plan import derived_range
from mlxcel.bringup.protocol import (
    Activated,
    Announce,
    ModelIdentity,
    PeerEnded,
    PeerState,
    Refusal,
)
from mlxcel.pipeline.cluster_config import ClusterConfig, parse_cluster_toml
from mlxcel.pipeline.partition import LayerCosts

# 8 layers of equal cost in 3 stages: (0, 3), (3, 6), (6, 8).
COSTS = LayerCosts((100,) * 8, 50, 50, 0)
MODEL = ModelIdentity("ab" * 32, 8, "cd" * 32)
VERSION = "1.2.3"  # the peer's and the coordinator's mlxcel version (not the package's own)
COORD = "127.0.0.1:19000"
ME = "127.0.0.2:19001"
STRANGER = "127.0.0.66:19000"
ACCEPTED_AT = 1.0  # when the helpers below accept, commit and activate
COMMITTED_AT = 2.0
ACTIVE_AT = 3.0

STAGES: tuple[tuple[str, str, str | None], ...] = (
    ("stage-0", ME, "0-2"),
    ("stage-1", "127.0.0.3:19001", "3-5"),
    ("stage-2", "127.0.0.4:19001", "6-7"),
)


def toml(
    stages: tuple[tuple[str, str, str | None], ...] = STAGES,
    coordinator: str = COORD,
    extra: str = "",
) -> str:
    """A cluster TOML as the coordinator writes it (``extra``: a trailing comment)."""
    lines = [
        'name = "mlxcel-cluster"',
        f"pipeline_parallel_size = {len(stages)}",
        "",
        "[[nodes]]",
        'id = "coordinator"',
        'role = "coordinator"',
        f'address = "{coordinator}"',
    ]
    for node_id, address, layers in stages:
        lines += ["", "[[nodes]]", f'id = "{node_id}"', 'role = "stage"', f'address = "{address}"']
        if layers is not None:
            lines.append(f'layers = "{layers}"')
    return "\n".join(lines) + "\n" + extra


TOML = toml()


class Derive:
    """``derive_range`` over COSTS that records what it was asked (to see the cache)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(
        self, n_stages: int, index: int, memory: list[float] | None = None
    ) -> tuple[int, int]:
        self.calls.append((n_stages, index))
        return derived_range(COSTS, n_stages, index, memory)


def facts(
    listen: str = ME, derive: Callable[..., tuple[int, int]] | None = None, **kw: object
) -> PeerFacts:
    host, port = listen.rsplit(":", 1)
    base = PeerFacts(
        VERSION,
        "mlxcel-cluster",
        MODEL,
        derive or Derive(),
        parse_cluster_toml,
        host.strip("[]"),
        int(port),
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def offer(**kw: object) -> AssignOffer:
    """The good offer of stage-0 to ME for attempt 7, with ``kw`` changed."""
    base = AssignOffer(
        protocol=2,
        attempt=7,
        mlxcel_version=VERSION,
        cluster_name="mlxcel-cluster",
        model_sha256=MODEL.sha256,
        n_layers=8,
        n_stages=3,
        stage=0,
        layers=(0, 3),
        node_id="stage-0",
        coordinator=COORD,
        cluster_toml=TOML,
        weights=MODEL.weights,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def refused(
    dest: str, attempt: int, code: Refusal, reason: str, final: bool = False, peer: bool = False
) -> Send:
    return Send(dest, AssignRefused(attempt, str(code), reason, final), peer=peer)


def accepted_line(attempt_offer: AssignOffer | None = None, source: str = COORD) -> Warn:
    o = attempt_offer or offer()
    return Warn(
        "info",
        f"assignment: accepted {o.node_id} (layers {o.layers[0]}-{o.layers[1] - 1} "
        f"of {o.n_layers}) from {source}",
    )


def accepted(**kw: object) -> PeerCore:
    peer = PeerCore(facts(**kw), 0.0)
    peer.handle(offer(), COORD, ACCEPTED_AT)
    assert peer.state is PeerState.ACCEPTED
    return peer


def committed(**kw: object) -> PeerCore:
    peer = accepted(**kw)
    peer.handle(AssignCommit(7), COORD, COMMITTED_AT)
    assert peer.state is PeerState.COMMITTED
    return peer


def active() -> PeerCore:
    peer = committed()
    peer.handle(AssignActivate(7), COORD, ACTIVE_AT)
    assert peer.state is PeerState.ACTIVE
    return peer


# --- waiting ------------------------------------------------------------------------------------
def test_a_fresh_peer_holds_no_offer_and_no_coordinator() -> None:
    peer = PeerCore(facts(), 10.0)
    assert peer.state is PeerState.WAITING
    # None, not merely falsy: "no coordinator" must not equal any identity, even ""
    assert peer.offer is None and peer.coordinator is None
    assert peer.refusals == deque() and peer.refusals.maxlen == 64
    assert peer.next_timer() == 610.0


def test_the_assignment_wait_ends_the_peer_exactly_at_its_deadline() -> None:
    peer = PeerCore(facts(), 10.0)
    assert peer.on_timer(610.0 - 1e-6) == []
    assert peer.state is PeerState.WAITING
    assert peer.on_timer(610.0) == [PeerEnded("no stage assignment arrived within 600 s")]
    assert peer.state is PeerState.ENDED and peer.next_timer() is None
    # the bound is the configured one, printed with :g
    peer = PeerCore(facts(assignment_wait=2.5), 0.0)
    assert peer.next_timer() == 2.5
    assert peer.on_timer(2.5) == [PeerEnded("no stage assignment arrived within 2.5 s")]


def test_a_refusal_to_the_empty_identity_goes_out_on_a_one_off_connection() -> None:
    # nobody is this peer's coordinator yet: not even an identity that is the empty string
    peer = PeerCore(facts(), 0.0)
    reason = "no accepted offer to commit for this attempt"
    assert peer.handle(AssignCommit(7), "", 1.0) == [refused("", 7, Refusal.NOT_ACCEPTED, reason)]


def test_a_message_without_an_attempt_is_ignored_not_an_error() -> None:
    peer = PeerCore(facts(), 0.0)
    ignored = [Warn("debug", f"assignment: ignoring BeginDrain from {COORD}")]
    assert peer.handle(BeginDrain(), COORD, 1.0) == ignored
    peer = accepted()
    assert peer.handle(BeginDrain(), COORD, 2.0) == ignored
    assert peer.state is PeerState.ACCEPTED


def test_commit_and_activate_with_no_offer_are_refused_by_code() -> None:
    peer = PeerCore(facts(), 0.0)
    assert peer.handle(AssignCommit(7), COORD, 1.0) == [
        refused(COORD, 7, Refusal.NOT_ACCEPTED, "no accepted offer to commit for this attempt")
    ]
    assert peer.handle(AssignActivate(7), COORD, 1.0) == [
        refused(COORD, 7, Refusal.NOT_COMMITTED, "nothing committed to activate for this attempt")
    ]
    assert peer.handle(AssignAbort(7, "x"), COORD, 1.0) == [
        Warn("debug", f"assignment: ignoring AssignAbort from {COORD}")
    ]
    assert peer.refusals == deque([(COORD, Refusal.NOT_ACCEPTED), (COORD, Refusal.NOT_COMMITTED)])
    assert peer.state is PeerState.WAITING


def test_beacons_fire_exactly_every_second_until_committed() -> None:
    peer = PeerCore(facts(beacons=True), 0.0)
    assert peer.next_timer() == 0.0  # announce at once
    assert peer.on_timer(0.0) == [Announce()]
    assert peer.next_timer() == 1.0
    assert peer.on_timer(1.0 - 1e-6) == []
    assert peer.on_timer(1.0) == [Announce()]
    peer.handle(offer(), COORD, 1.5)
    assert peer.next_timer() == 2.0  # accepted: still beacons (phase ends at 61.5)
    assert peer.on_timer(2.0) == [Announce()]
    peer.handle(AssignCommit(7), COORD, 2.5)
    # committed: the beacon is no timer any more, only the phase is
    assert peer.next_timer() == 62.5
    assert peer.on_timer(3.0) == []  # a beacon time passing while committed says nothing
    # the phase runs out: back to waiting, and the beacon is due again at once
    assert peer.on_timer(62.5) == [
        Warn(
            "warning",
            "assignment: committed for 60 s without the next phase; "
            "waiting for an assignment again",
        ),
        Announce(),
    ]
    assert peer.state is PeerState.WAITING
    assert peer.next_timer() == 63.5


def test_a_committed_peer_with_a_stale_beacon_time_schedules_only_its_phase() -> None:
    peer = PeerCore(facts(beacons=True), 0.0)  # the first beacon (0.0) never fired
    peer.handle(offer(), COORD, 0.5)
    peer.handle(AssignCommit(7), COORD, 0.6)
    assert peer.next_timer() == 60.6


# --- accepting ----------------------------------------------------------------------------------
def test_a_good_offer_is_accepted_word_for_word() -> None:
    peer = PeerCore(facts(), 0.0)
    o = offer()
    assert peer.handle(o, COORD, ACCEPTED_AT) == [
        Send(COORD, AssignAccepted(2, 7, "stage-0")),
        Warn("info", f"assignment: accepted stage-0 (layers 0-2 of 8) from {COORD}"),
    ]
    assert peer.state is PeerState.ACCEPTED
    assert peer.offer == o and peer.coordinator == COORD
    assert peer.refusals == deque()
    assert peer.next_timer() == 61.0


def test_the_last_stage_index_is_a_stage() -> None:
    # stage n-1 passes the range checks (and is then refused for its address: not ours)
    peer = PeerCore(facts(), 0.0)
    o = offer(stage=2, layers=(6, 8), node_id="stage-2")
    reason = (
        "listener address mismatch: the offered cluster puts stage-2 at 127.0.0.4:19001, "
        "this peer listens on 127.0.0.2:19001"
    )
    assert peer.handle(o, COORD, 1.0) == [
        refused(COORD, 7, Refusal.ADDRESS, reason),
        Warn("warning", f"assignment from {COORD} refused: {reason}; waiting again"),
    ]


@pytest.mark.parametrize("listen", ["0.0.0.0:19001", "[::]:19001"])
def test_a_wildcard_listener_checks_only_the_port(listen: str) -> None:
    peer = PeerCore(facts(listen), 0.0)
    assert peer.handle(offer(), COORD, 1.0) == [
        Send(COORD, AssignAccepted(2, 7, "stage-0")),
        accepted_line(),
    ]
    peer = PeerCore(facts(listen.replace("19001", "19002")), 0.0)
    reason = (
        f"listener address mismatch: the offered cluster puts stage-0 at {ME}, "
        f"this peer listens on {listen.rsplit(':', 1)[0].strip('[]')}:19002"
    )
    assert peer.handle(offer(), COORD, 1.0) == [
        refused(COORD, 7, Refusal.ADDRESS, reason),
        Warn("warning", f"assignment from {COORD} refused: {reason}; waiting again"),
    ]


def test_a_repeated_offer_is_answered_again_while_accepted_and_changes_nothing() -> None:
    peer = accepted()
    assert peer.handle(offer(), COORD, 30.0) == [Send(COORD, AssignAccepted(2, 7, "stage-0"))]
    assert peer.state is PeerState.ACCEPTED
    assert peer.next_timer() == 61.0  # the phase wait is not restarted by a repeat


def test_a_repeated_offer_once_committed_or_active_is_ignored() -> None:
    for peer, state in ((committed(), PeerState.COMMITTED), (active(), PeerState.ACTIVE)):
        assert peer.handle(offer(), COORD, 30.0) == [
            Warn("debug", f"assignment: repeated offer from {COORD} ignored")
        ]
        assert peer.state is state and peer.refusals == deque()


def test_the_same_coordinator_offering_a_new_attempt_is_checked_and_accepted_again() -> None:
    for peer in (accepted(), committed()):
        o = offer(attempt=8)
        assert peer.handle(o, COORD, 5.0) == [
            Send(COORD, AssignAccepted(2, 8, "stage-0")),
            accepted_line(o),
        ]
        assert peer.state is PeerState.ACCEPTED and peer.offer == o
        assert peer.next_timer() == 65.0


def test_a_new_attempt_that_fails_a_check_sends_the_peer_back_to_waiting() -> None:
    peer = accepted()
    reason = "cluster name mismatch: offered 'another', this peer is in 'mlxcel-cluster'"
    # peer=True: the refusal goes to the coordinator of the offer held when it was made
    assert peer.handle(offer(attempt=8, cluster_name="another"), COORD, 5.0) == [
        refused(COORD, 8, Refusal.CLUSTER_NAME, reason, peer=True),
        Warn("warning", f"assignment from {COORD} refused: {reason}; waiting again"),
    ]
    assert peer.state is PeerState.WAITING
    assert peer.offer is None and peer.coordinator is None
    assert peer.refusals == deque([(COORD, Refusal.CLUSTER_NAME)])
    assert peer.next_timer() == 605.0  # a bring-up that got somewhere restarts the wait


def test_a_refused_offer_while_waiting_does_not_restart_the_wait() -> None:
    peer = PeerCore(facts(), 0.0)
    peer.handle(offer(cluster_name="another"), COORD, 100.0)
    assert peer.next_timer() == 600.0


def test_another_coordinator_is_refused_as_busy_while_accepted_or_committed() -> None:
    for peer in (accepted(), committed()):
        state = peer.state
        o = offer(attempt=9, coordinator=STRANGER)
        assert peer.handle(o, STRANGER, 5.0) == [
            refused(
                STRANGER,
                9,
                Refusal.BUSY,
                f"busy with another coordinator's bring-up (the coordinator at {COORD})",
            )
        ]
        assert peer.state is state and peer.coordinator == COORD and peer.offer == offer()
        assert peer.refusals == deque([(STRANGER, Refusal.BUSY)])


def test_one_bring_up_offering_a_second_stage_is_refused_keeping_the_first() -> None:
    peer = accepted(listen="0.0.0.0:19001")
    second = offer(stage=1, layers=(3, 6), node_id="stage-1")
    assert peer.handle(second, COORD, 2.0) == [
        refused(
            COORD,
            7,
            Refusal.ADDRESS,
            "listener address mismatch: this peer already accepted stage-0 of this bring-up "
            "and is offered stage-1 too: is it listed under two addresses?",
            peer=True,
        )
    ]
    assert peer.state is PeerState.ACCEPTED and peer.offer == offer()
    assert peer.refusals == deque([(COORD, Refusal.ADDRESS)])


# --- the checks of an offer, in order -------------------------------------------------------------
def _final(source: str, code: Refusal, reason: str) -> list[Effect]:
    return [
        refused(source, 7, code, reason, final=True),
        PeerEnded(f"stage assignment refused: {reason} (the offer came from {source})"),
    ]


def _again(source: str, code: Refusal, reason: str) -> list[Effect]:
    return [
        refused(source, 7, code, reason),
        Warn("warning", f"assignment from {source} refused: {reason}; waiting again"),
    ]


NOT_A_STAGE = "layer range mismatch: stage {} of 3 with layers {} is not a stage"
TWO_STAGES = toml(stages=(("stage-0", ME, "0-2"), ("stage-1", "127.0.0.3:19001", "3-7")))
BAD_SCHEMA = 'name = "x"\n[[nodes]]\nid = "c"\nrole = "coordinator"\naddress = "127.0.0.1:1"\n'


@pytest.mark.parametrize(
    ("changes", "source", "code", "reason"),
    [
        pytest.param(
            {"protocol": 1},
            COORD,
            Refusal.PROTOCOL,
            "assignment protocol mismatch: the coordinator speaks version 1, this peer version 2",
            id="protocol",
        ),
        pytest.param(
            {"mlxcel_version": "0.0.9"},
            COORD,
            Refusal.VERSION,
            "mlxcel version mismatch: the coordinator runs mlxcel 0.0.9, this peer 1.2.3",
            id="version",
        ),
        pytest.param(
            {"cluster_name": "another"},
            COORD,
            Refusal.CLUSTER_NAME,
            "cluster name mismatch: offered 'another', this peer is in 'mlxcel-cluster'",
            id="cluster-name",
        ),
        pytest.param(
            {"model_sha256": "0123456789abcdef" * 4},
            COORD,
            Refusal.MODEL,
            "model identity mismatch: the coordinator's checkpoint is 0123456789ab (8 layers), "
            "this peer's abababababab (8 layers): the same model folder on every host?",
            id="model-sha",
        ),
        pytest.param(
            {"n_layers": 9},
            COORD,
            Refusal.MODEL,
            "model identity mismatch: the coordinator's checkpoint is abababababab (9 layers), "
            "this peer's abababababab (8 layers): the same model folder on every host?",
            id="model-layers",
        ),
        pytest.param(
            {"weights": "ef" * 32},
            COORD,
            Refusal.MODEL,
            "model identity mismatch: model weights differ: the coordinator's weights have "
            "digest efefefefefefefef, this node's cdcdcdcdcdcdcdcd (same config and file sizes, "
            "other values: copy the same checkpoint to every host; --trust-weights skips this "
            "check)",
            id="model-weights",
        ),
        # the stage index at its edges: n_stages is one past the last stage, -1 before the first
        pytest.param(
            {"stage": 3}, COORD, Refusal.LAYER_RANGE, NOT_A_STAGE.format(3, (0, 3)), id="stage-n"
        ),
        pytest.param(
            {"stage": -1}, COORD, Refusal.LAYER_RANGE, NOT_A_STAGE.format(-1, (0, 3)), id="stage-1"
        ),
        pytest.param(
            {"stage": 7, "layers": (0, 3, 5)},
            COORD,
            Refusal.LAYER_RANGE,
            NOT_A_STAGE.format(7, (0, 3, 5)),
            id="both-wrong",
        ),
        pytest.param(
            {"layers": (0, 3, 5)},
            COORD,
            Refusal.LAYER_RANGE,
            NOT_A_STAGE.format(0, (0, 3, 5)),
            id="three-bounds",
        ),
        pytest.param(
            {"n_stages": 9},
            COORD,
            Refusal.LAYER_RANGE,
            "layer range mismatch: cannot split 8 layers into 9 stages",
            id="cannot-split",
        ),
        pytest.param(
            {"layers": (0, 4)},
            COORD,
            Refusal.LAYER_RANGE,
            "layer range mismatch: offered layers (0, 4) for stage 0 of 3, "
            "this peer derives (0, 3)",
            id="other-range",
        ),
        pytest.param(
            {"node_id": "stage-9"},
            COORD,
            Refusal.NODE_ID,
            "node id mismatch: offered 'stage-9' for stage 0 (expected 'stage-0')",
            id="node-id",
        ),
        pytest.param(
            {"cluster_toml": "name = "},
            COORD,
            Refusal.CLUSTER_TOML,
            "invalid cluster TOML: Invalid value (at end of document)",
            id="toml-syntax",
        ),
        pytest.param(
            {"cluster_toml": BAD_SCHEMA},
            COORD,
            Refusal.CLUSTER_TOML,
            "invalid cluster TOML: 1 validation error for ClusterConfig",
            id="toml-schema",
        ),
        pytest.param(
            {"cluster_toml": TWO_STAGES},
            COORD,
            Refusal.CLUSTER_TOML,
            "invalid cluster TOML: 2 stages listed for stage 0 of 3",
            id="toml-stage-count",
        ),
        pytest.param(
            {"cluster_toml": toml(stages=(("stage-x", ME, "0-2"), *STAGES[1:]))},
            COORD,
            Refusal.CLUSTER_TOML,
            "invalid cluster TOML: stage 0 is 'stage-x' (layers 0-2) there, offered 'stage-0'",
            id="toml-stage-id",
        ),
        pytest.param(
            {
                "cluster_toml": toml(
                    stages=(
                        ("stage-0", ME, "0-3"),
                        ("stage-1", "127.0.0.3:19001", "4-5"),
                        STAGES[2],
                    )
                )
            },
            COORD,
            Refusal.CLUSTER_TOML,
            "invalid cluster TOML: stage 0 is 'stage-0' (layers 0-3) there, offered 'stage-0'",
            id="toml-stage-layers",
        ),
        pytest.param(
            {"cluster_toml": toml(stages=tuple((i, a, None) for i, a, _ in STAGES))},
            COORD,
            Refusal.CLUSTER_TOML,
            "invalid cluster TOML: stage 0 is 'stage-0' (layers None) there, offered 'stage-0'",
            id="toml-automatic-split",
        ),
        pytest.param(
            {"cluster_toml": TOML.replace(f'"{ME}"', '"127.0.0.2:19999"')},
            COORD,
            Refusal.ADDRESS,
            "listener address mismatch: the offered cluster puts stage-0 at 127.0.0.2:19999, "
            "this peer listens on 127.0.0.2:19001",
            id="address-port",
        ),
        pytest.param(
            {"cluster_toml": TOML.replace(f'"{ME}"', '"127.0.0.5:19001"')},
            COORD,
            Refusal.ADDRESS,
            "listener address mismatch: the offered cluster puts stage-0 at 127.0.0.5:19001, "
            "this peer listens on 127.0.0.2:19001",
            id="address-host",
        ),
        pytest.param(
            {},
            STRANGER,
            Refusal.COORDINATOR,
            f"coordinator identity mismatch: the offer names {COORD}, the handshake bound "
            f"{STRANGER}",
            id="coordinator-source",
        ),
        pytest.param(
            {"cluster_toml": toml(coordinator="127.0.0.9:19000")},
            COORD,
            Refusal.COORDINATOR,
            f"coordinator identity mismatch: the offer names {COORD} (cluster: 127.0.0.9:19000), "
            f"the handshake bound {COORD}",
            id="coordinator-in-toml",
        ),
        pytest.param(
            {"coordinator": "127.0.0.9:19000"},
            COORD,
            Refusal.COORDINATOR,
            "coordinator identity mismatch: the offer names 127.0.0.9:19000, the handshake "
            f"bound {COORD}",
            id="coordinator-in-offer",
        ),
    ],
)
def test_each_refusal_of_an_offer_word_for_word(
    changes: dict[str, object], source: str, code: Refusal, reason: str
) -> None:
    peer = PeerCore(facts(), 0.0)
    effects = peer.handle(offer(**changes), source, 5.0)
    if code in (Refusal.PROTOCOL, Refusal.VERSION, Refusal.MODEL, Refusal.LAYER_RANGE):
        # a retry against the same coordinator cannot succeed: the peer ends
        assert effects == _final(source, code, reason)
        assert peer.state is PeerState.ENDED and peer.next_timer() is None
    else:
        assert effects == _again(source, code, reason)
        assert peer.state is PeerState.WAITING and peer.next_timer() == 600.0
    assert peer.offer is None and peer.coordinator is None
    assert peer.refusals == deque([(source, code)])


@pytest.mark.parametrize(
    "exc", [PartitionError("no split"), ValueError("no split"), IndexError("no split")]
)
def test_a_range_that_cannot_be_derived_is_a_layer_range_refusal(exc: Exception) -> None:
    def derive(n_stages: int, index: int, memory: list[float] | None) -> tuple[int, int]:
        raise exc

    peer = PeerCore(facts(derive=derive), 0.0)
    assert peer.handle(offer(), COORD, 1.0) == _final(
        COORD, Refusal.LAYER_RANGE, "layer range mismatch: no split"
    )


def test_offer_refused_carries_its_code_and_reason() -> None:
    exc = OfferRefused(Refusal.NODE_ID, "node id mismatch: x")
    assert exc.code is Refusal.NODE_ID
    with pytest.raises(OfferRefused, match="^node id mismatch: x$"):
        raise exc


def test_the_derived_range_is_asked_once_per_stage_and_count() -> None:
    derive = Derive()
    peer = PeerCore(facts(derive=derive), 0.0)
    other = offer(cluster_toml=toml(coordinator="127.0.0.9:19000"))
    peer.handle(other, COORD, 1.0)  # refused (the cluster's coordinator) after deriving (3, 0)
    peer.handle(other, COORD, 2.0)  # a retry: split once
    assert derive.calls == [(3, 0)]
    # stage 1 of 3 derives its own range, (3, 6): the checks go on to the address
    reason = (
        "listener address mismatch: the offered cluster puts stage-1 at 127.0.0.3:19001, "
        f"this peer listens on {ME}"
    )
    effects = peer.handle(offer(stage=1, layers=(3, 6), node_id="stage-1"), COORD, 3.0)
    assert effects == _again(COORD, Refusal.ADDRESS, reason)
    assert derive.calls == [(3, 0), (3, 1)]


def test_at_most_four_cluster_tomls_are_held_parsed() -> None:
    parsed: list[str] = []

    def spy(text: str) -> ClusterConfig:
        parsed.append(text)
        return parse_cluster_toml(text)

    texts = [toml(coordinator="127.0.0.9:19000", extra=f"# {i}\n") for i in range(5)]
    peer = PeerCore(facts(parse_cluster=spy), 0.0)

    def offer_from_stranger(text: str) -> None:  # parsed, then refused for its coordinator
        (send, _warn) = peer.handle(offer(cluster_toml=text), COORD, 1.0)
        assert send.msg.code == Refusal.COORDINATOR  # type: ignore[union-attr]

    for t in texts[:4]:
        offer_from_stranger(t)
    offer_from_stranger(texts[0])  # four held: still cached
    assert parsed == texts[:4]
    offer_from_stranger(texts[4])  # the fifth clears the cache first ...
    offer_from_stranger(texts[0])  # ... so the first is parsed again
    assert parsed == [*texts, texts[0]]


# --- stale and foreign messages -------------------------------------------------------------------
def test_a_stranger_cannot_commit_activate_or_abort() -> None:
    peer = accepted()
    assert peer.handle(AssignCommit(7), STRANGER, 2.0) == [
        refused(STRANGER, 7, Refusal.NOT_ACCEPTED, "no accepted offer to commit for this attempt")
    ]
    assert peer.handle(AssignActivate(7), STRANGER, 2.0) == [
        refused(
            STRANGER, 7, Refusal.NOT_COMMITTED, "nothing committed to activate for this attempt"
        )
    ]
    assert peer.handle(AssignAbort(7, "x"), STRANGER, 2.0) == [
        Warn("debug", f"assignment: ignoring AssignAbort from {STRANGER}")
    ]
    assert peer.state is PeerState.ACCEPTED and peer.coordinator == COORD
    assert peer.refusals == deque(
        [(STRANGER, Refusal.NOT_ACCEPTED), (STRANGER, Refusal.NOT_COMMITTED)]
    )


def test_another_attempt_from_the_coordinator_is_not_obeyed() -> None:
    peer = accepted()
    # to the coordinator of the held offer: over its own outbox (peer=True)
    assert peer.handle(AssignCommit(8), COORD, 2.0) == [
        refused(
            COORD,
            8,
            Refusal.NOT_ACCEPTED,
            "no accepted offer to commit for this attempt",
            peer=True,
        )
    ]
    assert peer.handle(AssignActivate(6), COORD, 2.0) == [
        refused(
            COORD,
            6,
            Refusal.NOT_COMMITTED,
            "nothing committed to activate for this attempt",
            peer=True,
        )
    ]
    assert peer.handle(AssignAbort(6, "old"), COORD, 2.0) == [
        Warn("debug", f"assignment: ignoring AssignAbort from {COORD}")
    ]
    assert peer.state is PeerState.ACCEPTED and peer.next_timer() == 61.0


def test_other_messages_of_the_current_attempt_are_ignored() -> None:
    peer = accepted()
    for msg in (AssignCommitted(7), AssignAccepted(2, 7, "stage-0")):
        assert peer.handle(msg, COORD, 2.0) == [
            Warn("debug", f"assignment: ignoring {type(msg).__name__} from {COORD}")
        ]
    assert peer.state is PeerState.ACCEPTED


def test_an_undeliverable_answer_is_only_logged() -> None:
    peer = accepted()
    send = Send(COORD, AssignAccepted(2, 7, "stage-0"))
    assert peer.undeliverable(send, "connection reset", 2.0) == [
        Warn("debug", f"assignment: answer to {COORD} not delivered: connection reset")
    ]
    assert peer.state is PeerState.ACCEPTED and peer.next_timer() == 61.0


# --- commit, activate ---------------------------------------------------------------------------
def test_commit_then_activate_word_for_word() -> None:
    peer = accepted()
    assert peer.handle(AssignCommit(7), COORD, 2.0) == [Send(COORD, AssignCommitted(7))]
    assert peer.state is PeerState.COMMITTED and peer.next_timer() == 62.0
    # a repeated Commit is answered again and does not restart the phase wait
    assert peer.handle(AssignCommit(7), COORD, 30.0) == [Send(COORD, AssignCommitted(7))]
    assert peer.next_timer() == 62.0
    assert peer.handle(AssignActivate(7), COORD, 40.0) == [
        Send(COORD, AssignActivated(7)),
        Activated("stage-0", COORD, TOML),
    ]
    assert peer.state is PeerState.ACTIVE and peer.next_timer() is None
    assert peer.refusals == deque()


def test_activate_before_commit_is_refused_to_the_coordinator() -> None:
    peer = accepted()
    assert peer.handle(AssignActivate(7), COORD, 2.0) == [
        refused(
            COORD,
            7,
            Refusal.NOT_COMMITTED,
            "assignment peer: ACTIVATE is not allowed in state ACCEPTED",
            peer=True,
        )
    ]
    assert peer.state is PeerState.ACCEPTED and peer.next_timer() == 61.0
    assert peer.refusals == deque([(COORD, Refusal.NOT_COMMITTED)])


def test_an_active_peer_answers_activate_again_and_ignores_a_late_commit() -> None:
    peer = active()
    assert peer.handle(AssignActivate(7), COORD, 10.0) == [Send(COORD, AssignActivated(7))]
    assert peer.handle(AssignCommit(7), COORD, 10.0) == [
        Warn("debug", f"assignment: late Commit from {COORD} ignored")
    ]
    assert peer.handle(AssignAbort(7, "too late"), COORD, 10.0) == [
        Warn("warning", "assignment: Abort after Activate ignored: too late")
    ]
    assert peer.peer_lost(COORD, 10.0) == []  # the stage runs on
    assert peer.on_timer(1000.0) == []  # no timer is left, not even a phase wait
    assert peer.state is PeerState.ACTIVE and peer.next_timer() is None
    assert peer.refusals == deque()


def test_an_active_peer_refuses_any_new_offer_as_serving() -> None:
    peer = active()
    # a valid new attempt from its own coordinator
    assert peer.handle(offer(attempt=8), COORD, 10.0) == [
        refused(
            COORD,
            8,
            Refusal.SERVING,
            "assignment peer: OFFER_OK is not allowed in state ACTIVE",
            peer=True,
        )
    ]
    # a stranger's offer that fails a check: not busy, and the peer is not sent waiting
    assert peer.handle(offer(attempt=9, cluster_name="another"), STRANGER, 11.0) == [
        refused(
            STRANGER,
            9,
            Refusal.SERVING,
            "assignment peer: OFFER_REFUSED is not allowed in state ACTIVE",
        )
    ]
    # nor ended by a refusal that would end a waiting peer
    assert peer.handle(offer(attempt=9, protocol=1, coordinator=STRANGER), STRANGER, 12.0) == [
        refused(
            STRANGER,
            9,
            Refusal.SERVING,
            "assignment peer: OFFER_FINAL is not allowed in state ACTIVE",
        )
    ]
    assert peer.state is PeerState.ACTIVE and peer.offer == offer() and peer.coordinator == COORD
    assert peer.refusals == deque(
        [(COORD, Refusal.SERVING), (STRANGER, Refusal.SERVING), (STRANGER, Refusal.SERVING)]
    )


# --- back to waiting ----------------------------------------------------------------------------
@pytest.mark.parametrize("make", [accepted, committed], ids=["accepted", "committed"])
def test_abort_returns_to_waiting_and_restarts_the_wait(make: Callable[[], PeerCore]) -> None:
    peer = make()
    assert peer.handle(AssignAbort(7, "stage-1 did not commit"), COORD, 5.0) == [
        Warn("warning", f"assignment aborted by {COORD}: stage-1 did not commit")
    ]
    assert peer.state is PeerState.WAITING
    assert peer.offer is None and peer.coordinator is None
    assert peer.next_timer() == 605.0
    assert peer.on_timer(604.0) == []  # no phase wait is left behind
    assert peer.on_timer(605.0) == [PeerEnded("no stage assignment arrived within 600 s")]


@pytest.mark.parametrize(
    ("make", "phase", "at"),
    [(accepted, "accepted", 61.0), (committed, "committed", 62.0)],
    ids=["accepted", "committed"],
)
def test_a_phase_that_does_not_come_returns_to_waiting_exactly_at_its_deadline(
    make: Callable[[], PeerCore], phase: str, at: float
) -> None:
    peer = make()
    assert peer.next_timer() == at
    assert peer.on_timer(at - 1e-6) == []
    assert peer.state.value == phase
    assert peer.on_timer(at) == [
        Warn(
            "warning",
            f"assignment: {phase} for 60 s without the next phase; waiting for an assignment again",
        )
    ]
    assert peer.state is PeerState.WAITING
    assert peer.offer is None and peer.coordinator is None
    assert peer.next_timer() == at + 600.0
    assert peer.on_timer(at + 1.0) == []


def test_the_phase_wait_is_the_configured_one() -> None:
    peer = accepted(phase_wait=2.5)
    assert peer.next_timer() == 3.5
    assert peer.on_timer(3.5) == [
        Warn(
            "warning",
            "assignment: accepted for 2.5 s without the next phase; "
            "waiting for an assignment again",
        )
    ]


@pytest.mark.parametrize("make", [accepted, committed], ids=["accepted", "committed"])
def test_losing_the_coordinator_before_activate_returns_to_waiting(
    make: Callable[[], PeerCore],
) -> None:
    peer = make()
    assert peer.peer_lost(STRANGER, 5.0) == []  # someone else's connection: nothing changes
    assert peer.state is not PeerState.WAITING and peer.coordinator == COORD
    assert peer.peer_lost(COORD, 5.0) == [
        Warn(
            "warning",
            f"assignment: lost the coordinator {COORD} before Activate; "
            "waiting for an assignment again",
        )
    ]
    assert peer.state is PeerState.WAITING
    assert peer.offer is None and peer.coordinator is None
    assert peer.next_timer() == 605.0
    assert peer.peer_lost(COORD, 6.0) == []  # already waiting


def test_a_peer_ended_by_its_coordinator_answers_later_phases_with_refusals() -> None:
    peer = accepted()
    reason = "assignment protocol mismatch: the coordinator speaks version 1, this peer version 2"
    assert peer.handle(offer(attempt=8, protocol=1), COORD, 2.0) == [
        refused(COORD, 8, Refusal.PROTOCOL, reason, final=True, peer=True),
        PeerEnded(f"stage assignment refused: {reason} (the offer came from {COORD})"),
    ]
    assert peer.state is PeerState.ENDED and peer.next_timer() is None
    # the first offer is still held, so its Abort reaches the table and is refused there
    assert peer.handle(AssignAbort(7, "gone"), COORD, 3.0) == [
        Warn("warning", f"assignment aborted by {COORD}: gone"),
        refused(
            COORD,
            7,
            Refusal.NOT_ACCEPTED,
            "assignment peer: ABORT is not allowed in state ENDED",
            peer=True,
        ),
    ]
    assert peer.handle(AssignActivate(7), COORD, 3.0) == [
        refused(
            COORD,
            7,
            Refusal.NOT_COMMITTED,
            "assignment peer: ACTIVATE is not allowed in state ENDED",
            peer=True,
        )
    ]
    assert peer.state is PeerState.ENDED


# --- a bring-up that re-plans by memory ---------------------------------------------------------
def test_the_peer_says_its_memory_when_it_accepts() -> None:
    peer = PeerCore(facts(memory=48 << 30), 0.0)
    out = peer.handle(offer(), COORD, 1.0)
    assert out[0] == Send(COORD, AssignAccepted(2, 7, "stage-0", 48 << 30))


def test_the_second_offer_of_a_replanned_bring_up_is_taken_and_the_first_is_then_stale() -> None:
    peer = accepted()
    again = offer(attempt=8)
    assert peer.handle(again, COORD, 2.0)[0] == Send(COORD, AssignAccepted(2, 8, "stage-0"))
    assert peer.state is PeerState.ACCEPTED and peer.offer == again
    # A late copy of the first round's offer does not take the peer back to attempt 7.
    assert peer.handle(offer(), COORD, 2.5) == [
        Warn("debug", f"assignment: superseded offer from {COORD} ignored")
    ]
    assert peer.offer == again


def test_an_abort_of_the_replanned_attempt_ends_the_offer_held() -> None:
    peer = accepted()  # attempt 7 held; the coordinator failed after re-planning as attempt 8
    out = peer.handle(AssignAbort(8, "the model does not fit"), COORD, 2.0)
    assert peer.state is PeerState.WAITING and peer.offer is None
    assert out[0] == Warn("warning", f"assignment aborted by {COORD}: the model does not fit")
    # Any other attempt's Abort is not this peer's.
    other = accepted()
    assert other.handle(AssignAbort(9, "x"), COORD, 2.0)[0].kind == "debug"  # type: ignore[union-attr]
    assert other.state is PeerState.ACCEPTED


def test_a_member_speaking_for_another_coordinator_cannot_end_a_waiting_peer() -> None:
    """A secret holder that is not the coordinator its offer names gets a refusal that leaves
    the peer waiting, even for an offer every final check would refuse."""
    peer = PeerCore(facts(), 0.0)
    out = peer.handle(offer(protocol=1, mlxcel_version="0.0.1"), STRANGER, 1.0)
    assert peer.state is PeerState.WAITING
    assert out[0] == refused(
        STRANGER,
        7,
        Refusal.COORDINATOR,
        f"coordinator identity mismatch: the offer names {COORD}, the handshake bound {STRANGER}",
    )


def test_a_repeated_offer_is_accepted_again_with_the_memory() -> None:
    peer = PeerCore(facts(memory=48 << 30), 0.0)
    peer.handle(offer(), COORD, 1.0)
    assert peer.handle(offer(), COORD, 1.5) == [
        Send(COORD, AssignAccepted(2, 7, "stage-0", 48 << 30))
    ]


def test_an_offer_split_by_memory_is_derived_from_the_same_figures() -> None:
    gib = [1.0, 1.0, 4.0]
    memory = [g * 2**30 for g in gib]
    ranges = [derived_range(COSTS, 3, i, memory) for i in range(3)]
    assert ranges[0] != (0, 3)  # the figures change the split
    stages = tuple(
        (f"stage-{i}", addr, f"{lo}-{hi - 1}")
        for i, ((_, addr, _), (lo, hi)) in enumerate(zip(STAGES, ranges, strict=True))
    )
    text = toml(stages)
    for i, g in enumerate(gib):  # each stage's memory_gb after its layers
        head = f'layers = "{stages[i][2]}"\n'
        at = text.index(head, text.index(f'id = "stage-{i}"'))
        text = text[: at + len(head)] + f"memory_gb = {g}\n" + text[at + len(head) :]
    asked: list[object] = []

    def derive(n_stages: int, index: int, memory: list[float] | None) -> tuple[int, int]:
        asked.append(memory)
        return derived_range(COSTS, n_stages, index, memory)

    peer = PeerCore(facts(derive=derive), 0.0)
    out = peer.handle(offer(layers=ranges[0], cluster_toml=text), COORD, 1.0)
    assert out == [
        Send(COORD, AssignAccepted(2, 7, "stage-0")),
        Warn("info", f"assignment: accepted stage-0 (layers 0-0 of 8) from {COORD}"),
    ]
    assert asked == [memory]


def test_the_derived_ranges_held_are_at_most_64() -> None:
    calls: list[int] = []

    def derive(n_stages: int, index: int, memory: list[float] | None) -> tuple[int, int]:
        calls.append(n_stages)
        return (0, 3)

    peer = PeerCore(facts(derive=derive), 0.0)

    def ask(n_stages: int) -> None:  # derived, then refused (the cluster lists 3 stages)
        (send, _warn) = peer.handle(offer(n_stages=n_stages), COORD, 1.0)
        assert send.msg.code == Refusal.CLUSTER_TOML  # type: ignore[union-attr]

    for n in range(4, 68):  # 64 ranges: all held
        ask(n)
    ask(4)
    assert len(calls) == 64
    ask(68)  # a 65th: the ones held are forgotten
    ask(4)
    assert calls[-2:] == [68, 4]
