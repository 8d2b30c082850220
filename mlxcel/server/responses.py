"""Response bodies and server-sent event streams of the OpenAI-compatible API."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

from aiohttp import web
from loguru import logger

from mlxcel.base.errors import AdmissionRejected, DeadlineExceeded, EngineError, RequestError
from mlxcel.base.messages import ErrorCode
from mlxcel.server import logprobs as lp
from mlxcel.server.metrics import Metrics
from mlxcel.server.tools import ToolCallText
from mlxcel.serving.frontend import Usage

# The error code a stream ended with after its 200 went out (for the access log).
STREAM_ERROR: Any = web.RequestKey("stream_error", str) if hasattr(web, "RequestKey") else "se"


class Output:
    """What one response needs to shape its body or its chunks."""

    def __init__(
        self,
        kind: str,
        rid: str,
        created: int,
        model: str,
        tokenizer: Any,
        logprobs: bool,
        tool_text: ToolCallText | None,
    ) -> None:
        self.kind, self.rid, self.created, self.model = kind, rid, created, model
        self.tokenizer, self.logprobs, self.tool_text = tokenizer, logprobs, tool_text
        self.sent = bytearray()  # completion bytes so far, for a stream's text_offset
        self.hidden: frozenset[int] = frozenset()  # tokens left out of the text (special)

    def head(self, final: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion" if final else "chat.completion.chunk"
        else:
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def split(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return (text, []) if self.tool_text is None else self.tool_text.feed(text)

    def rest(self) -> str:
        return "" if self.tool_text is None else self.tool_text.finish()

    def chunk_choice(
        self, text: str, calls: list[dict[str, Any]], items: list[lp.Entry], finish: str | None
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or not calls else {}
            if calls:
                delta["tool_calls"] = calls
            logprobs = lp.chat_logprobs(self.tokenizer, items) if self.logprobs and items else None
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        logprobs = None
        if self.logprobs and items:
            logprobs = lp.completion_logprobs(self.tokenizer, items, self.sent, self.hidden)
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}


def usage_body(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class TokenMeter:
    """A request's tokens counted as they reach the HTTP layer (:meth:`Metrics.tokens_out`)."""

    def __init__(self, metrics: Metrics, usage: Usage) -> None:
        self.metrics, self.usage = metrics, usage
        self.counted = 0
        self.at: float | None = None  # when its previous tokens came

    def seen(self) -> None:
        now, n = self.usage.last_token_at, self.usage.completion_tokens - self.counted
        if n <= 0 or now is None:
            return
        self.metrics.tokens_out(n, None if self.at is None else now - self.at)
        self.counted, self.at = self.usage.completion_tokens, now


def account(metrics: Metrics, u: Usage, meter: TokenMeter) -> None:
    """The request ended: its prompt, its time to first token and per output token (its
    generated tokens were counted as they went)."""
    meter.seen()
    metrics.prompt_tokens.inc(u.prompt_tokens)
    metrics.requests_done += 1
    metrics.prompt_total += u.prompt_tokens
    if u.first_token_at is not None:
        metrics.ttft.observe(u.first_token_at - u.submitted_at)
        metrics.recent_ttft.append(u.first_token_at - u.submitted_at)
        if u.last_token_at is not None and u.completion_tokens > 1:
            after = u.last_token_at - u.first_token_at
            metrics.tpot.observe(after / (u.completion_tokens - 1))


def _in_band(exc: Exception) -> tuple[str, str, str]:
    """(type, code, message) of an error event for a failure after the stream began."""
    if isinstance(exc, EngineError):
        return "server_error", exc.code, str(exc)
    if isinstance(exc, DeadlineExceeded):
        return "server_error", ErrorCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, RequestError):
        return "invalid_request_error", exc.code, str(exc)
    if isinstance(exc, AdmissionRejected):
        return "server_busy", ErrorCode.QUEUE_FULL, str(exc)
    logger.opt(exception=exc).error("a stream failed after its first token")
    return "server_error", "internal_error", "internal server error"


async def sse(
    request: web.Request,
    stream: Any,
    out: Output,
    usage: Usage,
    include_usage: bool,
    metrics: Metrics,
    continuous: bool = False,
) -> web.StreamResponse:
    """The stream as server-sent events; ``continuous`` (stream_options'
    continuous_usage_stats): every chunk carries the usage so far."""
    resp: web.StreamResponse | None = None
    made_calls = False
    meter = TokenMeter(metrics, usage)

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**out.head(final=False), "choices": choices}
        if continuous:
            body["usage"] = usage_body(usage)
        elif include_usage:
            body["usage"] = None
        return body

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
                    if out.kind == "chat":
                        first = {"role": "assistant", "content": ""}
                        await send(
                            chunk(
                                [
                                    {
                                        "index": 0,
                                        "delta": first,
                                        "finish_reason": None,
                                        "logprobs": None,
                                    }
                                ]
                            )
                        )
                meter.seen()
                text, calls = out.split(d.text)
                if d.finish_reason is not None:
                    text += out.rest()
                made_calls = made_calls or bool(calls)
                finish = d.finish_reason
                if finish == "stop" and made_calls:
                    finish = "tool_calls"
                items = lp.entries(d)
                if text or calls or finish or (items and out.logprobs):
                    await send(chunk([out.chunk_choice(text, calls, items, finish)]))
    except ConnectionResetError:
        raise  # the client went away: nobody to tell, and not a server failure
    except Exception as exc:
        if resp is None:
            raise  # no status line yet: the handler answers with the right one
        # The status line is gone: whatever failed, the client gets one response -- the failure
        # in-band, as OpenAI's API reports it, then a clean end of the stream.
        err_type, code, message = _in_band(exc)
        request[STREAM_ERROR] = code  # the access log shows what really happened
        await send({"error": {"message": message, "type": err_type, "param": None, "code": code}})
        await resp.write_eof()
        return resp
    if resp is None:  # pragma: no cover - a stream always yields its final delta
        raise RequestError("generation produced nothing")
    account(metrics, usage, meter)
    if include_usage:
        await send({**out.head(final=False), "choices": [], "usage": usage_body(usage)})
    await send("[DONE]")
    await resp.write_eof()
    return resp
