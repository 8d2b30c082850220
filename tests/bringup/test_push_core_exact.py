"""The coordinator's push core, word for word and to the edge of every bound.

Pins, for :class:`~mlxcel.bringup.push_core.PushCore`: the whole effect list of every path
(offers, Commit, Activate and their repeats with their frame deadlines; Abort with a
handshake's time for a peer that never answered, a frame's for one that did; ``PushDone``),
every log line's kind and text, every failure and deadline summary, the ``Outcome`` it keeps,
and that each deadline and retry fires exactly at its time and not a microsecond before.
"""

from __future__ import annotations

import dataclasses

import pytest

from mlxcel import __version__
from mlxcel.base.effects import Effect, Send, Warn
from mlxcel.base.messages import (
    AssignAbort,
    AssignAccepted,
    AssignActivate,
    AssignActivated,
    AssignCommit,
    AssignCommitted,
    AssignOffer,
    AssignRefused,
    CancelRequest,
)
from mlxcel.bringup.beacon import BeaconGate, beacon_key, make_beacon
from mlxcel.bringup.plan import make_plan
from mlxcel.bringup.protocol import (
    HANDSHAKE_BOUND,
    ModelIdentity,
    PeerStep,
    Phase,
    PushDone,
    Verify,
)
from mlxcel.bringup.push_core import Outcome, PushConfig, PushCore, is_loopback
from mlxcel.pipeline.partition import LayerCosts
from mlxcel.sim.bugs import planted

COSTS = LayerCosts((100,) * 8, 50, 50, 0)
MODEL = ModelIdentity("ab" * 32, 8)
COORD = "127.0.0.1:19000"
ATTEMPT = 7
# Given out of address order: stage ids follow the sorted addresses.
PEERS = ("127.0.0.3:19001", "127.0.0.2:19001", "127.0.0.4:19001")
S0, S1, S2 = "127.0.0.2:19001", "127.0.0.3:19001", "127.0.0.4:19001"
ALL = (S0, S1, S2)
ID = {S0: "stage-0", S1: "stage-1", S2: "stage-2"}
STAGES_TEXT = (
    "stage-0=127.0.0.2:19001 (layers 0-2), stage-1=127.0.0.3:19001 (layers 3-5), "
    "stage-2=127.0.0.4:19001 (layers 6-7)"
)
EPS = 1e-6
KEY = beacon_key(b"k" * 32)


def config(beacon_key: bytes | None = None, **kw: object) -> PushConfig:
    """``beacon_key``: beacons judged by the gate the coordinator builds on that key."""
    cfg = PushConfig(
        attempt=ATTEMPT,
        n_peers=len(PEERS),
        coordinator=COORD,
        version=__version__,
        cluster_name="mlxcel-cluster",
        model=MODEL,
        costs=COSTS,
        peers=PEERS,
    )
    cfg = dataclasses.replace(cfg, **kw)  # type: ignore[arg-type]
    if beacon_key is None:
        return cfg
    return dataclasses.replace(cfg, gate=BeaconGate(beacon_key, cfg.version, cfg.cluster_name))


def expected_offers(
    peers: list[str], *, cluster: str = "mlxcel-cluster", secret_file: str | None = None
) -> dict[str, AssignOffer]:
    """What the core must offer each peer, built from the plan module (not the core)."""
    plan = make_plan(cluster, COORD, peers, COSTS, secret_file)
    return {
        a.address: AssignOffer(
            2,
            ATTEMPT,
            __version__,
            cluster,
            MODEL.sha256,
            MODEL.n_layers,
            len(plan.stages),
            a.index,
            (a.start, a.end),
            a.node_id,
            COORD,
            plan.body(),
        )
        for a in plan.stages
    }


OFFER = expected_offers(list(PEERS))


def offer_sends(deadline: float, to: tuple[str, ...] = ALL) -> list[Effect]:
    return [Send(a, OFFER[a], deadline=deadline) for a in to]


def sends(msg: object, deadline: float, to: tuple[str, ...] = ALL) -> list[Effect]:
    return [Send(a, msg, deadline=deadline) for a in to]  # type: ignore[arg-type]


def abort(summary: str, deadlines: dict[str, float]) -> list[Effect]:
    return [Send(a, AssignAbort(ATTEMPT, summary), deadline=d) for a, d in deadlines.items()]


def accepted(addr: str) -> AssignAccepted:
    return AssignAccepted(2, ATTEMPT, ID[addr])


def started(**kw: object) -> PushCore:
    core = PushCore(config(**kw), 0.0)
    core.start(0.0)
    return core


def committing(at: float = 1.0, **kw: object) -> PushCore:
    """Every peer accepted at ``at``: the core is committing."""
    core = started(**kw)
    for a in ALL:
        core.handle(accepted(a), a, at)
    assert core.phase is Phase.COMMITTING
    return core


def activating(at: float = 2.0, **kw: object) -> PushCore:
    """Every peer accepted at 1.0 and committed at ``at``: the core is activating."""
    core = committing(**kw)
    for a in ALL:
        core.handle(AssignCommitted(ATTEMPT), a, at)
    assert core.phase is Phase.ACTIVATING
    return core


def beacon(address: str, nonce: bytes, cluster: str = "mlxcel-cluster") -> bytes:
    return make_beacon(KEY, __version__, cluster, address, 1000.0, nonce * 16)


