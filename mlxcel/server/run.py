"""The one-process mode: the whole model on the compute thread, one engine, the frontend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from pydantic import ByteSize

from mlxcel.base.messages import EXTENDED_SAMPLING
from mlxcel.base.model_config import context_length
from mlxcel.reactor.bus import Node
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.kv_usage import figures
from mlxcel.runtime.model import LoadedModel, load_model
from mlxcel.serving.frontend import Frontend
from mlxcel.serving.specs import Generation, LocalSpec
from mlxcel.serving.stack import Serving, Stack


@dataclass
class LocalParts:
    loaded: LoadedModel
    engine: LocalEngine


@asynccontextmanager
async def local_stack(spec: LocalSpec, gen: Generation) -> AsyncIterator[Stack[LocalParts]]:
    """Load the model on the compute thread and run engine + frontend on a fresh Node."""
    compute = ComputeThread()
    try:
        loaded = await compute.run(load_model, spec.model, False, spec.adapter)
        async with Node("local") as node:
            engine = LocalEngine(
                node,
                loaded,
                compute,
                max_batch_size=gen.max_batch_size,
                prefill_step_size=gen.prefill_step_size,
                max_sequences=max(gen.parallel, 1),
                # A rotated cache has no prefix left to reuse: no prompt cache with one.
                prompt_cache_bytes=gen.prompt_cache_bytes if spec.max_kv_size is None else 0,
                max_kv_size=spec.max_kv_size,
            )
            engine.runtime.run_steps = gen.stream_interval
            await engine.attach()
            fe = Frontend.attached(node, loaded.tokenizer, gen, context_length(loaded.config))
            pc = engine.runtime.prompt_cache
            # Every OpenAI parameter serve serves: the engine applies all of mlx-lm's processors.
            serving = Serving(
                node,
                fe,
                lambda: engine.active,
                sampling=EXTENDED_SAMPLING,
                prompt_cache=pc.stats if pc is not None else None,
                kv=lambda: figures(engine.kv_tokens(), loaded.config, loaded.n_layers),
            )
            summary = (
                f"model {loaded.name} ({loaded.family}, {loaded.n_layers} layers); decode path: "
                f"batched forward, up to {gen.max_batch_size} sequence(s) per step; prompt cache: "
                + (ByteSize(pc.max_bytes).human_readable() if pc is not None else "off")
                + (f"; KV cache: at most {spec.max_kv_size} tokens a sequence (rotating)"
                   if spec.max_kv_size is not None else "")
                + (f"; LoRA adapter {spec.adapter}" if spec.adapter is not None else "")
            )  # fmt: skip
            yield Stack("local", serving, loaded.name, summary, LocalParts(loaded, engine))
    finally:
        compute.close()
