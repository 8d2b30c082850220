"""OpenAI-compatible HTTP API on aiohttp.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (plain JSON or SSE streaming),
``GET /v1/models``, ``GET /health`` and ``GET /metrics``. Handlers only translate: a request
becomes a :class:`~mlxcel.frontend.Frontend` stream; every refusal is a typed error mapped to
an OpenAI-style body. A client that disconnects cancels its handler (aiohttp's
``handler_cancellation``), which closes the stream, which cancels the sequence and frees its
cache.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web
from loguru import logger
from pydantic import BaseModel, ValidationError

from mlxcel.errors import AdmissionRejected, DeadlineExceeded, RequestError
from mlxcel.frontend import Delta, EngineError, Frontend, Usage
from mlxcel.messages import ErrorCode, SamplingParams
from mlxcel.server.metrics import Metrics
from mlxcel.server.schemas import MAX_INT, ChatCompletionRequest, CompletionRequest

FRONTEND = web.AppKey("frontend", Frontend)
METRICS = web.AppKey("metrics", Metrics)
SETTINGS = web.AppKey("settings", dict)
HEALTH = web.AppKey("health", object)  # optional async callable adding role details to /health


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    err_type: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _validation_error(exc: ValidationError) -> web.Response:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return error_response(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()  # aiohttp enforces client_max_size (413)
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:
        if "int_max_str_digits" in str(exc) or "integer string conversion" in str(exc):
            raise RequestError("request body holds a number with too many digits") from None
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply") from None
    _no_lone_surrogates(body)
    return body


def _no_lone_surrogates(value: Any) -> None:
    """JSON may escape half of a UTF-16 pair (``"\\ud800"``); no tokenizer can encode that."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(
                    "request body contains a lone UTF-16 surrogate (invalid Unicode text)"
                ) from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _model_check(app: web.Application, name: str) -> None:
    served = app[SETTINGS]["model_name"]
    if name != served:
        raise RequestError(
            f"model {name!r} does not exist; this server serves {served!r}", param="model"
        )


def _params(
    req: ChatCompletionRequest | CompletionRequest, default_max: int, logprobs: bool
) -> SamplingParams:
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    return SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=min(req.top_k or 0, MAX_INT),
        seed=req.seed,
        max_tokens=max_tokens or default_max,
        logprobs=logprobs,
    )


# Codes the generating side reports that mean "not now", not "broken": a load balancer may retry.
UNAVAILABLE_CODES = frozenset(
    {
        ErrorCode.STAGE_UNREACHABLE,
        ErrorCode.DOWNSTREAM_UNREACHABLE,
        ErrorCode.DRAINING,
        ErrorCode.NOT_PREPARED,
        ErrorCode.TOO_MANY_SEQUENCES,
        ErrorCode.NO_NODE_AVAILABLE,
        ErrorCode.NODE_UNREACHABLE,
    }
)


def engine_error_status(code: str) -> tuple[int, str, dict[str, str] | None]:
    """HTTP status, OpenAI error type and headers for an error the engine or pipeline sent."""
    if code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.HANDOFF_TIMEOUT):
        return 504, "timeout", None
    if code in UNAVAILABLE_CODES:
        return 503, "server_busy", {"Retry-After": "1"}
    return 500, "server_error", None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completions")


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    metrics = app[METRICS]
    endpoint = f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}"
    started = time.perf_counter()
    status = 500
    try:
        resp = await _generate(request, kind)
        status = resp.status
        return resp
    except RequestError as exc:
        status = 400
        return error_response(400, str(exc), param=exc.param)
    except AdmissionRejected as exc:
        status = 503
        return error_response(
            503,
            str(exc),
            err_type="server_busy",
            code=ErrorCode.QUEUE_FULL,
            headers={"Retry-After": "1"},
        )
    except DeadlineExceeded as exc:
        status = 504
        return error_response(504, str(exc), err_type="timeout", code=ErrorCode.DEADLINE_EXCEEDED)
    except EngineError as exc:
        status, err_type, headers = engine_error_status(exc.code)
        return error_response(status, str(exc), err_type=err_type, code=exc.code, headers=headers)
    finally:
        metrics.requests.labels(endpoint, str(status)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    fe = app[FRONTEND]
    metrics = app[METRICS]
    settings = app[SETTINGS]
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    schema: type[BaseModel] = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        req = schema.model_validate(body)
    except ValidationError as exc:
        return _validation_error(exc)
    _model_check(app, req.model)
    if isinstance(req, ChatCompletionRequest):
        prompt_ids = await fe.apply_chat_template_async(
            [{"role": m.role, "content": m.text()} for m in req.messages]
        )
        want_lp = req.logprobs
    else:
        assert isinstance(req, CompletionRequest)
        prompt_ids = await fe.encode_prompt_async(req.prompt)
        want_lp = bool(req.logprobs)
    params = _params(req, settings["default_max_tokens"], want_lp)
    usage = Usage()
    created = int(time.time())
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    stream = fe.stream(prompt_ids, params, req.stop_list(), usage)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream:
        return await _sse(
            request, stream, kind, rid, created, req.model, usage, include_usage, metrics
        )
    text: list[str] = []
    lps: list[tuple[int, float]] = []
    finish = None
    async with aclosing(stream) as it:
        async for d in it:
            text.append(d.text)
            if d.logprobs:
                lps.extend(zip(d.token_ids, d.logprobs, strict=False))
            finish = d.finish_reason
    _account(metrics, usage)
    content = "".join(text)
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": finish,
            "logprobs": _chat_logprobs(fe, lps) if want_lp else None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": content,
            "finish_reason": finish,
            "logprobs": _completion_logprobs(fe, lps) if want_lp else None,
        }
        obj = "text_completion"
    return web.json_response(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": req.model,
            "choices": [choice],
            "usage": _usage(usage),
        }
    )


