"""Tensor-parallel ranks meet rank 0 over mlxcel's own handshake before MLX's group forms.

MLX's ring and NCCL authenticate nothing: whoever connects to a rank's ring port first during
start-up is taken for a rank. So no rank goes near MLX's group until it has met rank 0 on the
cluster transport (channel ``TENSOR_PARALLEL``):

1. rank 0 listens on its rendezvous address -- a loopback port for the ranks it starts
   (which get a fresh launch secret in their environment), or its hostfile address for ranks
   started by hand (which need the cluster secret);
2. each rank dials it, proves the secret in the handshake, and sends a
   :class:`~mlxcel.base.messages.TpJoin` naming its rank and ring listener; rank 0's
   :class:`~mlxcel.tp.roll_call.RollCall` takes it or refuses it by name;
3. once every rank has joined, rank 0 stops accepting and sends each a
   :class:`~mlxcel.base.messages.TpRing`: the ring (so ports are learned only from rank 0, inside
   the encrypted connection), the backend, and the launch's step key;
4. then every rank forms MLX's group within :data:`RING_BOUND` seconds and proves it holds
   the step key over the group itself (:func:`~mlxcel.tp.group.prove_members`): all are known
   to be up, so a group that does not form in that time, or holds a stranger, was interfered
   with, and each rank says so and stops instead of waiting out the start-up timeout.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from loguru import logger

from mlxcel.base.error_codes import ErrorCode
from mlxcel.base.errors import ListenError, SendFailed, TpGroupFailed
from mlxcel.base.messages import Error, TpJoin, TpRing
from mlxcel.net.listener import ClusterListener, Limits
from mlxcel.net.network import ReplyEndpoint, TcpEndpoint, free_port, split_hostport
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Envelope, Node, Origin
from mlxcel.tp.roll_call import RollCall
from mlxcel.wire.handshake import Channel, Identity

# Seconds MLX's group may take to form once every rank has met rank 0 (its connects back off
# 1, 2, 4 s while a slow rank 0 is not listening yet).
RING_BOUND = 20.0
ANSWER_BOUND = 5.0  # seconds to deliver a TpRing or a refusal to a joined rank
LAUNCH_SECRET_ENV = "MLXCEL_TP_LAUNCH_SECRET"  # the rendezvous secret of ranks rank 0 starts


def ring_address(host: str, port: int) -> str:
    return Identity(host, port).address


def launch_secret() -> ClusterSecret:
    return ClusterSecret(os.urandom(32), "this launch")


def secret_from_env() -> ClusterSecret | None:
    """The launch secret rank 0 gave this process, taken out of the environment."""
    raw = os.environ.pop(LAUNCH_SECRET_ENV, None)
    return ClusterSecret(bytes.fromhex(raw), "rank 0 (environment)") if raw else None


@dataclass(frozen=True)
class Meeting:
    """What every rank knows once the roll is complete."""

    ring: tuple[str, ...]
    backend: str
    step_key: bytes
    prompt_cache_bytes: int = 0  # rank 0's: every rank keeps the same entries


class Rendezvous:
    """Rank 0's side: listen, take the roll, hand out the ring. ``async with`` it."""

    def __init__(self, secret: ClusterSecret, listen: str, roll: RollCall) -> None:
        self.secret = secret
        self.host, self.port = split_hostport(listen)
        self.roll = roll
        self._node = Node("tp-rendezvous")
        self._listener: ClusterListener | None = None
        self._complete = asyncio.Event()

    @property
    def address(self) -> str:
        return ring_address(self.host, self.port)

    async def __aenter__(self) -> Rendezvous:
        node = await self._node.__aenter__()
        n = self.roll.size
        limits = Limits(max_connections=n + 4, max_pending=max(8, 2 * n), peer_timeout=None)
        self._listener = ClusterListener(
            node,
            self.secret,
            self.host,
            self.port,
            node_id="tp-rank-0",
            channel=Channel.TENSOR_PARALLEL,
            limits=limits,
        )
        try:
            self.port = await self._listener.start()
        except ListenError as exc:
            await self._node.__aexit__(None, None, None)
            raise TpGroupFailed(
                f"rank 0 cannot listen where the ranks meet it: {exc} (is another rank 0 of "
                "this hostfile running?)"
            ) from None
        self._reply = ReplyEndpoint(self.address, self._listener)
        self._listener.on_lost.append(self._lost)
        node.bus.subscribe(TpJoin, self._on_join, origin=Origin.REMOTE, sync=True, maxsize=64)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._node.__aexit__(None, None, None)

    def _lost(self, source: str) -> None:
        if not self._complete.is_set():
            self.roll.left(source)

    def _on_join(self, env: Envelope[TpJoin]) -> None:
        if self._complete.is_set():
            return  # the ring went out: a late join is answered by the closed listener
        why = self.roll.join(env.source, env.msg)
        if why is not None:
            assert self._listener is not None
            self._listener.limiter.warn(
                "diagnostic", f"tensor parallel: refused {env.source} joining: {why}"
            )
            self._node.spawn(self._answer(env.source, Error(ErrorCode.TP_JOIN_REFUSED, why)))
            return
        logger.info("tensor parallel: rank {} joined from {}", env.msg.rank, env.source)
        if self.roll.complete:
            self._complete.set()

    async def _answer(self, dest: str, msg: Error | TpRing) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._reply.send(dest, msg, loop.time() + ANSWER_BOUND)
        except SendFailed as exc:
            logger.debug("tensor parallel: answer to {} lost: {}", dest, exc)

    def waiting_for(self) -> str:
        ranks = ", ".join(str(r) for r in self.roll.missing())
        return f"rank(s) {ranks} to join rank 0 at {self.address}"

    async def meet(
        self, own_ring: str | None, backend: str, prompt_cache_bytes: int = 0
    ) -> Meeting:
        """Wait for the full roll, then send every rank the ring; rank 0's own ring listener
        is ``own_ring`` (None: a port free now on the rendezvous host). Accepting stops
        first: once ranks dial MLX's ring, nothing of this listener may answer them."""
        await self._complete.wait()
        assert self._listener is not None
        self._listener.stop_accepting()
        own = own_ring or ring_address(self.host, free_port(self.host))
        meeting = Meeting(self.roll.ring(own), backend, os.urandom(32), prompt_cache_bytes)
        ring = TpRing(meeting.ring, meeting.backend, meeting.step_key, prompt_cache_bytes)
        sends = [self._answer(src, ring) for src in self.roll.sources()]
        await asyncio.gather(*sends)
        return meeting


