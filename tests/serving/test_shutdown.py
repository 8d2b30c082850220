"""A shutdown that keeps its word, with real processes: after ``--drain-timeout`` a stream
still running ends with an in-band ``server_shutting_down`` error and the process exits; a
second SIGINT exits at once. And the same for an embedder's ``NodeRunner.stop()``."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from mlxcel.base.messages import EXTENDED_SAMPLING
from mlxcel.serving.assembly import Generation, LocalSpec, assemble
from mlxcel.serving.runner import HttpOptions, NodeRunner, Serving
from tests.conftest import ServerProcess

# A stream that would run for minutes on the small checkpoint (about 60 tokens a second on
# CPU): end-of-text tokens are never sampled.
ENDLESS = {
    "model": "tiny",
    "prompt": "a story that never ends",
    "max_tokens": 8000,
    "temperature": 0,
    "stream": True,
    "logit_bias": {"0": -100, "1": -100, "2": -100},
}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.runtime.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("small") / "small", "small", "qwen3")


class Stream:
    """One streaming completion on a thread: its data lines, and when it ended."""

    def __init__(self, host: str, port: int, model: str = "tiny") -> None:
        self.events: list[str] = []
        self.ended: float | None = None
        self.first = threading.Event()
        self.body = {**ENDLESS, "model": model}
        self._t = threading.Thread(target=self._run, args=(host, port), daemon=True)
        self._t.start()

    def _run(self, host: str, port: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(self.body),
                         {"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            assert resp.status == 200
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            self.ended = time.monotonic()
            self.first.set()
            conn.close()

    def join(self, timeout: float) -> None:
        self._t.join(timeout)


@pytest.mark.parametrize("mode", [[], ["--pp-size", "2"]], ids=["one-process", "pipeline"])
def test_after_the_drain_timeout_a_running_stream_ends_in_band_and_the_process_exits(
    small: Path, mode: list[str]
) -> None:
    srv = ServerProcess(
        ["-m", str(small), "--served-model-name", "tiny", "--drain-timeout", "1", *mode]
    )
    try:
        s = Stream(srv.host, srv.port)
        assert s.first.wait(60) and s.events, srv.output
        time.sleep(0.5)
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        srv.proc.wait(30)
        exited = time.monotonic() - sent
        s.join(10)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.output
    print(f"shutdown [{' '.join(mode) or 'one process'}]: exited {exited:.2f}s after SIGINT")
    # The drain (1 s) and a grace to write the final error, not the stream's minutes.
    assert exited < 1.0 + 2.0 + 3.0, exited
    last = json.loads(s.events[-2] if s.events[-1] == "[DONE]" else s.events[-1])
    assert last["error"]["code"] == "server_shutting_down", s.events[-3:]
    assert len(s.events) > 5  # it was streaming, not refused
    assert "drain timeout (1 s): ending 1 request(s) still running" in srv.output
    assert "stream-error=server_shutting_down" in srv.output  # the access line says how it ended
    assert srv.left_behind() == []


def test_a_second_sigint_exits_at_once_without_draining(small: Path) -> None:
    srv = ServerProcess(["-m", str(small), "--served-model-name", "tiny", "--drain-timeout", "60"])
    try:
        s = Stream(srv.host, srv.port)
        assert s.first.wait(60), srv.output
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # draining: the stream runs on
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        srv.proc.wait(10)
        exited = time.monotonic() - sent
        s.join(10)
    finally:
        srv.stop()
    print(f"shutdown [second SIGINT]: exited {exited:.2f}s after it")
    assert exited < 1.0, exited
    assert srv.proc.returncode == 128 + signal.SIGINT
    assert "SIGINT: a second signal; exiting now without draining" in srv.output
    assert srv.left_behind() == []


async def test_an_embedders_stop_keeps_its_drain_timeout_with_a_stream_running(
    small: Path,
) -> None:
    async with assemble(LocalSpec(small), Generation(parallel=2)) as st:
        serving = Serving(st.node, st.frontend, sampling=EXTENDED_SAMPLING)  # logit_bias
        runner = NodeRunner(serving, HttpOptions(port=0, model_name="tiny"), drain_timeout=0.5)
        await runner.setup()
        url = (await runner.start())["http"]
        events: list[str] = []
        got_some = asyncio.Event()

        async def stream() -> None:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/completions", json=ENDLESS) as resp:
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            events.append(line[6:])
                            got_some.set()

        task = asyncio.create_task(stream())
        await asyncio.wait_for(got_some.wait(), 30)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(runner.stop(), 10)
        assert loop.time() - t0 < 0.5 + 2.5
        await asyncio.wait_for(task, 5)
        errors = [json.loads(e) for e in events if e.startswith('{"error"')]
        assert errors and errors[-1]["error"]["code"] == "server_shutting_down"
        assert st.frontend.in_flight == 0
        # Its sequence was cancelled on the engine, not left generating 8,000 tokens.
        for _ in range(100):
            if st.parts.engine.active == 0:
                break
            await asyncio.sleep(0.05)
        assert st.parts.engine.active == 0


def test_every_disaggregated_role_keeps_its_drain_with_a_stream_running(
    small: Path, tmp_path: Path
) -> None:
    """A decode node told to stop finishes what it streams for --drain-timeout while the
    router sends it nothing new, then exits and the stream ends in-band; the router does the
    same for its clients; an idle prefill or decode node exits at once."""
    from tests.disagg.test_disagg_cli import addr, keygen, router, worker

    secret = keygen(tmp_path / "cluster.secret")
    pa, d0a, d1a, ra = addr(31), addr(32), addr(33), addr(34)
    drain = ("--drain-timeout", "1")
    procs = [
        worker("prefill", small, secret, pa, "--decode-peers", f"{d0a},{d1a}", *drain),
        worker("decode", small, secret, d0a, *drain),
        worker("decode", small, secret, d1a, *drain),
    ]
    try:
        procs.append(router(small, secret, ra, [pa], [d0a, d1a], *drain))
        pre, d0, d1, rt = procs
        first = Stream(rt.host, rt.port, "m")  # round robin: decode-0 takes the first request
        assert first.first.wait(60) and first.events, rt.output
        time.sleep(0.5)
        sent = time.monotonic()
        d0.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert d0.proc.poll() is None and first.ended is None  # draining: it streams on
        d0.proc.wait(30)
        d0_exit = time.monotonic() - sent
        first.join(10)
        assert first.ended is not None
        print(f"shutdown [decode node]: exited {d0_exit:.2f}s after SIGTERM")
        assert d0_exit < 1.0 + 3.0, d0_exit  # the drain and a moment, not the stream's minutes
        assert first.ended - sent < 1.0 + 5.0
        end = json.loads(first.events[-2] if first.events[-1] == "[DONE]" else first.events[-1])
        assert end["error"]["code"] == "node_unreachable", first.events[-3:]
        assert "draining: taking no new work" in d0.output

        second = Stream(rt.host, rt.port, "m")  # decode-1 takes it: decode-0 is gone
        assert second.first.wait(60) and second.events, rt.output
        sent = time.monotonic()
        rt.proc.send_signal(signal.SIGINT)
        rt.proc.wait(30)
        rt_exit = time.monotonic() - sent
        second.join(10)
        print(f"shutdown [router]: exited {rt_exit:.2f}s after SIGINT")
        assert rt_exit < 1.0 + 2.0 + 3.0, rt_exit
        end = json.loads(second.events[-2] if second.events[-1] == "[DONE]" else second.events[-1])
        assert end["error"]["code"] == "server_shutting_down", second.events[-3:]
        assert len(second.events) > 5

        for idle in (pre, d1):  # nothing in flight: no drain to wait for
            sent = time.monotonic()
            idle.proc.send_signal(signal.SIGTERM)
            idle.proc.wait(30)
            print(f"shutdown [idle worker]: exited {time.monotonic() - sent:.2f}s after SIGTERM")
            assert time.monotonic() - sent < 3.0
            assert idle.proc.returncode == 0, idle.output
        assert all(p.proc.returncode == 0 for p in procs), [p.output[-500:] for p in procs]
    finally:
        for p in procs:
            p.stop()
