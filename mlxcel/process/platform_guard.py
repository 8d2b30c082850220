"""Distributed modes are not available on native Windows.

``generate`` and ``serve`` call :func:`refuse_distributed_on_windows` before anything else (in
particular before the model is resolved or created), so a Windows user learns at once which
flag to drop. Later modes add their flags to the table below.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from mlxcel.base.errors import PlatformUnsupported


def _above_one(v: Any) -> bool:
    try:
        return int(v) > 1
    except (TypeError, ValueError):
        return True  # an unparsable size still names a distributed flag


def _present(v: Any) -> bool:
    return v not in (None, "", False)


def _switched_on(v: Any) -> bool:
    """A boolean flag: True from the CLI, or a true-looking environment string."""
    return v is True or (isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"))


def _disaggregated(v: Any) -> bool:
    """``--node-role``: any role but the single-node default."""
    return v not in (None, "") and str(v).strip().lower() != "hybrid"


# (flag, field, predicate on the raw value that means "this asks for a distributed mode").
# Values are raw (CLI strings or environment strings): the guard runs before validation.
DISTRIBUTED_FLAGS: dict[str, list[tuple[str, str, Callable[[Any], bool]]]] = {
    "generate": [
        ("--tp-size", "tp_size", _above_one),
        ("--tp-hostfile", "tp_hostfile", _present),
        ("--pp-size", "pp_size", _above_one),
        ("--pp-layers", "pp_layers", _present),
    ],
    "serve": [
        ("--tp-size", "tp_size", _above_one),
        ("--tp-hostfile", "tp_hostfile", _present),
        ("--pp-size", "pp_size", _above_one),
        ("--pp-layers", "pp_layers", _present),
        ("--distributed-config", "distributed_config", _present),
        ("--pp-auto", "pp_auto", _present),
        ("--pp-peer", "pp_peer", _switched_on),
        ("--node-role", "node_role", _disaggregated),
        ("--cluster-peers", "cluster_peers", _present),
        ("--prefill-peers", "prefill_peers", _present),
        ("--decode-peers", "decode_peers", _present),
        ("--serving-bind", "serving_bind", _present),
    ],
}


def refuse_distributed_on_windows(
    command: str, values: dict[str, Any], platform: str | None = None
) -> None:
    if (platform or sys.platform) != "win32":
        return
    for flag, field, asks in DISTRIBUTED_FLAGS.get(command, []):
        if field in values and asks(values[field]):
            raise PlatformUnsupported(
                f"{flag} needs a distributed mode, which native Windows does not support; "
                "use Linux, macOS or WSL2"
            )
