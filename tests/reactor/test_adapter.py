"""CoreAdapter: a core's sends honour the deadline of the exchange they open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.errors import PipelineError, SendFailed
from mlxcel.base.messages import Ack, Bundle, Message, PrepareSequence, RunEntry, SamplingParams
from mlxcel.pipeline.coordinator import PipelineCoordinator
from mlxcel.reactor.bus import LOCAL, Node, Origin


class FakeEndpoint:
    """What a coordinator needs of an endpoint, besides ``send``."""

    identity = "coordinator"
    wire_bytes = 0

    def reset(self, dest: str) -> None:
        pass

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        pass


class DeadStage(FakeEndpoint):
    """An endpoint whose every send hangs until its deadline, like dialing a dead host."""

    def __init__(self) -> None:
        self.attempts: list[tuple[float, Message]] = []

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        self.attempts.append((loop.time(), msg))
        await asyncio.sleep(max(0.0, deadline - loop.time()))
        raise SendFailed(f"send to {dest} failed: connect deadline passed")


async def test_health_probes_to_a_dead_stage_do_not_hold_up_a_request() -> None:
    """Each /health probe (1 s) once queued a send with the 30 s budget in the dead stage's
    outbox, so a request behind ten probes waited minutes instead of failing at once."""
    async with Node("coordinator") as node:
        ep = DeadStage()
        coord = PipelineCoordinator(
            node, ep, ["s0"], eos=set(), vocab=16, max_len=64, step_timeout=30.0
        )
        coord.attach()
        loop = asyncio.get_running_loop()
        probes = [asyncio.ensure_future(coord.query("s0", timeout=1.0)) for _ in range(10)]
        await asyncio.sleep(0.05)
        t0 = loop.time()
        entry = RunEntry("r", 0, (1,), 0, SamplingParams(max_tokens=2), 1)
        await node.bus.publish(entry, source=LOCAL, deadline=t0 + 1)
        results = await asyncio.gather(*probes, return_exceptions=True)
        assert all(isinstance(r, PipelineError) for r in results)
        while not any(
            isinstance(m, PrepareSequence)
            for _, sent in ep.attempts
            for m in (sent.items if isinstance(sent, Bundle) else (sent,))
        ):
            assert loop.time() - t0 < 10, "the request waited behind expired probes"
            await asyncio.sleep(0.05)
        assert coord.expired_sends > 0  # expired probes were dropped unsent


class Recorder(FakeEndpoint):
    """An endpoint that records what it is asked to send and fails sends to ``dead``."""

    def __init__(self, dead: str = "") -> None:
        self.sent: list[tuple[str, Message]] = []
        self.dead = dead

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        self.sent.append((dest, msg))
        if dest == self.dead:
            raise SendFailed(f"send to {dest} failed: connection refused")


async def test_what_queues_for_one_peer_leaves_as_one_bundle_and_fails_item_by_item() -> None:
    """Eight requests admitted in one go: each stage gets one Bundle of eight PrepareSequences,
    not eight frames. When that Bundle cannot be delivered, every one of its requests fails
    (none waits out its deadline)."""
    async with Node("coordinator") as node:
        ep = Recorder(dead="s1")
        coord = PipelineCoordinator(
            node, ep, ["s0", "s1"], eos=set(), vocab=16, max_len=64, max_sequences=8
        )
        coord.attach()
        for i in range(8):
            coord.feed(
                coord.core.handle(
                    RunEntry(f"r{i}", 0, (1,), 0, SamplingParams(max_tokens=2), i), LOCAL, 0.0
                )
            )
        await asyncio.sleep(0.05)
        by_dest = {dest: msg for dest, msg in ep.sent}
        assert sorted(by_dest) == ["s0", "s1"] and len(ep.sent) == 2
        for msg in by_dest.values():
            assert isinstance(msg, Bundle)
            assert [m.request_id for m in msg.items] == [f"r{i}" for i in range(8)]
        assert coord.coord.failed == 8 and coord.active == 0


class TimerCore:
    """A core whose timer is ``due`` (a message may move it); counts its firings."""

    def __init__(self, due: float | None, fail: int = 0) -> None:
        self.due = due
        self.fired: list[float] = []
        self.fail = fail  # the first ``fail`` firings raise, as a core bug would

    def handle(self, msg: Message, source: str, now: float) -> list:
        assert isinstance(msg, RunEntry)
        self.due = now + msg.start_pos / 1000  # a message names a new timer, in ms
        return []

    def on_timer(self, now: float) -> list:
        self.fired.append(now)
        if len(self.fired) <= self.fail:
            raise RuntimeError("core bug")
        self.due = None
        return []

    def next_timer(self) -> float | None:
        return self.due

    def undeliverable(self, send: object, reason: str, now: float) -> list:
        return []

    def peer_lost(self, identity: str, now: float) -> list:
        return []


async def _timer_node(core: TimerCore) -> tuple[Node, object]:
    from mlxcel.reactor.adapter import CoreAdapter

    node = Node("timer")
    await node.__aenter__()
    adapter = CoreAdapter(node, Recorder(), core, "timer", 1.0)  # type: ignore[arg-type]
    adapter.subscribe([RunEntry], origin=Origin.ANY, maxsize=8)
    adapter.start()
    return node, adapter


async def test_the_core_timer_fires_when_due_and_moves_earlier_on_a_message() -> None:
    """The adapter arms the core's timer on the loop and re-arms it only when the time the
    core names changes: a message that makes it earlier must bring the firing forward."""
    loop = asyncio.get_running_loop()
    core = TimerCore(loop.time() + 5.0)
    node, _adapter = await _timer_node(core)
    try:
        t0 = loop.time()
        entry = RunEntry("r", 0, (1,), 50, SamplingParams(), 1)  # timer in 50 ms
        await node.bus.publish(entry, deadline=t0 + 1)
        while not core.fired:
            assert loop.time() - t0 < 2, "the earlier timer never fired"
            await asyncio.sleep(0.01)
        assert core.fired[0] - t0 >= 0.049 and len(core.fired) == 1
        await asyncio.sleep(0.1)
        assert len(core.fired) == 1  # nothing due any more: no firing
    finally:
        await node.__aexit__(None, None, None)


async def test_a_failing_core_timer_is_retried_without_spinning_and_stops_with_the_node() -> None:
    loop = asyncio.get_running_loop()
    core = TimerCore(loop.time(), fail=3)
    node, _adapter = await _timer_node(core)
    t0 = loop.time()
    try:
        while len(core.fired) < 4:
            assert loop.time() - t0 < 3
            await asyncio.sleep(0.02)
        gaps = [b - a for a, b in zip(core.fired, core.fired[1:], strict=False)]
        assert all(g >= 0.09 for g in gaps), gaps  # 0.1 s apart, not a busy loop
    finally:
        await node.__aexit__(None, None, None)
    core.due, n = loop.time(), len(core.fired)
    await asyncio.sleep(0.15)
    assert len(core.fired) == n  # a closed node's core is never called again


class Gate(Recorder):
    """An endpoint that can write at once while ``open`` (``send_now``), like an idle socket."""

    def __init__(self) -> None:
        super().__init__()
        self.open = True
        self.now: list[tuple[str, Message]] = []
        self.refused = 0

    def send_now(self, dest: str, msg: Message) -> bool:
        if not self.open:
            self.refused += 1
            return False
        self.now.append((dest, msg))
        return True


async def test_sends_go_out_at_once_when_idle_and_never_pass_what_is_queued() -> None:
    """An idle outbox writes through ``send_now`` (no task wakes); once something is queued
    for a peer, later sends to it queue behind it even when the socket could take them."""
    from mlxcel.base.effects import Send
    from mlxcel.reactor.adapter import CoreAdapter

    def entry(i: int) -> RunEntry:
        return RunEntry(f"r{i}", 0, (1,), 0, SamplingParams(), i)

    async with Node("n") as node:
        ep = Gate()
        adapter = CoreAdapter(node, ep, TimerCore(None), "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        adapter.feed([Send("s0", entry(1))])
        assert [m for _, m in ep.now] == [entry(1)] and ep.sent == []
        ep.open = False
        adapter.feed([Send("s0", entry(2))])  # refused: queued
        ep.open = True
        adapter.feed([Send("s0", entry(3)), Send("s1", entry(4))])  # s0 has one queued
        assert [m for _, m in ep.now] == [entry(1), entry(4)]  # s1 was idle
        await asyncio.sleep(0.05)
        assert ep.sent == [("s0", entry(2)), ("s0", entry(3))]  # in order, behind it
        adapter.bundles = True
        adapter.feed([Send("s0", entry(i)) for i in (5, 6, 7)])
        dest, msg = ep.now[-1]
        assert dest == "s0" and isinstance(msg, Bundle)  # a run of sends still bundles
        assert [m.nonce for m in msg.items] == [5, 6, 7] and ep.refused == 1


async def test_a_timer_due_as_the_node_closes_never_reaches_the_core() -> None:
    """The timer was disarmed only a loop turn after the bus closed, so one already due
    still called the core of a closing node (and a compute callback saw it running)."""
    loop = asyncio.get_running_loop()
    core = TimerCore(None)
    node, adapter = await _timer_node(core)
    core.due = loop.time()
    adapter.feed([])  # type: ignore[attr-defined]  # arms it: due on the next loop turn
    await node.__aexit__(None, None, None)  # closes without a turn in between
    await asyncio.sleep(0.05)
    assert core.fired == [] and not adapter.running  # type: ignore[attr-defined]


class Bogus:
    """An effect no adapter knows: carrying it out raises, as a core bug would."""


class ReactingCore(TimerCore):
    """Answers an undeliverable send with a notice to ``s0``; its first firing sends to a
    dead peer, then emits an effect nobody handles."""

    def __init__(self) -> None:
        super().__init__(None)
        self.notices = 0

    def on_timer(self, now: float) -> list:
        from mlxcel.base.effects import Send

        self.fired.append(now)
        self.due = None
        if len(self.fired) > 1:
            return []
        return [Send("dead", RunEntry("x", 0, (1,), 0, SamplingParams(), 0)), Bogus()]

    def undeliverable(self, send: object, reason: str, now: float) -> list:
        from mlxcel.base.effects import Send

        self.notices += 1
        self.due = now + 0.03  # the reaction also names a timer (armed by the nested feed)
        return [Send("s0", RunEntry("notice", 0, (1,), 0, SamplingParams(), 99))]


class DeadGate(Gate):
    def send_now(self, dest: str, msg: Message) -> bool:
        if dest == "dead":
            raise SendFailed("send to dead failed: connection refused")
        return super().send_now(dest, msg)


def _entry(i: int) -> RunEntry:
    return RunEntry(f"r{i}", 0, (1,), 0, SamplingParams(), i)


@pytest.mark.parametrize("between", ["send", "warn"])
async def test_a_failed_send_is_reported_after_every_effect_of_its_feed(between: str) -> None:
    """A send that failed at once was reported to the core before the later effects of the
    same call were carried out, so the core's reaction overtook later sends on the wire:
    first within a run of sends, then (once that was fixed) across any other effect."""
    from mlxcel.base.effects import Send, Warn
    from mlxcel.reactor.adapter import CoreAdapter

    async with Node("n") as node:
        ep = DeadGate()
        core = ReactingCore()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        middle = Send("s0", _entry(2)) if between == "send" else Warn("debug", "between")
        adapter.feed([Send("dead", _entry(1)), middle, Send("s0", _entry(3))])
        assert core.notices == 1
        want = [2, 3, 99] if between == "send" else [3, 99]
        assert [m.nonce for d, m in ep.now if d == "s0"] == want


async def test_a_failing_timer_leaves_one_retry_armed_not_an_orphan() -> None:
    """When carrying out a timer's effects raised after a nested call had armed the next
    timer, the 0.1 s retry replaced that handle without cancelling it: two timers ran."""
    from mlxcel.reactor.adapter import CoreAdapter

    loop = asyncio.get_running_loop()
    async with Node("n") as node:
        core = ReactingCore()
        adapter = CoreAdapter(node, DeadGate(), core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        core.due = loop.time()
        adapter.feed([])
        await asyncio.sleep(0.3)
        assert core.notices == 1
        assert len(core.fired) == 2, core.fired  # the first, then its retry: nothing else
        assert core.fired[1] - core.fired[0] >= 0.09


async def test_a_full_outbox_is_reported_after_the_sends_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send refused by a full outbox was reported at once, before sends to idle peers of
    the same call went out."""
    import mlxcel.reactor.adapter
    from mlxcel.base.effects import Send
    from mlxcel.reactor.adapter import CoreAdapter

    monkeypatch.setattr(mlxcel.reactor.adapter, "OUTBOX_SIZE", 1)
    async with Node("n") as node:
        ep = Gate()
        core = ReactingCore()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        ep.open = False
        adapter.feed([Send("slow", _entry(0))])  # not written: it fills slow's one-slot outbox
        ep.open = True
        adapter.feed([Send("slow", _entry(1)), Send("s0", _entry(2)), Send("s0", _entry(3))])
        assert core.notices == 1
        assert [m.nonce for d, m in ep.now if d == "s0"] == [2, 3, 99]


