"""``mlxcel serve``: pick the stack the flags ask for, run it under a NodeRunner, and stop on
SIGINT/SIGTERM. Signal handling lives here, in the CLI, and nowhere in the library."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loguru import logger

from mlxcel.cli.commands import _print_plan, _tp_follower, resolve_model
from mlxcel.config import ServeSettings
from mlxcel.net.secret import ClusterSecret, load_cluster_secret
from mlxcel.runner import HttpOptions, NodeRunner, Serving


@contextmanager
def signals(on_signal: Callable[[], None]) -> Iterator[None]:
    """Call ``on_signal`` on SIGINT/SIGTERM while the block runs (not on Windows)."""
    if sys.platform == "win32":
        yield
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def serve_http(s: ServeSettings, serving: Serving, default_name: str) -> None:
    """Serve the HTTP API until a signal (or the stack is done), then drain and close."""
    name = s.served_model_name or default_name
    http = HttpOptions(s.host, s.port, name, s.default_max_tokens, s.max_body_bytes)
    runner = NodeRunner(serving, http, drain_timeout=s.drain_timeout)
    await runner.setup()
    await runner.start()
    with signals(runner.request_stop):
        # One stable line on stdout that scripts and tests wait for (signals are armed by now).
        print(f"mlxcel serving {name} on {runner.addresses['http']}", flush=True)
        await runner.wait()
        await runner.stop()


async def serve(s: ServeSettings) -> int:
    if s.distributed_config is not None:
        return await _serve_distributed(s)
    path = resolve_model(s.model)
    if _tp_follower(s, path):
        return 0
    if s.dry_run:
        return _print_plan(path, s.pp_size, s.pp_layers)
    if s.tp_size > 1 or s.tp_hostfile is not None:
        return await _serve_tp(s, path)
    if s.pp_size > 1 or s.pp_layers is not None:
        from mlxcel.pipeline.inproc import pipeline_stack

        async with pipeline_stack(
            path,
            s.pp_size,
            pp_layers=s.pp_layers,
            parallel=s.parallel,
            queue_size=s.queue_size,
            request_timeout=s.request_timeout,
            return_logits=s.pp_return_logits,
            max_batch_size=s.max_batch_size,
            prefill_chunk=s.prefill_step_size,
            max_in_flight=s.pp_micro_batch_size,
        ) as st:
            c = st.coordinator
            serving = Serving(st.node, st.frontend, lambda: c.active, c.health)
            await serve_http(s, serving, st.loaded.name)
        return 0
    from mlxcel.runtime.blas import ensure_blas
    from mlxcel.server.run import local_stack

    logger.info("BLAS: {}", ensure_blas())
    async with local_stack(
        path,
        max_batch_size=s.max_batch_size,
        prefill_step_size=s.prefill_step_size,
        parallel=s.parallel,
        queue_size=s.queue_size,
        request_timeout=s.request_timeout,
        name="serve",
    ) as stack:
        logger.info(
            "model {} ({}, {} layers); decode path: batched forward, up to {} sequences per step",
            stack.loaded.name,
            stack.loaded.family,
            stack.loaded.n_layers,
            s.max_batch_size,
        )
        serving = Serving(stack.node, stack.frontend, lambda: stack.engine.active)
        await serve_http(s, serving, stack.loaded.name)
    return 0


async def _serve_tp(s: ServeSettings, path: Path) -> int:
    from mlxcel.tp.launch import TpGroupFailed, tp_stack

    async with tp_stack(
        path,
        s.tp_size,
        hostfile=s.tp_hostfile,
        max_batch_size=s.max_batch_size,
        prefill_step_size=s.prefill_step_size,
        parallel=s.parallel,
        queue_size=s.queue_size,
        request_timeout=s.request_timeout,
        name="serve-tp",
        startup_timeout=s.startup_timeout,
    ) as st:

        async def tp_health() -> dict[str, object]:
            failed = st.engine.fatal.is_set()
            out: dict[str, object] = {"ready": not failed, "tensor_parallel": {"ranks": st.tp_size}}
            if failed:
                out["tensor_parallel"] = {"ranks": st.tp_size, "error": st.engine.fatal_reason}
            return out

        # The group failing stops the runner like a signal does.
        serving = Serving(
            st.node, st.frontend, lambda: st.engine.active, tp_health, done=st.engine.fatal
        )
        await serve_http(s, serving, st.loaded.name)
        if st.engine.fatal_reason:
            raise TpGroupFailed(f"tensor-parallel group failed: {st.engine.fatal_reason}")
    return 0


async def _serve_distributed(s: ServeSettings) -> int:
    from mlxcel.errors import ConfigError
    from mlxcel.pipeline.cluster_config import load_cluster_config

    assert s.distributed_config is not None
    cfg = load_cluster_config(s.distributed_config)
    if s.model is not None:
        path = Path(s.model).expanduser()
    elif cfg.model is not None:
        path = (s.distributed_config.parent / cfg.model).expanduser()
    else:
        path = resolve_model(None)
    if s.dry_run:
        return _print_plan(path, cfg.pipeline_parallel_size, cfg.pp_layers, cfg.memory)
    if s.node_id is None:
        raise ConfigError(
            "--node-id", "required with --distributed-config (which node of the cluster is this?)"
        )
    me = cfg.node(s.node_id)
    secret = cluster_secret(s, s.distributed_config)
    if me.role == "stage":
        await _run_stage(s, cfg, me, path, secret)
    else:
        await _run_coordinator(s, cfg, me, path, secret)
    return 0


def cluster_secret(settings: ServeSettings, toml_path: Path) -> ClusterSecret:
    """Every process of a distributed config authenticates its peers: fail closed."""
    secret = load_cluster_secret(
        settings.cluster_secret_file,
        None,
        toml_path,
        required=True,
        cli_label=settings.origin("cluster_secret_file"),
    )
    assert secret is not None
    logger.info("cluster secret from {}", secret.source)
    return secret


async def _run_stage(s, cfg, me, path, secret) -> None:  # type: ignore[no-untyped-def]
    from mlxcel.net.interfaces import probe_rdma
    from mlxcel.pipeline.remote import stage_node

    async with stage_node(
        cfg,
        me,
        path,
        secret,
        return_logits=s.pp_return_logits,
        max_batch=s.max_batch_size,
        prefill_chunk=s.prefill_step_size,
        interface=s.cluster_interface,
    ) as (service, listener, spec):
        serving = Serving(service.node, listener=listener, done=service.stopped)
        runner = NodeRunner(serving)
        await runner.start()
        logger.info("transport: {}", probe_rdma().detail)
        print(f"mlxcel stage {me.id} (layers {spec}) listening on {me.address}", flush=True)
        with signals(runner.request_stop):
            await runner.wait()
            if not service.stopped.is_set():
                logger.info("stage {}: SIGTERM: draining {} sequences", me.id, len(service.seqs))
                service.request_shutdown()
                try:
                    await asyncio.wait_for(service.stopped.wait(), s.drain_timeout)
                except TimeoutError:
                    logger.warning(
                        "stage {}: drain timed out with {} sequences", me.id, len(service.seqs)
                    )
        await runner.stop()
        logger.info("stage {} stopped", me.id)


async def _run_coordinator(s, cfg, me, path, secret) -> None:  # type: ignore[no-untyped-def]
    from mlxcel.pipeline.remote import remote_coordinator

    async with remote_coordinator(
        cfg,
        me,
        path,
        secret,
        parallel=s.parallel,
        queue_size=s.queue_size,
        request_timeout=s.request_timeout,
        return_logits=s.pp_return_logits,
        interface=s.cluster_interface,
        startup_timeout=s.startup_timeout,
        prefill_chunk=s.prefill_step_size,
        max_in_flight=s.pp_micro_batch_size,
    ) as rc:
        c = rc.coordinator
        serving = Serving(rc.node, rc.frontend, lambda: c.active, c.health)
        await serve_http(s, serving, path.name)
