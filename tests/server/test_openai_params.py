"""Every OpenAI parameter through the official client: it does what its definition says, or
it gets a 400 that names it. Most checks run on a checkpoint rigged so greedy output is known
(tests/rigged.py); the real runtime, the real server, the real client."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mlxcel.runtime.checkpoint import SPECIAL_TOKENS
from tests.conftest import ServerProcess
from tests.rigged import CALL, Rigged, write_rigged

MODEL = "rigged"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Rigged:
    return write_rigged(tmp_path_factory.mktemp("rigged") / "rigged")


@pytest.fixture(scope="module")
def server(rig: Rigged) -> Iterator[ServerProcess]:
    srv = ServerProcess(["-m", str(rig.path), "--served-model-name", MODEL])
    yield srv
    assert srv.stop() == 0, srv.output[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", ASK)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, **kw)


def streamed_chat(client: openai.OpenAI, **kw: Any) -> tuple[str, list[Any], str | None, list[Any]]:
    """(content, tool call deltas, finish reason, logprob entries) of a streamed chat."""
    text, calls, finish, lps = "", [], None, []
    for ch in chat(client, stream=True, **kw):
        if not ch.choices:
            continue
        c = ch.choices[0]
        text += c.delta.content or ""
        calls += c.delta.tool_calls or []
        finish = c.finish_reason or finish
        if c.logprobs is not None:
            lps += c.logprobs.content or []
    return text, calls, finish, lps


# --- tool calls ---------------------------------------------------------------------------


def test_a_tool_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    r = chat(client, tools=TOOLS, max_tokens=10)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call_arrives_as_one_delta(client: openai.OpenAI) -> None:
    text, calls, finish, _ = streamed_chat(client, tools=TOOLS, max_tokens=10)
    assert finish == "tool_calls"
    assert "<tool_call>" not in text and CALL not in text
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_without_tools_the_same_text_is_plain_content(client: openai.OpenAI) -> None:
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = chat(client, max_tokens=10, **kw)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"
        assert r.choices[0].finish_reason == "stop"


def test_a_cut_off_tool_call_is_returned_as_content(client: openai.OpenAI) -> None:
    r = chat(client, tools=TOOLS, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == f"<tool_call>{CALL}"


def test_a_conversation_with_tool_results_renders(client: openai.OpenAI) -> None:
    r = chat(client, tools=TOOLS, max_tokens=10)
    call = r.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    again = chat(client, messages=history, tools=TOOLS, max_tokens=10)
    assert again.choices[0].finish_reason == "tool_calls"
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


# --- logit_bias, logprobs ---------------------------------------------------------------------


def test_logit_bias_of_minus_100_on_the_greedy_token_changes_it(
    client: openai.OpenAI, rig: Rigged
) -> None:
    plain = chat(client, max_tokens=1, logprobs=True)
    assert plain.choices[0].logprobs.content[0].token == "<tool_call>"
    biased = chat(client, max_tokens=1, logprobs=True, logit_bias={str(rig.call_start): -100})
    assert biased.choices[0].logprobs.content[0].token != "<tool_call>"
    text, *_ = streamed_chat(client, max_tokens=1, logit_bias={str(rig.call_start): -100})
    assert text and not text.startswith("<tool_call>")
    # +100 on another token makes it the greedy one.
    forced = client.completions.create(
        model=MODEL, prompt=[rig.x], max_tokens=3, temperature=0, logit_bias={str(rig.z): 100}
    )
    assert forced.choices[0].text == "zzz"


def test_top_logprobs_3_returns_3_alternatives_best_first(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=3, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["<tool_call>", CALL, "</tool_call>"]
    for c in content:
        assert len(c.top_logprobs) == 3
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert bytes(c.bytes) == c.token.encode()
    _, _, _, streamed = streamed_chat(client, max_tokens=3, logprobs=True, top_logprobs=3)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(len(c.top_logprobs) == 3 for c in streamed)


def test_completions_logprobs_2_returns_the_top_2(client: openai.OpenAI, rig: Rigged) -> None:
    r = client.completions.create(
        model=MODEL, prompt=[rig.x], max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "xxx" and lp.tokens == ["x", "x", "x"]
    assert lp.text_offset == [0, 1, 2]
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert list(top) == ["x", "y"] and top["x"] == chosen and top["y"] < chosen
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=[rig.x], max_tokens=3, temperature=0, logprobs=2, stream=True
        )
    )
    offsets = [
        o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset
    ]
    assert offsets == [0, 1, 2]
    plain = client.completions.create(model=MODEL, prompt=[rig.x], max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_a_character_split_over_tokens_keeps_its_bytes_and_offsets(
    client: openai.OpenAI, rig: Rigged
) -> None:
    """Byte-level BPE spreads "é" over two tokens: neither is text alone."""
    kw: dict[str, Any] = {"model": MODEL, "prompt": [rig.w], "max_tokens": 4, "temperature": 0}
    r = client.completions.create(**kw, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "é"
    assert lp.tokens == ["bytes:\\xc3", "bytes:\\xa9"]
    assert lp.text_offset == [0, 0]  # no character is complete before the second byte
    assert [next(iter(t)) for t in lp.top_logprobs] == lp.tokens
    streamed = [
        ch.choices[0].logprobs
        for ch in client.completions.create(**kw, logprobs=2, stream=True)
        if ch.choices and ch.choices[0].logprobs
    ]
    assert [o for s in streamed for o in s.text_offset] == [0, 0]
    msgs = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=1,
        temperature=0,
        logprobs=True,  # type: ignore[arg-type]
    )
    assert c.choices[0].logprobs.content[0].bytes == list(b"<tool_call>")
    # The chat shape: the bytes of the two tokens join into the character.
    from mlx_lm.utils import load_tokenizer

    from mlxcel.server.logprobs import chat_logprobs

    tok = load_tokenizer(rig.path)
    content = chat_logprobs(tok, [(rig.e_lead, -0.1, ()), (rig.e_tail, -0.2, ())])["content"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "é"
    assert [c["token"] for c in content] == lp.tokens


# --- penalties, min_p ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}],
    ids=lambda p: next(iter(p)),
)
def test_each_penalty_breaks_a_repeat(client: openai.OpenAI, rig: Rigged, penalty: dict) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": [rig.x], "max_tokens": 2, "temperature": 0}
    assert client.completions.create(**kw).choices[0].text == "xx"
    # mlx-lm's processors take penalties as extra parameters of the request body.
    out = client.completions.create(**kw, extra_body=penalty).choices[0].text
    assert out.startswith("y"), out


def test_min_p_1_keeps_only_the_most_likely_token(client: openai.OpenAI, rig: Rigged) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": [rig.x], "max_tokens": 8, "seed": 7}
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    hot = client.completions.create(**kw, temperature=2.0).choices[0].text
    assert hot != greedy  # 500 near-equal tokens at temperature 2
    pinned = client.completions.create(**kw, temperature=2.0, extra_body={"min_p": 1.0})
    assert pinned.choices[0].text == greedy == "x" * 8


# --- refusals ---------------------------------------------------------------------------------


# --- response_format ---------------------------------------------------------------------------
COLOR = {
    "type": "json_schema",
    "json_schema": {
        "name": "color",
        "schema": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "boolean"}},
            "required": ["color", "n"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_constrains_the_output_to_the_schema(
    client: openai.OpenAI, stream: bool
) -> None:
    """The rigged model wants to call a tool; masked by llguidance's grammar of the schema it
    writes an object the schema accepts, and stops there."""
    plain = chat(client, max_tokens=12).choices[0].message.content
    assert not plain.startswith("{")
    if stream:
        text, _, finish, _ = streamed_chat(client, max_tokens=40, response_format=COLOR)
    else:
        c = chat(client, max_tokens=40, response_format=COLOR).choices[0]
        text, finish = c.message.content, c.finish_reason
    got = json.loads(text)
    assert set(got) == {"color", "n"} and got["color"] in ("red", "green", "blue")
    assert isinstance(got["n"], bool) and finish == "stop"
    assert "\n" not in text and ", " not in text  # compact JSON: no whitespace to spend
    any_object = chat(client, max_tokens=40, response_format={"type": "json_object"})
    text = any_object.choices[0].message.content
    assert text.startswith("{")  # an object begins (40 tokens may not close it)
    assert chat(client, max_tokens=4, response_format={"type": "text"}).choices[0].finish_reason


def test_tokens_a_grammar_rules_out_have_a_finite_logprob_in_valid_json(
    server: ServerProcess,
) -> None:
    """-inf (a token the mask forbids) is not JSON: strict parsers would refuse the body."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "response_format": {"type": "json_object"}}  # fmt: skip
    req = urllib.request.Request(
        server.base_url + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()
    assert "Infinity" not in raw and "NaN" not in raw
    tops = json.loads(raw)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    lps = [t["logprob"] for t in tops]  # few tokens can open an object: the rest are floored
    assert lps[0] > -9999.0 and lps[-1] == -9999.0  # (vLLM's floor)


def test_a_pipeline_s_final_stage_applies_the_grammar_as_one_process_does(
    client: openai.OpenAI, rig: Rigged, start_server
) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(["-m", str(rig.path), "--served-model-name", MODEL, "--pp-size", "2"])
    pipe = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    for fmt in (COLOR, {"type": "json_object"}):
        want = chat(client, max_tokens=30, response_format=fmt).choices[0].message.content
        assert chat(pipe, max_tokens=30, response_format=fmt).choices[0].message.content == want


# --- min_tokens, ignore_eos, skip_special_tokens ------------------------------------------------


def test_min_tokens_and_ignore_eos_hold_the_end_of_sequence_back(
    client: openai.OpenAI, rig: Rigged
) -> None:
    """With EOS pushed to be the greedy token, a completion ends at once; min_tokens holds
    EOS back for that many tokens (then it ends), ignore_eos until max_tokens."""

    def done(**extra: Any) -> tuple[int, str | None]:
        r = client.completions.create(
            model=MODEL, prompt=[rig.x], max_tokens=8, temperature=0,
            logit_bias={str(rig.eos): 100}, extra_body=extra,
        )  # fmt: skip
        assert r.usage is not None
        return r.usage.completion_tokens, r.choices[0].finish_reason

    assert done() == (0, "stop")  # (EOS itself is not counted, nor shown)
    assert done(min_tokens=5) == (5, "stop")  # five held, the sixth is EOS
    assert done(ignore_eos=True) == (8, "length")
    assert done(min_tokens=8) == (8, "length")
    with pytest.raises(openai.BadRequestError) as err:
        done(min_tokens=9)
    assert err.value.body["param"] == "min_tokens"  # type: ignore[index]
    assert "min_tokens (9) must not exceed max_tokens (8)" in err.value.body["message"]  # type: ignore[index]


def test_skip_special_tokens_drops_their_text_not_their_count(
    client: openai.OpenAI, rig: Rigged
) -> None:
    """Special tokens' text is shown by default (as mlx-lm's server does); with
    skip_special_tokens it is left out, and the tokens still count."""
    forced = {str(SPECIAL_TOKENS.index("<|im_start|>")): 100}  # a special token, not EOS

    def text(**extra: Any) -> tuple[str, int]:
        r = client.completions.create(
            model=MODEL, prompt=[rig.x], max_tokens=3, temperature=0, logit_bias=forced,
            extra_body=extra,
        )  # fmt: skip
        assert r.usage is not None
        return r.choices[0].text, r.usage.completion_tokens

    assert text() == ("<|im_start|>" * 3, 3)
    assert text(skip_special_tokens=True) == ("", 3)
    assert text(skip_special_tokens=False) == ("<|im_start|>" * 3, 3)
    # The offsets are into the text returned: hidden tokens add nothing to them.
    r = client.completions.create(
        model=MODEL, prompt=[rig.x], max_tokens=3, temperature=0, logprobs=1,
        logit_bias=forced, extra_body={"skip_special_tokens": True},
    )  # fmt: skip
    assert r.choices[0].logprobs.text_offset == [0, 0, 0]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 3}},
            "min_tokens",
        ),
        ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        (
            {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"enum": ["x" * 40000]}},
                }
            },
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "tool_choice",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"n": 2}, "n"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
            "tools.0.function.strict",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stop": 5}, "stop"),  # a union's branch names never leak into param
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"abc": 5}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 5}}, "logit_bias"),  # isdigit() but not int(): was a 500
        ({"logit_bias": {"7": 1, "007": 2}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos"),
        ({"extra_body": {"skip_special_tokens": 1}}, "skip_special_tokens"),
        ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unimplemented_or_invalid_parameters_get_400_naming_them(
    client: openai.OpenAI, kw: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=2, **kw)
    body = err.value.body
    assert isinstance(body, dict) and body["param"].startswith(param), body
    assert body["code"] and param in body["message"], body
    assert chat(client, max_tokens=2).choices[0].finish_reason  # the server goes on


def test_deep_nesting_is_a_400_not_a_500(client: openai.OpenAI, rig: Rigged) -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(200):
        node["a"] = {}
        node = node["a"]
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, tools=[tool], max_tokens=2)
    assert "nested deeper" in err.value.body["message"]  # type: ignore[index]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(deep)}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages=history, max_tokens=2)
    assert "nested deeper" in err.value.body["message"]  # type: ignore[index]
    assert chat(client, max_tokens=2).choices[0].finish_reason


def test_tool_call_text_edge_cases() -> None:
    from mlx_lm.tool_parsers.json_tools import parse_tool_call

    from mlxcel.server.tools import ToolCallText

    t = ToolCallText("<tool_call>", "</tool_call>", parse_tool_call, [])
    # Markers split anywhere, text around calls kept, in order.
    pieces = ["a <tool", '_call>{"name": "f", "argu', 'ments": {}}</tool_', "call> b"]
    out = [t.feed(p) for p in pieces]
    assert "".join(text for text, _ in out) + t.finish() == "a  b"
    (call,) = [c for _, calls in out for c in calls]
    assert call["function"] == {"name": "f", "arguments": "{}"} and call["index"] == 0
    # Nothing the model wrote is lost: an empty list, bad JSON, no name, an unclosed call.
    for raw in ("[]", "{not json", '{"arguments": {}}'):
        t = ToolCallText("<tool_call>", "</tool_call>", parse_tool_call, [])
        text, calls = t.feed(f"x<tool_call>{raw}</tool_call>y")
        assert calls == [] and text + t.finish() == f"x<tool_call>{raw}</tool_call>y"
    t = ToolCallText("<tool_call>", "</tool_call>", parse_tool_call, [])
    text, calls = t.feed('x<tool_call>{"name": "f"')
    assert calls == [] and text + t.finish() == 'x<tool_call>{"name": "f"'


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of")],
)
def test_unimplemented_completion_parameters_get_400(
    client: openai.OpenAI, kw: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kw)
    assert err.value.body["param"] == param and err.value.body["code"]  # type: ignore[index]


