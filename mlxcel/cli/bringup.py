"""``serve --pp-auto N`` and ``serve --pp-peer``: run the bring-up, write the cluster TOML,
and hand the resulting cluster node to the ordinary serve path (docs/bringup.md)."""

from __future__ import annotations

import asyncio
import importlib
import os
import tomllib
from pathlib import Path

from loguru import logger

from mlxcel.bringup.launch import (
    Discovery,
    await_assignment,
    check_local,
    control_address,
    previous_cluster,
    push_assignments,
    readopt,
    write_config,
)
from mlxcel.cli.cluster_nodes import cluster_node_spec, cluster_secret
from mlxcel.cli.commands import resolve_model
from mlxcel.cli.http_checks import check_port
from mlxcel.config.settings import ServeSettings
from mlxcel.net.network import split_hostport
from mlxcel.net.secret import ClusterSecret
from mlxcel.pipeline.cluster_config import ClusterConfig
from mlxcel.process.loop import signals
from mlxcel.serving.assembly import StackSpec

COORDINATOR_OUT = Path(".mlxcel/cluster.toml")


def _discovery(s: ServeSettings) -> Discovery:
    peers = tuple(p.strip() for p in (s.cluster_peers or "").split(",") if p.strip())
    return Discovery(
        s.cluster_discovery, peers, s.cluster_discovery_target, s.cluster_discovery_port
    )


def _secret_file(s: ServeSettings) -> str | None:
    """Recorded in the written TOML (as an absolute path) when the secret came from a file."""
    path = s.cluster_secret_file or os.environ.get("MLXCEL_CLUSTER_SECRET_FILE")
    return str(Path(path).expanduser().resolve()) if path else None


async def _peer_spec(
    s: ServeSettings, path: Path, secret: ClusterSecret, discovery: Discovery
) -> StackSpec | None:
    """``--pp-peer``: wait for an assignment, then serve the stage it names (None: stopped
    while waiting)."""
    # What the stage needs once activated (MLX, mlx-lm, the runner) is loaded before the
    # peer starts waiting: an activated stage then starts at once. On this thread: a worker
    # thread that touched MLX can abort the process at exit (a refused peer exits within a
    # second, and did, under load, with SIGABRT).
    _load(("mlxcel.pipeline.remote", "mlxcel.serving.runner"))
    waiting = asyncio.ensure_future(
        await_assignment(
            path,
            secret,
            s.cluster_control_addr,
            discovery,
            memory=_offered_memory(int(s.usable_memory)),
            cluster_name=s.cluster_name,
            trust_weights=s.trust_weights,
        )
    )
    # A peer that is still waiting has nothing to drain: a signal ends it, with status 0.
    with signals(waiting.cancel):
        try:
            got = await waiting
        except asyncio.CancelledError:
            logger.info("stopped while waiting for a stage assignment")
            return None
    out = s.cluster_config_out or Path(f".mlxcel/cluster-{got.node_id}.toml")
    write_config(out, got.text)
    logger.info("assigned {}: cluster written to {}", got.node_id, out)
    return cluster_node_spec(s, got.cluster, got.cluster.node(got.node_id), path, secret)


def _load(modules: tuple[str, ...]) -> None:
    for m in modules:
        importlib.import_module(m)


def _offered_memory(cap: int) -> int:
    """What this peer offers for its stage: MLX's limit on this device, or --usable-memory."""
    from mlxcel.pipeline.partition import human_bytes
    from mlxcel.runtime.devices import usable_memory

    memory = usable_memory(cap)
    if cap > memory:
        logger.warning(
            "--usable-memory {} is more than this device lets MLX allocate: offering {}",
            human_bytes(cap),
            human_bytes(memory),
        )
    return memory


async def bringup_spec(s: ServeSettings) -> StackSpec | None:
    path = resolve_model(s.model)
    secret = cluster_secret(s, None)
    discovery = _discovery(s)
    if s.pp_peer:
        return await _peer_spec(s, path, secret, discovery)
    assert s.pp_auto is not None
    # The serving side's imports are not overlapped with the push on a worker thread: a
    # thread that imported mlx-lm aborted the process at exit now and then, and one that
    # imported transformers while the main thread did broke its lazy module for both.
    control = control_address(s.cluster_control_addr, s.host, discovery)
    check_local(control)
    out = s.cluster_config_out or COORDINATOR_OUT
    if not s.dry_run:
        previous = await previous_cluster(out, secret)
        again = readopt(previous, s.pp_auto) if previous else None
        if again is not None:
            logger.info(
                "the {} stages of the cluster in {} are serving (written by an earlier "
                "bring-up): serving as their coordinator again",
                len(again.stages),
                out,
            )
            return cluster_node_spec(s, again, again.coordinator, path, secret)
        # Every port this node will listen on, before any peer is assigned a stage.
        host, port = split_hostport(control)
        check_port(host, port, "listen for cluster connections")
        check_port(s.host, s.port)
    plan = await push_assignments(
        s.pp_auto,
        path,
        secret,
        control,
        discovery,
        cluster_name=s.cluster_name,
        secret_file=_secret_file(s),
        dry_run=s.dry_run,
        trust_weights=s.trust_weights,
    )
    text = plan.coordinator_file(f"serve --pp-auto {s.pp_auto}")
    write_config(out, text)
    if s.dry_run:
        print(plan.table(), flush=True)  # bytes per stage beside what each peer can hold
        print(text, end="", flush=True)
        logger.info("dry run: the plan is in {}; nothing was assigned", out)
        return None
    logger.info("cluster written to {}", out)
    cfg = ClusterConfig.model_validate(tomllib.loads(plan.body()))
    return cluster_node_spec(s, cfg, cfg.coordinator, path, secret)