def _usage(u: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _account(metrics: Metrics, u: Usage) -> None:
    metrics.prompt_tokens.inc(u.prompt_tokens)
    metrics.generated_tokens.inc(u.completion_tokens)
    if u.first_token_at is not None:
        metrics.ttft.observe(u.first_token_at - u.submitted_at)


def _token_str(fe: Frontend, t: int) -> str:
    return str(fe.tokenizer.decode([t]))


def _chat_logprobs(fe: Frontend, lps: list[tuple[int, float]]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": _token_str(fe, t),
                "logprob": lp,
                "bytes": list(_token_str(fe, t).encode()),
                "top_logprobs": [],
            }
            for t, lp in lps
        ]
    }


def _completion_logprobs(fe: Frontend, lps: list[tuple[int, float]]) -> dict[str, Any]:
    return {
        "tokens": [_token_str(fe, t) for t, _ in lps],
        "token_logprobs": [lp for _, lp in lps],
        "top_logprobs": None,
        "text_offset": None,
    }


async def _sse(
    request: web.Request,
    stream: Any,
    kind: str,
    rid: str,
    created: int,
    model: str,
    usage: Usage,
    include_usage: bool,
    metrics: Metrics,
) -> web.StreamResponse:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    resp: web.StreamResponse | None = None

    def chunk(d: Delta | None, first: bool = False) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        if d is not None or first:
            if kind == "chat":
                delta: dict[str, Any] = (
                    {"role": "assistant", "content": ""} if first else {"content": d.text}
                )  # type: ignore[union-attr]
                choices = [
                    {
                        "index": 0,
                        "delta": delta,
                        "finish_reason": None if first else d.finish_reason,
                        "logprobs": None,
                    }
                ]  # type: ignore[union-attr]
            else:
                choices = [
                    {"index": 0, "text": d.text, "finish_reason": d.finish_reason, "logprobs": None}
                ]  # type: ignore[union-attr]
        out: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            out["usage"] = None
        return out

    async def send(payload: dict[str, Any] | str) -> None:
        assert resp is not None
        data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        await resp.write(f"data: {data}\n\n".encode())

    try:
        async with aclosing(stream) as it:
            async for d in it:
                if resp is None:
                    # Headers go out with the first token, so admission errors can still be a 4xx/5xx.
                    resp = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await resp.prepare(request)
                    if kind == "chat":
                        await send(chunk(None, first=True))
                await send(chunk(d))
    except (EngineError, DeadlineExceeded) as exc:
        if resp is None:
            raise
        # The status line is gone; report the failure in-band, as OpenAI's API does.
        code = exc.code if isinstance(exc, EngineError) else ErrorCode.DEADLINE_EXCEEDED
        await send(
            {"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}}
        )
        await resp.write_eof()
        return resp
    if resp is None:  # pragma: no cover - a stream always yields its final delta
        raise RequestError("generation produced nothing")
    _account(metrics, usage)
    if include_usage:
        await send(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(usage),
            }
        )
    await send("[DONE]")
    await resp.write_eof()
    return resp


async def list_models(request: web.Request) -> web.Response:
    name = request.app[SETTINGS]["model_name"]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": request.app[SETTINGS]["created"],
                    "owned_by": "mlxcel",
                }
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    """Readiness: 200 only when this node can serve a request now, else 503 and why.

    A role adds its details through the HEALTH callable; a ``"ready": False`` among them (a
    pipeline stage unreachable or draining, a broken tensor-parallel group) makes the node
    ``degraded``, so a load balancer stops sending it traffic.
    """
    fe = request.app[FRONTEND]
    body: dict[str, Any] = {"status": "ok", "in_flight": fe.in_flight, "waiting": fe.waiting}
    extra = request.app.get(HEALTH)
    if extra is not None:
        body.update(await extra())  # type: ignore[operator]
    ready = body.pop("ready", True)
    if fe.draining:
        body["status"] = "draining"
    elif not ready:
        body["status"] = "degraded"
    return web.json_response(body, status=200 if body["status"] == "ok" else 503)


async def liveness(request: web.Request) -> web.Response:
    """Liveness: 200 for as long as the process runs and its reactor answers."""
    return web.json_response({"status": "alive"})


async def metrics_endpoint(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (404, 405, 413) into OpenAI-style bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason or "error", err_type="invalid_request_error")
    except Exception:
        logger.exception("unhandled error in {}", request.path)
        return error_response(500, "internal server error", err_type="server_error")


def build_app(
    fe: Frontend,
    metrics: Metrics,
    *,
    model_name: str,
    default_max_tokens: int,
    max_body_bytes: int,
    health_extra: Any = None,
) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[json_errors])
    app[FRONTEND] = fe
    app[METRICS] = metrics
    if health_extra is not None:
        app[HEALTH] = health_extra
    app[SETTINGS] = {
        "model_name": model_name,
        "default_max_tokens": default_max_tokens,
        "created": int(time.time()),
    }
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", liveness)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
