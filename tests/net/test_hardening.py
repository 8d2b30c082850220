"""Cluster hardening over real sockets: replayed handshakes, idle peers, memory floods."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from mlxcel.base.errors import SendFailed
from mlxcel.base.messages import CancelRequest
from mlxcel.net.listener import ClusterListener, Limits
from mlxcel.net.network import TcpEndpoint
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Node
from mlxcel.wire.frames import KIND_END, KIND_PART
from mlxcel.wire.handshake import LEN, PREAMBLE_LEN, Failure, Identity
from tests.conftest import until_true
from tests.net.test_transport import raw_client_handshake
from tests.wiretap import WireTap

SECRET = ClusterSecret(b"hardening-tests-cluster-secret-01", "test")
SERVER = "127.0.0.3"
ROOT = Path(__file__).resolve().parents[2]


async def listening(node: Node, limits: Limits | None = None) -> tuple[ClusterListener, int]:
    lst = ClusterListener(node, SECRET, SERVER, 0, limits=limits)
    return lst, await lst.start()


def pool(node: Node, ip: str, advertised: str | None = None) -> ConnectionPool:
    return ConnectionPool(
        node,
        SECRET,
        Identity(advertised or ip, 9000, f"node-{ip}"),
        bind_ip=ip,
        backoff=Backoff(attempts=1),
    )


async def record_message_1(node: Node, port: int, ip: str, advertised: str) -> bytes:
    """A genuine member's first handshake bytes (preamble + message 1), captured on the wire."""
    tap = WireTap("127.0.0.4", (SERVER, port), bind_ip=ip)
    tap_port = await tap.start()
    conn = await pool(node, ip, advertised).connect("127.0.0.4", tap_port)
    n = LEN.unpack_from(tap.up, PREAMBLE_LEN)[0]
    recorded = bytes(tap.up[: PREAMBLE_LEN + LEN.size + n])
    conn.close()
    tap.close()
    return recorded


async def replay(data: bytes, port: int, source: str) -> bytes:
    """Send recorded bytes from ``source``; return whatever the server answers before closing."""
    reader, writer = await asyncio.open_connection(SERVER, port, local_addr=(source, 0))
    writer.write(data)
    await writer.drain()
    try:
        got = await asyncio.wait_for(reader.read(4096), 10)
    except (ConnectionError, TimeoutError):
        got = b""
    writer.close()
    return got


async def test_replayed_message_1_takes_no_slot_and_members_still_connect() -> None:
    """The outside report: 520 replays of one recorded message 1 held all 512 slots."""
    limits = Limits(max_connections=4, max_pending=256, max_pending_per_source=256)
    async with Node("server") as node, Node("members") as members:
        lst, port = await listening(node, limits=limits)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(lst.connections))
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        recorded = await record_message_1(members, port, "127.0.0.2", "127.0.0.2")
        wildcard = await record_message_1(members, port, "127.0.0.6", "0.0.0.0")
        answers = await asyncio.gather(
            *(replay(recorded, port, "127.0.0.2") for _ in range(60)),
            *(replay(wildcard, port, "127.0.0.9") for _ in range(60)),  # any IP, 0.0.0.0 claim
        )
        assert all(a == b"" for a in answers)  # no message 2, nothing to work with
        assert lst.failures[Failure.REPLAYED] == 120
        assert lst.replay.replays == 120
        await until_true(lambda: lst.pending == 0 and not lst.connections)
        assert peak <= 1  # only ever the genuine recordings' own short-lived connections
        # Every slot is still there for members.
        conns = [await pool(members, f"127.0.0.{10 + i}").connect(SERVER, port) for i in range(4)]
        await until_true(lambda: len(lst.connections) == 4)
        for c in conns:
            c.close()
        watcher.cancel()


