"""Rate-limited cluster warnings, in classes that cannot starve each other.

Classes -- ``noise`` (junk, stalls, pool refusals), ``diagnostic`` (secret
mismatch, identity not owned, suite mismatch, failed frame, unknown kind), ``router-drop``,
``at-capacity``, the pipeline's own drops (``coordinator-drop``, ``stage-drop``), a decode
node's refusals (``decode-refusal``), discovery's drops and the HTTP port's refusals
(``http-cap``: a connection cap; ``http-slow``: a header deadline; ``http-evict``: a
connection closed for another address's), and a prompt cache's mismatches between the index
and the nodes that hold its entries (``prefix-mismatch``) -- each may log ``per_window`` warnings per
``window`` seconds; the rest go to debug. How many went to debug is said when their window
ends (given ``schedule``, the loop's ``call_later``), else with the class's next warning.
The clock is injected (the loop's clock in production).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

CLASSES = (
    "noise",
    "diagnostic",
    "router-drop",
    "at-capacity",
    "coordinator-drop",
    "stage-drop",
    "http-cap",
    "http-slow",
    "discovery-drop",
    "decode-refusal",
    "http-evict",
    "prefix-mismatch",
)
MAX_MESSAGE = 500


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


class WarningLimiter:
    def __init__(
        self,
        clock: Callable[[], float],
        *,
        per_window: int = 5,
        window: float = 60.0,
        emit: Callable[[str, str], None] | None = None,
        schedule: Callable[[float, Callable[[], None]], object] | None = None,
    ) -> None:
        self.clock = clock
        self._schedule = schedule
        self.per_window = per_window
        self.window = window
        self._emit = emit or (lambda level, msg: logger.log(level, msg))
        self._windows: dict[str, _Window] = {}
        self.warned: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.debugged: dict[str, int] = dict.fromkeys(CLASSES, 0)

    def warn(self, cls: str, message: str) -> bool:
        """Log ``message`` in class ``cls``; return True if it went out as a warning."""
        if cls not in CLASSES:
            raise ValueError(f"unknown warning class {cls!r}")
        if len(message) > MAX_MESSAGE:  # peers choose some of the text: bound what they write
            message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE} more chars)"
        now = self.clock()
        w = self._windows.get(cls)
        summary = None
        if w is None or now - w.start >= self.window:
            if w is not None and w.suppressed:
                ended = w.start + self.window
                summary = (
                    f"{w.suppressed} cluster warnings ({cls}) were logged at debug during the "
                    f"{self.window:g}s window that ended {now - ended:.0f}s ago"
                )
            w = _Window(now)
            self._windows[cls] = w
        if w.logged < self.per_window:
            w.logged += 1
            if summary:
                self._emit("WARNING", summary)
            self._emit("WARNING", message)
            self.warned[cls] += 1
            return True
        w.suppressed += 1
        self.debugged[cls] += 1
        self._emit("DEBUG", message)
        if w.suppressed == 1 and self._schedule is not None:
            self._schedule(max(0.0, w.start + self.window - now), lambda: self._window_end(cls, w))
        return False

    def _window_end(self, cls: str, w: _Window) -> None:
        """Say how many of ``cls`` went to debug as its window ends, not at the next one."""
        if self._windows.get(cls) is not w or not w.suppressed:
            return
        self._emit(
            "WARNING",
            f"{w.suppressed} cluster warnings ({cls}) were logged at debug during the "
            f"{self.window:g}s window that just ended",
        )
        w.suppressed = 0

    def debug(self, message: str) -> None:
        self._emit("DEBUG", message)
