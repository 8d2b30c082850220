from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlxcel.base.deadlines import deadline_in, until
from mlxcel.base.errors import BusError, DeadlineExceeded, QueueFull
from mlxcel.base.messages import Ack, CancelRequest, ReleaseSequence
from mlxcel.reactor.bus import LOCAL, Envelope, Node, Overflow


async def test_messages_reach_subscribers_of_their_class_with_source() -> None:
    got: list[Envelope[Ack]] = []

    async def on_ack(env: Envelope[Ack]) -> None:
        got.append(env)

    async with Node("t") as node:
        node.bus.subscribe(Ack, on_ack)
        assert await node.bus.publish(Ack("r", 1), deadline=deadline_in(1)) == 1
        assert (
            await node.bus.publish(Ack("r", 2), source="10.0.0.1:9000", deadline=deadline_in(1))
            == 1
        )
        assert await node.bus.publish(CancelRequest("r", "x")) == 0  # nobody listens
        await asyncio.sleep(0.01)
    assert [(e.msg.nonce, e.source) for e in got] == [(1, LOCAL), (2, "10.0.0.1:9000")]
    assert node.bus.unrouted["CancelRequest"] == 1


async def test_block_policy_applies_backpressure_until_the_deadline() -> None:
    release = asyncio.Event()

    async def slow(env: Envelope[Ack]) -> None:
        await release.wait()

    async with Node("t") as node:
        sub = node.bus.subscribe(Ack, slow, maxsize=2, policy=Overflow.BLOCK)
        # The drain task takes one message and blocks in the handler; two more fill the queue.
        for i in range(3):
            await node.bus.publish(Ack("r", i), deadline=deadline_in(1))
            await asyncio.sleep(0)
        assert sub.depth == 2
        with pytest.raises(QueueFull):
            await node.bus.publish(Ack("r", 9), deadline=deadline_in(0.05))
        with pytest.raises(BusError, match="deadline"):
            await node.bus.publish(Ack("r", 9))
        # Room appears: a blocked publisher proceeds.
        pending = asyncio.create_task(node.bus.publish(Ack("r", 10), deadline=deadline_in(2)))
        await asyncio.sleep(0.01)
        assert not pending.done()
        release.set()
        assert await pending == 1
        await asyncio.sleep(0.01)
        assert sub.delivered == 4 and sub.dropped == 0


async def test_drop_policy_drops_and_counts_without_blocking() -> None:
    release = asyncio.Event()

    async def slow(env: Envelope[Ack]) -> None:
        await release.wait()

    async with Node("t") as node:
        sub = node.bus.subscribe(Ack, slow, maxsize=1, policy=Overflow.DROP)
        accepted = [await node.bus.publish(Ack("r", i)) for i in range(5)]
        await asyncio.sleep(0)
        accepted += [await node.bus.publish(Ack("r", i)) for i in range(5)]
        assert sub.dropped >= 5
        assert sum(accepted) + sub.dropped == 10
        release.set()


async def test_handler_exception_is_logged_counted_and_not_fatal() -> None:
    seen: list[int] = []

    async def flaky(env: Envelope[Ack]) -> None:
        if env.msg.nonce == 1:
            raise RuntimeError("boom")
        seen.append(env.msg.nonce)

    from loguru import logger

    lines: list[tuple[str, str]] = []
    sink = logger.add(lambda m: lines.append((m.record["level"].name, str(m))), level="DEBUG")
    try:
        async with Node("t") as node:
            sub = node.bus.subscribe(Ack, flaky, name="flaky")
            for i in range(3):
                await node.bus.publish(Ack("r", i), deadline=deadline_in(1))
            await asyncio.sleep(0.01)
    finally:
        logger.remove(sink)
    assert seen == [0, 2]
    assert sub.failed == 1 and node.bus.handler_errors["flaky"] == 1
    # One labelled line at ERROR; the traceback only at DEBUG.
    errors = [text for level, text in lines if level == "ERROR"]
    assert len(errors) == 1 and errors[0].count("\n") == 1  # the line and its newline
    assert "handler flaky failed on Ack: RuntimeError: boom" in errors[0]
    assert any(lvl == "DEBUG" and "Traceback" in text for lvl, text in lines)


async def test_non_critical_task_failure_is_counted_critical_failure_surfaces() -> None:
    async def bad() -> None:
        raise ValueError("task failed")

    async with Node("t") as node:
        node.spawn(bad(), name="bad")
        await asyncio.sleep(0.01)
        assert node.task_errors == 1

    with pytest.raises(ExceptionGroup) as info:
        async with Node("t") as node:
            node.spawn(bad(), name="bad", critical=True)
            await asyncio.sleep(1)
    assert info.group_contains(ValueError)


