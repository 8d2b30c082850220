"""CoreAdapter: a core's sends honour the deadline of the exchange they open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mlxcel.bus import LOCAL, Node
from mlxcel.endpoint import SendFailed
from mlxcel.messages import Bundle, Message, PrepareSequence, RunEntry, SamplingParams
from mlxcel.pipeline.coordinator import PipelineCoordinator
from mlxcel.pipeline.coordinator_core import PipelineError


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
