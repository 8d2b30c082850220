"""Outsiders without the secret, on network namespaces: what a flood costs the cluster.

- *discovery under a beacon flood*: two ``--pp-peer`` hosts beacon to the subnet broadcast
  while ``k`` other hosts send forged beacons to the coordinator's discovery port as fast as
  one process each can; a ``--pp-auto 2 --dry-run`` coordinator runs discovery (and the
  handshake with each peer) and exits. The figure is the time from its first line to the
  second peer counted, with no flood and with one.
- *first dials under a pending-pool flood*: a 2-stage pipeline, and an attacker host with ten
  addresses holding eight silent connections each to stage-1's cluster port, reopened as soon
  as they are closed, from before stage-0 ever dialed stage-1. The figure is how many requests
  succeed and how long the first one took.

``python -m mlxcel bench floods`` prints them (docs/security.md explains them).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mlxcel.bench.faults import CLUSTER_PORT, pipeline_cluster
from mlxcel.bench.netns import Hosts
from mlxcel.bench.netns_nodes import NodeProc, keygen
from mlxcel.bringup.beacon import BEACON_PORT

ATTACK = [sys.executable, "-m", "mlxcel.bench.attacks"]
FOUND = re.compile(r"discovery: peer \S+ \(2 of 2\)")


@dataclass
class Discovery:
    flooders: int
    seconds: float | None  # None: discovery did not finish
    exit_code: int
    sent: int  # forged datagrams the flooders sent
    log: list[str]


def _timed_lines(p: subprocess.Popen[str], out: list[tuple[float, str]]) -> None:
    assert p.stdout is not None
    for line in p.stdout:
        out.append((time.monotonic(), line))


def discover(hosts: Hosts, model: Path, secret: Path, flooders: list[int]) -> Discovery:
    """One dry-run discovery on host 0 while ``flooders`` hosts flood it."""
    floods = [
        hosts.spawn(
            i,
            [*ATTACK, "beacons", hosts.ip(0), str(BEACON_PORT), "40"],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in flooders
    ]
    time.sleep(1.0 if floods else 0.0)  # the flood is under way before the coordinator starts
    argv = [sys.executable, "-m", "mlxcel", "serve", "-m", str(model), "--pp-auto", "2",
            "--dry-run", "--cluster-secret-file", str(secret), "--cluster-discovery", "mdns",
            "--cluster-control-addr", f"{hosts.ip(0)}:19000",
            "--cluster-config-out", str(secret.parent / "dry.toml")]  # fmt: skip
    lines: list[tuple[float, str]] = []
    started = time.monotonic()
    p = hosts.spawn(0, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=_timed_lines, args=(p, lines), daemon=True)
    reader.start()
    try:
        code = p.wait(90)
    except subprocess.TimeoutExpired:
        p.kill()
        code = p.wait()
    reader.join(5)
    sent = 0
    for f in floods:
        f.terminate()
        out, _ = f.communicate(10)
        sent += json.loads(out or "{}").get("sent", 0) if out.strip() else 0
    listening = next((t for t, line in lines if "discovery: listening" in line), started)
    found = next((t for t, line in lines if FOUND.search(line)), None)
    return Discovery(
        len(flooders),
        None if found is None else found - listening,
        code,
        sent,
        [line for _, line in lines],
    )


def beacon_flags(hosts: Hosts) -> list[str]:
    """Beacon discovery to the bridge's broadcast address."""
    return ["--cluster-discovery", "mdns", "--cluster-discovery-target", f"10.{hosts.net}.0.255"]


def beaconing_peer(hosts: Hosts, i: int, model: Path, secret: Path) -> NodeProc:
    """A ``--pp-peer`` on host ``i`` (port 19001), beaconing, started and waiting."""
    args = ["-m", str(model), "--pp-peer", "--cluster-secret-file", str(secret),
            *beacon_flags(hosts), "--cluster-control-addr", f"{hosts.ip(i)}:19001"]  # fmt: skip
    return NodeProc(hosts, i, args, "mlxcel peer waiting")


def discovery_runs(model: Path, secret: Path, n_flooders: int = 3) -> list[Discovery]:
    """Peers on hosts 1-2, flooders on hosts 3..; no flood, then the flood."""
    with Hosts(3 + n_flooders, net=81) as hosts:
        peers = [beaconing_peer(hosts, i, model, secret) for i in (1, 2)]
        try:
            quiet = discover(hosts, model, secret, [])
            flood = discover(hosts, model, secret, list(range(3, 3 + n_flooders)))
        finally:
            for p in peers:
                p.stop()
    return [quiet, flood]


@dataclass
class PendingFlood:
    requests: int
    ok: int
    first_s: float | None
    attacker: dict[str, int]
    stage0_log: list[str]


