"""Real pipeline processes on 127.0.0.x: coordinator + stages, the openai client, faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from tests.conftest import error_line, free_port, mlx_mapped

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3"
MESSAGES = [{"role": "user", "content": "Tell me about pipelines"}]


CHAT = [
    {
        "role": "user",
        "content": "Our pipeline has three hosts. The first holds the embedding and layers "
        "zero to nine, the second the middle layers, the third the last layers and the head. "
        "Each decode step sends one activation per hop. What limits our tokens per second?",
    }
]


def second_turn(reply: str) -> list[dict[str, str]]:
    return [*CHAT, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]


def write_cluster(tmp: Path, n_stages: int, secret: Path) -> tuple[Path, list[str]]:
    coord = f"127.0.0.1:{free_port('127.0.0.1')}"
    stages = [f"127.0.0.{i + 2}:{free_port(f'127.0.0.{i + 2}')}" for i in range(n_stages)]
    lines = [
        f'name = "test-{n_stages}"',
        f"pipeline_parallel_size = {n_stages}",
        "[cluster]",
        f'secret_file = "{secret.name}"',
        "step_timeout = 20",
        "",
        "[[nodes]]",
        'id = "coordinator"',
        'role = "coordinator"',
        f'address = "{coord}"',
    ]
    for i, a in enumerate(stages):
        lines += ["", "[[nodes]]", f'id = "stage-{i}"', 'role = "stage"', f'address = "{a}"']
    path = tmp / f"cluster{n_stages}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path, stages


class Proc:
    def __init__(self, args: list[str], ready: str, env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        assert self.p.stdout is not None
        end = time.monotonic() + 120
        while time.monotonic() < end:
            line = self.p.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if ready in line:
                # Keep reading: a chatty process never blocks on a full pipe, and its later
                # lines (the access log) can be checked.
                self._drainer = threading.Thread(target=self._drain, daemon=True)
                self._drainer.start()
                return
        self.stop()
        raise RuntimeError(f"process did not become ready ({ready!r}):\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line)

    def output(self) -> str:
        """Everything it printed (call once it has exited)."""
        self._drainer.join(10)
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.returncode


def start_stage(model: Path, cfg: Path, i: int, *extra: str) -> Proc:
    return Proc(
        ["-m", str(model), "--distributed-config", str(cfg), "--node-id", f"stage-{i}", *extra],
        "mlxcel stage",
    )


def start_coordinator(model: Path, cfg: Path, port: int, *extra: str) -> Proc:
    return Proc(
        [
            "-m",
            str(model),
            "--distributed-config",
            str(cfg),
            "--node-id",
            "coordinator",
            "--port",
            str(port),
            "--served-model-name",
            MODEL,
            "--parallel",
            "8",
            *extra,
        ],
        "mlxcel serving",
    )


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict[str, str]:
    """Single-process greedy answers, through the same HTTP API."""
    port = free_port()
    p = Proc(["-m", str(tiny), "--port", str(port), "--served-model-name", MODEL], "mlxcel serving")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = {
            "chat": c.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
            )  # type: ignore[arg-type]
            .choices[0]
            .message.content
            or ""
        }
        reply = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)  # type: ignore[arg-type]
        out["turn1"] = reply.choices[0].message.content or ""
        out["turn2"] = (
            c.chat.completions.create(
                model=MODEL, messages=second_turn(out["turn1"]), max_tokens=16, temperature=0
            )  # fmt: skip
            .choices[0]
            .message.content
            or ""
        )
        for i in range(8):
            out[f"p{i}"] = (
                c.completions.create(
                    model=MODEL, prompt=f"Concurrent {i} prompt", max_tokens=12, temperature=0
                )
                .choices[0]
                .text
            )
        return out
    finally:
        p.stop()


@pytest.fixture(scope="module", params=[2, 3])
def cluster(
    request: pytest.FixtureRequest, tiny: Path, secret: Path
) -> Iterator[tuple[int, list[Proc], Proc, Path]]:
    n = request.param
    cfg, _ = write_cluster(secret.parent, n, secret)
    # The 3-stage cluster's middle stage starts as the seed's stage command does: --no-warmup.
    stages = [
        start_stage(tiny, cfg, i, *(["--no-warmup"] if (n, i) == (3, 1) else [])) for i in range(n)
    ]
    port = free_port()
    coord = start_coordinator(tiny, cfg, port)
    yield port, stages, coord, cfg
    assert coord.stop() == 0, "".join(coord.lines)
    for s in stages:
        assert s.stop() == 0, "".join(s.lines)


def test_a_chats_second_turn_starts_from_the_history_every_stage_kept(
    cluster, reference: dict[str, str]
) -> None:  # type: ignore[no-untyped-def]
    """The default prompt cache on a stage-process pipeline: turn 2 prefills only what is new
    on every stage, with the one-process answer; another tenant's probe reuses nothing."""
    port, _, _, _ = cluster
    c = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
    )
    first = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    assert first.choices[0].message.content == reference["turn1"]
    second = c.chat.completions.create(
        model=MODEL, messages=second_turn(reference["turn1"]), max_tokens=16, temperature=0
    )  # type: ignore[arg-type]
    assert second.choices[0].message.content == reference["turn2"]
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= 0.8 * second.usage.prompt_tokens, (cached, second.usage)
    # The same history under a cache_salt is another namespace: nothing to reuse.
    salted = c.chat.completions.create(
        model=MODEL,
        messages=second_turn(reference["turn1"]),
        max_tokens=16,
        temperature=0,
        extra_body={"cache_salt": "another tenant"},
    )  # type: ignore[arg-type]
    assert salted.choices[0].message.content == reference["turn2"]
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "mlxcel_prompt_cache_hits_total" in metrics
    assert "mlxcel_prompt_cache_tokens" in metrics


