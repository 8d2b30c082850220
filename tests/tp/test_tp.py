"""Tensor parallelism: ranks are real processes joined by mx.distributed's ring backend."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import aclosing
from pathlib import Path

import openai
import pytest

from mlxcel.base.errors import ConfigError
from mlxcel.base.messages import SamplingParams
from mlxcel.serving.assembly import LocalSpec, assemble
from mlxcel.tp.group import check_modes, check_shardable
from tests.conftest import ServerProcess, error_line

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def run(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def local_hostfile(n: int, folder: Path) -> Path:
    """A hostfile for ``n`` ranks started by hand on this host (free loopback ports)."""
    from mlxcel.tp.rendezvous import free_port

    path = folder / "tp-hostfile.json"
    path.write_text(json.dumps([[f"127.0.0.1:{free_port('127.0.0.1')}"] for _ in range(n)]))
    return path


def with_secret(tmp_path: Path) -> dict[str, str]:
    """The environment of ranks started by hand: the cluster secret their step key comes from."""
    from mlxcel.net.secret import keygen

    path = keygen(tmp_path / "cluster.secret")
    return {**os.environ, "MLXCEL_CLUSTER_SECRET_FILE": str(path)}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_generate_tp2_prints_the_single_process_tokens(
    checkpoints: dict[str, Path], family: str
) -> None:
    model = str(checkpoints[family])
    single = run("generate", "-m", model, "-p", "Hello there", "-n", "16")
    tp = run("generate", "-m", model, "-p", "Hello there", "-n", "16", "--tp-size", "2")
    assert single.returncode == 0 and tp.returncode == 0, tp.stderr
    assert tp.stdout.rsplit("\n", 2)[0] == single.stdout.rsplit("\n", 2)[0]
    assert "generated tokens: 16" in tp.stdout
    assert "decode path: batched forward on every rank" in tp.stderr


def test_uneven_sharding_is_refused_before_loading(tiny: Path) -> None:
    t0 = time.monotonic()
    r = run("generate", "-m", str(tiny), "--tp-size", "3")
    assert r.returncode == 2
    assert (
        "attention heads 4" in r.stderr and "key/value heads 2" in r.stderr and "by 3" in r.stderr
    )
    assert time.monotonic() - t0 < 30
    with pytest.raises(ConfigError, match="key/value heads 2"):
        check_shardable(json.loads((tiny / "config.json").read_text()), 4)
    check_shardable(json.loads((tiny / "config.json").read_text()), 2)


@pytest.mark.parametrize("flag", ["--tp-moe-mode", "--tp-embedding-mode", "--tp-lm-head-mode"])
def test_unsupported_modes_are_refused(tiny: Path, flag: str) -> None:
    r = run("generate", "-m", str(tiny), "--tp-size", "2", flag, "sharded")
    assert r.returncode == 2 and flag in r.stderr and "not implemented" in r.stderr
    with pytest.raises(ConfigError):
        check_modes("replicated", "replicated", "sharded")
    bad = run("generate", "-m", str(tiny), "--tp-size", "2", flag, "bogus")
    assert bad.returncode == 2 and flag in bad.stderr


def test_tp_and_pp_together_are_refused(tiny: Path) -> None:
    r = run("generate", "-m", str(tiny), "--tp-size", "2", "--pp-size", "2")
    assert r.returncode == 2 and "cannot be combined" in r.stderr


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path], family: str) -> list[str]:
    async def go() -> list[str]:
        async with assemble(LocalSpec(checkpoints[family])) as st:
            fe = st.frontend
            out = []
            for i in range(4):
                text = []
                async with aclosing(
                    fe.stream(
                        fe.encode_prompt(f"Concurrent {i} prompt"), SamplingParams(max_tokens=12)
                    )
                ) as it:
                    async for d in it:
                        text.append(d.text)
                out.append("".join(text))
            # A bias away from the greedy first token changes the token fed back to every
            # rank: each must apply the same processors (and penalties), or they diverge.
            ids: list[int] = []
            async with aclosing(
                fe.stream(fe.encode_prompt("Concurrent 0 prompt"), SamplingParams(max_tokens=1))
            ) as it:
                async for d in it:
                    ids += d.token_ids
            text = []
            pen = SamplingParams(
                max_tokens=12,
                logit_bias_ids=(ids[0],),
                logit_bias_values=(-100.0,),
                presence_penalty=2.0,
                repetition_penalty=1.5,
            )
            async with aclosing(fe.stream(fe.encode_prompt("Concurrent 0 prompt"), pen)) as it:
                async for d in it:
                    text.append(d.text)
            out.append("".join(text))
            out.append(str(ids[0]))
            return out

    return asyncio.run(go())


def test_serve_tp2_through_the_openai_client(
    checkpoints: dict[str, Path], family: str, reference: list[str], start_server
) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(
        [
            "-m",
            str(checkpoints[family]),
            "--tp-size",
            "2",
            "--served-model-name",
            MODEL,
            "--parallel",
            "4",
        ]
    )

    async def concurrent() -> list[str]:
        ac = openai.AsyncOpenAI(
            base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60
        )
        rs = await asyncio.gather(
            *(
                ac.completions.create(
                    model=MODEL, prompt=f"Concurrent {i} prompt", max_tokens=12, temperature=0
                )
                for i in range(4)
            )
        )
        await ac.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(concurrent()) == reference[:4]
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL, prompt="Concurrent 0 prompt", max_tokens=12, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == reference[0]
    penalized = c.completions.create(
        model=MODEL,
        prompt="Concurrent 0 prompt",
        max_tokens=12,
        temperature=0,
        presence_penalty=2.0,
        logit_bias={reference[5]: -100},
        extra_body={"repetition_penalty": 1.5},
    )
    assert penalized.choices[0].text == reference[4] != reference[0]
    a = c.completions.create(model=MODEL, prompt="seeded", max_tokens=8, temperature=0.9, seed=11)
    b = c.completions.create(model=MODEL, prompt="seeded", max_tokens=8, temperature=0.9, seed=11)
    assert a.choices[0].text == b.choices[0].text
    # Unseeded sampling must also stay in step across ranks (rank 0 seeds it): it completes.
    u = c.completions.create(model=MODEL, prompt="unseeded", max_tokens=8, temperature=1.0)
    # (an unseeded draw may hit the end-of-sequence token early; it must still finish)
    assert u.usage is not None and 1 <= u.usage.completion_tokens <= 8
    assert u.choices[0].finish_reason in ("stop", "length")
    # The one client script: every parameter, one node's answers (logprobs within tolerance).
    from tests import parity

    want = asyncio.run(parity.one_node(checkpoints[family], MODEL))
    parity.assert_same(asyncio.run(parity.against(srv.base_url, MODEL)), want, "tensor parallel")
    # A conversation's next turn starts from every rank's shard of its history (the default
    # prompt cache, rank 0 deciding), with one process's tokens.
    history = "Tensor parallel ranks each hold a shard of every layer's matrices. " * 6
    first = c.completions.create(model=MODEL, prompt=history, max_tokens=8, temperature=0)
    second = history + first.choices[0].text + " Why?"
    r = c.completions.create(model=MODEL, prompt=second, max_tokens=8, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= 0.8 * r.usage.prompt_tokens
    assert r.choices[0].text == asyncio.run(one_process(checkpoints[family], second))
    salted = c.completions.create(
        model=MODEL, prompt=second, max_tokens=8, temperature=0, extra_body={"cache_salt": "t2"}
    )
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's: nothing
    assert salted.choices[0].text == r.choices[0].text
    assert srv.stop() == 0
    assert srv.left_behind() == []  # the follower rank exited with the server


async def one_process(model: Path, prompt: str) -> str:
    from mlxcel.serving.assembly import Generation

    async with assemble(LocalSpec(model), Generation(prompt_cache_bytes=0)) as st:
        return (await st.generate(prompt, SamplingParams(max_tokens=8))).text


def _followers(pid: int) -> list[int]:
    r = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", "mlxcel.tp.follower"], capture_output=True, text=True
    )
    return [int(x) for x in r.stdout.split()]


def test_killed_rank_fails_requests_and_the_server_exits_nonzero(tiny: Path) -> None:
    srv = ServerProcess(["-m", str(tiny), "--tp-size", "2", "--served-model-name", MODEL])
    try:
        (follower,) = _followers(srv.proc.pid)
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = c.completions.create(
            model=MODEL, prompt="long", max_tokens=3000, temperature=0, stream=True
        )
        t_kill = None
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for n, _ in enumerate(stream):
                if n == 3:
                    os.kill(follower, signal.SIGKILL)
                    t_kill = time.monotonic()
        code = srv.proc.wait(30)
        assert t_kill is not None and time.monotonic() - t_kill < 30
        assert code != 0
        time.sleep(0.2)
        assert "tensor-parallel group failed" in srv.output
    finally:
        srv.stop()


def test_bench_tp_prints_json_lines(tiny: Path) -> None:
    r = run("bench", "tp", "--json", "-m", str(tiny), "--tokens", "4")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["tp_size"] for row in rows] == [1, 2]
    assert all(row["tok_per_s"] > 0 for row in rows)
    assert [row["backend"] for row in rows] == ["none", "ring"]  # no CUDA here


def test_the_collective_backend_is_nccl_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring on this CPU; a wrong or impossible --tp-backend is refused by name, and the
    setting reads MLXCEL_TP_BACKEND through the settings layer."""
    from mlxcel.base.errors import ConfigError
    from mlxcel.config.settings import ServeSettings
    from mlxcel.tp.group import pick_backend

    assert pick_backend() == "ring"
    assert pick_backend("Ring") == "ring"
    for bad, words in (("mpi", "not one of auto, ring, nccl"), ("nccl", "needs MLX on CUDA")):
        with pytest.raises(ConfigError, match=words):
            pick_backend(bad)
    monkeypatch.setenv("MLXCEL_TP_BACKEND", "ring")
    assert ServeSettings().tp_backend == "ring"


