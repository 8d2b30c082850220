"""``python -m mlxcel bench frames``: what frame protection costs, over real loopback sockets.

For each mode a peer process is started. This process dials the peer (connection A, the full
cluster handshake) and the peer dials back (connection B); each message goes out on A, and
the peer echoes it back on B, so one-way latency is half the round trip and includes both
ends' frame work. Both connections use the mode's protection with the keys their handshakes
derived. ``handshake`` times a fresh TCP connect plus the cluster handshake.

``--netns`` puts the peer on a second host: two network namespaces joined by veth links
through a bridge (:mod:`mlxcel.bench.netns`), this process's reactor thread in the first and
the peer process in the second, each link shaped by ``tc tbf`` to ``--netns-rate`` when it is
given. That is an activation's transfer between two hosts: a decode row of an 8B model
(hidden 4096, bf16) is 8 KiB, 32 rows 256 KiB, a 512-token prompt chunk 4 MiB.

``reference`` is what a user would write without mlxcel: the same payloads echoed over one
plain uvloop stream with a 4-byte length prefix (a peer started from a short script that
imports nothing of mlxcel). Reference vs unprotected is the framework's cost; unprotected vs
the protected modes is the protection's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mlxcel.base.errors import ConnectionClosed, FrameError
from mlxcel.net.connection import SecureConnection
from mlxcel.net.listener import ClusterListener
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Node
from mlxcel.wire.frames import AeadProtection, ChaChaSuite, HmacSha256, Protection, Unprotected
from mlxcel.wire.handshake import Identity

MODES: dict[str, Callable[[bytes, bytes], Protection]] = {
    "unprotected": Unprotected,
    "hmac-sha256": HmacSha256,
    "aes-256-gcm": AeadProtection,
    "chacha20-poly1305": ChaChaSuite,
}
ORDER = ["reference", *MODES, "handshake"]
SIZES = {
    "8K": 8 << 10,
    "64K": 64 << 10,
    "256K": 256 << 10,
    "1M": 1 << 20,
    "2M": 2 << 20,
    "4M": 4 << 20,
    "16M": 16 << 20,
}
ITERATIONS = {
    8 << 10: 3000,
    64 << 10: 1500,
    256 << 10: 600,
    1 << 20: 300,
    2 << 20: 150,
    4 << 20: 80,
    16 << 20: 40,
}
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Where:
    """Where the two ends run: this process at ``here``, the peer at ``peer``, started after
    ``prefix`` (``ip netns exec HOST`` for a second host)."""

    here: str = HOST
    peer: str = HOST
    prefix: tuple[str, ...] = ()
    link: str = "loopback"


LOOPBACK = Where()
BENCH_SECRET = ClusterSecret(b"mlxcel-frame-benchmark-secret-0123456789", "benchmark")

# The reference peer: a length-prefixed echo on a bare uvloop stream, no mlxcel code at all.
REFERENCE_PEER = """
import asyncio, struct, sys
try:
    import uvloop
    factory = uvloop.new_event_loop
except ImportError:
    factory = None

