"""The log lines of a cluster's membership, one shape for every role that watches peers (the
router its prefill and decode nodes, the pipeline coordinator its stages): a node joined, was
lost (with the deadline or error that said so), came back (after how long, and why it had
gone). Pure: each call returns the Warn effects to log.

Rate-limited per node: past ``BURST`` lines about one node within ``WINDOW`` seconds (a
flapping node), a "back" is held, and so is the "lost" that follows it; the next line logged
for that node says how many changes were not. So the log never says "back" while the node is
down (a held "back" can only leave it saying "lost" while the node is up, which /health and
/cluster correct).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlxcel.base.effects import Warn

BURST, WINDOW = 4, 60.0  # at most BURST lines about one node within WINDOW seconds


@dataclass
class _Seen:
    lines: deque[float] = field(default_factory=lambda: deque(maxlen=BURST))  # when logged
    down_since: float | None = None
    held: int = 0  # changes not logged since the last line

    def flapping(self, now: float) -> bool:
        return len(self.lines) == BURST and now - self.lines[0] < WINDOW


class MembershipLog:
    def __init__(self, who: str) -> None:
        self.who = who  # "router", "coordinator": the lines' prefix
        self._nodes: dict[str, _Seen] = {}

    def joined(self, node: str, detail: str, now: float) -> list[Warn]:
        """``node`` answered for the first time (``detail``: what it runs, if anything)."""
        if node in self._nodes:
            return self.back(node, "", now)
        self._nodes[node] = s = _Seen()
        s.lines.append(now)
        return [Warn("info", f"{self.who}: {node} joined{f' ({detail})' if detail else ''}")]

    def lost(self, node: str, why: str, now: float) -> list[Warn]:
        s = self._nodes.setdefault(node, _Seen())
        if s.down_since is not None:
            return []  # already lost
        s.down_since = now
        if s.held and s.flapping(now):
            s.held += 1  # its "back" was held: the log still says it is lost
            return []
        why = why or "no reason given"
        return [Warn("warning", f"{self.who}: {node} lost: {why}{self._note(s, now)}")]

    def back(self, node: str, why_lost: str, now: float) -> list[Warn]:
        """``node`` answers again (``why_lost``: what had marked it lost)."""
        s = self._nodes.setdefault(node, _Seen())
        if s.down_since is None:
            return []
        down_for, s.down_since = now - s.down_since, None
        if s.flapping(now):
            s.held += 1
            return []
        why = f" ({why_lost})" if why_lost else ""
        note = self._note(s, now)
        return [Warn("info", f"{self.who}: {node} is back after {down_for:.1f}s down{why}{note}")]

    def _note(self, s: _Seen, now: float) -> str:
        held, s.held = s.held, 0
        s.lines.append(now)
        return f" ({held} more changes not logged: it is flapping)" if held else ""