def test_co_located_processes_get_a_gpu_each_only_where_there_are_several(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlxcel.runtime import devices

    env = {"A": "1"}
    assert devices.gpu_ids() == [] and devices.device_env(1, env) == env  # CPU: unchanged
    monkeypatch.setattr(devices, "gpu_ids", lambda: ["3"])
    assert devices.device_env(1, env) == env  # one GPU: everyone shares it
    monkeypatch.setattr(devices, "gpu_ids", lambda: ["2", "5"])
    assert [devices.device_env(i, env)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["2", "5", "2"]


def test_tp_hostfile_joins_ranks_started_separately(tiny: Path, tmp_path: Path) -> None:
    """The multi-host shape on one host: each rank is started by hand with --tp-rank."""
    hostfile = local_hostfile(2, tmp_path)
    args = [
        "generate",
        "-m",
        str(tiny),
        "-p",
        "Hello there",
        "-n",
        "12",
        "--tp-hostfile",
        str(hostfile),
    ]
    env = with_secret(tmp_path)
    follower = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", *args, "--tp-rank", "1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lead = run(*args, "--tp-rank", "0", env=env)
        assert lead.returncode == 0, lead.stderr
        assert follower.wait(60) == 0
        single = run("generate", "-m", str(tiny), "-p", "Hello there", "-n", "12")
        assert lead.stdout.rsplit("\n", 2)[0] == single.stdout.rsplit("\n", 2)[0]
    finally:
        if follower.poll() is None:
            follower.kill()


def test_tp_hostfile_with_no_peer_fails_after_the_startup_timeout(
    tiny: Path, tmp_path: Path
) -> None:
    """Rank 0 alone: it says what it waits for, then fails in one line (it hung for minutes)."""
    hostfile = local_hostfile(2, tmp_path)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "generate", "-m", str(tiny), "-p", "x", "-n", "2"]
        + ["--tp-hostfile", str(hostfile), "--tp-rank", "0", "--startup-timeout", "6"],
        capture_output=True,
        text=True,
        timeout=120,
        env=with_secret(tmp_path),
    )
    took = time.monotonic() - t0
    assert r.returncode != 0, r.stderr
    assert "waiting for rank(s) 1 to join rank 0 at 127.0.0.1:" in r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "after 6s (--startup-timeout)" in errors[0]
    assert "Traceback" not in r.stderr
    assert took < 60


