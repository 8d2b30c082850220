"""The access log: one line per HTTP request -- method, path, status (with the error code of a
4xx/5xx, or how a stream that began with 200 ended), tokens, latency; the same as fields in
JSON logs. Probes (health, metrics) are logged at DEBUG: a load balancer polling every second
must not bury the requests."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web
from loguru import logger

from mlxcel.server.responses import STREAM_ERROR
from mlxcel.serving.frontend import Usage

# What a generation request used, for its access line (a typed key where aiohttp has them).
USAGE: Any = web.RequestKey("usage", Usage) if hasattr(web, "RequestKey") else "usage"


PROBES = frozenset({"/health", "/health/live", "/metrics", "/cluster"})  # polled: at DEBUG


def _error_code(resp: web.StreamResponse) -> str | None:
    """The ``error.code`` of an error answer (what the access line says a 4xx/5xx was)."""
    body = getattr(resp, "body", None)
    if resp.status < 400 or not isinstance(body, bytes) or len(body) > 65536:
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


@web.middleware
async def access_log(request: web.Request, handler: Any) -> web.StreamResponse:
    """One INFO line per request: method, path, status (with the error code of a 4xx/5xx),
    tokens, latency (fields in JSON). Probes (health, metrics) are logged at DEBUG."""
    started = time.perf_counter()
    status = 500
    code: str | None = None
    try:
        resp = await handler(request)
        status = resp.status
        code = _error_code(resp)
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    except BaseException:
        status = 499 if request.transport is None or request.transport.is_closing() else 500
        raise
    finally:
        usage = request.get(USAGE)
        failed = request.get(STREAM_ERROR)  # a 200 whose stream then ended in an error
        shown = f"{status} stream-error={failed}" if failed else str(status)
        if code is not None:
            shown = f"{status} {code}"
        prompt = usage.prompt_tokens if usage is not None else 0
        completion = usage.completion_tokens if usage is not None else 0
        ms = (time.perf_counter() - started) * 1000
        logger.bind(
            method=request.method,
            path=request.path,
            status=status,
            stream_error=failed,
            prompt_tokens=prompt,
            completion_tokens=completion,
            latency_ms=round(ms, 1),
            remote=request.remote,
            error_code=code,
        ).log(
            # A probe's refusals stay at INFO: someone guessing keys there is seen.
            "DEBUG" if request.path in PROBES and status < 400 else "INFO",
            "{} {} {} prompt={} completion={} {:.1f}ms",
            request.method,
            request.path,
            shown,
            prompt,
            completion,
            ms,
        )
