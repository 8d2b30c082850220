from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import pytest

import mlxcel  # noqa: F401  (chooses the BLAS before any test module imports mlx)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mlxcel_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("mlxcel-home")
    os.environ["MLXCEL_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny float32 checkpoints of every supported family, written once per session."""
    from mlxcel.runtime.checkpoint import write_checkpoint

    base = tmp_path_factory.mktemp("ckpt")
    return {
        fam: write_checkpoint(base / f"tiny-{fam}", "tiny", fam)
        for fam in ("qwen3", "llama", "qwen2")
    }


@pytest.fixture(scope="session")
def tiny(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["qwen3"]


@pytest.fixture(scope="session")
def tiny_bf16(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint in bfloat16, as real checkpoints ship (arrays made by ops, not data)."""
    import json
    import shutil

    import mlx.core as mx

    out = tmp_path_factory.mktemp("ckpt-bf16") / "tiny-qwen3-bf16"
    shutil.copytree(tiny, out)
    for f in out.glob("*.safetensors"):
        weights = mx.load(str(f))
        mx.save_safetensors(
            str(f), {k: v.astype(mx.bfloat16) for k, v in weights.items()}, {"format": "mlx"}
        )
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def error_line(stderr: str) -> str:
    """The one line a failed command reports its error in: ``error: ...`` for a bad command
    line (before logging starts), else an ERROR log line; its message only."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ") or " ERROR " in ln]
    assert len(lines) == 1, stderr
    line = lines[0]
    return line.split(" ERROR ", 1)[1].strip() if " ERROR " in line else line[len("error: ") :]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the kernel's ephemeral range (mlxcel's own pick):
    a port from that range can be taken as some connection's source side before the test's
    listener binds it."""
    from mlxcel.net.network import free_port as pick

    return pick(host)


def mlx_mapped(pid: int) -> bool:
    """Whether process ``pid`` has MLX's library mapped (it imported mlx.core)."""
    return "libmlx" in Path(f"/proc/{pid}/maps").read_text()


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        ready: str = "mlxcel serving",  # in the log line that says it serves
    ) -> None:
        self.port = free_port(host)
        self.host = host
        cmd = [
            sys.executable,
            "-m",
            "mlxcel",
            "serve",
            "--host",
            host,
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self._family: list[int] = []  # its processes, taken at stop(): what must end with it
        deadline = time.monotonic() + 120
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if ready in line:
                # Keep draining its output, so a chatty server never blocks on a full pipe.
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.stop()
        raise RuntimeError("server did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def output_with(self, text: str, timeout: float = 10.0) -> str:
        """The output once ``text`` is in it (the server logs after it answers; its lines
        reach this process through a reader thread), or the output so far at ``timeout``."""
        end = time.monotonic() + timeout
        while text not in self.output and time.monotonic() < end:
            time.sleep(0.05)
        return self.output

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self._family = descendants(self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def left_behind(self) -> list[str]:
        """What a stopped server left: a port still accepting, a child process still alive."""
        assert self.proc.poll() is not None, "stop() it first"
        left = [f"pid {p} still alive" for p in self._family if alive(p)]
        with socket.socket() as s:
            if s.connect_ex((self.host, self.port)) == 0:
                left.append(f"{self.host}:{self.port} still accepts connections")
        return left


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), from /proc."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    # the command name may hold spaces: the fields after its ')' are fixed
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def start_server() -> Iterator[type[ServerProcess]]:
    started: list[ServerProcess] = []

    class _Tracked(ServerProcess):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, **kw)  # type: ignore[arg-type]
            started.append(self)

    yield _Tracked
    for s in started:
        s.stop()


async def collect(fe, prompt: str, n: int = 16, **kw) -> list[int]:  # type: ignore[no-untyped-def]
    from mlxcel.base.messages import SamplingParams

    toks: list[int] = []
    async with aclosing(
        fe.stream(fe.encode_prompt(prompt), SamplingParams(max_tokens=n, **kw))
    ) as it:
        async for d in it:
            toks.extend(d.token_ids)
    return toks


async def until_true(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Until ``cond()`` holds, polled on the loop; fails the test at ``timeout``."""
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.01)


# The edit loop's tier (``pytest -m quick``, under a minute on 2 cores): the pure cores, the
# wire formats, the bus and the limits -- no model processes, no namespaces, no servers.
QUICK_MODULES = frozenset(
    {
        "test_adapter", "test_adapter_exact", "test_bringup_cores", "test_bus", "test_codec",
        "test_coordinator_core", "test_coordinator_core_exact", "test_decode_refusals",
        "test_disagg_cores", "test_frame_stream", "test_frames", "test_handshake",
        "test_handshake_diagnostics", "test_errors", "test_faults", "test_layering", "test_membership", "test_model_identity",
        "test_noise_vectors", "test_peer_core_exact", "test_prefill_refusals",
        "test_push_core_exact", "test_ratelimit", "test_read_deadline", "test_router_refusals",
        "test_secret", "test_settings_flow", "test_stage_core", "test_stage_core_exact", "test_udp", "test_wire_doc",
    }
)  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cluster secret written by ``mlxcel keygen``, in a folder of its own (tests write
    cluster files beside it), one per test module."""
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    subprocess.run(
        [sys.executable, "-m", "mlxcel", "keygen", "--out", str(path)],
        check=True, capture_output=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    return path
