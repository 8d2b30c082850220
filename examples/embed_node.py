"""Embed mlxcel in your own asyncio service.

Starts the one-process mode (engine + frontend, built through mlxcel's mode registry: any
other mode is another spec) on a Node inside this program's event loop, next to the service's
own task and its own bus handler, then serves the OpenAI-compatible API from the same loop
with a NodeRunner (no signal handlers installed: stopping is the service's business). Run it with
``python examples/embed_node.py``; it writes a tiny random checkpoint to a temporary folder.
"""

from __future__ import annotations

import asyncio
import tempfile
from contextlib import aclosing
from pathlib import Path

import aiohttp

import mlxcel
from mlxcel import (
    Envelope,
    Generation,
    HttpOptions,
    LocalSpec,
    NodeRunner,
    Overflow,
    RunResult,
    SamplingParams,
    start,
)
from mlxcel.runtime.checkpoint import write_checkpoint


async def main() -> None:
    mlxcel.setup_logging("INFO")  # mlxcel's one log format, for this program's lines too
    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(Path(tmp) / "tiny", "tiny", "qwen3")
        # start() / close(): for a service whose start-up and clean-up are separate hooks
        # (``async with assemble(spec, gen) as stack`` does both).
        stack = await start(LocalSpec(model), Generation(parallel=4, max_batch_size=4))
        try:
            # Your own handler on the same bus: it sees every RunResult the engine publishes.
            # DROP policy: an audit log must never slow generation down.
            seen: list[int] = []

            async def audit(env: Envelope[RunResult]) -> None:
                if not seen:
                    seen.append(-1)
                    # A deliberate failure: one labelled ERROR line, and the node goes on.
                    raise RuntimeError("handlers may fail; the node logs and counts it")
                seen.extend(env.msg.token_ids)

            stack.node.bus.subscribe(
                RunResult, audit, maxsize=256, policy=Overflow.DROP, name="audit"
            )

            # Your service's own work keeps running on the same loop.
            ticks = 0

            async def heartbeat() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            beat = stack.node.spawn(heartbeat(), name="heartbeat")

            fe = stack.frontend
            text = []
            prompt = fe.apply_chat_template([{"role": "user", "content": "Hello from my service"}])
            async with aclosing(fe.stream(prompt, SamplingParams(max_tokens=32))) as stream:
                async for delta in stream:
                    text.append(delta.text)
            beat.cancel()
            await asyncio.sleep(0.01)
            print("generated:", repr("".join(text)))
            print("ticks while generating:", ticks)
            print("tokens seen by the audit handler:", len(seen) - 1)
            print("handler errors counted:", stack.node.bus.handler_errors["audit"])
            # The verbs every mode's stack has: generate (or stream) and stats.
            done = await stack.generate("One more", SamplingParams(max_tokens=4))
            stats = await stack.stats()
            print("one more:", done.usage.completion_tokens, "tokens; ready:", stats["ready"])

            # The same stack behind HTTP, on a free port, inside this loop: every parameter
            # `python -m mlxcel serve` serves (min_p, penalties, logit_bias, top_logprobs...).
            runner = NodeRunner(stack, HttpOptions(port=0, model_name="tiny"))
            await runner.setup()
            sites = await runner.start()  # a port in use raises here (and in runner.started)
            body = {
                "model": "tiny",
                "prompt": "Hi",
                "max_tokens": 4,
                "min_p": 0.05,
                "logprobs": 2,
                "presence_penalty": 0.5,
                "ignore_eos": True,  # four tokens, even where the model would end at once
            }
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{sites['http']}/v1/completions", json=body) as resp:
                    answer = await resp.json()
            await runner.stop()
            if "error" in answer:
                raise SystemExit(f"the HTTP request failed: {answer['error']['message']}")
            top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
            print("served over HTTP:", answer["usage"]["completion_tokens"], "tokens;",
                  "first token's alternatives:", len(top))  # fmt: skip
        finally:
            await stack.close()


if __name__ == "__main__":
    asyncio.run(main())
