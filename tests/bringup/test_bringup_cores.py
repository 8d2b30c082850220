"""The bring-up cores as tables: no sockets, no loop, no model.

A peer checks an offer in the documented order; a coordinator commits only after every peer
accepted and activates only after every peer committed; a failure before activation aborts
every peer back to waiting and starts nothing; beacons are judged MAC first.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest

from mlxcel import __version__
from mlxcel.base.effects import Send
from mlxcel.base.errors import BeaconRejected, IllegalTransition
from mlxcel.base.messages import (
    AssignAbort,
    AssignAccepted,
    AssignActivate,
    AssignActivated,
    AssignCommit,
    AssignOffer,
    AssignRefused,
    Message,
)
from mlxcel.bringup.beacon import BeaconGate, beacon_key, make_beacon
from mlxcel.bringup.identity import model_identity
from mlxcel.bringup.peer_core import PeerCore, PeerFacts
from mlxcel.bringup.plan import derived_range, make_plan
from mlxcel.bringup.protocol import (
    FINAL,
    PEER_TABLE,
    Activated,
    Announce,
    ModelIdentity,
    PeerEnded,
    PeerEvent,
    PeerState,
    Phase,
    PushDone,
    Refusal,
    Rejection,
)
from mlxcel.bringup.push_core import PushConfig, PushCore
from mlxcel.pipeline.cluster_config import parse_cluster_toml
from mlxcel.pipeline.partition import LayerCosts

COSTS = LayerCosts((100,) * 8, 50, 50, 0)
MODEL = ModelIdentity("ab" * 32, 8)
COORD = "127.0.0.1:19000"
PEERS = ("127.0.0.3:19001", "127.0.0.2:19001", "127.0.0.4:19001")


def facts(address: str, **kw: object) -> PeerFacts:
    host, port = address.rsplit(":", 1)
    base = PeerFacts(
        __version__,
        "mlxcel-cluster",
        MODEL,
        lambda n, k, memory: derived_range(COSTS, n, k, memory),
        parse_cluster_toml,
        host,
        int(port),
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def push(beacon_key: bytes | None = None, **kw: object) -> PushCore:
    cfg = PushConfig(
        attempt=7,
        n_peers=len(PEERS),
        coordinator=COORD,
        version=__version__,
        cluster_name="mlxcel-cluster",
        model=MODEL,
        costs=COSTS,
        peers=PEERS,
    )
    cfg = dataclasses.replace(cfg, **kw)  # type: ignore[arg-type]
    if beacon_key is not None:
        cfg = dataclasses.replace(cfg, gate=BeaconGate(beacon_key, cfg.version, cfg.cluster_name))
    return PushCore(cfg, 0.0)


def offers(core: PushCore) -> dict[str, AssignOffer]:
    out = {}
    for e in core.start(0.0):
        if isinstance(e, Send) and isinstance(e.msg, AssignOffer):
            out[e.dest] = e.msg
    return out


class Cluster:
    """A push core and its peer cores, wired back to back through one FIFO of messages."""

    def __init__(self, drop: set[tuple[str, type[Message]]] | None = None) -> None:
        self.push = push()
        self.peers = {a: PeerCore(facts(a), 0.0) for a in PEERS}
        self.queue: deque[tuple[str, str, Message]] = deque()
        self.effects: list[tuple[str, object]] = []
        self.drop = drop or set()  # (destination, message class) lost on the way
        self.now = 0.0
        self.route(COORD, self.push.start(0.0))

    def route(self, who: str, effects: list) -> None:  # type: ignore[type-arg]
        for e in effects:
            self.effects.append((who, e))
            if isinstance(e, Send) and (e.dest, type(e.msg)) not in self.drop:
                self.queue.append((who, e.dest, e.msg))

    def run(self) -> None:
        while self.queue:
            src, dst, msg = self.queue.popleft()
            core = self.push if dst == COORD else self.peers[dst]
            self.route(dst, core.handle(msg, src, self.now))

    def advance(self, to: float) -> None:
        self.now = to
        for who, core in [(COORD, self.push), *self.peers.items()]:
            t = core.next_timer()
            if t is not None and t <= to:
                self.route(who, core.on_timer(to))
        self.run()

    def of(self, kind: type) -> list[tuple[str, object]]:
        return [(w, e) for w, e in self.effects if isinstance(e, kind)]


def test_a_bring_up_activates_every_peer_in_address_order() -> None:
    c = Cluster()
    c.run()
    done = c.of(PushDone)
    assert done and done[0][1].ok  # type: ignore[attr-defined]
    assert c.push.phase is Phase.DONE
    assert all(p.state is PeerState.ACTIVE for p in c.peers.values())
    # stage ids follow the lexicographic order of the addresses, not the order given
    activated = {w: e.node_id for w, e in c.of(Activated)}  # type: ignore[attr-defined]
    assert activated == {
        "127.0.0.2:19001": "stage-0",
        "127.0.0.3:19001": "stage-1",
        "127.0.0.4:19001": "stage-2",
    }


def test_commit_only_after_every_peer_accepted() -> None:
    late = "127.0.0.4:19001"
    c = Cluster(drop={(late, AssignOffer)})  # one peer is not listening yet
    c.run()
    assert not any(isinstance(e.msg, AssignCommit) for _, e in c.of(Send))  # type: ignore[attr-defined]
    c.drop.clear()
    c.advance(0.6)  # the offer is repeated every 0.5 s
    assert c.push.phase is Phase.DONE


def test_one_peer_failing_commit_aborts_the_others_and_starts_nothing() -> None:
    c = Cluster()
    bad = "127.0.0.3:19001"  # stage-1
    c.drop.add((bad, AssignCommit))
    c.run()
    assert c.push.phase is Phase.COMMITTING
    committed = [a for a, p in c.peers.items() if p.state is PeerState.COMMITTED]
    assert sorted(committed) == ["127.0.0.2:19001", "127.0.0.4:19001"]
    c.advance(61.0)  # the push window (60 s) ends
    done = c.of(PushDone)[0][1]
    assert not done.ok  # type: ignore[attr-defined]
    assert "stage-1 at 127.0.0.3:19001 did not commit" in done.summary  # type: ignore[attr-defined]
    assert "not committed: stage-1" in done.summary and "no stage was started" in done.summary  # type: ignore[attr-defined]
    aborts = {e.dest for _, e in c.of(Send) if isinstance(e.msg, AssignAbort)}  # type: ignore[attr-defined]
    assert aborts == set(PEERS)
    assert all(p.state is PeerState.WAITING for p in c.peers.values())
    assert not c.of(Activated)


def test_a_refusal_aborts_every_peer_that_accepted() -> None:
    c = Cluster()
    odd = "127.0.0.4:19001"
    c.peers[odd] = PeerCore(facts(odd, cluster_name="another"), 0.0)
    c.run()
    done = c.of(PushDone)[0][1]
    assert (
        not done.ok and "stage-2 at 127.0.0.4:19001 refused: cluster name mismatch" in done.summary
    )  # type: ignore[attr-defined]
    assert all(p.state is PeerState.WAITING for p in c.peers.values())
    assert not c.of(Activated)


def test_the_peer_checks_an_offer_in_the_documented_order() -> None:
    """First who offers: an offer from another identity than the coordinator it names is
    refused for that, whatever else is wrong with it. Then, from the coordinator itself, apply
    the mismatches from check k onwards: the refusal must name check k."""
    me = "127.0.0.2:19001"
    good = offers(push())[me]
    peer = PeerCore(facts(me), 0.0)
    everything_wrong = dataclasses.replace(good, protocol=1, mlxcel_version="0.0.0")
    (send,) = [
        e for e in peer.handle(everything_wrong, "127.0.0.9:19000", 0.0) if isinstance(e, Send)
    ]
    assert isinstance(send.msg, AssignRefused) and send.msg.code == Refusal.COORDINATOR
    assert not send.msg.final and peer.state is PeerState.WAITING
    wrong_port = good.cluster_toml.replace(f'"{me}"', '"127.0.0.2:19999"')
    other = "127.0.0.8:19000"
    steps = [
        (Refusal.PROTOCOL, {"protocol": 1}),
        (Refusal.VERSION, {"mlxcel_version": "0.0.0"}),
        (Refusal.CLUSTER_NAME, {"cluster_name": "another"}),
        (Refusal.MODEL, {"model_sha256": "00" * 32}),
        (Refusal.LAYER_RANGE, {"layers": (0, 1)}),
        (Refusal.NODE_ID, {"node_id": "stage-9"}),
        (Refusal.ADDRESS, {"cluster_toml": wrong_port.replace(COORD, other)}),
        # the cluster it carries names another coordinator than the one offering
        (Refusal.COORDINATOR, {"cluster_toml": good.cluster_toml.replace(COORD, other)}),
    ]
    for k, (code, _) in enumerate(steps):
        changes: dict[str, object] = {}
        for _, ch in reversed(steps[k:]):  # an earlier step's cluster text wins
            changes.update(ch)
        offer = dataclasses.replace(good, **changes)  # type: ignore[arg-type]
        peer = PeerCore(facts(me), 0.0)
        effects = peer.handle(offer, COORD, 0.0)
        refused = [e.msg for e in effects if isinstance(e, Send)]
        assert len(refused) == 1 and isinstance(refused[0], AssignRefused)
        assert refused[0].code == code, (k, refused[0].reason)
        ended = [e for e in effects if isinstance(e, PeerEnded)]
        if code in FINAL:
            assert refused[0].final and peer.state is PeerState.ENDED
            assert ended and ended[0].reason.startswith("stage assignment refused: ")
            assert ended[0].reason.endswith(f"(the offer came from {COORD})")
        else:
            assert not refused[0].final and peer.state is PeerState.WAITING and not ended
    # and the untouched offer, from the identity it names, is accepted
    peer = PeerCore(facts(me), 0.0)
    effects = peer.handle(good, COORD, 0.0)
    assert any(isinstance(e, Send) and isinstance(e.msg, AssignAccepted) for e in effects)


def test_a_version_1_coordinator_is_refused_and_the_peer_ends() -> None:
    me = "127.0.0.2:19001"
    peer = PeerCore(facts(me), 0.0)
    offer = dataclasses.replace(offers(push())[me], protocol=1)
    effects = peer.handle(offer, COORD, 0.0)
    (ended,) = [e for e in effects if isinstance(e, PeerEnded)]
    assert "stage assignment refused: assignment protocol mismatch" in ended.reason


def test_a_version_1_peer_is_refused_by_the_coordinator() -> None:
    core = push()
    offers(core)
    effects = core.handle(AssignAccepted(1, 7, "stage-0"), "127.0.0.2:19001", 0.1)
    (done,) = [e for e in effects if isinstance(e, PushDone)]
    assert not done.ok and "assignment protocol mismatch" in done.summary


def test_a_peer_with_another_secret_fails_the_push_at_once() -> None:
    core = push()
    sends = [e for e in core.start(0.0) if isinstance(e, Send)]
    effects = core.undeliverable(sends[0], "secret mismatch", 0.2, final=True)
    (done,) = [e for e in effects if isinstance(e, PushDone)]
    assert not done.ok and sends[0].dest in done.summary and "secret mismatch" in done.summary
    # a refused connect (the peer is not up yet) is only retried
    core = push()
    sends = [e for e in core.start(0.0) if isinstance(e, Send)]
    assert not any(isinstance(e, PushDone) for e in core.undeliverable(sends[0], "refused", 0.2))


def test_a_peer_waits_600_s_for_an_assignment_then_ends() -> None:
    peer = PeerCore(facts("127.0.0.2:19001"), 10.0)
    assert peer.next_timer() == 610.0
    (ended,) = peer.on_timer(610.0)
    assert isinstance(ended, PeerEnded) and "600 s" in ended.reason
    assert peer.state is PeerState.ENDED


def test_a_peer_between_phases_waits_60_s_then_returns_to_waiting() -> None:
    me = "127.0.0.2:19001"
    peer = PeerCore(facts(me), 0.0)
    peer.handle(offers(push())[me], COORD, 1.0)
    assert peer.state is PeerState.ACCEPTED and peer.next_timer() == 61.0
    peer.on_timer(61.0)
    assert peer.state is PeerState.WAITING
    # and a Commit after that is refused: nothing to commit
    effects = peer.handle(AssignCommit(7), COORD, 62.0)
    assert effects[0].msg.code == Refusal.NOT_ACCEPTED  # type: ignore[union-attr]


def test_losing_the_coordinator_before_activation_returns_to_waiting() -> None:
    me = "127.0.0.2:19001"
    peer = PeerCore(facts(me), 0.0)
    peer.handle(offers(push())[me], COORD, 1.0)
    peer.handle(AssignCommit(7), COORD, 2.0)
    assert peer.state is PeerState.COMMITTED
    peer.peer_lost(COORD, 3.0)
    assert peer.state is PeerState.WAITING
    effects = peer.handle(AssignActivate(7), COORD, 4.0)
    assert not any(isinstance(e, Activated) for e in effects)


def test_a_stranger_cannot_commit_or_activate_a_peer() -> None:
    me = "127.0.0.2:19001"
    peer = PeerCore(facts(me), 0.0)
    peer.handle(offers(push())[me], COORD, 1.0)
    for msg in (AssignCommit(7), AssignActivate(7), AssignAbort(7, "x")):
        effects = peer.handle(msg, "127.0.0.66:19000", 2.0)
        assert not any(isinstance(e, Activated) for e in effects)
    assert peer.state is PeerState.ACCEPTED
    # another coordinator's offer meanwhile is refused as busy, not taken over
    other = dataclasses.replace(offers(push())[me], coordinator="127.0.0.66:19000", attempt=9)
    effects = peer.handle(other, "127.0.0.66:19000", 2.0)
    assert effects[0].msg.code == Refusal.BUSY and peer.coordinator == COORD  # type: ignore[union-attr]


def test_the_peer_table_refuses_illegal_moves_from_the_lookup() -> None:
    with pytest.raises(IllegalTransition) as exc:
        PEER_TABLE.next(PeerState.WAITING, PeerEvent.ACTIVATE)
    assert exc.value.code == Refusal.NOT_COMMITTED


def test_the_loopback_rule() -> None:
    core = push(peers=("127.0.0.2:19001", "10.1.2.3:19001", "127.0.0.4:19001"))
    effects = core.start(0.0)
    assert not any(isinstance(e, Send) for e in effects)  # nothing goes out
    (done,) = [e for e in effects if isinstance(e, PushDone)]
    assert not done.ok and "10.1.2.3:19001" in done.summary and "loopback" in done.summary
    # a coordinator on a routable address may drive the same peers
    core = push(coordinator="10.1.2.1:19000", peers=("10.1.2.2:1", "10.1.2.3:1", "10.1.2.4:1"))
    assert any(isinstance(e, Send) for e in core.start(0.0))


def test_a_peer_beacons_until_committed() -> None:
    me = "127.0.0.2:19001"
    peer = PeerCore(facts(me, beacons=True), 0.0)
    assert any(isinstance(e, Announce) for e in peer.on_timer(0.0))
    assert peer.next_timer() == 1.0
    peer.handle(offers(push())[me], COORD, 0.5)
    assert any(isinstance(e, Announce) for e in peer.on_timer(1.0))  # accepted: still beacons
    peer.handle(AssignCommit(7), COORD, 1.5)
    assert not any(isinstance(e, Announce) for e in peer.on_timer(2.0))


# --- beacons ------------------------------------------------------------------------------------
KEY = beacon_key(b"k" * 32)


def gate() -> BeaconGate:
    return BeaconGate(KEY, __version__)


def test_a_good_beacon_resolves_to_its_source() -> None:
    d = make_beacon(KEY, __version__, "mlxcel-cluster", "127.0.0.2:19001", 1000.0, b"1" * 16)
    assert gate().check(d, "127.0.0.2", 1010.0) == "127.0.0.2:19001"


@pytest.mark.parametrize(
    ("why", "key", "version", "address", "wall"),
    [
        (Rejection.BAD_MAC, beacon_key(b"o" * 32), __version__, "127.0.0.2:1", 1000.0),
        (Rejection.SKEW, KEY, __version__, "127.0.0.2:1", 1061.0),
        (Rejection.SKEW, KEY, __version__, "127.0.0.2:1", 939.0),
        (Rejection.VERSION, KEY, "0.0.1", "127.0.0.2:1", 1000.0),
        (Rejection.ADDRESS, KEY, __version__, "127.0.0.7:1", 1000.0),
        (Rejection.ADDRESS, KEY, __version__, "not-an-address", 1000.0),
        # a beacon names the IP it leaves from: 0.0.0.0 would let anyone replay it as theirs
        (Rejection.ADDRESS, KEY, __version__, "0.0.0.0:1", 1000.0),
    ],
)
def test_each_beacon_rejection(
    why: Rejection, key: bytes, version: str, address: str, wall: float
) -> None:
    d = make_beacon(key, version, "mlxcel-cluster", address, 1000.0, b"n" * 16)
    with pytest.raises(BeaconRejected) as exc:
        gate().check(d, "127.0.0.2", wall)
    assert exc.value.why is why


def test_a_replayed_beacon_is_rejected_inside_the_window() -> None:
    g = gate()
    d = make_beacon(KEY, __version__, "mlxcel-cluster", "127.0.0.2:1", 1000.0, b"r" * 16)
    g.check(d, "127.0.0.2", 1000.0)
    with pytest.raises(BeaconRejected) as exc:
        g.check(d, "127.0.0.2", 1030.0)
    assert exc.value.why is Rejection.REPLAY


def test_the_mac_is_checked_first() -> None:
    # every field wrong and the MAC too: the refusal says MAC, and nothing else leaks
    d = make_beacon(beacon_key(b"o" * 32), "0.0.1", "mlxcel-cluster", "127.0.0.7:1", 0.0, b"x" * 16)
    with pytest.raises(BeaconRejected) as exc:
        gate().check(d, "127.0.0.2", 5000.0)
    assert exc.value.why is Rejection.BAD_MAC
    # garbage is malformed, never an exception of another type
    for junk in (b"", b"\xa1", b"x" * 4096):
        with pytest.raises(BeaconRejected):
            gate().check(junk, "127.0.0.2", 0.0)


def test_discovery_uses_only_beacons_that_pass(tmp_path) -> None:  # type: ignore[no-untyped-def]
    core = push(peers=(), beacon_key=KEY, n_peers=2)
    core.start(0.0)
    bad = make_beacon(
        beacon_key(b"o" * 32), __version__, "mlxcel-cluster", "127.0.0.5:1", 0.0, b"a" * 16
    )
    core.beacon(bad, "127.0.0.5", 0.1, 0.0)
    core.beacon(
        make_beacon(KEY, __version__, "mlxcel-cluster", "127.0.0.3:7", 0.0, b"b" * 16),
        "127.0.0.3",
        0.2,
        0.0,
    )
    core.verified("127.0.0.3:7", None, 0.2)
    assert core.phase is Phase.DISCOVERING and core.found == ["127.0.0.3:7"]
    core.beacon(
        make_beacon(KEY, __version__, "mlxcel-cluster", "127.0.0.2:7", 0.0, b"c" * 16),
        "127.0.0.2",
        0.3,
        0.0,
    )
    effects = core.verified("127.0.0.2:7", None, 0.3)
    assert core.phase is Phase.OFFERING
    assert {e.dest for e in effects if isinstance(e, Send)} == {"127.0.0.2:7", "127.0.0.3:7"}
    # too few peers in the window: fails, saying how many were found
    core = push(peers=(), beacon_key=KEY, n_peers=2)
    core.start(0.0)
    (done,) = [e for e in core.on_timer(30.0) if isinstance(e, PushDone)]
    assert not done.ok and "discovered 0 of 2 peers within 30 s" in done.summary


# --- plan ---------------------------------------------------------------------------------------
def test_the_plan_text_is_reproducible_and_valid_cluster_toml() -> None:
    import tomllib

    from mlxcel.pipeline.cluster_config import ClusterConfig

    a = make_plan("c", COORD, list(PEERS), COSTS, "/etc/s").coordinator_file("serve --pp-auto 3")
    b = make_plan("c", COORD, list(reversed(PEERS)), COSTS, "/etc/s").coordinator_file(
        "serve --pp-auto 3"
    )
    assert a == b
    cfg = ClusterConfig.model_validate(tomllib.loads(a))
    assert [s.id for s in cfg.stages] == ["stage-0", "stage-1", "stage-2"]
    # Balanced by time: the embedding lookup costs nothing, the head does (300/300/250).
    assert cfg.pp_layers == "0-2,3-5,6-7" and cfg.cluster.secret_file == "/etc/s"


def test_model_identity_covers_config_and_weight_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_identity(tmp_path)
    assert first.n_layers == 4
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_identity(tmp_path) != first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "a": 1}))
    assert model_identity(tmp_path) != first


def test_an_activated_peer_closing_before_its_answer_is_read_is_not_a_failure() -> None:
    """A peer closes the assignment channel right after answering Activated; the coordinator
    may see the close first. Neither that nor a failed repeat of Activate (the port now serves
    the stage transport) may fail a bring-up whose every peer activated."""
    # run until the coordinator sends Activate, holding back the peers' Activated answers
    c = Cluster(drop={(COORD, AssignActivated)})
    core = c.push
    c.run()
    assert core.phase is Phase.ACTIVATING
    first = "127.0.0.2:19001"
    assert core.peer_lost(first, 0.5) == []
    resend = Send(first, AssignActivate(7))
    assert not any(
        isinstance(e, PushDone) for e in core.undeliverable(resend, "channel", 0.6, final=True)
    )
    c.drop = set()
    for a in PEERS:  # the answers are read after all
        c.route(a, [Send(COORD, AssignActivated(7))])
    c.run()
    assert core.outcome is not None and core.outcome.ok


def test_only_a_secret_or_identity_mismatch_ends_the_push_at_once() -> None:
    from mlxcel.base.errors import ConnectFailed, SendFailed
    from mlxcel.bringup.service import is_final
    from mlxcel.wire.handshake import Failure

    def failed(failure: Failure | None) -> SendFailed:
        exc = SendFailed("send failed")
        exc.__cause__ = ConnectFailed("x", failure)
        return exc

    assert is_final(failed(Failure.SECRET_MISMATCH)) and is_final(
        failed(Failure.IDENTITY_NOT_OWNED)
    )
    for retried in (
        None,
        Failure.TIMEOUT,
        Failure.CLOSED,
        Failure.BUSY,
        Failure.CLOCK_SKEW,
        Failure.REPLAYED,
        Failure.AT_CAPACITY,
        Failure.CHANNEL_MISMATCH,
    ):
        assert not is_final(failed(retried)), retried
    assert not is_final(SendFailed("no cause")) and not is_final(None)


def test_a_stranger_cannot_pile_up_outboxes_or_keep_a_peer_waiting() -> None:
    me = "127.0.0.2:19001"
    peer = PeerCore(facts(me), 0.0)
    bad = dataclasses.replace(offers(push())[me], cluster_name="another")
    for i in range(100):
        (send, *_rest) = peer.handle(bad, f"127.0.0.{i % 200 + 3}:{i + 1}", 100.0 + i)
        assert isinstance(send, Send) and not send.peer  # a one-off connection, no outbox
    assert len(peer.refusals) == 64
    assert peer.next_timer() == 600.0  # refused offers did not extend the 600 s wait
    # a stage index that is not a stage is refused, never an exception
    odd = dataclasses.replace(offers(push())[me], stage=7)
    (send, *_rest) = peer.handle(odd, COORD, 1.0)
    assert send.msg.code == Refusal.LAYER_RANGE  # type: ignore[union-attr]


def test_a_beacon_replayed_from_another_address_is_refused_even_if_never_seen() -> None:
    """Captured before this coordinator started (so its replay cache is empty) and resent
    from the attacker's own IP: refused, so discovery cannot be pointed at the attacker."""
    captured = make_beacon(KEY, __version__, "mlxcel-cluster", "127.0.0.2:19001", 1000.0, b"c" * 16)
    with pytest.raises(BeaconRejected) as exc:
        gate().check(captured, "127.0.0.66", 1001.0)
    assert exc.value.why is Rejection.ADDRESS


