"""The router's view of its prefill and decode nodes: one record per node, the table that
picks among them (round robin, around nodes whose handoffs keep failing), and the stats the
router serves (/router/stats, the cluster view). Pure: no I/O, no clock of its own."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxcel.base.messages import State

AVOID_AFTER = 3  # handoffs failed in a row before the router routes around a node
AVOID_FIRST = 5.0  # seconds it is routed around the first time; doubling each failure after
AVOID_MAX = 60.0


@dataclass
class PeerNode:
    id: str  # prefill-<i> / decode-<i>: what /router/stats shows instead of the address
    role: str
    address: str
    online: bool = False  # unknown until the first probe answers
    suspect: bool = False  # a connection with it dropped: the next probe decides
    dispatched: int = 0
    active: int = 0
    completed: int = 0
    failed: int = 0
    last_error: str = ""
    down_since: float | None = None  # when it was marked down (for the "back" line)
    seen_at: float | None = None  # when it last answered a probe
    figures: dict[str, float] = field(default_factory=dict)  # from its last State
    draining: bool = False  # its last State said it is shutting down: no new requests
    strikes: int = 0  # handoffs through it that failed in a row
    avoid_until: float = 0.0  # routed around until then, while another node can serve

    def why_not(self) -> str:
        """Why it takes no new request (asked only when it does not)."""
        return "down" if not self.online else "draining" if self.draining else "full"

    def avoided(self, now: float) -> bool:
        return now < self.avoid_until

    def handoff_failed(self, why: str, now: float) -> str | None:
        """One more handoff through it failed; from the third in a row it is routed around
        for a while (5 s, doubling to 60 s). Returns the line to log when that starts."""
        self.strikes += 1
        if self.strikes < AVOID_AFTER:
            return None
        pause = min(AVOID_MAX, AVOID_FIRST * 2 ** (self.strikes - AVOID_AFTER))
        started = not self.avoided(now)
        self.avoid_until = now + pause
        if not started:
            return None
        return (
            f"router: routing around {self.id} for {pause:g}s: {self.strikes} handoffs through "
            f"it failed in a row (last: {why[:200]})"
        )

    def handoff_done(self) -> None:
        self.strikes = 0
        self.avoid_until = 0.0


class NodeTable:
    """The router's nodes by address, and each role's round-robin order."""

    def __init__(self, prefill: list[str], decode: list[str], capacity: int) -> None:
        if not prefill or not decode:
            raise ValueError("a router needs at least one prefill and one decode peer")
        self.capacity = capacity
        self.by_address: dict[str, PeerNode] = {}
        for role, addrs in (("prefill", prefill), ("decode", decode)):
            for i, a in enumerate(addrs):
                if a in self.by_address:
                    raise ValueError(f"{a} is listed twice among the router's peers")
                self.by_address[a] = PeerNode(f"{role}-{i}", role, a)
        self._rr = {"prefill": itertools.cycle(prefill), "decode": itertools.cycle(decode)}
        self.by_role = {"prefill": list(prefill), "decode": list(decode)}

    def can_take(self, address: str, now: float) -> bool:
        """Whether node ``address`` takes a request now: online, not draining, below its
        capacity, its handoffs not failing."""
        n = self.by_address[address]
        return n.online and not n.draining and n.active < self.capacity and not n.avoided(now)

    def pick(
        self, role: str, now: float, exclude: frozenset[str] | set[str] = frozenset()
    ) -> str | None:
        """The next node of ``role`` that can take a request, one whose handoffs have not
        been failing first (see PeerNode.handoff_failed), else any that can."""
        fallback = None
        for _ in range(len(self.by_role[role])):
            a = next(self._rr[role])
            n = self.by_address[a]
            if n.online and not n.draining and n.active < self.capacity and a not in exclude:
                if not n.avoided(now):
                    return a
                fallback = fallback or a
        return fallback

    def redact(self, text: str) -> str:
        """``text`` with every node's address replaced by its id (what clients may see)."""
        for n in self.by_address.values():
            text = text.replace(n.address, n.id)
        return text


def figures_of(m: State) -> dict[str, float]:
    """What a node's State adds to its stats: KV-cache tokens held and capacity, and (a
    prefill node) the handoffs acknowledged and their total time from send to ack."""
    out: dict[str, float] = {"kv_tokens": m.kv_tokens, "kv_capacity": m.kv_capacity}
    if m.handoffs:
        out |= {"handoffs": m.handoffs, "handoff_s": m.handoff_us / 1e6}
    return out


def node_stats(nodes: Iterable[PeerNode], active: int, counts: Mapping[str, int]) -> dict[str, Any]:
    """What /router/stats shows (``seen_at`` on the router's clock: the adapter makes it an
    age)."""
    return {
        "nodes": [
            {
                "id": n.id,
                "role": n.role,
                "address": n.address,
                "healthy": n.online,
                "draining": n.draining,
                "dispatched": n.dispatched,
                "active": n.active,
                "completed": n.completed,
                "failed": n.failed,
                "last_error": n.last_error,
                "seen_at": n.seen_at,
                **n.figures,
            }
            for n in nodes
        ],
        "metrics": {"in_flight": active, **dict(counts)},
    }