# --- is_loopback ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:19000", True),
        ("127.9.9.9:1", True),
        ("[::1]:19000", True),  # brackets stripped, split at the last colon
        ("10.1.2.3:19000", False),
        ("[::2]:1", False),
        ("X127.0.0.1:1", False),  # only brackets are stripped: a stray character is no IP
        ("localhost:19000", False),  # a name is not judged loopback
        ("not-an-address", False),
    ],
)
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


# --- construction and start --------------------------------------------------------------------
def test_a_static_core_starts_with_its_deduplicated_peers_and_a_deadline_of_now() -> None:
    core = PushCore(config(peers=(S1, S1, S0, S2)), 5.0)
    assert core.phase is Phase.DISCOVERING
    assert core.found == [S1, S0, S2]  # duplicates dropped, order kept
    assert (core.started, core.push_start) == (5.0, 5.0)
    assert core.gate is None and core.plan is None and core.outcome is None
    assert core.peers == {}
    assert core.next_timer() == 5.0  # static discovery waits for nothing


def test_a_beacon_core_listens_for_its_discovery_window() -> None:
    core = PushCore(
        config(peers=(), beacon_key=KEY, cluster_name="lab-a", discovery_window=12.5), 5.0
    )
    assert core.gate is not None
    assert (core.gate.key, core.gate.version, core.gate.cluster) == (KEY, __version__, "lab-a")
    assert core.peers == {} and core.plan is None
    assert core.next_timer() == 17.5
    assert core.start(5.0) == [Warn("info", "discovery: listening for 3 peers' beacons for 12.5 s")]
    assert core.phase is Phase.DISCOVERING


def test_start_offers_every_peer_in_address_order_within_one_frame() -> None:
    core = PushCore(config(secret_file="/etc/s"), 100.0)
    out = core.start(100.0)
    want = expected_offers(list(PEERS), secret_file="/etc/s")
    assert out == [Send(a, want[a], deadline=110.0) for a in ALL]
    assert core.plan == make_plan("mlxcel-cluster", COORD, list(PEERS), COSTS, "/etc/s")
    assert 'secret_file = "/etc/s"' in want[S0].cluster_toml
    # the stages, concretely: stage-0 of 3 takes layers 0-2 ...
    assert [(o.stage, o.node_id, o.layers, o.n_stages) for o in want.values()] == [
        (0, "stage-0", (0, 3), 3),
        (1, "stage-1", (3, 6), 3),
        (2, "stage-2", (6, 8), 3),
    ]
    assert core.phase is Phase.OFFERING and core.push_start == 100.0
    assert {a: (p.node_id, p.step, p.why) for a, p in core.peers.items()} == {
        a: (ID[a], PeerStep.UNANSWERED, "") for a in ALL
    }
    assert core.next_timer() == 100.5  # the offer is repeated every 0.5 s


def test_a_short_push_window_caps_the_offer_frame_at_the_offer_deadline() -> None:
    # the offer phase ends FRAME_BOUND (10 s) before the push window: 15 - 10 = 5
    core = PushCore(config(push_window=15.0), 0.0)
    assert core.start(0.0) == offer_sends(5.0)
    assert core.on_timer(5.0 - EPS) == offer_sends(5.0)  # the repeats, still before the deadline


# --- discovery by beacons ----------------------------------------------------------------------
def test_beacons_resolve_the_peers_once_each_answers_a_handshake_then_offers_go_out() -> None:
    core = PushCore(config(peers=(), beacon_key=KEY, n_peers=2, cluster_name="lab-a"), 0.0)
    core.start(0.0)
    a, b = "127.0.0.3:7", "127.0.0.2:7"
    # A genuine beacon is only a claim: the peer counts once its address answers a handshake.
    assert core.beacon(beacon(a, b"a", "lab-a"), "127.0.0.3", 0.1, 1000.0) == [
        Warn("debug", "discovery: beacon from 127.0.0.3:7; checking that it answers"),
        Verify(a, 0.1 + HANDSHAKE_BOUND),
    ]
    assert core.found == [] and core.checking == {a}
    # the same peer again while its check runs (a fresh beacon): nothing new
    assert core.beacon(beacon(a, b"b", "lab-a"), "127.0.0.3", 0.2, 1000.0) == []
    assert core.verified(a, None, 0.25) == [Warn("info", "discovery: peer 127.0.0.3:7 (1 of 2)")]
    assert core.beacon(beacon(a, b"e", "lab-a"), "127.0.0.3", 0.26, 1000.0) == []  # found
    assert core.verified(a, None, 0.27) == []  # an answer nobody waits for
    want = expected_offers([a, b], cluster="lab-a")
    assert core.beacon(beacon(b, b"c", "lab-a"), "127.0.0.2", 0.3, 1000.0)[1] == Verify(b, 5.3)
    assert core.verified(b, None, 0.3) == [
        Warn("info", "discovery: peer 127.0.0.2:7 (2 of 2)"),
        Send("127.0.0.2:7", want["127.0.0.2:7"], deadline=10.3),
        Send("127.0.0.3:7", want["127.0.0.3:7"], deadline=10.3),
    ]
    assert core.phase is Phase.OFFERING and core.found == [a, b]
    # a check that ends after discovery did changes nothing either
    c = "127.0.0.4:7"
    core2 = PushCore(config(peers=(), beacon_key=KEY, n_peers=1, cluster_name="lab-a"), 0.0)
    core2.beacon(beacon(a, b"x", "lab-a"), "127.0.0.3", 0.1, 1000.0)
    core2.beacon(beacon(c, b"y", "lab-a"), "127.0.0.4", 0.1, 1000.0)
    core2.verified(a, None, 0.2)
    assert core2.phase is Phase.OFFERING
    assert core2.verified(c, None, 0.3) == [] and core2.found == [a]
    assert core2.verified(c, "refused", 0.3) == [] and core2.dropped == {}
    # the check's deadline never runs past discovery's
    core3 = PushCore(config(peers=(), beacon_key=KEY, discovery_window=3.0), 0.0)
    assert core3.beacon(beacon(a, b"z"), "127.0.0.3", 1.0, 1000.0)[1] == Verify(a, 3.0)
    # once resolved, a further good beacon changes nothing
    assert core.beacon(beacon("127.0.0.5:7", b"d", "lab-a"), "127.0.0.5", 0.4, 1000.0) == []
    assert core.found == [a, b]