def settled_health(port: int, timeout: float = 5.0) -> dict:
    """/health once every stage holds no sequence: it answers from the coordinator's probe,
    refreshed every second, so a release shows up within about a second."""
    end = time.monotonic() + timeout
    while True:
        h = health(port)
        if all(s.get("sequences") == 0 for s in h["pipeline"]["stages"]):
            return h
        assert time.monotonic() < end, h
        time.sleep(0.2)


def health(port: int, path: str = "/health", want: int = 200) -> dict:
    """The JSON body of GET ``path``, which must answer ``want``."""
    try:
        r = urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
        status, body = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    assert want == 0 or status == want, body
    return json.loads(body)


def test_pipeline_answers_like_one_process(cluster, reference: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    port, stages, _, _ = cluster
    c = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
    )
    full = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert full.choices[0].message.content == reference["chat"]
    warmed = ["no warm-up" not in "".join(s.lines) for s in stages]
    assert warmed == [True, False, True][: len(stages)] if len(stages) == 3 else all(warmed)
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True
        )
        if ch.choices
    )  # type: ignore[arg-type]
    assert streamed == reference["chat"]

    async def concurrent() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        rs = await asyncio.gather(
            *(
                ac.completions.create(
                    model=MODEL, prompt=f"Concurrent {i} prompt", max_tokens=12, temperature=0
                )
                for i in range(8)
            )
        )
        await ac.close()
        return [r.choices[0].text for r in rs]

    got = asyncio.run(concurrent())
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        assert got == [reference[f"p{i}"] for i in range(8)]
    else:
        # GPU matmuls are not batch-invariant: requests that share a forward pass can break
        # near-ties differently from the same requests run one at a time (the one-process
        # engine behaves the same way). One at a time, above, the answers are exact.
        assert len(got) == 8 and all(isinstance(t, str) for t in got)
    h = settled_health(port)
    assert len(h["pipeline"]["stages"]) == len(stages)
    # One notation for layer ranges: /health says what the stages' log lines say.
    for st, proc in zip(h["pipeline"]["stages"], stages, strict=True):
        assert f"(layers {st['layers']})" in "".join(proc.lines), st
    # Every process says at start which BLAS it computes on (the stages too).
    for proc in [*stages, cluster[2]]:
        assert "BLAS: " in "".join(proc.lines), "".join(proc.lines)[-2000:]
    # The coordinator holds no model and never loads MLX; the stages do.
    assert not mlx_mapped(cluster[2].p.pid)
    assert all(mlx_mapped(s.p.pid) for s in stages)


def test_the_openai_client_script_gets_what_one_node_gives_every_parameter(
    cluster, tiny: Path
) -> None:  # type: ignore[no-untyped-def]
    """Stage processes on 127.0.0.x: logprobs and top_logprobs, min_p, logit_bias, penalties,
    seed, stop and tools answer as one node does."""
    from tests import parity

    port = cluster[0]
    want = asyncio.run(parity.one_node(tiny, MODEL))
    got = asyncio.run(parity.against(f"http://127.0.0.1:{port}", MODEL))
    parity.assert_same(got, want, "remote pipeline")


