"""Rank 0 of a tensor-parallel group: start the local ranks, load the shard, run the engine.

With no hostfile, ``tp_size - 1`` follower processes are started on this host with a
generated ring hostfile. With ``--tp-hostfile`` the ranks are started by the operator on
their hosts (each with ``--tp-rank``); this process is rank 0 and owns the bus and the API.
A follower that exits while the group is serving makes the group fatal: in-flight requests
fail with an error and the process exits non-zero instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from mlxcel.bus import Node
from mlxcel.defaults import PREFILL_STEP_SIZE
from mlxcel.errors import ConfigError, TpGroupFailed
from mlxcel.frontend import Frontend
from mlxcel.runtime.blas import colocated_env
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.devices import device_env, gpu_ids
from mlxcel.runtime.model import LoadedModel
from mlxcel.tp.engine import TpEngine
from mlxcel.tp.group import (
    check_shardable,
    init_group,
    load_sharded,
    pick_backend,
    read_hostfile,
    write_local_hostfile,
)


@dataclass
class TpStack:
    node: Node
    loaded: LoadedModel
    engine: TpEngine
    frontend: Frontend
    size: int


@asynccontextmanager
async def tp_stack(
    model_path: Path,
    tp_size: int,
    *,
    hostfile: Path | None = None,
    max_batch_size: int = 8,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    parallel: int = 8,
    queue_size: int = 64,
    request_timeout: float = 600.0,
    name: str = "tp",
    startup_timeout: float = 60.0,
    backend: str = "auto",
) -> AsyncIterator[TpStack]:
    config = json.loads((model_path / "config.json").read_text())
    if hostfile is not None:
        ranks = len(read_hostfile(hostfile))
        if tp_size not in (1, ranks):
            raise TpGroupFailed(f"--tp-hostfile lists {ranks} ranks but --tp-size is {tp_size}")
        tp_size = ranks
    check_shardable(config, tp_size)  # before any weights load
    gpus = gpu_ids()
    if hostfile is None and pick_backend(backend) == "nccl" and tp_size > len(gpus):
        raise ConfigError(
            "--tp-size", f"{tp_size} ranks but {len(gpus)} GPUs here: NCCL needs a GPU per rank"
        )
    compute = ComputeThread()
    followers: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory(prefix="mlxcel-tp-") as tmp:
        if hostfile is None:
            hostfile = write_local_hostfile(tp_size, Path(tmp))
            for rank in range(1, tp_size):
                followers.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "mlxcel.tp.follower",
                        "--model",
                        str(model_path),
                        "--rank",
                        str(rank),
                        "--hostfile",
                        str(hostfile),
                        "--max-batch-size",
                        str(max_batch_size),
                        "--prefill-step-size",
                        str(prefill_step_size),
                        "--startup-timeout",
                        str(startup_timeout),
                        "--tp-backend",
                        backend,
                        env=device_env(rank, colocated_env(tp_size)),
                    )
                )
        stopping = False
        startup_failed = False
        engine: TpEngine | None = None
        try:
            group = await _while_ranks_live(
                compute.run(init_group, 0, hostfile, startup_timeout, backend),
                followers,
                "join the group",
                startup_timeout,
            )
            if group.size() != tp_size:
                raise TpGroupFailed(
                    f"the hostfile has {group.size()} ranks, --tp-size is {tp_size}"
                )
            loaded = await _while_ranks_live(
                compute.run(load_sharded, model_path, group),
                followers,
                "load the shards",
                max(startup_timeout, 120.0),
            )
            async with Node(name) as node:
                engine = TpEngine(
                    loaded,
                    compute,
                    max_batch_size=max_batch_size,
                    prefill_step_size=prefill_step_size,
                    max_sequences=max(parallel, 1),
                    group=group,
                )
                await engine.attach(node)
                for rank, proc in enumerate(followers, start=1):
                    node.spawn(_watch(proc, rank, engine, lambda: stopping), name=f"tp-rank-{rank}")
                fe = Frontend(
                    node,
                    loaded.tokenizer,
                    parallel=parallel,
                    queue_size=queue_size,
                    request_timeout=request_timeout,
                )
                fe.attach()
                logger.info(
                    "tensor parallel: {} ranks; decode path: batched forward on every rank, "
                    "up to {} sequences per step",
                    tp_size,
                    max_batch_size,
                )
                yield TpStack(node, loaded, engine, fe, tp_size)
                stopping = True
                if not engine.fatal.is_set():
                    await compute.run(engine.stop_followers)
        except TpGroupFailed:
            startup_failed = engine is None
            raise
        finally:
            stopping = True
            for proc in followers:
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            if startup_failed or (engine is not None and engine.fatal.is_set()):
                compute.abandon()  # its thread may sit in a dead collective: do not join it
            else:
                compute.close()


PROGRESS_EVERY = 5.0  # seconds between "still waiting" lines


async def _while_ranks_live(  # type: ignore[no-untyped-def]
    work, followers: list[asyncio.subprocess.Process], what: str, timeout: float
):
    """Await ``work`` unless a follower exits first or it takes longer than ``timeout``;
    say every few seconds what is being waited for."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    exits = [asyncio.ensure_future(p.wait()) for p in followers]
    start = loop.time()
    try:
        while True:
            left = start + timeout - loop.time()
            if left <= 0:
                break
            done, _ = await asyncio.wait(
                [task, *exits],
                timeout=min(PROGRESS_EVERY, left),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if task in done:
                return task.result()
            for rank, e in enumerate(exits, start=1):
                if e in done:
                    raise TpGroupFailed(
                        f"rank {rank} exited with status {e.result()} before the group could {what}"
                    )
            logger.info(
                "tensor parallel: waiting for the ranks to {} ({:.0f}s of {:g}s)",
                what,
                loop.time() - start,
                timeout,
            )
        raise TpGroupFailed(
            f"the ranks did not {what} within {timeout:g}s (--startup-timeout); "
            "is every rank of the hostfile started?"
        )
    finally:
        for e in exits:
            e.cancel()


async def _watch(proc: asyncio.subprocess.Process, rank: int, engine: TpEngine, stopping) -> None:  # type: ignore[no-untyped-def]
    code = await proc.wait()
    if not stopping():
        await engine.abort(f"rank {rank} exited with status {code}")
