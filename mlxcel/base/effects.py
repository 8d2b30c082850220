"""What a role core asks its adapter to do.

A role core (``StageCore``, ``CoordinatorCore``, ...) never performs I/O and never reads a
clock: ``handle(msg, source, now)`` and ``on_timer(now)`` return a list of these effects, and
the adapter that owns the core carries them out -- over sockets, over an in-process fabric,
or in :mod:`mlxcel.sim` on a virtual clock. Effects are small frozen dataclasses so a table
test can compare them with ``==``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel.base.messages import Message


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to the peer identity ``dest``.

    ``peer`` is False for a refusal to someone who is not a configured peer of this node: the
    adapter sends it on a one-off connection, so addresses a member claims cannot pile up.
    If the message cannot be delivered, the adapter calls the core's ``undeliverable(send,
    reason, now)`` with this very effect.
    """

    dest: str
    msg: Message
    peer: bool = True
    # When the message is no longer worth sending (the core's clock): the adapter gives up
    # on it then, and drops it unsent if it is still queued by then.
    deadline: float | None = None
    # Tell the core once it is written (``core.sent(send, now)``): how a core sees a long
    # transfer make progress, one message at a time.
    notify: bool = False


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand ``msg`` to this node's local consumer (the frontend), not to the network."""

    msg: Message


@dataclass(frozen=True, slots=True)
class StartCompute:
    """Run ``job`` on the compute backend; answer with ``compute_done``/``compute_failed``."""

    job: Any


@dataclass(frozen=True, slots=True)
class CutShort:
    """Ask the compute job under way to end at its next step: what it was given changed (a
    sequence joined or left), and the next job should see that soon."""


@dataclass(frozen=True, slots=True)
class FreeCache:
    """Drop whatever the compute backend holds for ``key`` (in order with running jobs)."""

    key: Any


@dataclass(frozen=True, slots=True)
class LoadPrefix:
    """Start ``key``'s cache from ``owner``'s prompt-cache entry ``entry``, its first
    ``tokens`` positions (in order with jobs: the sequence's first step finds it loaded, or
    fails ``prefix_not_cached``)."""

    key: Any
    owner: str
    entry: int
    tokens: int


@dataclass(frozen=True, slots=True)
class KeepPrefix:
    """Keep ``key``'s cache, exactly ``tokens`` positions, as ``owner``'s prompt-cache entry
    ``entry`` (before the FreeCache that follows it)."""

    key: Any
    owner: str
    entry: int
    tokens: int


@dataclass(frozen=True, slots=True)
class DropPrefixes:
    """Forget ``owner``'s prompt-cache entries ``entries`` (every one of its entries: ())."""

    owner: str
    entries: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ResetPeer:
    """Close every connection with ``dest``: a stream that missed a deadline may be wedged."""

    dest: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Resolve the local query ``token`` (``value`` is the answer or an exception)."""

    token: int
    value: Any


@dataclass(frozen=True, slots=True)
class Warn:
    """A log line: ``kind`` is a rate-limiter class (see :mod:`mlxcel.net.ratelimit`), or
    the plain level ``debug``, ``info`` or ``warning`` for one-off lines."""

    kind: str
    text: str


@dataclass(frozen=True, slots=True)
class Stopped:
    """The role finished its shutdown: nothing is left in flight."""


Effect = (
    Send
    | Deliver
    | StartCompute
    | CutShort
    | FreeCache
    | LoadPrefix
    | KeepPrefix
    | DropPrefixes
    | ResetPeer
    | Answer
    | Warn
    | Stopped
)
