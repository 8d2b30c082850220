"""The discovery receiver's bounds, on a real UDP socket on loopback: at most ``maxsize``
datagrams wait, none larger than MAX_DATAGRAM is kept, and every drop is counted."""

from __future__ import annotations

import asyncio

from mlxcel.net.udp import MAX_DATAGRAM, BeaconReceiver, BeaconSender
from tests.conftest import free_udp_port


async def test_the_receiver_keeps_at_most_maxsize_datagrams_and_none_too_large() -> None:
    port = free_udp_port()
    rx = BeaconReceiver("127.0.0.1", port, maxsize=4)
    await rx.start()
    tx = BeaconSender("127.0.0.1", port, "127.0.0.1")
    try:
        tx.send(bytes(MAX_DATAGRAM + 1))  # too large: dropped unread
        tx.send(bytes(MAX_DATAGRAM))  # the largest kept
        for i in range(9):
            tx.send(bytes([i]))
        for _ in range(500):  # loopback delivers them all; wait for the last to be counted
            if rx.queue.qsize() + rx.dropped == 11:
                break
            await asyncio.sleep(0.01)
        assert rx.queue.qsize() == 4 and rx.dropped == 7
        got = [rx.queue.get_nowait() for _ in range(4)]
        assert [len(d) for d, _ in got] == [MAX_DATAGRAM, 1, 1, 1]
        assert {src for _, src in got} == {"127.0.0.1"}
    finally:
        tx.close()
        rx.close()