def test_discovery_sets_aside_another_clusters_beacons() -> None:
    core = push(peers=(), beacon_key=KEY, n_peers=1)
    core.start(0.0)
    theirs = make_beacon(KEY, __version__, "lab-b", "127.0.0.5:1", 0.0, b"t" * 16)
    (warn,) = core.beacon(theirs, "127.0.0.5", 0.1, 0.0)
    assert warn.kind == "debug" and "lab-b" in warn.text  # type: ignore[union-attr]
    assert core.phase is Phase.DISCOVERING and core.found == []
    ours = make_beacon(KEY, __version__, "mlxcel-cluster", "127.0.0.6:1", 0.0, b"o" * 16)
    core.beacon(ours, "127.0.0.6", 0.2, 0.0)
    core.verified("127.0.0.6:1", None, 0.2)
    assert core.found == ["127.0.0.6:1"] and core.phase is Phase.OFFERING


def test_one_peer_offered_two_stages_in_one_bring_up_refuses_the_second() -> None:
    """A peer on 0.0.0.0 listed as 127.0.0.2 and as 127.0.0.3: the second offer is refused
    at once, and the coordinator fails without waiting out its window."""
    core = push(peers=("127.0.0.2:19001", "127.0.0.3:19001", "127.0.0.4:19001"))
    sent = offers(core)
    peer = PeerCore(facts("0.0.0.0:19001"), 0.0)
    peer.handle(sent["127.0.0.2:19001"], COORD, 0.1)
    assert peer.state is PeerState.ACCEPTED
    (send,) = peer.handle(sent["127.0.0.3:19001"], COORD, 0.2)
    assert send.msg.code == Refusal.ADDRESS and "two addresses" in send.msg.reason  # type: ignore[union-attr]
    assert peer.offer == sent["127.0.0.2:19001"]
    effects = core.handle(send.msg, "127.0.0.3:19001", 0.3)
    (done,) = [e for e in effects if isinstance(e, PushDone)]
    assert not done.ok and "two addresses" in done.summary


