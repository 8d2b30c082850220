"""What llama-server and vLLM users reach for beside the OpenAI routes: ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, and ``GET /`` for someone who opens the server in a
browser (it sends them to the dashboard, or to the list of routes where there is none).

``/tokenize`` takes vLLM's ``{"prompt": text}`` or llama-server's ``{"content": text}`` (with
``add_special_tokens`` / ``add_special``, default true), or ``{"messages": [...]}`` (the chat
template applied, as a chat completion would), and answers ``{"tokens", "count",
"max_model_len"}``. ``/detokenize`` takes ``{"tokens": [ids]}`` and answers the text under
both names (``prompt`` for vLLM, ``content`` for llama-server). Bad bodies get the OpenAI error
body naming the field; nothing is generated, so no slot is taken.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from mlxcel import __version__
from mlxcel.errors import RequestError

MAX_TOKENS_IN = 1 << 20  # ids one /detokenize may name (a body limit bounds it too)


def add_text_routes(app: web.Application, *, has_dashboard: bool) -> None:
    from mlxcel.server.openai_api import (
        BODY_BUDGET,
        FRONTEND,
        SETTINGS,
        _parse_json,
        _read_body,
        error_response,
    )

    async def tokenize(request: web.Request) -> web.Response:
        raw = await _read_body(request)
        # Parsing and tokenizing cost several times the body: held in the same budget as a
        # completion's, so a flood of large bodies cannot take the memory.
        async with request.app[BODY_BUDGET].hold(len(raw), request.app[SETTINGS]["body_timeout"]):
            return await _tokenize(request, raw)

    async def _tokenize(request: web.Request, raw: bytes) -> web.Response:
        fe = request.app[FRONTEND]
        try:
            body = _object(_parse_json(raw))
            given = [k for k in ("prompt", "content", "messages") if k in body]
            if len(given) != 1:
                raise RequestError("give one of prompt, content or messages", param="prompt")
            field = given[0]
            if field == "messages":
                messages = body["messages"]
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    raise RequestError("messages: a list of message objects", param="messages")
                ids = await asyncio.to_thread(fe.apply_chat_template, messages)
            else:
                text = body[field]
                if not isinstance(text, str):
                    raise RequestError(f"{field}: a string", param=field)
                special = _flag(body, "add_special_tokens" if field == "prompt" else "add_special")
                ids = await asyncio.to_thread(_encode, fe.tokenizer, text, special)
        except RequestError as exc:
            return error_response(400, str(exc), param=exc.param, code=exc.code or "invalid_value")
        return web.json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": fe.token_limit}
        )

    async def detokenize(request: web.Request) -> web.Response:
        raw = await _read_body(request)
        async with request.app[BODY_BUDGET].hold(len(raw), request.app[SETTINGS]["body_timeout"]):
            return await _detokenize(request, raw)

    async def _detokenize(request: web.Request, raw: bytes) -> web.Response:
        fe = request.app[FRONTEND]
        try:
            body = _object(_parse_json(raw))
            ids = body.get("tokens")
            vocab = fe.vocab_size
            if (
                not isinstance(ids, list)
                or len(ids) > MAX_TOKENS_IN
                or not all(type(t) is int and 0 <= t < vocab for t in ids)
            ):
                why = f"tokens: a list of at most {MAX_TOKENS_IN} token ids in [0, {vocab})"
                raise RequestError(why, param="tokens")
            text = await asyncio.to_thread(fe.tokenizer.decode, ids)
        except RequestError as exc:
            return error_response(400, str(exc), param=exc.param, code=exc.code or "invalid_value")
        return web.json_response({"prompt": text, "content": text})

    async def version(request: web.Request) -> web.Response:
        settings = request.app[SETTINGS]
        return web.json_response(
            {"version": __version__, "model": settings["model_name"], "mode": settings["mode"]}
        )

    async def index(_request: web.Request) -> web.Response:
        if has_dashboard:
            raise web.HTTPFound("/dashboard")
        routes = sorted({r.resource.canonical for r in app.router.routes() if r.resource})
        items = "".join(f'<li><a href="{p}">{p}</a></li>' for p in routes if "{" not in p)
        page = f"<!doctype html><title>mlxcel</title><h1>mlxcel {__version__}</h1><ul>{items}</ul>"
        return web.Response(text=page, content_type="text/html", charset="utf-8")

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/", index)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, True)
    if not isinstance(value, bool):
        raise RequestError(f"{name}: true or false", param=name)
    return value


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    from mlxcel.prompts import encode_within

    return encode_within(tokenizer, text, None, special=special)
