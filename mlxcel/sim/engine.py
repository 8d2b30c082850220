"""The serving engine under the simulator: ``python -m mlxcel sim --scenario engine``.

The one-process node's own code -- :class:`~mlxcel.runtime.engine.LocalEngine` (its core on
the effect runner; its runtime: mlx-lm's batch generator, the solo path, joins and leaves)
and the :class:`~mlxcel.serving.frontend.Frontend` (admission, per-request streams,
deadlines, cancellation) on a :class:`~mlxcel.reactor.bus.Node` -- runs on the virtual loop over the real tiny checkpoint. Only its compute thread is simulated
(:class:`~mlxcel.sim.compute.SimCompute`: each job runs on the simulator's thread and takes
``STEP_S`` of virtual time, or more while a ``slow`` fault is on), and a run of decode steps
ends on events and ``run_steps`` only, never on the wall clock.

Clients arrive at random with random prompts: most read their stream to the end, some hang
up after a few tokens, some give their request a short deadline. Checked after the run: every
request ended; a finished one holds exactly mlx-lm's greedy tokens for its prompt, an ended
one a prefix of them; a plain request was refused only at admission; the engine holds no
sequence and no KV cache, the frontend no request; nothing was logged as an error.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from mlxcel.base.errors import AdmissionRejected, DeadlineExceeded
from mlxcel.base.messages import SamplingParams
from mlxcel.reactor.bus import Node
from mlxcel.reactor.faults import Fault, FaultPlan, window
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.model import LoadedModel
from mlxcel.serving.frontend import Frontend
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.compute import SimCompute
from mlxcel.sim.process import logged_errors
from mlxcel.sim.real_model import real_model

STEP_S = 0.004  # virtual seconds per compute job
HORIZON = 2.0  # clients arrive within this many seconds (a burst: within a tenth of it)


@dataclass
class Client:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    kind: str  # "plain", "hang-up" (after ``hang_up_after`` tokens) or "deadline"
    hang_up_after: int = 0
    deadline_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # stop, length, hung-up, refused, deadline, or error:...


@dataclass
class EngineRun:
    sched: Scheduler
    loaded: LoadedModel
    clients: list[Client]
    plan: FaultPlan
    parallel: int
    run_steps: int  # decode steps per compute job at most (1: every token handed over)
    engine: LocalEngine | None = None
    frontend: Frontend | None = None
    slow: float = 1.0  # the compute's time multiplier while a ``slow`` fault is on


def greedy(loaded: LoadedModel, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """What plain mlx-lm generates greedily for ``prompt`` (up to an end-of-sequence token)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    eos, out = loaded.eos_token_ids(), []
    steps = generate_step(
        mx.array(prompt), loaded.model, max_tokens=max_tokens, sampler=partial(mx.argmax, axis=-1)
    )
    for token, _ in steps:
        if int(token) in eos:
            break
        out.append(int(token))
    return out


async def _serve(run: EngineRun, ready: asyncio.Event) -> None:
    compute = SimCompute(run.sched, lambda fn, args: STEP_S * run.slow)
    async with Node("engine") as node:
        run.engine = LocalEngine(
            node, run.loaded, compute, max_batch_size=4, prefill_step_size=16, max_sequences=8
        )
        # A run of decode steps ends on the wall clock in production: here only on events
        # and run_steps, so that a run is a function of its seed on any machine.
        run.engine.runtime.run_seconds, run.engine.runtime.run_steps = math.inf, run.run_steps
        await run.engine.attach()
        run.frontend = Frontend(node, run.loaded.tokenizer, parallel=run.parallel, queue_size=4)
        run.frontend.attach()
        ready.set()
        await asyncio.Event().wait()  # until the run closes the loop