# Rank 1, played by the test: it meets rank 0 with the secret, then either never forms
# MLX's group ("stall") or forms it without the launch's key ("stranger": what a process that
# won rank 1's ring port would be).
RANK1 = """
import asyncio, os, sys, time
from pathlib import Path
from mlxcel.net.secret import load_cluster_secret
from mlxcel.tp.follower import join_message
from mlxcel.tp.group import init_group, ring_digest, ring_of
from mlxcel.tp.rendezvous import attend
mode, model, hostfile = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ring = ring_of(hostfile)
join = join_message(model, 1, ring[1], ring_digest(ring))
secret = load_cluster_secret(None, os.environ)
meeting = asyncio.run(attend(secret, ring[0], join, 60))
if mode == "stall":
    time.sleep(60)
else:
    init_group(1, meeting.ring, meeting.backend, 20, os.urandom(32))
"""

HOLD = """
import socket, sys, time
held, end = [], time.time() + 40
while time.time() < end:  # connections MLX accepts as a rank, which never speak
    s = socket.socket()
    try:
        s.connect(("127.0.0.1", int(sys.argv[1])))
        held.append(s)
    except OSError:
        s.close()
    time.sleep(0.005)
"""


def _lead_against(tiny: Path, tmp_path: Path, mode: str) -> tuple[int, str]:
    """Rank 0 (generate) with rank 1 played by RANK1 in ``mode`` and, while it stalls, a
    local process holding connections to rank 0's ring port: rank 0's exit status and log."""
    hostfile = local_hostfile(2, tmp_path)
    env = with_secret(tmp_path)
    port = json.loads(hostfile.read_text())[0][0].rpartition(":")[2]
    helpers = [subprocess.Popen([sys.executable, "-c", RANK1, mode, str(tiny), str(hostfile)],
                                env=env, cwd=ROOT)]  # fmt: skip
    if mode == "stall":
        helpers.append(subprocess.Popen([sys.executable, "-c", HOLD, port]))
    try:
        lead = run("generate", "-m", str(tiny), "-p", "x", "-n", "2", "--tp-hostfile",
                   str(hostfile), "--tp-rank", "0", env=env, timeout=90)  # fmt: skip
        return lead.returncode, lead.stderr
    finally:
        for p in helpers:
            p.kill()
            p.wait()