async def test_an_intercepted_message_1_never_counts_as_authenticated() -> None:
    """Delivered once by someone without the ephemeral key: message 2 goes out, but no
    CONFIRM can follow, so the connection only ever holds a pending slot, then closes."""
    limits = Limits(max_connections=1, handshake_timeout=1.0)
    async with Node("server") as node, Node("member") as member:
        lst, port = await listening(node, limits=limits)
        intercepted = raw_client_handshake(SECRET).data_to_send()
        reader, writer = await asyncio.open_connection(SERVER, port, local_addr=("127.0.0.2", 0))
        writer.write(intercepted)
        assert await reader.read(4096)  # message 2 comes back ...
        await until_true(lambda: lst.confirming == 1)
        assert not lst.connections  # ... but the connection is not authenticated
        assert await asyncio.wait_for(reader.read(4096), 5) == b""  # closed at the deadline
        writer.close()
        await until_true(lambda: lst.failures[Failure.UNCONFIRMED] == 1)
        assert lst.confirming == 0 and lst.pending == 0 and not lst.connections
        conn = await pool(member, "127.0.0.5").connect(SERVER, port)
        await until_true(lambda: len(lst.connections) == 1)
        conn.close()


async def test_an_old_recording_gets_the_stale_verdict() -> None:
    limits = Limits(max_clock_skew=0.5)
    async with Node("server") as node, Node("member") as member:
        lst, port = await listening(node, limits=limits)
        recorded = await record_message_1(member, port, "127.0.0.2", "127.0.0.2")
        await asyncio.sleep(1.0)  # the recording leaves the window
        answer = await replay(recorded, port, "127.0.0.2")
        assert answer  # an authenticated "stale" verdict, which only the member could read
        await until_true(lambda: lst.failures[Failure.CLOCK_SKEW] == 1)
        assert lst.failures[Failure.REPLAYED] == 0 and not lst.connections


async def test_a_member_with_a_wrong_clock_is_told_so() -> None:
    async with Node("server") as node, Node("member") as member:
        lst, port = await listening(node)
        skewed = pool(member, "127.0.0.2")
        skewed.wall_clock = lambda: time.time() - 3600
        try:
            await skewed.connect(SERVER, port)
        except Exception as exc:  # ConnectFailed
            assert getattr(exc, "failure", None) is Failure.CLOCK_SKEW
            assert "clocks differ" in str(exc)
        else:
            raise AssertionError("a client an hour behind was accepted")


async def test_a_silent_authenticated_peer_is_closed_and_the_member_redials() -> None:
    got: list[str] = []
    async with Node("server") as node, Node("member") as member:
        from mlxcel.base.messages import Ack
        from mlxcel.reactor.bus import Envelope

        async def on_ack(env: Envelope[Ack]) -> None:
            got.append(env.msg.request_id)

        node.bus.subscribe(Ack, on_ack)
        lst, port = await listening(node, limits=Limits(idle_timeout=0.5))
        p = pool(member, "127.0.0.2")
        first = await p.get(SERVER, port)
        await until_true(lambda: len(lst.connections) == 1)
        await until_true(lambda: not lst.connections, timeout=5)  # idle: closed by the listener
        await until_true(lambda: first.closed)
        again = await p.get(SERVER, port)
        assert again is not first
        await again.send(Ack("after-idle", 1))
        await until_true(lambda: got == ["after-idle"])


