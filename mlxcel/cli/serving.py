"""``mlxcel serve``: describe the node the flags ask for, assemble it (one path for every
kind of node), run it under a NodeRunner, and stop on SIGINT/SIGTERM. Signal handling lives
here, in the CLI, and nowhere in the library."""

from __future__ import annotations

from typing import Any

from loguru import logger

from mlxcel.cli.cluster_nodes import cluster_node_spec, cluster_secret
from mlxcel.cli.commands import _print_plan, _tp_follower, resolve_model, single_host_spec
from mlxcel.cli.http_checks import ApiOptions, api_options, check_context, check_port
from mlxcel.config.settings import ServeSettings, router_stats_verbose
from mlxcel.net.connection import DEFAULT_PEER_TIMEOUT
from mlxcel.process.home import RANDOM_WEIGHTS_NOTE, is_embedded
from mlxcel.process.loop import signals
from mlxcel.serving.assembly import DisaggSpec, Generation, StackSpec, assemble
from mlxcel.serving.stack import Stack


async def serve(s: ServeSettings) -> int:
    api = api_options(s)  # a bad template or origin fails before anything starts
    spec = await _spec(s)
    if spec is None:
        return 0  # a dry run, or a tensor-parallel follower that has finished
    # The cluster listener: a pipeline node's, or a disaggregated role's --serving-bind.
    cluster = getattr(getattr(spec, "me", None), "address", None) or getattr(spec, "bind", None)
    if cluster is not None:
        host, _, port = cluster.rpartition(":")
        check_port(host.strip("[]"), int(port), "listen for cluster connections")
    if _serves_http(spec):
        check_context(api, spec.model)
        check_port(s.host, s.port)  # before the model loads, not after
        if is_embedded(spec.model):
            logger.info("note: {}", RANDOM_WEIGHTS_NOTE)
    gen = Generation(
        s.parallel,
        s.queue_size,
        s.request_timeout,
        s.max_batch_size,
        s.prefill_step_size,
        int(s.prompt_cache_bytes),
        s.stream_interval,
    )
    async with assemble(spec, gen) as stack:
        logger.info("{}", stack.summary)
        if stack.serving.frontend is None:
            await _serve_cluster_port(stack, s.drain_timeout)
        else:
            await _serve_http(s, stack, api)
        failure = stack.failure()
    if failure:
        from mlxcel.base.errors import TpGroupFailed

        raise TpGroupFailed(f"tensor-parallel group failed: {failure}")
    return 0


async def _spec(s: ServeSettings) -> StackSpec | None:
    if s.node_role != "hybrid":
        return _disagg_spec(s)
    if s.distributed_config is not None:
        return _distributed_spec(s)
    if s.pp_auto is not None or s.pp_peer:
        from mlxcel.cli.bringup import bringup_spec

        return await bringup_spec(s)
    path = resolve_model(s.model)
    if await _tp_follower(s, path):
        return None
    if s.dry_run:
        _print_plan(path, s.pp_size, s.pp_layers)
        return None
    return single_host_spec(s, path)


def _disagg_spec(s: ServeSettings) -> DisaggSpec:
    """Every disaggregated role authenticates its peers: the secret is required."""
    assert s.serving_bind is not None
    return DisaggSpec(
        s.node_role,
        resolve_model(s.model),
        cluster_secret(s, None),
        s.serving_bind,
        tuple(s.peer_list("prefill_peers")),
        tuple(s.peer_list("decode_peers")),
        s.cluster_interface,
        s.startup_timeout,
        s.peer_timeout if s.peer_timeout is not None else DEFAULT_PEER_TIMEOUT,
        s.prefill_timeout,
        s.decode_allowlist,
        router_peers=tuple(s.peer_list("router_peers")) or None,
        handoff_lease=s.handoff_lease,
        handoff_lease_max=s.handoff_lease_max,
        verbose_stats=router_stats_verbose,
    )


def _distributed_spec(s: ServeSettings) -> StackSpec | None:
    from mlxcel.base.errors import ConfigError
    from mlxcel.pipeline.cluster_config import load_cluster_config

    assert s.distributed_config is not None
    cfg = load_cluster_config(s.distributed_config)
    if s.model is not None:
        path = resolve_model(s.model)
    elif cfg.model is not None:
        path = (s.distributed_config.parent / cfg.model).expanduser()
    else:
        path = resolve_model(None)
    if s.dry_run:
        from mlxcel.pipeline.split import CLUSTER_SOURCES

        _print_plan(
            path,
            cfg.pipeline_parallel_size,
            cfg.pp_layers,
            cfg.memory,
            CLUSTER_SOURCES,
        )
        return None
    if s.node_id is None:
        raise ConfigError(
            "--node-id", "required with --distributed-config (which node of the cluster is this?)"
        )
    me = cfg.node(s.node_id)
    return cluster_node_spec(s, cfg, me, path, cluster_secret(s, s.distributed_config))


def _serves_http(spec: StackSpec) -> bool:
    return spec.mode not in ("stage", "prefill", "decode")


async def _serve_http(s: ServeSettings, stack: Stack[Any], api: ApiOptions) -> None:
    """Serve the HTTP API until a signal (or the stack is done), then drain and close."""
    from mlxcel.base.errors import ConfigError
    from mlxcel.runtime.hub import is_hub_id
    from mlxcel.serving.runner import HttpOptions, NodeRunner

    # A Hub model is served under its id, not its snapshot folder's hash.
    hub = s.model if s.model is not None and is_hub_id(s.model) else None
    name = s.served_model_name or hub or stack.model_name
    from mlxcel.server.http_guard import raise_fd_limit

    raise_fd_limit()  # the HTTP connection cap is set below it
    if s.min_p and "min_p" not in stack.serving.sampling:  # every request would be refused
        raise ConfigError("--min-p", f"this mode ({stack.serving.label}) does not apply min_p")
    http = HttpOptions(
        s.host,
        s.port,
        name,
        s.default_max_tokens,
        s.max_body_bytes,
        header_timeout=s.http_header_timeout,
        body_timeout=s.http_body_timeout,
        max_connections=s.max_http_connections,
        api_keys=api.api_keys,
        shared_prompt_cache=api.shared_prompt_cache,
        allowed_origins=api.origins,
        sampling_defaults={
            k: v
            for k, v in (("temperature", s.temp), ("top_p", s.top_p), ("min_p", s.min_p))
            if v is not None
        },
    )
    fe = stack.frontend
    fe.max_model_len = api.max_model_len
    fe.chat_template = api.chat_template
    runner = NodeRunner(stack, http, drain_timeout=s.drain_timeout)
    await runner.setup()
    await runner.start()
    with signals(runner.request_stop):
        # One stable line that scripts and tests wait for (signals are armed by now).
        logger.info("mlxcel serving {} on {}", name, runner.addresses["http"])
        await runner.wait()
        await runner.stop()


async def _serve_cluster_port(stack: Stack[Any], drain_timeout: float) -> None:
    """A stage, prefill or decode node: its cluster port only, until a signal (or a stage's
    shutdown order); then what it holds runs to its end (up to ``drain_timeout``)."""
    from mlxcel.net.interfaces import probe_rdma
    from mlxcel.serving.runner import NodeRunner

    runner = NodeRunner(stack, drain_timeout=drain_timeout)
    await runner.start()
    if stack.mode == "stage":
        logger.info("transport: {}", probe_rdma().detail)
    with signals(runner.request_stop):
        logger.info("mlxcel {} listening on {}", stack.summary, runner.addresses["cluster"])
        await runner.wait()
        await runner.stop()
    logger.info("{} stopped", stack.summary)
