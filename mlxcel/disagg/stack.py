"""Wiring of the disaggregated router: tokenizer, cluster listener, service, frontend.

Every role listens on its ``--serving-bind`` address (its identity, bound to the source IP
its connections come from) and authenticates every connection with the cluster secret. The
router runs the frontend behind the HTTP API and holds no model (it never imports MLX);
prefill and decode nodes (:mod:`.worker_stack`) serve only their cluster port.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.base.messages import EXTENDED_SAMPLING
from mlxcel.base.model_config import context_length, vocab_size
from mlxcel.base.topology import Topology, router_topology
from mlxcel.disagg.router_core import RouterCore
from mlxcel.disagg.service import RouterService
from mlxcel.net.listener import ClusterListener
from mlxcel.net.network import split_hostport
from mlxcel.net.pool import ConnectionPool
from mlxcel.pipeline.cluster_config import ClusterSection
from mlxcel.pipeline.remote import cluster_net
from mlxcel.reactor.bus import Node
from mlxcel.serving.frontend import Frontend
from mlxcel.serving.specs import DisaggSpec, Generation
from mlxcel.serving.stack import Serving, Stack
from mlxcel.serving.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from mlxcel.runtime.engine import LocalEngine

PING_BUDGET = 1.0  # at least this long for a probe's ping to be answered


@dataclass
class RoleParts:
    service: Any  # RouterService | PrefillService | DecodeService
    listener: ClusterListener
    engine: LocalEngine | None = None  # prefill and decode


@asynccontextmanager
async def router_stack(spec: DisaggSpec, gen: Generation) -> AsyncIterator[Stack[RoleParts]]:
    """A router that has seen one prefill and one decode node answer; the runner binds its
    listener (results come back there) with the HTTP API."""
    tokenizer, config = load_tokenizer(spec.model)
    prefill, decode = list(spec.prefill_peers), list(spec.decode_peers)
    async with Node("router") as node:
        section = ClusterSection(peer_timeout=spec.peer_timeout)
        listener, pool, endpoint = cluster_net(
            node, section, spec.bind, "router", spec.secret, spec.interface, [*prefill, *decode]
        )
        core = RouterCore(
            prefill,
            decode,
            first_nonce=secrets.randbits(48) + 1,
            prefill_timeout=spec.prefill_timeout,
            vocab=vocab_size(config),
            max_len=context_length(config),
        )
        service = RouterService(node, endpoint, core, _prober(pool))
        service.attach()
        await service.wait_ready(spec.startup_timeout)
        fe = Frontend.attached(node, tokenizer, gen, context_length(config))
        summary = (
            f"router over {len(prefill)} prefill and {len(decode)} decode nodes, results on "
            f"{spec.bind}"
        )
        serving = _router_serving(node, fe, service, listener, spec.verbose_stats)
        yield Stack("router", serving, spec.model.name, summary, RoleParts(service, listener))


def _prober(pool: ConnectionPool) -> Callable[[str, float, bool], Awaitable[None]]:
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

    return probe


def _router_serving(
    node: Node,
    fe: Frontend,
    service: RouterService,
    listener: ClusterListener,
    verbose: Callable[[], bool],
) -> Serving:
    async def topology() -> Topology:
        return router_topology(service.stats(verbose=False))

    return Serving(
        node,
        fe,
        lambda: service.router.active,
        service.health,
        listener,
        # The prefill and decode nodes sample with the one-process engine, and the handoff
        # carries what its penalties and PRNG need: every parameter.
        # Not response_format: the grammar's matcher would have to cross the handoff (or
        # run on every rank): refused by name.
        sampling=EXTENDED_SAMPLING - {"response_format"},
        label="disaggregated router",
        topology=topology,
        # Read per request: an operator may flip it without a restart.
        extra_get={"/router/stats": lambda: service.stats(verbose())},
    )
