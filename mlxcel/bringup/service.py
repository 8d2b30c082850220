"""The asyncio side of bring-up: the two cores on a node's bus, over real connections.

:class:`PeerService` drives a :class:`PeerCore` behind the peer's assignment listener and
answers on the coordinator's own connection; :class:`PushService` drives a :class:`PushCore`
over an assignment-channel connection pool, with an optional beacon receiver. Both resolve
``result`` when their core says the bring-up is over for them.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from loguru import logger

from mlxcel.base.effects import Effect, Send
from mlxcel.base.errors import AssignmentRefused, ConnectFailed, MlxcelError
from mlxcel.base.messages import (
    AssignAbort,
    AssignAccepted,
    AssignActivate,
    AssignActivated,
    AssignCommit,
    AssignCommitted,
    AssignOffer,
    AssignRefused,
)
from mlxcel.bringup.beacon import BeaconGate, make_beacon
from mlxcel.bringup.peer_core import PeerCore
from mlxcel.bringup.protocol import (
    FRAME_BOUND,
    PROGRESS_EVERY,
    Activated,
    Announce,
    PeerEnded,
    Phase,
    PushDone,
    Rejection,
    Verify,
)
from mlxcel.bringup.push_core import PushCore
from mlxcel.net.udp import SOURCE_RATE, BeaconReceiver, BeaconSender
from mlxcel.reactor.adapter import CoreAdapter
from mlxcel.reactor.bus import Node, Origin
from mlxcel.reactor.endpoint import Endpoint
from mlxcel.wire.handshake import Failure

FLOOD_REPORT_EVERY = 5.0  # seconds between summaries of what discovery refused, while it does


# Handshake failures that retrying cannot fix: the peer holds another secret, or this node's
# advertised identity is not the address it connects from (or the forged-verdict case, where
# someone on the path interferes). Everything else -- a refused connect, a timeout, a closed
# socket, a busy peer, clocks or a replay -- is retried every 0.5 s inside the push window.
FINAL_FAILURES = frozenset(
    {Failure.SECRET_MISMATCH, Failure.IDENTITY_NOT_OWNED, Failure.VERDICT_FORGED}
)


def is_final(exc: BaseException | None) -> bool:
    cause = exc.__cause__ if exc is not None else None
    return isinstance(cause, ConnectFailed) and cause.failure in FINAL_FAILURES


class PeerService(CoreAdapter):
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        core: PeerCore,
        announce: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(node, endpoint, core, "assignment-peer", send_budget=FRAME_BOUND)
        self.peer = core
        self.announce = announce
        self.result: asyncio.Future[Activated] = self.loop.create_future()

    def attach(self) -> None:
        classes = (AssignOffer, AssignCommit, AssignActivate, AssignAbort)
        self.subscribe(classes, Origin.REMOTE, maxsize=16)
        self.start()

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, Announce):
            if self.announce is not None:
                self.announce()
        elif isinstance(effect, Activated):
            if not self.result.done():
                self.result.set_result(effect)
        elif isinstance(effect, PeerEnded):
            if not self.result.done():
                self.result.set_exception(AssignmentRefused(effect.reason))
        else:
            super().apply(effect)


def beacon_announcer(
    sender: BeaconSender, key: bytes, version: str, cluster: str, address: str
) -> Callable[[], None]:
    """What a peer's ``Announce`` does: sign a fresh beacon with the wall clock and send it."""

    def announce() -> None:
        sender.send(make_beacon(key, version, cluster, address, time.time(), os.urandom(16)))

    return announce


def flood_note(receiver: BeaconReceiver, gate: BeaconGate | None) -> str | None:
    """What discovery refused so far, for the operator (None: nothing). Another cluster's
    beacons (same network, other name) are not counted: they are no anomaly."""
    st = receiver.stats
    rejected = {
        why: n
        for why, n in (gate.rejected if gate else {}).items()
        if n and why is not Rejection.CLUSTER
    }
    total = st.dropped + sum(rejected.values())
    if not total:
        return None
    sources: Counter[str] = Counter(st.by_source)
    if gate is not None:
        sources.update(gate.rejected_from)
    parts = [
        f"{st.throttled:,} over a source's budget ({SOURCE_RATE:g}/s)" if st.throttled else "",
        f"{st.not_beacon:,} not shaped like a beacon" if st.not_beacon else "",
        f"{st.queue_full:,} beyond the receive queue" if st.queue_full else "",
    ]
    if rejected:
        parts.append("rejected: " + ", ".join(f"{why.value} {n:,}" for why, n in rejected.items()))
    busiest = ", ".join(f"{ip} ({n:,})" for ip, n in sources.most_common(3))
    return (
        f"{len(sources)} source(s) sent {total:,} datagrams that are not valid beacons of this "
        f"cluster ({'; '.join(p for p in parts if p)}); busiest: {busiest}"
    )


