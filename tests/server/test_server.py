"""The real ``python -m mlxcel serve`` process, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import struct
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from mlxcel.base.errors import AdmissionRejected, DeadlineExceeded, EngineError, RequestError
from tests.conftest import ServerProcess

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server(tiny: Path) -> ServerProcess:
    srv = ServerProcess(
        ["-m", str(tiny), "--parallel", "8", "--max-batch-size", "8", "--served-model-name", MODEL]
    )
    yield srv  # type: ignore[misc]
    assert srv.stop() == 0, "".join(srv.lines)
    assert srv.left_behind() == []


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60
    )


def metric(server: ServerProcess, name: str) -> float:
    body = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_models_and_health(client: openai.OpenAI, server: ServerProcess) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = json.loads(urllib.request.urlopen(server.base_url + "/health", timeout=10).read())
    assert health["status"] == "ok"


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Say something"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 20
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=20,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_with_stop_and_seed(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=30, temperature=0
    )
    text = base.choices[0].text
    stop = text[8:11]
    cut = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    a = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=12, temperature=1.0, top_p=0.9, seed=5
    )
    b = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=12, temperature=1.0, top_p=0.9, seed=5
    )
    assert a.choices[0].text == b.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=30, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_eight_concurrent_streams_match_sequential(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    prompts = [f"Prompt number {i} about things" for i in range(8)]
    sequential = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]

    async def run() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        rs = await asyncio.gather(
            *(
                ac.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                for p in prompts
            )
        )
        await ac.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == sequential


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 9},
            "temperature",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"model": MODEL, "messages": []}, "messages"),
        # Counted before any is built: a body of many tiny messages costs no template pass.
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            "stream",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "stop": ["a", "b", "c", "d", "e"],
            },
            "stop",
        ),
        ({"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7},
            None,
        ),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(
    server: ServerProcess, client: openai.OpenAI, body: dict, param: str | None
) -> None:
    req = urllib.request.Request(
        server.base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    err = json.loads(info.value.read())["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    if len(body.get("messages", ())) > 4096:  # by their count, not by what the template made
        assert "at most 4096 messages" in err["message"], err
    ok = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )  # type: ignore[arg-type]
    assert ok.choices[0].message.content is not None


DEEP = b"[" * 50_000 + b"]" * 50_000
LONE_SURROGATE_CHAT = (
    b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
)
LONE_SURROGATE_PROMPT = b'{"model": "tiny-qwen3", "prompt": "\\udfff", "max_tokens": 2}'


@pytest.mark.parametrize(
    ("path", "raw", "says"),
    [
        ("completions", b"{not json", "not valid JSON"),
        ("completions", b"[1, 2]", "JSON object"),
        ("completions", b"\xff\xfe", "not valid JSON"),
        ("completions", b"", "not valid JSON"),
        ("completions", DEEP, "nested too deeply"),
        ("chat/completions", LONE_SURROGATE_CHAT, "lone UTF-16 surrogate"),
        ("completions", LONE_SURROGATE_PROMPT, "lone UTF-16 surrogate"),
        ("completions", b'{"model": "tiny-qwen3", "prompt": "x", "temperature": NaN}', "finite"),
        (
            "completions",
            b'{"model": "tiny-qwen3", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
            "too many digits",
        ),
    ],
)
def test_malformed_bodies_get_400(
    server: ServerProcess, client: openai.OpenAI, path: str, raw: bytes, says: str
) -> None:
    req = urllib.request.Request(f"{server.base_url}/v1/{path}", data=raw)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    err = json.loads(info.value.read())["error"]
    assert says in err["message"] and err["type"] == "invalid_request_error"
    assert "Traceback" not in server.output
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_body_over_the_limit_is_413_and_counted_as_413(server: ServerProcess) -> None:
    raw = b'{"model": "x", "prompt": "' + b"a" * (5 << 20) + b'"}'
    req = urllib.request.Request(f"{server.base_url}/v1/completions", data=raw)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 413
    assert json.loads(info.value.read())["error"]["code"] == "request_too_large"
    text = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    assert 'endpoint="/v1/completions",status="413"' in text
    assert 'endpoint="/v1/completions",status="500"' not in text


def test_openai_client_sees_bad_request_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="nope", prompt="x")
    assert "does not exist" in str(info.value)


def test_client_disconnect_mid_stream_frees_the_sequence(server: ServerProcess) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                server.base_url + "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "long",
                    "max_tokens": 3000,
                    "temperature": 0,
                    "stream": True,
                },
            )
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    break
            assert metric(server, "mlxcel_inflight_sequences") == 1
            resp.close()  # drop the connection mid-stream

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while metric(server, "mlxcel_inflight_sequences") != 0:
        assert time.monotonic() < deadline, "sequence not freed after disconnect"
        time.sleep(0.05)
    assert metric(server, "mlxcel_inflight_requests") == 0
    # A client that leaves is not a server error: counted as 499, never as a 500.
    text = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    assert 'endpoint="/v1/completions",status="499"' in text
    assert 'endpoint="/v1/completions",status="500"' not in text
    log = server.output
    assert "unhandled error" not in log and "Traceback" not in log, log[-3000:]


def test_a_client_that_resets_its_stream_is_a_499_not_an_error(server: ServerProcess) -> None:
    """A client that aborts (RST) mid-stream: the next write fails, which is not a server
    error to log with a traceback or count as a 500."""
    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True})
    for _ in range(3):
        with socket.create_connection((host, int(port)), 5) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                + f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 10
    while metric(server, "mlxcel_inflight_sequences") != 0:
        assert time.monotonic() < deadline, "sequence not freed after the reset"
        time.sleep(0.05)
    text = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    assert 'endpoint="/v1/completions",status="499"' in text
    assert 'endpoint="/v1/completions",status="500"' not in text
    assert "unhandled error" not in server.output, server.output[-3000:]


def test_metrics_count_requests_and_tokens(server: ServerProcess, client: openai.OpenAI) -> None:
    before = metric(server, "mlxcel_generated_tokens_total")
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0)
    assert metric(server, "mlxcel_generated_tokens_total") == before + 5
    assert metric(server, 'mlxcel_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert metric(server, "mlxcel_queue_depth") == 0


def test_full_admission_queue_gets_503_with_retry_after(
    tiny: Path, start_server: type[ServerProcess]
) -> None:
    from mlxcel.runtime.model import load_model

    eos = load_model(tiny).eos_token_ids()
    srv = start_server(
        ["-m", str(tiny), "--parallel", "1", "--queue-size", "0", "--served-model-name", MODEL]
    )

    async def run() -> tuple[int, str | None, int]:
        async with aiohttp.ClientSession() as s:
            # It must outlast the second request: its end-of-sequence tokens are ruled out
            # (sampled at random, one could end it within the first tokens).
            no_eos = {str(t): -100 for t in eos}
            long = await s.post(
                srv.base_url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 3000, "stream": True,
                      "logit_bias": no_eos},
            )  # fmt: skip
            async for line in long.content:
                if line.startswith(b"data: {"):
                    break
            busy = await s.post(
                srv.base_url + "/v1/completions",
                json={"model": MODEL, "prompt": "y", "max_tokens": 2},
            )
            status, retry = busy.status, busy.headers.get("Retry-After")
            body = await busy.json()
            assert body["error"]["code"] == "queue_full"
            long.close()
            await asyncio.sleep(0.3)
            after = await s.post(
                srv.base_url + "/v1/completions",
                json={"model": MODEL, "prompt": "y", "max_tokens": 2},
            )
            return status, retry, after.status

    status, retry, after = asyncio.run(run())
    assert status == 503 and retry == "1" and after == 200


def test_sigterm_exits_cleanly(tiny: Path, start_server: type[ServerProcess]) -> None:
    srv = start_server(["-m", str(tiny)])
    assert srv.stop() == 0
    assert srv.left_behind() == []  # no port still open, no process still running
    assert "Traceback" not in srv.output, srv.output[-2000:]


def _app(frontend: object) -> object:
    """The HTTP API over ``frontend``, as serve builds it (small limits)."""
    from mlxcel.server.metrics import Metrics
    from mlxcel.server.openai_api import build_app

    return build_app(
        frontend,
        Metrics(),
        model_name=MODEL,
        default_max_tokens=4,
        max_body_bytes=1 << 20,  # type: ignore[arg-type]
    )


async def test_prompts_are_tokenized_off_the_reactor(tiny: Path) -> None:
    """A multi-megabyte prompt takes seconds to tokenize; the reactor must not be the one doing it."""
    import threading

    from aiohttp.test_utils import TestClient, TestServer

    from mlxcel.serving.assembly import LocalSpec, assemble

    reactor = threading.get_ident()
    seen: list[tuple[str, int]] = []

    class Recording:
        def __init__(self, inner: object) -> None:
            self._inner = inner

        def encode(self, *a: object, **kw: object) -> object:
            seen.append(("encode", threading.get_ident()))
            return self._inner.encode(*a, **kw)  # type: ignore[attr-defined]

        def apply_chat_template(self, *a: object, **kw: object) -> object:
            seen.append(("chat", threading.get_ident()))
            return self._inner.apply_chat_template(*a, **kw)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self._inner, name)

    async with assemble(LocalSpec(tiny)) as stack:
        stack.frontend.tokenizer = Recording(stack.frontend.tokenizer)
        async with TestClient(TestServer(_app(stack.frontend))) as http:
            for path, body in (
                ("/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 2}),
                (
                    "/v1/chat/completions",
                    {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                    },
                ),
            ):
                r = await http.post(path, json=body)
                assert r.status == 200, await r.text()
    assert {kind for kind, _ in seen} == {"encode", "chat"}
    assert all(thread != reactor for _, thread in seen)


def test_top_k_beyond_the_vocabulary_breaks_nothing(client: openai.OpenAI) -> None:
    """The outside report: top_k=600 on serve, then every unseeded sampled request failed."""
    msgs = [{"role": "user", "content": "x"}]
    big = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, extra_body={"top_k": 600}
    )  # type: ignore[arg-type]
    assert big.choices[0].finish_reason in ("length", "stop")
    for _ in range(3):
        after = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)  # type: ignore[arg-type]
        assert after.choices[0].finish_reason in ("length", "stop")


def test_top_k_beyond_64_bits_is_clamped_before_it_reaches_the_wire() -> None:
    """top_k = 2**64 once failed the cluster codec: a tensor-parallel group died of it."""
    from mlxcel.base.messages import EXTENDED_SAMPLING, RunEntry
    from mlxcel.server.params import sampling_params
    from mlxcel.server.schemas import CompletionRequest
    from mlxcel.wire.codec import decode, encode

    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "top_k": 2**64})
    p = sampling_params(
        req, default_max=16, vocab=512, supported=EXTENDED_SAMPLING, mode="one process"
    )
    entry = RunEntry("r", 0, (1, 2), 0, p, 1)
    assert decode(encode(entry)) == entry and p.top_k == 2**31 - 1


async def test_drain_keeps_its_deadline_with_a_request_in_flight() -> None:
    """A request that never finishes (its engine is gone) cannot hold a drain past its
    deadline: drain returns then, with the request still counted in flight, and new requests
    are refused meanwhile."""
    from contextlib import aclosing

    from mlxcel.base.errors import AdmissionRejected
    from mlxcel.base.messages import SamplingParams
    from mlxcel.reactor.bus import Node
    from mlxcel.serving.frontend import Frontend

    class Tok:
        detokenizer = None

    async with Node("drain") as node:
        fe = Frontend(node, Tok(), parallel=2, request_timeout=60.0)
        fe.attach()

        async def stuck() -> None:
            async with aclosing(fe.stream([1, 2, 3], SamplingParams(max_tokens=4))) as it:
                async for _ in it:
                    pass

        task = asyncio.create_task(stuck())
        while fe.in_flight == 0:
            await asyncio.sleep(0.005)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.3
        await asyncio.wait_for(fe.drain(deadline), timeout=10.0)
        assert loop.time() >= deadline and fe.in_flight == 1 and fe.draining
        with pytest.raises(AdmissionRejected):
            async with aclosing(fe.stream([1], SamplingParams(max_tokens=1))) as it:
                async for _ in it:
                    pass
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert fe.in_flight == 0


@pytest.mark.parametrize(
    "failure",
    [
        EngineError("stage_failed", "a stage failed"),
        DeadlineExceeded("the request's deadline passed"),
        RequestError("hidden states claim 0 tokens", code="bad_request"),
        AdmissionRejected("no room"),
        RuntimeError("a bug"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_failure_after_the_first_token_is_one_in_band_error_event(
    tiny: Path, failure: Exception
) -> None:
    """Once the status line is out, any failure is an SSE error event and a clean end of the
    stream -- never a second HTTP response written into the first one's body."""
    from contextlib import aclosing

    from aiohttp.test_utils import TestClient, TestServer

    from mlxcel.serving.assembly import LocalSpec, assemble

    async with assemble(LocalSpec(tiny)) as stack:
        real = stack.frontend.stream

        def failing(*a: object, **kw: object) -> object:
            async def gen():  # type: ignore[no-untyped-def]
                async with aclosing(real(*a, **kw)) as it:
                    async for d in it:
                        yield d
                        raise failure

            return gen()

        stack.frontend.stream = failing  # type: ignore[method-assign]
        async with TestClient(TestServer(_app(stack.frontend))) as http:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": True}
            r = await http.post("/v1/completions", json=body)
            assert r.status == 200
            text = await r.text()  # the chunked body ends cleanly: no truncation, no hang
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert "HTTP/1.1" not in text and "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    code = getattr(failure, "code", None)
    want = {EngineError: code, RequestError: code, DeadlineExceeded: "deadline_exceeded",
            AdmissionRejected: "queue_full", RuntimeError: "internal_error"}[type(failure)]  # fmt: skip
    assert error["code"] == want and error["message"]
    assert all("choices" in json.loads(e) for e in events[:-1])  # tokens, then the error


