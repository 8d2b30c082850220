"""The cluster transport over real sockets on 127.0.0.x, so the source-IP rule is real."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.errors import ConnectFailed, ConnectionClosed, HandshakeError, InterfaceError
from mlxcel.base.messages import Ack, Activation, RunEntry, SamplingParams, Tensor
from mlxcel.net.handshake_io import drive
from mlxcel.net.interfaces import interface_ipv4, probe_rdma
from mlxcel.net.listener import ClusterListener, Limits
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Envelope, Node
from mlxcel.wire.codec import encode
from mlxcel.wire.frames import HEADER_LEN, KIND_MESSAGE
from mlxcel.wire.handshake import Channel, ClientHandshake, Failure, Identity
from tests.conftest import until_true

SECRET = ClusterSecret(b"the-cluster-secret-for-tests-0001", "test")
OTHER = ClusterSecret(b"a-different-cluster-secret-000002", "test")
SERVER_IP = "127.0.0.3"


class Server:
    def __init__(self, node: Node, listener: ClusterListener) -> None:
        self.node = node
        self.listener = listener
        self.received: list[Envelope[Ack]] = []
        self.lines: list[tuple[str, str]] = []


@asynccontextmanager
async def server(
    limits: Limits | None = None, secret: ClusterSecret = SECRET
) -> AsyncIterator[Server]:
    async with Node("server") as node:
        lines: list[tuple[str, str]] = []
        limiter = WarningLimiter(
            asyncio.get_running_loop().time, emit=lambda lvl, msg: lines.append((lvl, msg))
        )
        lst = ClusterListener(
            node, secret, SERVER_IP, 0, node_id="coordinator", limits=limits, limiter=limiter
        )
        srv = Server(node, lst)
        srv.lines = lines

        async def on_ack(env: Envelope[Ack]) -> None:
            srv.received.append(env)

        node.bus.subscribe(Ack, on_ack)
        await lst.start()
        yield srv


def raw_client_handshake(secret: ClusterSecret = SECRET, **kw: object) -> ClientHandshake:
    """A client handshake from 127.0.0.2:9000, to drive by hand over a socket."""
    loop = asyncio.get_running_loop()
    return ClientHandshake(
        secret.value,
        Identity("127.0.0.2", 9000),
        Channel.TRANSPORT,
        loop.time(),
        os.urandom,
        wall=time.time(),
        **kw,  # type: ignore[arg-type]
    )


def client_pool(
    node: Node,
    ip: str,
    *,
    secret: ClusterSecret = SECRET,
    port: int = 9000,
    advertised: str | None = None,
    attempts: int = 1,
    base_delay: float = 0.05,
) -> ConnectionPool:
    return ConnectionPool(
        node,
        secret,
        Identity(advertised or ip, port, f"node-{ip}"),
        bind_ip=ip,
        backoff=Backoff(attempts=attempts, base_delay=base_delay),
    )


async def test_messages_reach_the_bus_with_the_bound_identity() -> None:
    async with server() as srv, Node("client") as client:
        conn = await client_pool(client, "127.0.0.2").get(SERVER_IP, srv.listener.port)
        assert conn.peer.node_id == "coordinator"
        await conn.send(Ack("r1", 1))
        # A large message crosses as several records and arrives whole.
        big = Tensor("uint8", (3 << 20,), os.urandom(3 << 20))
        await conn.send(Activation("r1", 0, big, 0, SamplingParams(), 2))
        await until_true(lambda: len(srv.received) == 1)
        assert srv.received[0].msg == Ack("r1", 1)
        assert srv.received[0].source == "127.0.0.2:9000"
        assert conn.frames_out >= 4  # 1 + several records


async def test_wrong_secret_is_refused_in_both_directions() -> None:
    async with server() as srv, Node("client") as client:
        with pytest.raises(ConnectFailed) as info:
            await client_pool(client, "127.0.0.2", secret=OTHER, attempts=3).connect(
                SERVER_IP, srv.listener.port
            )
        assert info.value.failure is Failure.SECRET_MISMATCH and "secret mismatch" in str(
            info.value
        )
        await until_true(lambda: srv.listener.failures[Failure.SECRET_MISMATCH] == 1)
        assert any("probable secret mismatch" in m for _, m in srv.lines)
    async with server(secret=OTHER) as srv, Node("client") as client:
        pool = client_pool(client, "127.0.0.2", attempts=3)
        with pytest.raises(ConnectFailed) as info:
            await pool.connect(SERVER_IP, srv.listener.port)
        assert info.value.failure is Failure.SECRET_MISMATCH
        assert pool.attempts_made == 1  # final at once, never retried
    assert srv.received == []


async def test_identity_not_owned() -> None:
    async with server() as srv, Node("client") as client:
        pool = client_pool(client, "127.0.0.2", advertised="127.0.0.9", attempts=3)
        with pytest.raises(ConnectFailed) as info:
            await pool.connect(SERVER_IP, srv.listener.port)
        assert info.value.failure is Failure.IDENTITY_NOT_OWNED and "127.0.0.9:9000" in str(
            info.value
        )
        assert pool.attempts_made == 1
        await until_true(lambda: any("does not own" in m for _, m in srv.lines))
        # An unspecified advertised IP is bound to the real source.
        conn = await client_pool(client, "127.0.0.4", advertised="0.0.0.0").get(
            SERVER_IP, srv.listener.port
        )
        await conn.send(Ack("r", 3))
        await until_true(lambda: len(srv.received) == 1)
        assert srv.received[0].source == "127.0.0.4:9000"


@pytest.mark.parametrize(
    ("kw", "failure"),
    [({"version": 7}, Failure.VERSION_MISMATCH), ({"suite": 3}, Failure.SUITE_MISMATCH)],
)
async def test_version_and_suite_mismatch_over_sockets(kw: dict, failure: Failure) -> None:
    async with server() as srv:
        reader, writer = await asyncio.open_connection(
            SERVER_IP, srv.listener.port, local_addr=("127.0.0.2", 0)
        )
        hs = raw_client_handshake(**kw)
        with pytest.raises(HandshakeError) as info:
            await drive(hs, reader, writer)
        writer.close()
        assert info.value.failure is failure
        assert "the server v2" in str(info.value) or "the server suite 1" in str(info.value)
        await until_true(lambda: srv.listener.failures[failure] == 1)


async def test_at_capacity_then_success_once_a_slot_frees() -> None:
    async with server(Limits(max_connections=1)) as srv, Node("client") as client:
        first = await client_pool(client, "127.0.0.2").get(SERVER_IP, srv.listener.port)
        await until_true(lambda: len(srv.listener.connections) == 1)
        with pytest.raises(ConnectFailed) as info:
            await client_pool(client, "127.0.0.5", attempts=2).connect(SERVER_IP, srv.listener.port)
        assert info.value.failure is Failure.AT_CAPACITY
        # Now retry with a budget, and free the slot while the retries are running.
        waiting = asyncio.create_task(
            client_pool(client, "127.0.0.5", attempts=8, base_delay=0.05).connect(
                SERVER_IP, srv.listener.port
            )
        )
        await asyncio.sleep(0.1)
        assert not waiting.done()
        first.close()
        conn = await waiting
        assert not conn.closed
        assert any("max connections (1) reached" in m for _, m in srv.lines)


async def test_pending_budget_per_source_does_not_block_other_sources() -> None:
    async with (
        server(Limits(max_pending_per_source=2, handshake_timeout=1.0)) as srv,
        Node("client") as client,
    ):
        port = srv.listener.port
        idle = [
            socket.create_connection((SERVER_IP, port), source_address=("127.0.0.6", 0))
            for _ in range(2)
        ]
        await until_true(lambda: srv.listener.pending == 2)
        extra = socket.create_connection((SERVER_IP, port), source_address=("127.0.0.6", 0))
        await until_true(lambda: srv.listener.refused_at_accept == 1)
        extra.settimeout(2)
        # Closed at accept, after a busy preamble (so a member would retry, not give up).
        got = await asyncio.to_thread(extra.recv, 64)
        assert got[:4] == b"MLXC" and got[7] == 0x01
        assert await asyncio.to_thread(extra.recv, 64) == b""
        # Another source still gets in while 127.0.0.6 holds its whole budget.
        conn = await client_pool(client, "127.0.0.7").get(SERVER_IP, port)
        await conn.send(Ack("r", 1))
        await until_true(lambda: len(srv.received) == 1)
        # The stalled handshakes time out and free their slots.
        await until_true(lambda: srv.listener.pending == 0, timeout=3)
        assert srv.listener.failures[Failure.TIMEOUT] == 2
        for s in idle + [extra]:
            s.close()


async def test_junk_and_probes_are_closed_and_the_listener_keeps_serving() -> None:
    async with server() as srv, Node("client") as client:
        port = srv.listener.port
        probe = socket.create_connection((SERVER_IP, port), source_address=("127.0.0.8", 0))
        probe.close()
        junk = socket.create_connection((SERVER_IP, port), source_address=("127.0.0.8", 0))
        junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        junk.settimeout(2)
        assert await asyncio.to_thread(junk.recv, 100) == b""
        junk.close()
        await until_true(lambda: srv.listener.failures[Failure.BAD_MAGIC] == 1)
        assert srv.listener.failures[Failure.PROBE] == 1
        assert not any("probe" in m for lvl, m in srv.lines if lvl == "WARNING")
        # Bad magic closes silently, as the wire spec says: counted, at debug, no warning.
        assert not any("magic" in m for lvl, m in srv.lines if lvl == "WARNING")
        assert any("bad magic" in m for lvl, m in srv.lines if lvl == "DEBUG")
        conn = await client_pool(client, "127.0.0.2").get(SERVER_IP, port)
        await conn.send(Ack("ok", 1))
        await until_true(lambda: len(srv.received) == 1)


async def _established(srv: Server, client: Node, ip: str):  # type: ignore[no-untyped-def]
    pool = client_pool(client, ip)
    conn = await pool.connect(SERVER_IP, srv.listener.port)
    await until_true(lambda: len(srv.listener.connections) >= 1)
    return conn


@pytest.mark.parametrize("where", ["header", "body", "tag"])
async def test_tampered_frames_close_the_connection_and_reach_nothing(where: str) -> None:
    async with server() as srv, Node("client") as client:
        conn = await _established(srv, client, "127.0.0.2")
        frame = conn.protection.seal(KIND_MESSAGE, encode(Ack("r", 1)))
        pos = {"header": 0, "body": HEADER_LEN + 3, "tag": len(frame) - 2}[where]
        frame[pos] ^= 0x10
        conn.writer.write(frame)
        await until_true(lambda: not srv.listener.connections)
        assert srv.received == []
        assert any("closing connection" in m for _, m in srv.lines)
        # The listener keeps serving other peers.
        other = await client_pool(client, "127.0.0.4").get(SERVER_IP, srv.listener.port)
        await other.send(Ack("fine", 2))
        await until_true(lambda: len(srv.received) == 1)


async def test_replayed_reordered_and_foreign_frames_fail() -> None:
    async with server() as srv, Node("client") as client:
        conn = await _established(srv, client, "127.0.0.2")
        f1 = conn.protection.seal(KIND_MESSAGE, encode(Ack("r", 1)))
        conn.writer.write(f1)
        conn.writer.write(f1)  # replay
        await until_true(lambda: not srv.listener.connections)
        assert [e.msg.nonce for e in srv.received] == [1]

        conn = await _established(srv, client, "127.0.0.2")
        f1 = conn.protection.seal(KIND_MESSAGE, encode(Ack("r", 2)))
        f2 = conn.protection.seal(KIND_MESSAGE, encode(Ack("r", 3)))
        conn.writer.write(f2 + f1)  # reordered
        await until_true(lambda: not srv.listener.connections)
        assert [e.msg.nonce for e in srv.received] == [1]

        a = await _established(srv, client, "127.0.0.2")
        b = await _established(srv, client, "127.0.4.1")
        await until_true(lambda: len(srv.listener.connections) == 2)
        b.writer.write(a.protection.seal(KIND_MESSAGE, encode(Ack("r", 4))))  # cross-connection
        await until_true(lambda: len(srv.listener.connections) == 1)
        assert [e.msg.nonce for e in srv.received] == [1]


async def test_truncated_frame_then_close_reaches_nothing() -> None:
    async with server() as srv, Node("client") as client:
        conn = await _established(srv, client, "127.0.0.2")
        frame = conn.protection.seal(KIND_MESSAGE, encode(Ack("r", 1)))
        conn.writer.write(frame[:-5])
        await conn.writer.drain()
        conn.writer.close()
        await until_true(lambda: not srv.listener.connections)
        assert srv.received == []


@pytest.mark.parametrize("announced", [200 << 20, (256 << 10) + 1])
async def test_oversize_length_is_refused_without_reading_it(announced: int) -> None:
    """A frame is one 256 KiB record at most: anything larger is refused from the header."""
    async with server() as srv, Node("client") as client:
        conn = await _established(srv, client, "127.0.0.2")
        conn.writer.write(bytes([KIND_MESSAGE]) + announced.to_bytes(4, "big"))
        await until_true(lambda: not srv.listener.connections)
        assert any("cap is 262144" in m for _, m in srv.lines)


async def test_bus_backpressure_pauses_reading() -> None:
    """A full BLOCK subscription stops the reader; messages are delayed, never lost."""
    async with Node("server") as node, Node("client") as client:
        release = asyncio.Event()
        got: list[int] = []

        async def slow(env: Envelope[Ack]) -> None:
            await release.wait()
            got.append(env.msg.nonce)

        node.bus.subscribe(Ack, slow, maxsize=2)
        lst = ClusterListener(node, SECRET, SERVER_IP, 0)
        await lst.start()
        conn = await client_pool(client, "127.0.0.2").get(SERVER_IP, lst.port)
        for i in range(50):
            await conn.send(Ack("r", i), deadline=deadline_in(5))
        await asyncio.sleep(0.1)
        assert got == []
        release.set()
        await until_true(lambda: len(got) == 50)
        assert got == list(range(50))


def test_interface_lookup_and_rdma_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert interface_ipv4("lo") == "127.0.0.1"
    with pytest.raises(InterfaceError, match="no interface named 'nonexistent0' \\(have: .*lo"):
        interface_ipv4("nonexistent0")
    probe = probe_rdma(tmp_path / "none")
    assert probe.transport == "tcp" and probe.devices == () and "using TCP" in probe.detail
    (tmp_path / "ib" / "mlx5_0").mkdir(parents=True)
    probe = probe_rdma(tmp_path / "ib")
    assert probe.devices == ("mlx5_0",) and probe.transport == "tcp"


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a veth pair (root)")
def test_an_interface_is_found_by_name_with_its_address_or_refused_without_one() -> None:
    """A veth pair made for the test: without an IPv4 address it is refused by name; with
    one, that address is what --cluster-interface binds."""
    subprocess.run(["ip", "link", "add", "mlxcif0", "type", "veth", "peer", "name", "mlxcif1"],
                   check=True)  # fmt: skip
    try:
        with pytest.raises(InterfaceError, match="'mlxcif0' has no IPv4 address"):
            interface_ipv4("mlxcif0")
        subprocess.run(["ip", "addr", "add", "10.79.0.1/24", "dev", "mlxcif0"], check=True)
        assert interface_ipv4("mlxcif0") == "10.79.0.1"
    finally:
        subprocess.run(["ip", "link", "del", "mlxcif0"], check=False)


async def test_cluster_interface_binds_outbound_connections() -> None:
    async with server() as srv, Node("client") as client:
        ip = interface_ipv4("lo")
        pool = ConnectionPool(
            client, SECRET, Identity(ip, 9100, "lo-node"), bind_ip=ip, backoff=Backoff(attempts=1)
        )
        conn = await pool.get(SERVER_IP, srv.listener.port)
        assert conn.writer.get_extra_info("sockname")[0] == ip
        await conn.send(Ack("x", 1))
        await until_true(lambda: len(srv.received) == 1)
        assert srv.received[0].source == f"{ip}:9100"


async def test_truncated_handshake_is_closed_and_logged_as_noise() -> None:
    async with server() as srv, Node("client") as client:
        reader, writer = await asyncio.open_connection(
            SERVER_IP, srv.listener.port, local_addr=("127.0.0.2", 0)
        )
        hs = raw_client_handshake()
        first = hs.data_to_send()
        writer.write(first[: len(first) // 2])
        await writer.drain()
        writer.close()
        await until_true(lambda: srv.listener.failures[Failure.CLOSED] == 1)
        assert srv.listener.pending == 0
        conn = await client_pool(client, "127.0.0.2").get(SERVER_IP, srv.listener.port)
        await conn.send(Ack("after", 1))
        await until_true(lambda: len(srv.received) == 1)


def test_cluster_check_cli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from tests.conftest import free_port

    secret = tmp_path / "cluster.secret"
    subprocess.run(
        [sys.executable, "-m", "mlxcel", "keygen", "--out", str(secret)], check=True, timeout=60
    )
    port = free_port("127.0.0.3")
    listen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "cluster-check",
            "--listen",
            f"127.0.0.3:{port}",
            "--cluster-secret-file",
            str(secret),
            "--node-id",
            "coord",
            "--duration",
            "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert listen.stdout is not None
        for line in listen.stdout:
            if line.startswith("listening on"):
                break

        def check(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "mlxcel",
                    "cluster-check",
                    "--connect",
                    f"127.0.0.3:{port}",
                    "--attempts",
                    "1",
                    *extra,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )

        ok = check(
            "--cluster-secret-file",
            str(secret),
            "--cluster-interface",
            "lo",
            "--advertise",
            "127.0.0.1:7000",
        )
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "authenticated to 127.0.0.3" in ok.stdout and "node 'coord'" in ok.stdout
        assert "5 pings over protected frames" in ok.stdout and "via lo (127.0.0.1)" in ok.stdout
        other = tmp_path / "other.secret"
        subprocess.run(
            [sys.executable, "-m", "mlxcel", "keygen", "--out", str(other)], check=True, timeout=60
        )
        bad = check("--cluster-secret-file", str(other))
        assert bad.returncode == 1 and "secret mismatch" in bad.stdout
        assert secret.read_text().strip() not in bad.stdout + bad.stderr
        liar = check("--cluster-secret-file", str(secret), "--advertise", "127.0.0.9:7000")
        assert liar.returncode == 1 and "advertised identity 127.0.0.9:7000" in liar.stdout
        missing = check()
        assert missing.returncode == 1
        for src in (
            "--cluster-secret-file",
            "MLXCEL_CLUSTER_SECRET_FILE",
            "MLXCEL_CLUSTER_SECRET",
            "[cluster]",
        ):
            assert src in missing.stderr
    finally:
        listen.terminate()
        listen.wait(10)


async def test_a_send_cut_off_mid_message_closes_the_connection() -> None:
    """A message that stops after some of its records would swallow whatever came next on
    the stream: the connection is closed instead, and the next send dials a fresh one."""
    from mlxcel.base.errors import MlxcelError

    async with Node("server") as node, Node("client") as client:
        release = asyncio.Event()
        got: list[object] = []

        async def slow(env: Envelope[Ack]) -> None:
            await release.wait()
            got.append(env.msg.nonce)

        node.bus.subscribe(Ack, slow, maxsize=1)
        lst = ClusterListener(node, SECRET, SERVER_IP, 0)
        await lst.start()
        pool = client_pool(client, "127.0.0.2")
        conn = await pool.get(SERVER_IP, lst.port)
        for i in range(3):  # the reader stops behind a full subscription
            await conn.send(Ack("r", i), deadline=deadline_in(5))
        big = Tensor("uint8", (96 << 20,), bytes(96 << 20))
        with pytest.raises(MlxcelError):
            await conn.send(Activation("r1", 0, big, 0, SamplingParams(), 2), deadline_in(0.5))
        assert conn.closed
        release.set()
        fresh = await pool.get(SERVER_IP, lst.port)
        assert fresh is not conn
        await fresh.send(Ack("r", 999), deadline=deadline_in(5))
        await until_true(lambda: 999 in got)
        await lst.close()


async def test_a_large_message_without_tensors_is_encoded_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``send_now`` declines a message larger than one record after encoding it (a long
    prompt's token ids carry no tensor to size it by); the ``send`` that follows reuses that
    payload instead of encoding the message again."""
    import mlxcel.net.connection as connection

    async with server() as srv, Node("client") as client:
        got: list[RunEntry] = []

        async def on_entry(env: Envelope[RunEntry]) -> None:
            got.append(env.msg)

        srv.node.bus.subscribe(RunEntry, on_entry)
        conn = await client_pool(client, "127.0.0.2").get(SERVER_IP, srv.listener.port)
        encoded: list[object] = []
        real = connection.encode

        def counted(msg: object) -> bytes:
            encoded.append(msg)
            return real(msg)  # type: ignore[arg-type]

        monkeypatch.setattr(connection, "encode", counted)
        entry = RunEntry("r1", 0, tuple(range(70_000, 190_000)), 0, SamplingParams(), 7)
        assert not conn.send_now(entry)  # several records: not written at once
        await conn.send(entry)
        assert encoded == [entry]
        other = RunEntry("r2", 0, tuple(range(70_000, 190_000)), 0, SamplingParams(), 8)
        await conn.send(other)  # nothing declined for this one: encoded as usual
        assert encoded == [entry, other]
        await until_true(lambda: len(got) == 2)
        assert got == [entry, other]