def test_a_group_that_does_not_form_after_every_rank_met_rank_0_fails_in_seconds(
    tiny: Path, tmp_path: Path
) -> None:
    """A rank met rank 0 and then never formed the ring (stopped, or a local process took
    its ring port first and never speaks): each rank says so after RING_BOUND seconds (it
    waited 31 s, then raised a bare RuntimeError)."""
    code, log = _lead_against(tiny, tmp_path, "stall")
    assert code != 0
    lines = log.splitlines()
    joined = next(ln for ln in lines if "rank 1 joined from" in ln)
    error = next(ln for ln in lines if " ERROR " in ln)
    assert "gave up waiting for MLX's ring group to form (rank 1 at" in error
    assert "after 20s; every rank had met rank 0" in error
    assert "another process connected to a ring port first" in error
    assert _clock(error) - _clock(joined) < 30, (joined, error)


def test_a_stranger_in_mlx_s_ring_is_refused_before_any_step(tiny: Path, tmp_path: Path) -> None:
    """MLX's ring authenticates nothing: a process that wins a rank's ring port forms the
    group with rank 0. It cannot show the launch's key, so rank 0 refuses the group before a
    step (and so a prompt) crosses it, in one line."""
    code, log = _lead_against(tiny, tmp_path, "stranger")
    assert code == 1 and "Traceback" not in log, log[-3000:]
    errors = [ln for ln in log.splitlines() if " ERROR " in ln]
    assert (
        len(errors) == 1 and "rank(s) 1 of MLX's group do not hold this launch's key" in errors[0]
    )