def test_a_beaconed_address_that_does_not_answer_is_dropped_and_checked_again_later() -> None:
    """A captured beacon replayed from the address of a peer that left: genuine, but nothing
    answers there. Dropped with a line, not counted, checked again only after 2 s."""
    core = PushCore(config(peers=(), beacon_key=KEY, n_peers=2), 0.0)
    core.start(0.0)
    gone, live = "127.0.0.3:7", "127.0.0.2:7"
    core.beacon(beacon(gone, b"a"), "127.0.0.3", 1.0, 1000.0)
    assert core.verified(gone, "connect deadline passed", 6.0) == [
        Warn(
            "discovery-drop",
            "discovery: dropping 127.0.0.3:7: its beacon is genuine but nothing holding the "
            "secret answers there (connect deadline passed); a peer that left, or a replayed "
            "beacon",
        )
    ]
    assert core.found == [] and core.dropped == {gone: "connect deadline passed"}
    assert core.beacon(beacon(gone, b"b"), "127.0.0.3", 8.0 - EPS, 1000.0) == []  # not yet
    assert core.beacon(beacon(gone, b"c"), "127.0.0.3", 8.0, 1000.0)[1] == Verify(gone, 13.0)
    assert core.verified(gone, "connection refused", 8.1)[0].kind == "discovery-drop"
    core.beacon(beacon(live, b"d"), "127.0.0.2", 9.0, 1000.0)
    assert core.verified(live, None, 9.1) == [Warn("info", "discovery: peer 127.0.0.2:7 (1 of 2)")]
    text = (
        "bring-up failed: discovered 1 of 2 peers within 30 s (127.0.0.2:7); dropped "
        "127.0.0.3:7: connection refused; are they beaconing to this host's discovery port "
        "with the same secret? No stage was started"
    )
    assert core.on_timer(30.0) == [PushDone(False, text)]
    # A peer that answers after all counts (a slow start), and leaves the dropped list.
    core = PushCore(config(peers=(), beacon_key=KEY, n_peers=2), 0.0)
    core.beacon(beacon(gone, b"e"), "127.0.0.3", 1.0, 1000.0)
    core.verified(gone, "connection refused", 1.1)
    core.beacon(beacon(gone, b"f"), "127.0.0.3", 3.1, 1000.0)
    core.verified(gone, None, 3.2)
    assert core.found == [gone] and core.dropped == {}


def test_beacon_rejections_are_logged_by_kind() -> None:
    core = PushCore(config(peers=(), beacon_key=KEY), 0.0)
    forged = make_beacon(
        beacon_key(b"o" * 32), __version__, "mlxcel-cluster", "127.0.0.5:1", 1000.0, b"f" * 16
    )
    assert core.beacon(forged, "127.0.0.5", 0.1, 1000.0) == [
        Warn(
            "diagnostic",
            "discovery: beacon rejected: invalid MAC (another cluster secret?): from 127.0.0.5",
        )
    ]
    # another cluster on the same network is no anomaly: debug
    assert core.beacon(beacon("127.0.0.5:1", b"g", "lab-b"), "127.0.0.5", 0.2, 1000.0) == [
        Warn(
            "debug",
            "discovery: beacon rejected: another cluster name: "
            "127.0.0.5 is in cluster 'lab-b', not 'mlxcel-cluster'",
        )
    ]
    assert core.found == []


def test_a_core_without_a_beacon_key_ignores_beacons() -> None:
    core = PushCore(config(peers=()), 0.0)
    assert core.gate is None
    assert core.beacon(beacon("127.0.0.5:1", b"h"), "127.0.0.5", 0.1, 1000.0) == []
    assert core.found == [] and core.phase is Phase.DISCOVERING


def test_the_discovery_deadline_fires_at_its_time_naming_what_was_found() -> None:
    core = PushCore(config(peers=(), beacon_key=KEY), 2.0)
    core.start(2.0)
    core.beacon(beacon("127.0.0.3:7", b"i"), "127.0.0.3", 3.0, 1000.0)
    core.verified("127.0.0.3:7", None, 3.0)
    core.beacon(beacon("127.0.0.2:7", b"j"), "127.0.0.2", 4.0, 1000.0)
    core.verified("127.0.0.2:7", None, 4.0)
    assert core.next_timer() == 32.0
    assert core.on_timer(32.0 - EPS) == [] and core.outcome is None
    text = (
        "bring-up failed: discovered 2 of 3 peers within 30 s (127.0.0.3:7, 127.0.0.2:7); "
        "are they beaconing to this host's discovery port with the same secret? "
        "No stage was started"
    )
    assert core.on_timer(32.0) == [PushDone(False, text)]  # no peers yet: nobody to abort
    assert core.outcome == Outcome(False, text, None, 32.0)
    assert core.phase is Phase.FAILED
    assert core.next_timer() is None and core.on_timer(40.0) == []
    assert core.beacon(beacon("127.0.0.4:7", b"k"), "127.0.0.4", 41.0, 1000.0) == []


