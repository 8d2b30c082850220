"""Rank 0's roll call: who may join a tensor-parallel group, before MLX's group forms.

Pure: no sockets, no clock. Every ``TpJoin`` reaching it came over a connection whose peer
proved the secret (the launch's own, or the cluster secret for ranks started by hand), and
``source`` is that peer's authenticated identity. What it still checks is that the joiner
fits this group: a rank number the group has and nobody else took, a ring listener on the
host the rank connects from, and the same mlxcel, model and hostfile as rank 0. A refusal
says which, and is sent back to the joiner (which stops); rank 0 keeps waiting for the
right one. A rank whose connection is lost before the ring goes out leaves the roll, so a
restarted rank can join again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mlxcel.base.messages import TpJoin


def model_digest(model: Path) -> str:
    """What ranks compare to know they hold one model: the hash of its config.json."""
    return hashlib.sha256((Path(model) / "config.json").read_bytes()).hexdigest()


def host_of(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


class RollCall:
    """Ranks 1..size-1 joining rank 0; ``complete`` once each has, exactly once."""

    def __init__(self, size: int, model: str, hostfile: str, version: str) -> None:
        self.size = size
        self.model = model
        self.hostfile = hostfile  # its digest; "" when rank 0 started the ranks itself
        self.version = version
        self.joined: dict[int, tuple[str, str]] = {}  # rank -> (source, ring address)

    def join(self, source: str, msg: TpJoin) -> str | None:
        """Take ``msg`` from ``source`` into the roll; None, or why it is refused."""
        rank = msg.rank
        if msg.version != self.version:
            return f"rank {rank} runs mlxcel {msg.version}, rank 0 runs {self.version}"
        if not 1 <= rank < self.size:
            return f"there is no rank {rank} in this group of {self.size} (ranks 1..{self.size - 1} join rank 0)"
        if msg.model != self.model:
            return (
                f"rank {rank} holds another model (its config.json hashes to {msg.model[:12]}, "
                f"rank 0's to {self.model[:12]})"
            )
        if msg.hostfile != self.hostfile:
            return f"rank {rank} was started with another hostfile than rank 0's"
        if host_of(msg.ring) != host_of(source):
            return (
                f"rank {rank} names ring address {msg.ring}, which is not on the host it "
                f"connects from ({host_of(source)})"
            )
        held = self.joined.get(rank)
        if held is not None and held[0] != source:
            return f"rank {rank} has already joined, from {held[0]}"
        for other, (_, ring) in self.joined.items():
            if other != rank and ring == msg.ring:
                return f"ring address {msg.ring} is already rank {other}'s"
        self.joined[rank] = (source, msg.ring)
        return None

    def left(self, source: str) -> None:
        """The connection from ``source`` closed: a rank it held must join again."""
        for rank, (src, _) in list(self.joined.items()):
            if src == source:
                del self.joined[rank]

    @property
    def complete(self) -> bool:
        return len(self.joined) == self.size - 1

    def missing(self) -> list[int]:
        return [r for r in range(1, self.size) if r not in self.joined]

    def sources(self) -> list[str]:
        return [src for _, (src, _) in sorted(self.joined.items())]

    def ring(self, own: str) -> tuple[str, ...]:
        """Every rank's ring address in rank order, rank 0's being ``own``."""
        return (own, *(ring for _, (_, ring) in sorted(self.joined.items())))
