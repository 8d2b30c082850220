"""Pipeline roles in one process over the LocalFabric: equality, authorization, bounds, faults."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.errors import ConfigError, EngineError, PipelineError
from mlxcel.base.messages import (
    Ack,
    Activation,
    BeginDrain,
    CancelRequest,
    Error,
    PrepareSequence,
    ReleaseSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    Shutdown,
    Tensor,
)
from mlxcel.net.network import LocalEndpoint
from mlxcel.pipeline.cluster_config import load_cluster_config
from mlxcel.pipeline.partition import (
    LayerCosts,
    PartitionError,
    auto_split,
    format_plan,
    layer_costs,
    parse_layers,
    plan,
)
from mlxcel.serving.assembly import Generation, LocalSpec, PipelineSpec, assemble
from mlxcel.serving.stack import Stack
from tests.conftest import collect, until_true

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"Pipeline prompt {i}: the quick brown fox" for i in range(8)]


@pytest.fixture(scope="module")
def reference(tiny: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with assemble(LocalSpec(tiny)) as st:
            return [await collect(st.frontend, p) for p in PROMPTS]

    return asyncio.run(run())


@pytest.mark.parametrize("stages", [2, 3])
async def test_inproc_pipeline_matches_single_process(
    tiny: Path, reference: list[list[int]], stages: int
) -> None:
    async with assemble(PipelineSpec(tiny, stages), Generation(parallel=8)) as st:
        got = await asyncio.gather(*(collect(st.frontend, p) for p in PROMPTS))
        assert got == reference
        assert all(not s.seqs for s in st.parts.stages)  # every sequence released everywhere
        assert st.parts.coordinator.active == 0 and not st.parts.coordinator.dropped
        # Per sequence: one cache-filling chunk (the prompt but its last token), 16 steps.
        assert st.parts.stages[0].stats.forwards == 8 * (1 + 16)
        # Concurrent sequences' decode steps shared forward passes inside each stage.
        assert all(s.stats.batches < s.stats.forwards for s in st.parts.stages)


async def test_the_in_process_pipeline_runs_its_sequences_as_one_micro_batch(
    tiny: Path, reference: list[list[int]]
) -> None:
    """Its stages share one compute thread, so two micro-batches could never overlap: the
    default (no --pp-micro-batch-size) is one micro-batch of --parallel, and four concurrent
    requests decode as batches of four on every stage, not two batches of two."""
    async with assemble(PipelineSpec(tiny, 2), Generation(parallel=4)) as st:
        assert st.parts.coordinator.coord.micro_batch_size == 4
        got = await asyncio.gather(*(collect(st.frontend, p) for p in PROMPTS[:4]))
        assert got == reference[:4]
        assert all(s.stats.largest_batch == 4 for s in st.parts.stages)
    async with assemble(PipelineSpec(tiny, 2), Generation(parallel=4, max_batch_size=2)) as st:
        assert st.parts.coordinator.coord.micro_batch_size == 2  # never more than a stage runs
    async with assemble(PipelineSpec(tiny, 2), Generation(parallel=1)) as st:  # generate --pp-size
        assert st.parts.coordinator.coord.micro_batch_size == 1
        assert all(s.config.max_batch == 1 for s in st.parts.stages)  # no batches to warm up


async def test_micro_batches_whose_members_come_and_go_match_single_process(
    tiny: Path, reference: list[list[int]]
) -> None:
    """Two micro-batches of two, eight requests of different lengths through four slots:
    rows leave the stages' persistent batches early and newcomers join them mid-decode, and
    every request still gets exactly the single-process tokens (greedy). Afterwards no stage
    holds a cache, a batch or a sampler."""
    lengths = [3, 16, 7, 12, 5, 16, 9, 2]
    async with assemble(PipelineSpec(tiny, 2, micro_batch_size=2), Generation(parallel=4)) as st:
        got = await asyncio.gather(
            *(collect(st.frontend, p, n) for p, n in zip(PROMPTS, lengths, strict=True))
        )
        assert got == [ref[:n] for ref, n in zip(reference, lengths, strict=True)]
        assert st.parts.coordinator.coord.peak_in_flight == 4
        assert all(s.stats.largest_batch == 2 for s in st.parts.stages)
        await until_true(lambda: all(not s.seqs for s in st.parts.stages))
        await st.parts.stages[0].compute.run(lambda: None)  # frees queued before it have run
        for s in st.parts.stages:
            rt = s.runtime
            assert (rt.caches, rt.batches, rt.batch_of, rt.samplers) == ({}, {}, {}, {})


async def test_a_micro_batch_larger_than_a_stage_batch_keeps_its_caches_in_chunks(
    tiny: Path, reference: list[list[int]]
) -> None:
    """One micro-batch of four through stages that run at most two rows at once: the stage
    runs it as two fixed chunks, each on a batch cache of its own, instead of regrouping
    rows every step (which copied every cache, every step). Tokens stay the engine's."""
    async with assemble(
        PipelineSpec(tiny, 2, micro_batch_size=4), Generation(parallel=4, max_batch_size=2)
    ) as st:
        got = await asyncio.gather(*(collect(st.frontend, p) for p in PROMPTS[:4]))
        assert got == reference[:4]
        assert all(s.stats.largest_batch == 2 for s in st.parts.stages)
        # 4 rows join once each, plus a few moves while the first steps line up; 30 decode
        # jobs per stage would regroup about 60 times if chunks changed every step.
        assert all(s.runtime.regroups <= 12 for s in st.parts.stages), [
            s.runtime.regroups for s in st.parts.stages
        ]


async def _tokens_and_logprobs(fe, prompt: str, **kw) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    from contextlib import aclosing

    toks: list[int] = []
    lps: list[float] = []
    params = SamplingParams(max_tokens=10, logprobs=True, **kw)
    async with aclosing(fe.stream(fe.encode_prompt(prompt), params)) as it:
        async for d in it:
            toks.extend(d.token_ids)
            lps.extend(d.logprobs or ())
    return toks, lps