FLOOD_LISTENER = """
import asyncio, sys
from mlxcel.reactor.bus import Node
from mlxcel.net.connection import MemoryBudget
from mlxcel.net.listener import ClusterListener, Limits
from mlxcel.net.secret import ClusterSecret

async def main():
    budget = MemoryBudget(int(sys.argv[2]))
    async with Node("flooded") as node:
        lst = ClusterListener(
            node, ClusterSecret(sys.argv[1].encode(), "test"), "127.0.0.3", 0,
            limits=Limits(max_message=int(sys.argv[3])), budget=budget,
        )
        print(await lst.start(), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print(budget.peak, budget.refusals, budget.used, flush=True)

asyncio.run(main())
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_a_flood_of_large_messages_stays_within_the_node_budget() -> None:
    """8 members each start a 40 MiB message and never finish it: the node holds at most its
    64 MiB budget (32 MiB per connection) before closing the connections that would pass it."""
    budget, per_conn = 64 << 20, 32 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD_LISTENER, SECRET.value.decode(), str(budget), str(per_conn)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(await asyncio.to_thread(proc.stdout.readline))
        before = rss_mib(proc.pid)
        peak = before
        record = os.urandom(256 << 10)
        async with Node("flood") as node:
            conns = [await pool(node, f"127.0.0.{20 + i}").connect(SERVER, port) for i in range(8)]

            async def flood(conn) -> None:  # type: ignore[no-untyped-def]
                try:
                    for _ in range(160):  # 40 MiB of PART records, no END
                        conn.writer.write(conn.protection.seal(KIND_PART, record))
                        await conn.writer.drain()
                except (ConnectionError, OSError):
                    pass

            async def sample() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, rss_mib(proc.pid))
                    await asyncio.sleep(0.01)

            sampler = asyncio.create_task(sample())
            await asyncio.gather(*(flood(c) for c in conns))
            await asyncio.sleep(0.5)
            sampler.cancel()
            for c in conns:
                c.writer.write(c.protection.seal(KIND_END, b""))
                c.close()
        await asyncio.sleep(0.5)
        after = rss_mib(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        held_peak, refusals, used = map(
            int, (await asyncio.to_thread(proc.stdout.readline)).split()
        )
        print(
            f"\nRSS before {before:.0f} MiB, peak {peak:.0f} MiB, after {after:.0f} MiB; "
            f"reassembly peak {held_peak >> 20} MiB of a {budget >> 20} MiB budget, "
            f"{refusals} connection(s) refused"
        )
        assert held_peak <= budget and refusals >= 1 and used == 0
        # 320 MiB were sent; the node grew by about its budget, not by the flood.
        assert peak - before < (budget >> 20) + 48
    finally:
        proc.kill()
        proc.wait()


async def test_a_full_handler_queue_drops_and_counts_but_keeps_the_connection() -> None:
    from mlxcel.base.messages import Ack
    from mlxcel.reactor.bus import Envelope

    release = asyncio.Event()
    got: list[int] = []
    async with Node("server") as node, Node("member") as member:

        async def slow(env: Envelope[Ack]) -> None:
            await release.wait()
            got.append(env.msg.nonce)

        node.bus.subscribe(Ack, slow, maxsize=1)
        lst, port = await listening(node, limits=Limits(bus_deadline=0.2))
        conn = await pool(member, "127.0.0.2").get(SERVER, port)
        for i in range(5):
            await conn.send(Ack("r", i))
        await until_true(lambda: len(lst.connections) == 1)
        (inbound,) = list(lst.connections)
        await until_true(lambda: inbound.bus_drops >= 1, timeout=10)
        assert not inbound.closed  # a declared drop, not a teardown
        release.set()
        await conn.send(Ack("r", 99))
        await until_true(lambda: 99 in got)


async def test_pool_entries_do_not_outlive_their_connections() -> None:
    async with Node("server") as node, Node("member") as member:
        lst, port = await listening(node)
        p = pool(member, "127.0.0.2")
        for closed_port in (1, 2, 3):  # destinations that refuse: nothing is kept for them
            try:
                await p.get(SERVER, closed_port)
            except Exception:
                pass
        conn = await p.get(SERVER, port)
        assert p.dialing <= {(SERVER, port)}
        await until_true(lambda: len(lst.connections) == 1)
        for c in list(lst.connections):
            c.close()
        await until_true(lambda: conn.closed)
        await until_true(lambda: not p._locks and not p._conns)


async def test_a_destination_that_is_no_address_fails_the_send_not_the_sender() -> None:
    """A malformed destination is a failed send (never sent), on the immediate path and the
    queued one alike: a ValueError escaping would end the role's feed of effects."""
    async with Node("member") as member:
        ep = TcpEndpoint("node-127.0.0.2", pool(member, "127.0.0.2"))
        msg = CancelRequest("r", "test")
        for dest in ("no-port", "127.0.0.3:http", ""):
            try:
                ep.send_now(dest, msg)
            except SendFailed as exc:
                assert exc.unsent and dest in str(exc)
            else:
                raise AssertionError(f"send_now to {dest!r} did not fail")
            try:
                await ep.send(dest, msg, asyncio.get_running_loop().time() + 1)
            except SendFailed as exc:
                assert exc.unsent
            else:
                raise AssertionError(f"send to {dest!r} did not fail")
            ep.reset(dest)  # nothing to close, and no error


