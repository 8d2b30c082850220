"""Drives a sans-I/O handshake over an asyncio stream: the only place it meets a socket."""

from __future__ import annotations

import asyncio

from mlxcel.base.errors import HandshakeError
from mlxcel.wire.handshake import ClientHandshake, Established, Failure, ServerHandshake


async def drive(
    hs: ClientHandshake | ServerHandshake,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> Established:
    """Run ``hs`` to completion; raise HandshakeError on failure (bytes owed are sent first)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            out = hs.data_to_send()
            if out:
                writer.write(out)
                try:
                    # Within the handshake's one deadline, the last message included: a peer
                    # that stops reading cannot hold this side here.
                    async with asyncio.timeout_at(hs.deadline):
                        await writer.drain()
                except TimeoutError:
                    hs.on_timer(loop.time())  # the handshake's own timeout failure
                    if hs.finished:
                        break
                    continue
            if hs.finished:
                break
            timer = hs.next_timer()
            try:
                async with asyncio.timeout_at(timer):
                    data = await reader.readexactly(hs.bytes_needed)
            except TimeoutError:
                hs.on_timer(loop.time())
                continue
            except asyncio.IncompleteReadError as exc:
                hs.receive_data(exc.partial)
                hs.connection_lost()
                continue
            hs.receive_data(data)
    except (ConnectionError, OSError):
        hs.connection_lost()
    if hs.error is not None:
        raise hs.error
    if hs.result is None:  # pragma: no cover - finished implies one of the two
        raise HandshakeError(Failure.CLOSED, "handshake ended without a result")
    return hs.result
