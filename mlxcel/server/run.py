"""Wiring of a single-process serving node: model, engine, frontend, HTTP API, signals."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from loguru import logger

from mlxcel.bus import Node
from mlxcel.config import ServeSettings
from mlxcel.errors import ListenError
from mlxcel.frontend import Frontend
from mlxcel.runtime.blas import ensure_blas
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.model import LoadedModel, load_model
from mlxcel.server.metrics import Metrics
from mlxcel.server.openai_api import build_app


@dataclass
class LocalStack:
    """Everything a one-process node runs, for the CLI, tests and embedding services."""

    node: Node
    loaded: LoadedModel
    engine: LocalEngine
    frontend: Frontend


@asynccontextmanager
async def local_stack(
    model_path: Path,
    *,
    max_batch_size: int = 8,
    prefill_step_size: int = 512,
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


async def serve(settings: ServeSettings, model_path: Path) -> None:
    logger.info("BLAS: {}", ensure_blas())
    async with local_stack(
        model_path,
        max_batch_size=settings.max_batch_size,
        prefill_step_size=settings.prefill_step_size,
        parallel=settings.parallel,
        queue_size=settings.queue_size,
        request_timeout=settings.request_timeout,
        name="serve",
    ) as stack:
        logger.info(
            "model {} ({}, {} layers); decode path: batched forward, up to {} sequences per step",
            stack.loaded.name,
            stack.loaded.family,
            stack.loaded.n_layers,
            settings.max_batch_size,
        )
        await serve_http(
            settings,
            stack.frontend,
            stack.node,
            stack.loaded.name,
            inflight=lambda: stack.engine.active,
        )


async def serve_http(
    settings: ServeSettings,
    frontend: Frontend,
    node: Node,
    default_name: str,
    *,
    inflight: Callable[[], float],
    stop: asyncio.Event | None = None,
    health_extra: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> None:
    """Serve the HTTP API until SIGINT/SIGTERM (or ``stop``), then drain and close."""
    metrics = Metrics()
    metrics.bind(
        queue_depth=lambda: frontend.waiting,
        inflight=inflight,
        inflight_requests=lambda: frontend.in_flight,
        handler_errors=lambda: sum(node.bus.handler_errors.values()),
    )
    model_name = settings.served_model_name or default_name
    app = build_app(
        frontend,
        metrics,
        model_name=model_name,
        default_max_tokens=settings.default_max_tokens,
        max_body_bytes=settings.max_body_bytes,
        health_extra=health_extra,
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(
            f"cannot serve HTTP on {settings.host}:{settings.port}: {exc.strerror or exc}"
        ) from None
    port = runner.addresses[0][1] if runner.addresses else settings.port
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if sys.platform != "win32":
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    # One stable line on stdout that scripts and tests wait for (signals are armed by now).
    print(f"mlxcel serving {model_name} on http://{settings.host}:{port}", flush=True)
    try:
        await stop.wait()
        logger.info(
            "draining: admitting no new requests, finishing {} in flight", frontend.in_flight
        )
        await frontend.drain(loop.time() + settings.drain_timeout)
        logger.info("shutting down")
    finally:
        if sys.platform != "win32":
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await runner.cleanup()
