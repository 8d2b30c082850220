"""Liveness on real loopback sockets: keepalives both ways, the read deadline, PING.

A peer that goes silent without closing (a partition, a stopped process) must be noticed by
both ends within ``peer_timeout``; an idle but live peer must never be; a ping is a real round
trip that a silent peer fails. Silence is made here by muting one end's writes (what a
stopped process looks like from the other end: an open socket that says nothing).
"""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.base.errors import ConnectionClosed, PeerSilent
from mlxcel.net.connection import SecureConnection
from mlxcel.net.listener import ClusterListener, Limits
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Node
from mlxcel.wire.frames import KIND_KEEPALIVE, KIND_PING
from mlxcel.wire.handshake import Identity
from tests.conftest import until_true

SECRET = ClusterSecret(b"liveness-tests-cluster-secret-001", "test")
SERVER, CLIENT = "127.0.0.3", "127.0.0.5"
PEER_TIMEOUT = 0.6


async def pair(
    node: Node, peer_timeout: float | None = PEER_TIMEOUT
) -> tuple[ClusterListener, ConnectionPool, SecureConnection, SecureConnection]:
    """A listener and a pool on loopback, connected: (listener, pool, dialer's conn, its peer)."""
    lst = ClusterListener(node, SECRET, SERVER, 0, limits=Limits(peer_timeout=peer_timeout))
    port = await lst.start()
    pool = ConnectionPool(
        node,
        SECRET,
        Identity(CLIENT, 9000, "client"),
        bind_ip=CLIENT,
        backoff=Backoff(attempts=1),
        peer_timeout=peer_timeout,
    )
    conn = await pool.get(SERVER, port)
    await until_true(lambda: lst.connection_for(f"{CLIENT}:9000") is not None)
    accepted = lst.connection_for(f"{CLIENT}:9000")
    assert accepted is not None
    return lst, pool, conn, accepted


def mute(conn: SecureConnection) -> None:
    """This end stops writing anything (its keepalives and answers included)."""
    conn.send_control = lambda kind: False  # type: ignore[method-assign]


async def test_an_idle_live_pair_keeps_its_connection_and_answers_pings() -> None:
    async with Node("n") as node:
        lst, pool, conn, accepted = await pair(node)
        await asyncio.sleep(PEER_TIMEOUT * 4)  # nothing to say, for four peer timeouts
        assert not conn.closed and not accepted.closed
        assert conn.frames_out >= 3 and accepted.frames_out >= 3  # keepalives, both ways
        rtt = await conn.ping(asyncio.get_running_loop().time() + 1.0)
        assert rtt >= 0  # answered inside the ping's deadline, or ping() would have raised
        await lst.close()


async def test_a_silent_listener_side_is_dropped_by_the_dialer_and_reported_lost() -> None:
    async with Node("n") as node:
        lst, pool, conn, accepted = await pair(node)
        lost: list[str] = []
        pool.on_lost.append(lost.append)
        loop = asyncio.get_running_loop()
        mute(accepted)
        t0 = loop.time()
        await until_true(lambda: conn.closed, timeout=5.0)
        # Not before a keepalive interval of silence (the loop's timers never fire early);
        # until_true bounds the other side.
        assert loop.time() - t0 >= PEER_TIMEOUT / 3
        await until_true(lambda: lost == [f"{SERVER}:{lst.port}"])
        await lst.close()


async def test_a_silent_dialer_is_dropped_by_the_listener() -> None:
    async with Node("n") as node:
        lst, pool, conn, accepted = await pair(node)
        lost: list[str] = []
        lst.on_lost.append(lost.append)
        mute(conn)
        await until_true(lambda: accepted.closed, timeout=5.0)
        await until_true(lambda: lost == [f"{CLIENT}:9000"])
        await lst.close()


async def test_a_ping_to_a_silent_peer_fails_by_its_deadline_and_closes_the_connection() -> None:
    async with Node("n") as node:
        # No heartbeat (peer_timeout None): only the ping can tell.
        lst, pool, conn, accepted = await pair(node, peer_timeout=None)
        loop = asyncio.get_running_loop()
        assert await conn.ping(loop.time() + 1.0) >= 0
        mute(accepted)
        t0 = loop.time()
        with pytest.raises(PeerSilent, match=r"^no answer to a ping within 0\.[34]s$"):
            await conn.ping(t0 + 0.3)
        assert loop.time() - t0 >= 0.3 and conn.closed  # at its deadline, never before
        with pytest.raises(ConnectionClosed):
            await conn.ping(loop.time() + 1.0)
        await lst.close()


async def test_control_frames_wait_for_a_message_being_written_and_never_split_it() -> None:
    """A keepalive or ping while a multi-record message is being written would land between
    its records; it is skipped then (the records flowing already say this end is alive)."""
    async with Node("n") as node:
        lst, pool, conn, accepted = await pair(node)
        async with conn._send_lock:
            assert conn.send_control(KIND_KEEPALIVE) is False
            assert conn.send_control(KIND_PING) is False
        assert conn.send_control(KIND_KEEPALIVE) is True
        conn.close()
        assert conn.send_control(KIND_KEEPALIVE) is False
        await lst.close()