def test_stage_with_another_secret_fails_the_coordinator_at_startup(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    cfg, _ = write_cluster(secret.parent, 2, secret)
    other = tmp_path / "other.secret"
    subprocess.run(
        [sys.executable, "-m", "mlxcel", "keygen", "--out", str(other)], check=True, timeout=60
    )
    s0 = start_stage(tiny, cfg, 0)
    s1 = start_stage(tiny, cfg, 1, "--cluster-secret-file", str(other))
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlxcel",
                "serve",
                "-m",
                str(tiny),
                "--distributed-config",
                str(cfg),
                "--node-id",
                "coordinator",
                "--port",
                str(free_port()),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert r.returncode == 1
        assert "stage-1" in r.stderr and "secret mismatch" in r.stderr
        assert secret.read_text().strip() not in r.stderr
    finally:
        s0.stop()
        s1.stop()


def test_a_stage_with_other_weights_of_the_same_shape_fails_the_coordinator_at_startup(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    """Same config, file names and sizes, other values (another seed): refused with both
    weight digests named; a stage started with --trust-weights is not compared."""
    from mlxcel.bringup.identity import model_identity
    from mlxcel.runtime.checkpoint import write_checkpoint

    other = write_checkpoint(tmp_path / "seed7", "tiny", "qwen3", seed=7)
    ours, theirs = model_identity(tiny).weights, model_identity(other).weights
    assert ours != theirs
    cfg, _ = write_cluster(secret.parent, 2, secret)
    s0 = start_stage(tiny, cfg, 0)
    s1 = start_stage(other, cfg, 1)
    try:
        argv = [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny),
                "--distributed-config", str(cfg), "--node-id", "coordinator"]  # fmt: skip
        r = subprocess.run(
            [*argv, "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert r.returncode == 1
        assert f"stage stage-1's weights have digest {theirs[:16]}" in r.stderr
        assert f"this node's {ours[:16]}" in r.stderr
        s1.stop()
        s1 = start_stage(other, cfg, 1, "--trust-weights")
        c = start_coordinator(tiny, cfg, free_port())
        c.stop()
        assert "stage stage-1: weights not compared" in "".join(c.lines)
    finally:
        s0.stop()
        s1.stop()


def test_missing_secret_is_refused_naming_every_source(tiny: Path, tmp_path: Path) -> None:
    cfg, _ = write_cluster(tmp_path, 2, tmp_path / "absent.secret")
    cfg.write_text(cfg.read_text().replace('secret_file = "absent.secret"\n', ""))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "serve",
            "-m",
            str(tiny),
            "--distributed-config",
            str(cfg),
            "--node-id",
            "stage-0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_CLUSTER")},
    )
    assert r.returncode == 1
    for src in (
        "--cluster-secret-file",
        "MLXCEL_CLUSTER_SECRET_FILE",
        "MLXCEL_CLUSTER_SECRET",
        "[cluster]",
    ):
        assert src in r.stderr


@contextmanager
def two_stage_cluster(
    tiny: Path, secret: Path, *coord_args: str
) -> Iterator[tuple[list[Proc], Path, int]]:
    """Stage 0, stage 1 and a coordinator as processes: yields them, the config and the port.

    At the end it stops whatever the list then holds (a test that restarts a stage puts
    the new process in the list)."""
    cfg, _ = write_cluster(secret.parent, 2, secret)
    procs = [start_stage(tiny, cfg, 0), start_stage(tiny, cfg, 1)]
    port = free_port()
    procs.append(start_coordinator(tiny, cfg, port, *coord_args))
    try:
        yield procs, cfg, port  # type: ignore[misc]
    finally:
        for p in reversed(procs):
            p.stop()


def test_killed_stage_fails_the_request_then_the_cluster_recovers(
    tiny: Path, secret: Path, reference: dict[str, str]
) -> None:
    with two_stage_cluster(tiny, secret) as (procs, cfg, port):
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
        )
        stream = c.completions.create(
            model=MODEL, prompt="long", max_tokens=3000, temperature=0, stream=True
        )
        got = 0
        t_kill = None
        with pytest.raises(openai.APIError) as info:
            for _chunk in stream:
                got += 1
                if got == 5:
                    procs[1].p.kill()
                    procs[1].p.wait()
                    t_kill = time.monotonic()
        assert (
            t_kill is not None and time.monotonic() - t_kill < 15
        )  # well before the 20 s step deadline
        assert "unreachable" in str(info.value) or "stage" in str(info.value), str(info.value)
        # The access log shows the real outcome, not a bare 200.
        end = time.monotonic() + 5.0
        while "POST /v1/completions 200 stream-error=stage_unreachable" not in "".join(
            procs[2].lines
        ):
            assert time.monotonic() < end, "".join(procs[2].lines)[-3000:]
            time.sleep(0.1)
        # Not ready while a stage is down (a load balancer stops sending), but alive: the
        # coordinator's probe finds it gone within a couple of seconds.
        end = time.monotonic() + 5.0
        while (down := health(port, want=0))["status"] == "ok":
            assert time.monotonic() < end, down
            time.sleep(0.1)
        assert down["status"] == "degraded"
        assert "error" in down["pipeline"]["stages"][1]
        assert down["pipeline"]["stages"][1]["id"] == "stage-1"  # last known, still named
        assert health(port, "/health/live")["status"] == "alive"
        procs[1] = start_stage(tiny, cfg, 1)
        # The coordinator's probe hears it again within about a second (until then a request
        # gets 503 with Retry-After at once).
        end = time.monotonic() + 10.0
        while (h := health(port, want=0))["status"] != "ok":
            assert time.monotonic() < end, h
            time.sleep(0.2)
        ok = c.completions.create(
            model=MODEL, prompt="Concurrent 0 prompt", max_tokens=12, temperature=0
        )
        # The restarted stage answers like one process, token for token.
        assert ok.choices[0].text == reference["p0"]
        assert ok.usage is not None and ok.usage.completion_tokens == 12
        h = settled_health(port)
        assert h["status"] == "ok"
        assert [s["sequences"] for s in h["pipeline"]["stages"]] == [0, 0]
        assert h["in_flight"] == 0 and h["pipeline"]["failed"] >= 1


