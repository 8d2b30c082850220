"""``bench hostile``: what a heavy client or a few addresses cost a serving node, measured.

Each scenario runs real ``mlxcel serve`` processes on network-namespace hosts
(:mod:`mlxcel.bench.netns`) and reports figures; the tests run the same scenarios and hold
them to the targets:

- ``big prompts``: ``n`` concurrent prompts of ``chars`` characters each (under the body
  cap, each far over the context): what the clients were answered, and how far the server's
  peak resident memory rose above where it stood before (``peak_growth_mib``) and what
  stayed afterwards (``kept_mib``);
- ``http flood``: ``sources`` addresses each open ``per_source`` connections and trickle
  header bytes on them, while a further address probes ``/health``: how many probes were
  answered, and what the attackers held;
- ``slow handoff``: a router, a prefill node whose link is shaped to ``rate`` (``tc tbf``)
  and one decode node; one prompt of ``prompt_tokens`` tokens (its KV cache must cross the
  slow link), and meanwhile ``shorts`` short requests, one every ``every`` seconds: whether
  the long one completed, and how many short ones did and how fast;
- ``full decode``: a router, a prefill node and two decode nodes; a member holding the secret
  fills decode-0's slots with handoffs of its own (valid, never committed, sent again as
  they lapse) while clients send requests: how many succeeded, and what the others got;
- ``restart under flood``: decode-1 restarts while an outsider with ``sources`` addresses
  holds every unfinished-handshake slot of its port: how long until the router has it back
  in rotation (``router_peers``: the decode nodes were told the router's address).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxcel.bench.netns import Hosts
from mlxcel.bench.netns_nodes import HTTP_PORT, NodeProc, enter_netns, keygen

NET = 83  # 10.83.0.0/24: apart from the other benches' namespaces
# The connection cap of a host whose descriptor limit is 4096 (where the flood was found);
# machines with a higher limit get a higher cap, and five addresses would not reach it.
FLOOD_CAP = ("--max-http-connections", "3840")


@dataclass
class BigPrompts:
    prompts: int
    chars: int
    statuses: dict[str, int]
    codes: dict[str, int]
    seconds: float
    peak_growth_mib: float
    kept_mib: float


def _memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of ``pid``, in MiB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _post(url: str, body: bytes, timeout: float) -> tuple[int, str]:
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


@contextmanager
def one_node(model: Path, hosts: Hosts, host: int, *extra: str) -> Iterator[NodeProc]:
    """One serving node on ``host``, HTTP on all of its addresses."""
    args = ["-m", str(model), "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--served-model-name", "m", *extra]  # fmt: skip
    node = NodeProc(hosts, host, args, "mlxcel serving")
    try:
        yield node
    finally:
        node.stop()


def big_prompts(model: Path, n: int = 6, chars: int = 3_900_000) -> BigPrompts:
    """``n`` concurrent completions whose prompt is ``chars`` characters (ASCII words)."""
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    body = json.dumps({"model": "m", "prompt": text, "max_tokens": 4}).encode()
    with Hosts(1, net=NET) as hosts, one_node(model, hosts, 0) as node:
        pid = node.p.pid
        time.sleep(1.0)  # let start-up's allocations settle before the baseline
        before = _memory(pid)["VmRSS"]
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts from here
        url = f"http://127.0.0.1:{HTTP_PORT}/v1/completions"
        t0 = time.monotonic()
        with ThreadPoolExecutor(n, initializer=enter_netns, initargs=(hosts.names[0],)) as pool:
            answers = list(pool.map(lambda _: _post(url, body, 120.0), range(n)))
        seconds = time.monotonic() - t0
        peak = _memory(pid)["VmHWM"]
        time.sleep(1.0)
        after = _memory(pid)["VmRSS"]
    return BigPrompts(
        n,
        chars,
        {str(k): v for k, v in Counter(s for s, _ in answers).items()},
        dict(Counter(c for _, c in answers)),
        round(seconds, 2),
        round(peak - before, 1),
        round(after - before, 1),
    )


@dataclass
class HttpFlood:
    sources: int
    per_source: int
    probes: int
    answered: int
    attacker_sockets: int  # sockets the attackers kept open (some already closed by the server)
    cut: int  # attacker connections the server was seen to close
    attacker_errors: int  # sockets the attackers could not open (their own limits)
    probe_ms: list[float] = field(default_factory=list)


def _trickle(host: str, port: int, source: str, count: int, stop: threading.Event,
             held: list[int], cut: list[int], errors: list[int]) -> None:  # fmt: skip
    """Keep ``count`` connections from ``source`` open, each sending a header byte at a time
    and reopened as soon as the server closes it."""
    socks: list[socket.socket | None] = [None] * count
    header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
    sent = [0] * count
    while not stop.is_set():
        open_now = 0
        for k in range(count):
            s = socks[k]
            if s is None:
                try:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                except OSError:
                    errors[0] += 1  # out of descriptors here: try again next round
                    continue
                try:
                    s.setblocking(False)
                    s.bind((source, 0))
                    s.connect_ex((host, port))
                except OSError:
                    errors[0] += 1
                    s.close()
                    continue
                socks[k], sent[k] = s, 0
            try:
                s.send(header[sent[k] % len(header) : sent[k] % len(header) + 1])
                sent[k] += 1
                open_now += 1
            except BlockingIOError:
                open_now += 1
            except OSError:
                s.close()
                socks[k] = None
                cut[0] += 1
        held[0] = open_now
        stop.wait(0.5)
    for s in socks:
        if s is not None:
            s.close()


def http_flood(
    model: Path, sources: int = 5, per_source: int = 960, probes: int = 20, *extra: str
) -> HttpFlood:
    """``sources`` addresses trickle ``per_source`` connections each; a further address then
    sends ``probes`` health probes, one every 0.25 s, each given 5 s."""
    with Hosts(2, net=NET) as hosts, one_node(model, hosts, 0, *extra):
        addrs = hosts.add_addresses(1, sources + 1)
        target = hosts.ip(0)
        stop = threading.Event()
        held = [[0] for _ in range(sources)]
        cut = [[0] for _ in range(sources)]
        errors = [[0] for _ in range(sources)]

        def attacker(k: int) -> None:
            enter_netns(hosts.names[1])
            _trickle(target, HTTP_PORT, addrs[k], per_source, stop, held[k], cut[k], errors[k])

        threads = [threading.Thread(target=attacker, args=(k,), daemon=True)
                   for k in range(sources)]  # fmt: skip
        for t in threads:
            t.start()
        time.sleep(3.0)  # the flood is in place
        times = _probe(hosts, addrs[sources], target, probes)
        stop.set()
        for t in threads:
            t.join(30)
    answered = [t for t in times if t is not None]
    return HttpFlood(
        sources,
        per_source,
        probes,
        len(answered),
        sum(h[0] for h in held),
        sum(c[0] for c in cut),
        sum(e[0] for e in errors),
        [round(t * 1000, 1) for t in answered],
    )


def _probe(hosts: Hosts, source: str, target: str, probes: int) -> list[float | None]:
    out: list[float | None] = []

    def run() -> None:
        enter_netns(hosts.names[1])
        for _ in range(probes):
            t0 = time.monotonic()
            try:
                with socket.create_connection((target, HTTP_PORT), 5.0, (source, 0)) as s:
                    s.settimeout(5.0)
                    s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    ok = s.recv(64).startswith(b"HTTP/1.1 200")
            except OSError:
                ok = False
            out.append(time.monotonic() - t0 if ok else None)
            time.sleep(0.25)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


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


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


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
            status, code = _post(url, body, 180.0)
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
        round(_quantile(ok, 0.5), 2),
        round(_quantile(ok, 0.95), 2),
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

    from mlxcel.bus import Envelope, Node
    from mlxcel.deadlines import deadline_in
    from mlxcel.handoff import digest_of, tensor_digest
    from mlxcel.messages import HandoffAck, KvHandoff, QueryState, SamplingParams, Tensor
    from mlxcel.net.listener import ClusterListener
    from mlxcel.net.pool import ConnectionPool
    from mlxcel.net.secret import load_cluster_secret
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
    """(layers, kv heads, key dim, value dim) of a llama-shaped checkpoint's cache."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], heads, dim, dim


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
            futures.append(c.client.pool.submit(_post, url, body, 60.0))
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


