"""Seeing the cluster, with stage processes on 127.0.0.x: ``/cluster``, the per-node gauges of
``/metrics``, ``python -m mlxcel status``, and ``/dashboard`` in a real headless Chromium --
and a stage that dies shows as down in each of them within seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, free_port
from tests.pipeline.test_pipeline_remote import start_coordinator, start_stage, write_cluster

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        body = r.read()
    return json.loads(body) if path == "/cluster" else body.decode()


def node(view: dict[str, Any], node_id: str) -> dict[str, Any]:
    (n,) = [n for n in view["nodes"] if n["id"] == node_id]
    return n


@pytest.fixture()
def pipeline(tiny: Path, tmp_path: Path) -> Iterator[tuple[int, list[Any], Any]]:
    secret = tmp_path / "cluster.secret"
    subprocess.run([sys.executable, "-m", "mlxcel", "keygen", "--out", str(secret)],
                   check=True, timeout=60)  # fmt: skip
    cfg, _ = write_cluster(tmp_path, 2, secret)
    stages = [start_stage(tiny, cfg, i) for i in range(2)]
    port = free_port()
    coord = start_coordinator(tiny, cfg, port)
    try:
        yield port, stages, coord
    finally:
        coord.stop()
        for s in stages:
            s.stop()


def wait_until(check: Any, timeout: float) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "not within the time"
        time.sleep(0.1)
    return time.monotonic() - start


def test_the_cluster_view_status_and_metrics_show_every_node_and_a_stage_that_dies(
    pipeline: tuple[int, list[Any], Any],
) -> None:
    port, stages, _coord = pipeline
    body = {"model": "tiny-qwen3", "prompt": "hello", "max_tokens": 6, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    urllib.request.urlopen(req, timeout=60).read()
    view = get(port, "/cluster")
    assert view["mode"] == "pipeline" and view["totals"]["generated_tokens"] >= 1
    assert [n["id"] for n in view["nodes"]] == ["coordinator", "stage-0", "stage-1"]
    assert node(view, "stage-0")["layers"] == "0-1" and node(view, "stage-1")["up"]
    assert view["links"] == [["coordinator", "stage-0"], ["stage-0", "stage-1"],
                             ["stage-1", "coordinator"]]  # fmt: skip
    assert "127.0.0." not in json.dumps(view)  # ids, never addresses
    metrics = get(port, "/metrics")
    assert 'mlxcel_node_up{node="stage-1",role="stage"} 1.0' in metrics
    assert 'mlxcel_requests_running{model="tiny-qwen3"} 0.0' in metrics
    table = subprocess.run(
        [sys.executable, "-m", "mlxcel", "status", f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    print(table.stdout)  # what an operator sees (pytest -s)
    lines = table.stdout.splitlines()
    assert lines[0].startswith("tiny-qwen3 (pipeline): 3/3 nodes up")
    assert lines[2].split() == ["node", "role", "layers", "health", "in", "flight", "sequences",
                                "KV", "tokens", "last", "seen"]  # fmt: skip
    # Each stage's KV cache: nothing held once the request is done, room for more.
    assert node(view, "stage-0")["kv_tokens"] == 0 and node(view, "stage-0")["kv_capacity"] > 0
    assert 'mlxcel_node_kv_capacity_tokens{node="stage-0",role="stage"}' in metrics
    assert 'mlxcel_node_kv_usage_ratio{node="stage-0",role="stage"} 0.0' in metrics
    assert lines[4].split()[:4] == ["stage-0", "stage", "0-1", "up"]
    stages[1].p.kill()
    took = wait_until(lambda: not node(get(port, "/cluster"), "stage-1")["up"], 10.0)
    assert took < 5.0, took
    assert 'mlxcel_node_up{node="stage-1",role="stage"} 0.0' in get(port, "/metrics")
    table = subprocess.run(  # HOST:PORT as typed: http is understood
        [sys.executable, "-m", "mlxcel", "status", f"127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert "2/3 nodes up" in table.stdout
    (row,) = [ln for ln in table.stdout.splitlines() if ln.startswith("stage-1 ")]
    assert row.split()[:4] == ["stage-1", "stage", "2-3", "DOWN"]
    assert "  stage-1: " in table.stdout and "127.0.0." not in table.stdout  # why, by id
    # A reader that leaves (`| head -1`) ends the watch quietly: no BrokenPipe traceback.
    watch = f"{sys.executable} -m mlxcel status 127.0.0.1:{port} --watch --interval 0.2 | head -1"
    head = subprocess.run(["bash", "-o", "pipefail", "-c", watch], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert head.returncode == 0, head.stderr
    assert head.stdout.count("\n") == 1 and "nodes up" in head.stdout
    assert "Traceback" not in head.stderr and "BrokenPipe" not in head.stderr


# Set by .ci/run, which installs the browser first: there a missing browser fails the test
# instead of skipping it, so CI cannot pass without having run it.
REQUIRE_BROWSER = "MLXCEL_REQUIRE_BROWSER"


def chromium_or_skip() -> None:
    """Debian's chromium and its driver, or the test says why it cannot run. A test never
    installs anything: ``.ci/run`` does, before the suite."""
    if os.path.exists(CHROMIUM) and os.path.exists(DRIVER):
        return
    why = f"no browser: {CHROMIUM} and {DRIVER} (apt install chromium chromium-driver)"
    if os.environ.get(REQUIRE_BROWSER):
        pytest.fail(f"{why}; {REQUIRE_BROWSER} is set")
    pytest.skip(why)


def headless_chromium(tmp_path_factory: pytest.TempPathFactory) -> Any:
    chromium_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1200,800",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):  # fmt: skip
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(DRIVER), options=opts)


def test_a_dashboard_without_the_servers_key_says_how_to_give_it(
    tiny: Path, start_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_server(["-m", str(tiny), "--api-key", "sesame"])
    browser = headless_chromium(tmp_path_factory)
    base = f"http://127.0.0.1:{server.port}/dashboard"

    def status(address: str, want: str) -> str:
        browser.get(address)
        browser.refresh()  # a new #fragment alone does not load the page again
        wait_until(lambda: want in browser.find_element("id", "status").text, 10.0)
        return str(browser.find_element("id", "status").text)

    try:
        text = status(base, "needs its API key")
        assert "/dashboard#key=" in text and "unreachable" not in text
        assert "not this server's --api-key" in status(base + "#key=wrong", "--api-key")
        assert "all nodes up" in status(base + "#key=sesame", "all nodes up")
    finally:
        browser.quit()


def test_the_dashboard_draws_the_cluster_and_shows_a_stage_going_down_within_5_s(
    pipeline: tuple[int, list[Any], Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    port, stages, _coord = pipeline
    browser = headless_chromium(tmp_path_factory)
    try:
        browser.get(f"http://127.0.0.1:{port}/dashboard")

        def rows() -> dict[str, str]:
            js = ("return Array.from(document.querySelectorAll('#rows tr'))"
                  ".map(r => [r.dataset.node, r.dataset.up]);")  # fmt: skip
            return dict(browser.execute_script(js))

        wait_until(lambda: len(rows()) == 3, 15.0)
        assert rows() == {"coordinator": "true", "stage-0": "true", "stage-1": "true"}
        boxes = browser.execute_script(
            "return Array.from(document.querySelectorAll('g.node')).map(g => g.dataset.id);"
        )
        assert sorted(boxes) == ["coordinator", "stage-0", "stage-1"]
        links = browser.execute_script("return document.querySelectorAll('.link').length;")
        assert links == 3
        assert "all nodes up" in browser.find_element("id", "status").text
        stages[1].p.kill()
        took = wait_until(lambda: rows().get("stage-1") == "false", 10.0)
        assert took < 5.0, took
        assert "down: stage-1" in browser.find_element("id", "status").text
        shot = tmp_path_factory.getbasetemp() / "dashboard.png"
        browser.save_screenshot(str(shot))
        print(f"dashboard screenshot: {shot}")
        assert shot.stat().st_size > 10_000
    finally:
        browser.quit()


def test_a_routers_view_links_it_to_its_prefill_and_decode_nodes() -> None:
    from mlxcel.base.topology import router_topology

    stats = {
        "nodes": [
            {"id": "prefill-0", "role": "prefill", "healthy": True, "active": 1,
             "completed": 4, "failed": 0, "last_seen_s": 0.3},
            {"id": "decode-0", "role": "decode", "healthy": False, "active": 0,
             "completed": 2, "failed": 1, "last_seen_s": 4.2},
            {"id": "decode-1", "role": "decode", "healthy": True, "active": 1,
             "completed": 2, "failed": 0, "last_seen_s": 0.1},
        ],
        "metrics": {"in_flight": 2},
    }  # fmt: skip
    nodes, links = router_topology(stats)
    assert [(n["id"], n["up"]) for n in nodes] == [
        ("router", True), ("prefill-0", True), ("decode-0", False), ("decode-1", True)
    ]  # fmt: skip
    assert links == [
        ["router", "prefill-0"], ["prefill-0", "decode-0"], ["prefill-0", "decode-1"],
        ["decode-0", "router"], ["decode-1", "router"],
    ]  # fmt: skip
    assert nodes[0]["in_flight"] == 2 and nodes[2]["failed"] == 1


def test_without_a_browser_the_test_skips_and_names_it_or_fails_where_ci_requires_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tests.server.test_cluster_view as me

    monkeypatch.setattr(me, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv(REQUIRE_BROWSER, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no browser: /nonexistent/chromium"):
        chromium_or_skip()
    monkeypatch.setenv(REQUIRE_BROWSER, "1")
    with pytest.raises(pytest.fail.Exception, match="MLXCEL_REQUIRE_BROWSER is set"):
        chromium_or_skip()
