"""Transports: TCP through a chosen interface, and an RDMA capability probe.

``--cluster-interface NAME`` pins cluster traffic to one network interface (what the reference
does for Thunderbolt bridges): the listener binds that interface's IPv4 address and outbound
connections use it as their source address. RDMA is probed and reported; the transport falls
back to TCP, which is all this build speaks.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from mlxcel.errors import InterfaceError

SIOCGIFADDR = 0x8915


def interface_ipv4(name: str) -> str:
    """The IPv4 address of interface ``name`` (Linux ioctl SIOCGIFADDR)."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise InterfaceError(
            f"--cluster-interface: no interface named {name!r} (have: {names})"
        ) from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            raise InterfaceError(
                f"--cluster-interface: interface {name!r} has no IPv4 address"
            ) from None
    return socket.inet_ntoa(packed[20:24])


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