class Stubborn(TimerCore):
    """Answers every undeliverable send by sending to the dead peer again."""

    def __init__(self) -> None:
        super().__init__(None)
        self.notices = 0

    def undeliverable(self, send: object, reason: str, now: float) -> list:
        from mlxcel.base.effects import Send

        self.notices += 1
        return [Send("dead", RunEntry("again", 0, (1,), 0, SamplingParams(), self.notices))]


async def test_a_core_that_answers_each_failure_with_another_cannot_loop_forever() -> None:
    from mlxcel.base.effects import Send
    from mlxcel.reactor.adapter import OUTBOX_SIZE, CoreAdapter

    async with Node("n") as node:
        core = Stubborn()
        adapter = CoreAdapter(node, DeadGate(), core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        adapter.feed([Send("dead", RunEntry("x", 0, (1,), 0, SamplingParams(), 0))])
        assert core.notices == OUTBOX_SIZE  # told in a loop, not a recursion; then dropped


class OrderCore(TimerCore):
    """Records what it is handed, in order."""

    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[tuple[str, str]] = []

    def handle(self, msg: Message, source: str, now: float) -> list:
        self.seen.append((type(msg).__name__, msg.request_id))  # type: ignore[attr-defined]
        return []


async def test_a_core_is_handed_messages_inside_the_publish_and_in_arrival_order() -> None:
    """A role's classes share one inbox: a message that finds it empty reaches the core
    before ``publish`` returns (no task switch), and a backlog drains in arrival order
    across classes (per-class queues could hand a later RunEntry over before a CancelRequest
    that arrived first)."""
    from mlxcel.base.messages import CancelRequest
    from mlxcel.reactor.adapter import CoreAdapter

    core = OrderCore()
    async with Node("order") as node:
        adapter = CoreAdapter(node, Recorder(), core, "order", 1.0)  # type: ignore[arg-type]
        adapter.subscribe([RunEntry, CancelRequest], origin=Origin.ANY, maxsize=8)
        adapter.start()
        entry = RunEntry("a", 0, (1,), 0, SamplingParams(), 1)
        await node.bus.publish(entry, source="10.0.0.2:9000", deadline=deadline_in(1))
        assert core.seen == [("RunEntry", "a")]
        # From inside a core's handler (here: a synchronous bus handler) nothing is handed
        # over at once: these queue, and drain in the order they were published.
        burst = [
            RunEntry("b", 0, (1,), 0, SamplingParams(), 2),
            RunEntry("c", 0, (1,), 0, SamplingParams(), 3),
            CancelRequest("b", "gone"),
            RunEntry("d", 0, (1,), 0, SamplingParams(), 4),
        ]
        node.bus.subscribe(Ack, lambda env: [node.bus.publish_now(m) for m in burst], sync=True)
        node.bus.publish_now(Ack("x", 0))
        assert len(core.seen) == 1
        await asyncio.sleep(0.01)
    assert core.seen[1:] == [
        ("RunEntry", "b"),
        ("RunEntry", "c"),
        ("CancelRequest", "b"),
        ("RunEntry", "d"),
    ]


class ScriptCore(TimerCore):
    """Answers each message by the script ``replies``: request id -> (dest, request ids)."""

    def __init__(self, replies: dict[str, tuple[str, tuple[str, ...]]]) -> None:
        super().__init__(None)
        self.replies = replies
        self.seen: list[str] = []
        self.others: list[Any] = []  # adapters of other nodes: is one of them feeding?
        self.inside: list[bool] = []

    def handle(self, msg: Message, source: str, now: float) -> list:
        from mlxcel.base.effects import Send
        from mlxcel.base.messages import CancelRequest

        rid = msg.request_id  # type: ignore[attr-defined]
        self.seen.append(rid)
        self.inside.append(any(ad._feeding for ad in self.others))
        dest, ids = self.replies.get(rid, ("", ()))
        return [Send(dest, CancelRequest(i, "script")) for i in ids]


async def test_over_the_in_memory_fabric_no_core_runs_inside_another_nodes_feed() -> None:
    """A decides p then q for B; B answers p with r; A answers r with s. Over the fabric a
    message must not be handled inside the sender's feed: B's core ran there, between p and
    q, and (with a per-bus count) B's answer too, so B saw p, s, q -- a reaction overtaking
    what A had decided before it, which TCP never allows."""
    from mlxcel.base.messages import CancelRequest
    from mlxcel.net.network import LocalFabric
    from mlxcel.reactor.adapter import CoreAdapter

    fabric = LocalFabric()
    a_core = ScriptCore({"go": ("b", ("p", "q")), "r": ("b", ("s",))})
    b_core = ScriptCore({"p": ("a", ("r",))})
    async with Node("a") as a, Node("b") as b:
        adapters = []
        for name, node, core in (("a", a, a_core), ("b", b, b_core)):
            ad = CoreAdapter(node, fabric.endpoint(name, node), core, name, 1.0)  # type: ignore[arg-type]
            ad.subscribe([CancelRequest], origin=Origin.ANY, maxsize=8)
            ad.start()
            adapters.append(ad)
        a_core.others, b_core.others = [adapters[1]], [adapters[0]]
        adapters[0].feed(a_core.handle(CancelRequest("go", "start"), LOCAL, 0.0))
        for _ in range(100):
            if len(b_core.seen) == 3:
                break
            await asyncio.sleep(0.01)
    assert b_core.seen == ["p", "q", "s"]
    assert a_core.seen == ["go", "r"]
    assert not any(a_core.inside[1:] + b_core.inside)  # ("go" is fed from outside)


async def test_results_for_the_frontend_are_never_dropped_and_keep_their_order() -> None:
    """The local outbox hands results to the bus at once; when the frontend's inbox is full
    they wait, in order, however many there are -- none is dropped (a dropped token would
    leave its stream waiting for its deadline)."""
    from mlxcel.base.messages import RunResult
    from mlxcel.reactor.adapter import LocalOutbox

    async with Node("n") as node:
        gate = asyncio.Event()
        got: list[int] = []

        async def slow(env: Any) -> None:
            await gate.wait()
            got.append(env.msg.nonce)

        node.bus.subscribe(RunResult, slow, maxsize=4, origin=Origin.LOCAL)
        outbox = LocalOutbox(node, "coordinator")
        outbox.start()
        n = 6000  # more than any fixed bound a drop-on-full queue could have had
        for i in range(n):
            outbox.put(RunResult("r", 0, (i,), None, i))
        assert outbox.waited >= n - 5  # all but what fit in the inbox waited in the outbox
        gate.set()
        for _ in range(2000):
            if len(got) == n:
                break
            await asyncio.sleep(0.01)
        assert got == list(range(n))


async def test_a_leaf_subscriber_is_called_inside_a_feed_and_others_are_queued() -> None:
    """A leaf (a sync handler that publishes nothing) takes a message inside the publish even
    while a feed is on the stack; an ordinary sync handler then gets it from its queue."""
    from mlxcel.base.errors import BusError
    from mlxcel.base.messages import Error, RunResult
    from mlxcel.reactor.bus import handling

    async with Node("n") as node:
        leaf_calls: list[int] = []
        plain_calls: list[int] = []
        leaf = node.bus.subscribe(
            RunResult, lambda env: leaf_calls.append(env.msg.nonce), sync=True, leaf=True
        )
        plain = node.bus.subscribe(Error, lambda env: plain_calls.append(env.msg.nonce), sync=True)
        with handling():
            assert node.bus.publish_now(RunResult("r", 0, (1,), None, 7))
            assert node.bus.publish_now(Error("c", "m", "r", 8))
            assert leaf_calls == [7] and leaf.inline == 1  # inside the publish
            assert plain_calls == [] and plain.depth == 1  # queued behind the feed
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert plain_calls == [8] and plain.inline == 0
        with pytest.raises(BusError, match="leaf"):
            node.bus.subscribe(RunResult, lambda env: None, leaf=True)


class Refusals(TimerCore):
    """Counts the sends the adapter reports undeliverable."""

    def __init__(self) -> None:
        super().__init__(None)
        self.lost: list[str] = []

    def undeliverable(self, send: object, reason: str, now: float) -> list:
        self.lost.append(reason)
        return []


async def test_refusals_to_strangers_wait_in_one_bounded_outbox() -> None:
    """Refusals to identities that are not peers share one outbox of STRANGER_OUTBOX sends: a
    flood of strangers cannot queue more; the rest are reported undeliverable at once (and
    each refusal's connection is reset after it went out)."""
    from mlxcel.base.effects import Send
    from mlxcel.reactor.adapter import STRANGER_OUTBOX, CoreAdapter

    class Slow(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()
            self.resets: list[str] = []

        async def send(self, dest: str, msg: Message, deadline: float) -> None:
            await self.gate.wait()
            await super().send(dest, msg, deadline)

        def reset(self, dest: str) -> None:
            self.resets.append(dest)

    async with Node("n") as node:
        ep, core = Slow(), Refusals()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        n = STRANGER_OUTBOX + 36
        adapter.feed([Send(f"10.0.0.{i}:1", _entry(i), peer=False) for i in range(n)])
        assert len(core.lost) == 36 and all("is full" in why for why in core.lost)
        assert adapter.dropped_sends == 36
        ep.gate.set()
        for _ in range(500):
            if len(ep.sent) == STRANGER_OUTBOX:
                break
            await asyncio.sleep(0.01)
        assert [m.nonce for _, m in ep.sent] == list(range(STRANGER_OUTBOX))
        assert ep.resets == [d for d, _ in ep.sent]  # one-off connections, closed after use
