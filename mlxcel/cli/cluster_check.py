"""``python -m mlxcel cluster-check``: prove two hosts can form a cluster before starting one.

``--listen`` runs an authenticated endpoint that answers pings; ``--connect`` dials it with
the cluster handshake, sends a few pings over protected frames and reports the round trip.
Both report the transport (interface address, RDMA probe) and every refusal with the same
diagnostics the cluster roles use, so a wrong secret, a wrong advertised address or a NAT in
the way shows up here first.
"""

from __future__ import annotations

import asyncio
import os
import time

from loguru import logger

from mlxcel.base.deadlines import deadline_in, until
from mlxcel.base.errors import ConfigError, MlxcelError
from mlxcel.base.messages import Ack
from mlxcel.config.tools import ClusterCheckSettings
from mlxcel.net.interfaces import interface_ipv4, probe_rdma
from mlxcel.net.listener import ClusterListener
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import load_cluster_secret
from mlxcel.process.loop import signals
from mlxcel.reactor.bus import Envelope, Node
from mlxcel.wire.handshake import Identity


def split_address(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(flag, f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def run_check(s: ClusterCheckSettings) -> int:
    secret = load_cluster_secret(s.cluster_secret_file, os.environ)
    assert secret is not None
    bind_ip = interface_ipv4(s.cluster_interface) if s.cluster_interface else None
    rdma = probe_rdma()
    print(
        f"transport: tcp{f' via {s.cluster_interface} ({bind_ip})' if bind_ip else ''}; {rdma.detail}",
        flush=True,
    )
    async with Node("cluster-check") as node:
        if s.listen:
            return await _listen(node, s, secret, bind_ip)
        return await _connect(node, s, secret, bind_ip)


async def _listen(node: Node, s: ClusterCheckSettings, secret, bind_ip: str | None) -> int:  # type: ignore[no-untyped-def]
    assert s.listen is not None
    host, port = split_address(s.listen, "--listen")
    host = bind_ip or host
    listener = ClusterListener(
        node,
        secret,
        host,
        port,
        node_id=s.node_id,
        on_connection=lambda c: print(
            f"authenticated peer {c.source} (node {c.peer.node_id!r})", flush=True
        ),
    )

    async def pong(env: Envelope[Ack]) -> None:
        conn = listener.connection_for(env.source)
        if conn is not None:  # reply only to the authenticated source
            await conn.send(Ack(env.msg.request_id, env.msg.nonce), deadline=deadline_in(5))

    node.bus.subscribe(Ack, pong)
    bound = await listener.start()
    print(f"listening on {Identity(host, bound).address} as node {s.node_id!r}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        with signals(stop.set):
            async with until(loop.time() + s.duration if s.duration > 0 else None, "listen"):
                await stop.wait()
    except MlxcelError:
        pass
    return 0


async def _connect(node: Node, s: ClusterCheckSettings, secret, bind_ip: str | None) -> int:  # type: ignore[no-untyped-def]
    assert s.connect is not None
    host, port = split_address(s.connect, "--connect")
    adv_host, adv_port = (
        split_address(s.advertise, "--advertise") if s.advertise else (bind_ip or "0.0.0.0", 0)
    )
    pool = ConnectionPool(
        node,
        secret,
        Identity(adv_host, adv_port, s.node_id),
        bind_ip=bind_ip,
        backoff=Backoff(attempts=s.attempts, base_delay=s.base_delay),
    )
    replies: asyncio.Queue[Ack] = asyncio.Queue(16)

    async def on_ack(env: Envelope[Ack]) -> None:
        replies.put_nowait(env.msg)

    node.bus.subscribe(Ack, on_ack)
    t0 = time.perf_counter()
    try:
        conn = await pool.get(host, port, deadline=deadline_in(60))
    except MlxcelError as exc:
        print(f"FAILED: {exc}", flush=True)
        return 1
    print(
        f"authenticated to {conn.source} (node {conn.peer.node_id!r}) in {(time.perf_counter() - t0) * 1e3:.1f} ms",
        flush=True,
    )
    rtts = []
    for i in range(s.pings):
        t = time.perf_counter()
        await conn.send(Ack("ping", i), deadline=deadline_in(5))
        async with until(deadline_in(5), "waiting for a pong"):
            got = await replies.get()
        if got.nonce != i:
            logger.warning("out-of-order pong {}", got.nonce)
        rtts.append((time.perf_counter() - t) * 1e3)
    if rtts:
        print(
            f"{len(rtts)} pings over protected frames: median round trip {sorted(rtts)[len(rtts) // 2]:.3f} ms",
            flush=True,
        )
    return 0
