"""The request side of a serving node: admission, per-request streams, text and stop strings.

HTTP handlers and the ``generate`` command talk to a :class:`Frontend`. It publishes one
``RunEntry`` per request on the bus and reads the ``RunResult`` (or ``Error``) messages that
come back, whoever produced them -- the local engine today, the final pipeline stage later.
Detokenizing and stop strings live here, on the reactor (cheap per token), because only the
node that owns the request has the text.

Admission: at most ``parallel`` requests run at once; up to ``queue_size`` more wait for a
slot; anything beyond is refused at once with :class:`AdmissionRejected` (HTTP 503).
Every wait has the request's absolute deadline; a request that ends for any reason (finish,
error, deadline, client gone) releases its slot and, if it was still running, cancels its
sequence so no cache outlives it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from loguru import logger

from mlxcel.base import defaults as d
from mlxcel.base.deadlines import deadline_in, until
from mlxcel.base.errors import (
    AdmissionRejected,
    DeadlineExceeded,
    EngineError,
    MlxcelError,
    RequestError,
)
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    RunEntry,
    RunResult,
    SamplingParams,
)
from mlxcel.reactor.bus import Envelope, Node, Origin
from mlxcel.serving.prompts import encode_within, render_chat, special_token_ids
from mlxcel.serving.specs import Generation

SHUTDOWN_MESSAGE = "the server is shutting down: the request was still running when its drain ended"


@dataclass(frozen=True, slots=True)
class Delta:
    """One step of a stream: new text (possibly empty) and, at the end, why it finished."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[float, ...] | None = None
    # Per token of token_ids: its most likely alternatives, (token id, logprob), best first.
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None


def _alternatives(msg: RunResult) -> tuple[tuple[tuple[int, float], ...], ...] | None:
    if not msg.top_ids or msg.top_logprobs is None or not msg.token_ids:
        return None
    k = len(msg.top_ids) // len(msg.token_ids)
    pairs = list(zip(msg.top_ids, msg.top_logprobs, strict=True))
    return tuple(tuple(pairs[i * k : (i + 1) * k]) for i in range(len(msg.token_ids)))


def _per_token(msg: RunResult) -> list[RunResult]:
    """A result of several tokens as one result per token (the finish on the last)."""
    n = len(msg.token_ids)
    k = len(msg.top_ids) // n if msg.top_ids else 0
    return [
        replace(
            msg,
            token_ids=(t,),
            finish_reason=msg.finish_reason if i == n - 1 else None,
            logprobs=msg.logprobs[i : i + 1] if msg.logprobs else msg.logprobs,
            top_ids=msg.top_ids[i * k : (i + 1) * k] if msg.top_ids else msg.top_ids,
            top_logprobs=(
                msg.top_logprobs[i * k : (i + 1) * k] if msg.top_logprobs else msg.top_logprobs
            ),
        )
        for i, t in enumerate(msg.token_ids)
    ]


@dataclass
class Usage:
    """A request's token counts and times. The times are ``time.perf_counter()`` readings,
    not the loop's clock: uvloop's ``loop.time()`` has millisecond steps and is read once per
    loop iteration, which would blur a time to first token of a few milliseconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, how many the prompt cache supplied
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    submitted_at: float = 0.0


async def _to_the_end(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread. A thread cannot be stopped: a caller cancelled meanwhile
    (its client went away) still waits for it to end, so what it holds -- its share of the
    body budget -- is not given back while the work goes on."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        if not work.cancelled():
            work.exception()  # retrieved: nobody waits for its result any more
        raise


class StopStrings:
    """Finds stop strings in streamed text and holds back what might be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