async def _client(run: EngineRun, c: Client, ready: asyncio.Event) -> None:
    await ready.wait()
    fe = run.frontend
    assert fe is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + c.deadline_s if c.kind == "deadline" else None
    stream = fe.stream(list(c.prompt), SamplingParams(max_tokens=c.max_tokens), deadline=deadline)
    try:
        async for d in stream:
            run.sched.trace("delta", c.request_id, *d.token_ids)
            c.tokens.extend(d.token_ids)
            if d.finish_reason is not None:
                c.finish = d.finish_reason
            elif c.kind == "hang-up" and len(c.tokens) >= c.hang_up_after:
                c.finish = "hung-up"
                break
    except AdmissionRejected:
        c.finish = "refused"
    except DeadlineExceeded:
        c.finish = "deadline"
    except Exception as exc:  # a violation, reported by check()
        c.finish = f"error:{type(exc).__name__}: {exc}"
    finally:
        await stream.aclose()
        run.sched.trace("end", c.request_id, c.finish)


def build_engine_run(seed: int, model_path: Path) -> EngineRun:
    rng = random.Random(f"engine:{seed}")
    loaded = real_model(model_path).loaded
    vocab = loaded.vocab_size
    run = EngineRun(Scheduler(), loaded, [], FaultPlan(), rng.randint(1, 4), rng.choice([1, 4, 16]))
    for i in range(rng.randint(4, 14)):
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 40)))
        kind = rng.choices(["plain", "hang-up", "deadline"], [0.7, 0.15, 0.15])[0]
        c = Client(f"req-{i}", prompt, rng.randint(1, 16), kind)
        c.hang_up_after, c.deadline_s = rng.randint(1, 4), rng.uniform(0.005, 0.2)
        run.clients.append(c)
    if rng.random() < 0.5:  # the device slows down for a while (thermal, a neighbour)
        factor = rng.choice([5.0, 20.0])

        def slow(factor: float = factor) -> None:
            run.sched.trace("slow", factor)
            run.slow = factor

        run.plan.add(
            Fault("slow compute", slow, partial(setattr, run, "slow", 1.0)), *window(rng, HORIZON)
        )
    ready = asyncio.Event()
    run.sched.spawn(_serve(run, ready), name="engine.life")
    spread = HORIZON if rng.random() < 0.7 else HORIZON / 10  # a burst overflows admission
    for c in run.clients:
        run.sched.at(rng.uniform(0.0, spread), _arrive, run, c, ready)
    run.plan.install(run.sched.at)
    return run


def _arrive(run: EngineRun, c: Client, ready: asyncio.Event) -> None:
    run.sched.spawn(_client(run, c, ready), name=f"client.{c.request_id}")


def check_engine(run: EngineRun) -> list[str]:
    bad: list[str] = []
    for c in run.clients:
        want = greedy(run.loaded, c.prompt, c.max_tokens)
        if c.finish is None:
            bad.append(f"{c.request_id} never ended")
        elif c.finish.startswith("error:"):
            bad.append(f"{c.request_id} failed: {c.finish[6:]}")
        elif c.finish == "deadline" and c.kind != "deadline":
            bad.append(f"{c.request_id} ({c.kind}) ran out of time")
        elif c.finish in ("stop", "length") and c.tokens != want:
            bad.append(f"{c.request_id} finished with {c.tokens}, mlx-lm gives {want}")
        elif c.tokens != want[: len(c.tokens)]:
            bad.append(f"{c.request_id} ({c.finish}) streamed {c.tokens}, not a prefix of {want}")
    engine, fe = run.engine, run.frontend
    if engine is None or fe is None:
        return [*bad, "the engine never started"]
    if engine.active or engine.kv_tokens() or engine.batch_cache_rows():
        bad.append(
            f"the engine still holds {engine.active} sequences, {engine.kv_tokens()} KV "
            f"tokens, {engine.batch_cache_rows()} cache rows"
        )
    if fe.in_flight or fe.waiting:
        bad.append(f"the frontend still holds {fe.in_flight} requests, {fe.waiting} waiting")
    return bad


def run_engine(seed: int, model_path: Path) -> tuple[EngineRun, list[str]]:
    run = build_engine_run(seed, model_path)

    def settled() -> bool:
        done = all(c.finish is not None for c in run.clients)
        return done and run.engine is not None and not run.engine.active

    with logged_errors() as logged:
        run.sched.run(HORIZON + 700.0, stop=settled)
        run.sched.run(run.sched.now + 1.0)  # what the last cancellations free
        violations = check_engine(run) + logged
        run.sched.close()
    return run, violations