async def test_closing_the_node_cancels_its_tasks_and_closes_the_bus() -> None:
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async with Node("t") as node:
        node.spawn(forever())
        await asyncio.sleep(0.01)
        closed: list[str] = []

        async def closer() -> None:
            closed.append("closed")

        node.on_close(closer)
    assert cancelled.is_set() and closed == ["closed"]
    with pytest.raises(BusError):
        await node.bus.publish(ReleaseSequence("r"))
    with pytest.raises(BusError):
        node.spawn(asyncio.sleep(0))


async def test_until_uses_the_loop_clock_and_names_the_wait() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceeded, match="waiting for godot"):
        async with until(loop.time() + 0.02, "waiting for godot"):
            await asyncio.sleep(1)
    async with until(None, "no deadline"):
        await asyncio.sleep(0)


async def test_subscription_size_must_be_positive() -> None:
    async def h(env: Envelope[Ack]) -> None:
        pass

    async with Node("t") as node:
        with pytest.raises(BusError):
            node.bus.subscribe(Ack, h, maxsize=0)
        with pytest.raises(BusError):
            node.bus.subscribe(int, h)  # type: ignore[arg-type]


# --- synchronous subscriptions: inline delivery, one queue for several classes --------------
# Handlers here record what they see; the tests assert outside them (the bus catches and
# counts whatever a handler raises, an AssertionError included).


async def test_a_sync_subscriber_is_called_inside_publish_when_nothing_waits() -> None:
    got: list[int] = []

    async with Node("t") as node:
        sub = node.bus.subscribe(Ack, lambda env: got.append(env.msg.nonce), sync=True)
        await node.bus.publish(Ack("r", 1), source="10.0.0.1:9000", deadline=deadline_in(1))
        assert got == [1]  # before publish returned: no queue, no task switch
        assert node.bus.publish_now(Ack("r", 2))
        assert got == [1, 2]
        assert (sub.delivered, sub.inline, sub.depth) == (2, 2, 0)


async def test_several_classes_share_one_queue_in_publish_order() -> None:
    """What a synchronous handler publishes is queued (never run inside it); a subscription
    of several classes drains them in the order they were published, across classes."""
    seen: list[tuple[str, int | None]] = []
    seen_inside: list[int] = []

    def relay(env: Envelope[ReleaseSequence]) -> None:
        for msg in (Ack("r", 1), CancelRequest("r", "x"), Ack("r", 2), CancelRequest("r", "y")):
            node.bus.publish_now(msg)
        seen_inside.append(len(seen))

    def record(env: Envelope[Ack | CancelRequest]) -> None:
        m = env.msg
        seen.append((type(m).__name__, m.nonce if isinstance(m, Ack) else None))

    async with Node("t") as node:
        sub = node.bus.subscribe((Ack, CancelRequest), record, sync=True, name="both")
        node.bus.subscribe(ReleaseSequence, relay, sync=True)
        await node.bus.publish(ReleaseSequence("r"), deadline=deadline_in(1))
        assert seen_inside == [0]  # nothing ran inside the relay
        await asyncio.sleep(0.01)
        assert node.bus.subscriptions().count(sub) == 1
    assert seen == [("Ack", 1), ("CancelRequest", None), ("Ack", 2), ("CancelRequest", None)]
    assert sub.inline == 0 and sub.delivered == 4


async def test_a_sync_handler_is_never_reentered_by_its_own_publishes() -> None:
    depth, most, order = [0], [0], []

    def handler(env: Envelope[Ack]) -> None:
        depth[0] += 1
        most[0] = max(most[0], depth[0])
        order.append(env.msg.nonce)
        if env.msg.nonce < 3:
            node.bus.publish_now(Ack("r", env.msg.nonce + 1))
        depth[0] -= 1

    async with Node("t") as node:
        sub = node.bus.subscribe(Ack, handler, sync=True)
        assert node.bus.publish_now(Ack("r", 1))
        assert order == [1]  # the first inline; what it published waits for the drain task
        await asyncio.sleep(0.01)
    assert order == [1, 2, 3] and most[0] == 1
    assert sub.inline == 1 and sub.delivered == 3


async def test_with_two_subscribers_nothing_runs_inside_publish() -> None:
    """A handler run inside the loop over a message's subscribers could publish ahead of it
    to the next one, fill its queue, or unsubscribe it: with several, both are queued."""
    first: list[int] = []
    second: list[int] = []
    subs: list[Any] = []

    def one(env: Envelope[Ack]) -> None:
        first.append(env.msg.nonce)
        if env.msg.nonce == 1:
            node.bus.publish_now(Ack("r", 2))  # a reply, published after 1
        if env.msg.nonce == 3:
            subs[1].unsubscribe()

    async with Node("t") as node:
        subs.append(node.bus.subscribe(Ack, one, sync=True))
        subs.append(node.bus.subscribe(Ack, lambda env: second.append(env.msg.nonce), sync=True))
        assert node.bus.publish_now(Ack("r", 1))
        assert first == [] and second == []
        await asyncio.sleep(0.01)
        assert first == [1, 2] and second == [1, 2]  # the cause before its reply, for both
        await node.bus.publish(Ack("r", 3), deadline=deadline_in(1))
        await asyncio.sleep(0.01)
    assert second == [1, 2]  # unsubscribed by the first: never called with 3
    assert subs[0].inline == 0 and subs[1].inline == 0


