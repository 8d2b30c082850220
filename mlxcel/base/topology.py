"""The nodes behind a serving node and their links, read from its role's health or stats
answer: what ``/cluster``, ``/dashboard`` and the per-node metrics show
(:mod:`mlxcel.server.cluster_view`). Nodes are named by id and role, never by address. Pure."""

from __future__ import annotations

import functools
from typing import Any

NodeView = dict[str, Any]
Topology = tuple[list[NodeView], list[list[str]]]


def pipeline_topology(health: dict[str, Any]) -> Topology:
    """A pipeline coordinator's stages (from its /health details): coordinator -> stage-0 ->
    ... -> stage-N -> coordinator (the results come back)."""
    p = health.get("pipeline", {})
    nodes: list[NodeView] = [
        {"id": "coordinator", "role": "coordinator", "up": True, "in_flight": p.get("active", 0)}
    ]
    for st in p.get("stages", []):
        node: NodeView = {
            "id": st.get("id", "?"),
            "role": "stage",
            "up": "error" not in st,
            "layers": st.get("layers"),
            "sequences": st.get("sequences"),
            "draining": st.get("draining", False),
            "wire_bytes_out": st.get("wire_bytes_out"),
            "last_seen_s": st.get("last_seen_s"),
            "kv_tokens": st.get("kv_tokens"),
            "kv_capacity": st.get("kv_capacity"),
        }
        if "error" in st:
            node["error"] = st["error"]
        nodes.append(node)
    ids = [n["id"] for n in nodes]
    links = [[a, b] for a, b in zip(ids, ids[1:], strict=False)]
    if len(ids) > 1:
        links.append([ids[-1], ids[0]])
    return nodes, links


def router_topology(stats: dict[str, Any]) -> Topology:
    """A disaggregated router's nodes (from /router/stats): router -> prefill -> decode ->
    router."""
    m = stats.get("metrics", {})
    nodes: list[NodeView] = [
        {"id": "router", "role": "router", "up": True, "in_flight": m.get("in_flight", 0)}
    ]
    for n in stats.get("nodes", []):
        nodes.append(
            {
                "id": n["id"],
                "role": n["role"],
                "up": bool(n.get("healthy")),
                "draining": n.get("draining", False),
                "in_flight": n.get("active"),
                "completed": n.get("completed"),
                "failed": n.get("failed"),
                "last_seen_s": n.get("last_seen_s"),
                "kv_tokens": n.get("kv_tokens"),
                "kv_capacity": n.get("kv_capacity"),
                "handoffs": n.get("handoffs"),
                "handoff_s": n.get("handoff_s"),
            }
        )
    prefill = [n["id"] for n in nodes if n["role"] == "prefill"]
    decode = [n["id"] for n in nodes if n["role"] == "decode"]
    links = [["router", p] for p in prefill]
    links += [[p, d] for p in prefill for d in decode]
    links += [[d, "router"] for d in decode]
    return nodes, links


def single_topology(mode: str, in_flight: int, kv: dict[str, int] | None = None) -> Topology:
    """A node with no cluster behind it: named by its host, its role a word ("engine" for
    one process, else the mode with dashes), as every node of a cluster is labelled."""
    role = "engine" if mode == "one process" else mode.replace(" ", "-")
    node = {"id": _host(), "role": role, "up": True, "in_flight": in_flight, **(kv or {})}
    return [node], []


@functools.cache
def _host() -> str:
    """This host's name (asked once: the view is drawn every second)."""
    import socket

    return socket.gethostname() or "localhost"