def test_the_flood_note_counts_what_discovery_refused_by_reason_and_source() -> None:
    from mlxcel.bringup.service import flood_note
    from mlxcel.net.udp import BeaconReceiver

    rx = BeaconReceiver("127.0.0.1", 0)
    g = gate()
    assert flood_note(rx, g) is None  # nothing refused: nothing to say
    # Another cluster's beacons are no anomaly: still nothing.
    with pytest.raises(BeaconRejected):
        g.check(
            make_beacon(KEY, __version__, "lab-b", "127.0.0.5:1", 1000.0, b"x" * 16),
            "127.0.0.5",
            1000.0,
        )
    assert flood_note(rx, g) is None
    forged = make_beacon(
        beacon_key(b"o" * 32), __version__, "mlxcel-cluster", "127.0.0.7:1", 1000.0, b"f" * 16
    )
    for _ in range(2):
        with pytest.raises(BeaconRejected):
            g.check(forged, "127.0.0.7", 1000.0)
    st = rx.stats
    st.throttled, st.not_beacon = 1_500_000, 3
    st.by_source.update({"10.0.0.4": 1_000_000, "10.0.0.5": 500_000, "10.0.0.6": 3})
    assert flood_note(rx, g) == (
        "4 source(s) sent 1,500,005 datagrams that are not valid beacons of this cluster "
        "(1,500,000 over a source's budget (10/s); 3 not shaped like a beacon; rejected: "
        "invalid MAC (another cluster secret?) 2); busiest: 10.0.0.4 (1,000,000), "
        "10.0.0.5 (500,000), 10.0.0.6 (3)"
    )