def test_an_image_part_is_refused_clearly(client: openai.OpenAI) -> None:
    msg = {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    }
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages=[msg], max_tokens=2)
    body = err.value.body
    assert "'image_url'" in body["message"] and "text only" in body["message"]  # type: ignore[index]
    assert body["param"] == "messages.0.content" and body["code"] == "unsupported_parameter"  # type: ignore[index]


def test_every_400_has_a_code(client: openai.OpenAI, server: ServerProcess) -> None:
    import urllib.error
    import urllib.request

    for raw in (b"{not json", b"[]", json.dumps({"model": MODEL}).encode()):
        req = urllib.request.Request(server.base_url + "/v1/chat/completions", data=raw)
        req.add_header("Content-Type", "application/json")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400
        assert json.loads(err.value.read())["error"]["code"]
    with pytest.raises(openai.BadRequestError) as bad_model:
        client.chat.completions.create(model="nope", messages=ASK)  # type: ignore[arg-type]
    assert bad_model.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_models_retrieve(client: openai.OpenAI) -> None:
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by == "mlxcel"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/other-model")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_tools_for_a_template_without_tool_support_are_refused(
    tiny: Path, tmp_path: Path, start_server: type[ServerProcess]
) -> None:
    plain = tmp_path / "plain-template"
    shutil.copytree(tiny, plain)
    cfg_path = plain / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    cfg_path.write_text(json.dumps(cfg))
    srv = start_server(["-m", str(plain), "--served-model-name", MODEL])
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as err:
        chat(c, tools=TOOLS, max_tokens=2)
    assert err.value.body["param"] == "tools"  # type: ignore[index]
    assert "tool calling" in err.value.body["message"]  # type: ignore[index]


def test_a_pipeline_that_samples_returned_logits_refuses_what_it_cannot_apply(
    tiny: Path, start_server: type[ServerProcess]
) -> None:
    """With --pp-return-logits the coordinator samples the logits itself, without mlx-lm's
    processors: those parameters are refused by name, never ignored. (A pipeline whose final
    stage samples applies them all: tests/parity.py.)"""
    srv = start_server(
        ["-m", str(tiny), "--pp-size", "2", "--pp-return-logits", "--served-model-name", MODEL]
    )
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    for kw in (
        {"logit_bias": {"5": 3}},
        {"logprobs": True, "top_logprobs": 2},
        {"presence_penalty": 1.0},
        {"extra_body": {"min_p": 0.1}},
    ):
        with pytest.raises(openai.BadRequestError) as err:
            chat(c, max_tokens=2, **kw)
        assert "pipeline" in err.value.body["message"]  # type: ignore[index]
        assert err.value.body["code"] == "unsupported_parameter"  # type: ignore[index]
    assert chat(c, max_tokens=2, logprobs=True).choices[0].logprobs is not None
