"""The plan a ``--pp-auto`` coordinator pushes, and the cluster TOML it writes.

Stage ids are ``stage-0``, ``stage-1``, ... in the lexicographic order of the peers'
addresses; each stage's layer range is the automatic split of the coordinator's checkpoint:
balancing compute while the peers' memory is unknown, and bytes held per byte of memory once
every peer said what it can hold (``memory_gb`` in the TOML, so every node derives the same
split from it).
The TOML text is a pure function of the plan (no timestamps, fixed key order), so rerunning
the coordinator's command against the same peers writes the same bytes; every file written
from a plan is valid input for ``serve --distributed-config FILE --node-id ID``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxcel.pipeline.partition import LayerCosts, StagePlan, auto_split, format_plan

COORDINATOR_ID = "coordinator"


@dataclass(frozen=True)
class Assignment:
    index: int
    node_id: str
    address: str
    start: int
    end: int  # exclusive
    bytes: int = 0  # what the stage holds (its layers, and the embedding or head it runs)
    memory: float | None = None  # what the peer can hold, when it said

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
            if a.memory is not None:  # exact: a float of bytes / 2**30 round-trips in TOML
                lines.append(f"memory_gb = {a.memory / 2**30!r}")
        return "\n".join(lines) + "\n"

    def table(self) -> str:
        """Bytes per stage beside each peer's memory (what a dry run prints)."""
        total = sum(a.bytes for a in self.stages) or 1
        return format_plan(
            [
                StagePlan(a.index, a.start, a.end, a.bytes, a.bytes / total, a.memory)
                for a in self.stages
            ]
        )

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
    memory: dict[str, int] | None = None,
) -> BringupPlan:
    """One stage per peer; with ``memory`` (bytes by peer address) the split follows what each
    peer can hold. Raises PartitionError when the layers cannot be split so, or (with the
    figures) when they do not fit."""
    ordered = sorted(peers)
    budgets = [float(memory[a]) for a in ordered] if memory else None
    split = auto_split(costs, len(ordered), budgets)
    return BringupPlan(
        cluster_name,
        coordinator,
        tuple(
            Assignment(i, f"stage-{i}", addr, p.start, p.end, p.bytes, p.memory)
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


def derived_range(
    costs: LayerCosts, n_stages: int, index: int, memory: list[float] | None = None
) -> tuple[int, int]:
    """The range a peer derives for stage ``index`` from its own checkpoint (and the stages'
    memory figures, when the offered cluster carries them)."""
    p = auto_split(costs, n_stages, memory)[index]
    return p.start, p.end
