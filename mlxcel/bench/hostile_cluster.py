"""``bench hostile``, the cluster half: a disaggregated cluster against a slow link, a faulty
member and a half-open flood, on network-namespace hosts (:mod:`mlxcel.bench.netns`):

- ``slow handoff``: a router, a prefill node whose link is shaped to ``rate`` (``tc tbf``)
  and one decode node; one prompt of ``prompt_tokens`` tokens (its KV cache must cross the
  slow link), and meanwhile ``shorts`` short requests, one every ``every`` seconds: whether
  the long one completed, and how many short ones did and how fast;
- ``full decode``: a router, a prefill node and two decode nodes; a member holding the secret
  fills decode-0's slots with handoffs of its own (valid, never committed, sent again as
  they lapse) while clients send requests: how many succeeded, and what the others got;
- ``restart under flood``: decode-1 restarts while an outsider with ``sources`` addresses
  holds every unfinished-handshake slot of its port: how long until the router has it back
  in rotation (``router_peers``: the decode nodes were told the router's address);
- ``message flood``: a member sends a decode node ``messages`` messages of ``mib`` MiB over
  ``connections`` connections at once: the node's resident memory before, at the peak, and
  ``settle_s`` seconds after the last one (``kept_mib``: what it did not give back).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mlxcel.bench.disagg import percentile
from mlxcel.bench.netns import Hosts
from mlxcel.bench.netns_nodes import HTTP_PORT, NodeProc, enter_netns, keygen
from mlxcel.runtime.families import layer_count
from mlxcel.runtime.kv_usage import kv_heads_and_dim


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of ``pid``, in MiB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def post(url: str, body: bytes, timeout: float) -> tuple[int, str]:
    """POST ``body`` to ``url``: (status, the error's code) -- (0, the exception's name) when
    no answer came."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, ""
    except urllib.error.HTTPError as exc:
        try:
            code = json.loads(exc.read())["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "?"
        return exc.code, str(code)
    except OSError as exc:
        return 0, type(exc).__name__


@dataclass
class SlowHandoff:
    rate: str
    prompt_tokens: int
    long_status: int
    long_s: float
    long_code: str
    shorts: int
    shorts_ok: int
    short_p50_s: float
    short_p95_s: float
    short_codes: dict[str, int]


def slow_handoff(
    model: Path,
    tmp: Path,
    prompt_tokens: int = 2000,
    shorts: int = 40,
    every: float = 0.2,
    rate: str = "1mbit",
) -> SlowHandoff:
    """A long prompt's KV cache over a slow prefill link, and short requests meanwhile."""
    import random

    from mlxcel.bench.faults import disagg_cluster

    secret = keygen(tmp / "cluster.secret")
    rng = random.Random(7)
    long_body = json.dumps(
        {"model": "m", "prompt": [rng.randrange(10, 500) for _ in range(prompt_tokens)],
         "max_tokens": 4, "temperature": 0}
    ).encode()  # fmt: skip
    short_body = json.dumps({"model": "m", "prompt": "short one", "max_tokens": 4}).encode()
    with disagg_cluster(model, secret, n_decode=1) as c:
        url = c.client.base + "/v1/completions"

        def timed(body: bytes) -> tuple[int, str, float]:
            t0 = time.monotonic()
            status, code = post(url, body, 180.0)
            return status, code, time.monotonic() - t0

        warm = c.client.pool.submit(timed, short_body).result()  # (from inside host 0)
        if warm[0] != 200:
            raise RuntimeError(f"the cluster does not answer: {warm}")
        c.hosts.slow(1, rate)
        long_f = c.client.pool.submit(timed, long_body)
        time.sleep(0.5)  # its prompt runs, then its cache starts across the link
        futures = []
        for _ in range(shorts):
            futures.append(c.client.pool.submit(timed, short_body))
            time.sleep(every)
        results = [f.result() for f in futures]
        long_status, long_code, long_s = long_f.result()
        c.hosts.unslow(1)
    ok = [t for status, _, t in results if status == 200]
    return SlowHandoff(
        rate,
        prompt_tokens,
        long_status,
        round(long_s, 2),
        long_code,
        shorts,
        len(ok),
        round(percentile(ok, 50), 2),
        round(percentile(ok, 95), 2),
        dict(Counter(code or str(status) for status, code, _ in results)),
    )


@dataclass
class FullDecode:
    requests: int
    ok: int
    codes: dict[str, int]
    filled: int  # handoffs the member had taken by decode-0 (acknowledged)


def _member_fills(
    host: str, secret: Path, target: str, dims: tuple[int, int, int, int], n: int,
    stop: threading.Event, acked: list[int],
) -> None:  # fmt: skip
    """A member (it holds the secret) that keeps ``n`` slots of the decode node ``target``
    busy with handoffs it never commits, sending them again as they lapse."""
    import asyncio

    from mlxcel.base.deadlines import deadline_in
    from mlxcel.base.handoff import digest_of, tensor_digest
    from mlxcel.base.messages import HandoffAck, KvHandoff, QueryState, SamplingParams, Tensor
    from mlxcel.net.listener import ClusterListener
    from mlxcel.net.pool import ConnectionPool
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.reactor.bus import Envelope, Node
    from mlxcel.wire.handshake import Identity

    layers, heads, kdim, vdim = dims
    k = Tensor("float32", (1, heads, 1, kdim), bytes(heads * kdim * 4))
    v = Tensor("float32", (1, heads, 1, vdim), bytes(heads * vdim * 4))
    keys, values = (k,) * layers, (v,) * layers
    tensors = tensor_digest(keys, values)

    async def run() -> None:
        sec = load_cluster_secret(secret)
        assert sec is not None
        async with Node("member") as node:

            async def on_ack(env: Envelope[HandoffAck]) -> None:
                acked[0] += env.msg.ok

            node.bus.subscribe(HandoffAck, on_ack)
            listener = ClusterListener(node, sec, host, 0)
            me = Identity(host, await listener.start(), "member")
            pool = ConnectionPool(node, sec, me, bind_ip=host)
            dhost, dport = target.rsplit(":", 1)
            lease = 1
            while not stop.is_set():
                conn = await pool.get(dhost, int(dport))
                await conn.send(QueryState(0), deadline_in(5))  # "a router", as a router polls
                for _ in range(n):
                    h = KvHandoff(f"fill-{lease}", lease, me.address, 1, 5,
                                  SamplingParams(max_tokens=64), (), 1, keys, values, b"")  # fmt: skip
                    h = dataclasses.replace(h, digest=digest_of(h, tensors))
                    await conn.send(h, deadline_in(5))
                    lease += 1
                await asyncio.sleep(12.0)  # the unread ones lapse after 15 s: fill again

    asyncio.run(run())


def _kv_dims(model: Path) -> tuple[int, int, int, int]:
    """(layers, kv heads, key dim, value dim) of an attention model's cache, from config.json."""
    config = json.loads((model / "config.json").read_text())
    heads, dim = kv_heads_and_dim(config)
    return layer_count(config), heads, dim, dim


def full_decode(model: Path, tmp: Path, requests: int = 60, every: float = 0.1) -> FullDecode:
    """Requests while a member keeps decode-0 full (the node's 256 slots)."""
    from mlxcel.bench.faults import disagg_cluster
    from mlxcel.bench.netns_nodes import CLUSTER_PORT
    from mlxcel.disagg.protocol import NODE_CAPACITY

    secret = keygen(tmp / "cluster.secret")
    body = json.dumps({"model": "m", "prompt": "full decode", "max_tokens": 4}).encode()
    with disagg_cluster(model, secret, n_decode=2) as c:
        url = c.client.base + "/v1/completions"
        stop = threading.Event()
        acked = [0]
        target = f"{c.hosts.ip(2)}:{CLUSTER_PORT}"

        def member() -> None:
            enter_netns(c.hosts.names[0])
            _member_fills(c.hosts.ip(0), secret, target, _kv_dims(model), NODE_CAPACITY, stop,
                          acked)  # fmt: skip

        t = threading.Thread(target=member, daemon=True)
        t.start()
        time.sleep(4.0)  # decode-0 is full by now
        futures = []
        for _ in range(requests):
            futures.append(c.client.pool.submit(post, url, body, 60.0))
            time.sleep(every)
        results = [f.result() for f in futures]
        stop.set()
    return FullDecode(
        requests,
        sum(1 for st, _ in results if st == 200),
        dict(Counter(code or str(st) for st, code in results)),
        acked[0],
    )


@dataclass
class RestartUnderFlood:
    sources: int
    flood_s: float
    router_peers: bool
    back_s: float | None  # from the restarted node's ready line to healthy at the router
    attacker: dict[str, int]


def restart_under_flood(
    model: Path, tmp: Path, sources: int = 70, flood_s: float = 40.0, router_peers: bool = True
) -> RestartUnderFlood:
    """A router, a prefill node, two decode nodes (and an attacker host); decode-1 restarts
    while the attacker holds its pending pool."""
    import subprocess

    from mlxcel.bench.faults import running
    from mlxcel.bench.floods import ATTACK
    from mlxcel.bench.netns_nodes import CLUSTER_PORT, wait_for

    secret = keygen(tmp / "cluster.secret")
    with Hosts(5, net=84) as hosts:
        addr = [f"{hosts.ip(i)}:{CLUSTER_PORT}" for i in range(4)]
        common = ["-m", str(model), "--cluster-secret-file", str(secret)]
        told = ["--router-peers", addr[0]] if router_peers else []

        def worker(role: str, i: int) -> list[str]:
            return [*common, "--node-role", role, "--serving-bind", addr[i], *told]

        router = [*common, "--node-role", "router", "--serving-bind", addr[0],
                  "--prefill-peers", addr[1], "--decode-peers", f"{addr[2]},{addr[3]}",
                  "--host", "127.0.0.1", "--port", str(HTTP_PORT), "--served-model-name", "m"]  # fmt: skip
        starts = [("prefill", 1, worker("prefill", 1), "mlxcel prefill node"),
                  ("decode-0", 2, worker("decode", 2), "mlxcel decode node"),
                  ("decode-1", 3, worker("decode", 3), "mlxcel decode node"),
                  ("router", 0, router, "mlxcel serving")]  # fmt: skip
        with running(hosts, starts) as c:
            from mlxcel.bench.faults import node_healthy

            if wait_for(lambda: node_healthy(c, "decode-1") is True, 20.0) is None:
                raise RuntimeError("decode-1 never came up at the router")
            c.procs["decode-1"].stop()
            wait_for(lambda: node_healthy(c, "decode-1") is False, 20.0)
            srcs = hosts.add_addresses(4, sources)
            attacker = hosts.spawn(4, [*ATTACK, "pending", hosts.ip(3), str(CLUSTER_PORT),
                                       str(flood_s), "1", *srcs], stdout=subprocess.PIPE,
                                   text=True)  # fmt: skip
            try:
                time.sleep(2.0)  # the pool is theirs
                c.procs["decode-1"] = NodeProc(hosts, 3, worker("decode", 3), "mlxcel decode node")
                back = wait_for(lambda: node_healthy(c, "decode-1") is True, flood_s + 20.0)
            finally:
                attacker.terminate()
                out, _ = attacker.communicate(15)
    stats = json.loads(out) if out.strip() else {}
    return RestartUnderFlood(sources, flood_s, router_peers, back, stats)


@dataclass
class MessageFlood:
    connections: int
    messages: int
    mib: int
    seconds: float
    base_mib: float
    peak_mib: float
    kept_mib: float  # resident memory settle_s after the flood, above the base
    settle_s: float


def message_flood(
    model: Path, tmp: Path, connections: int = 16, per: int = 10, mib: int = 32
) -> MessageFlood:
    """A decode node on host 1; a member on host 0 floods it with large activations (which a
    decode node refuses: only their memory matters here)."""
    import asyncio

    from mlxcel.base.messages import Activation, SamplingParams, Tensor
    from mlxcel.bench.netns_nodes import CLUSTER_PORT
    from mlxcel.net.pool import ConnectionPool
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.wire.handshake import Identity

    secret = keygen(tmp / "cluster.secret")
    settle = 5.0
    with Hosts(2, net=86) as hosts:
        target = (hosts.ip(1), CLUSTER_PORT)
        args = ["-m", str(model), "--cluster-secret-file", str(secret), "--node-role", "decode",
                "--serving-bind", f"{target[0]}:{target[1]}"]  # fmt: skip
        node = NodeProc(hosts, 1, args, "mlxcel decode node")
        try:
            time.sleep(1.0)
            base = memory(node.p.pid)["VmRSS"]
            data = bytes(mib << 20)
            msg = Activation(
                "flood", 0, Tensor("uint8", (len(data),), data), 0, SamplingParams(), 1
            )

            async def member() -> None:
                from mlxcel.reactor.bus import Node

                sec = load_cluster_secret(secret)
                assert sec is not None
                async with Node("member") as n:

                    async def one(k: int) -> None:
                        me = Identity(hosts.ip(0), 40000 + k, "member")
                        pool = ConnectionPool(n, sec, me, bind_ip=hosts.ip(0))
                        for _ in range(per):
                            deadline = asyncio.get_running_loop().time() + 60
                            conn = await pool.get(*target, deadline)
                            await conn.send(msg, deadline)

                    await asyncio.gather(*(one(k) for k in range(connections)))

            def flood() -> None:
                enter_netns(hosts.names[0])
                asyncio.run(member())

            t0 = time.monotonic()
            t = threading.Thread(target=flood)
            t.start()
            t.join()
            took = time.monotonic() - t0
            time.sleep(settle)
            now = memory(node.p.pid)
            peak, kept = now["VmHWM"], now["VmRSS"] - base
        finally:
            node.stop()
    return MessageFlood(connections, connections * per, mib, took, base, peak, kept, settle)