async def test_keepalives_keep_a_quiet_live_member_connected() -> None:
    async with Node("server") as node, Node("member") as member:
        # Keepalives ten times as often as the idle timeout: only a loop stalled for most of
        # a second could make this fail, not a busy machine.
        lst, port = await listening(node, limits=Limits(idle_timeout=1.0))
        p = pool(member, "127.0.0.2")
        p.keepalive = 0.1
        conn = await p.get(SERVER, port)
        await until_true(lambda: len(lst.connections) == 1)
        (inbound,) = list(lst.connections)
        # Two and a half idle timeouts without a message, counted in keepalives received.
        await until_true(lambda: inbound.frames_in >= 25 or conn.closed, timeout=60)
        assert not conn.closed and len(lst.connections) == 1
        assert inbound.unknown_kinds == 0


async def test_a_half_sent_message_does_not_hold_the_budget() -> None:
    async with Node("server") as node, Node("member") as member:
        lst, port = await listening(node, limits=Limits(frame_timeout=0.3))
        conn = await pool(member, "127.0.0.2").connect(SERVER, port)
        conn.writer.write(conn.protection.seal(KIND_PART, os.urandom(256 << 10)))
        await until_true(lambda: lst.budget.used == 256 << 10)
        # ...and nothing more: after frame_timeout the connection goes, and its share with it.
        await until_true(lambda: not lst.connections and lst.budget.used == 0, timeout=5)
        conn.close()


def test_the_replay_guard_outlives_the_window_by_a_handshake() -> None:
    """A connection accepted just inside the window reads its clock at accept; a later one,
    outside, must not evict the entry the first one still needs (found by an attack run)."""
    from mlxcel.wire.handshake import ReplayGuard

    g = ReplayGuard(max_skew=3.0, hold=5.0)
    key, stamp = b"e" * 32, 1000.0
    assert g.check(key, stamp, stamp) is None
    assert g.check(key, stamp, stamp + 3.5) is Failure.CLOCK_SKEW  # B, outside the window
    assert g.check(key, stamp, stamp + 2.9) is Failure.REPLAYED  # A, accepted inside it


async def test_a_full_pending_pool_says_busy_and_members_retry() -> None:
    """Once the pool-full close looked like a secret mismatch: final, and misdiagnosed."""
    limits = Limits(max_pending=1, max_pending_per_source=1, handshake_timeout=1.0)
    async with Node("server") as node, Node("member") as member:
        lst, port = await listening(node, limits=limits)
        squatter = await asyncio.open_connection(SERVER, port, local_addr=("127.0.0.30", 0))
        await until_true(lambda: lst.pending == 1)
        once = pool(member, "127.0.0.2")
        try:
            await once.connect(SERVER, port)
        except Exception as exc:
            assert getattr(exc, "failure", None) is Failure.BUSY, exc
            assert "pending-handshake pool is full" in str(exc)
        else:
            raise AssertionError("connected through a full pending pool")
        patient = ConnectionPool(
            member,
            SECRET,
            Identity("127.0.0.5", 9000, "patient"),
            bind_ip="127.0.0.5",
            backoff=Backoff(attempts=6, base_delay=0.2),
        )
        conn = await patient.connect(SERVER, port)  # the squatter times out; the retry gets in
        assert not conn.closed
        squatter[1].close()


async def test_large_messages_are_decoded_off_the_reactor(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    from mlxcel.base.messages import RunEntry, SamplingParams
    from mlxcel.net import connection
    from mlxcel.reactor.bus import Envelope

    threads: list[int] = []
    real = connection.decode

    def spy(data):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident())
        return real(data)

    monkeypatch.setattr(connection, "decode", spy)
    got: list[int] = []
    async with Node("server") as node, Node("member") as member:

        async def on_entry(env: Envelope[RunEntry]) -> None:
            got.append(len(env.msg.token_ids))

        node.bus.subscribe(RunEntry, on_entry)
        lst, port = await listening(node)
        conn = await pool(member, "127.0.0.2").get(SERVER, port)
        await conn.send(RunEntry("small", 0, (1, 2), 0, SamplingParams(), 1))
        await conn.send(RunEntry("big", 0, tuple(range(50_000)), 0, SamplingParams(), 2))
        await until_true(lambda: got == [2, 50_000])
    reactor = threading.get_ident()
    assert threads[0] == reactor and threads[1] != reactor
