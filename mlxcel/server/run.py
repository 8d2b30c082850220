"""Wiring of a single-process node (model, engine, frontend) for the CLI, tests and embedders."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlxcel.bus import Node
from mlxcel.defaults import PREFILL_STEP_SIZE
from mlxcel.frontend import Frontend
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.model import LoadedModel, load_model

if TYPE_CHECKING:
    from mlxcel.runner import Serving


@dataclass
class LocalStack:
    """Everything a one-process node runs, for the CLI, tests and embedding services."""

    node: Node
    loaded: LoadedModel
    engine: LocalEngine
    frontend: Frontend

    def serving(self) -> Serving:
        """What a NodeRunner serves over HTTP: every OpenAI parameter ``serve`` serves (the
        engine applies all of mlx-lm's processors), its prompt cache and KV figures."""
        from mlxcel.messages import EXTENDED_SAMPLING
        from mlxcel.runner import Serving
        from mlxcel.runtime.kv_usage import figures

        pc, m = self.engine.prompt_cache, self.loaded
        return Serving(
            self.node,
            self.frontend,
            lambda: self.engine.active,
            sampling=EXTENDED_SAMPLING,
            prompt_cache=pc.stats if pc is not None else None,
            kv=lambda: figures(self.engine.kv_tokens(), m.config, m.n_layers),
        )


@asynccontextmanager
async def local_stack(
    model_path: Path,
    *,
    max_batch_size: int = 8,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    prompt_cache_bytes: int = 0,
    parallel: int = 8,
    queue_size: int = 64,
    request_timeout: float = 600.0,
    name: str = "mlxcel",
) -> AsyncIterator[LocalStack]:
    """Load the model on the compute thread and run engine + frontend on a fresh Node."""
    compute = ComputeThread()
    try:
        loaded = await compute.run(load_model, model_path)
        async with Node(name) as node:
            engine = LocalEngine(
                loaded,
                compute,
                max_batch_size=max_batch_size,
                prefill_step_size=prefill_step_size,
                max_sequences=max(parallel, 1),
                prompt_cache_bytes=prompt_cache_bytes,
            )
            await engine.attach(node)
            fe = Frontend(
                node,
                loaded.tokenizer,
                parallel=parallel,
                queue_size=queue_size,
                request_timeout=request_timeout,
            )
            fe.attach()
            yield LocalStack(node, loaded, engine, fe)
    finally:
        compute.close()
