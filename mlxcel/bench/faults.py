"""``bench faults``: what a silent or stopped peer costs, measured on real network stacks.

Clusters run as processes on hosts built from network namespaces (:mod:`mlxcel.bench.netns`)
while a client sends a steady trickle of requests from the router's (or coordinator's) host.
Each fault is applied at ``t = 0``:

- ``silent decode``: a decode node's cable is pulled (no reset is ever sent);
- ``silent prefill``: the only prefill node's cable is pulled;
- ``silent stage``: a pipeline stage's cable is pulled;
- ``stopped decode``: a decode node's process is stopped (SIGSTOP).

and undone (heal / SIGCONT) once the cluster has noticed. Measured, per fault: when the
cluster marked the peer down (``detect_s``), when a client first got a 503 for a request sent
after the fault (``first_503_s``; none where another node can serve), how many requests
failed after being admitted (``lost``: an in-band error, a 5xx other than a 503 refusal, a
timeout) and how many were refused with 503 (``refused``), the longest any request waited
(``longest_s``), and how long after the heal it served again (``recover_s``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.bench.netns import Hosts
from mlxcel.bench.netns_nodes import (
    CLUSTER_PORT,
    HTTP_PORT,
    Client,
    Load,
    NodeProc,
    enter_netns,
    keygen,
    wait_for,
)
from mlxcel.reactor.faults import Fault, applied

__all__ = [
    "Client",
    "Cluster",
    "FaultResult",
    "bringup_cluster",
    "disagg_cluster",
    "enter_netns",
    "keygen",
    "node_healthy",
    "pipeline_cluster",
    "pipeline_ready",
    "run_bench",
    "run_fault",
    "wait_for",
]


@dataclass
class Cluster:
    hosts: Hosts
    procs: dict[str, NodeProc]
    client: Client

    def close(self) -> None:
        self.client.close()
        for p in reversed(list(self.procs.values())):
            p.stop()


# The HTTP side of the node that serves it, on its host's 127.0.0.1.
SERVE_HTTP = ["--host", "127.0.0.1", "--port", str(HTTP_PORT), "--served-model-name", "m"]
# (name, host, serve arguments, the log line that says it is ready), in start order.
Start = tuple[str, int, list[str], str]


@contextmanager
def running(hosts: Hosts, starts: list[Start]) -> Iterator[Cluster]:
    """Start each node in order (the HTTP one last, on host 0); stop them all at the end, or
    at once if one fails to start."""
    procs: dict[str, NodeProc] = {}
    try:
        for name, host, args, ready in starts:
            procs[name] = NodeProc(hosts, host, args, ready)
        cluster = Cluster(hosts, procs, Client(hosts, 0, f"http://127.0.0.1:{HTTP_PORT}"))
    except BaseException:
        for p in procs.values():
            p.stop()
        raise
    try:
        yield cluster
    finally:
        cluster.close()


@contextmanager
def disagg_cluster(model: Path, secret: Path, n_decode: int = 2) -> Iterator[Cluster]:
    """Router on host 0 (HTTP on its 127.0.0.1), one prefill on host 1, decode nodes after."""
    with Hosts(2 + n_decode, net=77) as hosts:
        addr = [f"{hosts.ip(i)}:{CLUSTER_PORT}" for i in range(hosts.n)]
        common = ["-m", str(model), "--cluster-secret-file", str(secret)]

        def worker(name: str, i: int, role: str) -> Start:
            return (
                name,
                i,
                [*common, "--node-role", role, "--serving-bind", addr[i]],
                f"mlxcel {role} node",
            )

        router = [*common, "--node-role", "router", "--serving-bind", addr[0],
                  "--prefill-peers", addr[1], "--decode-peers", ",".join(addr[2:]),
                  *SERVE_HTTP, "--parallel", "64"]  # fmt: skip
        starts = [worker("prefill", 1, "prefill")]
        starts += [worker(f"decode-{d}", 2 + d, "decode") for d in range(n_decode)]
        with running(hosts, [*starts, ("router", 0, router, "mlxcel serving")]) as cluster:
            yield cluster


@contextmanager
def pipeline_cluster(
    model: Path, secret: Path, tmp: Path, extra_hosts: int = 0, net: int = 78
) -> Iterator[Cluster]:
    """A 2-stage pipeline from a cluster TOML: coordinator on host 0, stage-i on host i+1
    (and ``extra_hosts`` hosts after them that run no node)."""
    with Hosts(3 + extra_hosts, net=net) as hosts:
        lines = [
            'name = "faults"',
            "pipeline_parallel_size = 2",
            "[cluster]",
            f'secret_file = "{secret}"',
            "",
            "[[nodes]]",
            'id = "coordinator"',
            'role = "coordinator"',
            f'address = "{hosts.ip(0)}:{CLUSTER_PORT}"',
        ]
        for s in range(2):
            lines += ["", "[[nodes]]", f'id = "stage-{s}"', 'role = "stage"']
            lines.append(f'address = "{hosts.ip(s + 1)}:{CLUSTER_PORT}"')
        cfg = tmp / "faults-cluster.toml"
        cfg.write_text("\n".join(lines) + "\n")
        common = ["-m", str(model), "--distributed-config", str(cfg)]
        starts: list[Start] = [
            (f"stage-{s}", s + 1, [*common, "--node-id", f"stage-{s}"], "mlxcel stage")
            for s in range(2)
        ]
        coordinator = [*common, "--node-id", "coordinator", *SERVE_HTTP]
        with running(hosts, [*starts, ("coordinator", 0, coordinator, "mlxcel serving")]) as c:
            yield c


@contextmanager
def bringup_cluster(model: Path, secret: Path, tmp: Path) -> Iterator[Cluster]:
    """Zero-config bring-up across the bridge: two ``--pp-peer`` hosts announce themselves
    with beacons to the subnet's broadcast address; ``--pp-auto 2`` on host 0 finds them,
    assigns the stages and serves HTTP on its 127.0.0.1."""
    with Hosts(3, net=80) as hosts:
        common = ["-m", str(model), "--cluster-secret-file", str(secret)]
        beacons = ["--cluster-discovery", "mdns",
                   "--cluster-discovery-target", f"10.{hosts.net}.0.255"]  # fmt: skip
        starts: list[Start] = [
            (
                f"peer-{i}",
                i,
                [
                    *common,
                    "--pp-peer",
                    *beacons,
                    "--cluster-control-addr",
                    f"{hosts.ip(i)}:19001",
                    "--cluster-config-out",
                    str(tmp / f"peer-{i}.toml"),
                ],
                "mlxcel peer waiting",
            )
            for i in (1, 2)
        ]
        coordinator = [*common, "--pp-auto", "2", *beacons,
                       "--cluster-control-addr", f"{hosts.ip(0)}:19000",
                       "--cluster-config-out", str(tmp / "cluster.toml"), *SERVE_HTTP]  # fmt: skip
        with running(hosts, [*starts, ("coordinator", 0, coordinator, "mlxcel serving")]) as c:
            yield c


def node_healthy(c: Cluster, node_id: str) -> bool | None:
    status, body = c.client.get("/router/stats")
    for n in body.get("nodes", []):
        if n.get("id") == node_id:
            return bool(n.get("healthy"))
    return None


def pipeline_ready(c: Cluster) -> bool:
    return c.client.get("/health")[0] == 200


@dataclass
class FaultResult:
    fault: str
    detect_s: float | None
    first_503_s: float | None
    lost: int
    refused: int
    served: int
    longest_s: float
    recover_s: float | None
    detail: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        def f(v: float | None) -> str:
            return "never" if v is None else f"{v:.2f}"

        return (
            f"{self.fault:<16} {f(self.detect_s):>9} {f(self.first_503_s):>10} {self.lost:>5} "
            f"{self.refused:>8} {self.served:>7} {self.longest_s:>9.2f} {f(self.recover_s):>10}"
        )


HEADER = (
    f"{'fault':<16} {'detect_s':>9} {'first_503':>10} {'lost':>5} {'refused':>8} "
    f"{'served':>7} {'longest_s':>9} {'recover_s':>10}"
)


def run_fault(
    c: Cluster,
    fault: Fault,
    down: Callable[[], bool],
    up: Callable[[], bool],
    *,
    detect_within: float = 20.0,
    hold: float = 1.0,
) -> FaultResult:
    """Apply ``fault`` under load, time its detection, undo it, time the recovery. The fault
    is driven by what the cluster does (undone once noticed), not by a clock."""
    with Load(c.client) as load:
        time.sleep(1.0)  # steady state first
        t0 = time.monotonic()
        with applied(fault):
            detect = wait_for(down, detect_within)
            time.sleep(hold)  # requests meet the known-down state
        t_heal = time.monotonic()
        recover = wait_for(lambda: up() and c.client.complete().status == 200, 30.0)
        time.sleep(0.5)
    after = [o for o in load.outcomes if o.sent >= t0 - 0.5]  # in flight at the fault, or later
    first_503 = next(
        (o.done - t0 for o in after if o.sent >= t0 and o.status == 503 and o.retry_after), None
    )
    # Lost: admitted before the cluster knew, and not served. Refused: a 503 with Retry-After
    # for a request that came once it knew (what a client should get then).
    known = t0 + (detect if detect is not None else float("inf"))
    lost = sum(1 for o in after if o.sent < known and o.status != 200)
    refused = sum(1 for o in after if o.sent >= known and o.status == 503 and o.retry_after)
    served = sum(1 for o in after if o.status == 200)
    longest = max((o.done - o.sent for o in after), default=0.0)
    statuses: dict[int, int] = {}
    for o in after:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    slow = [(round(o.sent - t0, 2), round(o.done - o.sent, 2), o.status) for o in after]
    slow = [x for x in slow if x[1] > 5.0]
    return FaultResult(
        fault.name,
        detect,
        first_503,
        lost,
        refused,
        served,
        longest,
        recover,
        {"heal_at_s": round(t_heal - t0, 2), "statuses": statuses, "slow": slow[:5]},
    )


def disagg_faults(model: Path, secret: Path) -> list[FaultResult]:
    with disagg_cluster(model, secret) as c:
        h, dec = c.hosts, c.procs["decode-1"]

        def watch(node: str) -> tuple[Callable[[], bool], Callable[[], bool]]:
            return lambda: node_healthy(c, node) is False, lambda: node_healthy(c, node) is True

        return [
            run_fault(c, h.cable_pulled(3, "silent decode"), *watch("decode-1")),
            run_fault(c, dec.stopped("stopped decode"), *watch("decode-1")),
            run_fault(c, h.cable_pulled(1, "silent prefill"), *watch("prefill-0")),
        ]


def pipeline_faults(model: Path, secret: Path, tmp: Path) -> list[FaultResult]:
    with pipeline_cluster(model, secret, tmp) as c:
        silent = c.hosts.cable_pulled(2, "silent stage")
        return [run_fault(c, silent, lambda: not pipeline_ready(c), lambda: pipeline_ready(c))]


def run_bench(model: Path, json_lines: bool = False) -> int:
    """``bench faults``: every fault above, one line each (or one JSON object each)."""
    import dataclasses
    import tempfile

    from mlxcel.bench.netns import unavailable

    why = unavailable()
    if why is not None:
        print(f"bench faults: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        secret = keygen(Path(tmp) / "cluster.secret")
        rows = disagg_faults(model, secret) + pipeline_faults(model, secret, Path(tmp))
    if json_lines:
        for r in rows:
            print(json.dumps(dataclasses.asdict(r)))
        return 0
    print(
        f"faults on network namespaces, model {model.name}; a request every 0.1 s; seconds from the fault"
    )
    print(HEADER)
    for r in rows:
        print(r.row())
    return 0
