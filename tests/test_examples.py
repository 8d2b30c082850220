"""The examples as a user runs them: ``examples/distributed/run_loopback.sh`` started from a
terminal and stopped with Ctrl-C drains every node (a request in flight finishes)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import ROOT, descendants, free_port


def default_sigint() -> None:
    """In the script's process, before it starts: SIGINT as a terminal delivers it. A test run
    started in the background (``nohup``, ``&`` without job control) ignores SIGINT, and a
    signal ignored when bash starts is one its ``trap`` cannot catch."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_the_loopback_script_lets_every_node_drain(tiny: Path, tmp_path: Path) -> None:
    here = tmp_path / "distributed"
    shutil.copytree(ROOT / "examples" / "distributed", here)  # its secret is written there
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    # A session of its own, as a terminal gives it: Ctrl-C is SIGINT to the foreground group.
    script = subprocess.Popen(
        ["bash", str(here / "run_loopback.sh"), "2", str(tiny), str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, cwd=tmp_path, preexec_fn=default_sigint,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(script.stdout or ()), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any("mlxcel serving" in ln for ln in lines):
            assert time.monotonic() < deadline and script.poll() is None, "".join(lines)
            time.sleep(0.2)
        body = {"model": tiny.name, "prompt": "hello", "max_tokens": 200, "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
        answer: dict[str, object] = {}

        def ask() -> None:
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    answer.update(json.loads(r.read()))
            except urllib.error.HTTPError as exc:
                answer["error"] = exc.read().decode()

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.5)  # the request is in the pipeline
        os.killpg(script.pid, signal.SIGINT)  # Ctrl-C
        asker.join(120)
        assert "choices" in answer, answer
        assert answer["choices"][0]["finish_reason"] == "length", answer  # type: ignore[index]
        try:
            code: int | None = script.wait(60)
        except subprocess.TimeoutExpired:  # the nodes' own words say which one did not stop
            code = None
        assert code == 0, "".join(lines)
    finally:  # the nodes have process groups of their own: each is stopped by pid
        for pid in [script.pid, *descendants(script.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = "".join(lines)
    assert "second signal" not in text.lower(), text