async def test_publish_now_is_all_or_nothing_across_subscribers() -> None:
    release = asyncio.Event()

    async def slow(env: Envelope[Ack]) -> None:
        await release.wait()

    got: list[int] = []
    async with Node("t") as node:
        node.bus.subscribe(Ack, lambda env: got.append(env.msg.nonce), sync=True)
        full = node.bus.subscribe(Ack, slow, maxsize=1)
        assert node.bus.publish_now(Ack("r", 1))  # the slow one takes it into its handler
        await asyncio.sleep(0)
        assert node.bus.publish_now(Ack("r", 2))  # and this fills its queue
        assert not node.bus.publish_now(Ack("r", 3))  # full: nobody takes 3
        await asyncio.sleep(0.01)
        assert got == [1, 2] and full.dropped == 0
        release.set()


async def test_a_failing_sync_handler_is_counted_and_the_publisher_goes_on() -> None:
    cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cancelled.cancel()

    def flaky(env: Envelope[Ack]) -> None:
        if env.msg.nonce == 1:
            raise RuntimeError("boom")
        if env.msg.nonce == 2:
            cancelled.result()  # a CancelledError out of a plain function: its own failure

    async with Node("t") as node:
        sub = node.bus.subscribe(Ack, flaky, sync=True, name="flaky")
        for n in (1, 2, 3):
            assert await node.bus.publish(Ack("r", n), deadline=deadline_in(1)) == 1
        assert (sub.failed, sub.delivered, sub.inline) == (2, 1, 1)
        assert node.bus.handler_errors["flaky"] == 2


async def test_a_task_started_by_a_sync_handler_publishes_inline() -> None:
    """Only a handler on the stack queues what it publishes: a task it starts (an outbox, a
    connection's reader) runs later with none on the stack, and delivers inline."""
    got: list[int] = []

    async def later() -> None:
        await asyncio.sleep(0)
        await node.bus.publish(Ack("r", 7), deadline=deadline_in(1))
        got.append(-1)  # after publish returned

    async with Node("t") as node:
        sub = node.bus.subscribe(Ack, lambda env: got.append(env.msg.nonce), sync=True)
        node.bus.subscribe(ReleaseSequence, lambda env: node.spawn(later()), sync=True)
        assert node.bus.publish_now(ReleaseSequence("r"))
        await asyncio.sleep(0.01)
    assert got == [7, -1] and sub.inline == 1


async def test_a_subscription_needs_message_classes_and_a_plain_sync_handler() -> None:
    async def coroutine_handler(env: Envelope[Ack]) -> None:
        pass

    async with Node("t") as node:
        with pytest.raises(BusError, match="at least one"):
            node.bus.subscribe((), lambda env: None, sync=True)
        with pytest.raises(BusError, match="not a message class"):
            node.bus.subscribe((Ack, int), lambda env: None, sync=True)  # type: ignore[arg-type]
        with pytest.raises(BusError, match="plain function"):
            node.bus.subscribe(Ack, coroutine_handler, sync=True)


async def test_a_handler_that_unsubscribes_itself_is_not_called_for_its_backlog() -> None:
    got: list[int] = []
    subs: list[Any] = []

    def once(env: Envelope[Ack]) -> None:
        got.append(env.msg.nonce)
        subs[0].unsubscribe()

    def fill(env: Envelope[ReleaseSequence]) -> None:
        for n in (1, 2, 3):  # queued behind each other (a handler publishes them)
            node.bus.publish_now(Ack("r", n))

    async with Node("t") as node:
        subs.append(node.bus.subscribe(Ack, once, sync=True))
        node.bus.subscribe(ReleaseSequence, fill, sync=True)
        node.bus.publish_now(ReleaseSequence("r"))
        await asyncio.sleep(0.01)
    assert got == [1]


async def test_a_sync_handler_returning_an_awaitable_fails_visibly() -> None:
    async def work() -> None:
        pass

    async with Node("t") as node:
        sub = node.bus.subscribe(Ack, lambda env: work(), sync=True, name="wrong")
        assert node.bus.publish_now(Ack("r", 1))
        assert (sub.failed, sub.delivered) == (1, 0)
        assert node.bus.handler_errors["wrong"] == 1


async def test_a_refused_subscription_is_not_left_half_registered() -> None:
    node = Node("t")  # never entered: it cannot start a drain task
    with pytest.raises(BusError, match="not running"):
        node.bus.subscribe(Ack, lambda env: None, sync=True)
    assert node.bus.subscriptions() == []
