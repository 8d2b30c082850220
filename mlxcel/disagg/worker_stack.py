"""A prefill or decode node: its model loaded and warmed up, its service over an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from loguru import logger

from mlxcel.base.model_config import context_length, vocab_size
from mlxcel.disagg.decode_core import DecodeConfig
from mlxcel.disagg.prefill_core import PrefillConfig
from mlxcel.disagg.protocol import NODE_CAPACITY, parse_allowlist
from mlxcel.disagg.stack import RoleParts
from mlxcel.disagg.worker_service import DecodeService, PrefillService
from mlxcel.pipeline.cluster_config import ClusterSection
from mlxcel.pipeline.remote import cluster_net
from mlxcel.reactor.bus import Node
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.kv_usage import figures
from mlxcel.runtime.model import LoadedModel, load_model
from mlxcel.serving.specs import DisaggSpec, Generation
from mlxcel.serving.stack import Serving, Stack


def _kv_dims(loaded: LoadedModel) -> tuple[int, int, int, int]:
    """(layers, kv heads, key dim, value dim) of this model's cache, read from a one-token
    forward (also a warm-up). Keys and values differ in width under MLA, where the keys are
    the compressed latent and the values its rotary part."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    mx.eval(loaded.model(mx.array([[0]]), cache=cache))
    # The first attention layer's (a hybrid's linear layers keep recurrent state instead; such
    # a family is refused per request before any handoff, see unsupported_reason).
    kv = next((c for c in cache if getattr(c, "keys", None) is not None), None)
    if kv is None:
        return len(cache), 0, 0, 0
    return len(cache), int(kv.keys.shape[1]), int(kv.keys.shape[3]), int(kv.values.shape[3])


@asynccontextmanager
async def worker_stack(spec: DisaggSpec, gen: Generation) -> AsyncIterator[Stack[RoleParts]]:
    """A prefill or decode node with its model loaded and warmed up; the runner binds its
    listener."""
    compute = ComputeThread()
    try:
        loaded = await compute.run(load_model, spec.model)
        async with Node(spec.role) as node:
            # Routers it was told of (--router-peers) dial from the members' pool at once;
            # another router's first dial gets a slot by the listener's fair share, every
            # later one from the members' pool.
            section = ClusterSection(peer_timeout=spec.peer_timeout)
            listener, _pool, endpoint = cluster_net(
                node,
                section,
                spec.bind,
                spec.role,
                spec.secret,
                spec.interface,
                [*spec.decode_peers, *(spec.router_peers or ())],
            )
            engine = LocalEngine(
                node,
                loaded,
                compute,
                max_batch_size=gen.max_batch_size,
                prefill_step_size=gen.prefill_step_size,
                max_sequences=NODE_CAPACITY,  # what the router lets a node hold
                # A prefill node keeps the prompts it ran, a decode node the conversations it
                # finished: the router sends a next turn to whichever holds more of it.
                prompt_cache_bytes=gen.prompt_cache_bytes,
            )
            engine.runtime.run_steps = gen.stream_interval
            await engine.attach()
            make = _prefill_service if spec.role == "prefill" else _decode_service
            service = await make(node, endpoint, engine, compute, spec)
            service.attach()
            serving = Serving(
                node,
                inflight=lambda: engine.active,
                listener=listener,
                kv=lambda: figures(engine.kv_tokens(), loaded.config, loaded.n_layers),
                drain=service.drain,
            )
            summary = f"{spec.role} node on {spec.bind}"
            parts = RoleParts(service, listener, engine)
            yield Stack(spec.role, serving, spec.model.name, summary, parts)
    finally:
        compute.close()


def _model_bounds(loaded: LoadedModel) -> tuple[int, int]:
    """(vocab size, longest sequence) of the model's config."""
    config = loaded.config
    return vocab_size(config), context_length(config)


async def _prefill_service(
    node: Node, endpoint: Any, engine: LocalEngine, compute: ComputeThread, spec: DisaggSpec
) -> PrefillService:
    from mlxcel.runtime.kv_handoff import unsupported_reason

    loaded = engine.loaded
    unsupported = await compute.run(unsupported_reason, loaded.model, loaded.family)
    if unsupported:
        logger.warning("prefill: {}; every request will be refused", unsupported)
    else:
        await compute.run(_kv_dims, loaded)
    allowed, skipped = parse_allowlist(spec.decode_allowlist)
    for item in skipped:
        logger.warning("--decode-allowlist: skipping {!r}: not a numeric IP:port", item)
    if allowed is None:
        logger.warning(
            "--decode-allowlist (MLXCEL_DECODE_ALLOWLIST) is unset or has no valid entry: this "
            "prefill node hands KV caches to any decode target a request names"
        )
    vocab, max_len = _model_bounds(loaded)
    cfg = PrefillConfig(
        spec.decode_peers,
        allowed,
        unsupported,
        vocab,
        max_len,
        lease=spec.handoff_lease,
        lease_max=spec.handoff_lease_max,
        max_sequences=NODE_CAPACITY,
    )
    return PrefillService(node, endpoint, engine, cfg)


async def _decode_service(
    node: Node, endpoint: Any, engine: LocalEngine, compute: ComputeThread, spec: DisaggSpec
) -> DecodeService:
    dims = await compute.run(_kv_dims, engine.loaded)
    vocab, max_len = _model_bounds(engine.loaded)
    return DecodeService(
        node,
        endpoint,
        engine,
        DecodeConfig(
            vocab,
            max_len,
            NODE_CAPACITY,
            # A lease's progress bound is the wait for a handoff's next part (and verdict).
            verdict_wait=spec.handoff_lease + 5.0,
            dims=dims,
            routers=frozenset(spec.router_peers) if spec.router_peers else None,
            keeps=engine.runtime.prompt_cache is not None,
        ),
    )