def test_sigterm_on_a_stage_drains_then_exits(tiny: Path, secret: Path) -> None:
    with two_stage_cluster(tiny, secret) as (procs, _cfg, port):
        s0 = procs[0]
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
        )
        stream = c.completions.create(
            model=MODEL, prompt="drain me", max_tokens=300, temperature=0, stream=True
        )
        it = iter(stream)
        next(it)
        s0.p.send_signal(signal.SIGTERM)  # drains: the running request still completes
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "length"
        assert s0.p.wait(30) == 0
        assert "draining" in s0.output()


def test_long_prompt_streams_between_decode_steps_and_frees_every_cache(
    tiny: Path, secret: Path
) -> None:
    """A prompt of many prefill chunks while 4 short streams decode, on stage processes."""
    chunk = 16
    long_prompt = " ".join(f"w{i}" for i in range(400))
    with two_stage_cluster(tiny, secret, "--prefill-step-size", str(chunk)) as (_, _cfg, port):
        base = f"http://127.0.0.1:{port}/v1"

        async def run() -> dict[str, object]:
            ac = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0, timeout=120)
            short_times: list[list[float]] = [[] for _ in range(4)]
            started = asyncio.Event()

            async def short(i: int) -> str | None:
                s = await ac.completions.create(
                    model=MODEL, prompt=f"short {i}", max_tokens=80, temperature=0, stream=True
                )
                finish = None
                async for ch in s:
                    short_times[i].append(time.monotonic())
                    finish = ch.choices[0].finish_reason or finish
                    if sum(len(t) for t in short_times) >= 12:
                        started.set()
                return finish

            tasks = [asyncio.create_task(short(i)) for i in range(4)]
            await started.wait()
            t0 = time.monotonic()
            long = await ac.completions.create(
                model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0, stream=True
            )
            t_first = None
            finish = None
            async for ch in long:
                t_first = t_first or time.monotonic()
                finish = ch.choices[0].finish_reason or finish
            finishes = await asyncio.gather(*tasks)
            await ac.close()
            return {
                "t0": t0,
                "t_first": t_first,
                "finish": finish,
                "shorts": finishes,
                "short_times": short_times,
            }

        r = asyncio.run(run())
        prompt_tokens = (
            openai.OpenAI(base_url=base, api_key="x")
            .completions.create(model=MODEL, prompt=long_prompt, max_tokens=1, temperature=0)
            .usage.prompt_tokens
        )  # type: ignore[union-attr]
        n_chunks = -(-prompt_tokens // chunk)
        assert n_chunks >= 8
        assert r["finish"] == "length"
        assert all(f in ("length", "stop") for f in r["shorts"])  # type: ignore[union-attr]
        t0, t1 = float(r["t0"]), float(r["t_first"])  # type: ignore[arg-type]
        times: list[list[float]] = r["short_times"]  # type: ignore[assignment]
        during = sum(1 for ts in times for t in ts if t0 < t < t1)
        assert during > 0, "no short stream produced a token while the long prompt prefilled"
        gaps = sorted(b - a for ts in times for a, b in zip(ts, ts[1:], strict=False))
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
        print(
            f"\nlong prompt: {prompt_tokens} tokens in {n_chunks} chunks of {chunk}; "
            f"prefill {1e3 * (t1 - t0):.1f} ms = {1e3 * (t1 - t0) / n_chunks:.2f} ms/chunk; "
            f"short streams: {during} tokens during the prefill, inter-token p99 {1e3 * p99:.2f} ms"
        )
        h = settled_health(port)
        assert [s["sequences"] for s in h["pipeline"]["stages"]] == [0, 0]
        assert h["in_flight"] == 0


def test_pp_micro_batch_size_and_max_batch_size_are_honoured(tiny: Path) -> None:
    """In-process ``serve --pp-size 2``: both flags change what the stages do."""

    def run(*flags: str) -> dict:
        port = free_port()
        p = Proc(
            [
                "-m",
                str(tiny),
                "--port",
                str(port),
                "--served-model-name",
                MODEL,
                "--pp-size",
                "2",
                *flags,
            ],
            "mlxcel serving",
        )
        try:

            async def many() -> list[str | None]:
                ac = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
                )
                rs = await asyncio.gather(
                    *(
                        ac.completions.create(
                            model=MODEL, prompt=f"batch {i}", max_tokens=24, temperature=0
                        )
                        for i in range(6)
                    )
                )
                await ac.close()
                return [r.choices[0].finish_reason for r in rs]

            assert asyncio.run(many()) == ["length"] * 6
            return health(port)["pipeline"]
        finally:
            assert p.stop() == 0

    # Micro-batches of one: six requests in flight at once, every stage runs one at a time.
    one = run("--pp-micro-batch-size", "1", "--parallel", "6")
    assert one["micro_batch_size"] == 1 and one["peak_in_flight"] == 6
    assert all(s["largest_batch"] == 1 for s in one["stages"])
    # Two micro-batches of three travel and run together (the first steps may be apart).
    three = run("--pp-micro-batch-size", "3", "--parallel", "6")
    assert three["micro_batch_size"] == 3
    assert all(s["largest_batch"] == 3 for s in three["stages"])
    # The in-process default: one micro-batch of --parallel (its stages share one compute
    # thread, so a second micro-batch could not overlap), no more than --max-batch-size.
    six = run("--parallel", "6", "--max-batch-size", "6")
    assert six["micro_batch_size"] == 6 and six["peak_in_flight"] == 6
    assert all(s["largest_batch"] == 6 for s in six["stages"])
    two = run("--parallel", "6", "--max-batch-size", "2")
    assert two["micro_batch_size"] == 2 and two["peak_in_flight"] > 1
    assert all(s["largest_batch"] == 2 for s in two["stages"])


