"""A pipeline stage as a node of its own: its layers loaded and warmed up, serving its
cluster port. The coordinator it serves is :mod:`.remote`'s."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from loguru import logger

from mlxcel.bringup.identity import model_identity
from mlxcel.pipeline.remote import cluster_plan, node_net
from mlxcel.pipeline.stage import StageConfig, StageService
from mlxcel.pipeline.stage_protocol import keep_alive_interval
from mlxcel.pipeline.stage_runtime import StageRuntime
from mlxcel.reactor.bus import Node
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.model import LayerRange, load_model
from mlxcel.serving.specs import Generation, StageSpec
from mlxcel.serving.stack import Serving, Stack


@asynccontextmanager
async def stage_stack(spec: StageSpec, gen: Generation) -> AsyncIterator[Stack[StageService]]:
    """A stage node of ``spec.cfg``, warmed up; its cluster listener (in ``serving``) is bound
    by the runner."""
    cfg, me = spec.cfg, spec.me
    stages = cfg.stages
    index = [s.id for s in stages].index(me.id)
    plans = cluster_plan(cfg, spec.model)
    compute = ComputeThread()
    try:
        # Hashing the weights (the first time: seconds per GB) overlaps loading them.
        hashing = asyncio.ensure_future(
            asyncio.to_thread(model_identity, spec.model, not spec.trust_weights)
        )
        try:
            loaded = await compute.run(load_model, spec.model, True)
        finally:
            ident = await hashing
        stage_plan = plans[index]
        async with Node(me.id) as node:
            listener, _pool, endpoint = node_net(node, cfg, me, spec.secret, spec.interface)
            service = StageService(
                node,
                endpoint,
                StageRuntime(
                    LayerRange(loaded, stage_plan.start, stage_plan.end),
                    device_handoff=False,
                    prompt_cache_bytes=gen.prompt_cache_bytes,
                ),
                compute,
                StageConfig(
                    me.id,
                    index,
                    len(stages),
                    cfg.coordinator.address,
                    upstream=stages[index - 1].address if index else None,
                    downstream=stages[index + 1].address if index + 1 < len(stages) else None,
                    return_logits=spec.return_logits,
                    max_batch=gen.max_batch_size,
                    warm_up_tokens=gen.prefill_step_size,
                    max_sequences=cfg.cluster.max_sequences_per_stage,
                    lease=cfg.cluster.sequence_lease,
                    forward_timeout=cfg.cluster.forward_timeout,
                    progress_interval=keep_alive_interval(cfg.cluster.step_timeout, len(stages)),
                    model=ident.sha256,
                    weights=ident.weights,
                ),
            )
            service.attach()
            await _warm_up(service, spec.warm_up, me.id)
            serving = Serving(
                node,
                inflight=lambda: len(service.seqs),
                listener=listener,
                done=service.stopped,
                drain=_stage_drain(service),
            )
            summary = f"stage {me.id} (layers {stage_plan.spec})"
            yield Stack("stage", serving, spec.model.name, summary, service)
    finally:
        compute.close()


def _stage_drain(service: StageService) -> Callable[[float], Awaitable[int]]:
    """A stage told to stop finishes its sequences (the coordinator sends it nothing new)
    until the deadline; returns how many are left."""

    async def drain(deadline: float) -> int:
        if not service.stopped.is_set():
            me = service.config.node_id
            logger.info("stage {}: draining {} sequences", me, len(service.seqs))
            service.request_shutdown()
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(service.stopped.wait(), max(left, 0.0))
            except TimeoutError:
                pass
        return len(service.seqs)

    return drain


async def _warm_up(service: StageService, wanted: bool, node_id: str) -> None:
    """Serve throwaway sequences before serving, unless told not to (``--no-warmup``)."""
    if wanted:
        await service.warm_up()
    else:
        logger.info("stage {}: no warm-up (--no-warmup): the first requests compile its "
                    "kernels", node_id)  # fmt: skip
