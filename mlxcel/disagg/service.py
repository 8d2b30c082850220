"""The asyncio side of the disaggregated roles (bus, network, timers), and the router's.

Each service is a :class:`~mlxcel.reactor.adapter.CoreAdapter` around its core; :class:`DisaggAdapter`
holds what the three share. The router service stands where the engine stands on a
one-process node, between the frontend and the network, and probes its peers in the
background. It holds no model, and nothing here imports MLX: the prefill and decode services,
which run one, are in :mod:`.worker_service`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.effects import Deliver, Effect, Send
from mlxcel.base.errors import BusError, ConnectFailed, MlxcelError, PeerSilent, SendFailed
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    Progress,
    RunEntry,
    State,
    TokenResult,
)
from mlxcel.disagg.protocol import PROBE_INTERVAL
from mlxcel.disagg.router_core import RouterCore
from mlxcel.reactor.adapter import CoreAdapter, LocalOutbox
from mlxcel.reactor.bus import Node, Origin
from mlxcel.reactor.endpoint import Endpoint

# (address, deadline, fresh): raises if unreachable; ``fresh`` dials anew instead of trusting
# an open connection (after a connection with the node dropped).
Probe = Callable[[str, float, bool], Awaitable[None]]

# How long one send may wait for its peer (connecting included) before it counts as failed.
# Short on purpose: a send to a node that just died must not hold up the sends queued behind
# it for that address (a restarted node comes back at the same one). A send with a deadline
# of its own (a handoff: its lease) uses that instead.
SEND_BUDGET = 5.0
STARTUP_SETTLE = 5.0  # seconds the router waits for its other nodes once one of each answers


class DisaggAdapter(CoreAdapter):
    """The three roles' common adapter settings."""

    def __init__(self, node: Node, endpoint: Endpoint, core: Any, name: str) -> None:
        super().__init__(node, endpoint, core, name, SEND_BUDGET)
        self.deadline_overrides_budget = True

    async def drain(self, deadline: float) -> int:
        """Take no new work (the router learns it from the next State and stops sending),
        and wait until what is in flight is done or ``deadline``; returns what is left.
        An idle node still waits until a State has told the router (or a few probe
        intervals): what the router sends meanwhile is refused unrun and moves elsewhere,
        never lost to a closed connection. A node no router has asked for a State is sent
        nothing and need not wait. Then what is queued to peers is flushed."""
        self.core.draining = True
        heard_by = min(deadline, self.now() + 3 * PROBE_INTERVAL)
        core = self.core
        while self.now() < deadline and (
            core.active or (core.queried and not core.told_draining and self.now() < heard_by)
        ):
            await asyncio.sleep(0.05)
        await self.flush(deadline)
        return int(self.core.active)


