"""One view of the cluster behind a serving node, whatever its mode: ``GET /cluster`` (JSON),
what ``python -m mlxcel status`` prints, what ``/dashboard`` draws, and the per-node gauges of
``/metrics``.

::

    {"model": "...", "mode": "pipeline", "time": 1796330000.1,
     "totals": {"generated_tokens": 812, "prompt_tokens": 96, "requests": 12,
                "running": 2, "waiting": 0, "ttft_ms_p50": 41.3},
     "nodes": [{"id": "coordinator", "role": "coordinator", "up": true, ...},
               {"id": "stage-0", "role": "stage", "layers": "0-1", "up": true,
                "sequences": 2, "last_seen_s": 0.4, ...}],
     "links": [["coordinator", "stage-0"], ["stage-0", "stage-1"], ...]}

Nodes are named by id and role, never by address (the same rule as /health and
/router/stats). Rates (tokens a second) are left to the reader: it has two snapshots and
their times.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from mlxcel.base.topology import Topology


class ClusterView:
    """Builds the view from the serving node's parts; ``last`` keeps the latest for the
    Prometheus collector (scrapes are synchronous)."""

    def __init__(
        self,
        model: str,
        mode: str,
        topology: Callable[[], Awaitable[Topology]],
        totals: Callable[[], dict[str, Any]],
    ) -> None:
        self.model, self.mode = model, mode
        self.topology = topology
        self.totals = totals
        self.last: dict[str, Any] = {"nodes": []}

    async def snapshot(self) -> dict[str, Any]:
        nodes, links = await self.topology()
        self.last = {
            "model": self.model,
            "mode": self.mode,
            "time": time.time(),
            "totals": self.totals(),
            "nodes": nodes,
            "links": links,
        }
        return self.last


def ttft_p50_ms(recent: list[float]) -> float | None:
    if not recent:
        return None
    ordered = sorted(recent)
    return round(ordered[len(ordered) // 2] * 1000, 1)
