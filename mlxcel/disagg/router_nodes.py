"""The router's view of its prefill and decode nodes: one record per node, and the stats the
router serves (/router/stats, the cluster view). Pure data."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


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
                "dispatched": n.dispatched,
                "active": n.active,
                "completed": n.completed,
                "failed": n.failed,
                "last_error": n.last_error,
                "seen_at": n.seen_at,
            }
            for n in nodes
        ],
        "metrics": {"in_flight": active, **dict(counts)},
    }
