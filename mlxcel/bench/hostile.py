"""``bench hostile``: what a heavy client or a few addresses cost a serving node, measured.

Each scenario runs real ``mlxcel serve`` processes on network-namespace hosts
(:mod:`mlxcel.bench.netns`) and reports figures; the tests run the same scenarios and hold
them to the targets. Here, one serving node against its clients:

- ``big prompts``: ``n`` concurrent prompts of ``chars`` characters each (under the body
  cap, each far over the context): what the clients were answered, and how far the server's
  peak resident memory rose above where it stood before (``peak_growth_mib``) and what
  stayed afterwards (``kept_mib``);
- ``http flood``: ``sources`` addresses each open ``per_source`` connections and trickle
  header bytes on them, while a further address probes ``/health``: how many probes were
  answered, and what the attackers held.

A disaggregated cluster against a slow link, a faulty member and a flood:
:mod:`mlxcel.bench.hostile_cluster`.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxcel.bench.hostile_cluster import (
    full_decode,
    memory,
    message_flood,
    post,
    restart_under_flood,
    slow_handoff,
)
from mlxcel.bench.netns import Hosts
from mlxcel.bench.netns_nodes import HTTP_PORT, NodeProc, enter_netns

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
        before = memory(pid)["VmRSS"]
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts from here
        url = f"http://127.0.0.1:{HTTP_PORT}/v1/completions"
        t0 = time.monotonic()
        with ThreadPoolExecutor(n, initializer=enter_netns, initargs=(hosts.names[0],)) as pool:
            answers = list(pool.map(lambda _: post(url, body, 120.0), range(n)))
        seconds = time.monotonic() - t0
        peak = memory(pid)["VmHWM"]
        time.sleep(1.0)
        after = memory(pid)["VmRSS"]
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

        def folder(name: str) -> Path:
            """A folder of its own per scenario: each writes its own cluster secret."""
            (Path(tmp) / name).mkdir()
            return Path(tmp) / name

        slow = slow_handoff(model, folder("slow"))
        full = full_decode(model, folder("full"))
        untold = restart_under_flood(model, folder("untold"), router_peers=False)
        told = restart_under_flood(model, folder("told"), router_peers=True)
        messages = message_flood(model, folder("messages"))
    if json_lines:
        print(json.dumps({"scenario": "big prompts", **asdict(big)}))
        print(json.dumps({"scenario": "http flood", **asdict(flood)}))
        print(json.dumps({"scenario": "slow handoff", **asdict(slow)}))
        print(json.dumps({"scenario": "full decode", **asdict(full)}))
        for r in (untold, told):
            print(json.dumps({"scenario": "restart under flood", **asdict(r)}))
        print(json.dumps({"scenario": "message flood", **asdict(messages)}))
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
    m = messages
    print(f"a member's {m.messages} messages of {m.mib} MiB over {m.connections} connections in "
          f"{m.seconds:.1f} s: decode node resident {m.base_mib:.0f} MiB before, peak "
          f"{m.peak_mib:.0f} MiB, kept +{m.kept_mib:.0f} MiB {m.settle_s:g} s after")  # fmt: skip
    return 0
