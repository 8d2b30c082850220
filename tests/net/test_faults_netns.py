"""Silent peers on real network stacks: hosts are network namespaces on one bridge.

A partition unplugs a host's cable from the bridge (no reset, no FIN ever arrives); a stopped
process is SIGSTOPped. Each test runs a cluster as ``python -m mlxcel serve`` processes, one
per host, with a client sending a request every 0.1 s from the router's (coordinator's) host,
and checks what the issue asks: the node is marked down within seconds, a request that cannot
be served gets 503 with Retry-After at once, no client waits long, and the cluster serves again
soon after the heal. Bounds here are loose on purpose (a busy 2-core CI host); ``bench faults``
prints the measured times.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mlxcel.bench.faults import (
    FaultResult,
    bringup_cluster,
    disagg_cluster,
    node_healthy,
    pipeline_cluster,
    pipeline_ready,
    run_fault,
    wait_for,
)
from mlxcel.bench.netns import unavailable
from mlxcel.pipeline.cluster_config import load_cluster_config
from mlxcel.reactor.faults import applied

why = unavailable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")

DETECT = 6.5  # the 5 s, plus the poll interval and a loaded host's slack
LONGEST = 10.0  # no client waits anywhere near --request-timeout (600 s) or 30 s


def check_silent(r: FaultResult, *, refused: bool) -> None:
    assert r.detect_s is not None and r.detect_s < DETECT, r
    assert r.longest_s < LONGEST, r
    assert r.recover_s is not None and r.recover_s < 10.0, r
    if refused:  # nothing else can serve: 503 with Retry-After once it is known
        assert r.first_503_s is not None and r.first_503_s < r.detect_s + 1.0, r
        assert r.refused > 0, r


def test_a_disaggregated_cluster_notices_silent_stopped_and_killed_nodes(
    tiny: Path, secret: Path
) -> None:
    with disagg_cluster(tiny, secret) as c:
        h = c.hosts
        decode1_down = lambda: node_healthy(c, "decode-1") is False  # noqa: E731
        decode1_up = lambda: node_healthy(c, "decode-1") is True  # noqa: E731
        # A decode node's cable pulled: out of rotation in seconds; the other serves.
        r = run_fault(c, h.cable_pulled(3, "silent decode"), decode1_down, decode1_up)
        check_silent(r, refused=False)
        assert r.served > 0
        # The same node stopped (SIGSTOP), then continued.
        dec = c.procs["decode-1"]
        r = run_fault(c, dec.stopped("stopped decode"), decode1_down, decode1_up)
        check_silent(r, refused=False)
        # The only prefill node's cable pulled: 503 with Retry-After, never a long wait.
        r = run_fault(
            c,
            h.cable_pulled(1, "silent prefill"),
            lambda: node_healthy(c, "prefill-0") is False,
            lambda: node_healthy(c, "prefill-0") is True,
        )
        check_silent(r, refused=True)
        status, body = c.client.get("/router/stats")
        assert status == 200 and "10.77." not in str(body)  # ids, never addresses
        # A slow link (1 Mbit/s) to a decode node is slow, not dead: it stays in rotation.
        with applied(h.slow_link(2, "1mbit", "slow decode link")):
            outcomes = [c.client.complete() for _ in range(6)]
            assert all(o.status == 200 for o in outcomes), outcomes
            assert node_healthy(c, "decode-0") is True
        # Killed (a reset arrives): marked down at once, and the cluster keeps serving.
        dec.signal(signal.SIGKILL)
        assert wait_for(decode1_down, DETECT) is not None
        after_kill = [c.client.complete() for _ in range(4)]
        assert all(o.status == 200 for o in after_kill), after_kill


def test_a_pipeline_refuses_at_once_while_a_stage_is_silent_and_serves_after_the_heal(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    with pipeline_cluster(tiny, secret, tmp_path) as c:
        h = c.hosts
        r = run_fault(
            c,
            h.cable_pulled(2, "silent stage"),
            lambda: not pipeline_ready(c),
            lambda: pipeline_ready(c),
        )
        check_silent(r, refused=True)
        # While a stage is stopped, /health answers at once from state (503, degraded), and
        # neither it nor a refusal shows an internal address.
        stage = c.procs["stage-1"]
        with applied(stage.stopped("stopped stage")):
            assert wait_for(lambda: not pipeline_ready(c), DETECT) is not None
            status, body = c.client.get("/health")
            assert status == 503, body
            assert body["status"] == "degraded" and "10.78." not in str(body), body
            assert body["pipeline"]["stages"][1]["id"] == "stage-1"
            refusal = c.client.complete()
            assert (refusal.status, refusal.retry_after) == (503, True)
            assert "stage-1" in refusal.body and "10.78." not in refusal.body, refusal.body
            assert refusal.done - refusal.sent < LONGEST  # refused, never left waiting
        assert wait_for(lambda: pipeline_ready(c), 10.0) is not None
        assert c.client.complete().status == 200
        # A slow link (1 Mbit/s) to a stage is slow, not dead: it keeps serving.
        with applied(h.slow_link(2, "1mbit", "slow stage link")):
            assert all(c.client.complete().status == 200 for _ in range(4))
            assert pipeline_ready(c)
        # Killed (a reset arrives): down at once, and refused at once.
        stage.signal(signal.SIGKILL)
        assert wait_for(lambda: not pipeline_ready(c), DETECT) is not None
        refusal = c.client.complete()
        assert (refusal.status, refusal.retry_after) == (503, True), refusal


def test_a_pipeline_brought_up_by_beacons_across_the_bridge_notices_a_silent_stage(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    """``--pp-auto`` discovery on real network stacks (beacons broadcast on the bridge), then
    the pipeline it brought up loses a stage's cable and gets it back."""
    with bringup_cluster(tiny, secret, tmp_path) as c:
        assert c.client.complete().status == 200
        # Which peer became stage-1 is the coordinator's choice: partition that host.
        stage1 = load_cluster_config(tmp_path / "cluster.toml").node("stage-1").host
        host = [c.hosts.ip(i) for i in range(3)].index(stage1)
        assert host in (1, 2)
        r = run_fault(
            c,
            c.hosts.cable_pulled(host, "silent stage (bring-up)"),
            lambda: not pipeline_ready(c),
            lambda: pipeline_ready(c),
        )
        check_silent(r, refused=True)


