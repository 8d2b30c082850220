"""In-process pipeline: N stage nodes and a coordinator node in one process, on a LocalFabric.

The same roles and messages as the multi-host path, minus the sockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from mlxcel.base.model_config import context_length
from mlxcel.net.network import LocalFabric
from mlxcel.pipeline.coordinator import PipelineCoordinator, coordinator_serving
from mlxcel.pipeline.partition import StagePlan
from mlxcel.pipeline.split import make_plan
from mlxcel.pipeline.stage import StageConfig, StageService
from mlxcel.pipeline.stage_protocol import keep_alive_interval
from mlxcel.pipeline.stage_runtime import StageRuntime
from mlxcel.reactor.bus import Node
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.kv_usage import prompt_cache_positions
from mlxcel.runtime.model import LayerRange, LoadedModel, load_model
from mlxcel.serving.frontend import Frontend
from mlxcel.serving.specs import Generation, PipelineSpec
from mlxcel.serving.stack import Stack

STEP_TIMEOUT = 30.0  # the coordinator's step deadline (its stages report progress within it)


@dataclass
class PipelineParts:
    loaded: LoadedModel
    coordinator: PipelineCoordinator
    stages: list[StageService]
    plan: list[StagePlan]
    fabric: LocalFabric


@asynccontextmanager
async def pipeline_stack(
    spec: PipelineSpec, gen: Generation
) -> AsyncIterator[Stack[PipelineParts]]:
    """N stages and a coordinator in this process. By default the stages share one compute
    thread -- one device, fed in order: a stage hands its activation to the next as a device
    array still being computed, so the next stage's graph is built meanwhile. With
    ``spec.stage_threads`` each stage has a compute thread of its own (activations are
    evaluated and copied between them), so micro-batches overlap on the host as they do across
    processes: stage k computes micro-batch m while stage k+1 computes m-1."""
    stage_batch = max(1, min(gen.parallel, gen.max_batch_size))  # a stage never sees more rows
    micro = spec.micro_batch_size
    if micro is None:
        # With one compute thread micro-batches cannot overlap: splitting the batch would only
        # cost batching (8 streams on `small`: 75 tok/s in two micro-batches of 4, 110-120 in
        # one of 8). With a thread per stage, one micro-batch per stage.
        micro = -(-stage_batch // spec.size) if spec.stage_threads else stage_batch
    stages_plan = make_plan(spec.model, spec.size, spec.layers)
    threads = [ComputeThread()]
    try:
        loaded = await threads[0].run(load_model, spec.model)
        fabric = LocalFabric()
        async with AsyncExitStack() as stack:
            services = await _stages(stack, fabric, threads, loaded, stages_plan, spec, gen)
            if not spec.stage_threads and not spec.return_logits and micro >= stage_batch:
                # One compute thread and one micro-batch: the last stage starts the entry
                # stage's next step while it samples this one (what mlx-lm's loop does within
                # one model). With several micro-batches each would undo the other's.
                services[-1].runtime.ahead_to = services[0].runtime
            node = await stack.enter_async_context(Node("coordinator"))
            coordinator = PipelineCoordinator(
                node,
                fabric.endpoint("coordinator", node),
                [s.config.node_id for s in services],
                eos=loaded.eos_token_ids(),
                vocab=loaded.vocab_size,
                max_len=context_length(loaded.config),
                step_timeout=STEP_TIMEOUT,
                return_logits=spec.return_logits,
                max_sequences=max(gen.parallel, 1),
                prefill_step_size=gen.prefill_step_size,
                micro_batch_size=micro,
                stage_max_batch=stage_batch,
                prompt_cache_tokens=prompt_cache_positions(
                    gen.prompt_cache_bytes,
                    loaded.config,
                    [p.end - p.start for p in stages_plan],
                    one_process=True,
                ),  # fmt: skip
            )
            coordinator.attach()
            fe = Frontend.attached(node, loaded.tokenizer, gen, context_length(loaded.config))
            parts = PipelineParts(loaded, coordinator, services, stages_plan, fabric)
            summary = f"in-process pipeline of {len(stages_plan)} stages: " + ", ".join(
                p.spec for p in stages_plan
            )
            serving = coordinator_serving(node, fe, coordinator, spec.return_logits)
            yield Stack("pipeline", serving, loaded.name, summary, parts)
    finally:
        for thread in threads:
            thread.close()


async def _stages(
    stack: AsyncExitStack,
    fabric: LocalFabric,
    threads: list[ComputeThread],
    loaded: LoadedModel,
    stages_plan: list[StagePlan],
    spec: PipelineSpec,
    gen: Generation,
) -> list[StageService]:
    """Every stage on its own node, attached and warmed up (a thread each with
    ``stage_threads``, appended to ``threads``)."""
    names = [f"stage-{i}" for i in range(len(stages_plan))]
    stage_batch = max(1, min(gen.parallel, gen.max_batch_size))
    services = []
    for i, sp in enumerate(stages_plan):
        node = await stack.enter_async_context(Node(names[i]))
        cfg = StageConfig(
            names[i],
            i,
            len(names),
            "coordinator",
            upstream=names[i - 1] if i else None,
            downstream=names[i + 1] if i + 1 < len(names) else None,
            return_logits=spec.return_logits,
            max_batch=stage_batch,
            warm_up_tokens=gen.prefill_step_size,
            progress_interval=keep_alive_interval(STEP_TIMEOUT, len(names)),
            device_handoff=not spec.stage_threads and i + 1 < len(names),
        )
        if spec.stage_threads and i:
            threads.append(ComputeThread(f"mlxcel-stage{i}"))
        # The process's prompt-cache budget, shared by the stages as their layers are.
        share = gen.prompt_cache_bytes * (sp.end - sp.start) // stages_plan[-1].end
        svc = StageService(
            node,
            fabric.endpoint(names[i], node),
            StageRuntime(LayerRange(loaded, sp.start, sp.end), cfg.device_handoff, share),
            threads[-1],
            cfg,
        )
        svc.attach()
        await svc.warm_up()
        services.append(svc)
    return services
