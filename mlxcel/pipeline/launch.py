"""Start a loopback pipeline cluster as real processes (for the demo, the benchmark and scripts).

Writes a fresh secret (mode 0600) and a cluster TOML into a work folder, puts the stages on
127.0.0.2, 127.0.0.3, ... and the coordinator on 127.0.0.1 (free ports), starts one
``python -m mlxcel serve`` process per stage (and optionally the coordinator), waits until
each says it is ready, and on exit -- normal, error or Ctrl-C -- sends SIGTERM to every process
and waits for it (SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxcel.base.errors import MlxcelError
from mlxcel.net.network import free_port
from mlxcel.net.secret import keygen
from mlxcel.runtime.blas import colocated_env
from mlxcel.runtime.devices import device_env

START_SILENCE_S = 120.0  # a starting node silent this long (no log line, not ready) is stuck
START_LIMIT_S = 1800.0  # and one that is not ready after this long, however much it writes


# Ports of a cluster placed on hosts of its own (fresh network namespaces: nothing else binds).
STAGE_PORT, COORDINATOR_PORT = 7100, 7000


@dataclass(frozen=True)
class Placement:
    """Stages on hosts other than this one's loopback (network-namespace hosts): stage ``i``
    listens on ``ips[i]`` and starts through ``command(i, argv)``; the coordinator listens
    beside the last stage."""

    ips: Sequence[str]
    command: Callable[[int, list[str]], list[str]]


class LoopbackCluster:
    def __init__(
        self,
        model: Path,
        n_stages: int,
        workdir: Path,
        *,
        http_port: int | None = None,
        spawn_coordinator: bool = True,
        extra_args: tuple[str, ...] = (),
        placement: Placement | None = None,
        module: str = "mlxcel",
    ) -> None:
        self.model = model
        self.module = module  # its nodes run as ``python -m MODULE serve`` (see start_serve)
        self.n_stages = n_stages
        self.workdir = workdir
        self.spawn_coordinator = spawn_coordinator
        self.http_port = http_port or free_port("127.0.0.1")
        self.extra_args = extra_args
        self.placement = placement
        self.procs: list[tuple[str, asyncio.subprocess.Process, Path]] = []
        self.config = workdir / "cluster.toml"
        self.secret = workdir / "cluster.secret"
        self.coordinator_address = ""

    def write_config(self) -> None:
        keygen(self.secret, force=True)
        where = self.placement
        self.coordinator_address = (
            f"127.0.0.1:{free_port('127.0.0.1')}"
            if where is None
            else f"{where.ips[self.n_stages - 1]}:{COORDINATOR_PORT}"
        )
        lines = [
            f'name = "loopback-{self.n_stages}"',
            f"pipeline_parallel_size = {self.n_stages}",
            "",
            "[cluster]",
            'secret_file = "cluster.secret"',
            "",
            "[[nodes]]",
            'id = "coordinator"',
            'role = "coordinator"',
            f'address = "{self.coordinator_address}"',
        ]
        for i in range(self.n_stages):
            host = f"127.0.0.{i + 2}"
            address = (
                f"{host}:{free_port(host)}" if where is None else f"{where.ips[i]}:{STAGE_PORT}"
            )
            lines += [
                "",
                "[[nodes]]",
                f'id = "stage-{i}"',
                'role = "stage"',
                f'address = "{address}"',
            ]
        self.config.write_text("\n".join(lines) + "\n")

    async def _start(self, node_id: str, ready: str, *extra: str, index: int = 0) -> None:
        args = ["-m", str(self.model), "--distributed-config", str(self.config)]
        args += ["--node-id", node_id, *extra, *self.extra_args]
        log = self.workdir / f"{node_id}.log"
        where = self.placement
        prefix = [] if where is None or node_id == "coordinator" else where.command(index, [])
        env = device_env(index, self._env())
        proc = await start_serve(args, log, ready, env, prefix, self.module)
        self.procs.append((node_id, proc, log))

    def _env(self) -> dict[str, str]:
        return colocated_env(self.n_stages + (1 if self.spawn_coordinator else 0))

    async def __aenter__(self) -> LoopbackCluster:
        self.write_config()
        try:
            await asyncio.gather(
                *(self._start(f"stage-{i}", "mlxcel stage", index=i) for i in range(self.n_stages))
            )
            if self.spawn_coordinator:
                await self._start("coordinator", "mlxcel serving", "--port", str(self.http_port))
            # In stage order, whichever was ready first (shutdown goes in reverse).
            order = [f"stage-{i}" for i in range(self.n_stages)] + ["coordinator"]
            self.procs.sort(key=lambda p: order.index(p[0]))
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self, grace: float = 15.0) -> dict[str, int | None]:
        for _, proc, _ in reversed(self.procs):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name, proc, _ in self.procs:
            try:
                codes[name] = await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                proc.kill()
                codes[name] = await proc.wait()
        self.procs.clear()
        return codes


async def start_serve(
    args: list[str],
    log: Path,
    ready: str,
    env: dict[str, str],
    prefix: Sequence[str] = (),
    module: str = "mlxcel",
) -> asyncio.subprocess.Process:
    """``python -m mlxcel serve ARGS`` (after ``prefix``: say, ``ip netns exec HOST``; another
    ``module`` with mlxcel's command line: the bench's unprotected nodes) with its output in
    ``log``; returns once a line containing ``ready`` is there (or raises with the log's
    tail)."""
    if env.get("MLXCEL_LOG_LEVEL", "INFO").upper() not in ("TRACE", "DEBUG", "INFO"):
        env = {**env, "MLXCEL_LOG_LEVEL": "INFO"}  # the ready line is an INFO line
    fh = open(log, "w")  # noqa: SIM115 - the child owns it until it exits
    proc = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-m",
        module,
        "serve",
        *args,
        stdout=fh,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    fh.close()
    ok = False
    try:
        ok = await wait_ready(proc, log, ready)
    finally:  # not ready, or interrupted: never leave the child behind
        if not ok and proc.returncode is None:
            proc.kill()
            await proc.wait()
    if not ok:
        tail = log.read_text(errors="replace")[-2000:]
        raise MlxcelError(f"{' '.join(args[:6])} did not start:\n{tail}")
    return proc


async def wait_ready(
    proc: asyncio.subprocess.Process,
    log: Path,
    ready: str,
    silence: float = START_SILENCE_S,
    limit: float = START_LIMIT_S,
) -> bool:
    """Whether ``ready`` appeared in ``log`` while ``proc`` still runs, before it fell silent
    for ``silence`` seconds or ``limit`` passed. A process that keeps writing (a stage
    compiling GPU kernels in its warm-up, minutes on a fresh machine) is waited for."""
    loop = asyncio.get_running_loop()
    size, heard, end = -1, loop.time(), loop.time() + limit
    want = ready.encode()
    while proc.returncode is None and loop.time() < end:
        grown = log.stat().st_size
        if grown != size:  # read only what changed: a warm-up can take minutes
            size, heard = grown, loop.time()
            if want in log.read_bytes():
                return proc.returncode is None
        elif loop.time() - heard > silence:
            return False
        await asyncio.sleep(0.05)
    return False
