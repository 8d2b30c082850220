"""What users of other inference servers reach for, against a real server process and the
official ``openai`` client: an API key, CORS, a context cap and a chat template of one's own;
and options that are wrong fail at start in one line, before the model loads."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import ROOT, ServerProcess, error_line

KEY = "sk-test-0123456789abcdef"
ORIGIN = "https://app.example"
# Renders only the contents: a conversation of "hello" is the tokens of "hello" and nothing else.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tpl = tmp_path_factory.mktemp("tpl") / "plain.jinja"
    tpl.write_text(TEMPLATE)
    srv = ServerProcess(
        [
            "-m",
            str(tiny),
            "--served-model-name",
            "tiny",
            "--allowed-origins",
            ORIGIN,
            "--max-model-len",
            "64",
            "--chat-template",
            str(tpl),
        ],  # fmt: skip
        env={"MLXCEL_API_KEY": KEY},  # from the environment: not in the process list
    )
    yield srv
    srv.stop()


def raw(srv: ServerProcess, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.base_url + path, data, method=method, headers=headers)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def client(srv: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_the_api_key_is_required_everywhere_but_liveness(server: ServerProcess) -> None:
    r = client(server).completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert r.usage is not None and r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError) as exc:
        client(server, "sk-wrong").completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    for path in ("/v1/models", "/health", "/metrics"):
        status, headers, body = raw(server, "GET", path)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", path
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, _ = raw(server, "GET", "/v1/models", Authorization="Basic " + KEY)
    assert status == 401  # only Bearer
    assert raw(server, "GET", "/health/live")[0] == 200
    assert raw(server, "GET", "/health", Authorization=f"Bearer {KEY}")[0] == 200
    assert KEY not in server.output  # never logged
    assert "/v1/models 401 invalid_api_key" in server.output  # refusals are in the access log
    assert "GET /health 401 invalid_api_key" in server.output  # a probe's too: guessing is seen


def test_cors_allows_the_given_origin_only_and_preflights_need_no_key(
    server: ServerProcess,
) -> None:
    # What the openai JS client asks to send: its x-stainless-* headers too.
    asked = "authorization, content-type, x-stainless-lang, x-stainless-retry-count"
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": asked}  # fmt: skip
    status, headers, _ = raw(server, "OPTIONS", "/v1/chat/completions", **pre)
    assert status == 204
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == asked.replace(", ", ", ")
    assert "Origin" in headers["Vary"]
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    status, headers, _ = raw(server, "OPTIONS", "/v1/chat/completions",
                             **{**pre, "Origin": "https://evil.example"})  # fmt: skip
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    status, headers, text = raw(server, "POST", "/v1/completions", body, Origin=ORIGIN, **auth)
    assert status == 200 and text.endswith(b"data: [DONE]\n\n")
    assert headers["Access-Control-Allow-Origin"] == ORIGIN and "Origin" in headers["Vary"]
    status, headers, _ = raw(server, "GET", "/v1/models", Origin="https://evil.example", **auth)
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    assert "Origin" in headers["Vary"]  # the answer depends on the Origin: caches are told
    # A refusal carries the header too, so the page can read why.
    status, headers, _ = raw(server, "GET", "/v1/models", Origin=ORIGIN)
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN


def test_max_model_len_caps_prompt_plus_max_tokens(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(server).completions.create(model="tiny", prompt="hi", max_tokens=64)
    assert exc.value.code == "context_length_exceeded"
    assert "exceeds this server's context of 64 (--max-model-len)" in str(exc.value)
    r = client(server).completions.create(model="tiny", prompt="hi", max_tokens=8)
    assert r.choices[0].finish_reason in ("length", "stop")
    # No max_tokens: the default (256) would not fit, so the rest of the context is used.
    r = client(server).completions.create(model="tiny", prompt="hi", temperature=0)
    total = r.usage.prompt_tokens + r.usage.completion_tokens
    assert total == 64 if r.choices[0].finish_reason == "length" else total < 64


def test_the_chat_template_file_is_used_instead_of_the_tokenizers(
    server: ServerProcess, tiny: Path
) -> None:
    from mlx_lm import load

    _, tok = load(str(tiny))
    r = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tok.encode("hello", add_special_tokens=False))
    # the tokenizer's own ChatML template would have wrapped it in several more tokens
    assert len(tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                       add_generation_prompt=True)) > r.usage.prompt_tokens  # fmt: skip


def serve_fails(tiny: Path, *args: str) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny), *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    return r.returncode, r.stderr


def test_bad_options_fail_at_start_in_one_line_before_the_model_loads(
    tiny: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    code, err = serve_fails(tiny, "--chat-template", str(bad))
    assert code == 2 and "--chat-template" in error_line(err) and "line 1" in error_line(err)
    code, err = serve_fails(tiny, "--chat-template", str(tmp_path / "absent.jinja"))
    assert code == 2 and "cannot read" in error_line(err)
    code, err = serve_fails(tiny, "--allowed-origins", "app.example")
    assert code == 2 and "is not an origin" in error_line(err)
    code, err = serve_fails(tiny, "--max-model-len", "99999")
    assert code == 2 and "exceeds the model's context of 4096" in error_line(err)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = serve_fails(tiny, "--port", str(port))
    assert code == 1 and f"cannot serve HTTP on 127.0.0.1:{port}" in error_line(err)
    assert "loaded model" not in err  # found before the model loaded


def test_status_takes_its_url_wherever_it_is_typed() -> None:
    from mlxcel.cli.main import _status_url

    assert _status_url(["status", "http://h:1"]) == ["status", "--url", "http://h:1"]
    assert _status_url(["status", "--watch", "http://h:1"]) == [
        "status", "--watch", "--url", "http://h:1"
    ]  # fmt: skip
    assert _status_url(["status", "--interval", "5", "--watch"]) == [
        "status", "--interval", "5", "--watch"
    ]  # fmt: skip
    assert _status_url(["serve", "x"]) == ["serve", "x"]


def test_status_understands_host_port_and_refuses_other_schemes() -> None:
    from pydantic import ValidationError

    from mlxcel.config.tools import StatusSettings

    assert StatusSettings(url="127.0.0.1:8080").url == "http://127.0.0.1:8080"
    assert StatusSettings(url="https://h:1").url == "https://h:1"
    with pytest.raises(ValidationError, match="give http://HOST:PORT, https://HOST:PORT or HOST"):
        StatusSettings(url="ftp://h:1")


def test_tokenize_detokenize_version_and_the_root_as_llama_server_and_vllm_have_them(
    server: ServerProcess, tiny: Path
) -> None:
    import http.client

    from mlxcel.serving.tokenizer import load_tokenizer

    tok, _ = load_tokenizer(tiny)
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: Any) -> tuple[int, Any]:
        status, _, data = raw(server, "POST", path, body, **auth)
        return status, json.loads(data)

    status, got = post("/tokenize", {"prompt": "hello world"})
    assert status == 200 and got["tokens"] == tok.encode("hello world")
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 64
    plain = tok.encode("hello world", add_special_tokens=False)
    assert post("/tokenize", {"content": "hello world", "add_special": False})[1]["tokens"] == plain
    # The chat template applies, as for a chat completion (this one joins the contents).
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "hello world"}]})[1]
    assert chat["tokens"] == plain
    status, text = post("/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and text["prompt"] == text["content"] == tok.decode(got["tokens"])
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "content": "b"}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
        ("/tokenize", [1, 2], None),
        # Bounded as a completion's prompt is: past the context, refused by name.
        ("/tokenize", {"prompt": "many words " * 8000}, "prompt"),
        ("/tokenize", {"content": "many words " * 8000}, "content"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "many words " * 8000}]},
            "messages",
        ),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [1, 1 << 40]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ]:
        status, err = post(path, body)
        assert status == 400 and err["error"]["param"] == param, (path, body, err)
        if "many words " in json.dumps(body):
            assert err["error"]["code"] == "context_length_exceeded", err
        if isinstance(body, dict) and len(body.get("messages", ())) > 4096:
            assert "at most 4096 messages" in err["error"]["message"], err
    # The key is asked for, as on every data route.
    assert raw(server, "POST", "/tokenize", {"prompt": "x"})[0] == 401
    status, _, data = raw(server, "GET", "/version", **auth)
    assert status == 200 and json.loads(data)["version"] and json.loads(data)["model"] == "tiny"
    # A browser opening the server lands on the dashboard (no key needed for the redirect).
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/")
    r = conn.getresponse()
    assert (r.status, r.getheader("Location")) == (302, "/dashboard")
    conn.close()


def test_serve_samples_a_request_that_gives_none_as_its_flags_say(
    tiny: Path, start_server: Any
) -> None:
    """mlx_lm.server's --temp, --top-p, --min-p and --max-tokens: what a request that gives
    none of them gets; a request's own values still win."""
    srv = start_server(["-m", str(tiny), "--temp", "0", "--max-tokens", "5", "--min-p", "0.1"])
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    bare = [c.completions.create(model=tiny.name, prompt="Hello there") for _ in range(2)]
    assert bare[0].choices[0].text == bare[1].choices[0].text  # greedy: the same twice
    assert bare[0].usage is not None and bare[0].usage.completion_tokens == 5
    greedy = c.completions.create(
        model=tiny.name, prompt="Hello there", temperature=0, max_tokens=9
    )
    assert greedy.choices[0].text.startswith(bare[0].choices[0].text)
    assert greedy.usage is not None and greedy.usage.completion_tokens == 9


