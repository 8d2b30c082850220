"""A bulk sender waits for the kernel's send queue to drain to the link's share before its
next piece: the share's rule exactly, the queue read from a real socket, and the adapter
telling a core a ``notify`` send was written only once it has settled."""

from __future__ import annotations

import asyncio
import socket

from mlxcel.base.effects import Effect, Send
from mlxcel.base.messages import Ack
from mlxcel.net import send_queue
from mlxcel.net.send_queue import DELAY, FLOOR, QueueState, share
from mlxcel.reactor.adapter import CoreAdapter
from mlxcel.reactor.bus import Node
from tests.conftest import until_true
from tests.reactor.test_adapter_exact import Core, Endpoint


def test_the_share_is_the_floor_or_what_the_link_delivers_in_a_round_trip_or_two() -> None:
    assert share(QueueState(0, 0, 0.0)) == FLOOR  # nothing known: the floor
    assert share(QueueState(0, 125_000, 0.0001)) == FLOOR  # 1 Mbit/s: 2.5 KB of 20 ms
    assert share(QueueState(0, 100_000_000, 0.0001)) == int(100_000_000 * DELAY)  # a LAN
    assert share(QueueState(0, 12_500_000, 0.05)) == 1_250_000  # 100 Mbit/s, 50 ms away


async def test_the_queue_is_read_from_the_socket_and_settles_as_the_peer_reads(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    # On loopback the link's share is many megabytes: hold the queue to the floor here.
    monkeypatch.setattr(send_queue, "share", lambda state: FLOOR)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    out = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    out.setblocking(False)
    try:
        written = 0
        try:
            while True:  # the peer reads nothing: its buffer fills, then this side's
                written += out.send(bytes(1 << 16))
        except BlockingIOError:
            pass
        state = send_queue.read(out)
        assert state is not None and FLOOR < state.queued <= written
        assert state.delivery_rate > 0 and state.min_rtt > 0
        waiting = asyncio.ensure_future(send_queue.settled(out, lambda: False))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        peer.setblocking(False)
        got = 0
        while got < written:
            try:
                got += len(peer.recv(1 << 20))
            except BlockingIOError:
                await asyncio.sleep(0.001)
        await asyncio.wait_for(waiting, 5)
        out.send(bytes(1 << 16))
        # A closed connection never holds anyone, whatever its queue.
        await asyncio.wait_for(send_queue.settled(out, lambda: True), 1)
    finally:
        for s in (out, peer, srv):
            s.close()


class Notified(Core):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[Send] = []

    def sent(self, send: Send, now: float) -> list[Effect]:
        self.written.append(send)
        return []


class Settling(Endpoint):
    def __init__(self) -> None:
        super().__init__()
        self.drained = asyncio.Event()
        self.asked: list[str] = []

    async def settled(self, dest: str) -> None:
        self.asked.append(dest)
        await self.drained.wait()


async def test_a_core_hears_of_a_written_part_only_once_it_has_left_the_host() -> None:
    async with Node("n") as node:
        ep, core = Settling(), Notified()
        adapter = CoreAdapter(node, ep, core, "n", 1.0)  # type: ignore[arg-type]
        adapter.start()
        part = Send("10.0.0.2:7000", Ack("r", 1), notify=True)
        adapter.feed([part, Send("10.0.0.2:7000", Ack("r", 2))])
        await until_true(lambda: ep.asked == ["10.0.0.2:7000"])
        await asyncio.sleep(0.02)
        assert core.written == []  # written to the socket, still in the kernel's queue
        ep.drained.set()
        await until_true(lambda: core.written == [part])
