"""OpenAI-compatible HTTP API on aiohttp.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (plain JSON or SSE streaming),
``GET /v1/models``, ``GET /health`` and ``GET /metrics``. Handlers only translate: a request
becomes a :class:`~mlxcel.serving.frontend.Frontend` stream; every refusal is a typed error mapped to
an OpenAI-style body. A client that disconnects cancels its handler (aiohttp's
``handler_cancellation``), which closes the stream, which cancels the sequence and frees its
cache.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web
from loguru import logger
from pydantic import BaseModel, ValidationError

from mlxcel.base.error_codes import http_status
from mlxcel.base.errors import AdmissionRejected, DeadlineExceeded, EngineError, RequestError
from mlxcel.base.messages import EXTENDED_SAMPLING, ErrorCode, SamplingParams
from mlxcel.base.prefix_index import cache_namespace
from mlxcel.server import logprobs as lp
from mlxcel.server.access import TENANT, Cors, api_key_middleware
from mlxcel.server.access_log import USAGE, access_log
from mlxcel.server.body_budget import BODIES_IN_FLIGHT, BodyBudget
from mlxcel.server.metrics import Metrics
from mlxcel.server.params import (
    fit_default,
    refuse_unimplemented,
    requested_max_tokens,
    sampling_params,
    structured_grammar,
    template_tools,
)
from mlxcel.server.responses import Output, TokenMeter, account, sse, usage_body
from mlxcel.server.schemas import ChatCompletionRequest, CompletionRequest, messages_problem
from mlxcel.server.tools import tool_text_for
from mlxcel.serving.frontend import Frontend, Usage
from mlxcel.serving.grammar import check_grammar
from mlxcel.serving.prompts import special_token_ids

FRONTEND = web.AppKey("frontend", Frontend)
METRICS = web.AppKey("metrics", Metrics)
SETTINGS = web.AppKey("settings", dict)
BODY_BUDGET = web.AppKey("body_budget", BodyBudget)
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


# pydantic names the branch of a union it tried in an error's location: not a parameter.
_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_error(exc: ValidationError) -> RequestError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if str(p) not in _BRANCHES and "[" not in str(p)]
    param = ".".join(loc) or None
    if err["type"] == "unsupported_parameter":
        return RequestError(f"{param}: {err['msg']}", param=param, code="unsupported_parameter")
    if err["type"] == "extra_forbidden":
        return RequestError(
            f"{param}: this server does not recognize this parameter",
            param=param,
            code="unsupported_parameter",
        )
    msg = str(err["msg"]).removeprefix("Value error, ")
    return RequestError(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


async def _read_body(request: web.Request) -> bytes:
    wait = request.app[SETTINGS]["body_timeout"]
    try:
        async with asyncio.timeout(wait):  # a trickled body cannot hold a slot forever
            return await request.read()  # aiohttp enforces client_max_size (413)
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            reason=f"the request body did not arrive within {wait:g}s"
        ) from None


def _parse_json(raw: bytes) -> Any:
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


MAX_DEPTH = 64  # JSON nesting: a chat template renders tool schemas recursively


def _no_lone_surrogates(value: Any) -> None:
    """JSON may escape half of a UTF-16 pair (``"\\ud800"``); no tokenizer can encode that.
    Also bounds the nesting, which recursive consumers (templates, schemas) cannot take."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(
                    "request body contains a lone UTF-16 surrogate (invalid Unicode text)"
                ) from None
        elif isinstance(v, dict):
            stack.extend((k, depth + 1) for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def _model_check(app: web.Application, name: str) -> None:
    served = app[SETTINGS]["model_name"]
    if name != served:
        raise RequestError(
            f"model {name!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


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
        return error_response(400, str(exc), param=exc.param, code=exc.code)
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
        status, err_type, headers = http_status(exc.code)
        return error_response(status, str(exc), err_type=err_type, code=exc.code, headers=headers)
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away: not a server error (nginx's code for it)
        raise
    except web.HTTPException as exc:  # aiohttp's own (a body over the limit: 413); answered by
        status = exc.status  # json_errors, and counted as what the client gets
        raise
    finally:
        metrics.requests.labels(endpoint, str(status)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    fe = app[FRONTEND]
    settings = app[SETTINGS]
    raw = await _read_body(request)
    # Parsing, templating and tokenizing cost several times the body: that is held in the
    # budget, from the body read (a client trickling its body holds none) to token ids.
    async with app[BODY_BUDGET].hold(len(raw), settings["body_timeout"]):
        req, params, tools, prompt_ids = await _prompt(request, kind, raw)
    if requested_max_tokens(req) is None:
        params = fit_default(params, len(prompt_ids), fe.token_limit)
    out = Output(
        kind,
        ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
        int(time.time()),
        req.model,
        fe.tokenizer,
        params.logprobs,
        tool_text_for(fe.tokenizer, tools),
    )
    if req.skip_special_tokens:
        out.hidden = special_token_ids(fe.tokenizer)
    if params.logprobs:
        await asyncio.to_thread(lp.prepare, fe.tokenizer)  # once per tokenizer, then cached
    usage = Usage()
    request[USAGE] = usage
    namespace = cache_namespace(request.get(TENANT, ""), req.cache_salt)
    stream = fe.stream(
        prompt_ids,
        params,
        req.stop_list(),
        usage,
        skip_special=req.skip_special_tokens,
        cache_ns=namespace,
    )
    if req.stream:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        return await sse(request, stream, out, usage, include_usage, app[METRICS], continuous)
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    lps: list[lp.Entry] = []
    finish = None
    meter = TokenMeter(app[METRICS], usage)
    async with aclosing(stream) as it:
        async for d in it:
            meter.seen()
            shown, new_calls = out.split(d.text)
            text.append(shown)
            calls.extend(new_calls)
            lps.extend(lp.entries(d))
            finish = d.finish_reason
    text.append(out.rest())
    account(app[METRICS], usage, meter)
    content = "".join(text)
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
            "logprobs": lp.chat_logprobs(fe.tokenizer, lps) if params.logprobs else None,
        }
    else:
        choice = {
            "index": 0,
            "text": content,
            "finish_reason": finish,
            "logprobs": (
                lp.completion_logprobs(fe.tokenizer, lps, hidden=out.hidden)
                if params.logprobs
                else None
            ),
        }
    return web.json_response(
        {**out.head(final=True), "choices": [choice], "usage": usage_body(usage)}
    )


async def _prompt(
    request: web.Request, kind: str, raw: bytes
) -> tuple[ChatCompletionRequest | CompletionRequest, SamplingParams, Any, list[int]]:
    """The request's body ``raw``, validated, as (request, sampling, tools, prompt ids)."""
    app = request.app
    fe = app[FRONTEND]
    settings = app[SETTINGS]
    body = _parse_json(raw)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    schema: type[BaseModel] = ChatCompletionRequest if kind == "chat" else CompletionRequest
    if kind == "chat" and (problem := messages_problem(body.get("messages"))):
        raise RequestError(problem, param="messages")  # counted before any is validated
    try:
        req = schema.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    assert isinstance(req, ChatCompletionRequest | CompletionRequest)
    _model_check(app, req.model)
    refuse_unimplemented(req)
    params = sampling_params(
        req,
        default_max=settings["default_max_tokens"],
        defaults=settings["sampling_defaults"],
        vocab=fe.vocab_size,
        supported=settings["sampling"],
        mode=settings["mode"],
        grammar=structured_grammar(req),
    )
    if params.grammar:  # compiled against the tokenizer, off the reactor (a schema may be big)
        problem = await asyncio.to_thread(check_grammar, params.grammar, fe.tokenizer)
        if problem is not None:
            raise RequestError(
                f"response_format: the JSON schema does not compile: {problem}",
                param="response_format",
                code="invalid_value",
            )
    tools = None
    if isinstance(req, ChatCompletionRequest):
        tools = template_tools(req, bool(getattr(fe.tokenizer, "has_tool_calling", False)))
        try:
            messages = [m.for_template() for m in req.messages]
        except ValueError as exc:
            raise RequestError(str(exc), param="messages", code="invalid_value") from None
        prompt_ids = await fe.apply_chat_template_async(messages, tools, req.chat_template_kwargs)
    else:
        prompt_ids = await fe.encode_prompt_async(req.prompt)
    return req, params, tools, prompt_ids


def _model_card(app: web.Application) -> dict[str, Any]:
    return {
        "id": app[SETTINGS]["model_name"],
        "object": "model",
        "created": app[SETTINGS]["created"],
        "owned_by": "mlxcel",
    }


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app)]})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the client's ``models.retrieve``); ids may contain '/'."""
    card = _model_card(request.app)
    wanted = request.match_info["model_id"]
    if wanted != card["id"]:
        return error_response(
            404,
            f"model {wanted!r} does not exist; this server serves {card['id']!r}",
            param="model",
            code="model_not_found",
        )
    return web.json_response(card)


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
    metrics = request.app[METRICS]
    if metrics.refresh is not None:
        try:
            await metrics.refresh()  # the per-node gauges read the cluster view as it is now
        except Exception as exc:  # the last view stands; the scrape still answers
            logger.warning("metrics: cluster view not refreshed: {}", exc)
    body = metrics.render()
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
        code = {
            404: "not_found",
            405: "method_not_allowed",
            408: "body_timeout",
            413: "request_too_large",
        }
        return error_response(
            exc.status,
            exc.reason or "error",
            err_type="invalid_request_error",
            code=code.get(exc.status, f"http_{exc.status}"),
        )
    except ConnectionResetError:
        raise  # the client went away mid-answer: aiohttp drops the connection quietly
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
    sampling: frozenset[str] = EXTENDED_SAMPLING,
    mode: str = "one process",
    guard: Any = None,
    body_timeout: float = 30.0,
    api_keys: tuple[str, ...] = (),
    shared_prompt_cache: bool = False,
    allowed_origins: tuple[str, ...] = (),
    sampling_defaults: dict[str, float] | None = None,
) -> web.Application:
    # The guard first: a request whose headers arrived is busy, not slow (http_guard). Then
    # the access log (it sees 401s and 403s too), CORS (a 401 carries its headers), the key.
    middlewares = [guard.middleware] if guard is not None else []
    middlewares.append(access_log)
    cors = Cors(allowed_origins) if allowed_origins else None
    if cors is not None:
        middlewares.append(cors.middleware)
    if api_keys:
        middlewares.append(api_key_middleware(api_keys, shared_prompt_cache))
    app = web.Application(client_max_size=max_body_bytes, middlewares=[*middlewares, json_errors])
    if cors is not None:
        app.on_response_prepare.append(cors.on_prepare)
    app[FRONTEND] = fe
    app[METRICS] = metrics
    if health_extra is not None:
        app[HEALTH] = health_extra
    app[SETTINGS] = {
        "model_name": model_name,
        "default_max_tokens": default_max_tokens,
        "created": int(time.time()),
        "sampling": sampling,
        "mode": mode,
        "body_timeout": body_timeout,
        "max_body_bytes": max_body_bytes,
        "sampling_defaults": dict(sampling_defaults or {}),
    }
    app[BODY_BUDGET] = BodyBudget(BODIES_IN_FLIGHT * max_body_bytes)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", liveness)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
