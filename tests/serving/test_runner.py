"""NodeRunner: a node's sites inside someone else's loop -- started, refused, stopped."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest

from mlxcel.base.errors import ListenError
from mlxcel.serving.assembly import Generation, LocalSpec, assemble
from mlxcel.serving.runner import HttpOptions, NodeRunner, Serving


async def test_started_names_the_sites_and_a_taken_port_fails_at_once(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(parallel=2)) as st:
        serving = Serving(st.node, st.frontend, lambda: st.parts.engine.active)
        runner = NodeRunner(serving, HttpOptions(port=0, model_name="tiny"))
        await runner.setup()
        sites = await runner.start()
        assert runner.started.done() and runner.started.result() == sites
        url = sites["http"]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as resp:
                assert resp.status == 200
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert (await resp.json())["usage"]["completion_tokens"] == 3
        # A second runner on the same port: the bind error surfaces from start() and started.
        port = int(url.rsplit(":", 1)[1])
        other = NodeRunner(serving, HttpOptions(port=port))
        await other.setup()
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}"):
            await other.start()
        assert isinstance(other.started.exception(), ListenError)
        await other.stop()  # never served: must not drain the frontend it shares
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
        await runner.stop()
        with socket.socket() as s:  # the port is free again
            s.bind(("127.0.0.1", port))


async def test_wait_returns_on_request_or_when_the_stack_is_done(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(parallel=1)) as st:
        done = asyncio.Event()
        runner = NodeRunner(Serving(st.node, st.frontend, done=done), HttpOptions(port=0))
        await runner.setup()
        await runner.start()
        waiter = asyncio.create_task(runner.wait())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        done.set()  # e.g. a tensor-parallel group failed
        await asyncio.wait_for(waiter, 2)
        runner.request_stop()
        await asyncio.wait_for(runner.wait(), 2)
        await runner.stop()


async def test_a_failed_setup_resolves_started(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(parallel=1)) as st:
        runner = NodeRunner(Serving(st.node, st.frontend), HttpOptions(max_body_bytes=-1))

        async def broken() -> None:
            raise RuntimeError("app factory failed")

        runner._setup = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await runner.setup()
        assert isinstance(runner.started.exception(), RuntimeError)


async def test_an_embedded_stack_serves_every_parameter_serve_serves(tiny: Path) -> None:
    """``stack.serving``: what an embedder puts behind HTTP takes min_p, penalties,
    logit_bias and top_logprobs as ``serve`` does, asked by the official openai client."""
    import openai

    async with assemble(LocalSpec(tiny), Generation(parallel=2)) as st:
        runner = NodeRunner(st.serving, HttpOptions(port=0, model_name="tiny"))
        await runner.setup()
        url = (await runner.start())["http"]
        try:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            r = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                logprobs=True,
                top_logprobs=2,
                frequency_penalty=0.5,
                logit_bias={"5": -100},
                extra_body={"min_p": 0.05},
            )
            (choice,) = r.choices
            assert choice.logprobs is not None and len(choice.logprobs.content) == 3
            assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
            cluster = await asyncio.to_thread(_get_json, f"{url}/cluster")
            (me,) = cluster["nodes"]
            assert me["kv_tokens"] == 0 and me["kv_capacity"] > 0
        finally:
            await runner.stop()


def _get_json(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())
