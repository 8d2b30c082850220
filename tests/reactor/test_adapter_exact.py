"""CoreAdapter, path by path: bundles in and out, lost peers, expiry at its exact time, the
send budget and deadlines each send is given, discarding and flushing outboxes, where each
kind of log line goes, and the codec's count of tensor bytes that bundling relies on.

Every wait is on an event or a bounded poll of a condition, never a timed margin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from loguru import logger

import mlxcel.reactor.adapter as adapter_mod
from mlxcel.base.effects import Effect, Send, Warn
from mlxcel.base.errors import SendFailed
from mlxcel.base.messages import (
    MAX_BUNDLE,
    Activation,
    Bundle,
    KvHandoff,
    Message,
    RunEntry,
    SamplingParams,
    Tensor,
)
from mlxcel.reactor.adapter import BUNDLE_TENSOR_BYTES, CoreAdapter, LocalOutbox
from mlxcel.reactor.bus import Node, Origin
from mlxcel.wire.codec import tensor_bytes
from tests.conftest import until_true


def entry(i: int) -> RunEntry:
    return RunEntry(f"r{i}", 0, (1,), 0, SamplingParams(), i)


def act(i: int, nbytes: int) -> Activation:
    return Activation(f"a{i}", 0, Tensor("uint8", (nbytes,), bytes(nbytes)), 0, SamplingParams(), i)


class Core:
    """Records what the adapter hands it; answers with ``reply`` effects."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.reply: list[Effect] = []
        self.lost_sends: list[tuple[Send, str]] = []

    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        self.calls.append(("handle", msg, source, now))
        return list(self.reply)

    def on_timer(self, now: float) -> list[Effect]:
        return []

    def next_timer(self) -> float | None:
        return None

    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
        self.lost_sends.append((send, reason))
        return []

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        self.calls.append(("peer_lost", identity, now))
        return list(self.reply)


class TimedCore(Core):
    """A core whose timer is due at ``due``; each firing is recorded with the time it was
    told, and fires once (the due time is cleared)."""

    def __init__(self) -> None:
        super().__init__()
        self.due: float | None = None
        self.told: list[float] = []

    def next_timer(self) -> float | None:
        return self.due

    def on_timer(self, now: float) -> list[Effect]:
        self.told.append(now)
        self.due = None
        return []


class BatchingCore(Core):
    def handle_bundle(self, items: tuple[Message, ...], source: str, now: float) -> list[Effect]:
        self.calls.append(("bundle", items, source, now))
        return []


