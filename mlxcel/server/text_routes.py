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
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from mlxcel import __version__
from mlxcel.base.errors import RequestError
from mlxcel.server.schemas import messages_problem

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

    def budgeted(answer: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]) -> Any:
        """A POST route whose JSON body is held in the same budget as a completion's (parsing
        and tokenizing cost several times the body: a flood of large bodies cannot take the
        memory); a bad body is a 400 naming its field."""

        async def handler(request: web.Request) -> web.Response:
            raw = await _read_body(request)
            app_ = request.app
            async with app_[BODY_BUDGET].hold(len(raw), app_[SETTINGS]["body_timeout"]):
                try:
                    body = await answer(app_[FRONTEND], _object(_parse_json(raw)))
                except RequestError as exc:
                    code = exc.code or "invalid_value"
                    return error_response(400, str(exc), param=exc.param, code=code)
            return web.json_response(body)

        return handler

    async def tokenize(fe: Any, body: dict[str, Any]) -> dict[str, Any]:
        given = [k for k in ("prompt", "content", "messages") if k in body]
        if len(given) != 1:
            raise RequestError("give one of prompt, content or messages", param="prompt")
        field = given[0]
        if field == "messages":
            messages = body["messages"]
            if problem := messages_problem(messages):
                raise RequestError(problem, param="messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise RequestError("messages: a list of message objects", param="messages")
            ids = await fe.apply_chat_template_async(messages)
        else:
            text = body[field]
            if not isinstance(text, str):
                raise RequestError(f"{field}: a string", param=field)
            special = _flag(body, "add_special_tokens" if field == "prompt" else "add_special")
            # Bounded as a completion's prompt: a text past the context is refused by name
            # at the first chunk that shows it, never tokenized whole.
            ids = await fe.tokenize_async(text, special, field)
        return {"tokens": ids, "count": len(ids), "max_model_len": fe.token_limit}

    async def detokenize(fe: Any, body: dict[str, Any]) -> dict[str, Any]:
        # Checking up to a million ids and decoding them: on a worker, not the reactor.
        text = await asyncio.to_thread(_decode, fe.tokenizer, body.get("tokens"), fe.vocab_size)
        return {"prompt": text, "content": text}

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

    app.router.add_post("/tokenize", budgeted(tokenize))
    app.router.add_post("/detokenize", budgeted(detokenize))
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


def _decode(tokenizer: Any, ids: Any, vocab: int) -> str:
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_TOKENS_IN
        or not all(type(t) is int and 0 <= t < vocab for t in ids)
    ):
        why = f"tokens: a list of at most {MAX_TOKENS_IN} token ids in [0, {vocab})"
        raise RequestError(why, param="tokens")
    return str(tokenizer.decode(ids))