def test_the_discovery_deadline_with_nothing_found() -> None:
    core = PushCore(config(peers=(), beacon_key=KEY, n_peers=2), 0.0)
    text = (
        "bring-up failed: discovered 0 of 2 peers within 30 s; "
        "are they beaconing to this host's discovery port with the same secret? "
        "No stage was started"
    )
    assert core.on_timer(30.0) == [PushDone(False, text)]
    assert core.outcome == Outcome(False, text, None, 30.0)


# --- planning failures and the dry run ---------------------------------------------------------
def test_the_loopback_rule_names_every_remote_peer() -> None:
    core = PushCore(config(peers=("127.0.0.2:1", "10.1.2.3:1", "10.1.2.4:1")), 3.0)
    text = (
        "the coordinator's control address 127.0.0.1:19000 is loopback but peer(s) "
        "10.1.2.3:1, 10.1.2.4:1 are not: stages could not reply to it (serve on a "
        "reachable --host or give --cluster-control-addr)"
    )
    assert core.start(3.0) == [PushDone(False, text)]
    assert core.outcome == Outcome(False, text, None, 3.0)
    assert core.phase is Phase.FAILED and core.peers == {}


def test_a_cluster_that_cannot_be_planned_fails_before_any_offer() -> None:
    peers = tuple(f"127.0.0.{i}:1" for i in range(2, 11))  # 9 peers, 8 layers
    core = PushCore(config(peers=peers, n_peers=9), 3.0)
    text = "cannot plan the cluster: cannot split 8 layers into 9 stages"
    assert core.start(3.0) == [PushDone(False, text)]
    assert core.outcome == Outcome(False, text, None, 3.0)
    assert core.phase is Phase.FAILED and core.plan is None


def test_a_dry_run_offers_plans_by_memory_then_aborts_and_commits_nothing() -> None:
    core = PushCore(config(dry_run=True, secret_file="/etc/s"), 4.0)
    assert core.start(4.0) == [
        Send(a, o, deadline=14.0)
        for a, o in expected_offers(list(PEERS), secret_file="/etc/s").items()
    ]
    mem = {S0: 2048, S1: 1024, S2: 1024}
    core.handle(AssignAccepted(2, ATTEMPT, ID[S0], mem[S0]), S0, 4.1)
    core.handle(AssignAccepted(2, ATTEMPT, ID[S1], mem[S1]), S1, 4.2)
    out = core.handle(AssignAccepted(2, ATTEMPT, ID[S2], mem[S2]), S2, 4.3)
    plan = make_plan("mlxcel-cluster", COORD, list(PEERS), COSTS, "/etc/s", mem)
    assert core.outcome is not None and core.outcome.ok and core.outcome.plan == plan
    text = core.outcome.summary
    assert text.startswith(
        "dry run: planned stage-0=127.0.0.2:19001 (layers 0-3, 450 B of 2.0 KiB)"
    )
    assert out == [Send(a, AssignAbort(ATTEMPT, text), deadline=14.3) for a in ALL] + [
        PushDone(True, text)
    ]
    assert core.phase is Phase.DONE and core.next_timer() is None


def test_peers_that_say_their_memory_get_a_split_by_it_as_a_new_attempt() -> None:
    core = started()
    mem = {S0: 1000, S1: 1000, S2: 4000}  # the third peer holds four times as much
    for a in ALL[:2]:
        assert core.handle(AssignAccepted(2, ATTEMPT, ID[a], mem[a]), a, 0.1) == []
    out = core.handle(AssignAccepted(2, ATTEMPT, ID[S2], mem[S2]), S2, 0.2)
    plan = make_plan("mlxcel-cluster", COORD, list(PEERS), COSTS, None, mem)
    assert core.plan == plan and [a.layers for a in plan.stages] == ["0-0", "1-1", "2-7"]
    assert "memory_gb = " in plan.body()
    again = [o for o in out if isinstance(o, Send)]
    assert [s.dest for s in again] == list(ALL)
    assert all(isinstance(s.msg, AssignOffer) and s.msg.attempt == ATTEMPT + 1 for s in again)
    assert {s.dest: s.msg.layers for s in again} == {S0: (0, 1), S1: (1, 2), S2: (2, 8)}  # type: ignore[union-attr]
    assert core.phase is Phase.OFFERING
    # A late answer to the first round counts for nothing; the new round's answers commit.
    assert core.handle(AssignAccepted(2, ATTEMPT, ID[S0], 1000), S0, 0.3)[0].kind == "debug"  # type: ignore[union-attr]
    for a in ALL:
        out = core.handle(AssignAccepted(2, ATTEMPT + 1, ID[a], mem[a]), a, 0.4)
    assert core.phase is Phase.COMMITTING
    assert out == [Send(a, AssignCommit(ATTEMPT + 1), deadline=10.4) for a in ALL]


def test_a_model_that_does_not_fit_the_peers_fails_with_the_figures_and_starts_nothing() -> None:
    core = started()
    for a in ALL[:2]:
        core.handle(AssignAccepted(2, ATTEMPT, ID[a], 300), a, 0.1)
    out = core.handle(AssignAccepted(2, ATTEMPT, ID[S2], 300), S2, 0.2)
    assert core.phase is Phase.FAILED and core.outcome is not None and not core.outcome.ok
    text = core.outcome.summary
    assert text.startswith("bring-up failed: the model does not fit these peers' memory: ")
    assert "does not fit" in text and "no stage was started" in text
    assert "<- does not fit" in text  # the table: bytes per stage beside each peer's memory
    assert out == [Send(a, AssignAbort(ATTEMPT, text), deadline=10.2) for a in ALL] + [
        PushDone(False, text)
    ]


