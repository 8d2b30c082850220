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
from typing import Any

from loguru import logger

from mlxcel.bus import Node
from mlxcel.errors import ConfigError, TpGroupFailed
from mlxcel.frontend import Frontend
from mlxcel.messages import EXTENDED_SAMPLING
from mlxcel.runtime.blas import colocated_env
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.devices import device_env, gpu_ids
from mlxcel.runtime.kv_usage import figures
from mlxcel.runtime.model import LoadedModel, context_length
from mlxcel.specs import Generation, TensorParallelSpec
from mlxcel.stack import Serving, Stack
from mlxcel.tp.engine import TpEngine
from mlxcel.tp.group import (
    check_shardable,
    cleartext_hosts,
    init_group,
    load_sharded,
    pick_backend,
    read_hostfile,
    write_local_hostfile,
)
from mlxcel.tp.step_seal import KEY_ENV, StepSeal, hostfile_key, launch_key


@dataclass
class TpParts:
    loaded: LoadedModel
    engine: TpEngine
    size: int


HOSTFILE_NEEDS_SECRET = (
    "ranks started by hand need the cluster secret: the key that authenticates rank 0's "
    "step messages is derived from it; pass --cluster-secret-file (serve) or set "
    "MLXCEL_CLUSTER_SECRET_FILE, the same on every rank"
)


def step_key(spec: TensorParallelSpec) -> bytes:
    """This launch's step key: a fresh one for the ranks this process starts, else the one
    every rank derives from the cluster secret and the hostfile."""
    if spec.hostfile is None:
        return launch_key()
    assert spec.secret is not None  # _group_size refused it otherwise
    return hostfile_key(spec.secret.value, spec.hostfile)


def _group_size(spec: TensorParallelSpec) -> int:
    """The group's size (a hostfile's rank count wins), checked before any weights load."""
    config = json.loads((spec.model / "config.json").read_text())
    size = spec.size
    if spec.hostfile is not None:
        listed = read_hostfile(spec.hostfile)
        warning = cleartext_hosts(listed, spec.allow_cleartext)
        if warning:
            logger.warning("{}", warning)
        if spec.secret is None:
            raise ConfigError("--tp-hostfile", HOSTFILE_NEEDS_SECRET)
        ranks = len(listed)
        if size not in (1, ranks):
            raise TpGroupFailed(f"--tp-hostfile lists {ranks} ranks but --tp-size is {size}")
        size = ranks
    check_shardable(config, size)
    gpus = gpu_ids()
    if spec.hostfile is None and pick_backend(spec.backend) == "nccl" and size > len(gpus):
        raise ConfigError(
            "--tp-size", f"{size} ranks but {len(gpus)} GPUs here: NCCL needs a GPU per rank"
        )
    return size


async def _spawn_followers(
    spec: TensorParallelSpec,
    gen: Generation,
    hostfile: Path,
    size: int,
    followers: list[asyncio.subprocess.Process],
    key: bytes,
) -> None:
    """Ranks 1..size-1 on this host, each a ``mlxcel.tp.follower`` process, appended to
    ``followers`` as each starts (a start cancelled midway still reaps those)."""
    for rank in range(1, size):
        args = {
            "--model": spec.model,
            "--rank": rank,
            "--hostfile": hostfile,
            "--max-batch-size": gen.max_batch_size,
            "--prefill-step-size": gen.prefill_step_size,
            "--startup-timeout": spec.startup_timeout,
            "--tp-backend": spec.backend,
        }
        argv = [str(x) for pair in args.items() for x in pair]
        followers.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mlxcel.tp.follower",
                *argv,
                # The step key travels in the environment (readable only by this user),
                # never on the command line (readable by anyone on the host).
                env={**device_env(rank, colocated_env(size)), KEY_ENV: key.hex()},
            )
        )


