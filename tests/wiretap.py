"""A TCP relay for tests: sits between two nodes on a real socket and records (or damages) bytes.

The relay connects to its target from ``bind_ip`` -- the same address the real client would
use -- so the listener's source-IP identity rule still holds with the relay in the path.
``captured`` holds every byte that went client -> server and server -> client, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Mutator = Callable[[bytes], bytes | None]  # None: swallow the chunk


class WireTap:
    def __init__(self, host: str, target: tuple[str, int], bind_ip: str) -> None:
        self.host = host
        self.target = target
        self.bind_ip = bind_ip
        self.port = 0
        self.up = bytearray()  # client -> server
        self.down = bytearray()  # server -> client
        self.mutate_up: Mutator | None = None
        self.delay_up = 0.0  # one-shot: hold the next client -> server chunk this long
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.target, local_addr=(self.bind_ip, 0))
        self._writers += [cw, sw]
        await asyncio.gather(
            self._pump(cr, sw, self.up, up=True),
            self._pump(sr, cw, self.down, up=False),
            return_exceptions=True,
        )

    async def _pump(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, log: bytearray, up: bool
    ) -> None:
        try:
            while data := await r.read(1 << 16):
                log += data
                if up and self.delay_up:
                    delay, self.delay_up = self.delay_up, 0.0
                    await asyncio.sleep(delay)
                if up and self.mutate_up is not None:
                    changed = self.mutate_up(data)
                    if changed is None:
                        continue
                    data = changed
                w.write(data)
                await w.drain()
        finally:
            w.close()

    def once(self, mutate: Mutator) -> None:
        """Apply ``mutate`` to the next client -> server chunk only."""

        def one_shot(data: bytes) -> bytes | None:
            self.mutate_up = None
            return mutate(data)

        self.mutate_up = one_shot

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