def test_a_peer_that_does_not_say_its_memory_keeps_the_first_split() -> None:
    core = started()
    for a in ALL:
        out = core.handle(AssignAccepted(2, ATTEMPT, ID[a]), a, 0.1)
    assert core.phase is Phase.COMMITTING
    assert out == [Send(a, AssignCommit(ATTEMPT), deadline=10.1) for a in ALL]


def test_progress_says_what_the_push_still_waits_for() -> None:
    core = PushCore(config(peers=(), beacon_key=KEY, discovery_window=30.0), 0.0)
    core.start(0.0)
    assert core.progress(10.0) == (
        "discovery: 0 of 3 peers after 10 s of 30 s; listening for beacons"
    )
    core.found = [S0]
    assert core.progress(15.2) == (
        f"discovery: 1 of 3 peers ({S0}) after 15 s of 30 s; listening for beacons"
    )
    core = started()
    core.handle(accepted(S0), S0, 0.1)
    assert core.progress(5.0) == (
        f"assignment: waiting for {ID[S1]} at {S1}, {ID[S2]} at {S2} to accept (5 s of 60 s)"
    )
    core.handle(accepted(S1), S1, 6.0)
    core.handle(accepted(S2), S2, 6.0)
    assert core.progress(7.0) == (
        f"assignment: waiting for {ID[S0]} at {S0}, {ID[S1]} at {S1}, {ID[S2]} at {S2} to "
        "commit (7 s of 60 s)"
    )


# --- offering ----------------------------------------------------------------------------------
def test_offers_are_repeated_at_their_retry_time_only_to_peers_that_did_not_answer() -> None:
    core = started()
    assert core.handle(accepted(S0), S0, 0.1) == []  # one of three: nothing moves yet
    assert core.peers[S0].step is PeerStep.ACCEPTED
    assert core.next_timer() == 0.5
    assert core.on_timer(0.5 - EPS) == []
    assert core.on_timer(0.5) == offer_sends(10.5, (S1, S2))
    assert core.next_timer() == 1.0


def test_commit_goes_out_once_every_peer_accepted() -> None:
    core = started(push_window=15.0)
    core.handle(accepted(S0), S0, 1.0)
    core.handle(accepted(S2), S2, 2.0)
    assert core.phase is Phase.OFFERING
    assert core.handle(accepted(S1), S1, 4.0) == sends(AssignCommit(ATTEMPT), 14.0)
    assert core.phase is Phase.COMMITTING
    assert core.next_timer() == 5.0  # Commit is repeated every second
    assert core.on_timer(5.0 - EPS) == []
    assert core.on_timer(5.0) == sends(AssignCommit(ATTEMPT), 15.0)  # capped at the window


def test_the_offer_deadline_names_the_late_peers_and_aborts_everyone() -> None:
    core = started()  # push window 60: offers end at 50
    core.handle(accepted(S0), S0, 0.1)
    core.undeliverable(Send(S1, OFFER[S1]), "connection refused", 0.2)
    out = core.on_timer(50.0 - EPS)
    assert core.outcome is None and all(isinstance(e, Send) for e in out)
    text = (
        "bring-up failed: stage-1 at 127.0.0.3:19001 (last attempt: connection refused), "
        "stage-2 at 127.0.0.4:19001 did not accept in time; "
        "not committed: stage-0, stage-1, stage-2; no stage was started"
    )
    # an accepted peer is told within a frame, an unanswered one within a handshake
    assert core.on_timer(50.0) == [
        *abort(text, {S0: 60.0, S1: 55.0, S2: 55.0}),
        PushDone(False, text),
    ]
    assert core.outcome == Outcome(False, text, core.plan, 50.0)
    assert core.phase is Phase.FAILED and core.next_timer() is None


# --- committing --------------------------------------------------------------------------------
def test_the_commit_deadline_is_the_end_of_the_push_window() -> None:
    core = started(push_window=15.0)
    for a in ALL:
        core.handle(accepted(a), a, 4.0)
    core.handle(AssignCommitted(ATTEMPT), S0, 4.5)
    core.handle(AssignCommitted(ATTEMPT), S2, 4.5)
    out = core.on_timer(15.0 - EPS)
    assert out == [Send(S1, AssignCommit(ATTEMPT), deadline=15.0)]
    text = (
        "bring-up failed: stage-1 at 127.0.0.3:19001 did not commit in time; "
        "not committed: stage-1; no stage was started"
    )
    assert core.on_timer(15.0) == [
        *abort(text, {S0: 25.0, S1: 25.0, S2: 25.0}),
        PushDone(False, text),
    ]
    assert core.outcome == Outcome(False, text, core.plan, 15.0)


def test_the_commit_deadline_counts_from_the_push_start() -> None:
    # accepted late (at 40): the commit phase still ends 60 s after the push started
    core = committing(at=40.0)
    assert core.on_timer(60.0 - EPS) == sends(AssignCommit(ATTEMPT), 60.0)
    (*_, done) = core.on_timer(60.0)
    assert isinstance(done, PushDone) and not done.ok