def test_busy_stage_port_and_missing_stages_fail_in_one_line(
    tiny: Path, secret: Path, tmp_path: Path
) -> None:
    import socket

    cfg, stages = write_cluster(secret.parent, 2, secret)
    host, port = stages[0].rsplit(":", 1)
    with socket.socket() as s:
        s.bind((host, int(port)))
        s.listen()
        r = subprocess.run(
            [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny)]
            + ["--distributed-config", str(cfg), "--node-id", "stage-0"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = error_line(r.stderr)
    assert stages[0] in line and "address already in use" in line
    # A coordinator whose stages never come says what it waits for, then gives up.
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny)]
        + ["--distributed-config", str(cfg), "--node-id", "coordinator"]
        + ["--port", str(free_port()), "--startup-timeout", "7"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"waiting for stage stage-0 at {stages[0]}" in r.stderr
    line = error_line(r.stderr)
    assert "unreachable within 7s (--startup-timeout)" in line


def _flip_length(data: bytes) -> bytes:
    """Announce 1000 more body bytes than follow (still under the frame cap): a stall."""
    b = bytearray(data)
    b[3] = (b[3] + 4) % 256  # the length's second-lowest byte: +1024
    return bytes(b)


def test_wedged_frames_are_replaced_and_the_next_request_succeeds(tiny: Path, secret: Path) -> None:
    """A relay between the coordinator (here) and stage 0 (a process) flips a length byte,
    truncates, drops and stalls RunEntry frames; each time the request fails quickly and the
    next one succeeds on a fresh connection."""
    from mlxcel.base.errors import EngineError
    from mlxcel.base.messages import SamplingParams
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.pipeline.cluster_config import load_cluster_config
    from mlxcel.serving.assembly import CoordinatorSpec, assemble
    from tests.wiretap import WireTap

    cfg_path, stages = write_cluster(secret.parent, 2, secret)
    cfg_path.write_text(
        cfg_path.read_text().replace("step_timeout = 20", "step_timeout = 3\nframe_timeout = 1.5")
    )
    procs = [start_stage(tiny, cfg_path, 0), start_stage(tiny, cfg_path, 1)]

    async def run() -> list[str]:
        cfg = load_cluster_config(cfg_path)
        sec = load_cluster_secret(None, {}, cfg_path)
        assert sec is not None
        out = []
        async with assemble(CoordinatorSpec(cfg, cfg.coordinator, tiny, sec)) as rc:
            s0 = stages[0]
            host, port = s0.rsplit(":", 1)
            tap = WireTap("127.0.0.8", (host, int(port)), bind_ip="127.0.0.1")
            rc.parts.endpoint.pool.routes[s0] = ("127.0.0.8", await tap.start())
            rc.parts.endpoint.reset(
                s0
            )  # from now on, coordinator -> stage 0 goes through the relay
            fe = rc.frontend

            async def ask(n: int = 4) -> int:
                got = 0
                it = fe.stream(fe.encode_prompt("wedge test"), SamplingParams(max_tokens=n))
                async for d in it:
                    got += len(d.token_ids)
                return got

            assert await ask() == 4
            faults = {
                "flipped length": lambda: tap.once(_flip_length),
                "truncated frame": lambda: tap.once(lambda d: d[: len(d) // 2]),
                "dropped frame": lambda: tap.once(lambda d: None),
                "stalled frame (5 s)": lambda: setattr(tap, "delay_up", 5.0),
            }
            loop = asyncio.get_running_loop()
            for name, arm in faults.items():
                await asyncio.sleep(0.3)  # the last request's releases are out: hit a RunEntry
                arm()
                t0 = loop.time()
                with pytest.raises(EngineError) as info:
                    await ask(8)
                failed_after = loop.time() - t0
                # A stage that answered nothing for the probe's 2 s (the stall) is down until
                # it answers again; then the next request succeeds. (The probe under way at
                # the fault decides within its 2 s: wait that out first.)
                await asyncio.sleep(2.2)
                while rc.parts.coordinator.coord.down:
                    assert loop.time() - t0 < 10, rc.parts.coordinator.coord.down
                    await asyncio.sleep(0.05)
                assert await ask() == 4
                recovered = loop.time() - t0
                out.append(
                    f"{name}: request failed after {failed_after:.2f}s ({info.value.code}), "
                    f"next request succeeded {recovered:.2f}s after the fault"
                )
                assert failed_after < 3 + 1.5  # one step deadline at most, never 30 s
            # The other direction: the final stage's own connection to us, which carries its
            # results, drops mid-request. That is losing the stage too: fail at once.
            long = asyncio.create_task(ask(400))
            await asyncio.sleep(0.5)
            t0 = loop.time()
            inbound = rc.parts.endpoint.listener.connection_for(stages[1])  # type: ignore[union-attr]
            assert inbound is not None
            inbound.close()
            with pytest.raises(EngineError) as info:
                await long
            # The client learns which stage by name, never its address.
            assert str(info.value) == "lost the connection to stage-1"
            assert info.value.code == "stage_unreachable"
            out.append(f"results connection lost: request failed after {loop.time() - t0:.2f}s")
            assert loop.time() - t0 < 2.5  # at once: well before the 3 s step deadline
            assert await ask() == 4
            tap.close()
        return out

    try:
        lines = asyncio.run(run())
        print("\n" + "\n".join(lines))
    finally:
        for p in procs:
            p.stop()


def test_a_step_longer_than_the_step_deadline_completes_while_its_stages_report_progress(
    tiny: Path, secret: Path
) -> None:
    """One 3000-token prompt chunk takes seconds on a CPU, more than the 1 s step deadline set
    here (as the first requests on a fresh GPU do while kernels compile). The stages holding
    it say so (Progress), so the request completes instead of failing deadline_exceeded."""
    from mlxcel.base.messages import SamplingParams
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.pipeline.cluster_config import load_cluster_config
    from mlxcel.serving.assembly import CoordinatorSpec, Generation, assemble

    cfg_path, _ = write_cluster(secret.parent, 2, secret)
    cfg_path.write_text(cfg_path.read_text().replace("step_timeout = 20", "step_timeout = 1"))
    procs = [start_stage(tiny, cfg_path, 0), start_stage(tiny, cfg_path, 1)]

    async def run() -> tuple[list[int], int, float]:
        cfg = load_cluster_config(cfg_path)
        sec = load_cluster_secret(None, {}, cfg_path)
        assert sec is not None
        spec = CoordinatorSpec(cfg, cfg.coordinator, tiny, sec)
        async with assemble(spec, Generation(prefill_step_size=3000)) as rc:
            prompt = [1 + (7 * i) % 500 for i in range(3001)]  # one chunk, then the last token
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            tokens: list[int] = []
            async for d in rc.frontend.stream(prompt, SamplingParams(max_tokens=3)):
                tokens += d.token_ids
            return tokens, rc.parts.coordinator.coord.kept_alive, loop.time() - t0

    try:
        tokens, kept_alive, took = asyncio.run(run())
    finally:
        for p in procs:
            p.stop()
    print(
        f"\n3001-token prompt through 2 stages in {took:.2f}s; {kept_alive} exchange(s) kept alive past the deadline"
    )
    assert len(tokens) == 3 and kept_alive > 0


def test_undecodable_messages_are_answered_with_an_error_carrying_the_nonce(
    tiny: Path, secret: Path
) -> None:
    """A tensor whose bytes do not match its shape, a top_k beyond 64 bits: once dropped in
    silence (the request waited 30 s); now the exchange fails at once."""
    import cbor2

    from mlxcel.base.deadlines import deadline_in
    from mlxcel.base.messages import Ack, Error, PrepareSequence
    from mlxcel.net.listener import ClusterListener
    from mlxcel.net.pool import ConnectionPool
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.reactor.bus import Envelope, Node
    from mlxcel.wire.handshake import Identity

    cfg, stages = write_cluster(secret.parent, 2, secret)
    coord = cfg.read_text().split('address = "')[1].split('"')[0]
    procs = [start_stage(tiny, cfg, 0), start_stage(tiny, cfg, 1)]

    async def run() -> list[Error]:
        sec = load_cluster_secret(None, {}, cfg)
        assert sec is not None
        errors: list[Error] = []
        acks: list[Ack] = []
        async with Node("fake-coordinator") as node:

            async def on_error(env: Envelope[Error]) -> None:
                errors.append(env.msg)

            async def on_ack(env: Envelope[Ack]) -> None:
                acks.append(env.msg)

            node.bus.subscribe(Error, on_error)
            node.bus.subscribe(Ack, on_ack)
            host, port = coord.rsplit(":", 1)
            await ClusterListener(node, sec, host, int(port)).start()
            as_coord = ConnectionPool(node, sec, Identity(host, int(port), "coordinator"))
            s0h, s0p = stages[0].rsplit(":", 1)
            s1h, s1p = stages[1].rsplit(":", 1)
            to0 = await as_coord.get(s0h, int(s0p))
            to1 = await as_coord.get(s1h, int(s1p))
            for conn in (to0, to1):
                await conn.send(PrepareSequence("r1", 64, 1), deadline_in(5))
            for _ in range(200):
                if len(acks) == 2:
                    break
                await asyncio.sleep(0.02)
            sampling = {
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 2**65,
                "seed": None,
                "max_tokens": 4,
                "logprobs": False,
            }
            entry = {
                "kind": 2,
                "request_id": "r1",
                "micro_batch": 0,
                "token_ids": [1, 2],
                "start_pos": 0,
                "sampling": sampling,
                "nonce": 41,
            }
            await to0.send_payload(cbor2.dumps(entry), deadline_in(5))
            # stage 0 -> stage 1: an activation whose tensor bytes do not match its shape.
            as_stage0 = ConnectionPool(node, sec, Identity(s0h, int(s0p), "stage-0"), bind_ip=s0h)
            up = await as_stage0.get(s1h, int(s1p))
            sampling["top_k"] = 0
            act = {
                "kind": 3,
                "request_id": "r1",
                "micro_batch": 0,
                "hidden": {"dtype": "float32", "shape": [1, 1, 64], "data": b"\0" * 10},
                "start_pos": 0,
                "sampling": sampling,
                "nonce": 42,
            }
            await up.send_payload(cbor2.dumps(act), deadline_in(5))
            for _ in range(250):
                if len(errors) >= 2:
                    break
                await asyncio.sleep(0.02)
        return errors

    try:
        errors = asyncio.run(run())
    finally:
        for p in procs:
            p.stop()
    by_nonce = {e.nonce: e for e in errors}
    assert set(by_nonce) == {41, 42}, errors
    assert all(e.code == "bad_message" and e.request_id == "r1" for e in by_nonce.values())
    assert "64-bit" in by_nonce[41].message and "needs 256 bytes" in by_nonce[42].message


def test_refused_members_cannot_pile_up_connections_or_logs(tiny: Path, secret: Path) -> None:
    """A member claiming many listener ports, each refused: the stage answers every refusal
    on a one-off connection (its open files return to where they were), and its log stays
    rate-limited however long the request ids (an attack run grew a stage log by 60 MB)."""
    from mlxcel.base.deadlines import deadline_in
    from mlxcel.base.errors import MlxcelError
    from mlxcel.base.messages import Error, PrepareSequence, RunEntry, SamplingParams
    from mlxcel.net.listener import ClusterListener
    from mlxcel.net.pool import ConnectionPool
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.reactor.bus import Envelope, Node
    from mlxcel.wire.handshake import Identity

    cfg, stages = write_cluster(secret.parent, 2, secret)
    stage = start_stage(tiny, cfg, 0)
    fds = Path(f"/proc/{stage.p.pid}/fd")

    async def attack() -> int:
        sec = load_cluster_secret(None, {}, cfg)
        assert sec is not None
        refusals: list[Error] = []
        host, port = stages[0].rsplit(":", 1)
        async with Node("member") as node:

            async def on_error(env: Envelope[Error]) -> None:
                refusals.append(env.msg)

            node.bus.subscribe(Error, on_error)
            for i in range(20):
                lst = ClusterListener(node, sec, "127.0.0.9", 0)
                claimed = await lst.start()
                p = ConnectionPool(
                    node, sec, Identity("127.0.0.9", claimed, f"m{i}"), bind_ip="127.0.0.9"
                )
                conn = await p.get(host, int(port))
                await conn.send(PrepareSequence(f"x{i}", 8, i), deadline_in(5))
                if i == 0:
                    for j in range(300):
                        rid = f"{j}-" + "A" * 10_000
                        entry = RunEntry(rid, 0, (1,), 0, SamplingParams(), j)
                        try:
                            await conn.send(entry, deadline_in(5))
                        except (ConnectionError, MlxcelError):
                            # The stage closes a refused stranger's connection once it has
                            # answered on it: a persistent one dials again and goes on.
                            conn = await p.get(host, int(port))
            for _ in range(300):
                if len(refusals) >= 20:
                    break
                await asyncio.sleep(0.05)
        return len(refusals)

    try:
        before = len(list(fds.iterdir()))
        answered = asyncio.run(attack())
        time.sleep(1.5)
        after = len(list(fds.iterdir()))
    finally:
        stage.stop()
    refusing = [ln for ln in stage.output().splitlines() if "refusing" in ln]
    assert answered >= 20
    assert after <= before + 2, (before, after)
    assert len(refusing) <= 10, len(refusing)
    assert max(len(ln) for ln in refusing) < 700


LAUNCHER = """
import asyncio, sys
from pathlib import Path
from mlxcel.pipeline.launch import LoopbackCluster

async def main():
    async with LoopbackCluster(Path(sys.argv[1]), 2, Path(sys.argv[2]), spawn_coordinator=False) as cl:
        print(" ".join(str(p.pid) for _, p, _ in cl.procs), flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_stage_processes_go_when_their_launcher_is_killed(tiny: Path, tmp_path: Path) -> None:
    """A benchmark or test killed outright (SIGKILL: no cleanup runs) used to leave its stage
    processes serving forever; now each gets SIGTERM from the kernel and exits."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tiny), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        launcher.kill()
        launcher.wait()
    end = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == []


def test_a_stale_parent_pid_does_not_kill_a_process_someone_else_started() -> None:
    """MLXCEL_PARENT_PID left in a shell (not this process's parent) is ignored."""
    env = {**os.environ, "MLXCEL_PARENT_PID": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "--help"], env=env, capture_output=True, timeout=60
    )
    assert r.returncode == 0 and b"usage" in r.stdout


def test_a_starting_node_is_waited_for_while_it_writes_and_given_up_when_silent(
    tmp_path: Path,
) -> None:
    """The launchers wait on a node's log: one that keeps writing (a stage warming up on a
    fresh GPU, minutes of kernel compiles) is waited for past the silence window; one that
    goes silent is given up after it, not after a fixed total."""
    from mlxcel.pipeline.launch import wait_ready

    async def run(script: str, silence: float, limit: float = 60.0) -> tuple[bool, float]:
        log = tmp_path / "node.log"
        with open(log, "w") as fh:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-u", "-c", script, stdout=fh, stderr=fh
            )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ok = await wait_ready(proc, log, "READY", silence=silence, limit=limit)
        took = loop.time() - t0
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        return ok, took

    serve = "print('READY'); time.sleep(30)"  # a node that is ready keeps running
    busy = f"import time\nfor i in range(10):\n    print('warm-up', i); time.sleep(0.4)\n{serve}"
    ok, took = asyncio.run(run(busy, silence=2.0))
    assert ok and took > 3.0  # 4 s of output, twice the silence window: still waited for
    ok, took = asyncio.run(run("import time\nprint('loading'); time.sleep(30)", silence=2.0))
    assert not ok and took < 12  # silent: given up after the window
    ok, _ = asyncio.run(run("raise SystemExit(3)", silence=5.0))
    assert not ok
    forever = "import time\nwhile True:\n    print('busy'); time.sleep(0.2)"
    ok, took = asyncio.run(run(forever, silence=2.0, limit=1.5))
    assert not ok and took < 8  # writing forever is not starting: the overall limit
    half = "import sys, time\nsys.stdout.buffer.write(b'\\xc3'); sys.stdout.flush()\n"
    ok, _ = asyncio.run(run(half + f"time.sleep(1)\n{serve}", silence=5.0))
    assert ok  # a UTF-8 character cut in half by a read is no error


def test_a_stage_whose_cluster_port_is_taken_says_so_before_loading_the_model(
    tiny: Path, secret: Path
) -> None:
    cfg, stages = write_cluster(secret.parent, 2, secret)
    host, port = stages[0].rsplit(":", 1)
    with socket.socket() as busy:
        busy.bind((host, int(port)))
        busy.listen()
        r = subprocess.run(
            [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny), "--distributed-config",
             str(cfg), "--node-id", "stage-0"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"cannot listen for cluster connections on {host}:{port}" in r.stderr
    assert "loaded model" not in r.stderr  # found before the weights were read
