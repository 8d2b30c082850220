"""One request as the router carries it: its nodes, its ids, its deadline, and what a missed
deadline means where it stood. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxcel.base.messages import RunEntry, TokenResult
from mlxcel.disagg.protocol import RouteState


@dataclass
class Route:
    request_id: str  # the frontend's id
    wire: str  # the id the nodes see: the frontend's plus the nonce, unique across restarts
    entry: RunEntry  # what the frontend asked (its nonce goes back with every result)
    nonce: int  # the router's nonce for this request; results must carry it
    prefill: str
    decode: str
    deadline: float
    state: RouteState = RouteState.PREFILLING
    prefill_busy: bool = True  # counted in the prefill node's load until token 0 is in
    next_index: int = 0
    early: dict[int, TokenResult] = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)
    restarts: int = 0  # times it started over on other nodes after losing one
    # Its decode node dropped a connection: tokens sent on it may be lost, so the stream must
    # go on by this time (a live node's next token comes on a new connection at once).
    quiet_by: float | None = None
    # The prefill node was chosen for the prompt it was recorded to hold: (that node, its
    # record, positions). A failover to another node makes it moot.
    expected: tuple[str, int, int] | None = None
    generated: list[int] = field(default_factory=list)  # the tokens delivered so far

    @property
    def continued(self) -> bool:
        """A conversation's next turn, run by the decode node that keeps its history (it
        prefills what is new and streams every token itself)."""
        return self.prefill == self.decode

    def missed(self, prefill: str, decode: str, prefill_timeout: float, handoff: float) -> str:
        """What its deadline passing means, where it stood (``prefill``, ``decode``: the
        nodes' ids, never their addresses)."""
        if self.state is RouteState.PREFILLING:
            return f"no first token from {prefill} within {prefill_timeout:g}s"
        if self.state is RouteState.HANDOFF:
            return (
                f"handoff timeout: {decode} did not start decoding within {handoff:g}s of the "
                "first token"
            )
        return f"handoff timeout: {decode} sent no token for {handoff:g}s"
