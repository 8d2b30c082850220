"""The router's view of its prefill and decode nodes: one record per node, and the stats the
router serves (/router/stats, the cluster view). Pure data."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxcel.messages import State


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

    def why_not(self) -> str:
        """Why it takes no new request (asked only when it does not)."""
        return "down" if not self.online else "draining" if self.draining else "full"


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