async def test_a_micro_batch_of_greedy_and_sampled_rows_samples_each_row_as_alone(
    tiny: Path,
) -> None:
    """The last stage samples a micro-batch at once (one argmax for greedy rows, a row's own
    sampler otherwise): greedy rows keep the one-process engine's tokens and logprobs beside
    a seeded sampled row, and the sampled row draws what it draws alone."""
    async with assemble(LocalSpec(tiny)) as one:
        want = [await _tokens_and_logprobs(one.frontend, p) for p in PROMPTS[:3]]
    async with assemble(PipelineSpec(tiny, 2, micro_batch_size=4), Generation(parallel=4)) as st:
        alone = await _tokens_and_logprobs(st.frontend, PROMPTS[3], temperature=0.9, seed=7)
        got = await asyncio.gather(
            *(_tokens_and_logprobs(st.frontend, p) for p in PROMPTS[:3]),
            _tokens_and_logprobs(st.frontend, PROMPTS[3], temperature=0.9, seed=7),
        )
        assert all(s.stats.largest_batch == 4 for s in st.parts.stages)
    for (toks, lps), (want_toks, want_lps) in zip(got[:3], want, strict=True):
        assert toks == want_toks and len(lps) == len(toks)
        assert lps == pytest.approx(want_lps, abs=1e-4)
    assert got[3][0] == alone[0] and len(alone[0]) == 10
    assert got[3][1] == pytest.approx(alone[1], abs=1e-4)


def test_warm_up_serves_the_shapes_the_first_requests_bring_and_keeps_nothing(
    tiny: Path,
) -> None:
    """A GPU compiles kernels on a shape class's first use; warm-up ran one 512-token chunk
    and one single-row step on an empty cache, so batched decode (padded masks, batch caches
    that grow and shrink, batched sampling) compiled inside the first requests. Every stage
    now serves throwaway sequences through its own compute path before it reports ready: a
    full chunk, short prompts, and decode steps of 1, 2, 4, ... max-batch rows gathered into
    a batch cache, and prompts in every tile class of the quantized matmul; afterwards it
    holds nothing."""
    from mlxcel.pipeline.stage_runtime import StageRuntime
    from mlxcel.runtime.model import LayerRange, load_model

    class Spy:
        """The layer range, recording the (batch, length) of every forward."""

        def __init__(self, real: LayerRange) -> None:
            self.real, self.seen = real, []

        def __getattr__(self, name: str) -> object:
            return getattr(self.real, name)

        def __call__(self, x, cache, head):  # type: ignore[no-untyped-def]
            self.seen.append(tuple(x.shape[:2]))
            return self.real(x, cache, head=head)

    import mlxcel.pipeline.stage_runtime as stage_runtime

    made: list[SamplingParams] = []

    def recording(p: SamplingParams):  # type: ignore[no-untyped-def]
        made.append(p)
        return real_make_sampler(p)

    real_make_sampler = stage_runtime.make_sampler
    loaded = load_model(tiny)
    n = loaded.n_layers
    for start, end in ((0, n // 2), (n // 2, n)):
        spy = Spy(LayerRange(loaded, start, end))
        runtime = StageRuntime(spy)  # type: ignore[arg-type]
        stage_runtime.make_sampler = recording
        try:
            runtime.warm_up(512, spy.is_first, spy.is_last, batch=6)
        finally:
            stage_runtime.make_sampler = real_make_sampler
        # The last stage also draws a filtered sample (top-p, top-k, min-p kernels).
        hot = [p for p in made if p.temperature > 0]
        assert [p.top_k > 0 and p.top_p < 1 and p.min_p > 0 for p in hot] == (
            [True] if spy.is_last else []
        )
        made.clear()
        prompts = [length for rows, length in spy.seen if length > 1]
        decodes = [rows for rows, length in spy.seen if length == 1]
        assert 512 in prompts and min(prompts) < 8
        # A chunk in each tile class of MLX's quantized matmul (on a fresh H200 a 21-token
        # prompt compiled the 32-row class inside a request, for 32 s).
        tile = {max(16, min(64, 1 << (m - 1).bit_length())) for m in prompts if m >= 8}
        assert tile == {16, 32, 64}
        assert sorted(set(decodes)) == [1, 2, 4, 6] and all(decodes.count(b) == 2 for b in (2, 4))
        assert runtime.regroups == 0  # the counter counts serving only
        assert (runtime.caches, runtime.batches, runtime.batch_of, runtime.samplers) == (
            {},
            {},
            {},
            {},
        )


def test_a_sampling_evaluation_that_fails_fails_its_rows_instead_of_returning_garbage(
    tiny: Path,
) -> None:
    """MLX marks the arrays of a failed evaluation as evaluated, and reading them returns
    garbage instead of raising: a sampler whose graph fails when evaluated used to hand every
    row of the pass a token anyway. Now every sampled row of that pass fails (a sampler that
    raises when called still fails only its own row)."""
    import mlx.core as mx

    from mlxcel.pipeline.stage_protocol import ComputeJob, Sampled, Step, StepFailed
    from mlxcel.pipeline.stage_runtime import StageRuntime
    from mlxcel.runtime.model import LayerRange, load_model

    loaded = load_model(tiny)
    runtime = StageRuntime(LayerRange(loaded, 0, loaded.n_layers))
    keys = [("a", 1), ("b", 1), ("c", 1)]
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.9, seed=3)

    def job(steps: list[Step]) -> list:
        return runtime.run(ComputeJob(0, tuple(steps), True, True, False))[0]

    def decode(params: list[SamplingParams], pos: int) -> list:
        return job(
            [Step(k, 0, (7,), None, 1, pos, p, 0) for k, p in zip(keys, params, strict=True)]
        )

    for k in keys:
        job([Step(k, 0, (5, 6, 7, 8), None, 4, 0, greedy, 0, sample=False)])
    ok = decode([greedy, hot, greedy], 4)
    assert all(isinstance(o, Sampled) for o in ok)

    def fails_when_evaluated(logprobs: mx.array) -> mx.array:
        singular = mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu)[0, 0]
        return mx.argmax(logprobs, -1) + (singular * 0).astype(mx.uint32)

    def fails_when_called(logprobs: mx.array) -> mx.array:
        raise ValueError("boom")

    runtime.samplers[keys[1]] = fails_when_evaluated
    out = decode([greedy, hot, greedy], 5)
    assert all(isinstance(o, StepFailed) and o.why.startswith("sampling failed") for o in out)
    runtime.samplers[keys[1]] = fails_when_called
    out = decode([greedy, hot, greedy], 6)
    assert isinstance(out[1], StepFailed) and "boom" in out[1].why
    assert isinstance(out[0], Sampled) and isinstance(out[2], Sampled)


async def test_return_logits_mode_matches(tiny: Path, reference: list[list[int]]) -> None:
    async with assemble(PipelineSpec(tiny, 2, return_logits=True)) as st:
        assert [await collect(st.frontend, p) for p in PROMPTS[:3]] == reference[:3]