PROGRESS_EVERY = 5.0  # seconds between a waiting rank's "still waiting" lines


async def attend(secret: ClusterSecret, rendezvous: str, join: TpJoin, timeout: float) -> Meeting:
    """A rank other than 0: dial rank 0 (retrying until it listens), prove the secret, join,
    and wait for the ring -- joining again if rank 0 goes away meanwhile (a restarted one
    takes the roll afresh). Raises :class:`TpGroupFailed` saying why it cannot join."""
    own_host, _ = split_hostport(join.ring)
    rank0 = ring_address(*split_hostport(rendezvous))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with Node(f"tp-rank-{join.rank}") as node:
        answers: asyncio.Queue[TpRing | Error | None] = asyncio.Queue()

        def on_answer(env: Envelope[Any]) -> None:
            if env.source == rank0:
                answers.put_nowait(env.msg)

        node.bus.subscribe((TpRing, Error), on_answer, origin=Origin.REMOTE, sync=True)
        pool = ConnectionPool(
            node,
            secret,
            # A port of this process's own, so two copies of one rank are two peers to rank 0.
            Identity(own_host, free_port(own_host), f"tp-rank-{join.rank}"),
            channel=Channel.TENSOR_PARALLEL,
            # Rank 0 may start after this rank: keep dialling until the start-up timeout.
            backoff=Backoff(attempts=1 << 20, base_delay=0.2, max_delay=1.0),
            bind_ip=own_host,  # the handshake binds the claimed host to the source IP
            peer_timeout=None,
        )
        endpoint = TcpEndpoint(rank0, pool)
        endpoint.on_peer_lost(lambda who: answers.put_nowait(None) if who == rank0 else None)
        got = await _join_until(endpoint, rank0, join, answers, deadline, timeout)
    if isinstance(got, Error):
        raise TpGroupFailed(f"rank 0 at {rendezvous} refused rank {join.rank}: {got.message}")
    if len(got.ring) < 2 or not 0 < join.rank < len(got.ring) or got.ring[join.rank] != join.ring:
        raise TpGroupFailed(f"rank 0 at {rendezvous} sent a ring that does not hold this rank")
    return Meeting(got.ring, got.backend, got.step_key, got.prompt_cache_bytes)


async def _join_until(
    endpoint: TcpEndpoint,
    rank0: str,
    join: TpJoin,
    answers: asyncio.Queue[TpRing | Error | None],
    deadline: float,
    timeout: float,
) -> TpRing | Error:
    loop = asyncio.get_running_loop()
    me = f"tp rank {join.rank}"
    while True:
        logger.info("{}: joining rank 0 at {}", me, rank0)
        try:
            await endpoint.send(rank0, join, deadline)
        except SendFailed as exc:
            why = exc.__cause__ or exc
            raise TpGroupFailed(f"rank {join.rank} could not join rank 0: {why}") from None
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TpGroupFailed(
                    f"rank {join.rank} joined rank 0 at {rank0}, which did not send the ring "
                    f"within {timeout:g}s (--startup-timeout): are all its ranks started?"
                )
            try:
                got = await asyncio.wait_for(answers.get(), min(PROGRESS_EVERY, left))
            except TimeoutError:
                logger.info("{}: joined; rank 0 waits for the other ranks", me)
                continue
            if got is not None:
                return got
            logger.warning("{}: rank 0 at {} went away before sending the ring", me, rank0)
            break  # dial again: a restarted rank 0 takes the roll afresh