class RouterService(DisaggAdapter):
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        core: RouterCore,
        probe: Probe,
        *,
        probe_interval: float = PROBE_INTERVAL,
    ) -> None:
        super().__init__(node, endpoint, core, "router")
        self.router = core
        self.probe = probe
        self.report_expired = True  # a prompt that never left fails over (or fails) at once
        self.probe_interval = probe_interval
        self._local = LocalOutbox(node, "router")
        # Nodes whose handshake refused this router for a reason retrying cannot heal (another
        # cluster secret, protocol version or channel), by address: startup fails on them.
        self.refused: dict[str, str] = {}

    def attach(self) -> None:
        self.subscribe([RunEntry, CancelRequest], Origin.LOCAL, maxsize=1024)
        self.subscribe([TokenResult, Error, State, Progress], Origin.REMOTE, maxsize=4096)
        self._local.start()
        self.node.spawn(self._probe_loop(), name="router.probe", critical=True)
        self.start()

    def undeliverable(self, send: Send, reason: str, exc: BaseException | None) -> list[Effect]:
        # No exception: it never left its outbox. A SendFailed says whether it left.
        unsent = exc is None or (isinstance(exc, SendFailed) and exc.unsent)
        return self.router.undeliverable(send, reason, self.now(), unsent)

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, Deliver):
            self._local.put(effect.msg)
        else:
            super().apply(effect)

    def _peer_lost(self, identity: str) -> None:
        super()._peer_lost(identity)
        if identity in self.router.nodes:  # is it gone, or was that someone else on its IP?
            try:
                self.node.spawn(self._probe_one(identity, fresh=True), name="router.probe-now")
            except BusError:
                pass  # the router is shutting down: its connections close, nothing to probe

    async def _probe_one(self, address: str, fresh: bool = False) -> None:
        wait = min(2.0, self.probe_interval * 2)
        deadline = deadline_in(wait)
        try:
            # Well past the probe's own deadline (a ping may take PING_BUDGET after a slow
            # dial), so a ping's verdict (PeerSilent: the node is lost) is never pre-empted.
            async with asyncio.timeout_at(deadline + 2.0):
                await self.probe(address, deadline, fresh)
        except PeerSilent as exc:  # an open connection went silent: the node is lost
            why = str(exc) or "its connection went silent"
            self.feed(self.router.probe_result(address, False, why, self.now(), lost=True))
        except (MlxcelError, OSError, TimeoutError) as exc:
            if isinstance(exc, ConnectFailed) and exc.failure and not exc.failure.retryable:
                self.refused[address] = str(exc)
            why = str(exc) or (
                f"no answer to a probe within {wait:g}s"
                if isinstance(exc, TimeoutError)
                else f"probe failed ({type(exc).__name__})"
            )
            self.feed(self.router.probe_result(address, False, why, self.now()))
        else:
            self.refused.pop(address, None)
            self.feed(self.router.probe_result(address, True, "", self.now()))
            self.feed(self.router.ask_figures(address, self.now()))

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe_one(a) for a in self.router.nodes))
            await asyncio.sleep(self.probe_interval)

    async def wait_ready(self, timeout: float) -> None:
        """Until one prefill and one decode node answer (or ``timeout``: raise, naming them),
        then up to STARTUP_SETTLE more for the other nodes."""
        deadline = self.now() + timeout
        while not (self.router.online("prefill") and self.router.online("decode")):
            self._fail_on_refusal()
            if self.now() >= deadline:
                down = [
                    f"{n.id} at {n.address}: {n.last_error or 'no answer yet'}"
                    for n in self.router.nodes.values()
                    if not n.online
                ]
                raise MlxcelError(
                    f"router: no prefill and decode node online within {timeout:g}s "
                    f"(--startup-timeout): {'; '.join(down)}"
                )
            await asyncio.sleep(0.1)
        # The rest get a few seconds more (a node still busy starting misses its first
        # probe): serving before they answer would send all the first requests to one node.
        settle = min(deadline, self.now() + STARTUP_SETTLE)
        while any(not n.online for n in self.router.nodes.values()) and self.now() < settle:
            self._fail_on_refusal()
            await asyncio.sleep(0.1)

    def _fail_on_refusal(self) -> None:
        """At startup a node that refused this router for good fails it at once (as a
        pipeline's coordinator fails on a stage), not after --startup-timeout."""
        for address, why in self.refused.items():
            raise MlxcelError(
                f"router: node {self.router.nodes[address].id} refused the connection, which "
                f"retrying cannot heal: {why} (every node needs the same --cluster-secret-file "
                "and mlxcel version)"
            )

    def stats(self, verbose: bool) -> dict[str, Any]:
        """GET /router/stats: addresses only when ``verbose`` (MLXCEL_ROUTER_STATS_VERBOSE)."""
        body = self.router.stats()
        for n in body["nodes"]:
            seen = n.pop("seen_at", None)
            n["last_seen_s"] = None if seen is None else round(self.now() - seen, 2)
        if not verbose:
            for n in body["nodes"]:
                n.pop("address", None)
                n.pop("last_error", None)  # connect errors name addresses too
        body["addresses_redacted"] = not verbose
        return body

    async def health(self) -> dict[str, Any]:
        r = self.router
        ready = bool(r.online("prefill") and r.online("decode"))
        return {
            "ready": ready,
            "router": {
                "prefill_online": len(r.online("prefill")),
                "decode_online": len(r.online("decode")),
                "in_flight": r.active,
            },
        }