async def echo(reader, writer):
    try:
        while True:
            head = await reader.readexactly(4)
            body = await reader.readexactly(struct.unpack("!I", head)[0])
            writer.write(head)
            writer.write(body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
        done.set()

async def main():
    global done
    done = asyncio.Event()
    server = await asyncio.start_server(echo, sys.argv[1], 0, limit=1 << 20)
    print(server.sockets[0].getsockname()[1], flush=True)
    await done.wait()

with asyncio.Runner(loop_factory=factory) as runner:
    runner.run(main())
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _inbound(
    node: Node, factory: Callable[[bytes, bytes], Protection], host: str
) -> tuple[asyncio.Queue[SecureConnection], int]:
    """A listener on ``host`` whose authenticated connections are handed over raw (not to
    the bus)."""
    inbound: asyncio.Queue[SecureConnection] = asyncio.Queue(1)
    listener = ClusterListener(
        node,
        BENCH_SECRET,
        host,
        0,
        publish=False,
        protection=factory,
        on_connection=inbound.put_nowait,
    )
    return inbound, await listener.start()


async def run_peer(mode: str, parent: str, parent_port: int, host: str) -> None:
    """Echo every message received on A back on B (runs in the peer process, at ``host``)."""
    factory = MODES[mode]
    async with Node("bench-peer") as node:
        inbound, port = await _inbound(node, factory, host)
        print(port, flush=True)
        conn_a = await inbound.get()
        pool = ConnectionPool(
            node, BENCH_SECRET, Identity(host, port), publish=False, protection=factory,
            bind_ip=host,
        )  # fmt: skip
        conn_b = await pool.connect(parent, parent_port)
        try:
            while True:
                payload = await conn_a.recv_payload()
                await conn_b.send_payload(payload)
        except (ConnectionClosed, FrameError):
            pass  # A closed: the measuring side is done with this mode
        finally:
            conn_a.close()
            conn_b.close()


def _row(mode: str, size: int, samples: list[float]) -> dict[str, object]:
    p50 = pct(samples, 0.50)
    return {
        "mode": mode,
        "payload_bytes": size,
        "iterations": len(samples),
        "p50_us": round(p50 * 1e6, 1),
        "p95_us": round(pct(samples, 0.95) * 1e6, 1),
        "p99_us": round(pct(samples, 0.99) * 1e6, 1),
        "gib_per_s": round(size / p50 / 2**30, 3),
    }


async def measure_reference(
    sizes: list[int], scale: float, where: Where = LOOPBACK
) -> list[dict[str, object]]:
    """One-way latency over a bare length-prefixed stream (the reference row)."""
    peer = subprocess.Popen(
        [*where.prefix, sys.executable, "-c", REFERENCE_PEER, where.peer],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None
        port = int(await asyncio.to_thread(peer.stdout.readline))
        reader, writer = await asyncio.open_connection(where.peer, port, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        async def once(payload: bytes) -> int:
            writer.write(len(payload).to_bytes(4, "big"))
            writer.write(payload)
            await writer.drain()
            n = int.from_bytes(await reader.readexactly(4), "big")
            return len(await reader.readexactly(n))

        rows = await _time_echoes("reference", sizes, scale, once)
        writer.close()
    finally:
        await _reap(peer)
    return rows


async def _time_echoes(
    mode: str, sizes: list[int], scale: float, once: Callable[[bytes], Awaitable[int]]
) -> list[dict[str, object]]:
    """Warm up, then time ``once`` (send a payload, await its echo, return its size)."""
    rows = []
    for size in sizes:
        payload = os.urandom(size)
        iters = max(10, int(ITERATIONS.get(size, 100) * scale))
        for _ in range(max(3, iters // 20)):
            await once(payload)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            got = await once(payload)
            samples.append((time.perf_counter() - t0) / 2)
        if got != size:
            raise RuntimeError(f"{mode}: the echo returned a different size")
        rows.append(_row(mode, size, samples))
    return rows


async def _reap(peer: subprocess.Popen[str]) -> None:
    try:
        await asyncio.to_thread(peer.wait, 10)
    except subprocess.TimeoutExpired:
        peer.kill()


async def measure_mode(
    mode: str, sizes: list[int], scale: float, where: Where = LOOPBACK
) -> list[dict[str, object]]:
    factory = MODES[mode]
    async with Node("bench") as node:
        inbound, port = await _inbound(node, factory, where.here)
        peer = subprocess.Popen(
            [*where.prefix, sys.executable, "-m", "mlxcel.bench.frames", "--peer", mode,
             where.here, str(port), "--at", where.peer],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            assert peer.stdout is not None
            peer_port = int(await asyncio.to_thread(peer.stdout.readline))
            pool = ConnectionPool(
                node, BENCH_SECRET, Identity(where.here, port), publish=False,
                protection=factory, bind_ip=where.here,
            )  # fmt: skip
            conn_a = await pool.connect(where.peer, peer_port)
            conn_b = await inbound.get()

            async def once(payload: bytes) -> int:
                await conn_a.send_payload(payload)
                return len(await conn_b.recv_payload())

            rows = await _time_echoes(mode, sizes, scale, once)
            await conn_a.wait_closed()  # the peer exits when A closes
        finally:
            await _reap(peer)
    return rows


async def measure_handshake(iterations: int, host: str = HOST) -> dict[str, object]:
    async with Node("bench-hs") as node:
        listener = ClusterListener(node, BENCH_SECRET, host, 0, publish=False)
        port = await listener.start()
        pool = ConnectionPool(
            node, BENCH_SECRET, Identity(host, 1), publish=False, backoff=Backoff(attempts=1)
        )
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            conn = await pool.connect(host, port)
            samples.append(time.perf_counter() - t0)
            await conn.wait_closed()
    return {
        "mode": "handshake",
        "payload_bytes": 0,
        "iterations": iterations,
        "p50_us": round(statistics.median(samples) * 1e6, 1),
        "p95_us": round(pct(samples, 0.95) * 1e6, 1),
        "p99_us": round(pct(samples, 0.99) * 1e6, 1),
        "gib_per_s": 0.0,
    }


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


@contextmanager
def two_hosts(netns: bool, rate: str | None) -> Iterator[Where]:
    """Loopback, or (``netns``) two namespace hosts with links shaped to ``rate`` (if given),
    the calling thread on the first for the block."""
    if not netns:
        yield LOOPBACK
        return
    from mlxcel.bench.netns import Hosts
    from mlxcel.bench.netns_nodes import in_netns

    with Hosts(2, net=81, tag="fr") as hosts:
        if rate is not None:
            for i in range(2):
                hosts.slow(i, rate, burst="512kb")  # a gigabit link needs a tick's worth
        with in_netns(hosts.names[0]):
            link = f"two netns hosts, tc tbf {rate}" if rate else "two netns hosts, unshaped"
            yield Where(hosts.ip(0), hosts.ip(1), tuple(hosts.command(1, [])), link)


async def run_bench(
    json_lines: bool,
    sizes: list[int],
    scale: float,
    modes: list[str],
    where: Where = LOOPBACK,
) -> int:
    rows: list[dict[str, object]] = []
    await measure_mode(
        "unprotected", sizes, min(scale, 0.1), where
    )  # warm-up, discarded: first runs pay for it
    for mode in modes:
        measured = (
            await measure_reference(sizes, scale, where)
            if mode == "reference"
            else await measure_mode(mode, sizes, scale, where)
        )
        for row in measured:
            row["link"] = where.link
            rows.append(row)
            if json_lines:
                print(json.dumps(row), flush=True)
    hs = await measure_handshake(max(10, int(200 * scale)), where.here)
    rows.append(hs)
    if json_lines:
        print(json.dumps(hs), flush=True)
        return 0
    unprot = {r["payload_bytes"]: r["p50_us"] for r in rows if r["mode"] == "unprotected"}
    ref = {r["payload_bytes"]: r["p50_us"] for r in rows if r["mode"] == "reference"}

    def ratio(r: dict[str, object], base: dict[object, object]) -> str:
        if r["mode"] == "handshake" or r["payload_bytes"] not in base:
            return ""
        return f"{float(r['p50_us']) / float(base[r['payload_bytes']]):.2f}"  # type: ignore[arg-type]

    print(f"link: {where.link}")
    print(
        f"{'mode':<19}{'payload':>9}{'iters':>7}{'p50':>11}{'p95':>11}{'p99':>11}{'GiB/s':>8}"
        f"{'x unprot.':>10}{'x ref.':>8}"
    )
    for r in sorted(
        rows, key=lambda r: (int(r["payload_bytes"]) or 1 << 40, ORDER.index(r["mode"]))
    ):  # type: ignore[call-overload]
        size = human(int(r["payload_bytes"])) if r["mode"] != "handshake" else "-"  # type: ignore[call-overload]
        print(
            f"{r['mode']:<19}{size:>9}{r['iterations']:>7}{r['p50_us']:>9}us{r['p95_us']:>9}us"
            f"{r['p99_us']:>9}us{r['gib_per_s']:>8}{ratio(r, unprot):>10}{ratio(r, ref):>8}"
        )
    return 0


def parse_sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        if part in SIZES:
            out.append(SIZES[part])
        else:
            out.append(int(part))
    return out


if __name__ == "__main__":  # the echo peer: python -m mlxcel.bench.frames --peer MODE IP PORT
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", nargs=3, metavar=("MODE", "IP", "PORT"), required=True)
    ap.add_argument("--at", default=HOST, help="the peer's own address")
    a = ap.parse_args()
    from loguru import logger

    from mlxcel.process.loop import run_async

    logger.remove()
    run_async(run_peer(a.peer[0], a.peer[1], int(a.peer[2]), a.at))
