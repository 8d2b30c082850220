"""The plan a ``--pp-auto`` coordinator pushes, and the cluster TOML it writes.

Stage ids are ``stage-0``, ``stage-1``, ... in the lexicographic order of the peers'
addresses; each stage's layer range is the automatic split of the coordinator's checkpoint.
The TOML text is a pure function of the plan (no timestamps, fixed key order), so rerunning
the coordinator's command against the same peers writes the same bytes; every file written
from a plan is valid input for ``serve --distributed-config FILE --node-id ID``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxcel.pipeline.partition import LayerCosts, auto_split

COORDINATOR_ID = "coordinator"


@dataclass(frozen=True)
class Assignment:
    index: int
    node_id: str
    address: str
    start: int
    end: int  # exclusive

    @property
    def layers(self) -> str:
        return f"{self.start}-{self.end - 1}"


@dataclass(frozen=True)
class BringupPlan:
    cluster_name: str
    coordinator: str  # control address
    stages: tuple[Assignment, ...]
    secret_file: str | None = None  # absolute; None when the secret came from the environment

    def body(self) -> str:
        q = json.dumps  # a TOML basic string is a JSON string for everything we write
        lines = [
            f"name = {q(self.cluster_name)}",
            f"pipeline_parallel_size = {len(self.stages)}",
            "",
            "[cluster]",
        ]
        if self.secret_file is not None:
            lines.append(f"secret_file = {q(self.secret_file)}")
        lines += [
            "",
            "[[nodes]]",
            f"id = {q(COORDINATOR_ID)}",
            'role = "coordinator"',
            f"address = {q(self.coordinator)}",
        ]
        for a in self.stages:
            lines += [
                "",
                "[[nodes]]",
                f"id = {q(a.node_id)}",
                'role = "stage"',
                f"address = {q(a.address)}",
                f"layers = {q(a.layers)}",
            ]
        return "\n".join(lines) + "\n"

    def coordinator_file(self, command: str) -> str:
        return (
            f"# mlxcel cluster plan, written by the coordinator ({command}).\n"
            "# Rerunning that command against the same peers rewrites this file byte for byte.\n"
            "# Start a node from it with: serve --distributed-config FILE --node-id ID\n\n"
            + self.body()
        )


def make_plan(
    cluster_name: str,
    coordinator: str,
    peers: list[str],
    costs: LayerCosts,
    secret_file: str | None = None,
) -> BringupPlan:
    """One stage per peer (raises PartitionError when the layers cannot be split so)."""
    ordered = sorted(peers)
    split = auto_split(costs, len(ordered))
    return BringupPlan(
        cluster_name,
        coordinator,
        tuple(
            Assignment(i, f"stage-{i}", addr, p.start, p.end)
            for i, (addr, p) in enumerate(zip(ordered, split, strict=True))
        ),
        secret_file,
    )


def peer_file(node_id: str, coordinator: str, body: str) -> str:
    """What a peer writes on Activate: the body it received under its own header."""
    return (
        f"# mlxcel cluster plan as received by {node_id} from the coordinator at {coordinator}.\n"
        "# The next assignment this peer commits overwrites it.\n"
        f"# Start this node from it with: serve --distributed-config FILE --node-id {node_id}\n\n"
        + body
    )


def derived_range(costs: LayerCosts, n_stages: int, index: int) -> tuple[int, int]:
    """The range a peer derives for stage ``index`` from its own checkpoint."""
    p = auto_split(costs, n_stages)[index]
    return p.start, p.end
