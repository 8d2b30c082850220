"""Wiring of the disaggregated roles: model, engine, cluster listener, service, frontend.

Every role listens on its ``--serving-bind`` address (its identity, bound to the source IP
its connections come from) and authenticates every connection with the cluster secret. The
router also runs the frontend behind the HTTP API; prefill and decode nodes serve only their
cluster port.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from mlxcel.bus import Node
from mlxcel.defaults import PREFILL_STEP_SIZE
from mlxcel.disagg.decode_core import DecodeConfig
from mlxcel.disagg.prefill_core import PrefillConfig
from mlxcel.disagg.protocol import PREFILL_TIMEOUT, parse_allowlist
from mlxcel.disagg.router_core import RouterCore
from mlxcel.disagg.service import DecodeService, PrefillService, RouterService
from mlxcel.frontend import Frontend
from mlxcel.net.connection import DEFAULT_PEER_TIMEOUT
from mlxcel.net.listener import ClusterListener
from mlxcel.net.network import split_hostport
from mlxcel.net.secret import ClusterSecret
from mlxcel.pipeline.cluster_config import ClusterSection
from mlxcel.pipeline.remote import cluster_net
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.model import LoadedModel, load_model, load_tokenizer_only

PING_BUDGET = 1.0  # at least this long for a probe's ping to be answered


@dataclass
class RoleStack:
    node: Node
    service: Any  # RouterService | PrefillService | DecodeService
    listener: ClusterListener
    frontend: Frontend | None = None  # the router's
    engine: LocalEngine | None = None  # prefill and decode


@asynccontextmanager
async def router_stack(
    model_path: Path,
    secret: ClusterSecret,
    bind: str,
    prefill: list[str],
    decode: list[str],
    *,
    parallel: int = 8,
    queue_size: int = 64,
    request_timeout: float = 600.0,
    startup_timeout: float = 60.0,
    interface: str | None = None,
    peer_timeout: float = DEFAULT_PEER_TIMEOUT,
    prefill_timeout: float = PREFILL_TIMEOUT,
) -> AsyncIterator[RoleStack]:
    """A router that has seen one prefill and one decode node answer; bind ``listener``
    (results come back there) before serving HTTP."""
    tokenizer, config = load_tokenizer_only(model_path)
    async with Node("router") as node:
        section = ClusterSection(peer_timeout=peer_timeout)
        listener, pool, endpoint = cluster_net(
            node, section, bind, "router", secret, interface, [*prefill, *decode]
        )

        async def probe(address: str, deadline: float, fresh: bool) -> None:
            host, port = split_hostport(address)
            if fresh:
                pool.drop(host, port)  # the handshake must succeed again, with that very node
            # A round trip on the open connection: an open socket to a partitioned or stopped
            # node says nothing (no reset ever comes); an answer does.
            # After a lost connection, a refused dial is the answer (a killed node): two tries,
            # not the backoff's five over 3 s.
            conn = await pool.get(host, port, deadline, attempts=2 if fresh else None)
            # The ping's own budget: a dial that took most of the probe's time says nothing
            # about whether the node answers.
            await conn.ping(max(deadline, asyncio.get_running_loop().time() + PING_BUDGET))

        core = RouterCore(
            prefill,
            decode,
            first_nonce=secrets.randbits(48) + 1,
            prefill_timeout=prefill_timeout,
            vocab=int(config["vocab_size"]),
            max_len=int(config.get("max_position_embeddings", 1 << 30)),
        )
        service = RouterService(node, endpoint, core, probe)
        service.attach()
        await service.wait_ready(startup_timeout)
        fe = Frontend(
            node,
            tokenizer,
            parallel=parallel,
            queue_size=queue_size,
            request_timeout=request_timeout,
        )
        fe.attach()
        yield RoleStack(node, service, listener, frontend=fe)


def _kv_dims(loaded: LoadedModel) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of this model's cache, read from a one-token forward
    (also a warm-up)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    mx.eval(loaded.model(mx.array([[0]]), cache=cache))
    first = cache[0]
    keys = first.keys if getattr(first, "keys", None) is not None else first.state[0]
    return len(cache), int(keys.shape[1]), int(keys.shape[3])


@asynccontextmanager
async def worker_stack(
    role: str,
    model_path: Path,
    secret: ClusterSecret,
    bind: str,
    *,
    decode_peers: list[str] | None = None,
    allowlist: str | None = None,
    max_batch_size: int = 8,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    max_sequences: int = 64,
    interface: str | None = None,
    peer_timeout: float = DEFAULT_PEER_TIMEOUT,
) -> AsyncIterator[RoleStack]:
    """A prefill or decode node with its model loaded and warmed up; bind ``listener``."""
    from mlxcel.runtime.kv_handoff import unsupported_reason

    compute = ComputeThread()
    try:
        loaded = await compute.run(load_model, model_path)
        async with Node(role) as node:
            # It is not told the router's address: the router's first dial gets a slot by the
            # listener's fair share, every later one from the members' pool.
            section = ClusterSection(peer_timeout=peer_timeout)
            listener, _pool, endpoint = cluster_net(
                node, section, bind, role, secret, interface, list(decode_peers or ())
            )
            engine = LocalEngine(
                loaded,
                compute,
                max_batch_size=max_batch_size,
                prefill_step_size=prefill_step_size,
                max_sequences=max_sequences,
            )
            await engine.attach(node, serve_bus=False)
            vocab = int(loaded.config["vocab_size"])
            max_len = int(loaded.config.get("max_position_embeddings", 1 << 30))
            service: PrefillService | DecodeService
            if role == "prefill":
                unsupported = await compute.run(unsupported_reason, loaded.model, loaded.family)
                if unsupported:
                    logger.warning("prefill: {}; every request will be refused", unsupported)
                else:
                    await compute.run(_kv_dims, loaded)
                allowed, skipped = parse_allowlist(allowlist)
                for item in skipped:
                    logger.warning("--decode-allowlist: skipping {!r}: not a numeric IP:port", item)
                if allowed is None:
                    logger.warning(
                        "--decode-allowlist (MLXCEL_DECODE_ALLOWLIST) is unset or has no valid "
                        "entry: this prefill node hands KV caches to any decode target a "
                        "request names"
                    )
                cfg = PrefillConfig(
                    tuple(decode_peers or ()),
                    allowed,
                    unsupported,
                    vocab,
                    max_len,
                    max_sequences=max_sequences,
                )
                service = PrefillService(node, endpoint, engine, cfg)
            else:
                dims = await compute.run(_kv_dims, loaded)
                cfg_d = DecodeConfig(vocab, max_len, max_sequences, dims=dims)
                service = DecodeService(node, endpoint, engine, cfg_d, dims)
            service.attach()
            yield RoleStack(node, service, listener, engine=engine)
    finally:
        compute.close()