def test_the_sampling_defaults_stand_in_only_for_what_a_request_leaves_out() -> None:
    from mlxcel.base.messages import EXTENDED_SAMPLING
    from mlxcel.server.params import sampling_params
    from mlxcel.server.schemas import CompletionRequest

    def params(body: dict[str, Any], defaults: dict[str, float] | None) -> tuple[float, ...]:
        req = CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
        p = sampling_params(req, default_max=7, vocab=100, supported=EXTENDED_SAMPLING,
                            mode="one process", defaults=defaults)  # fmt: skip
        return p.temperature, p.top_p, p.min_p, p.max_tokens

    assert params({}, None) == (1.0, 1.0, 0.0, 7)  # OpenAI's
    given = {"temperature": 0.0, "top_p": 0.9, "min_p": 0.05}
    assert params({}, given) == (0.0, 0.9, 0.05, 7)
    assert params({"temperature": 0.7, "top_p": 1, "min_p": 0}, given) == (0.7, 1.0, 0.0, 7)


def test_chat_template_variables_and_usage_in_every_chunk(
    tiny: Path, start_server: Any, tmp_path: Path
) -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, for one) reach the template;
    stream_options.continuous_usage_stats puts the usage so far in every chunk."""
    tpl = tmp_path / "thinking.jinja"
    tpl.write_text(  # (mlx-lm's tokenizer itself sets enable_thinking: a variable of our own)
        "{% if persona is defined %}You are {{ persona }}. {% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    srv = start_server(["-m", str(tiny), "--chat-template", str(tpl)])
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]

    def prompt_tokens(**extra: Any) -> int:
        r = c.chat.completions.create(model=tiny.name, messages=msgs, max_tokens=1, **extra)  # type: ignore[arg-type]
        assert r.usage is not None
        return r.usage.prompt_tokens

    plain = prompt_tokens()
    pirate = prompt_tokens(extra_body={"chat_template_kwargs": {"persona": "a pirate"}})
    assert pirate > plain  # the template saw the variable
    assert prompt_tokens(extra_body={"chat_template_kwargs": {}}) == plain
    with pytest.raises(openai.BadRequestError) as bad:
        prompt_tokens(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    chunks = list(
        c.chat.completions.create(
            model=tiny.name, messages=msgs, max_tokens=4, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )  # fmt: skip
    counts = [ch.usage.completion_tokens for ch in chunks if ch.usage is not None]
    assert len(counts) == len(chunks)  # every chunk, the role chunk and the last included
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.prompt_tokens == plain  # type: ignore[union-attr]


async def test_the_openai_routes_mount_in_a_services_own_aiohttp_application(tiny: Path) -> None:
    """docs/embedding.md's recipe: the stack's HTTP API as a sub-application of one's own
    aiohttp app, on one's own site; the official client talks to it under the prefix."""
    import asyncio

    from aiohttp import web

    from mlxcel.serving.assembly import Generation, LocalSpec, assemble
    from mlxcel.serving.runner import HttpOptions, openai_app
    from tests.conftest import free_port

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="my service")

    async with assemble(LocalSpec(tiny), Generation()) as stack:
        app = web.Application()
        app.router.add_get("/hello", hello)
        app.add_subapp("/llm", openai_app(stack, HttpOptions(model_name="tiny")))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/llm/v1", api_key="x", max_retries=0
            )
            r = await client.completions.create(model="tiny", prompt="hi", max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens == 3
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/hello").read()
            )
            assert body == b"my service"
        finally:
            await runner.cleanup()


