"""One client script, the official ``openai`` client, run unchanged against every serving mode:
each request uses parameters a one-process node serves, and the answers are compared with one
node's (text exactly, logprobs within float tolerance)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from mlxcel.runtime.checkpoint import SPECIAL_TOKENS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = [{"role": "user", "content": "Tell me about clusters that span machines"}]
EOS = str(SPECIAL_TOKENS.index("<|im_end|>"))  # the test checkpoints' end of sequence


def requests(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, endpoint, arguments) of every request the script sends."""
    chat: dict[str, Any] = {"model": model, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    comp: dict[str, Any] = {"model": model, "prompt": "A pipeline of stages", "max_tokens": 10,
                            "temperature": 0}  # fmt: skip
    return [
        ("greedy", "chat", chat),
        ("logprobs", "chat", {**chat, "logprobs": True, "top_logprobs": 3}),
        ("completion logprobs", "completions", {**comp, "logprobs": 2}),
        (
            "seeded min_p",
            "chat",
            {**chat, "temperature": 0.8, "seed": 7, "extra_body": {"min_p": 0.05}},
        ),  # fmt: skip
        ("logit_bias", "completions", {**comp, "logit_bias": {"5": -100, "9": 5}}),
        (
            "penalties",
            "completions",
            {
                **comp,
                "presence_penalty": 1.5,
                "frequency_penalty": 0.5,
                "extra_body": {"repetition_penalty": 1.3},
            },
        ),  # fmt: skip
        # A penalty that must see the prompt: token 5 is pushed up by the bias and down by
        # the repetition penalty only while the prompt (which holds it) is in view.
        (
            "penalised prompt",
            "completions",
            {
                **comp,
                "prompt": [5, 6, 7, 8],
                "max_tokens": 6,
                "logit_bias": {"5": 10},
                "extra_body": {"repetition_penalty": 10.0},
            },
        ),  # fmt: skip
        # Longer than the penalties' 20-token window on both sides: the prompt's tail and the
        # window sliding over what was generated must match too.
        (
            "long penalised",
            "completions",
            {
                **comp,
                "prompt": list(range(3, 43)),
                "max_tokens": 30,
                "presence_penalty": 1.0,
                "frequency_penalty": 0.7,
                "extra_body": {"repetition_penalty": 1.8},
            },
        ),  # fmt: skip
        ("stop", "completions", {**comp, "max_tokens": 24, "stop": ["e", "a"]}),
        # EOS made the greedy token, then held back: for 4 tokens, and for all of them.
        (
            "min_tokens",
            "completions",
            {**comp, "logit_bias": {EOS: 100}, "extra_body": {"min_tokens": 4}},
        ),
        (
            "ignore_eos",
            "completions",
            {**comp, "logit_bias": {EOS: 100}, "extra_body": {"ignore_eos": True}},
        ),
        ("tools", "chat", {**chat, "tools": TOOLS}),
    ]


async def run(client: openai.AsyncOpenAI, model: str) -> dict[str, dict[str, Any]]:
    out = await _each(client, requests(model))
    # The same requests at once: rows with and without processors share a batch.
    together = [(f"{name} (together)", e, a) for name, e, a in requests(model)]
    parts = await asyncio.gather(*(_each(client, [r]) for r in together))
    for part in parts:
        out.update(part)
    return out


async def _each(
    client: openai.AsyncOpenAI, reqs: list[tuple[str, str, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, endpoint, args in reqs:
        if endpoint == "chat":
            r = await client.chat.completions.create(**args)
            c = r.choices[0]
            lps = c.logprobs.content if c.logprobs and c.logprobs.content else []
            out[name] = {
                "text": c.message.content,
                "finish": c.finish_reason,
                "logprobs": [t.logprob for t in lps],
                "top": [[(a.token, a.logprob) for a in t.top_logprobs] for t in lps],
            }
        else:
            r = await client.completions.create(**args)
            c = r.choices[0]
            lp = c.logprobs
            out[name] = {
                "text": c.text,
                "finish": c.finish_reason,
                "logprobs": list(lp.token_logprobs or []) if lp else [],
                "top": [sorted(d.items()) for d in (lp.top_logprobs or [])] if lp else [],
            }
    return out


def assert_same(
    got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]], mode: str = ""
) -> None:
    """``got`` answers as one node did; prints one line per mode (``pytest -s`` shows it)."""
    assert got.keys() == want.keys()
    worst = 0.0
    for name in want:
        g, w = got[name], want[name]
        assert (g["text"], g["finish"]) == (w["text"], w["finish"]), name
        assert len(g["logprobs"]) == len(w["logprobs"]), name
        for a, b in zip(g["logprobs"], w["logprobs"], strict=True):
            assert abs(a - b) < 1e-4, (name, a, b)
            worst = max(worst, abs(a - b))
        assert [[t for t, _ in row] for row in g["top"]] == [
            [t for t, _ in row] for row in w["top"]
        ], name
        for grow, wrow in zip(g["top"], w["top"], strict=True):
            for (_, a), (_, b) in zip(grow, wrow, strict=True):
                assert abs(a - b) < 1e-4, (name, a, b)
    assert any(v["logprobs"] for v in want.values())  # the script asked for some: it compared
    lps = sum(len(v["logprobs"]) for v in want.values())
    print(
        f"parity [{mode or '?'}]: {len(want)} requests, text and finish identical, "
        f"{lps} logprobs within {worst:.1e} of one node's"
    )


async def against(url: str, model: str = "tiny") -> dict[str, dict[str, Any]]:
    """The script against the server at ``url`` (http://host:port)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        return await run(client, model)
    finally:
        await client.close()


async def served(serving: Any, model: str = "tiny") -> dict[str, dict[str, Any]]:
    """The script against ``serving`` behind a NodeRunner on a free port of this loop."""
    from mlxcel.serving.runner import HttpOptions, NodeRunner

    runner = NodeRunner(serving, HttpOptions(port=0, model_name=model))
    await runner.setup()
    url = (await runner.start())["http"]
    try:
        return await against(url, model)
    finally:
        await runner.stop()


_REFERENCE: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}


async def one_node(path: Any, model: str = "tiny") -> dict[str, dict[str, Any]]:
    """What one process answers: the reference every mode is held to (computed once per
    checkpoint in a test session: it never changes)."""
    from mlxcel.serving.assembly import LocalSpec, assemble

    key = (str(path), model)
    if key not in _REFERENCE:
        async with assemble(LocalSpec(path)) as st:
            _REFERENCE[key] = await served(st.serving, model)
    return _REFERENCE[key]
