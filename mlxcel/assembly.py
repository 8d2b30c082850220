"""One assembly path: every kind of node, built from one description, served the same way.

A :data:`StackSpec` says what to run -- one process, tensor-parallel rank 0, an in-process
pipeline, a remote pipeline's coordinator or one of its stages -- with plain values (no
settings objects). :func:`assemble` builds it and yields an :class:`Assembled` whose
``serving`` goes to a :class:`~mlxcel.runner.NodeRunner`. The CLI, the benchmarks and an
embedding service all go through here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.defaults import PREFILL_STEP_SIZE

if TYPE_CHECKING:  # the runner pulls in aiohttp, mlx-lm and transformers: only when assembling
    from mlxcel.runner import Serving


@dataclass(frozen=True)
class Generation:
    """What every generating stack shares: admission and batching limits."""

    parallel: int = 8
    queue_size: int = 64
    request_timeout: float = 600.0
    max_batch_size: int = 8
    prefill_step_size: int = PREFILL_STEP_SIZE
    prompt_cache_bytes: int = 0  # one process only: 0 keeps no prompt cache


@dataclass(frozen=True)
class LocalSpec:
    model: Path


@dataclass(frozen=True)
class TensorParallelSpec:
    model: Path
    size: int
    hostfile: Path | None = None
    startup_timeout: float = 60.0
    backend: str = "auto"  # --tp-backend


@dataclass(frozen=True)
class PipelineSpec:
    """Every stage and the coordinator in this process, on an in-memory fabric."""

    model: Path
    size: int
    layers: str | None = None
    return_logits: bool = False
    micro_batch_size: int | None = None


@dataclass(frozen=True)
class _ClusterNodeSpec:
    """A node of a multi-process pipeline (``cfg``: its cluster TOML; ``me``: its entry)."""

    cfg: Any
    me: Any
    model: Path
    secret: Any
    return_logits: bool = False
    interface: str | None = None
    trust_weights: bool = False  # skip the weight digest (see mlxcel.bringup.identity)


@dataclass(frozen=True)
class CoordinatorSpec(_ClusterNodeSpec):
    startup_timeout: float = 60.0
    micro_batch_size: int | None = None


@dataclass(frozen=True)
class StageSpec(_ClusterNodeSpec):
    """One stage process of a multi-process pipeline."""


@dataclass(frozen=True)
class DisaggSpec:
    """A node of disaggregated serving: ``role`` is router, prefill or decode."""

    role: str
    model: Path
    secret: Any
    bind: str
    prefill_peers: tuple[str, ...] = ()
    decode_peers: tuple[str, ...] = ()
    interface: str | None = None
    startup_timeout: float = 60.0
    peer_timeout: float = 3.0  # a peer unheard this long is down
    prefill_timeout: float = 300.0  # router: dispatch to first token
    decode_allowlist: str | None = None  # prefill: decode targets a request may name (None: any)


StackSpec = LocalSpec | TensorParallelSpec | PipelineSpec | CoordinatorSpec | StageSpec | DisaggSpec


@dataclass
class Assembled:
    serving: Serving
    model_name: str
    summary: str  # one line for the log: what this node runs
    stage: Any = None  # the StageService of a stage node
    failure: Callable[[], str | None] = field(default=lambda: None)  # why it stopped serving


@asynccontextmanager
async def assemble(spec: StackSpec, gen: Generation | None = None) -> AsyncIterator[Assembled]:
    from mlxcel.messages import EXTENDED_SAMPLING
    from mlxcel.runner import Serving
    from mlxcel.runtime.kv_usage import figures as kv_figures

    g = gen or Generation()
    limits: dict[str, Any] = {
        "parallel": g.parallel,
        "queue_size": g.queue_size,
        "request_timeout": g.request_timeout,
    }
    if isinstance(spec, LocalSpec):
        from pydantic import ByteSize

        from mlxcel.server.run import local_stack

        async with local_stack(
            spec.model,
            max_batch_size=g.max_batch_size,
            prefill_step_size=g.prefill_step_size,
            prompt_cache_bytes=g.prompt_cache_bytes,
            name="serve",
            **limits,
        ) as st:
            m = st.loaded
            pc = st.engine.prompt_cache
            yield Assembled(
                st.serving(),
                m.name,
                f"model {m.name} ({m.family}, {m.n_layers} layers); decode path: batched "
                f"forward, up to {g.max_batch_size} sequences per step; prompt cache: "
                + (ByteSize(pc.max_bytes).human_readable() if pc is not None else "off"),
            )
    elif isinstance(spec, TensorParallelSpec):
        from mlxcel.tp.launch import tp_stack

        async with tp_stack(
            spec.model,
            spec.size,
            hostfile=spec.hostfile,
            max_batch_size=g.max_batch_size,
            prefill_step_size=g.prefill_step_size,
            name="serve-tp",
            startup_timeout=spec.startup_timeout,
            backend=spec.backend,
            **limits,
        ) as tp:

            async def health() -> dict[str, object]:
                ranks: dict[str, object] = {"ranks": tp.size}
                if tp.engine.fatal.is_set():
                    ranks["error"] = tp.engine.fatal_reason
                return {"ready": not tp.engine.fatal.is_set(), "tensor_parallel": ranks}

            # The group failing stops the runner like a signal does.
            serving = Serving(
                tp.node,
                tp.frontend,
                lambda: tp.engine.active,
                health,
                done=tp.engine.fatal,
                sampling=EXTENDED_SAMPLING,
                mode="tensor parallel",
                kv=lambda: kv_figures(
                    tp.engine.kv_tokens(), tp.loaded.config, tp.loaded.n_layers, tp.size
                ),
            )
            yield Assembled(
                serving,
                tp.loaded.name,
                f"tensor-parallel group of {tp.size} ranks",
                failure=lambda: tp.engine.fatal_reason or None,
            )
    elif isinstance(spec, PipelineSpec):
        from mlxcel.pipeline.inproc import pipeline_stack

        async with pipeline_stack(
            spec.model,
            spec.size,
            pp_layers=spec.layers,
            return_logits=spec.return_logits,
            max_batch_size=g.max_batch_size,
            prefill_step_size=g.prefill_step_size,
            micro_batch_size=spec.micro_batch_size,
            **limits,
        ) as ps:
            c = ps.coordinator
            plan = ", ".join(p.spec for p in ps.plan)
            yield Assembled(
                Serving(
                    ps.node,
                    ps.frontend,
                    lambda: c.active,
                    c.health,
                    sampling=_pipeline_sampling(spec.return_logits),
                    mode="pipeline",
                    topology=_pipeline_topology(c),
                ),
                ps.loaded.name,
                f"in-process pipeline of {len(ps.plan)} stages: {plan}",
            )
    elif isinstance(spec, CoordinatorSpec):
        from mlxcel.pipeline.remote import remote_coordinator

        async with remote_coordinator(
            spec.cfg,
            spec.me,
            spec.model,
            spec.secret,
            return_logits=spec.return_logits,
            interface=spec.interface,
            startup_timeout=spec.startup_timeout,
            prefill_step_size=g.prefill_step_size,
            micro_batch_size=spec.micro_batch_size,
            max_batch_size=g.max_batch_size,
            trust_weights=spec.trust_weights,
            **limits,
        ) as rc:
            from mlxcel.config import router_stats_verbose

            c = rc.coordinator
            # Stage addresses in /health only when asked for (as /router/stats).
            verbose = router_stats_verbose()
            yield Assembled(
                Serving(
                    rc.node,
                    rc.frontend,
                    lambda: c.active,
                    lambda: c.health(verbose),
                    sampling=_pipeline_sampling(spec.return_logits),
                    mode="pipeline",
                    topology=_pipeline_topology(c),
                ),
                spec.model.name,
                f"pipeline coordinator of {len(rc.plan)} stages",
            )
    elif isinstance(spec, DisaggSpec):
        async with _disagg(spec, g) as assembled:
            yield assembled
    else:
        from mlxcel.pipeline.remote import stage_node

        async with stage_node(
            spec.cfg,
            spec.me,
            spec.model,
            spec.secret,
            return_logits=spec.return_logits,
            max_batch=g.max_batch_size,
            prefill_step_size=g.prefill_step_size,
            interface=spec.interface,
            trust_weights=spec.trust_weights,
        ) as (service, listener, layers):
            yield Assembled(
                Serving(service.node, listener=listener, done=service.stopped),
                spec.model.name,
                f"stage {spec.me.id} (layers {layers})",
                stage=service,
            )


def _pipeline_topology(coordinator: Any) -> Any:
    async def topology() -> Any:
        from mlxcel.server.cluster_view import pipeline_topology

        return pipeline_topology(await coordinator.health(verbose=False))

    return topology


def _pipeline_sampling(return_logits: bool) -> frozenset[str]:
    """The final stage samples with every parameter (processors, top_logprobs); with
    --pp-return-logits the coordinator samples the returned logits itself, plainly."""
    from mlxcel.messages import EXTENDED_SAMPLING

    return frozenset() if return_logits else EXTENDED_SAMPLING


@asynccontextmanager
async def _disagg(spec: DisaggSpec, g: Generation) -> AsyncIterator[Assembled]:
    from mlxcel.messages import EXTENDED_SAMPLING
    from mlxcel.runner import Serving

    if spec.role == "router":
        from mlxcel.config import router_stats_verbose
        from mlxcel.disagg.stack import router_stack

        async with router_stack(
            spec.model,
            spec.secret,
            spec.bind,
            list(spec.prefill_peers),
            list(spec.decode_peers),
            parallel=g.parallel,
            queue_size=g.queue_size,
            request_timeout=g.request_timeout,
            startup_timeout=spec.startup_timeout,
            interface=spec.interface,
            peer_timeout=spec.peer_timeout,
            prefill_timeout=spec.prefill_timeout,
        ) as rs:
            svc = rs.service
            serving = Serving(
                rs.node,
                rs.frontend,
                lambda: svc.router.active,
                svc.health,
                rs.listener,
                # The prefill and decode nodes sample with the one-process engine, and the
                # handoff carries what its penalties and PRNG need: every parameter.
                sampling=EXTENDED_SAMPLING,
                mode="disaggregated router",
            )

            async def topology() -> Any:
                from mlxcel.server.cluster_view import router_topology

                return router_topology(svc.stats(verbose=False))

            serving.topology = topology
            # Read per request: an operator may flip it without a restart of the probe state.
            serving.extra_get["/router/stats"] = lambda: svc.stats(router_stats_verbose())
            yield Assembled(
                serving,
                spec.model.name,
                f"router over {len(spec.prefill_peers)} prefill and {len(spec.decode_peers)} "
                f"decode nodes, results on {spec.bind}",
            )
        return
    from mlxcel.disagg.protocol import NODE_CAPACITY
    from mlxcel.disagg.stack import worker_stack

    async with worker_stack(
        spec.role,
        spec.model,
        spec.secret,
        spec.bind,
        decode_peers=list(spec.decode_peers),
        max_batch_size=g.max_batch_size,
        prefill_step_size=g.prefill_step_size,
        max_sequences=NODE_CAPACITY,  # what the router lets a node hold
        interface=spec.interface,
        peer_timeout=spec.peer_timeout,
        allowlist=spec.decode_allowlist,
    ) as ws:
        yield Assembled(
            Serving(ws.node, listener=ws.listener, drain=ws.service.drain),
            spec.model.name,
            f"{spec.role} node on {spec.bind}",
        )