# --- activating --------------------------------------------------------------------------------
def test_activate_goes_out_once_every_peer_committed_then_done() -> None:
    core = committing(at=1.0)
    core.handle(AssignCommitted(ATTEMPT), S0, 6.0)
    core.handle(AssignCommitted(ATTEMPT), S1, 6.0)
    assert core.handle(AssignCommitted(ATTEMPT), S2, 6.0) == sends(AssignActivate(ATTEMPT), 16.0)
    assert core.phase is Phase.ACTIVATING
    assert core.next_timer() == 7.0  # Activate is repeated every second
    assert core.on_timer(7.0 - EPS) == []
    assert core.handle(AssignActivated(ATTEMPT), S0, 6.5) == []
    # one frame's window for the whole round: the repeat is capped at 16
    assert core.on_timer(7.0) == sends(AssignActivate(ATTEMPT), 16.0, (S1, S2))
    core.handle(AssignActivated(ATTEMPT), S1, 7.5)
    text = "bring-up complete: " + STAGES_TEXT
    assert core.handle(AssignActivated(ATTEMPT), S2, 8.0) == [PushDone(True, text)]
    assert core.outcome == Outcome(True, text, core.plan, 8.0)
    assert core.phase is Phase.DONE
    assert core.next_timer() is None and core.on_timer(100.0) == []


def test_the_activation_deadline_names_who_did_not_confirm_and_who_runs() -> None:
    core = activating(at=6.0)  # deadline 16
    core.handle(AssignActivated(ATTEMPT), S0, 6.5)
    assert core.outcome is None and core.on_timer(16.0 - EPS) == sends(
        AssignActivate(ATTEMPT), 16.0, (S1, S2)
    )
    text = (
        "bring-up failed: stage-1 at 127.0.0.3:19001, stage-2 at 127.0.0.4:19001 "
        "did not confirm activation in time; already activated (their stages run): stage-0"
    )
    # the activated peer runs its stage: it is not aborted
    assert core.on_timer(16.0) == [*abort(text, {S1: 26.0, S2: 26.0}), PushDone(False, text)]
    assert core.outcome == Outcome(False, text, core.plan, 16.0)


def test_the_activation_deadline_lists_every_activated_peer() -> None:
    core = activating(at=6.0)
    core.handle(AssignActivated(ATTEMPT), S0, 6.5)
    core.handle(AssignActivated(ATTEMPT), S1, 6.5)
    text = (
        "bring-up failed: stage-2 at 127.0.0.4:19001 did not confirm activation in time; "
        "already activated (their stages run): stage-0, stage-1"
    )
    assert core.on_timer(16.0) == [*abort(text, {S2: 26.0}), PushDone(False, text)]


# --- refusals ----------------------------------------------------------------------------------
def test_a_refusal_while_offering_names_everyone_not_committed() -> None:
    core = started()
    core.handle(accepted(S0), S0, 0.1)
    refused = AssignRefused(ATTEMPT, "cluster_name", "cluster name mismatch", False)
    text = (
        "bring-up failed: stage-2 at 127.0.0.4:19001 refused: cluster name mismatch; "
        "not committed: stage-0, stage-1, stage-2; no stage was started"
    )
    assert core.handle(refused, S2, 0.3) == [
        *abort(text, {S0: 10.3, S1: 5.3}),  # the refusing peer itself is not told
        PushDone(False, text),
    ]
    assert core.peers[S2].step is PeerStep.FAILED
    assert core.peers[S2].why == "refused: cluster name mismatch"
    assert core.outcome == Outcome(False, text, core.plan, 0.3)
    assert core.phase is Phase.FAILED


def test_a_refusal_while_committing_leaves_committed_peers_out_of_the_list() -> None:
    core = committing(at=1.0)
    core.handle(AssignCommitted(ATTEMPT), S0, 1.5)
    refused = AssignRefused(ATTEMPT, "x", "no accepted offer to commit", False)
    text = (
        "bring-up failed: stage-2 at 127.0.0.4:19001 refused: no accepted offer to commit; "
        "not committed: stage-1, stage-2; no stage was started"
    )
    assert core.handle(refused, S2, 2.0) == [
        *abort(text, {S0: 12.0, S1: 12.0}),
        PushDone(False, text),
    ]


def test_a_refusal_while_activating_says_which_stages_run() -> None:
    core = activating(at=2.0)
    core.handle(AssignActivated(ATTEMPT), S0, 2.5)
    refused = AssignRefused(ATTEMPT, "x", "nothing committed to activate", False)
    text = (
        "bring-up failed: stage-1 at 127.0.0.3:19001 refused: nothing committed to activate; "
        "already activated (their stages run): stage-0"
    )
    assert core.handle(refused, S1, 3.0) == [*abort(text, {S2: 13.0}), PushDone(False, text)]
    assert core.phase is Phase.FAILED


def test_an_acceptance_in_another_protocol_version_fails_the_push() -> None:
    core = started()
    text = (
        "bring-up failed: stage-0 at 127.0.0.2:19001 assignment protocol mismatch: "
        "it speaks version 1, this coordinator 2; "
        "not committed: stage-0, stage-1, stage-2; no stage was started"
    )
    assert core.handle(AssignAccepted(1, ATTEMPT, "stage-0"), S0, 0.2) == [
        *abort(text, {S1: 5.2, S2: 5.2}),
        PushDone(False, text),
    ]