class Endpoint:
    """Records sends with the deadline each was given and the loop time it started; ``gate``
    holds every send until set; ``send_now`` writes at once while ``open``."""

    identity = "me"
    wire_bytes = 0

    def __init__(self, open_now: bool = False) -> None:
        self.sent: list[tuple[str, Message, float, float]] = []
        self.now: list[tuple[str, Message]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.open = open_now
        self.lost_callback: Callable[[str], None] | None = None
        self.resets: list[str] = []

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        self.sent.append((dest, msg, deadline, asyncio.get_running_loop().time()))
        await self.gate.wait()

    def send_now(self, dest: str, msg: Message) -> bool:
        if self.open:
            self.now.append((dest, msg))
        return self.open

    def reset(self, dest: str) -> None:
        self.resets.append(dest)

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        self.lost_callback = callback


async def test_a_bundle_reaches_a_batching_core_once_and_other_cores_item_by_item() -> None:
    items = (entry(1), entry(2), entry(3))
    for core in (BatchingCore(), Core()):
        async with Node("n") as node:
            adapter = CoreAdapter(node, Endpoint(), core, "n", 1.0)  # type: ignore[arg-type]
            adapter.subscribe([Bundle], origin=Origin.ANY, maxsize=8)
            adapter.start()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await node.bus.publish(Bundle(items), source="10.0.0.1:9", deadline=t0 + 5)
            await until_true(lambda c=core: bool(c.calls))
            kinds = [(c[0], c[1], c[2]) for c in core.calls]
            if isinstance(core, BatchingCore):
                assert kinds == [("bundle", items, "10.0.0.1:9")]
            else:
                assert kinds == [("handle", m, "10.0.0.1:9") for m in items]
            assert all(t0 <= c[3] <= loop.time() for c in core.calls)


async def test_a_lost_peer_reaches_the_core_and_its_answer_is_carried_out() -> None:
    async with Node("n") as node:
        ep, core = Endpoint(open_now=True), Core()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        assert ep.lost_callback is not None
        core.reply = [Send("s2", entry(7))]
        t0 = adapter.now()
        ep.lost_callback("s1")
        ((kind, who, when),) = core.calls
        assert (kind, who) == ("peer_lost", "s1") and t0 <= when <= adapter.now()
        assert ep.now == [("s2", entry(7))]


async def test_a_peer_lost_while_the_node_closes_its_connections_reaches_no_core() -> None:
    """A closing node loses every connection: the core is not asked (what it would send, a
    stage's eviction or a release, could only fail on a node that spawns no more tasks)."""
    node = Node("n")
    await node.__aenter__()
    ep, core = Endpoint(open_now=True), Core()
    adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
    adapter.start()
    core.reply = [Send("s2", entry(7))]
    await node.__aexit__(None, None, None)
    assert ep.lost_callback is not None
    ep.lost_callback("s1")
    assert core.calls == [] and ep.now == []


async def test_a_send_whose_deadline_is_now_is_dropped_unsent_and_counted() -> None:
    async with Node("n") as node:
        ep = Endpoint(open_now=True)
        core = Core()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.now = lambda: 100.0  # type: ignore[method-assign]
        adapter.feed([Send("s0", entry(1), deadline=100.0), Send("s0", entry(2), deadline=100.0)])
        adapter.feed([Send("s0", entry(3), deadline=100.001)])
        assert adapter.expired_sends == 2 and ep.now == [("s0", entry(3))]
        assert core.lost_sends == []  # the core is told only where it asks (report_expired)


async def test_a_role_that_asks_is_told_of_each_expired_send_as_never_sent() -> None:
    """The router's prompt send waits 5 s, its request minutes: a prompt that expired in its
    queue must fail over (or fail) now, not leave its request waiting for minutes."""
    async with Node("n") as node:
        ep, core = Endpoint(), Core()
        ep.gate.clear()  # the first send hangs: what queues behind it expires there
        adapter = Told(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.excs = []
        adapter.report_expired = True
        now = adapter.now()
        first, late = Send("s0", entry(1)), Send("s0", entry(2), deadline=now + 0.05)
        adapter.feed([first, late])
        await until_true(lambda: len(ep.sent) == 1)
        await asyncio.sleep(0.1)
        ep.gate.set()  # the line moves again: the late one's deadline has passed
        why = "not sent before its deadline: the queue for s0 did not move"
        await until_true(lambda: core.lost_sends == [(late, why)])
        assert adapter.excs == [None] and adapter.expired_sends == 1 and len(ep.sent) == 1


async def test_a_run_of_sends_bundles_up_to_max_bundle_items_and_the_tensor_budget() -> None:
    async with Node("n") as node:
        ep = Endpoint(open_now=True)
        adapter = CoreAdapter(node, ep, Core(), "n", 1.0)  # type: ignore[arg-type]
        adapter.bundles = True
        adapter.feed([Send("s0", entry(i)) for i in range(MAX_BUNDLE + 1)])
        (d0, first), (d1, second) = ep.now
        assert isinstance(first, Bundle) and len(first.items) == MAX_BUNDLE
        assert second == entry(MAX_BUNDLE) and d0 == d1 == "s0"
        # Two activations that fill the tensor budget exactly travel together; a third byte
        # does not fit and starts the next message.
        ep.now.clear()
        half = BUNDLE_TENSOR_BYTES // 2
        a, b, c = act(1, half), act(2, BUNDLE_TENSOR_BYTES - half), act(3, 1)
        adapter.feed([Send("s0", a), Send("s0", b), Send("s0", c)])
        assert ep.now == [("s0", Bundle((a, b))), ("s0", c)]
        # What does not travel in Bundles goes alone, and so does a send to a stranger.
        ep.now.clear()
        h = KvHandoff("k", 1, "r", 1, 1, SamplingParams(), (), 1, (), (), b"")
        adapter.feed([Send("s0", entry(1)), Send("s0", h), Send("s0", entry(2))])
        assert ep.now == [("s0", entry(1)), ("s0", h), ("s0", entry(2))]


async def test_each_send_gets_the_budget_or_its_own_deadline() -> None:
    async with Node("n") as node:
        ep = Endpoint()
        adapter = CoreAdapter(node, ep, Core(), "n", 7.0)  # type: ignore[arg-type]
        t = adapter.now()
        adapter.feed([Send("s0", entry(1))])  # no deadline: the 7 s budget
        adapter.feed([Send("s1", entry(2), deadline=t + 100)])  # a later deadline: the budget
        adapter.feed([Send("s2", entry(3), deadline=t + 3)])  # an earlier one: its own
        adapter.feed([Send("10.0.0.9:1", entry(4), peer=False)])  # a stranger: 1 s
        await until_true(lambda: len(ep.sent) == 4)
        # (the deadline is taken just before the send starts: what is left of it is the budget,
        # give or take a scheduling hiccup, far below the 1 s and 7 s told apart here)
        given = {dest: deadline - started for dest, _, deadline, started in ep.sent}
        assert all(abs(given[d] - 7.0) < 0.5 for d in ("s0", "s1"))
        assert abs(given["10.0.0.9:1"] - 1.0) < 0.5
        assert ep.sent[2][2] == t + 3
        assert ep.resets == ["10.0.0.9:1"]  # the stranger's one-off connection is closed
        adapter.deadline_overrides_budget = True  # a lease longer than the budget wins
        adapter.feed([Send("s3", entry(5), deadline=t + 100)])
        await until_true(lambda: len(ep.sent) == 5)
        assert ep.sent[4][2] == t + 100


async def test_discard_and_flush_act_on_what_is_queued_and_in_flight() -> None:
    async with Node("n") as node:
        ep = Endpoint()
        ep.gate.clear()  # every send hangs until released
        adapter = CoreAdapter(node, ep, Core(), "n", 30.0)  # type: ignore[arg-type]
        assert await adapter.flush(adapter.now()) is True  # nothing queued: done at once
        adapter.feed([Send("s0", entry(i)) for i in range(1, 6)])
        await until_true(lambda: len(ep.sent) == 1)  # entry 1 is on its way; 2..5 wait behind it
        assert await adapter.flush(adapter.now() + 0.02) is False
        dropped = adapter.discard_queued(lambda s: s.msg.nonce % 2 == 0)
        assert dropped == 2
        assert adapter.discard_queued(lambda s: False) == 0
        ep.gate.set()
        assert await adapter.flush(adapter.now() + 30) is True
        assert [m.nonce for _, m, _, _ in ep.sent] == [1, 3, 5]


async def test_log_lines_go_to_their_level_and_cluster_warnings_through_the_limiter() -> None:
    lines: list[tuple[str, str]] = []
    sink = logger.add(lambda m: lines.append((m.record["level"].name, m.record["message"])))
    try:
        async with Node("n") as node:
            adapter = CoreAdapter(node, Endpoint(), Core(), "n", 1.0)  # type: ignore[arg-type]
            adapter.feed(
                [
                    Warn("debug", "a"),
                    Warn("info", "b"),
                    Warn("warning", "c"),
                    Warn("noise", "d"),
                    Warn("router-drop", "e"),
                ]
            )
            assert adapter.limiter.warned == {
                "noise": 1,
                "diagnostic": 0,
                "router-drop": 1,
                "at-capacity": 0,
                "coordinator-drop": 0,
                "stage-drop": 0,
                "http-cap": 0,
                "http-slow": 0,
                "discovery-drop": 0,
                "decode-refusal": 0,
                "http-evict": 0,
                "prefix-mismatch": 0,
            }

            class Bogus:
                pass

            with pytest.raises(NotImplementedError, match="^n: no handler for Bogus$"):
                adapter.feed([Bogus()])  # type: ignore[list-item]
    finally:
        logger.remove(sink)
    mine = [x for x in lines if x[1] in "abcde"]
    assert mine == [
        ("DEBUG", "a"),
        ("INFO", "b"),
        ("WARNING", "c"),
        ("WARNING", "d"),
        ("WARNING", "e"),
    ]


async def test_the_frontend_outbox_counts_exactly_what_had_to_wait() -> None:
    async with Node("fe") as node:
        got: list[int] = []

        async def take(env: object) -> None:
            got.append(env.msg.nonce)  # type: ignore[attr-defined]

        node.bus.subscribe(RunEntry, take, maxsize=1, name="fe")
        out = LocalOutbox(node, "fe")
        out.start()
        for i in (1, 2, 3):  # no loop turn between: the inbox of one holds the first
            out.put(entry(i))
        assert out.waited == 2
        await until_true(lambda: len(got) == 3)
        assert got == [1, 2, 3]


def test_tensor_bytes_counts_every_tensor_a_message_or_bundle_carries() -> None:
    t3, t5 = Tensor("uint8", (3,), bytes(3)), Tensor("uint8", (5,), bytes(5))
    assert tensor_bytes(entry(1)) == 0
    assert tensor_bytes(act(1, 7)) == 7
    h = KvHandoff("k", 1, "r", 1, 1, SamplingParams(), (), 1, (t3, t5), (t5,), b"")
    assert tensor_bytes(h) == 13
    assert tensor_bytes(Bundle((act(1, 7), entry(2), act(3, 4)))) == 11


async def test_a_frontend_that_takes_nothing_is_reported_and_its_results_still_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QueueFull is a BusError: caught after BusError, it ended the outbox for good, and
    every later result of every request waited out its deadline."""
    import mlxcel.reactor.adapter

    monkeypatch.setattr(mlxcel.reactor.adapter, "LOCAL_WAIT", 0.05)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="ERROR")
    try:
        async with Node("fe") as node:
            gate = asyncio.Event()
            got: list[int] = []

            async def stuck(env: object) -> None:
                await gate.wait()
                got.append(env.msg.nonce)  # type: ignore[attr-defined]

            node.bus.subscribe(RunEntry, stuck, maxsize=1, name="fe")
            out = LocalOutbox(node, "fe")
            out.start()
            for i in (1, 2, 3):
                out.put(entry(i))
            await until_true(lambda: bool(lines))
            # r1 is with the stuck handler, r2 in its inbox of one, r3 waits here.
            assert lines[0] == "fe: the frontend took nothing for 0.05s; 1 result(s) wait"
            gate.set()
            await until_true(lambda: len(got) == 3)
            assert got == [1, 2, 3]
    finally:
        logger.remove(sink)


class Failing(Endpoint):
    """``send_now`` and ``send`` to ``dead`` fail with a reason naming the message."""

    def send_now(self, dest: str, msg: Message) -> bool:
        if dest == "dead" and self.open:
            raise SendFailed(f"now: {msg.nonce}")  # type: ignore[attr-defined]
        return super().send_now(dest, msg)

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        await super().send(dest, msg, deadline)
        if dest == "dead":
            raise SendFailed(f"later: {msg.nonce}")  # type: ignore[attr-defined]


class Told(CoreAdapter):
    """Keeps the exception each failed send came with (a role like the router's reads it)."""

    def undeliverable(self, send: Send, reason: str, exc: BaseException | None) -> list[Effect]:
        self.excs.append(exc)
        return super().undeliverable(send, reason, exc)


async def test_every_failed_send_reaches_the_core_with_its_own_reason() -> None:
    async with Node("n") as node:
        ep, core = Failing(open_now=True), Core()
        adapter = Told(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.excs: list[BaseException | None] = []
        a, b, c = Send("dead", entry(1)), Send("dead", entry(2)), Send("s0", entry(3))
        adapter.feed([a, b, c])  # written at once: each refusal is told, none is skipped
        assert core.lost_sends == [(a, "now: 1"), (b, "now: 2")]
        assert ep.now == [("s0", entry(3))]
        core.lost_sends.clear()
        ep.open = False  # now they queue, and fail from the outbox, outside any feed
        adapter.feed([a])
        await until_true(lambda: bool(core.lost_sends))
        assert core.lost_sends == [(a, "later: 1")] and adapter.dropped_sends == 3
        assert [str(e) for e in adapter.excs] == ["now: 1", "now: 2", "later: 1"]
        assert all(isinstance(e, SendFailed) for e in adapter.excs)


async def test_a_reset_closes_that_peer_and_failures_that_never_end_are_dropped_loudly() -> None:
    from mlxcel.base.effects import ResetPeer
    from mlxcel.reactor.adapter import OUTBOX_SIZE

    class Stubborn(Core):
        def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
            self.lost_sends.append((send, reason))
            return [send]  # sends it again, and again

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="ERROR")
    try:
        async with Node("n") as node:
            ep, core = Failing(open_now=True), Stubborn()
            adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
            adapter.feed([ResetPeer("s1")])
            assert ep.resets == ["s1"]
            adapter.feed([Send("dead", entry(1))])
            assert len(core.lost_sends) == OUTBOX_SIZE
    finally:
        logger.remove(sink)
    assert lines == ["n: failed sends keep failing; dropped"]


async def test_sends_to_two_peers_in_one_run_never_share_a_bundle_and_expired_ones_drop_out() -> (
    None
):
    async with Node("n") as node:
        ep = Endpoint(open_now=True)
        adapter = CoreAdapter(node, ep, Core(), "n", 1.0)  # type: ignore[arg-type]
        adapter.bundles = True
        adapter.feed([Send("s0", entry(1)), Send("s1", entry(2)), Send("s0", entry(3))])
        assert ep.now == [("s0", Bundle((entry(1), entry(3)))), ("s1", entry(2))]
        ep.now.clear()
        gone = Send("s0", entry(5), deadline=0.0)  # long past
        adapter.feed([Send("s0", entry(4)), gone, Send("s0", entry(6)), Send("s0", entry(7))])
        assert ep.now == [("s0", Bundle((entry(4), entry(6), entry(7))))]
        assert adapter.expired_sends == 1


async def test_what_waits_in_an_outbox_leaves_as_bundles_of_at_most_max_bundle() -> None:
    async with Node("n") as node:
        ep = Endpoint()
        ep.gate.clear()
        adapter = CoreAdapter(node, ep, Core(), "n", 30.0)  # type: ignore[arg-type]
        adapter.bundles = True
        adapter.feed([Send("s0", entry(0))])
        await until_true(lambda: len(ep.sent) == 1)  # on its way, held at the gate
        gone = Send("s0", entry(1), deadline=0.0)
        adapter.feed([gone] + [Send("s0", entry(i)) for i in range(2, MAX_BUNDLE + 3)])
        ep.gate.set()
        await until_true(lambda: len(ep.sent) == 3)
        first, second = ep.sent[1][1], ep.sent[2][1]
        assert isinstance(first, Bundle) and len(first.items) == MAX_BUNDLE
        assert [m.nonce for m in first.items] == list(range(2, MAX_BUNDLE + 2))
        assert second == entry(MAX_BUNDLE + 2) and adapter.expired_sends == 1


async def test_nothing_passes_a_send_that_is_on_its_way_and_flush_waits_for_it() -> None:
    async with Node("n") as node:
        ep = Endpoint(open_now=False)
        ep.gate.clear()
        adapter = CoreAdapter(node, ep, Core(), "n", 30.0)  # type: ignore[arg-type]
        adapter.feed([Send("s0", entry(1))])  # the socket is busy: queued, then taken out
        await until_true(lambda: len(ep.sent) == 1)
        ep.open = True  # the socket could take more now, but entry 1 is still on its way
        adapter.feed([Send("s0", entry(2))])
        assert ep.now == []
        assert await adapter.flush(adapter.now() + 0.02) is False  # nothing queued but 2
        ep.gate.set()
        assert await adapter.flush(adapter.now() + 30) is True
        assert [m.nonce for _, m, _, _ in ep.sent] == [1, 2]


async def test_a_subscription_keeps_its_origin_and_size() -> None:
    from mlxcel.reactor.bus import LOCAL

    async with Node("n") as node:
        core = Core()
        adapter = CoreAdapter(node, Endpoint(), core, "n", 1.0)  # type: ignore[arg-type]
        adapter.subscribe([RunEntry], origin=Origin.LOCAL, maxsize=3)
        (sub,) = node.bus._subs[RunEntry]
        assert sub.queue.maxsize == 3
        t = adapter.now()
        assert await node.bus.publish(entry(1), source="10.0.0.1:9", deadline=t + 1) == 0
        assert await node.bus.publish(entry(2), source=LOCAL, deadline=t + 1) == 1
        await until_true(lambda: bool(core.calls))
        assert [c[1] for c in core.calls] == [entry(2)]


async def test_a_timer_withdrawn_by_a_message_is_disarmed_and_closing_clears_it() -> None:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="ERROR")
    try:
        node = Node("n")
        await node.__aenter__()
        core = TimedCore()
        adapter = CoreAdapter(node, Endpoint(), core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        core.due = adapter.now() + 0.05
        adapter.feed([])
        assert adapter.timer_due is not None
        core.due = None  # a message withdrew it
        adapter.feed([])
        assert adapter.timer_due is None
        core.due = adapter.now() + 60
        adapter.feed([])
        await node.__aexit__(None, None, None)
        assert adapter.timer_due is None
        assert not adapter.running and core.told == []
    finally:
        logger.remove(sink)
    assert lines == []


async def test_a_failing_timer_is_reported_by_name() -> None:
    class Broken(Core):
        def __init__(self, due: float) -> None:
            super().__init__()
            self.due: float | None = due

        def next_timer(self) -> float | None:
            return self.due

        def on_timer(self, now: float) -> list[Effect]:
            self.due = None
            raise RuntimeError("core bug")

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="ERROR")
    try:
        async with Node("n") as node:
            core = Broken(asyncio.get_running_loop().time())
            adapter = CoreAdapter(node, Endpoint(), core, "timer-node", 1.0)  # type: ignore[arg-type]
            adapter.start()
            await until_true(lambda: bool(lines))
    finally:
        logger.remove(sink)
    assert lines[0] == "timer-node: timer handling failed"


async def test_an_idle_outbox_is_removed_with_its_task_and_their_number_is_capped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4,000 destinations named once must not stay (a queue and a task each, forever); past
    the cap a send to one more fails at once, with a warning, instead of growing the node."""
    monkeypatch.setattr(adapter_mod, "OUTBOX_IDLE", 0.2)
    monkeypatch.setattr(adapter_mod, "MAX_OUTBOXES", 3)
    async with Node("n") as node:
        ep, core = Endpoint(), Core()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        tasks = len(node._tasks)
        adapter.feed([Send(f"d{i}", entry(i)) for i in range(4)])
        assert adapter.destinations == ["d0", "d1", "d2"]
        (lost,) = core.lost_sends
        assert lost == (Send("d3", entry(3)), "3 destinations already have sends queued")
        assert adapter.limiter.warned["noise"] == 1
        await until_true(lambda: len(ep.sent) == 3)
        # Idle for OUTBOX_IDLE: every outbox and its task is gone.
        await until_true(lambda: not adapter._outboxes, timeout=2.0)
        await until_true(lambda: len(node._tasks) == tasks, timeout=2.0)
        # And a destination used again gets a fresh one.
        ep.open = False
        adapter.feed([Send("d3", entry(9))])
        await until_true(lambda: len(ep.sent) == 4)
        assert ep.sent[-1][:2] == ("d3", entry(9))


class TellingCore(Core):
    """A core that asks to hear of written sends (``Send.notify``)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[Send, float]] = []
        self.answer: list[Effect] = []

    def sent(self, send: Send, now: float) -> list[Effect]:
        self.written.append((send, now))
        return list(self.answer)


class SettlingEndpoint(Endpoint):
    """``settled(dest)`` returns once ``settle`` is set: the bytes have left the host."""

    def __init__(self, open_now: bool = False) -> None:
        super().__init__(open_now)
        self.settling: list[str] = []
        self.settle = asyncio.Event()

    async def settled(self, dest: str) -> None:
        self.settling.append(dest)
        await self.settle.wait()


async def test_the_core_hears_of_the_sends_it_asked_about_once_they_left_the_host() -> None:
    async with Node("n") as node:
        ep, core = SettlingEndpoint(open_now=True), TellingCore()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        told = Send("s0", entry(1), notify=True)
        core.answer = [Send("s1", entry(9))]
        t0 = adapter.now()
        adapter.feed([told, Send("s0", entry(2))])
        assert ep.now == [("s0", entry(1)), ("s0", entry(2))]
        assert core.written == []  # on a later turn, never inside this feed
        await until_true(lambda: ep.settling == ["s0"])
        assert core.written == []  # and not before its bytes left the host
        ep.settle.set()
        await until_true(lambda: bool(core.written))
        ((send, when),) = core.written
        assert send == told and t0 <= when <= adapter.now()
        await until_true(lambda: ("s1", entry(9)) in ep.now)  # its answer is carried out
        assert node.task_errors == 0  # the send nobody asked about started nothing


async def test_every_send_of_a_written_bundle_is_told_and_every_answer_carried_out() -> None:
    class Answering(TellingCore):
        def sent(self, send: Send, now: float) -> list[Effect]:
            super().sent(send, now)
            return [Send("s1", entry(100 + send.msg.nonce))]  # type: ignore[union-attr]

    async with Node("n") as node:
        ep, core = Endpoint(open_now=True), Answering()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.bundles = True
        adapter.start()
        told = [Send("s0", entry(1), notify=True), Send("s0", entry(2), notify=True)]
        adapter.feed(told)
        assert ep.now == [("s0", Bundle((entry(1), entry(2))))]
        await until_true(lambda: len(ep.now) == 2)
        assert [s for s, _ in core.written] == told
        assert ep.now[1:] == [("s1", Bundle((entry(101), entry(102))))]


async def test_a_queued_send_is_told_of_when_the_outbox_wrote_it() -> None:
    async with Node("n") as node:
        ep, core = Endpoint(), TellingCore()  # no send_now: every send goes through its outbox
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        told = Send("s0", entry(1), notify=True)
        adapter.feed([told])
        await until_true(lambda: bool(core.written))
        assert [s for s, _ in core.written] == [told]


async def test_flush_waits_for_a_send_held_behind_a_bundle_and_for_other_peers() -> None:
    async with Node("n") as node:
        ep = Endpoint()
        ep.gate.clear()  # every send hangs until released
        adapter = CoreAdapter(node, ep, Core(), "n", 30.0)  # type: ignore[arg-type]
        adapter.bundles = True
        adapter.feed([Send("s1", entry(5))])  # another peer's send, on its way meanwhile
        await until_true(lambda: len(ep.sent) == 1)
        big = act(3, BUNDLE_TENSOR_BYTES)  # too big to join the bundle: held, then alone
        adapter.feed([Send("s0", act(1, 8)), Send("s0", act(2, 8)), Send("s0", big)])
        await until_true(lambda: len(ep.sent) == 2)  # the two activations, as one bundle
        assert isinstance(ep.sent[1][1], Bundle)
        assert await adapter.flush(adapter.now() + 0.02) is False  # the big one waits its turn
        ep.gate.set()
        assert await adapter.flush(adapter.now() + 5) is True
        assert [type(m).__name__ for _, m, _, _ in ep.sent] == ["RunEntry", "Bundle", "Activation"]


async def test_a_core_on_its_own_host_clock_is_told_at_least_the_time_it_asked_for() -> None:
    """The simulator's skewed hosts: the core lives on the host's clock, loop timers are
    armed in the loop's. Here the conversion is off by 5 s (a host clock read behind the
    time it maps to), so the timer fires when the host clock still reads before the due
    time: the core is told the due time, never a "now" earlier than what it asked for."""
    loop = asyncio.get_running_loop()

    class Host:
        def now(self) -> float:
            return loop.time() + 995.0

        def loop_time(self, t: float) -> float:
            return t - 1000.0

    async with Node("n") as node:
        ep, core = Endpoint(open_now=True), TimedCore()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.clock = Host()
        adapter.start()
        before = loop.time()
        t = adapter.now()
        assert before + 995.0 <= t <= loop.time() + 995.0  # the host's clock, not the loop's
        due = core.due = t + 5.0  # 5 s ahead on the host clock: armed at loop time t - 995
        adapter.feed([])
        await until_true(lambda: bool(core.told))
        assert core.told == [due]
