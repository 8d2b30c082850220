"""Hosts on a real network stack: Linux network namespaces joined by one bridge.

Loopback never loses a packet and always answers a dead port with a reset, so it cannot show
what a silent peer does to a cluster. :class:`Hosts` builds ``n`` hosts (each a namespace with
one veth, 10.<net>.0.<i+1>/24) plugged into a bridge that lives in a namespace of its own (the
machine's own networking is never touched), and can:

- ``partition(i)`` / ``heal(i)``: unplug host ``i``'s cable from the bridge and plug it back.
  Its packets go nowhere and nothing answers them: no reset, no FIN -- a cut cable, a switch
  failure, a laptop that slept;
- ``slow(i, rate)``: shape host ``i``'s outgoing traffic with a token bucket (``tc tbf``);
- ``cable_pulled(i, name)``, ``slow_link(i, rate, name)``: the same as
  :class:`~mlxcel.reactor.faults.Fault` objects (apply and undo), for ``run_fault`` and ``applied``;
- ``spawn(i, argv)``: start a process inside host ``i``.

Needs root and ``ip``/``tc`` (iproute2). :func:`unavailable` says why not, when not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

from mlxcel.reactor.faults import Fault


def unavailable() -> str | None:
    """Why namespaces cannot be built here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"mxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Hosts:
    """``n`` hosts on one bridge; a context manager that deletes everything it made."""

    def __init__(self, n: int, net: int = 77, tag: str | None = None) -> None:
        self.n = n
        self.net = net
        self.tag = tag or f"mx{os.getpid() % 100000}"
        self.hub = f"{self.tag}-hub"
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self._made: list[str] = []

    def ip(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 1}"

    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", self.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
                "netns", name)  # fmt: skip
            _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def add_addresses(self, i: int, count: int, first: int = 100) -> list[str]:
        """Give host ``i`` ``count`` more addresses (10.<net>.0.<first>...): one attacker that
        looks like many sources."""
        extra = [f"10.{self.net}.0.{first + k}" for k in range(count)]
        for a in extra:
            _ip("-n", self.names[i], "addr", "add", f"{a}/24", "dev", "eth0")
        return extra

    def cable_pulled(self, i: int, name: str) -> Fault:
        """Host ``i`` unplugged (:meth:`partition`), then plugged back (:meth:`heal`)."""
        return Fault(name, partial(self.partition, i), partial(self.heal, i))

    def slow_link(self, i: int, rate: str, name: str) -> Fault:
        """Host ``i``'s outgoing traffic shaped to ``rate``, then unshaped."""
        return Fault(name, partial(self.slow, i, rate), partial(self.unslow, i), hurts=False)

    def partition(self, i: int) -> None:
        """Unplug host ``i``: everything it sends is lost and nothing reaches it (no reset)."""
        _ip("-n", self.hub, "link", "set", f"p{i}", "nomaster")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0")

    def slow(self, i: int, rate: str = "1mbit", burst: str = "32kbit") -> None:
        """Shape host ``i``'s outgoing traffic to ``rate`` (a token bucket of ``burst``: at
        gigabit rates it must hold a timer tick's worth, hundreds of KB; ``unslow`` ends it)."""
        r = subprocess.run(
            [
                "tc",
                "-n",
                self.names[i],
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                "400ms",
            ],  # fmt: skip
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"tc tbf on host {i}: {r.stderr.strip()}")

    def unslow(self, i: int) -> None:
        subprocess.run(
            ["tc", "-n", self.names[i], "qdisc", "del", "dev", "eth0", "root"], capture_output=True
        )

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``i``."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def spawn(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(i, argv), **kw)

    def close(self) -> None:
        # Deleting a namespace kills nothing that runs in it: callers stop their processes
        # first. The veths go with their namespaces.
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)