def test_a_burst_of_large_messages_trims_the_heap_once_it_is_over() -> None:
    """Freed memory goes back to the OS after a flood (it stayed at the peak's level): one
    trim a quiet spell after large messages worth ENOUGH arrived, none for small ones."""
    from mlxcel.net import heap

    async def scenario() -> list[int]:
        calls: list[int] = []
        trimmer = heap.HeapTrimmer(lambda pad: calls.append(pad) or 1)
        for _ in range(40):
            trimmer.received(heap.LARGE - 1)  # small: never counted
        assert trimmer.pending == 0
        for _ in range(heap.ENOUGH // heap.LARGE - 1):
            trimmer.received(heap.LARGE)
        await asyncio.sleep(heap.QUIET * 1.5)
        assert calls == []  # not enough yet
        trimmer.received(heap.LARGE)  # enough: trims once the burst is over
        await asyncio.sleep(heap.QUIET / 2)
        trimmer.received(heap.LARGE)  # the burst goes on: the trim waits
        await asyncio.sleep(heap.QUIET * 0.7)
        assert calls == []
        await asyncio.sleep(heap.QUIET)
        assert trimmer.trims == 1 and trimmer.pending == 0
        return calls

    assert asyncio.run(scenario()) == [0]


async def test_messages_received_over_a_connection_reach_the_heap_trimmer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mlxcel.net import heap

    seen: list[int] = []
    monkeypatch.setattr(heap.TRIMMER, "received", seen.append)
    async with server() as srv, Node("client") as client:
        conn = await client_pool(client, "127.0.0.2").get(SERVER_IP, srv.listener.port)
        big = Tensor("uint8", (2 << 20,), bytes(2 << 20))
        await conn.send(Activation("r1", 0, big, 0, SamplingParams(), 2))
        await until_true(lambda: any(n > 2 << 20 for n in seen))


async def test_a_write_onto_a_transport_that_closed_fails_the_send_by_type() -> None:
    """The peer went while a long message was being written (a decode node killed during a
    handoff): the send fails with ConnectionClosed, which the outbox answers by failing that
    send, and not with the event loop's own error (uvloop raises a bare RuntimeError), which
    ended the outbox task and left every later send to that address queued for nobody."""
    async with server() as srv, Node("client") as client:
        conn = await _established(srv, client, "127.0.0.2")
        conn.writer.transport.abort()  # gone under the sender; the reader has not seen it yet
        assert not conn.closed
        payload = bytes(4 * conn.record_size)  # several records: the waiting path
        with pytest.raises(ConnectionClosed, match="closed while sending$"):
            await conn.send_payload(payload, deadline_in(5))