def test_bodies_trickled_slowly_hold_no_share_of_the_body_budget(server: ServerProcess) -> None:
    """Nine clients announce bodies of the maximum size and trickle them: the budget is taken
    only once a body has arrived, so a small request is served at once meanwhile."""
    host, port = server.base_url.removeprefix("http://").split(":")
    slow = []
    try:
        for _ in range(9):
            s = socket.create_connection((host, int(port)), 5)
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {4 << 20}\r\n\r\n".encode()
                + b'{"model": "'
            )
            slow.append(s)
        time.sleep(0.3)
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(
            server.base_url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=20) as r:
            assert r.status == 200
        assert time.monotonic() - t0 < 10  # not the 30 s of a body deadline
    finally:
        for s in slow:
            s.close()


async def test_a_write_to_a_client_that_left_is_a_499_not_an_unhandled_error(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client is gone between two writes of a stream (aiohttp raises a
    ConnectionResetError from the write): counted as 499, no ERROR line, no traceback. It was
    logged as "unhandled error" and counted as a 500."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from loguru import logger
    from prometheus_client import generate_latest

    from mlxcel.server.metrics import Metrics
    from mlxcel.server.openai_api import build_app
    from mlxcel.serving.assembly import LocalSpec, assemble

    writes = [0]
    real = web.StreamResponse.write

    async def leaving(self: web.StreamResponse, data: bytes) -> None:
        writes[0] += 1
        if writes[0] > 1:  # the first chunk went out; then the client reset the connection
            raise ConnectionResetError("Cannot write to closing transport")
        await real(self, data)

    errors: list[str] = []
    sink = logger.add(lambda m: errors.append(str(m)), level="ERROR")
    monkeypatch.setattr(web.StreamResponse, "write", leaving)
    metrics = Metrics()
    try:
        async with assemble(LocalSpec(tiny)) as stack:
            app = build_app(stack.frontend, metrics, model_name=MODEL, default_max_tokens=8,
                            max_body_bytes=1 << 20)  # fmt: skip
            async with TestClient(TestServer(app)) as http:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}
                r = await http.post("/v1/completions", json=body)
                with contextlib.suppress(aiohttp.ClientError):  # not a timeout: it hung
                    await asyncio.wait_for(r.read(), 20)
    finally:
        logger.remove(sink)
    text = generate_latest(metrics.registry).decode()
    assert 'endpoint="/v1/completions",status="499"} 1.0' in text
    assert 'status="500"' not in text
    assert errors == []
