"""Members first at admission, over real sockets on 127.0.0.x: outsiders' unfinished
handshakes cannot keep a member's dial out, and a dial to a busy peer keeps trying within its
own deadline. (The same flood across network namespaces: tests/net/test_floods_netns.py.)"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.errors import ConnectFailed
from mlxcel.base.messages import Ack
from mlxcel.net.listener import ClusterListener, Limits, member_ips
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.reactor.bus import Node
from mlxcel.wire.handshake import Failure
from tests.net.test_transport import SECRET, SERVER_IP, client_pool, until_true

FLOOD = [f"127.0.1.{i}" for i in range(10, 20)]  # ten outsider addresses


@asynccontextmanager
async def listening(limits: Limits, members: list[str]) -> AsyncIterator[ClusterListener]:
    async with Node("server") as node:
        lines: list[str] = []
        limiter = WarningLimiter(
            asyncio.get_running_loop().time, emit=lambda _l, m: lines.append(m)
        )
        lst = ClusterListener(
            node, SECRET, SERVER_IP, 0, limits=limits, limiter=limiter, members=members
        )
        lst.lines = lines  # type: ignore[attr-defined]
        await lst.start()
        yield lst


def hold(port: int, sources: list[str], each: int) -> list[socket.socket]:
    """Silent connections: each holds a pending slot until the handshake timeout."""
    held = []
    for src in sources:
        for _ in range(each):
            held.append(
                socket.create_connection((SERVER_IP, port), source_address=(src, 0), timeout=2)
            )
    return held


def test_member_addresses_name_their_sources() -> None:
    got = member_ips(["10.0.0.1:19000", "[fd00::1]:5", "fd00:0:0:1::7", "0.0.0.0:1", "x:1"])
    assert got == {"10.0.0.1", "fd00::1", "fd00:0:0:1::7"}  # exact IPs, not their /64s


async def test_an_outsider_flood_fills_its_pool_and_members_still_get_in() -> None:
    limits = Limits(max_pending=16, max_pending_per_source=4, handshake_timeout=5.0)
    async with listening(limits, ["127.0.0.2:9000"]) as lst, Node("client") as client:
        held = hold(lst.port, FLOOD, 4)  # 40 sockets at a pool of 16: full, the rest closed
        await until_true(lambda: lst.refused_at_accept + lst.evicted == 24)
        assert lst.pending == 16 and lst.member_pending == 0
        # A source that held nothing took the oldest slot of the largest holder: every flooding
        # address holds some, none more than its share allows.
        assert set(lst.pending_by_source) == set(FLOOD) and lst.evicted >= 6
        assert any("pending-handshake pool full" in m for m in lst.lines)
        # The configured member dials at once, every time.
        for _ in range(3):
            conn = await client_pool(client, "127.0.0.2").connect(SERVER_IP, lst.port)
            await conn.send(Ack("member", 1))
            conn.close()
        # A source nobody configured, holding nothing, takes an outsider's oldest slot ...
        newcomer = client_pool(client, "127.0.0.5")
        evicted = lst.evicted
        conn = await newcomer.connect(SERVER_IP, lst.port)
        assert lst.evicted == evicted + 1 and lst.pending <= 16
        conn.close()
        # ... and, having authenticated, is a member from then on (its own pool).
        evicted = lst.evicted
        conn = await newcomer.connect(SERVER_IP, lst.port)
        assert lst.evicted == evicted
        conn.close()
        for s in held:
            s.close()
        await until_true(lambda: lst.pending == 0)
        assert lst.member_pending == 0 and not lst.pending_by_source and not lst.slot_sources


async def test_outsiders_cannot_take_the_members_pool_and_every_slot_comes_back() -> None:
    limits = Limits(max_pending=4, max_pending_per_source=2, handshake_timeout=5.0)
    members = [f"127.0.0.{i}:1" for i in (2, 6, 7)]
    async with listening(limits, members) as lst, Node("client") as client:
        outsiders = hold(lst.port, ["127.0.1.10", "127.0.1.11"], 2)
        await until_true(lambda: lst.pending == 4)
        idle_members = hold(lst.port, ["127.0.0.6", "127.0.0.7"], 2)
        await until_true(lambda: lst.member_pending == 4)
        assert lst.pending == 8 and lst.refused_at_accept == 0  # two pools of 4
        # The members' pool is full: a member tries everyone else's, and there, holding
        # nothing, takes the largest holder's oldest slot.
        extra = hold(lst.port, ["127.0.0.2"], 1)
        await until_true(lambda: lst.evicted == 1)
        assert lst.pending == 8 and lst.member_pending == 4 and lst.refused_at_accept == 0
        # A second one from that member now holds a slot there: refused, and said why.
        extra += hold(lst.port, ["127.0.0.2"], 1)
        await until_true(lambda: lst.refused_at_accept == 1)
        assert any("pending-handshake pool full" in m for m in lst.lines)
        for s in idle_members + extra:
            s.close()
        await until_true(lambda: lst.member_pending == 0)
        conn = await client_pool(client, "127.0.0.2").connect(SERVER_IP, lst.port)
        conn.close()
        for s in outsiders:
            s.close()
        # Every slot is given back, whichever way its socket ended (evicted, closed, served).
        await until_true(lambda: lst.pending == 0)
        assert lst.member_pending == 0 and not lst.pending_by_source and not lst.slot_sources


async def test_a_dial_to_a_busy_peer_retries_until_its_deadline_not_five_times() -> None:
    """The dialer's own source holds its whole per-source budget for 3.5 s (a handshake
    timeout): the backoff's five attempts are spent after 3 s, the deadline is later."""
    limits = Limits(max_pending_per_source=2, handshake_timeout=3.5)
    async with listening(limits, []) as lst, Node("client") as client:
        pool = client_pool(client, "127.0.0.2", attempts=5, base_delay=0.2)
        held = hold(lst.port, ["127.0.0.2"], 2)
        await until_true(lambda: lst.pending == 2)
        # Without a deadline: the backoff's attempts, then a typed failure naming the cause.
        with pytest.raises(ConnectFailed) as exc:
            await pool.connect(SERVER_IP, lst.port)
        assert exc.value.failure is Failure.BUSY and "gave up after 5 attempts" in str(exc.value)
        assert "pending-handshake pool is full" in str(exc.value)
        # With one: it keeps trying, and gets in once the stalled handshakes time out.
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn = await pool.connect(SERVER_IP, lst.port, deadline_in(10.0))
        assert loop.time() - started < 9.0
        conn.close()
        # A deadline that comes first ends it, saying what it last saw.
        held = hold(lst.port, ["127.0.0.2"], 2)
        await until_true(lambda: lst.pending == 2)
        with pytest.raises(ConnectFailed) as exc:
            await pool.connect(SERVER_IP, lst.port, deadline_in(1.0))
        assert "pending-handshake pool is full" in str(exc.value)
        # A caller queued behind a long dial to the same peer keeps its own deadline.
        long = asyncio.ensure_future(pool.get(SERVER_IP, lst.port, deadline_in(10.0)))
        await asyncio.sleep(0.1)
        started = loop.time()
        with pytest.raises(ConnectFailed) as exc:
            await pool.get(SERVER_IP, lst.port, deadline_in(0.5))
        assert loop.time() - started < 1.5 and "another dial to it" in str(exc.value)
        (await long).close()  # the long one still gets in once the stalled ones time out
        for s in held:
            s.close()