def test_dials_to_silent_hosts_give_up_at_the_handshake_timeout_and_are_capped() -> None:
    """200 silent destinations once left 200 dials in SYN-SENT for minutes and held up a real
    request 13 s: a dial that hears nothing now gives up after the handshake timeout, and at
    most ``max_dials`` run at once (the rest wait their turn within their deadline)."""
    import asyncio
    import threading

    from mlxcel.bench.faults import enter_netns
    from mlxcel.bench.netns import Hosts
    from mlxcel.net.pool import Backoff, ConnectionPool
    from mlxcel.net.secret import ClusterSecret
    from mlxcel.reactor.bus import Node
    from mlxcel.wire.handshake import Identity

    secret = ClusterSecret(b"netns-dial-tests-cluster-secret-1", "test")
    out: dict[str, object] = {}
    with Hosts(2, net=79) as h:
        h.partition(1)  # host 1 exists on the subnet, but nothing reaches it

        async def dial() -> None:
            async with Node("dialer") as node:
                pool = ConnectionPool(
                    node,
                    secret,
                    Identity(h.ip(0), 7000, "d"),
                    backoff=Backoff(attempts=1),
                    handshake_timeout=0.5,
                    max_dials=2,
                )
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                got = await asyncio.gather(
                    *(pool.get(h.ip(1), 7000 + i, loop.time() + 10) for i in range(4)),
                    return_exceptions=True,
                )
                out["took"] = loop.time() - t0
                out["errors"] = [str(e) for e in got]
                out["waited"] = pool.dials_waited

        def in_host() -> None:
            enter_netns(h.names[0])
            asyncio.run(dial())

        t = threading.Thread(target=in_host)
        t.start()
        t.join(30)
    errors = out["errors"]
    assert isinstance(errors, list) and len(errors) == 4
    assert all("no answer within 0.5s" in e for e in errors), errors
    assert out["waited"] == 2  # two dials waited for a slot
    # Two rounds of the 0.5 s handshake deadline (the loop's timers never fire early), not
    # the kernel's minutes of SYN retries.
    assert LONGEST > float(out["took"]) >= 1.0, out
