"""``python -m mlxcel bench bringup``: how long a zero-config cluster takes to serve.

For each discovery mode, two ``--pp-peer`` processes on 127.0.0.2 and 127.0.0.3 wait for an
assignment (their start-up is not counted: in practice peers are up before the coordinator);
then the clock starts with the ``--pp-auto 2`` coordinator process itself and stops at the
first token of a streamed chat completion. Beacon discovery sends to 127.0.0.1 on a free
port, as a single-host rehearsal does. Every process is real; nothing leaves loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

READY_TIMEOUT = 120.0


def _free(host: str, kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "mlxcel", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env={**os.environ, "MLXCEL_LOG_LEVEL": "INFO"},  # the ready lines are INFO lines
    )


def _wait_line(p: subprocess.Popen[str], prefix: str) -> str:
    assert p.stdout is not None
    end = time.monotonic() + READY_TIMEOUT
    seen = []
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            break
        seen.append(line)
        if prefix in line:
            return line
    raise RuntimeError(f"no {prefix!r} line:\n" + "".join(seen[-20:]))


def _first_token(url: str, model: str) -> None:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=READY_TIMEOUT) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {") and '"content": "' in line:
                return  # the first chunk that carries text


def _one(model: Path, secret: Path, mode: str, work: Path) -> dict[str, object]:
    common = ["-m", str(model), "--cluster-secret-file", str(secret)]
    peers_args, coord_args = [], []
    addrs = [f"127.0.0.{i}:{_free(f'127.0.0.{i}')}" for i in (2, 3)]
    if mode == "mdns":
        udp = str(_free("127.0.0.1", socket.SOCK_DGRAM))
        beacons = ["--cluster-discovery", "mdns", "--cluster-discovery-port", udp]
        peers_args = [[*beacons, "--cluster-discovery-target", "127.0.0.1"]] * 2
        coord_args = beacons
    else:
        peers_args = [[], []]
        coord_args = ["--cluster-peers", ",".join(addrs)]
    procs = []
    try:
        for i, (a, extra) in enumerate(zip(addrs, peers_args, strict=True)):
            p = _spawn([*common, "--pp-peer", "--cluster-control-addr", a, *extra], work / f"p{i}")
            procs.append(p)
            _wait_line(p, "mlxcel peer waiting")
        control = f"127.0.0.1:{_free('127.0.0.1')}"
        t0 = time.perf_counter()
        c = _spawn(
            [
                *common,
                "--pp-auto",
                "2",
                "--cluster-control-addr",
                control,
                "--port",
                "0",
                "--served-model-name",
                "bench",
                *coord_args,
            ],
            work / "coordinator",
        )
        procs.append(c)
        line = _wait_line(c, "mlxcel serving")
        serving = time.perf_counter() - t0
        _first_token(line.split(" on ", 1)[1].strip(), "bench")
        first = time.perf_counter() - t0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return {
        "bench": "bringup",
        "discovery": mode,
        "peers": 2,
        "serving_s": round(serving, 3),
        "first_token_s": round(first, 3),
        "target_s": 3.0 if mode == "static" else None,
    }


def run_bench(model: Path, json_lines: bool, modes: tuple[str, ...] = ("static", "mdns")) -> int:
    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-bringup-") as tmp:
        work = Path(tmp)
        secret = work / "cluster.secret"
        subprocess.run(
            [sys.executable, "-m", "mlxcel", "keygen", "--out", str(secret)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        rows = [_one(model, secret, m, work / m) for m in modes]
    for r in rows:
        if json_lines:
            print(json.dumps(r), flush=True)
        else:
            print(
                f"{r['discovery']:>6} discovery, 2 peers: serving after {r['serving_s']:.2f} s, "
                f"first token after {r['first_token_s']:.2f} s (from coordinator start)"
            )
    return 0