def pending_flood(model: Path, secret: Path, tmp: Path, requests: int = 5) -> PendingFlood:
    """The pipeline's first requests while an outsider holds stage-1's pending slots."""
    with pipeline_cluster(model, secret, tmp, extra_hosts=1, net=82) as c:
        h = c.hosts
        sources = h.add_addresses(3, 10)
        attacker = h.spawn(3, [*ATTACK, "pending", h.ip(2), str(CLUSTER_PORT), "60", "8",
                               *sources], stdout=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(3.0)  # every slot it can take is taken
        outcomes = []
        for _ in range(requests):
            outcomes.append(c.client.complete(max_tokens=4, timeout=60))
        attacker.terminate()
        out, _ = attacker.communicate(10)
        stats = json.loads(out) if out.strip() else {}
        ok = [o for o in outcomes if o.status == 200]
        o = outcomes[0]
        first = o.done - o.sent if o.status == 200 else None
        return PendingFlood(requests, len(ok), first, stats, list(c.procs["stage-0"].lines))


@dataclass
class Replay:
    victim: str  # the departed peer's address
    plan: str  # what the dry run planned
    exit_code: int
    replayed: dict[str, int]
    log: list[str]


def replayed_departed_peer(model: Path, secret: Path, tmp: Path) -> Replay:
    """Peer 1 beacons and an attacker (host 4) records it; peer 1 leaves the network; the
    attacker replays its beacons forged from its address while a ``--dry-run`` coordinator
    discovers; peers 2 and 3 are alive (3 starts late). The plan must be 2 and 3."""
    with Hosts(5, net=83) as hosts:
        beacons = beacon_flags(hosts)

        def peer(i: int) -> NodeProc:
            return beaconing_peer(hosts, i, model, secret)

        victim, live = peer(1), [peer(2)]
        captured = tmp / "captured.hex"
        cap = hosts.spawn(4, [*ATTACK, "capture", hosts.ip(1), str(BEACON_PORT), "4",
                              str(captured)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        cap.communicate(30)
        victim.stop()
        hosts.partition(1)  # gone: nothing answers at its address any more
        replay = hosts.spawn(4, [*ATTACK, "replay", hosts.ip(0), str(BEACON_PORT), "60",
                                 str(captured), hosts.ip(1)], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
        argv = [sys.executable, "-m", "mlxcel", "serve", "-m", str(model), "--pp-auto", "2",
                "--dry-run", "--cluster-secret-file", str(secret), *beacons,
                "--cluster-control-addr", f"{hosts.ip(0)}:19000",
                "--cluster-config-out", str(tmp / "replay-plan.toml")]  # fmt: skip
        coord = hosts.spawn(0, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(6.0)  # the replayed peer is checked and dropped before peer 3 comes
            live.append(peer(3))
            out, _ = coord.communicate(timeout=60)
        finally:
            if coord.poll() is None:
                coord.kill()
                out, _ = coord.communicate()
            replay.terminate()
            rout, _ = replay.communicate(10)
            for p in live:
                p.stop()
        plan_file = tmp / "replay-plan.toml"
        return Replay(
            f"{hosts.ip(1)}:19001",
            plan_file.read_text() if plan_file.exists() else "",
            coord.returncode,
            json.loads(rout) if rout.strip() else {},
            out.splitlines(),
        )


def run_bench(model: Path, json_lines: bool = False) -> int:
    """``bench floods``: discovery under a beacon flood, first dials under a pending flood."""
    import dataclasses
    import tempfile

    from mlxcel.bench.netns import unavailable

    why = unavailable()
    if why is not None:
        print(f"bench floods: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        secret = keygen(Path(tmp) / "cluster.secret")
        runs = discovery_runs(model, secret)
        pend = pending_flood(model, secret, Path(tmp))
    if json_lines:
        for r in runs:
            print(json.dumps({**dataclasses.asdict(r), "log": r.log[-20:]}))
        print(json.dumps({**dataclasses.asdict(pend), "stage0_log": []}))
        return 0
    print(f"floods without the secret on network namespaces, model {model.name}")
    for r in runs:
        took = "did not finish" if r.seconds is None else f"{r.seconds:.2f} s"
        print(f"discovery of 2 peers, {r.flooders} flooding hosts ({r.sent:,} forged beacons "
              f"sent): {took}")  # fmt: skip
        for line in r.log:
            if "discovery: ended; meanwhile" in line or "discovery failed" in line:
                print("   ", line.rstrip().split("discovery: ", 1)[-1])
    first = "failed" if pend.first_s is None else f"{pend.first_s:.2f} s"
    print(f"pipeline under a pending-pool flood (10 addresses x 8): {pend.ok}/{pend.requests} "
          f"requests ok, first {first}; attacker {pend.attacker}")  # fmt: skip
    return 0
