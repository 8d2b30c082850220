"""Multi-host pipeline processes: ``serve --distributed-config cluster.toml --node-id ID``.

A stage process (:mod:`.stage_node`) listens on its address, loads its layer range lazily,
and serves the stage protocol. The coordinator process (here) holds no model: it reads the
tokenizer and plans the split from the checkpoint's files, and never imports MLX. It listens on its address (stages send results there),
connects to every stage at start-up -- so a wrong secret or address fails it at once, naming
the problem -- checks that each stage runs the planned layers, then serves the HTTP API.
Every node of a pipeline with two or more stages requires the cluster secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from mlxcel.base.errors import ConfigError, ConnectFailed, MlxcelError, PipelineError
from mlxcel.base.messages import State
from mlxcel.base.model_config import context_length, vocab_size
from mlxcel.bringup.identity import model_identity
from mlxcel.bringup.protocol import ModelIdentity, weights_mismatch
from mlxcel.net.connection import MemoryBudget
from mlxcel.net.interfaces import interface_ipv4
from mlxcel.net.listener import ClusterListener, Limits
from mlxcel.net.network import TcpEndpoint, split_hostport
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import ClusterSecret
from mlxcel.pipeline.cluster_config import ClusterConfig, ClusterSection, NodeSpec
from mlxcel.pipeline.coordinator import PipelineCoordinator, coordinator_serving
from mlxcel.pipeline.partition import StagePlan
from mlxcel.pipeline.split import CLUSTER_SOURCES, make_plan
from mlxcel.reactor.bus import Node
from mlxcel.runtime.kv_usage import prompt_cache_positions
from mlxcel.serving.frontend import Frontend
from mlxcel.serving.specs import CoordinatorSpec, Generation
from mlxcel.serving.stack import Stack
from mlxcel.serving.tokenizer import load_tokenizer
from mlxcel.wire.handshake import Identity


def cluster_plan(cfg: ClusterConfig, model_path: Path) -> list[StagePlan]:
    """The stages the cluster TOML asks for, checked before any weight loads."""
    return make_plan(
        model_path,
        cfg.pipeline_parallel_size,
        cfg.pp_layers,
        cfg.memory,
        sources=CLUSTER_SOURCES,
    )


def node_net(
    node: Node, cfg: ClusterConfig, me: NodeSpec, secret: ClusterSecret, interface: str | None
) -> tuple[ClusterListener, ConnectionPool, TcpEndpoint]:
    members = [n.address for n in cfg.nodes if n.id != me.id]
    return cluster_net(node, cfg.cluster, me.address, me.id, secret, interface, members)


def cluster_net(
    node: Node,
    c: ClusterSection,
    address: str,
    node_id: str,
    secret: ClusterSecret,
    interface: str | None = None,
    members: list[str] | None = None,
) -> tuple[ClusterListener, ConnectionPool, TcpEndpoint]:
    """A node's cluster listener on ``address``, its pool of outbound connections (bound to
    the same IP, so peers see the identity it claims) and the endpoint over both. ``members``:
    the addresses of the other nodes it knows of (their dials never wait behind outsiders')."""
    host, port = split_hostport(address)
    bind = interface_ipv4(interface) if interface else host
    limits = Limits(
        max_connections=c.max_connections,
        max_pending=c.max_pending_handshakes,
        max_pending_per_source=c.max_pending_handshakes_per_ip,
        handshake_timeout=c.handshake_timeout,
        max_message=c.max_message_bytes,
        idle_timeout=c.idle_timeout,
        frame_timeout=c.frame_timeout,
        peer_timeout=c.peer_timeout,
        max_clock_skew=c.max_clock_skew,
    )
    budget = MemoryBudget(c.memory_budget_bytes)  # one for every connection of this node
    listener = ClusterListener(
        node,
        secret,
        bind,
        port,
        node_id=node_id,
        limits=limits,
        budget=budget,
        members=members or (),
    )
    src = None if host in ("0.0.0.0", "::") else bind
    pool = ConnectionPool(
        node,
        secret,
        Identity(host, port, node_id),
        bind_ip=src,
        backoff=Backoff(c.reconnect_attempts, c.reconnect_base_delay),
        handshake_timeout=c.handshake_timeout,
        max_message=c.max_message_bytes,
        budget=budget,
        frame_timeout=c.frame_timeout,
        keepalive=min(60.0, c.idle_timeout / 3),  # peers never look idle while alive
        peer_timeout=c.peer_timeout,
    )
    return listener, pool, TcpEndpoint(address, pool, listener)


@dataclass
class CoordinatorParts:
    coordinator: PipelineCoordinator
    endpoint: TcpEndpoint
    plan: list[StagePlan]


@asynccontextmanager
async def coordinator_stack(
    spec: CoordinatorSpec, gen: Generation
) -> AsyncIterator[Stack[CoordinatorParts]]:
    """A coordinator node connected to every stage of ``spec.cfg`` and checked, plus its
    frontend."""
    cfg = spec.cfg
    stages_plan = cluster_plan(cfg, spec.model)  # refused here, before anything is read
    # Hashing the weights overlaps reaching the stages (which hash theirs meanwhile).
    hashing = asyncio.ensure_future(
        asyncio.to_thread(model_identity, spec.model, not spec.trust_weights)
    )
    tokenizer, config = load_tokenizer(spec.model)
    async with Node(spec.me.id) as node:
        listener, pool, endpoint = node_net(node, cfg, spec.me, spec.secret, spec.interface)
        coordinator = PipelineCoordinator(
            node,
            endpoint,
            [s.address for s in cfg.stages],
            eos=set(tokenizer.eos_token_ids),
            vocab=vocab_size(config),
            max_len=context_length(config),
            step_timeout=cfg.cluster.step_timeout,
            return_logits=spec.return_logits,
            max_sequences=gen.parallel,
            prefill_step_size=gen.prefill_step_size,
            micro_batch_size=spec.micro_batch_size,
            stage_max_batch=gen.max_batch_size,
            # Each stage process has its own --prompt-cache-bytes; the coordinator plans as if
            # it were its own (a stage given less makes room by its oldest entries: a request
            # that asks for one of those prefills in full).
            prompt_cache_tokens=prompt_cache_positions(
                gen.prompt_cache_bytes,
                config,
                [p.end - p.start for p in stages_plan],
                one_process=False,
            ),  # fmt: skip
        )
        coordinator.attach()
        await listener.start()
        try:
            states = await connect_stages(coordinator, pool, cfg, stages_plan, spec.startup_timeout)
        except BaseException:
            hashing.cancel()  # the error is what matters now, not the digest
            raise
        ident = await hashing
        for stage, st in zip(cfg.stages, states, strict=True):
            check_model(stage.id, st, ident)
        coordinator.start_probing()
        fe = Frontend.attached(node, tokenizer, gen, context_length(config))
        logger.info(
            "pipeline of {} stages ready: {}",
            len(stages_plan),
            ", ".join(f"{s.id}={p.spec}" for s, p in zip(cfg.stages, stages_plan, strict=True)),
        )
        serving = coordinator_serving(node, fe, coordinator, spec.return_logits, spec.verbose_stats)
        summary = f"pipeline coordinator of {len(stages_plan)} stages"
        parts = CoordinatorParts(coordinator, endpoint, stages_plan)
        yield Stack("coordinator", serving, spec.model.name, summary, parts)


async def connect_stages(
    coordinator: PipelineCoordinator,
    pool: ConnectionPool,
    cfg: ClusterConfig,
    stages_plan: list[StagePlan],
    timeout: float,
) -> list[State]:
    """Reach every stage (retrying while they start) and check its layers; fail fast on
    refusals. Returns what each stage said of itself."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout
    for spec in cfg.stages:
        next_note = loop.time() + 5.0
        while True:
            try:
                await pool.get(spec.host, spec.port, deadline)
                logger.info("stage {} at {} connected", spec.id, spec.address)
                break
            except ConnectFailed as exc:
                if exc.failure is not None and not exc.failure.retryable:
                    raise MlxcelError(f"stage {spec.id} at {spec.address}: {exc}") from None
                if loop.time() >= deadline:
                    raise MlxcelError(
                        f"stage {spec.id} at {spec.address} unreachable within {timeout:g}s "
                        f"(--startup-timeout): {exc}"
                    ) from None
                if loop.time() >= next_note:
                    next_note = loop.time() + 5.0
                    logger.info(
                        "waiting for stage {} at {} ({:.0f}s of {:g}s): {}",
                        spec.id,
                        spec.address,
                        loop.time() - start,
                        timeout,
                        exc,
                    )
                await asyncio.sleep(0.2)
    try:
        states = await coordinator.query_states(timeout=max(1.0, deadline - loop.time()))
    except (PipelineError, MlxcelError) as exc:
        raise MlxcelError(f"stages did not answer their state query: {exc}") from None
    for spec, planned, st in zip(cfg.stages, stages_plan, states, strict=True):
        if tuple(st.layers) != (planned.start, planned.end):
            raise MlxcelError(
                f"stage {spec.id} runs layers {st.layers[0]}-{st.layers[1] - 1}, "
                f"the plan says {planned.spec}: same model and config on every node?"
            )
        if st.node_id != spec.id:
            raise ConfigError(
                "--distributed-config",
                f"{spec.address} answers as {st.node_id!r}, expected {spec.id!r}",
            )
    return states


def check_model(stage: str, st: State, ours: ModelIdentity) -> None:
    """A stage must hold this coordinator's checkpoint: the same shape and, where both sides
    hashed them, the same weights (one with other values serves wrong text, silently)."""
    if st.model and st.model != ours.sha256:
        raise MlxcelError(
            f"stage {stage} holds another checkpoint: model identity {st.model[:12]}, this "
            f"coordinator's {ours.short}: the same model folder on every host?"
        )
    differ = weights_mismatch(st.weights, ours.weights, f"stage {stage}'s")
    if differ is not None:
        raise MlxcelError(differ)
    if not (st.weights and ours.weights):
        logger.info("stage {}: weights not compared (--trust-weights on one side)", stage)
