"""Disaggregated serving as users run it: ``python -m mlxcel serve --node-role ...`` processes
on 127.0.0.x, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.conftest import ROOT, ServerProcess, free_port, mlx_mapped

N_CHATS = 32


def keygen(path: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "mlxcel", "keygen", "--out", str(path)],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    return path


def addr(i: int) -> str:
    ip = f"127.0.0.{i}"
    return f"{ip}:{free_port(ip)}"


def worker(
    role: str, model: Path, secret: Path, bind: str, *extra: str, env: dict | None = None
) -> ServerProcess:
    host = bind.rpartition(":")[0]
    return ServerProcess(
        [
            "-m",
            str(model),
            "--node-role",
            role,
            "--serving-bind",
            bind,
            "--cluster-secret-file",
            str(secret),
            *extra,
        ],
        env=env,
        host=host,
        ready=f"mlxcel {role} node",
    )


def router(
    model: Path,
    secret: Path,
    bind: str,
    prefill: list[str],
    decode: list[str],
    *extra: str,
    env: dict | None = None,
) -> ServerProcess:
    host = bind.rpartition(":")[0]
    return ServerProcess(
        [
            "-m",
            str(model),
            "--node-role",
            "router",
            "--serving-bind",
            bind,
            "--prefill-peers",
            ",".join(prefill),
            "--decode-peers",
            ",".join(decode),
            "--cluster-secret-file",
            str(secret),
            "--parallel",
            "64",
            "--served-model-name",
            "m",
            *extra,
        ],
        env=env,
        host=host,
    )


def stats(r: ServerProcess) -> dict:
    with urllib.request.urlopen(r.base_url + "/router/stats", timeout=10) as resp:
        return json.loads(resp.read())


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Chat {i}: tell me about " + "foxes and dogs " * (i % 5)}]


async def stream_chat(base: str, i: int, max_tokens: int = 16) -> str:
    c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    s = await c.chat.completions.create(
        model="m", messages=messages(i), max_tokens=max_tokens, temperature=0, stream=True
    )
    text = ""
    async for ch in s:
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
    return text


def test_router_two_prefill_two_decode_serves_32_streaming_chats_like_one_node(
    tiny: Path, secret: Path
) -> None:
    pre, dec = [addr(22), addr(23)], [addr(24), addr(25)]
    # The allowlist holds the whole decode pool, plus an entry that does not parse.
    allow = {"MLXCEL_DECODE_ALLOWLIST": ",".join(dec) + ",decode.example:1"}
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(worker, "decode", tiny, secret, d) for d in dec]
        futs += [
            pool.submit(worker, "prefill", tiny, secret, p, "--decode-peers", dec[0], env=allow)
            for p in pre
        ]
        hybrid_f = pool.submit(
            ServerProcess, ["-m", str(tiny), "--parallel", "32", "--served-model-name", "m"]
        )
        procs = [f.result() for f in futs]
        hybrid = hybrid_f.result()
    rt = router(tiny, secret, addr(26), pre, dec)
    try:
        single = openai.OpenAI(base_url=hybrid.base_url + "/v1", api_key="x")
        want = [
            single.chat.completions.create(
                model="m", messages=messages(i), max_tokens=16, temperature=0
            )
            .choices[0]
            .message.content
            for i in range(N_CHATS)
        ]

        async def all_chats() -> list[str]:
            return list(
                await asyncio.gather(*(stream_chat(rt.base_url, i) for i in range(N_CHATS)))
            )

        got = asyncio.run(all_chats())
        assert got == want
        # The router holds no model and never loads MLX; the nodes that run one do.
        assert not mlx_mapped(rt.proc.pid)
        assert all(mlx_mapped(p.proc.pid) for p in procs)
        body = stats(rt)
        assert body["addresses_redacted"] is True
        assert {n["id"]: n["dispatched"] for n in body["nodes"]} == {
            "prefill-0": 16,
            "prefill-1": 16,
            "decode-0": 16,
            "decode-1": 16,
        }
        assert all(n["healthy"] for n in body["nodes"]) and body["metrics"]["completed"] == 32
        assert all(p not in json.dumps(body) for p in pre + dec)
        for p in procs[2:]:
            assert "skipping 'decode.example:1'" in p.output
    finally:
        for p in (rt, hybrid, *procs):
            p.stop()


def forge_result(secret: Path, router_bind: str) -> None:
    """A process that holds the secret but is no configured peer sends the router a token."""
    from mlxcel.base.messages import TokenResult
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.pipeline.cluster_config import ClusterSection
    from mlxcel.pipeline.remote import cluster_net
    from mlxcel.reactor.bus import Node

    async def run() -> None:
        s = load_cluster_secret(secret, None, None, required=True)
        assert s is not None
        async with Node("forger") as node:
            _listener, _pool, endpoint = cluster_net(node, ClusterSection(), addr(29), "forger", s)
            loop = asyncio.get_running_loop()
            for i in range(3):
                msg = TokenResult("req-1", 0, (5,), "stop", i)
                await endpoint.send(router_bind, msg, loop.time() + 5)
            await asyncio.sleep(0.3)

    asyncio.run(run())


def test_failover_restart_admission_and_demux(tiny: Path, secret: Path) -> None:
    pre, dec = [addr(32)], [addr(33), addr(34)]
    verbose = {"MLXCEL_ROUTER_STATS_VERBOSE": "Yes"}
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(worker, "decode", tiny, secret, d) for d in dec]
        futs.append(pool.submit(worker, "prefill", tiny, secret, pre[0], "--decode-peers", dec[0]))
        d0, d1, p0 = (f.result() for f in futs)
    # No MLXCEL_DECODE_ALLOWLIST on this prefill node: permissive, and it says so.
    assert "(MLXCEL_DECODE_ALLOWLIST) is unset or has no valid entry" in p0.output
    rbind = addr(35)
    rt = router(tiny, secret, rbind, pre, dec, env=verbose)
    procs = [d0, d1, p0, rt]
    try:
        body = stats(rt)
        assert body["addresses_redacted"] is False
        assert [n["address"] for n in body["nodes"]] == pre + dec

        # A member of the cluster that is not a configured peer cannot inject tokens.
        forge_result(secret, rbind)
        deadline = time.monotonic() + 10
        while "router: dropping result frame from 127.0.0.29" not in rt.output:
            assert time.monotonic() < deadline, rt.output[-3000:]
            time.sleep(0.1)

        # Kill decode-0 while 8 long streams run: the ones on it fail with a clear error,
        # the others go on; nothing hangs.
        async def kill_mid_run() -> list[object]:
            c = openai.AsyncOpenAI(
                base_url=rt.base_url + "/v1", api_key="x", max_retries=0, timeout=60
            )
            started = asyncio.Event()
            first = 0

            async def one(i: int) -> object:
                nonlocal first
                try:
                    s = await c.chat.completions.create(
                        model="m", messages=messages(i), max_tokens=3000, temperature=0, stream=True
                    )
                    n = 0
                    async for _ch in s:
                        n += 1
                        if n == 1:
                            first += 1
                            if first == 8:
                                started.set()
                        if n >= 400:  # long enough: this stream survived the kill
                            await s.close()
                            return "ok"
                    return "finished"
                except openai.APIError as exc:
                    return exc

            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await asyncio.wait_for(started.wait(), 30)
            d0.proc.send_signal(signal.SIGKILL)
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))

        results = asyncio.run(kill_mid_run())
        errors = [r for r in results if isinstance(r, Exception)]
        assert 1 <= len(errors) <= 4 and len(results) - len(errors) >= 4, results
        assert all("decode-0" in str(e) for e in errors), errors
        assert not stats(rt)["nodes"][1]["healthy"]

        # New requests go to decode-1.
        assert all(asyncio.run(_chats(rt, 4)))
        assert stats(rt)["nodes"][1]["dispatched"] == 4  # unchanged since the kill

        # Restarted at the same address, decode-0 is probed back in and used again.
        d0 = worker("decode", tiny, secret, dec[0])
        procs.append(d0)
        deadline = time.monotonic() + 20
        while not stats(rt)["nodes"][1]["healthy"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert all(asyncio.run(_chats(rt, 4)))
        assert stats(rt)["nodes"][1]["dispatched"] > 4

        # Every prefill node down: 503 with Retry-After, at once, for a prompt no decode node
        # keeps (one that continues a conversation a decode node holds needs no prefill node).
        p0.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while stats(rt)["nodes"][0]["healthy"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        c = openai.OpenAI(base_url=rt.base_url + "/v1", api_key="x", max_retries=0)
        fresh = [{"role": "user", "content": "A prompt nobody sent before, about otters"}]
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model="m", messages=fresh, max_tokens=4)
        assert err.value.status_code == 503
        assert err.value.response.headers.get("Retry-After") == "1"
        assert "no prefill node" in str(err.value)
        # ... and with every node down.
        for p in (d0, d1):
            p.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(n["healthy"] for n in stats(rt)["nodes"]):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model="m", messages=messages(1), max_tokens=4)
        assert err.value.status_code == 503
        assert err.value.response.headers.get("Retry-After") == "1"
    except BaseException:
        for p in procs:  # what each node said, in the failure's report
            print(f"--- {' '.join(map(str, p.proc.args))}\n{p.output[-6000:]}")
        raise
    finally:
        for p in procs:
            p.stop()


async def _chats(rt: ServerProcess, n: int) -> list[str]:
    return list(await asyncio.gather(*(stream_chat(rt.base_url, i, 4) for i in range(n))))


def test_roles_refuse_to_start_without_the_secret(tiny: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_CLUSTER_SECRET")}
    env["MLXCEL_HOME"] = str(tmp_path)
    for role, extra in (
        ("prefill", []),
        ("decode", []),
        ("router", ["--prefill-peers", "127.0.0.2:9", "--decode-peers", "127.0.0.3:9"]),
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlxcel",
                "serve",
                "-m",
                str(tiny),
                "--node-role",
                role,
                "--serving-bind",
                "127.0.0.1:9",
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        assert out.returncode != 0
        assert "secret" in (out.stdout + out.stderr).lower(), out.stderr


def test_a_router_with_another_secret_fails_at_once_and_idle_nodes_stop_promptly(
    tiny: Path, tmp_path: Path
) -> None:
    """A secret mismatch cannot heal: the router fails at startup naming the node, well
    before its --startup-timeout, as a pipeline's coordinator does; the idle prefill and
    decode nodes it never reached then stop on SIGTERM as quickly as any node."""
    secret, other = keygen(tmp_path / "a.key"), keygen(tmp_path / "b.key")
    at = {"prefill": addr(2), "decode": addr(3)}
    nodes = {role: worker(role, tiny, secret, bind) for role, bind in at.items()}
    try:
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny), "--node-role", "router",
             "--serving-bind", addr(4), "--prefill-peers", at["prefill"], "--decode-peers",
             at["decode"], "--cluster-secret-file", str(other), "--startup-timeout", "300"],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - started
        assert out.returncode != 0
        assert "refused the connection, which retrying cannot heal" in out.stderr, out.stderr
        assert "--cluster-secret-file" in out.stderr
        print(f"router with another secret exited in {took:.1f}s (--startup-timeout 300)")
    finally:
        for role, p in nodes.items():
            started = time.monotonic()
            assert p.stop() == 0, p.output[-2000:]
            print(f"idle {role} node stopped in {time.monotonic() - started:.1f}s")


def test_a_decode_node_whose_cluster_port_is_taken_says_so_before_loading_the_model(
    tiny: Path, tmp_path: Path
) -> None:
    import socket

    secret, bind = keygen(tmp_path / "a.key"), addr(3)
    host, port = bind.rsplit(":", 1)
    with socket.socket() as busy:
        busy.bind((host, int(port)))
        busy.listen()
        r = subprocess.run(
            [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny), "--node-role", "decode",
             "--serving-bind", bind, "--cluster-secret-file", str(secret)],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"cannot listen for cluster connections on {host}:{port}" in r.stderr
    assert "loaded model" not in r.stderr  # found before the weights were read
