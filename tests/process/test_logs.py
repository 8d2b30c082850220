"""Every line a process prints about itself is in one format: text, or JSON per line."""

from __future__ import annotations

import json
import logging
import urllib.request
import warnings
from pathlib import Path

import openai
import pytest
from loguru import logger

from mlxcel.process.logs import setup_logging
from tests.conftest import ServerProcess

MODEL = "tiny"
ASK = [{"role": "user", "content": "hello"}]


def test_json_logs_are_one_object_per_line_with_access_fields(
    tiny: Path, start_server: type[ServerProcess]
) -> None:
    srv = start_server(["-m", str(tiny), "--served-model-name", MODEL, "--log-format", "json"])
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="nope", messages=ASK)  # type: ignore[arg-type]
    assert srv.stop() == 0
    records = [json.loads(line) for line in srv.output.splitlines()]  # every line parses
    assert all({"time", "level", "message", "pid"} <= rec.keys() for rec in records)
    messages = [rec["message"] for rec in records]
    assert any(m.startswith("BLAS: ") for m in messages)
    assert any(m.startswith(f"mlxcel serving {MODEL} on http://") for m in messages)
    access = [rec for rec in records if rec.get("path") == "/v1/chat/completions"]
    assert [a["status"] for a in access] == [200, 400]
    ok = access[0]
    assert ok["method"] == "POST" and ok["level"] == "INFO" and ok["latency_ms"] > 0
    assert ok["prompt_tokens"] == r.usage.prompt_tokens  # type: ignore[union-attr]
    assert ok["completion_tokens"] == r.usage.completion_tokens  # type: ignore[union-attr]


def test_text_access_line_per_request(tiny: Path, start_server: type[ServerProcess]) -> None:
    srv = start_server(["-m", str(tiny), "--served-model-name", MODEL])
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, stream=True)
    chunks = list(r)
    assert chunks
    c.models.list()
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=5)
    for path in ("/health", "/health/live", "/metrics"):
        urllib.request.urlopen(srv.base_url + path, timeout=10).read()
    srv.stop()
    lines = srv.output.splitlines()
    # A refusal's line says which error it was; probes are polled, so they stay at DEBUG.
    assert any(" INFO    POST /v1/completions 400 invalid_value " in ln for ln in lines), lines
    assert not any(f"GET {p} " in ln for p in ("/health", "/metrics") for ln in lines)
    (line,) = [ln for ln in lines if "POST /v1/completions 200" in ln]
    assert " INFO    POST /v1/completions 200 prompt=" in line and "completion=4 " in line
    assert line.endswith("ms")
    assert any(" INFO    GET /v1/models 200 prompt=0 completion=0 " in ln for ln in lines)
    # No line escapes the format: each starts with a time and a level.
    import re

    pattern = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (TRACE|DEBUG|INFO|SUCCESS|WARNING|ERROR)\s")
    assert all(pattern.match(ln) for ln in lines if ln.strip()), lines


def test_library_records_and_warnings_go_through_loguru() -> None:
    seen: list[str] = []
    with warnings.catch_warnings():  # restores the warnings hook afterwards
        warnings.simplefilter("always")
        setup_logging("INFO", "text")
        logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
        logging.getLogger("huggingface_hub.file_download").warning("a library speaks")
        logging.getLogger("some.lib").info("below WARNING: quiet unless asked")
        warnings.warn("an old API", DeprecationWarning, stacklevel=1)
    setup_logging("INFO", "text")
    assert "huggingface_hub.file_download: a library speaks" in seen
    assert not any("quiet unless asked" in m for m in seen)
    assert any(m.startswith("DeprecationWarning: an old API") for m in seen)


def test_progress_bars_appear_only_for_slow_steps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from mlxcel.process import progress
    from mlxcel.process.progress import slow_task, step_bar

    monkeypatch.setattr(progress, "bars_wanted", lambda: False)  # a pipe, or JSON logs
    monkeypatch.setattr(progress, "LINE_EVERY", 0.5)
    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="INFO")
    try:
        with slow_task("slow step"):
            time.sleep(1.3)
    finally:
        logger.remove(sink)
    assert capsys.readouterr().err == ""  # no bar ...
    assert "slow step: still running (0 s)" in said or "slow step: still running (1 s)" in said
    assert 1 <= len([m for m in said if m.startswith("slow step: still running")]) <= 3
    monkeypatch.setattr(progress, "bars_wanted", lambda: True)  # a terminal
    with slow_task("quick step"):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""
    with slow_task("slow step"):
        time.sleep(1.6)
    err = capsys.readouterr().err
    assert "slow step: 00:01" in err and err.endswith("\n")
    bar = step_bar(3, "shards", enabled=True)
    for _ in range(3):
        time.sleep(0.5)
        bar.update(1)  # type: ignore[attr-defined]
    bar.close()  # type: ignore[attr-defined]
    assert "shards: 100%" in capsys.readouterr().err
    quiet = step_bar(3, "shards", enabled=False)
    quiet.update(3)  # type: ignore[attr-defined]
    quiet.close()  # type: ignore[attr-defined]
    assert capsys.readouterr().err == ""


def test_a_bad_command_line_is_one_json_line_when_json_is_asked(tiny: Path) -> None:
    import subprocess
    import sys

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        import os

        return subprocess.run(
            [sys.executable, "-m", "mlxcel", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **(env or {})},
        )

    r = run("serve", "--log-format", "JSON", "--port", "99999")
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    rec = json.loads(line)
    assert rec["level"] == "ERROR" and rec["message"].startswith("--port: ")
    r = run("serve", "--nope", env={"MLXCEL_LOG_FORMAT": "json"})
    assert (
        r.returncode == 2 and "unrecognized arguments: --nope;" in json.loads(r.stderr)["message"]
    )
    # A long prompt's library warning comes through the same sink, not as a raw line.
    r = run(
        "generate", "-m", str(tiny), "--raw", "-n", "2", "-p", "x " * 5000, "--log-format", "json"
    )
    assert r.returncode == 1
    records = [json.loads(ln) for ln in r.stderr.splitlines()]
    assert any(rec["logger"].startswith("transformers") for rec in records)