# --- messages that do not fit ------------------------------------------------------------------
def test_messages_that_do_not_fit_are_logged_and_change_nothing() -> None:
    core = started()
    # a stranger, even with the right attempt
    assert core.handle(accepted(S0), "127.0.0.9:1", 0.1) == [
        Warn("debug", "assignment: ignoring AssignAccepted from 127.0.0.9:1")
    ]
    # a peer's answer to another attempt
    assert core.handle(AssignAccepted(2, 6, "stage-0"), S0, 0.1) == [
        Warn("debug", "assignment: ignoring AssignAccepted from 127.0.0.2:19001")
    ]
    # a message with no attempt at all
    assert core.handle(CancelRequest("r", "x"), S0, 0.1) == [
        Warn("debug", "assignment: ignoring CancelRequest from 127.0.0.2:19001")
    ]
    # a message of this attempt that is no answer
    assert core.handle(AssignCommit(ATTEMPT), S0, 0.1) == [
        Warn("debug", "assignment: ignoring AssignCommit from 127.0.0.2:19001")
    ]
    # an answer that does not fit where the peer stands
    assert core.handle(AssignCommitted(ATTEMPT), S0, 0.1) == [
        Warn(
            "diagnostic",
            "assignment: 127.0.0.2:19001: assignment push peer: "
            "COMMITTED is not allowed in state UNANSWERED",
        )
    ]
    assert all(p.step is PeerStep.UNANSWERED for p in core.peers.values())
    assert core.phase is Phase.OFFERING and core.outcome is None


def test_answers_after_the_outcome_are_ignored() -> None:
    core = started()
    core.handle(AssignRefused(ATTEMPT, "x", "no", False), S0, 0.1)
    assert core.handle(accepted(S1), S1, 0.2) == [
        Warn("debug", "assignment: ignoring AssignAccepted from 127.0.0.3:19001")
    ]
    assert core.peers[S1].step is PeerStep.UNANSWERED


def test_activate_early_injection_moves_on_after_one_answer() -> None:
    core = started()
    with planted(frozenset({"activate-early"})):  # as the simulator plants it
        assert core.handle(accepted(S0), S0, 1.0) == sends(AssignCommit(ATTEMPT), 11.0)
    assert core.phase is Phase.COMMITTING
    fair = started()  # and only there
    assert fair.handle(accepted(S0), S0, 1.0) == [] and fair.phase is Phase.OFFERING


# --- undeliverable sends -----------------------------------------------------------------------
def test_an_undeliverable_send_is_logged_once_per_reason() -> None:
    core = started()
    send = Send(S0, OFFER[S0], deadline=10.0)
    line = "assignment: stage-0 at 127.0.0.2:19001: connection refused"
    assert core.undeliverable(send, "connection refused", 0.2) == [Warn("info", line)]
    assert core.peers[S0].why == "connection refused"
    assert core.undeliverable(send, "connection refused", 0.7) == [Warn("debug", line)]
    assert core.undeliverable(send, "timed out", 1.2) == [
        Warn("info", "assignment: stage-0 at 127.0.0.2:19001: timed out")
    ]
    assert core.peers[S0].why == "timed out" and core.outcome is None


def test_undeliverable_sends_that_concern_nobody_are_dropped() -> None:
    core = started()
    assert core.undeliverable(Send("127.0.0.9:1", OFFER[S0]), "refused", 0.1) == []
    # an Abort that cannot be delivered changes nothing (the push is over, or it was stray)
    assert core.undeliverable(Send(S0, AssignAbort(ATTEMPT, "x")), "refused", 0.1) == []
    assert core.peers[S0].why == ""
    core.handle(AssignRefused(ATTEMPT, "x", "no", False), S1, 0.2)
    assert core.undeliverable(Send(S0, OFFER[S0]), "refused", 0.3, final=True) == []


def test_a_peer_that_cannot_be_reached_for_good_fails_the_push() -> None:
    core = committing(at=1.0)
    core.handle(AssignCommitted(ATTEMPT), S0, 1.5)
    text = (
        "bring-up failed: stage-1 at 127.0.0.3:19001 cannot be reached: secret mismatch; "
        "not committed: stage-1, stage-2; no stage was started"
    )
    send = Send(S1, AssignCommit(ATTEMPT), deadline=11.0)
    assert core.undeliverable(send, "secret mismatch", 2.0, final=True) == [
        *abort(text, {S0: 12.0, S2: 12.0}),
        PushDone(False, text),
    ]
    assert core.outcome == Outcome(False, text, core.plan, 2.0)


def test_a_final_failure_while_activating_is_only_logged() -> None:
    core = activating(at=2.0)
    send = Send(S0, AssignActivate(ATTEMPT), deadline=12.0)
    line = "assignment: stage-0 at 127.0.0.2:19001: channel mismatch"
    assert core.undeliverable(send, "channel mismatch", 3.0, final=True) == [Warn("info", line)]
    assert core.undeliverable(send, "channel mismatch", 4.0, final=True) == [Warn("debug", line)]
    assert core.outcome is None and core.peers[S0].step is PeerStep.COMMITTED


# --- lost connections --------------------------------------------------------------------------
def test_losing_an_accepted_peer_fails_the_push() -> None:
    core = started()
    core.handle(accepted(S0), S0, 0.1)
    assert core.peer_lost("127.0.0.9:1", 0.2) == []  # a stranger
    assert core.peer_lost(S1, 0.2) == []  # not answered yet: the offer is only repeated
    assert core.outcome is None
    text = (
        "bring-up failed: stage-0 at 127.0.0.2:19001 connection lost before activation; "
        "not committed: stage-0, stage-1, stage-2; no stage was started"
    )
    assert core.peer_lost(S0, 0.3) == [*abort(text, {S1: 5.3, S2: 5.3}), PushDone(False, text)]
    assert core.peers[S0].step is PeerStep.FAILED
    assert core.outcome == Outcome(False, text, core.plan, 0.3)
    assert core.peer_lost(S1, 0.4) == []  # over: nothing more


