"""In-process pipeline: N stage nodes and a coordinator node in one process, on a LocalFabric.

The same roles and messages as the multi-host path, minus the sockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from mlxcel.bus import Node
from mlxcel.defaults import PREFILL_STEP_SIZE
from mlxcel.frontend import Frontend
from mlxcel.net.network import LocalFabric
from mlxcel.pipeline.coordinator import PipelineCoordinator
from mlxcel.pipeline.partition import StagePlan, auto_split, layer_costs, parse_layers, plan
from mlxcel.pipeline.stage import StageConfig, StageService
from mlxcel.pipeline.stage_protocol import keep_alive_interval
from mlxcel.pipeline.stage_runtime import StageRuntime
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.model import LayerRange, LoadedModel, load_model

STEP_TIMEOUT = 30.0  # the coordinator's step deadline (its stages report progress within it)


@dataclass
class PipelineStack:
    node: Node
    loaded: LoadedModel
    frontend: Frontend
    coordinator: PipelineCoordinator
    stages: list[StageService]
    plan: list[StagePlan]
    fabric: LocalFabric


def make_plan(
    model_path: Path, n_layers: int, pp_size: int, pp_layers: str | None
) -> list[StagePlan]:
    costs = layer_costs(model_path, n_layers)
    if pp_layers:
        return plan(costs, parse_layers(pp_layers, n_layers))
    return auto_split(costs, pp_size)


@asynccontextmanager
async def pipeline_stack(
    model_path: Path,
    pp_size: int,
    *,
    pp_layers: str | None = None,
    parallel: int = 8,
    queue_size: int = 64,
    request_timeout: float = 600.0,
    return_logits: bool = False,
    max_batch_size: int = 8,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    micro_batch_size: int | None = None,
    stage_threads: bool = False,
) -> AsyncIterator[PipelineStack]:
    """N stages and a coordinator in this process. By default the stages share one compute
    thread -- one device, fed in order: a stage hands its activation to the next as a device
    array still being computed, so the next stage's graph is built meanwhile. With
    ``stage_threads`` each stage has a compute thread of its own (activations are evaluated
    and copied between them), so micro-batches overlap on the host as they do across
    processes: stage k computes micro-batch m while stage k+1 computes m-1."""
    stage_batch = max(1, min(parallel, max_batch_size))  # a stage never sees more rows
    if micro_batch_size is None:
        # With one compute thread micro-batches cannot overlap: splitting the batch would only
        # cost batching (8 streams on `small`: 75 tok/s in two micro-batches of 4, 110-120 in
        # one of 8). With a thread per stage, one micro-batch per stage.
        micro_batch_size = -(-stage_batch // pp_size) if stage_threads else stage_batch
    compute = ComputeThread()
    threads = [compute]
    try:
        loaded = await compute.run(load_model, model_path)
        stages_plan = make_plan(model_path, loaded.n_layers, pp_size, pp_layers)
        names = [f"stage-{i}" for i in range(len(stages_plan))]
        fabric = LocalFabric()
        async with AsyncExitStack() as stack:
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
                    return_logits=return_logits,
                    max_batch=stage_batch,
                    warm_up_tokens=prefill_step_size,
                    progress_interval=keep_alive_interval(STEP_TIMEOUT, len(names)),
                    device_handoff=not stage_threads and i + 1 < len(names),
                )
                if stage_threads and i:
                    threads.append(ComputeThread(f"mlxcel-stage{i}"))
                svc = StageService(
                    node,
                    fabric.endpoint(names[i], node),
                    StageRuntime(LayerRange(loaded, sp.start, sp.end), cfg.device_handoff),
                    threads[-1],
                    cfg,
                )
                svc.attach()
                await svc.warm_up()
                services.append(svc)
            if not stage_threads and not return_logits and micro_batch_size >= stage_batch:
                # One compute thread and one micro-batch: the last stage starts the entry
                # stage's next step while it samples this one (what mlx-lm's loop does within
                # one model). With several micro-batches each would undo the other's.
                services[-1].runtime.ahead_to = services[0].runtime
            coord_node = await stack.enter_async_context(Node("coordinator"))
            coordinator = PipelineCoordinator(
                coord_node,
                fabric.endpoint("coordinator", coord_node),
                names,
                eos=loaded.eos_token_ids(),
                vocab=int(loaded.config["vocab_size"]),
                max_len=int(loaded.config.get("max_position_embeddings", 1 << 30)),
                step_timeout=STEP_TIMEOUT,
                return_logits=return_logits,
                max_sequences=max(parallel, 1),
                prefill_step_size=prefill_step_size,
                micro_batch_size=micro_batch_size,
                stage_max_batch=stage_batch,
            )
            coordinator.attach()
            fe = Frontend(
                coord_node,
                loaded.tokenizer,
                parallel=parallel,
                queue_size=queue_size,
                request_timeout=request_timeout,
            )
            fe.attach()
            yield PipelineStack(coord_node, loaded, fe, coordinator, services, stages_plan, fabric)
    finally:
        for thread in threads:
            thread.close()