def _clock(line: str) -> float:
    h, m, s = line.split()[0].split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def test_a_hostfile_of_the_wrong_shape_is_one_line(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "hosts.json"
    for text in ('{"a": 1}', "[[1, 2]]", "[]", "not json", '[["localhost:5000"], ["127.0.0.1:5001"]]',
                 '[["[::1]:5000"], ["[::1]:5001"]]', '[["127.0.0.1:5000", "127.0.0.1:5002"], ["127.0.0.1:5001"]]'):  # fmt: skip
        bad.write_text(text)
        r = subprocess.run(
            [sys.executable, "-m", "mlxcel", "generate", "-m", str(tiny), "-p", "x", "-n", "2"]
            + ["--tp-hostfile", str(bad), "--tp-rank", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert error_line(r.stderr).startswith("--tp-hostfile: ")


def test_a_hostfile_that_spans_hosts_needs_the_cleartext_opt_in_on_every_rank(
    tiny: Path, tmp_path: Path
) -> None:
    """MLX's ring and NCCL carry activations and step messages in clear: a hostfile naming
    another host is refused before anything loads, on rank 0 and on a follower, unless the
    operator opts in; with the opt-in, each start logs a WARNING saying what crosses."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text('[["127.0.0.1:45871"], ["10.99.0.2:45872"]]')
    for rank in ("0", "1"):
        r = run("generate", "-m", str(tiny), "-p", "x", "-n", "2", "--tp-hostfile", str(hosts),
                "--tp-rank", rank)  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        line = error_line(r.stderr)
        assert line.startswith("--tp-hostfile: the tensor-parallel ranks span hosts (10.99.0.2)")
        assert "unencrypted, and the activations unauthenticated" in line
        assert "--tp-allow-cleartext" in line
    # Opted in: the warning, then the (absent) peer is waited for until the start-up timeout.
    r = run("generate", "-m", str(tiny), "-p", "x", "-n", "2", "--tp-hostfile", str(hosts),
            "--tp-rank", "0", "--tp-allow-cleartext", "--startup-timeout", "2")  # fmt: skip
    assert r.returncode != 0
    warned = [ln for ln in r.stderr.splitlines() if "WARNING" in ln and "span hosts" in ln]
    assert warned and "can read them, and alter the activations" in warned[0], r.stderr


def test_local_ranks_need_no_opt_in() -> None:
    from mlxcel.tp.group import cleartext_hosts

    assert (
        cleartext_hosts([["127.0.0.1:1"], ["127.0.0.2:2"], ["[::1]:3"], ["localhost:4"]], False)
        is None
    )


def test_ranks_started_by_hand_need_the_secret_their_step_key_comes_from(
    tiny: Path, tmp_path: Path
) -> None:
    hostfile = local_hostfile(2, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_CLUSTER_SECRET")}
    for rank in ("0", "1"):
        r = run("generate", "-m", str(tiny), "-p", "x", "-n", "2", "--tp-hostfile",
                str(hostfile), "--tp-rank", rank, env=env)  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert error_line(r.stderr).startswith(
            "--tp-hostfile: ranks started by hand need the cluster secret"
        )


def test_a_step_with_a_wrong_tag_a_replay_or_a_reorder_is_refused() -> None:
    from mlxcel.base.errors import StepForged
    from mlxcel.tp.step_seal import StepSeal

    key = bytes(range(32))
    lead, follow = StepSeal(key), StepSeal(key)
    first, second = lead.seal(b"step one"), lead.seal(b"step two")
    assert follow.open(first) == b"step one"
    with pytest.raises(StepForged, match="step 1 failed its MAC"):
        follow.open(first)  # a replay
    other = StepSeal(key)
    with pytest.raises(StepForged):
        other.open(second)  # out of order
    with pytest.raises(StepForged):
        StepSeal(key).open(b"step one" + bytes(16))  # forged: no key
    with pytest.raises(StepForged):
        StepSeal(bytes(32)).open(StepSeal(key).seal(b"x"))  # another launch's key


def test_a_rank_that_lacks_rank_0s_prefix_makes_every_rank_prefill_it_in_full() -> None:
    """Rank 0 chose a cached prefix for two sequences; this rank holds only the first. Its
    vote fails the second on every rank (the group's all_sum), so each prefills in full."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.base.messages import TpInsert
    from mlxcel.runtime.prompt_cache import PromptCache
    from mlxcel.tp.follower import _starts

    kept = PromptCache(1 << 20)
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, 6, 8)), mx.ones((1, 2, 6, 8)))
    kept.store([1, 2, 3, 4, 5, 6], [c], "ns")
    sp = SamplingParams(max_tokens=4)
    inserts = (
        TpInsert("a", (1, 2, 3, 4, 5, 6, 7), sp, cached=6, cache_ns="ns"),
        TpInsert("b", (1, 2, 3, 4, 9), sp, cached=4, cache_ns="other"),  # not held here
        TpInsert("c", (5, 5), sp),
    )
    votes: list[list[bool]] = []

    def agree(group: object, ok: list[bool]) -> list[bool]:
        votes.append(ok)
        return ok  # a group of this rank alone: its own vote decides

    starts = _starts(kept, inserts, None, agree)
    assert votes == [[True, False]]  # only the sequences rank 0 started from a prefix vote
    assert starts[0][1] == 6 and starts[0][0] is not None and starts[0][0][0].offset == 6
    assert starts[1] == (None, 0) and starts[2] == (None, 0)
