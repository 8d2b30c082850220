"""``python -m mlxcel status URL [--watch]``: the cluster behind a serving node as a table --
its nodes, roles, layers, health, load -- from its ``/cluster`` view, with tokens a second
measured between two views a second (or ``--interval``) apart."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from mlxcel.base.errors import MlxcelError
from mlxcel.config.tools import StatusSettings

COLUMNS = ("node", "role", "layers", "health", "in flight", "sequences", "KV tokens", "last seen")


def fetch(url: str, key: str | None) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + "/cluster")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise MlxcelError(
                f"{url} needs an API key: pass --api-key or set MLXCEL_API_KEY"
            ) from None
        if exc.code == 404:
            raise MlxcelError(f"{url} has no /cluster view: is it an mlxcel server?") from None
        raise MlxcelError(f"{url}/cluster answered HTTP {exc.code}") from None
    except json.JSONDecodeError:
        raise MlxcelError(f"{url}/cluster is not JSON: is it an mlxcel server?") from None
    except (OSError, ValueError) as exc:
        raise MlxcelError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None


def _clean(value: Any) -> str:
    """A node's id or error as text without control characters (no escape sequences reach
    the operator's terminal from a view)."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(value))


def render(view: dict[str, Any], before: dict[str, Any] | None) -> str:
    try:
        return _render(view, before)
    except (KeyError, TypeError, ValueError) as exc:
        raise MlxcelError(f"the /cluster view is not one this version reads ({exc!r})") from None


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def _kv(n: dict[str, Any]) -> str:
    """KV-cache positions held / held plus what still fits ("-": the node does not say)."""
    used, cap = n.get("kv_tokens"), n.get("kv_capacity")
    if used is None:
        return "-"
    return _count(float(used)) + (f" / {_count(float(cap))}" if cap else "")


def _render(view: dict[str, Any], before: dict[str, Any] | None) -> str:
    t = view["totals"]
    rate = "-"
    if before is not None and view["time"] > before["time"]:
        made = t["generated_tokens"] - before["totals"]["generated_tokens"]
        rate = f"{made / (view['time'] - before['time']):.1f}"
    ttft = "-" if t.get("ttft_ms_p50") is None else f"{t['ttft_ms_p50']:g} ms"
    up = sum(1 for n in view["nodes"] if n["up"])
    head = (
        f"{_clean(view['model'])} ({_clean(view['mode'])}): {up}/{len(view['nodes'])} nodes up, "
        f"{rate} tok/s, {t['running']} running, {t['waiting']} waiting, TTFT p50 {ttft}, "
        f"{t['requests']} requests served"
    )
    rows = [COLUMNS]
    for n in view["nodes"]:
        seen = n.get("last_seen_s")
        rows.append(
            (
                _clean(n["id"]),
                _clean(n["role"]),
                _clean(n.get("layers") or "-"),
                "up" if n["up"] else "DOWN",
                "-" if n.get("in_flight") is None else str(n["in_flight"]),
                "-" if n.get("sequences") is None else str(n["sequences"]),
                _kv(n),
                "-" if seen is None else f"{seen:.1f} s ago",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    down = [
        f"  {_clean(n['id'])}: {_clean(n['error'])}"
        for n in view["nodes"]
        if not n["up"] and n.get("error")
    ]
    return "\n".join([head, "", *lines, *down])


def status(s: StatusSettings) -> int:
    key = s.api_key.get_secret_value() if s.api_key is not None else None
    if key is not None:  # MLXCEL_API_KEY may hold the server's several keys: send the first
        from mlxcel.server.access import parse_api_keys

        key = parse_api_keys(key, None)[0]
    before = fetch(s.url, key)
    if not s.watch:
        time.sleep(min(1.0, s.interval))  # a second view: tokens a second need two
        print(render(fetch(s.url, key), before), flush=True)
        return 0
    try:
        while True:
            time.sleep(s.interval)
            try:
                now = fetch(s.url, key)
            except MlxcelError as exc:  # a restart, a blip: say so and keep watching
                print(f"unreachable: {exc}", flush=True)
                continue
            if sys.stdout.isatty():
                sys.stdout.write("\033[2J\033[H")  # clear, home
            print(render(now, before), flush=True)
            print(flush=True)
            before = now
    except KeyboardInterrupt:
        return 0