def test_figures_move_while_a_stream_runs_and_name_nodes_by_id(
    tiny: Path, start_server: Any
) -> None:
    """Tokens are counted as they are sent (the dashboard's tok/s moves during a long stream);
    /metrics has time per output token and inter-token latency, no `_created` series, and a
    one-process node labelled by its host, as a cluster's nodes are by their ids."""
    import socket
    import threading

    srv = start_server(["-m", str(tiny), "--stream-interval", "1"])
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    done = threading.Event()

    def long_stream() -> None:
        for _ in c.completions.create(model=tiny.name, prompt="go", max_tokens=3000,
                                      temperature=0, stream=True):  # fmt: skip
            pass
        done.set()

    threading.Thread(target=long_stream, daemon=True).start()

    def counted() -> int:
        with urllib.request.urlopen(srv.base_url + "/cluster", timeout=10) as r:
            return int(json.loads(r.read())["totals"]["generated_tokens"])

    deadline = time.monotonic() + 60
    while counted() == 0:
        assert time.monotonic() < deadline and not done.is_set(), "no tokens counted mid-stream"
        time.sleep(0.05)
    assert not done.is_set()  # counted while the stream still ran
    assert done.wait(120)
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "mlxcel_generated_tokens_total 3000.0" in metrics
    assert "mlxcel_time_per_output_token_seconds_count 1.0" in metrics
    assert "mlxcel_inter_token_latency_seconds_count 2999.0" in metrics
    assert "_created" not in metrics
    host = socket.gethostname()
    assert f'mlxcel_node_up{{node="{host}",role="engine"}} 1.0' in metrics


def test_tokens_handed_over_together_count_their_wait_once() -> None:
    from mlxcel.server.metrics import Metrics

    m = Metrics()
    m.tokens_out(3, None)  # a stream's first three, in one burst: two gaps of 0
    m.tokens_out(2, 0.05)  # the next two, 50 ms later: 0.05 and 0
    text = m.render().decode()
    assert "mlxcel_generated_tokens_total 5.0" in text
    assert "mlxcel_inter_token_latency_seconds_count 4.0" in text
    assert "mlxcel_inter_token_latency_seconds_sum 0.05" in text