async def test_explicit_layers(tiny: Path, reference: list[list[int]]) -> None:
    async with assemble(PipelineSpec(tiny, 2, layers="0-0,1-3")) as st:
        assert [(s.layers.start, s.layers.end) for s in st.parts.stages] == [(0, 1), (1, 4)]
        assert await collect(st.frontend, PROMPTS[0]) == reference[0]


_asks = iter(range(10**9, 2 * 10**9))


async def ask(st: Stack, dest: str, msg_for, reply=None, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    """Send ``msg_for(nonce)`` to a stage as the coordinator and wait for the answer to that
    nonce (the coordinator's own core sees the answer too, and drops it as unknown)."""
    from mlxcel.reactor.bus import Origin

    node = st.parts.coordinator.node
    nonce = next(_asks)
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def spy(env) -> None:  # type: ignore[no-untyped-def]
        if getattr(env.msg, "nonce", None) == nonce and not got.done():
            got.set_result(env.msg)

    subs = [node.bus.subscribe(c, spy, origin=Origin.REMOTE) for c in (reply or Ack, Error)]
    try:
        await st.parts.coordinator.endpoint.send(dest, msg_for(nonce), deadline_in(timeout))
        async with asyncio.timeout(timeout):
            res = await got
    finally:
        for sub in subs:
            sub.unsubscribe()
    if isinstance(res, Error):
        raise PipelineError(res.code, res.message)
    return res


def rogue(st: Stack, identity: str) -> LocalEndpoint:
    return LocalEndpoint(st.parts.fabric, identity)


async def test_commands_from_a_non_coordinator_get_error_and_change_nothing(tiny: Path) -> None:
    from mlxcel.reactor.bus import Envelope, Node

    async with assemble(PipelineSpec(tiny, 2)) as st, Node("mallory") as mallory:
        seen: list[Error] = []

        async def on_error(env: Envelope[Error]) -> None:
            seen.append(env.msg)

        mallory.bus.subscribe(Error, on_error)
        evil = st.parts.fabric.endpoint("mallory", mallory)
        fe = st.frontend
        it = fe.stream(fe.encode_prompt("hello"), SamplingParams(max_tokens=400))
        await anext(it)
        (rid,) = st.parts.stages[0].seqs
        before = {s.config.index: dict(s.seqs) for s in st.parts.stages}
        s0 = "stage-0"
        for msg in (
            RunEntry(rid, 0, (1, 2), 0, SamplingParams(), 99),
            CancelRequest(rid, "evil"),
            ReleaseSequence(rid),
            PrepareSequence(rid, 10, 98),
            BeginDrain("evil"),
            Shutdown("evil"),
        ):
            await evil.send(s0, msg, asyncio.get_running_loop().time() + 5)
        await until_true(lambda: len(seen) == 6)
        assert {e.code for e in seen} == {"not_coordinator"}
        assert {e.nonce for e in seen if e.nonce} == {99, 98}
        assert {s.config.index: dict(s.seqs) for s in st.parts.stages} == before  # unchanged
        assert st.parts.stages[0].state.value == "serving"
        # An activation from anyone but the upstream stage is refused too.
        hidden = Tensor("float32", (1, 1, 64), bytes(256))
        await evil.send(
            "stage-1",
            Activation(rid, 0, hidden, 0, SamplingParams(), 5),
            asyncio.get_running_loop().time() + 5,
        )
        await until_true(lambda: st.parts.stages[1].stats.refused == 1)
        # The real request is unharmed.
        n = 1
        async for d in it:
            n += len(d.token_ids)
            if n >= 30:
                break
        await it.aclose()
        await until_true(lambda: all(not s.seqs for s in st.parts.stages))


async def test_stale_nonce_and_wrong_sender_results_are_dropped(
    tiny: Path, reference: list[list[int]]
) -> None:
    async with assemble(PipelineSpec(tiny, 2)) as st:
        coord = st.parts.coordinator
        real_send = coord.endpoint.send
        forged: list[str] = []

        async def send_and_forge(dest: str, msg, deadline: float) -> None:  # type: ignore[no-untyped-def]
            await real_send(dest, msg, deadline)
            if isinstance(msg, RunEntry) and len(forged) < 3:
                # Before the real answer: a stale nonce from the final stage, the right nonce
                # from a non-final stage, and a result for another request.
                final, first = rogue(st, "stage-1"), rogue(st, "stage-0")
                t = asyncio.get_running_loop().time() + 5
                await final.send(
                    "coordinator", RunResult(msg.request_id, 0, (7,), None, msg.nonce - 1000), t
                )
                await first.send(
                    "coordinator", RunResult(msg.request_id, 0, (7,), None, msg.nonce), t
                )
                await final.send(
                    "coordinator", RunResult("someone-else", 0, (7,), None, msg.nonce), t
                )
                forged.append(msg.request_id)

        coord.endpoint.send = send_and_forge  # type: ignore[method-assign]

        coord.endpoint.send_now = None  # every send through it
        assert await collect(st.frontend, PROMPTS[0]) == reference[0]
        assert coord.dropped["not from the final stage"] >= 1
        assert coord.dropped["stale or unknown nonce"] >= 1
        assert coord.dropped["request or micro-batch does not match the exchange"] >= 1


@pytest.mark.parametrize("problem", ["width", "tokens", "dtype"])
async def test_out_of_bounds_activation_fails_the_request_fast(tiny: Path, problem: str) -> None:
    async with assemble(PipelineSpec(tiny, 2), Generation(request_timeout=60)) as st:
        s0 = st.parts.stages[0]
        real = s0.endpoint.send
        tampered = []

        async def tamper(dest: str, msg, deadline: float) -> None:  # type: ignore[no-untyped-def]
            if isinstance(msg, Activation) and not tampered:
                tampered.append(1)
                if problem == "width":
                    hidden = Tensor("float32", (1, 1, 65), bytes(260))
                elif problem == "dtype":
                    hidden = Tensor("int32", (1, 1, 64), bytes(256))
                else:  # claims more than 2**20 tokens without sending them
                    hidden = object.__new__(Tensor)
                    for k, v in (
                        ("dtype", "float32"),
                        ("shape", (1, (1 << 20) + 1, 64)),
                        ("data", b""),
                    ):
                        object.__setattr__(hidden, k, v)
                msg = Activation(
                    msg.request_id, msg.micro_batch, hidden, 0, msg.sampling, msg.nonce
                )
            await real(dest, msg, deadline)

        s0.endpoint.send = tamper  # type: ignore[method-assign]

        s0.endpoint.send_now = None  # every send through it
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(EngineError) as info:
            await collect(st.frontend, "hello", 50)
        assert info.value.code == "bad_activation"
        assert loop.time() - t0 < 5  # failed at once, not at a deadline
        assert st.parts.stages[1].stats.errors == 1
        await until_true(lambda: all(not s.seqs for s in st.parts.stages))
        # The stage keeps serving.
        assert len(await collect(st.frontend, "again", 5)) == 5


async def test_drain_refuses_new_sequences_and_finishes_running_ones(tiny: Path) -> None:
    async with assemble(PipelineSpec(tiny, 2)) as st:
        running = asyncio.create_task(collect(st.frontend, "long one", 60))
        await until_true(lambda: bool(st.parts.stages[0].seqs))
        st.parts.stages[0].request_shutdown()
        with pytest.raises(EngineError) as info:
            await collect(st.frontend, "new", 3)
        assert info.value.code == "draining"
        assert len(await running) == 60
        await until_true(lambda: st.parts.stages[0].stopped.is_set())


# --- partitioner ---------------------------------------------------------------------------------


def test_parse_layers_errors_name_the_range() -> None:
    assert parse_layers("0-1,2-3", 4) == [(0, 2), (2, 4)]
    for spec, text in (
        ("0-1,3-3", "should start at layer 2"),
        ("0-1", "the model has 4"),
        ("0-2,1-3", "should start at layer 3"),
        ("2-1,2-3", "empty"),
        ("zero-3", "bad range"),
    ):
        with pytest.raises(PartitionError, match=text):
            parse_layers(spec, 4)


def test_auto_split_uses_real_costs_for_uneven_models() -> None:
    # A heavy dense layer 0, cheap attention-only layers, heavy expert layers.
    costs = LayerCosts((900, 100, 100, 100, 800, 800), embed=200, head=200, other=0)
    stages = auto_split(costs, 3)
    # Time: 1000 | 1000 | 1000 (the embedding is a lookup; the head a matmul).
    assert [(s.start, s.end) for s in stages] == [(0, 2), (2, 5), (5, 6)]
    assert sum(s.bytes for s in stages) == costs.total
    # A large tied vocabulary: the head outweighs layers, so the last stage gets fewer.
    vocab = LayerCosts((100,) * 8, embed=300, head=300, other=0)
    assert [(s.start, s.end) for s in auto_split(vocab, 2)] == [(0, 5), (5, 8)]
    # Declared memory shifts the split; a plan that cannot fit is an error with the numbers.
    weighted = auto_split(costs, 2, memory=[3000.0, 1000.0])
    assert weighted[0].bytes > weighted[1].bytes
    with pytest.raises(PartitionError) as info:
        plan(costs, [(0, 3), (3, 6)], memory=[100.0, 100.0])
    assert "does not fit" in str(info.value) and "1,300" in str(info.value)


def test_layer_costs_come_from_safetensors_headers(tiny: Path) -> None:
    c = layer_costs(tiny)
    assert len(c.layers) == 4 and len(set(c.layers)) == 1 and c.embed > 0
    assert c.head >= c.embed  # tied head is charged to the last stage
    text = format_plan(auto_split(c, 2))
    assert "0-1" in text and "2-3" in text and "share" in text


def test_dry_run_prints_the_plan(tiny: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "generate",
            "-m",
            str(tiny),
            "--pp-size",
            "3",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["stage", "layers", "bytes", "share", "memory"] and len(lines) == 4
    bad = subprocess.run(
        [sys.executable, "-m", "mlxcel", "generate", "-m", str(tiny), "--pp-layers", "0-1,3-3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "--pp-layers" in bad.stderr


@pytest.mark.parametrize("stages", ["2", "3"])
def test_generate_pp_size_prints_the_single_process_tokens(tiny: Path, stages: str) -> None:
    def run(*extra: str) -> str:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlxcel",
                "generate",
                "-m",
                str(tiny),
                "-p",
                "Hello there",
                "-n",
                "20",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.rsplit("\n", 2)[0]

    assert run("--pp-size", stages) == run()


# --- cluster config --------------------------------------------------------------------------------


def test_example_configs_validate() -> None:
    for name in ("pipeline_2stage.toml", "pipeline_3stage.toml"):
        cfg = load_cluster_config(ROOT / "examples" / "distributed" / name)
        assert len(cfg.stages) == cfg.pipeline_parallel_size
        assert cfg.cluster.secret_file == "cluster.secret"


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (
            "pipeline_parallel_size = 2\n[[nodes]]\nid='c'\nrole='coordinator'\naddress='127.0.0.1:1'\n",
            "2 but 0 stage",
        ),
        (
            "pipeline_parallel_size = 1\n[[nodes]]\nid='s'\nrole='stage'\naddress='127.0.0.1:1'\n",
            "exactly one",
        ),
        (
            "pipeline_parallel_size = 1\n[[nodes]]\nid='c'\nrole='coordinator'\naddress='host:1'\n"
            "[[nodes]]\nid='s'\nrole='stage'\naddress='127.0.0.2:1'\n",
            "IP address",
        ),
        (
            "pipeline_parallel_size = 1\nbogus = 1\n[[nodes]]\nid='c'\nrole='coordinator'\naddress='127.0.0.1:1'\n"
            "[[nodes]]\nid='s'\nrole='stage'\naddress='127.0.0.2:1'\n",
            "bogus",
        ),
        ("not toml [", "not valid TOML"),
        (
            "pipeline_parallel_size = 2\n[[nodes]]\nid='c'\nrole='coordinator'\naddress='127.0.0.1:1'\n"
            "[[nodes]]\nid='s0'\nrole='stage'\naddress='127.0.0.2:1'\nmemory_gb = 8\n"
            "[[nodes]]\nid='s1'\nrole='stage'\naddress='127.0.0.3:1'\n",
            "memory_gb on every stage or on none",
        ),
        (
            "pipeline_parallel_size = 1\n[[nodes]]\nid='c'\nrole='coordinator'\naddress='127.0.0.1:1'\n"
            "[[nodes]]\nid='s0'\nrole='stage'\naddress='127.0.0.2:1'\nmemory_gb = inf\n",
            "memory_gb",
        ),
    ],
)
def test_bad_cluster_configs_name_the_problem(tmp_path: Path, body: str, text: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(body)
    with pytest.raises(ConfigError, match=text):
        load_cluster_config(p)


def test_json_plan_shares_sum_to_one(tiny: Path) -> None:
    stages = auto_split(layer_costs(tiny), 2)
    assert abs(sum(s.share for s in stages) - 1.0) < 1e-9
    json.dumps([s.spec for s in stages])


async def test_begin_drain_and_shutdown_from_the_coordinator(tiny: Path) -> None:
    async with assemble(PipelineSpec(tiny, 2)) as st:
        coord = st.parts.coordinator
        loop = asyncio.get_running_loop()
        await coord.endpoint.send("stage-1", BeginDrain("maintenance"), loop.time() + 5)
        await until_true(lambda: st.parts.stages[1].state.value == "draining")
        with pytest.raises(EngineError) as info:
            await collect(st.frontend, "refused while draining", 3)
        assert info.value.code == "draining"
        await coord.endpoint.send("stage-1", Shutdown("bye"), loop.time() + 5)
        await until_true(lambda: st.parts.stages[1].stopped.is_set())
        assert not st.parts.stages[0].stopped.is_set()


def test_demo_runs_a_real_cluster_and_shuts_it_down(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "MLXCEL_HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "demo", "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cluster up: stages on 127.0.0.2 and 127.0.0.3" in r.stdout
    assert "note: the embedded model has random weights" in r.stdout  # the gibberish explained
    import platform

    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert "BLAS: mkl " in r.stdout  # the README's command gets the fast BLAS
    assert "tokens: 12;" in r.stdout and "per-token latency" in r.stdout
    assert "bytes on the wire" in r.stdout
    assert "stage-0 exit 0, stage-1 exit 0, coordinator exit 0" in r.stdout


async def test_run_entry_with_a_wrong_position_is_refused(tiny: Path) -> None:
    async with assemble(PipelineSpec(tiny, 2)) as st:
        from mlxcel.base.errors import PipelineError

        await ask(st, "stage-0", lambda n: PrepareSequence("r-pos", 64, n))
        with pytest.raises(PipelineError) as info:
            await ask(
                st,
                "stage-0",
                lambda n: RunEntry("r-pos", 0, (5, 6), 3, SamplingParams(), n),
                RunResult,
            )
        assert info.value.code == "bad_request" and "start_pos 3" in str(info.value)
        assert st.parts.stages[0].seqs["r-pos"].tokens == 0  # nothing ran


async def test_bf16_pipeline_keeps_every_mlx_object_on_its_compute_thread(tiny_bf16: Path) -> None:
    """bf16 activations are rebuilt with an MLX op; made on the reactor, the stage's compute
    thread cannot evaluate them ("There is no Stream(cpu, N) in current thread") -- the same
    rule that failed every pipeline on a GPU."""
    async with assemble(LocalSpec(tiny_bf16)) as one:
        want = [await collect(one.frontend, p, 12) for p in PROMPTS[:3]]
    async with assemble(PipelineSpec(tiny_bf16, 2)) as st:
        got = [await collect(st.frontend, p, 12) for p in PROMPTS[:3]]
        seeded = [
            await collect(st.frontend, PROMPTS[0], 8, temperature=0.9, seed=s) for s in (4, 4)
        ]
    assert got == want
    assert seeded[0] == seeded[1] and len(seeded[0]) >= 1


async def test_long_prompt_runs_in_chunks_between_decode_steps(tiny: Path) -> None:
    """Chunked prefill gives the one-shot answer, and other streams decode between chunks."""
    long_prompt = " ".join(f"word{i}" for i in range(300))
    async with assemble(LocalSpec(tiny)) as one:
        want = await collect(one.frontend, long_prompt, 8)
    async with assemble(PipelineSpec(tiny, 2), Generation(prefill_step_size=16, parallel=8)) as st:
        fe = st.frontend
        n_prompt = len(fe.encode_prompt(long_prompt))
        assert n_prompt >= 8 * 16
        order: list[str] = []  # which request each final-stage result belonged to, in order

        async def spy(env):  # type: ignore[no-untyped-def]
            order.append("long" if env.msg.request_id == "req-5" else "short")

        st.parts.coordinator.node.bus.subscribe(RunResult, spy, name="spy")
        shorts = [asyncio.create_task(collect(fe, p, 40)) for p in PROMPTS[:4]]
        await until_true(lambda: len(order) >= 4)
        got = await collect(fe, long_prompt, 8)  # req-5
        await asyncio.gather(*shorts)
        assert got == want
        assert st.parts.coordinator.steps >= (n_prompt - 1) // 16 + 8
        # Short streams produced tokens while the long prompt was still being prefilled.
        first_long, last_long_chunk = order.index("long"), n_prompt // 16 - 1
        long_positions = [i for i, who in enumerate(order) if who == "long"]
        between = order[first_long : long_positions[last_long_chunk]]
        assert "short" in between
        await until_true(lambda: all(not s.seqs for s in st.parts.stages))


async def test_cancelled_long_prompt_stops_within_one_chunk(tiny: Path) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(300))
    async with assemble(PipelineSpec(tiny, 2), Generation(prefill_step_size=16)) as st:
        fe = st.frontend
        chunks_done: list[int] = []

        async def spy(env):  # type: ignore[no-untyped-def]
            chunks_done.append(st.parts.stages[0].stats.forwards)

        st.parts.coordinator.node.bus.subscribe(RunResult, spy, name="spy")
        task = asyncio.create_task(collect(fe, long_prompt, 4))
        await until_true(lambda: len(chunks_done) >= 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        at_cancel = st.parts.stages[0].stats.forwards
        await until_true(lambda: all(not s.seqs for s in st.parts.stages))
        await asyncio.sleep(0.2)
        # At most the chunk already running finishes; nothing after it is computed.
        assert st.parts.stages[0].stats.forwards <= at_cancel + 1
        assert st.parts.stages[1].stats.forwards <= at_cancel + 1
        n_chunks = len(fe.encode_prompt(long_prompt)) // 16
        assert st.parts.stages[0].stats.forwards < n_chunks


async def test_decode_overhead_is_step_time_minus_the_stages_compute(tiny: Path) -> None:
    """Each stage adds its compute for a step to the message it passes on; the coordinator
    subtracts that from the step's wall time. With 20 ms of extra work per stage per step,
    the reported compute holds it and the overhead does not."""
    import time as _time

    async with assemble(PipelineSpec(tiny, 2)) as st:
        for svc in st.parts.stages:
            real = svc.runtime._run

            def slow(job, real=real):  # type: ignore[no-untyped-def]
                _time.sleep(0.02)
                return real(job)

            svc.runtime._run = slow  # type: ignore[method-assign]
        c = st.parts.coordinator.coord
        await collect(st.frontend, PROMPTS[0], 10)
        assert c.decode_steps == 10
        compute_ms = 1e3 * c.decode_compute_s / c.decode_steps
        wall_ms = 1e3 * c.decode_wall_s / c.decode_steps
        assert compute_ms >= 40  # both stages' sleeps are inside the reported compute
        assert 0 <= c.decode_overhead_ms() == pytest.approx(wall_ms - compute_ms)
        assert c.decode_overhead_ms() < compute_ms  # the sleeps did not land in the overhead


def test_bench_pipeline_reports_every_mode_with_the_mlx_lm_reference(tiny: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "bench", "pipeline", "--json", "-m", str(tiny)]
        + ["--tokens", "8", "--streams", "1,3", "--pin"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    rows = {(row["mode"], row["streams"]): row for row in map(json.loads, r.stdout.splitlines())}
    modes = ("mlx-lm loop", "mlx-lm split", "mlx-lm split_host", "single", "inproc-2", "remote-2",
             "remote-2 unprotected")  # fmt: skip
    assert set(rows) == {(m, n) for m in modes for n in (1, 3)}
    for n in (1, 3):  # the same pipeline with its frames unprotected: what protection costs
        bare = rows[("remote-2 unprotected", n)]
        assert bare["protection_cost"] == round(
            1 - rows[("remote-2", n)]["tok_per_s"] / bare["tok_per_s"], 4
        )
    # (That its frames really go unprotected: test_bench_s_unprotected_frames_carry_no_tag.)
    assert rows[("remote-2 unprotected", 1)]["wire_bytes_per_token"] > 0
    for n in (1, 3):
        assert rows[("single", n)]["ratio_vs_single"] == 1.0
        for mode in ("inproc-2", "remote-2"):
            row = rows[(mode, n)]
            assert row["tok_per_s"] > 0 and row["overhead_ms_per_step"] >= 0
            assert row["stage_compute_ms_per_step"] > 0
            # With its busiest stage always computing it would do at least as well.
            assert row["saturated_ratio"] >= row["ratio_vs_single"]
            # Each stage ran jobs; its compute splits into build, eval and copy.
            for st in row["stages"]:
                assert st["jobs"] > 0 and st["compute_ms"] > 0 and 0 < st["busy"] <= 1
                assert st["build_ms"] + st["eval_ms"] + st["copy_ms"] <= st["compute_ms"] * 1.01
        assert rows[("mlx-lm split", n)]["ms_per_step"] > 0
    # In one process activations stay on the device: no host copy between the stages.
    assert rows[("inproc-2", 1)]["stages"][0]["copy_ms"] == 0
    assert rows[("remote-2", 1)]["stages"][0]["copy_ms"] > 0
    assert rows[("remote-2", 1)]["wire_bytes_per_token"] > 0
    # --pin: one device against two -- every one-process row on one core, each stage of
    # remote-2 on a core of its own, the coordinator beside the last stage.
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert rows[("single", 3)]["cores"] == rows[("inproc-2", 3)]["cores"] == [[first]]
    assert rows[("remote-2", 3)]["cores"] == [[first], [second]]
    assert rows[("remote-2", 3)]["coordinator_cores"] == [second]  # the last stage's core


async def test_bounded_stage_state_sequences_leases_and_owner_loss(tiny: Path) -> None:
    """A stage holds at most max_sequences, frees a sequence whose lease ran out (a lost
    ReleaseSequence) and everything its owner held once the owner is gone."""
    async with assemble(PipelineSpec(tiny, 2)) as st:
        s0 = st.parts.stages[0]
        s0.config.max_sequences = 3
        s0.config.lease = 0.3
        for i in range(3):
            await ask(st, "stage-0", lambda n, i=i: PrepareSequence(f"held-{i}", 16, n))
        assert len(s0.seqs) == 3
        with pytest.raises(PipelineError) as info:
            await ask(st, "stage-0", lambda n: PrepareSequence("one-more", 16, n))
        assert info.value.code == "too_many_sequences"
        await until_true(lambda: not s0.seqs, timeout=5)  # nobody released them: leases ran out
        assert s0.stats.leases_expired == 3
        s0.config.lease = 300.0
        await ask(st, "stage-0", lambda n: PrepareSequence("orphan", 16, n))
        s0._peer_lost("coordinator")  # what the transport reports when the owner's link drops
        assert not s0.seqs


async def test_a_forward_that_overruns_fails_its_requests_and_the_stage_keeps_serving(
    tiny: Path,
) -> None:
    import threading

    async with assemble(PipelineSpec(tiny, 2)) as st:
        s1 = st.parts.stages[1]
        s1.config.forward_timeout = 0.3
        real = s1.runtime._run
        release = threading.Event()

        def stuck(job):  # type: ignore[no-untyped-def]
            release.wait(60.0)  # a forward that hangs until the test lets it go
            return real(job)

        s1.runtime._run = stuck  # type: ignore[method-assign]
        with pytest.raises(EngineError) as info:
            await collect(st.frontend, PROMPTS[0], 4)
        assert info.value.code == "forward_timeout"
        # The request failed while its forward still hung: the forward timeout ended it, not
        # the forward (nor the 30 s step deadline).
        assert not release.is_set()
        s1.runtime._run = real  # type: ignore[method-assign]
        release.set()
        await s1.compute.run(lambda: None)  # the stuck step has finished on the thread
        assert len(await collect(st.frontend, PROMPTS[1], 4)) == 4


async def test_a_slow_destination_delays_only_what_goes_to_it(tiny: Path) -> None:
    """A refusal to a member that reads slowly must not hold the stage's PrepareSequence
    handler (replies were sent inline once, so one slow peer stalled everyone's requests)."""
    async with assemble(PipelineSpec(tiny, 2)) as st:
        s0 = st.parts.stages[0]
        real_send = s0.endpoint.send

        async def send(dest, msg, deadline):  # type: ignore[no-untyped-def]
            if dest == "mallory":
                await asyncio.sleep(10)  # a peer that never drains its socket
            await real_send(dest, msg, deadline)

        s0.endpoint.send = send  # type: ignore[method-assign]

        s0.endpoint.send_now = None  # every send through it
        evil = rogue(st, "mallory")
        for i in range(3):
            await evil.send("stage-0", PrepareSequence(f"x{i}", 8, i), deadline_in(5))
        t0 = asyncio.get_running_loop().time()
        assert len(await collect(st.frontend, PROMPTS[0], 4)) == 4
        assert asyncio.get_running_loop().time() - t0 < 5


async def test_the_coordinators_drop_counter_cannot_be_grown_by_peers(tiny: Path) -> None:
    async with assemble(PipelineSpec(tiny, 2)) as st:
        evil = rogue(st, "stage-1")  # even a member's own identity
        for i in range(200):
            await evil.send(
                "coordinator", Error(f"code-{i}", f"text {i}", f"r{i}", 10_000 + i), deadline_in(5)
            )
        await until_true(lambda: sum(st.parts.coordinator.dropped.values()) == 200)
        assert set(st.parts.coordinator.dropped) == {"unmatched error"}


async def test_stages_on_their_own_threads_compute_two_micro_batches_at_once(
    tiny: Path, reference: list[list[int]]
) -> None:
    """With a compute thread per stage and two micro-batches in flight, stage 0 computes one
    micro-batch while stage 1 computes the other: shown from the stages' own job timestamps
    on a slowed model (each job also sleeps 30 ms, as a device would keep it busy). Greedy
    tokens stay the single-process ones."""
    async with assemble(
        PipelineSpec(tiny, 2, micro_batch_size=2, stage_threads=True), Generation(parallel=4)
    ) as st:
        assert st.parts.stages[0].compute is not st.parts.stages[1].compute
        assert not any(s.config.device_handoff for s in st.parts.stages)
        for svc in st.parts.stages:
            real = svc.runtime._run

            def slow(job, real=real):  # type: ignore[no-untyped-def]
                out = real(job)
                time.sleep(0.03)
                return out

            svc.runtime._run = slow  # type: ignore[method-assign]
            svc.runtime.timing.spans.clear()
        got = await asyncio.gather(*(collect(st.frontend, p, 8) for p in PROMPTS[:4]))
        assert got == [ref[:8] for ref in reference[:4]]
        first, second = (list(s.runtime.timing.spans) for s in st.parts.stages)
        both = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in first for b0, b1 in second)
        busy = sum(b - a for a, b in second)
        # Stage 1 spent a good part of its time computing while stage 0 computed too.
        assert both > 0.25 * busy, (both, busy)


async def test_in_process_stages_hand_activations_over_on_the_device(
    tiny: Path, reference: list[list[int]]
) -> None:
    """Stages sharing a compute thread pass device arrays (no host copy, no bytes); such a
    tensor can never be encoded for a socket."""
    from mlxcel.base.messages import Activation, Bundle, DeviceTensor, StepActivation
    from mlxcel.reactor.bus import Origin
    from mlxcel.wire.codec import encode

    async with assemble(PipelineSpec(tiny, 2), Generation(parallel=2)) as st:
        seen: list[Activation | StepActivation] = []
        kinds = (Activation, StepActivation)

        def spy(env):  # type: ignore[no-untyped-def]
            items = env.msg.items if isinstance(env.msg, Bundle) else (env.msg,)
            seen.extend(m for m in items if isinstance(m, kinds))

        st.parts.stages[1].node.bus.subscribe((*kinds, Bundle), spy, origin=Origin.ANY, sync=True)
        got = await asyncio.gather(*(collect(st.frontend, p) for p in PROMPTS[:2]))
        assert got == reference[:2]
        assert seen and all(isinstance(m.hidden, DeviceTensor) for m in seen)
        assert {type(m) for m in seen} == {Activation, StepActivation}  # prompts; decode steps
        assert st.parts.stages[0].runtime.timing.copy_s == 0.0  # nothing went to the host
        with pytest.raises(TypeError, match="device tensor"):
            encode(seen[0])


async def test_the_entry_stage_starts_the_next_step_while_the_last_samples(
    tiny: Path, reference: list[list[int]]
) -> None:
    """In one process the last stage starts the entry stage's next decode step on the tokens
    it is still sampling; the entry stage serves the coordinator's step from it, and undoes it
    (one cache position per row) when the step asked for differs -- here, whenever a member
    of the micro-batch finishes. Tokens stay the single-process ones."""
    lengths = [3, 16, 7, 12]
    async with assemble(PipelineSpec(tiny, 2), Generation(parallel=4)) as st:
        got = await asyncio.gather(
            *(collect(st.frontend, p, n) for p, n in zip(PROMPTS[:4], lengths, strict=True))
        )
        assert got == [ref[:n] for ref, n in zip(reference[:4], lengths, strict=True)]
        first = st.parts.stages[0].runtime
        assert first.ahead_used >= 10 and first.ahead_undone >= 1
        await until_true(lambda: all(not s.seqs for s in st.parts.stages))
        await st.parts.stages[0].compute.run(lambda: None)  # the frees queued before it have run
        assert not first.started_ahead and not first.batches and not first.caches


def test_a_step_started_ahead_on_other_tokens_is_undone_exactly(tiny: Path) -> None:
    """The entry stage runs a step ahead only if the coordinator asks for exactly that step:
    asked for another token, it trims the step off its caches and computes the real one,
    with the same numbers as a stage that never ran ahead."""
    import mlx.core as mx

    from mlxcel.base.messages import DeviceTensor
    from mlxcel.pipeline.stage_protocol import ComputeJob, Row, Step
    from mlxcel.pipeline.stage_runtime import StageRuntime
    from mlxcel.runtime.model import LayerRange, load_model

    loaded = load_model(tiny)
    greedy = SamplingParams()

    def run(rt: StageRuntime, tokens: tuple[int, ...], pos: int) -> mx.array:
        step = Step(("a", 1), 0, tokens, None, len(tokens), pos, greedy, 0, len(tokens) == 1)
        (out,) = rt.run(ComputeJob(0, (step,), True, False, False))[0]
        assert isinstance(out, Row) and isinstance(out.tensor, DeviceTensor)
        return out.tensor.array[out.tensor.rows[out.index]]  # type: ignore[index]

    results = []
    for ahead in (None, 5, 6):
        rt = StageRuntime(LayerRange(loaded, 0, 2), device_handoff=True)
        run(rt, (5, 6, 7, 8), 0)
        run(rt, (9,), 4)
        if ahead is not None:
            rt.start_ahead(["a"], mx.array([ahead]))
        results.append((run(rt, (6,), 5), run(rt, (4,), 6), rt.ahead_used, rt.ahead_undone))
    plain, wrong, right = results
    assert (wrong[2:], right[2:]) == ((0, 1), (1, 0))
    for got in (wrong, right):
        assert mx.array_equal(got[0], plain[0]) and mx.array_equal(got[1], plain[1])


def test_a_failed_sampling_evaluation_fails_rows_also_when_the_next_step_starts_ahead(
    tiny: Path,
) -> None:
    """In one process the last stage submits its sampling and starts the entry stage's next
    step before reading the tokens: an evaluation that fails there still fails the sampled
    rows as sampling failures (it used to escape as a failed forward)."""
    import mlx.core as mx

    from mlxcel.pipeline.stage_protocol import ComputeJob, Sampled, Step, StepFailed
    from mlxcel.pipeline.stage_runtime import StageRuntime
    from mlxcel.runtime.model import LayerRange, load_model

    loaded = load_model(tiny)
    n = loaded.n_layers
    first = StageRuntime(LayerRange(loaded, 0, n // 2), device_handoff=True)
    last = StageRuntime(LayerRange(loaded, n // 2, n))
    last.ahead_to = first
    keys = [("a", 1), ("b", 1), ("c", 1)]
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.9, seed=3)

    def both(steps: list[Step]) -> list:
        hidden = first.run(ComputeJob(0, tuple(steps), True, False, False))[0]
        second = [
            Step(s.key, 0, None, h.tensor, s.n, s.start_pos, s.sampling, 0, s.sample, row=h.index)
            for s, h in zip(steps, hidden, strict=True)
        ]
        return last.run(ComputeJob(0, tuple(second), False, True, False))[0]

    for k in keys:
        both([Step(k, 0, (5, 6, 7, 8), None, 4, 0, greedy, 0, sample=False)])
    params = [greedy, hot, greedy]
    ok = both([Step(k, 0, (7,), None, 1, 4, p, 0) for k, p in zip(keys, params, strict=True)])
    assert all(isinstance(o, Sampled) for o in ok) and first.started_ahead

    def fails_when_evaluated(logprobs: mx.array) -> mx.array:
        singular = mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu)[0, 0]
        return mx.argmax(logprobs, -1) + (singular * 0).astype(mx.uint32)

    last.samplers[keys[1]] = fails_when_evaluated
    steps = [
        Step(k, 0, (o.token,), None, 1, 5, p, 0) for k, o, p in zip(keys, ok, params, strict=True)
    ]
    out = both(steps)
    assert all(isinstance(o, StepFailed) and o.why.startswith("sampling failed") for o in out)


def test_cluster_toml_accepts_the_original_engines_names_and_bounds_peer_timeout(
    tmp_path: Path,
) -> None:
    base = (
        'pipeline_parallel_size = 1\n[cluster]\n{extra}\n[[nodes]]\nid = "c"\n'
        'role = "coordinator"\naddress = "127.0.0.1:7000"\n[[nodes]]\nid = "s"\n'
        'role = "stage"\naddress = "127.0.0.2:7000"\n'
    )
    path = tmp_path / "c.toml"
    path.write_text(base.format(extra="max_reconnect_attempts = 9\npeer_timeout = 1.5"))
    c = load_cluster_config(path).cluster
    assert (c.reconnect_attempts, c.peer_timeout) == (9, 1.5)
    path.write_text(base.format(extra=""))
    assert load_cluster_config(path).cluster.peer_timeout == 3.0  # the default
    path.write_text(base.format(extra="peer_timeout = 0.1"))
    with pytest.raises(ConfigError, match="peer_timeout"):
        load_cluster_config(path)


async def test_the_openai_client_script_gets_what_one_node_gives_every_parameter(
    tiny: Path,
) -> None:
    """The final stage applies logit_bias and the penalties over the prompt's tail its claim
    carried, min_p, seeds, and returns top_logprobs: the one client script, one node's
    answers."""
    from tests import parity

    want = await parity.one_node(tiny)
    async with assemble(PipelineSpec(tiny, 2)) as st:
        got = await parity.served(st.serving)
    parity.assert_same(got, want, "in-process pipeline")


def test_bench_pipeline_refuses_a_link_rate_tc_would_not_take() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "bench", "pipeline", "--netns-rate", "1gb"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert "'1gb' is not a tc rate such as 1gbit, 100mbit or 512kbit" in r.stderr


def test_saturation_is_the_busiest_stage_only_where_stages_overlap() -> None:
    from mlxcel.bench.pipeline import _saturation

    def row(mode: str, streams: int, batches: int) -> dict[str, object]:
        stages = [{"busy": 0.5}, {"busy": 0.3}]
        return {"mode": mode, "streams": streams, "micro_batches": batches, "stages": stages}

    assert _saturation(row("remote-2", 8, 2)) == 0.5  # a micro-batch per stage: they overlap
    assert _saturation(row("remote-2", 1, 2)) == 0.8  # one stream: they take turns
    assert _saturation(row("remote-2", 8, 1)) == 0.8  # one micro-batch: turns too
    assert _saturation(row("inproc-2", 8, 2)) == 0.8  # one compute thread for both


async def test_bench_s_unprotected_frames_carry_no_tag() -> None:
    """The protection-cost row's nodes: inside frames_unprotected a connection's frames are
    the framing alone (the payload in the clear, no tag); outside it, AES-256-GCM again. Its
    stage processes start as ``python -m mlxcel.bench.unprotected``, mlxcel's own CLI."""
    from mlxcel.bench.unprotected import MODULE, frames_unprotected
    from mlxcel.net.listener import ClusterListener
    from mlxcel.net.pool import Backoff, ConnectionPool
    from mlxcel.net.secret import ClusterSecret
    from mlxcel.reactor.bus import Node
    from mlxcel.wire.frames import AeadProtection, Unprotected
    from mlxcel.wire.handshake import Identity

    key = ClusterSecret(bytes(range(32)), "test")

    async def dial() -> object:
        async with Node("a") as a, Node("b") as b:
            port = await ClusterListener(b, key, "127.0.0.1", 0).start()
            pool = ConnectionPool(a, key, Identity("127.0.0.1", 9), backoff=Backoff(attempts=1))
            conn = await pool.get("127.0.0.1", port)
            sealed = conn.protection.seal(1, b"activation")
            assert (b"activation" in sealed) is isinstance(conn.protection, Unprotected)
            return conn.protection

    with frames_unprotected():
        assert isinstance(await dial(), Unprotected)
    assert isinstance(await dial(), AeadProtection)
    r = subprocess.run([sys.executable, "-m", MODULE, "--version"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("mlxcel ")