def run_bench(model: Path, json_lines: bool = False) -> int:
    from mlxcel.bench.netns import unavailable

    why = unavailable()
    if why is not None:
        print(f"bench hostile: {why}", file=sys.stderr)
        return 2
    from mlxcel.server.http_guard import raise_fd_limit

    raise_fd_limit()  # the flood's own sockets
    import tempfile

    big = big_prompts(model)
    flood = http_flood(model, 5, 960, 20, *FLOOD_CAP)
    with tempfile.TemporaryDirectory() as tmp:
        slow = slow_handoff(model, Path(tmp))
        full = full_decode(model, Path(tmp))
        untold = restart_under_flood(model, Path(tmp), router_peers=False)
        told = restart_under_flood(model, Path(tmp), router_peers=True)
    if json_lines:
        print(json.dumps({"scenario": "big prompts", **asdict(big)}))
        print(json.dumps({"scenario": "http flood", **asdict(flood)}))
        print(json.dumps({"scenario": "slow handoff", **asdict(slow)}))
        print(json.dumps({"scenario": "full decode", **asdict(full)}))
        for r in (untold, told):
            print(json.dumps({"scenario": "restart under flood", **asdict(r)}))
        return 0
    print(f"hostile clients on network namespaces, model {model.name}")
    print(f"{big.prompts} concurrent prompts of {big.chars:,} characters: answered {big.statuses} "
          f"{big.codes} in {big.seconds:.2f} s; peak memory +{big.peak_growth_mib:.0f} MiB, "
          f"kept +{big.kept_mib:.0f} MiB")  # fmt: skip
    print(f"{flood.sources} addresses x {flood.per_source} trickled connections: "
          f"{flood.answered}/{flood.probes} probes from a sixth address answered "
          f"(attackers' sockets {flood.attacker_sockets}, {flood.cut} cut)")  # fmt: skip
    long = "completed" if slow.long_status == 200 else f"failed {slow.long_status} {slow.long_code}"
    print(f"a {slow.prompt_tokens}-token prompt over a {slow.rate}/s prefill link: {long} in "
          f"{slow.long_s:.1f} s; meanwhile {slow.shorts_ok}/{slow.shorts} short requests, p50 "
          f"{slow.short_p50_s:.2f} s, p95 {slow.short_p95_s:.2f} s {slow.short_codes}")  # fmt: skip
    print(f"a member holding {full.filled} of decode-0's slots: {full.ok}/{full.requests} "
          f"requests served {full.codes}")  # fmt: skip
    for r in (untold, told):
        back = "not back" if r.back_s is None else f"back in {r.back_s:.1f} s"
        how = "told the router (--router-peers)" if r.router_peers else "not told the router"
        print(f"decode-1 restarted under a {r.flood_s:g} s pending flood from {r.sources} "
              f"addresses, {how}: {back}")  # fmt: skip
    return 0
