"""Who may call the HTTP API: an API key, and the browser origins allowed to (CORS).

- ``--api-key`` (one key or several, or ``--api-key-file``): every request but
  ``GET /health/live`` (a liveness probe carries no credentials), ``GET /dashboard`` (a page
  without data; its polls send the key), ``GET /`` (a redirect to it) and a CORS preflight
  must send ``Authorization: Bearer KEY``; the key is compared in constant time against every
  key (all of them, whichever matches), and a missing or wrong one gets 401 in the OpenAI
  error shape with ``WWW-Authenticate: Bearer``. A key is never logged. Each key is a
  **tenant**: the request carries a label derived from its key (``request[TENANT]``), and the
  prompt cache is shared only inside one tenant (``mlxcel.base.prefix_index``).
- ``--allowed-origins``: a comma-separated list of origins (``https://app.example``), or
  ``*`` for any. A request from an allowed origin gets ``Access-Control-Allow-Origin`` (on
  streams too: the header is added as the response is prepared); a preflight (``OPTIONS``
  with ``Access-Control-Request-Method``) from one gets 204 with the methods and the headers
  it asked for, from any other origin 403. Without the option no CORS header is ever sent, so a
  browser on another origin cannot read an answer.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from mlxcel.base.errors import ConfigError
from mlxcel.base.prefix_index import tenant_of

# The tenant label of an authenticated request ("": a server without keys, or a shared cache).
TENANT = web.RequestKey("tenant", str)

# Liveness carries no credentials; the dashboard page holds no data (its polls of /cluster
# send the key).
EXEMPT = frozenset({"/health/live", "/dashboard", "/"})  # "/" only sends to the dashboard
ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE = "600"
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")  # an HTTP token


def parse_origins(text: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: ``*``, or origins as a browser sends them (scheme://host[:port],
    no path). Raises ConfigError naming a malformed one."""
    if not text or not text.strip():
        return ()
    items = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if "*" in items:
        return ("*",)
    for o in items:
        scheme, sep, rest = o.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
            raise ConfigError(
                "--allowed-origins",
                f"{o!r} is not an origin: give scheme://host[:port] (e.g. https://app.example), "
                "or * for any",
            )
    return items


def _error(
    status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> web.Response:
    """The OpenAI error shape (as ``openai_api.error_response``, which imports this module)."""
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return web.json_response(body, status=status, headers=headers)


def _unauthorized(message: str) -> web.Response:
    return _error(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def api_key_middleware(keys: tuple[str, ...], shared_cache: bool = False) -> Any:
    """Requests must carry one of ``keys``; each key is its own tenant of the prompt cache
    unless ``shared_cache`` (then every key shares one)."""
    expected = [(k.encode(), "" if shared_cache else tenant_of(k)) for k in keys]

    @web.middleware
    async def require_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in EXEMPT or _is_preflight(request):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return _unauthorized(
                "this server needs an API key: send the header Authorization: Bearer <key>"
            )
        raw, tenant = given.strip().encode(), None
        for key, label in expected:  # every key is compared: the time says nothing of which
            if hmac.compare_digest(raw, key) and tenant is None:
                tenant = label
        if tenant is None:
            return _unauthorized("incorrect API key provided")
        request[TENANT] = tenant
        return await handler(request)

    return require_api_key


def parse_api_keys(text: str | None, file_text: str | None) -> tuple[str, ...]:
    """``--api-key`` (one key, or several separated by commas) and the lines of
    ``--api-key-file`` (one key a line; blank lines and lines starting with ``#`` are skipped),
    as one tuple in order, without repeats. Raises ConfigError naming a malformed key: empty,
    or holding whitespace (a pasted line break would otherwise lock every client out)."""
    keys: list[str] = []
    for flag, items in (
        ("--api-key", [k.strip() for k in text.split(",")] if text is not None else []),
        ("--api-key-file", [ln.strip() for ln in (file_text or "").lstrip("\ufeff").splitlines()
                            if ln.strip() and not ln.lstrip().startswith("#")]),
    ):  # fmt: skip
        for i, key in enumerate(items, 1):
            if not key or any(c.isspace() for c in key):
                where = f"key {i}" if flag == "--api-key" else f"line {i} (of the keys)"
                raise ConfigError(flag, f"{where} must be non-empty and contain no whitespace")
            if key not in keys:
                keys.append(key)
    return tuple(keys)


def _is_preflight(request: web.Request) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


class Cors:
    """The allowed origins, as a middleware (preflights) and a response-prepare hook."""

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(origins)
        self.any = "*" in self.origins

    def allows(self, origin: str) -> bool:
        return self.any or origin.rstrip("/") in self.origins

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not _is_preflight(request):
            return await handler(request)
        origin = request.headers["Origin"]
        if not self.allows(origin):
            return _error(403, f"origin {origin!r} is not allowed", "origin_not_allowed")
        # Clients send more than Authorization and Content-Type (the openai JS client adds
        # x-stainless-*): the headers asked for are allowed, if they are header names.
        asked = request.headers.get("Access-Control-Request-Headers", "")
        names = [h.strip() for h in asked.split(",") if h.strip()]
        allowed = ", ".join(h for h in names if _HEADER_NAME.fullmatch(h)) or ALLOWED_HEADERS
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": allowed,
                "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
                "Vary": "Origin, Access-Control-Request-Headers",
            },
        )

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        if not self.any:  # the answer depends on the Origin: caches must know it
            response.headers.add("Vary", "Origin")
        origin = request.headers.get("Origin")
        if origin is None or not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if self.any else origin
