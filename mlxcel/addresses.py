"""Cluster addresses as operators write them: ``IP:PORT`` with a literal IP, in the one form
identities are compared in. Pure: no sockets, no settings."""

from __future__ import annotations

import ipaddress


def check_address(address: str, flag: str, port_zero: bool) -> None:
    """IP:PORT with a literal IP (identities are bound to source IPs, so no host names), in
    the one form identities are compared in: no leading zeros, IPv6 in brackets."""
    host, sep, port = address.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        canonical = f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"
        ok = (
            bool(sep)
            and port.isdigit()
            and (port_zero or int(port) > 0)
            and int(port) < 65536
            and address == canonical
        )
    except ValueError:
        ok = False
    if not ok:
        zero = " (port 0: any free port)" if port_zero else ""
        raise ValueError(
            f"{flag}: expected IP:PORT with a literal IP{zero} (IPv6 as [IP]:PORT, no leading "
            f"zeros), got {address!r}"
        )
