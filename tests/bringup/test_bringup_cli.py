"""Zero-config bring-up with real processes on 127.0.0.x: ``serve --pp-auto`` and
``serve --pp-peer``, static and beacon discovery, and every way a bring-up must fail
without starting a stage."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from mlxcel import __version__
from mlxcel.base.messages import AssignOffer, AssignRefused
from mlxcel.bringup.launch import PEER_LIMITS
from mlxcel.net.listener import ClusterListener
from mlxcel.net.pool import ConnectionPool
from mlxcel.net.secret import load_cluster_secret
from mlxcel.pipeline.cluster_config import load_cluster_config
from mlxcel.reactor.bus import Node, Origin
from mlxcel.wire.handshake import Channel, Identity
from tests.conftest import free_port, free_udp_port, mlx_mapped

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3"
MESSAGES = [{"role": "user", "content": "Tell me about zero-config clusters"}]


class Proc:
    """``python -m mlxcel serve ARGS`` in ``cwd``; output collected line by line."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.p = subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env={**os.environ, "MLXCEL_LOG_LEVEL": "DEBUG"},
        )
        self.lines: list[str] = []
        # A reader thread, so a wait for a line that never comes ends at its timeout.
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, prefix: str, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)  # stays at the end for later readers
                break
            self.lines.append(line)
            if prefix in line:
                return line
        raise AssertionError(f"never saw {prefix!r}:\n" + self.text)

    def _drain(self) -> None:
        while True:
            try:
                line = self._queue.get(timeout=5)
            except queue.Empty:
                return
            if line is None:
                self._queue.put(None)
                return
            self.lines.append(line)

    def finish(self, timeout: float = 120.0) -> int:
        """Wait for the process to exit on its own; collect the rest of its output."""
        self.p.wait(timeout)
        self._drain()
        return self.p.returncode

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._drain()
        return self.p.returncode


def keygen(path: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "mlxcel", "keygen", "--out", str(path)], check=True, timeout=60
    )
    return path


@pytest.fixture(scope="module")
def other_secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return keygen(tmp_path_factory.mktemp("other") / "other.secret")