# Completes an authenticated handshake with an address by a deadline (the loop's clock), or
# raises saying why not.
Verifier = Callable[[str, float], Awaitable[None]]


class PushService(CoreAdapter):
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        core: PushCore,
        receiver: BeaconReceiver | None = None,
        verify: Verifier | None = None,
    ) -> None:
        super().__init__(node, endpoint, core, "assignment-push", send_budget=FRAME_BOUND)
        self.push = core
        self.receiver = receiver
        self.verify = verify
        self._ended = False  # discovery's end was reported
        self.result: asyncio.Future[PushDone] = self.loop.create_future()

    def attach(self) -> None:
        classes = (AssignAccepted, AssignRefused, AssignCommitted, AssignActivated)
        self.subscribe(classes, Origin.REMOTE, maxsize=64)
        self.start()
        if self.receiver is not None:
            self.node.spawn(self._beacons(self.receiver), name="assignment-push.beacons")
            self.node.spawn(self._report_floods(self.receiver), name="assignment-push.floods")
        self.node.spawn(self._report_progress(), name="assignment-push.progress")
        self.feed(self.push.start(self.now()))

    async def _report_progress(self) -> None:
        """Every few seconds while the push runs: what it still waits for (discovery alone
        may take its whole window, and an operator should not wonder whether it hung)."""
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            if self.push.outcome is not None:
                return
            logger.info("{}", self.push.progress(self.now()))

    async def _beacons(self, receiver: BeaconReceiver) -> None:
        while True:
            data, ip = await receiver.queue.get()
            self.feed(self.push.beacon(data, ip, self.now(), time.time()))

    def undeliverable(self, send: Send, reason: str, exc: BaseException | None) -> list[Effect]:
        return self.push.undeliverable(send, reason, self.now(), is_final(exc))

    async def _report_floods(self, receiver: BeaconReceiver) -> None:
        """While discovery refuses datagrams, say how many and from whom every few seconds
        (the per-beacon warnings are rate limited: these counts are what the operator has)."""
        said = None
        while self.push.phase is Phase.DISCOVERING:
            await asyncio.sleep(FLOOD_REPORT_EVERY)
            note = flood_note(receiver, self.push.gate)
            if note is not None and note != said and self.push.phase is Phase.DISCOVERING:
                logger.warning("discovery: so far {}", note)
                said = note

    def feed(self, effects: list[Effect]) -> None:
        super().feed(effects)
        if (
            self.receiver is not None
            and not self._ended
            and self.push.phase is not Phase.DISCOVERING
        ):
            self._ended = True  # and once more as it ends, however it ends
            note = flood_note(self.receiver, self.push.gate)
            if note is not None:
                logger.warning("discovery: ended; meanwhile {}", note)

    async def _verify(self, v: Verify) -> None:
        why: str | None = None
        try:
            if self.verify is None:
                raise MlxcelError("no way to reach peers here")
            await self.verify(v.address, v.deadline)
        except Exception as exc:  # whatever it was, the core hears of it: nothing waits forever
            why = str(exc) or type(exc).__name__
        self.feed(self.push.verified(v.address, why, self.now()))

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, Verify):
            self.node.spawn(self._verify(effect), name=f"assignment-push.verify:{effect.address}")
        elif isinstance(effect, PushDone):
            note = flood_note(self.receiver, self.push.gate) if self.receiver else None
            if not effect.ok and note is not None and self.push.plan is None:
                # A discovery that failed under a flood: the real beacons may have drowned.
                effect = PushDone(False, f"{effect.summary}; meanwhile {note}")
            if not effect.ok:
                # Offers still queued for a peer must not hold up the Abort behind them.
                self.discard_queued(lambda s: not isinstance(s.msg, AssignAbort))
            if not self.result.done():
                self.result.set_result(effect)
        else:
            super().apply(effect)