def test_losing_a_committed_peer_fails_the_push() -> None:
    core = committing(at=1.0)
    core.handle(AssignCommitted(ATTEMPT), S2, 1.5)
    text = (
        "bring-up failed: stage-2 at 127.0.0.4:19001 connection lost before activation; "
        "not committed: stage-0, stage-1, stage-2; no stage was started"
    )
    assert core.peer_lost(S2, 2.0) == [*abort(text, {S0: 12.0, S1: 12.0}), PushDone(False, text)]


def test_losing_a_peer_while_activating_is_settled_by_answers() -> None:
    core = activating(at=2.0)
    assert core.peer_lost(S0, 2.5) == []
    assert core.outcome is None and core.peers[S0].step is PeerStep.COMMITTED


# --- suspected bug -----------------------------------------------------------------------------
def test_a_resolved_delivery_failure_is_not_named_in_a_later_deadline() -> None:
    """A send that failed in an earlier phase was kept as the peer's "last attempt" after it
    answered, so a later deadline's summary named a stale reason."""
    core = started(push_window=15.0)
    core.undeliverable(Send(S1, OFFER[S1]), "connection refused", 0.2)
    for a in ALL:
        core.handle(accepted(a), a, 1.0)  # stage-1 answered after all
    core.handle(AssignCommitted(ATTEMPT), S0, 1.5)
    core.handle(AssignCommitted(ATTEMPT), S2, 1.5)
    (*_, done) = core.on_timer(15.0)
    assert done == PushDone(
        False,
        "bring-up failed: stage-1 at 127.0.0.3:19001 did not commit in time; "
        "not committed: stage-1; no stage was started",
    )


# --- the texts of planning by memory, progress and deadlines --------------------------------------
def test_the_split_by_memory_is_logged_with_each_stages_share() -> None:
    core = started()
    mem = {S0: 1000, S1: 1000, S2: 4000}
    for a in ALL:
        out = core.handle(AssignAccepted(2, ATTEMPT, ID[a], mem[a]), a, 0.2)
    assert out[0] == Warn(
        "info",
        "assignment: split by the peers' memory: "
        "stage-0=127.0.0.2:19001 (layers 0-0, 150 B of 1000 B), "
        "stage-1=127.0.0.3:19001 (layers 1-1, 100 B of 1000 B), "
        "stage-2=127.0.0.4:19001 (layers 2-7, 650 B of 3.9 KiB)",
    )


def test_a_model_that_does_not_fit_ends_its_summary_saying_nothing_started() -> None:
    core = started()
    for a in ALL:
        core.handle(AssignAccepted(2, ATTEMPT, ID[a], 300), a, 0.2)
    assert core.outcome is not None and core.outcome.summary.endswith("; no stage was started")


def test_a_dry_run_with_a_peer_that_does_not_say_its_memory_plans_the_first_split() -> None:
    core = PushCore(config(dry_run=True), 4.0)
    core.start(4.0)
    core.handle(AssignAccepted(2, ATTEMPT, ID[S0], 100), S0, 4.1)
    core.handle(AssignAccepted(2, ATTEMPT, ID[S1]), S1, 4.2)  # an older mlxcel: no figure
    out = core.handle(AssignAccepted(2, ATTEMPT, ID[S2], 100), S2, 4.3)
    text = "dry run: planned " + STAGES_TEXT
    assert out == [*sends(AssignAbort(ATTEMPT, text), 14.3), PushDone(True, text)]
    assert core.outcome == Outcome(True, text, core.plan, 4.3)


def test_progress_counts_from_the_start_of_each_phase() -> None:
    core = PushCore(config(peers=(), beacon_key=KEY, discovery_window=30.0), 2.0)
    core.start(2.0)
    core.found = [S0, S1]
    assert core.progress(12.4) == (
        f"discovery: 2 of 3 peers ({S0}, {S1}) after 10 s of 30 s; listening for beacons"
    )
    core = PushCore(config(), 3.0)
    core.start(3.0)
    assert core.progress(8.0).endswith("to accept (5 s of 60 s)")
    core = activating(at=2.0)
    assert core.progress(5.0) == (
        f"assignment: waiting for {ID[S0]} at {S0}, {ID[S1]} at {S1}, {ID[S2]} at {S2} to "
        "activate (5 s of 60 s)"
    )


def test_the_discovery_deadline_names_every_dropped_address() -> None:
    core = PushCore(config(peers=(), beacon_key=KEY, n_peers=2), 0.0)
    core.start(0.0)
    for host, nonce in (("127.0.0.3", b"a"), ("127.0.0.4", b"b")):
        core.beacon(beacon(f"{host}:7", nonce), host, 1.0, 1000.0)
        core.verified(f"{host}:7", "connection refused", 1.1)
    text = (
        "bring-up failed: discovered 0 of 2 peers within 30 s; dropped 127.0.0.3:7: connection "
        "refused; dropped 127.0.0.4:7: connection refused; are they beaconing to this host's "
        "discovery port with the same secret? No stage was started"
    )
    assert core.on_timer(30.0) == [PushDone(False, text)]


def test_offers_carry_the_weight_digest() -> None:
    weighed = dataclasses.replace(MODEL, weights="cd" * 32)
    core = PushCore(config(model=weighed), 0.0)
    offers = core.start(0.0)
    assert [s.msg.weights for s in offers] == ["cd" * 32] * 3  # type: ignore[union-attr]