def _serving(node: Node, fe: Frontend, engine: TpEngine, loaded: LoadedModel, size: int) -> Serving:
    async def health() -> dict[str, object]:
        ranks: dict[str, object] = {"ranks": size}
        if engine.fatal.is_set():
            ranks["error"] = engine.fatal_reason
        return {"ready": not engine.fatal.is_set(), "tensor_parallel": ranks}

    # The group failing stops the runner like a signal does.
    return Serving(
        node,
        fe,
        lambda: engine.active,
        health,
        done=engine.fatal,
        sampling=EXTENDED_SAMPLING,
        mode="tensor parallel",
        kv=lambda: figures(engine.kv_tokens(), loaded.config, loaded.n_layers, size),
    )


@asynccontextmanager
async def tp_stack(spec: TensorParallelSpec, gen: Generation) -> AsyncIterator[Stack[TpParts]]:
    size = _group_size(spec)
    compute = ComputeThread()
    followers: list[asyncio.subprocess.Process] = []
    stopping = startup_failed = False
    engine: TpEngine | None = None
    with tempfile.TemporaryDirectory(prefix="mlxcel-tp-") as tmp:
        hostfile = spec.hostfile
        key = step_key(spec)
        try:
            if hostfile is None:
                hostfile = write_local_hostfile(size, Path(tmp))
                await _spawn_followers(spec, gen, hostfile, size, followers, key)
            group, loaded = await _join(compute, followers, hostfile, spec, size)
            async with Node("tensor-parallel") as node:
                engine = TpEngine(
                    loaded,
                    compute,
                    max_batch_size=gen.max_batch_size,
                    prefill_step_size=gen.prefill_step_size,
                    max_sequences=max(gen.parallel, 1),
                    group=group,
                    seal=StepSeal(key),
                )
                await engine.attach(node)
                for rank, proc in enumerate(followers, start=1):
                    node.spawn(_watch(proc, rank, engine, lambda: stopping), name=f"tp-rank-{rank}")
                fe = Frontend.attached(node, loaded.tokenizer, gen, context_length(loaded.config))
                summary = (
                    f"tensor-parallel group of {size} ranks; decode path: batched forward on "
                    f"every rank, up to {gen.max_batch_size} sequence(s) per step"
                )
                eng = engine
                yield Stack(
                    "tensor-parallel",
                    _serving(node, fe, eng, loaded, size),
                    loaded.name,
                    summary,
                    TpParts(loaded, eng, size),
                    lambda: eng.fatal_reason or None,
                )
                stopping = True
                if not engine.fatal.is_set():
                    await compute.run(engine.stop_followers)
        except TpGroupFailed:
            startup_failed = engine is None
            raise
        finally:
            stopping = True
            # A group that never formed has nothing to wait for: its followers go at once.
            await _reap(followers, patient=engine is not None)
            # A failed group's compute thread may sit in a dead collective: do not join it.
            if startup_failed or (engine is not None and engine.fatal.is_set()):
                compute.abandon()
            else:
                compute.close()


async def _join(
    compute: ComputeThread,
    followers: list[asyncio.subprocess.Process],
    hostfile: Path,
    spec: TensorParallelSpec,
    size: int,
) -> tuple[Any, LoadedModel]:
    """Rank 0 joins the group and loads its shard, failing early when a follower exits."""
    group = await _while_ranks_live(
        compute.run(init_group, 0, hostfile, spec.startup_timeout, spec.backend),
        followers,
        "join the group",
        spec.startup_timeout,
    )
    if group.size() != size:
        raise TpGroupFailed(f"the hostfile has {group.size()} ranks, --tp-size is {size}")
    loaded = await _while_ranks_live(
        compute.run(load_sharded, spec.model, group),
        followers,
        "load the shards",
        max(spec.startup_timeout, 120.0),
    )
    return group, loaded


async def _reap(followers: list[asyncio.subprocess.Process], patient: bool) -> None:
    for proc in followers:
        try:
            await asyncio.wait_for(proc.wait(), 10 if patient else 0)
        except TimeoutError:
            proc.kill()
            await proc.wait()


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