@pytest.fixture(scope="module")
def reference(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The single-process greedy answer through the same API."""
    port = free_port()
    p = Proc(["-m", str(tiny), "--port", str(port), "--served-model-name", MODEL], ROOT)
    try:
        p.wait_for("mlxcel serving")
        return chat(port)
    finally:
        p.stop()


def chat(port: int) -> str:
    c = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
    )
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


def peer(tiny: Path, secret: Path, cwd: Path, *extra: str) -> Proc:
    p = Proc(["-m", str(tiny), "--pp-peer", "--cluster-secret-file", str(secret), *extra], cwd)
    p.wait_for("mlxcel peer waiting for a stage assignment")
    return p


def coordinator(tiny: Path, secret: Path, cwd: Path, n: int, *extra: str) -> Proc:
    args = ["-m", str(tiny), "--pp-auto", str(n), "--cluster-secret-file", str(secret)]
    return Proc([*args, "--served-model-name", MODEL, *extra], cwd)


def test_static_bring_up_serves_like_one_process(
    tiny: Path, secret: Path, reference: str, tmp_path: Path
) -> None:
    addrs = [f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (3, 2)]
    control = f"127.0.0.1:{free_port()}"
    common = ["--cluster-peers", ",".join(addrs), "--cluster-control-addr", control]
    peers = [
        peer(tiny, secret, tmp_path / f"p{i}", "--cluster-control-addr", a)
        for i, a in enumerate(addrs)
    ]
    # The dry run offers, learns what each peer can hold, plans, aborts its offers (the peers
    # wait again) and writes the same file the real run writes.
    dry = coordinator(tiny, secret, tmp_path, 2, *common, "--dry-run")
    assert dry.finish() == 0, dry.text
    planned = (tmp_path / ".mlxcel" / "cluster.toml").read_bytes()
    assert planned.decode() in dry.text  # printed too
    assert "memory_gb = " in planned.decode()  # the split follows the peers' memory
    assert "stage     layers           bytes   share          memory" in dry.text
    for p in peers:
        p.wait_for("assignment aborted by")
    port = free_port()
    coord = coordinator(tiny, secret, tmp_path, 2, *common, "--port", str(port))
    try:
        coord.wait_for("mlxcel serving")
        for p in peers:
            p.wait_for("mlxcel stage")
        assert chat(port) == reference
        # The coordinator brought the cluster up and serves it with no model: no MLX loaded.
        assert not mlx_mapped(coord.p.pid)
        # The one client script: every parameter, one node's answers.
        from tests import parity

        want = asyncio.run(parity.one_node(tiny, MODEL))
        got = asyncio.run(parity.against(f"http://127.0.0.1:{port}", MODEL))
        parity.assert_same(got, want, "pp-auto (static bring-up)")
        # byte for byte what the dry run wrote: the rerun reproduces the coordinator's file
        assert (tmp_path / ".mlxcel" / "cluster.toml").read_bytes() == planned
        cfg = load_cluster_config(tmp_path / ".mlxcel" / "cluster.toml")
        # stage ids follow the lexicographic order of the peer addresses
        assert [s.address for s in cfg.stages] == sorted(addrs)
        body = planned.decode().split("\n\n", 1)[1]
        for i in range(2):
            f = tmp_path / f"p{i}" / ".mlxcel"
            (written,) = list(f.glob("cluster-stage-*.toml"))
            text = written.read_text()
            assert text.endswith(body) and not text.startswith(planned.decode()[:40])
            node_id = written.stem.removeprefix("cluster-")
            assert load_cluster_config(written).node(node_id).address == addrs[i]
        # The same command again: its stages serve (no peer waits), so it takes them back.
        assert coord.stop() == 0, coord.text
        coord = coordinator(tiny, secret, tmp_path, 2, *common, "--port", str(port))
        coord.wait_for("are serving (written by an earlier bring-up): serving as their coordinator")
        coord.wait_for("mlxcel serving")
        assert chat(port) == reference
        # With one stage gone it says which serve and what to do, at once.
        assert coord.stop() == 0, coord.text
        assert peers[0].stop() == 0
        again = coordinator(tiny, secret, tmp_path, 2, *common, "--port", str(port))
        assert again.finish(60) == 1, again.text
        assert (
            f"1 of 2 stages of the cluster in .mlxcel/cluster.toml are still serving ({addrs[1]}; not {addrs[0]})"
            in again.text
        )
        assert "--distributed-config .mlxcel/cluster.toml --node-id coordinator" in again.text
    finally:
        code = coord.stop()
        for p in peers:  # stopped whatever the coordinator did: never leak a peer
            p.stop()
        assert code == 0, coord.text


def test_ports_are_checked_before_any_peer_is_assigned_and_a_waiting_peer_ends_cleanly(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    """A coordinator whose HTTP or control port is taken fails before it offers anything (no
    stage left running); a peer waiting for an assignment exits 0 on SIGTERM."""
    import socket

    at = f"127.0.0.2:{free_port('127.0.0.2')}"
    p = peer(tiny, secret, tmp_path / "p", "--cluster-control-addr", at)
    http, control = free_port(), free_port()
    try:
        for busy, flags, what in (
            (http, [], f"cannot serve HTTP on 127.0.0.1:{http}"),
            (control, [], f"cannot listen for cluster connections on 127.0.0.1:{control}"),
        ):
            with socket.socket() as s:
                s.bind(("127.0.0.1", busy))
                s.listen()
                coord = coordinator(
                    tiny, secret, tmp_path, 1, "--cluster-peers", at, "--port", str(http),
                    "--cluster-control-addr", f"127.0.0.1:{control}", *flags,
                )  # fmt: skip
                assert coord.finish(60) == 1, coord.text
            assert what in coord.text, coord.text
        time.sleep(0.3)
        assert p.p.poll() is None  # still waiting: nothing was offered to it
    finally:
        assert p.stop() == 0, p.text
    # never offered anything: an offer made and then given up would have been aborted
    assert "assignment aborted" not in p.text and "mlxcel stage" not in p.text
    assert "stopped while waiting for a stage assignment" in p.text


def test_beacon_bring_up_serves_like_one_process(
    tiny: Path, secret: Path, reference: str, tmp_path: Path
) -> None:
    udp = free_udp_port()
    beacons = ["--cluster-discovery", "mdns", "--cluster-discovery-port", str(udp)]
    target = ["--cluster-discovery-target", "127.0.0.1"]
    peers = [
        # port 0: the OS picks one, and the beacon announces it
        peer(
            tiny,
            secret,
            tmp_path / "p0",
            *beacons,
            *target,
            "--cluster-control-addr",
            "127.0.0.2:0",
        ),
        # no address at all: 0.0.0.0 at an OS-assigned port, announced from the beacon's source
        peer(tiny, secret, tmp_path / "p1", *beacons, *target),
    ]
    port = free_port()
    control = f"127.0.0.1:{free_port()}"
    coord = coordinator(
        tiny, secret, tmp_path, 2, *beacons, "--cluster-control-addr", control, "--port", str(port)
    )
    try:
        coord.wait_for("mlxcel serving")
        assert chat(port) == reference
        cfg = load_cluster_config(tmp_path / ".mlxcel" / "cluster.toml")
        assert sorted(s.host for s in cfg.stages) == ["127.0.0.1", "127.0.0.2"]
        assert all(s.port != 0 for s in cfg.stages)
    finally:
        code = coord.stop()
        for p in peers:  # stopped whatever the coordinator did: never leak a peer
            p.stop()
        assert code == 0, coord.text


def test_stages_are_placed_by_what_each_peer_can_hold(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    """A peer offering three times the memory gets about three times the layers' bytes; a
    cluster whose peers cannot hold the model fails with the figures and starts nothing."""
    from mlxcel.pipeline.partition import layer_costs

    total = layer_costs(tiny).total
    small, big = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3))
    sizes = {small: total // 3, big: total}
    peers = [
        peer(tiny, secret, tmp_path / f"p{i}", "--cluster-control-addr", a,
             "--usable-memory", str(sizes[a]))
        for i, a in enumerate((small, big))
    ]  # fmt: skip
    common = [
        "--cluster-peers",
        f"{small},{big}",
        "--cluster-control-addr",
        f"127.0.0.1:{free_port()}",
    ]
    try:
        dry = coordinator(tiny, secret, tmp_path, 2, *common, "--dry-run")
        assert dry.finish() == 0, dry.text
        cfg = load_cluster_config(tmp_path / ".mlxcel" / "cluster.toml")
        by = {s.address: s for s in cfg.stages}
        assert by[small].memory_gb == sizes[small] / 2**30
        a, b = (tuple(map(int, by[x].layers.split("-"))) for x in (small, big))  # type: ignore[union-attr]
        assert b[1] - b[0] > a[1] - a[0]  # the bigger peer holds more layers
        for p in peers:
            p.wait_for("assignment aborted by")
    finally:
        for p in peers:
            p.stop()
    # Peers that cannot hold the model between them: refused with the figures, nothing starts.
    tight = [
        peer(tiny, secret, tmp_path / f"t{i}", "--cluster-control-addr", a,
             "--usable-memory", str(total // 4))
        for i, a in enumerate((small, big))
    ]  # fmt: skip
    coord = coordinator(tiny, secret, tmp_path / "c", 2, *common, "--port", str(free_port()))
    try:
        assert coord.finish() == 1
        assert "the model does not fit these peers' memory" in coord.text
        assert "<- does not fit" in coord.text and "no stage was started" in coord.text
        for p in tight:
            p.wait_for("assignment aborted by")
            assert p.p.poll() is None
    finally:
        for p in tight:
            p.stop()
    assert all("mlxcel stage" not in p.text for p in tight)


def test_a_peer_with_another_secret_fails_the_bring_up_and_starts_nothing(
    tiny: Path, secret: Path, other_secret: Path, tmp_path: Path
) -> None:
    good, bad = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3))
    p_good = peer(tiny, secret, tmp_path / "good", "--cluster-control-addr", good)
    p_bad = peer(tiny, other_secret, tmp_path / "bad", "--cluster-control-addr", bad)
    coord = coordinator(
        tiny,
        secret,
        tmp_path,
        2,
        "--cluster-peers",
        f"{good},{bad}",
        "--cluster-control-addr",
        f"127.0.0.1:{free_port()}",
        "--port",
        str(free_port()),
    )
    try:
        assert coord.finish() == 1
        assert "bring-up failed" in coord.text and bad in coord.text
        assert "secret mismatch" in coord.text and "no stage was started" in coord.text
        # not retried: it failed at the first handshake, long before the 50 s offer phase
        assert coord.text.count("secret mismatch") <= 2
        # the good peer accepted, then got the Abort and went back to waiting
        p_good.wait_for("assignment aborted by")
        time.sleep(0.5)
        assert p_good.p.poll() is None and p_bad.p.poll() is None
    finally:
        p_good.stop()
        p_bad.stop()
    assert "mlxcel stage" not in p_good.text + p_bad.text
    assert not (tmp_path / "good" / ".mlxcel").exists()


def other_checkpoint(tiny: Path, where: Path, differs: str) -> Path:
    """Another checkpoint of ``tiny``'s shape: another config (its RoPE base), or the same
    config, file names and sizes with other weights (another seed)."""
    import json
    import shutil

    from mlxcel.runtime.checkpoint import write_checkpoint

    if differs == "weights":
        other = write_checkpoint(where, "tiny", "qwen3", seed=7)
        for f in tiny.glob("*.safetensors"):
            assert (other / f.name).stat().st_size == f.stat().st_size
        assert (other / "config.json").read_bytes() == (tiny / "config.json").read_bytes()
        return other
    shutil.copytree(tiny, where)
    cfg = json.loads((where / "config.json").read_text())
    cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
    (where / "config.json").write_text(json.dumps(cfg))
    return where


@pytest.mark.parametrize("differs", ["config", "weights"])
def test_a_peer_with_another_checkpoint_is_refused_and_ends(
    tiny: Path, secret: Path, tmp_path: Path, differs: str
) -> None:
    other = other_checkpoint(tiny, tmp_path / "other-model", differs)
    good, odd = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3))
    p_good = peer(tiny, secret, tmp_path / "good", "--cluster-control-addr", good)
    p_odd = peer(other, secret, tmp_path / "odd", "--cluster-control-addr", odd)
    coord = coordinator(
        tiny,
        secret,
        tmp_path,
        2,
        "--cluster-peers",
        f"{good},{odd}",
        "--cluster-control-addr",
        f"127.0.0.1:{free_port()}",
        "--port",
        str(free_port()),
    )
    try:
        assert p_odd.finish() == 1
        assert "stage assignment refused: model identity mismatch" in p_odd.text
        assert coord.finish() == 1
        assert "model identity mismatch" in coord.text and "stage-1" in coord.text
        if differs == "weights":  # both digests named, on both sides
            from mlxcel.bringup.identity import model_identity

            ours, theirs = model_identity(tiny).weights, model_identity(other).weights
            assert ours != theirs
            for text in (p_odd.text, coord.text):
                assert f"weights have digest {ours[:16]}, this node's {theirs[:16]}" in text
        assert p_good.p.poll() is None  # back to waiting, not gone
    finally:
        p_good.stop()
        coord.stop()
    assert "mlxcel stage" not in p_good.text


def test_a_version_1_coordinator_is_refused(tiny: Path, secret: Path, tmp_path: Path) -> None:
    """A coordinator speaking assignment protocol 1 over the real channel: the peer answers
    "assignment protocol mismatch" and ends."""
    me = f"127.0.0.2:{free_port('127.0.0.2')}"
    p = peer(tiny, secret, tmp_path, "--cluster-control-addr", me)
    host, port = me.rsplit(":", 1)
    control_port = free_port()

    async def offer() -> AssignRefused:
        got: asyncio.Future[AssignRefused] = asyncio.get_running_loop().create_future()

        async def on_refused(env) -> None:  # type: ignore[no-untyped-def]
            if not got.done():
                got.set_result(env.msg)

        key = load_cluster_secret(secret)
        assert key is not None
        async with Node("v1") as node:
            node.bus.subscribe(AssignRefused, on_refused, origin=Origin.REMOTE)
            pool = ConnectionPool(
                node, key, Identity("127.0.0.1", control_port, "old"), channel=Channel.ASSIGNMENT
            )
            conn = await pool.get(host, int(port), asyncio.get_running_loop().time() + 10)
            msg = AssignOffer(
                1,
                5,
                __version__,
                "mlxcel-cluster",
                "0" * 64,
                4,
                2,
                0,
                (0, 2),
                "stage-0",
                f"127.0.0.1:{control_port}",
                "",
            )
            await conn.send(msg, asyncio.get_running_loop().time() + 10)
            return await asyncio.wait_for(got, 10)

    refused = asyncio.run(offer())
    assert refused.final and refused.reason.startswith("assignment protocol mismatch")
    assert p.finish() == 1
    assert "stage assignment refused: assignment protocol mismatch" in p.text


def test_a_loopback_coordinator_refuses_a_remote_peer(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    """--host 127.0.0.1 (so the control address is loopback) and a peer on another host:
    refused at start, before a single connection is attempted."""
    c = coordinator(
        tiny, secret, tmp_path, 1, "--cluster-peers", "10.255.0.7:19001", "--port", str(free_port())
    )
    assert c.finish(60) == 1
    assert "127.0.0.1:19000 is loopback" in c.text and "10.255.0.7:19001" in c.text
    assert "assignment:" not in c.text  # no offer was attempted (DEBUG logging is on)


def test_dry_run_is_for_the_coordinator_only(tiny: Path, secret: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "serve",
            "--pp-peer",
            "--dry-run",
            "--cluster-control-addr",
            "127.0.0.2:19001",
            "--cluster-secret-file",
            str(secret),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "--dry-run is for the --pp-auto coordinator" in r.stderr
    assert "listener" not in r.stderr  # refused before any socket was bound
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "serve",
            "--pp-auto",
            "2",
            "--distributed-config",
            "x.toml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "mutually exclusive" in r.stderr


def test_bring_up_requires_the_secret(tiny: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_CLUSTER_SECRET")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "serve",
            "-m",
            str(tiny),
            "--pp-peer",
            "--cluster-control-addr",
            "127.0.0.2:19001",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode != 0 and "--cluster-secret-file" in r.stderr


def test_the_assignment_listener_keeps_8_pending_sockets_4_per_source(secret: Path) -> None:
    """The peer's listener (its very limits) closes unauthenticated sockets beyond the caps."""
    assert (PEER_LIMITS.max_pending, PEER_LIMITS.max_pending_per_source) == (8, 4)

    async def flood() -> tuple[int, int]:
        key = load_cluster_secret(secret)
        assert key is not None
        async with Node("peer") as node:
            lst = ClusterListener(
                node, key, "127.0.0.1", 0, channel=Channel.ASSIGNMENT, limits=PEER_LIMITS
            )
            port = await lst.start()
            conns = []
            for src in ["127.0.0.2"] * 5 + ["127.0.0.3"] * 4 + ["127.0.0.4"]:
                r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
                conns.append((r, w))
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            closed = 0
            for r, _w in conns:
                try:  # a refused socket is closed at once (after a busy preamble at most)
                    await asyncio.wait_for(r.read(), 0.3)
                    closed += 1
                except (TimeoutError, ConnectionError):
                    pass
            for _r, w in conns:
                w.close()
            return closed, lst.refused_at_accept, lst.evicted

    closed, refused, evicted = asyncio.run(flood())
    # The 5th from 127.0.0.2 is refused (per source); the one from 127.0.0.4 finds the pool of
    # 8 full and, holding nothing, takes the oldest slot of 127.0.0.2 (which holds the most).
    assert (refused, evicted, closed) == (1, 1, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--pp-auto", "2", "--cluster-peers", "127.0.0.2:1,127.0.0.2:1"],
            "lists an address twice",
        ),
        (["--pp-auto", "1", "--cluster-peers", "peer-host:19001"], "literal IP"),
        (["--pp-auto", "1", "--cluster-peers", "127.0.0.2:0"], "expected IP:PORT"),
        (
            [
                "--pp-auto",
                "1",
                "--cluster-peers",
                "127.0.0.2:1",
                "--cluster-control-addr",
                "127.0.0.1:0",
            ],
            "--cluster-control-addr",
        ),
        (["--pp-peer", "--cluster-control-addr", "127.0.0.2"], "--cluster-control-addr"),
        (["--pp-auto", "2", "--pp-peer"], "give one"),
        (
            ["--pp-auto", "2", "--cluster-peers", "127.0.0.2:1,127.0.0.3:1", "--tp-size", "2"],
            "cannot be combined",
        ),
        (["--pp-peer", "--pp-size", "2"], "the stages come from the cluster"),
        (["--pp-peer", "--usable-memory", "0"], "holds no stage"),
        (
            ["--pp-auto", "1", "--cluster-peers", "127.0.0.2:1", "--usable-memory", "8GiB"],
            "give it to the peers",
        ),
        (["--pp-auto", "1", "--cluster-peers", "127.0.0.2:019391"], "no leading"),
        (["--pp-auto", "2", "--cluster-peers", "127.0.0.2:1,127.0.0.2:01"], "no leading"),
        (["--pp-auto", "1", "--cluster-peers", "::1:19001"], "IPv6 as"),
    ],
)
def test_bad_bring_up_flags_are_refused_by_name(argv: list[str], message: str) -> None:
    from mlxcel.base.errors import ConfigError
    from mlxcel.cli.main import build_parser
    from mlxcel.config.cli import load_settings
    from mlxcel.config.settings import ServeSettings

    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ConfigError, match=message):
        load_settings(ServeSettings, args)
    # a peer may ask for any free port
    ok = build_parser().parse_args(["serve", "--pp-peer", "--cluster-control-addr", "127.0.0.2:0"])
    assert load_settings(ServeSettings, ok).cluster_control_addr == "127.0.0.2:0"


def test_a_control_address_that_is_not_this_hosts_is_refused_at_start(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    c = coordinator(
        tiny,
        secret,
        tmp_path,
        1,
        "--cluster-peers",
        "127.0.0.2:19001",
        "--cluster-control-addr",
        "192.0.2.77:19000",
        "--port",
        str(free_port()),
    )
    assert c.finish(60) == 2
    assert "192.0.2.77 is not an address of this host" in c.text