class Frontend:
    def __init__(
        self,
        node: Node,
        tokenizer: object,
        *,
        parallel: int = d.PARALLEL,
        queue_size: int = d.QUEUE_SIZE,
        request_timeout: float = d.REQUEST_TIMEOUT,
        context: int | None = None,
    ) -> None:
        self.node = node
        self.tokenizer = tokenizer
        self.parallel = parallel
        self.queue_size = queue_size
        self.request_timeout = request_timeout
        self._slots = asyncio.Semaphore(parallel)
        self._waiting = 0
        self._streams: dict[str, asyncio.Queue[RunResult | Error]] = {}
        self._ids = itertools.count(1)
        self._nonces = itertools.count(1)
        self.unmatched = 0
        self.in_flight = 0
        self.draining = False
        self.shutting_down = False  # the drain ran out: what still runs is ended
        # Set by the operator (--max-model-len, --chat-template); None: the model's own.
        self.max_model_len: int | None = None
        self.chat_template: str | None = None
        self.context = context  # the model's own (config.json); None: not known here

    @classmethod
    def attached(cls, node: Node, tokenizer: object, gen: Generation, context: int) -> Frontend:
        """A frontend with ``gen``'s admission limits and the model's ``context``, subscribed
        on ``node``: what every mode that serves the API puts in front of its generating
        role."""
        fe = cls(
            node,
            tokenizer,
            parallel=gen.parallel,
            queue_size=gen.queue_size,
            request_timeout=gen.request_timeout,
            context=context,
        )
        fe.attach()
        return fe

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (the engine checks the model's own bound)."""
        inner = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        try:
            return len(inner)
        except TypeError:
            return 1 << 31

    @property
    def waiting(self) -> int:
        return self._waiting

    def attach(self) -> None:
        # Only this node's own generating role (engine or coordinator) answers requests;
        # results that arrived from the network are the coordinator's to check first.
        # A leaf: _route only hands the message to its request's queue, so the bus calls it
        # inside the producer's own call -- the stream's queue is the only one on the way.
        bus = self.node.bus
        for cls, size in ((RunResult, 1024), (Error, 256)):
            bus.subscribe(
                cls,
                self._route,
                maxsize=size,
                name=f"frontend.{cls.__name__}",
                origin=Origin.LOCAL,
                sync=True,
                leaf=True,
            )

    def _route(self, env: Envelope[RunResult | Error]) -> None:
        rid = env.msg.request_id
        q = self._streams.get(rid) if rid is not None else None
        if q is None:
            self.unmatched += 1
            logger.debug("frontend: result for unknown request {}", rid)
            return
        # Bounded by construction (max_tokens + 2 messages per request); never blocks.
        q.put_nowait(env.msg)

    @property
    def token_limit(self) -> int | None:
        """The most tokens a prompt may have: the operator's limit, else the model's."""
        limits = [n for n in (self.max_model_len, self.context) if n is not None]
        return min(limits) if limits else None

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_within(self.tokenizer, prompt, self.token_limit)
        return list(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids; ``variables``: a request's chat_template_kwargs."""
        kwargs: dict[str, Any] = {**(variables or {}), "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            text = render_chat(self.tokenizer, messages, **kwargs)
        except RecursionError:
            raise RequestError("the messages or tools are nested too deeply", "messages") from None
        except (ValueError, TypeError, KeyError, TemplateError) as exc:
            # The template refused the conversation (e.g. roles out of order, or its own
            # raise_exception): the request is at fault, not the server.
            raise RequestError(
                f"the chat template refused the messages: {exc}", "messages"
            ) from None
        return encode_within(
            self.tokenizer, text, self.token_limit, special=False, param="messages"
        )

    # Tokenizing a multi-megabyte prompt takes seconds: the HTTP path does it on a worker
    # thread so the reactor keeps streaming everyone else's tokens meanwhile.
    async def encode_prompt_async(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        return await _to_the_end(self.encode_prompt, prompt)

    async def tokenize_async(self, text: str, special: bool, param: str) -> list[int]:
        """``text``'s ids within a prompt's token limit, as a completion's prompt is encoded
        (``/tokenize``): a text longer than the context stops at the first chunk past it
        (``context_length_exceeded`` naming ``param``), whatever its size."""
        encode = partial(
            encode_within, self.tokenizer, text, self.token_limit, special=special, param=param
        )
        return await _to_the_end(encode)  # type: ignore[no-any-return]

    async def apply_chat_template_async(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        return await _to_the_end(self.apply_chat_template, messages, tools, variables)

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        usage: Usage | None = None,
        deadline: float | None = None,
        skip_special: bool = False,
        cache_ns: str = "",
    ) -> AsyncIterator[Delta]:
        """Generate; yields :class:`Delta`, the last one carrying ``finish_reason``.
        ``skip_special`` leaves special tokens' text out (their ids and logprobs stay);
        ``cache_ns`` is the prompt-cache namespace the request may reuse entries of (and adds
        its own to): its tenant's (:func:`mlxcel.base.prefix_index.cache_namespace`)."""
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        limit = self.token_limit
        if limit is not None and len(prompt_ids) + params.max_tokens > limit:
            whose = "(--max-model-len)" if limit == self.max_model_len else "(the model's)"
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"this server's context of {limit} {whose}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if self.draining:
            raise AdmissionRejected("server is draining and admits no new requests")
        if self._waiting >= self.queue_size and self._slots.locked():
            raise AdmissionRejected(
                f"admission queue full ({self._waiting} waiting, {self.parallel} running)"
            )
        deadline = deadline if deadline is not None else deadline_in(self.request_timeout)
        usage = usage if usage is not None else Usage()
        usage.prompt_tokens = len(prompt_ids)
        usage.submitted_at = time.perf_counter()
        self._waiting += 1
        try:
            async with until(deadline, "waiting for a generation slot"):
                await self._slots.acquire()
        finally:
            self._waiting -= 1
        if self.shutting_down:
            self._slots.release()
            raise EngineError(ErrorCode.SERVER_SHUTTING_DOWN, SHUTDOWN_MESSAGE)
        request_id = f"req-{next(self._ids)}"
        q: asyncio.Queue[RunResult | Error] = asyncio.Queue(params.max_tokens + 2)
        self._streams[request_id] = q
        self.in_flight += 1
        finished = False
        try:
            entry = RunEntry(
                request_id, 0, tuple(prompt_ids), 0, params, next(self._nonces), cache_ns=cache_ns
            )
            await self.node.bus.publish(entry, deadline=deadline)
            detok = self.tokenizer.detokenizer
            hidden = special_token_ids(self.tokenizer) if skip_special else frozenset()
            stops = StopStrings(stop)
            while True:
                async with until(deadline, f"request {request_id}"):
                    msg = await q.get()
                if isinstance(msg, Error):
                    # Ended here at shutdown, the sequence still runs there: cancel it.
                    finished = msg.code != ErrorCode.SERVER_SHUTTING_DOWN
                    if msg.code == ErrorCode.BAD_REQUEST:
                        raise RequestError(msg.message)
                    raise EngineError(msg.code, msg.message)
                now = time.perf_counter()
                if usage.first_token_at is None:
                    usage.first_token_at = now
                    usage.cached_tokens = msg.cached_tokens
                usage.last_token_at = now
                # A stop string may end inside a message of several tokens: then it is read
                # token by token, so the stream ends at the token that completed it.
                several = stops.stops and len(msg.token_ids) > 1
                for part in _per_token(msg) if several else (msg,):
                    usage.completion_tokens += len(part.token_ids)
                    for t in part.token_ids:
                        if t not in hidden:
                            detok.add_token(t)
                    if part.finish_reason is not None:
                        finished = True
                        detok.finalize()
                    text, hit = stops.feed(detok.last_segment)
                    top = _alternatives(part)
                    if hit:
                        yield Delta(text, part.token_ids, "stop", part.logprobs, top)
                        return
                    if part.finish_reason is not None:
                        text += stops.flush()
                        yield Delta(text, part.token_ids, part.finish_reason, part.logprobs, top)
                        return
                    yield Delta(text, part.token_ids, None, part.logprobs, top)
        finally:
            self._streams.pop(request_id, None)
            self.in_flight -= 1
            self._slots.release()
            if not finished:
                await self._cancel(request_id, "client went away or stop string")

    async def drain(self, deadline: float) -> None:
        """Stop admitting; wait (until ``deadline``) for the requests in flight to finish."""
        self.draining = True
        loop = asyncio.get_running_loop()
        while (self.in_flight or self._waiting) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def end_all(self) -> int:
        """The drain ran out: end every request still running (a stream gets a final in-band
        ``server_shutting_down`` error, anything else a 503) and every one still waiting for
        a slot. Returns how many were running."""
        self.draining = self.shutting_down = True
        for rid, q in self._streams.items():
            if q.full():  # a consumer far behind: the error must still get in, last
                q.get_nowait()
            q.put_nowait(Error(ErrorCode.SERVER_SHUTTING_DOWN, SHUTDOWN_MESSAGE, rid))
        return len(self._streams)

    async def _cancel(self, request_id: str, reason: str) -> None:
        if self.node.bus.closed:
            return  # the node is gone, and what it was generating with it
        try:
            await self.node.bus.publish(
                CancelRequest(request_id, reason), deadline=deadline_in(5.0)
            )
        except (DeadlineExceeded, MlxcelError) as exc:
            logger.warning("could not cancel {}: {}", request_id, exc)
