"""Transports: TCP through a chosen interface, and an RDMA capability probe.

``--cluster-interface NAME`` pins cluster traffic to one network interface (what the reference
does for Thunderbolt bridges): the listener binds that interface's IPv4 address and outbound
connections use it as their source address. RDMA is probed and reported; the transport falls
back to TCP, which is all this build speaks.

Interfaces and their addresses come from psutil, which reads them the same way on Linux and
macOS (where most MLX clusters run: a Thunderbolt bridge is ``bridge0`` there), rather than
through an ioctl that only Linux has.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from mlxcel.base.errors import InterfaceError


def interface_ipv4(name: str) -> str:
    """The (first) IPv4 address of interface ``name``."""
    import psutil  # only a node given --cluster-interface needs it

    table = psutil.net_if_addrs()
    if name not in table:
        names = ", ".join(sorted(table))
        raise InterfaceError(f"--cluster-interface: no interface named {name!r} (have: {names})")
    for addr in table[name]:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise InterfaceError(f"--cluster-interface: interface {name!r} has no IPv4 address")


@dataclass(frozen=True)
class RdmaProbe:
    devices: tuple[str, ...]
    transport: str
    detail: str


def probe_rdma(sysfs: Path = Path("/sys/class/infiniband")) -> RdmaProbe:
    """Report RDMA devices; the cluster transport uses TCP either way in this build."""
    devices = tuple(sorted(p.name for p in sysfs.iterdir())) if sysfs.is_dir() else ()
    if not devices:
        return RdmaProbe((), "tcp", f"no RDMA devices under {sysfs}; using TCP")
    return RdmaProbe(
        devices,
        "tcp",
        f"RDMA devices found ({', '.join(devices)}) but this build has no RDMA "
        "data path; using TCP",
    )
