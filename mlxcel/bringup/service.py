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
from collections.abc import Awaitable, Callable

from mlxcel.adapter import CoreAdapter
from mlxcel.bringup.beacon import make_beacon
from mlxcel.bringup.peer_core import PeerCore
from mlxcel.bringup.protocol import (
    FRAME_BOUND,
    Activated,
    Announce,
    PeerEnded,
    PushDone,
    Verify,
)
from mlxcel.bringup.push_core import PushCore
from mlxcel.bus import Node, Origin
from mlxcel.effects import Effect, Send
from mlxcel.endpoint import Endpoint
from mlxcel.errors import MlxcelError
from mlxcel.messages import (
    AssignAbort,
    AssignAccepted,
    AssignActivate,
    AssignActivated,
    AssignCommit,
    AssignCommitted,
    AssignOffer,
    AssignRefused,
)
from mlxcel.net.pool import ConnectFailed
from mlxcel.net.udp import BeaconReceiver, BeaconSender
from mlxcel.wire.handshake import Failure


class AssignmentRefused(MlxcelError):
    """The peer ends: an offer it can never accept, or no assignment in time."""


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


class BringupFailed(MlxcelError):
    """The coordinator's bring-up failed; no stage was started (or, during activation, the
    message says which already run)."""


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
        self.result: asyncio.Future[PushDone] = self.loop.create_future()

    def attach(self) -> None:
        classes = (AssignAccepted, AssignRefused, AssignCommitted, AssignActivated)
        self.subscribe(classes, Origin.REMOTE, maxsize=64)
        self.start()
        if self.receiver is not None:
            self.node.spawn(self._beacons(self.receiver), name="assignment-push.beacons")
        self.feed(self.push.start(self.now()))

    async def _beacons(self, receiver: BeaconReceiver) -> None:
        while True:
            data, ip = await receiver.queue.get()
            self.feed(self.push.beacon(data, ip, self.now(), time.time()))

    def undeliverable(self, send: Send, reason: str, exc: BaseException | None) -> list[Effect]:
        return self.push.undeliverable(send, reason, self.now(), is_final(exc))

    async def _verify(self, v: Verify) -> None:
        why: str | None = None
        try:
            if self.verify is None:
                raise MlxcelError("no way to reach peers here")
            await self.verify(v.address, v.deadline)
        except (MlxcelError, OSError) as exc:
            why = str(exc) or type(exc).__name__
        self.feed(self.push.verified(v.address, why, self.now()))

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, Verify):
            self.node.spawn(self._verify(effect), name=f"assignment-push.verify:{effect.address}")
        elif isinstance(effect, PushDone):
            if not effect.ok:
                # Offers still queued for a peer must not hold up the Abort behind them.
                self.discard_queued(lambda s: not isinstance(s.msg, AssignAbort))
            if not self.result.done():
                self.result.set_result(effect)
        else:
            super().apply(effect)
