from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import run_cli
from tests.conftest import error_line

ROOT = Path(__file__).resolve().parents[2]


def _bench(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m mlxcel ARGV``, which must succeed."""
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return r


def _py(code: str, env: dict[str, str]) -> str:
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_blas_choice_is_reported_and_can_be_opted_out() -> None:
    code = "from mlxcel.runtime.blas import ensure_blas; print(ensure_blas())"
    assert _py(code, {"MLXCEL_BLAS": "bundled"}).startswith(
        "bundled reference BLAS (MLXCEL_BLAS=bundled)"
    )
    auto = _py(code, {"MLXCEL_BLAS": "", "MLXCEL_BLAS_THREADS": ""})
    if sys.platform == "linux" and platform.machine() == "x86_64":
        # The mkl wheel is a dependency there: a fresh install needs nothing else.
        assert auto.startswith("mkl 20") and "libmkl_rt.so" in auto, auto
    else:
        assert auto.startswith("openblas (") or "hint:" in auto
    late = _py("import mlx.core; " + code, {"MLXCEL_BLAS": ""})
    assert "imported before" in late
    broken = _py(code, {"MLXCEL_BLAS": "/nonexistent/libblas.so"})
    assert broken.startswith("bundled reference BLAS (slow)") and "MLXCEL_BLAS=" in broken


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="mkl")
def test_blas_threads_follow_the_setting_and_the_share_of_cores() -> None:
    code = "from mlxcel.runtime.blas import ensure_blas; print(ensure_blas())"
    assert _py(code, {"MLXCEL_BLAS": "mkl", "MLXCEL_BLAS_THREADS": "1"}).endswith(", 1 threads")
    # A user's own MKL_NUM_THREADS wins over mlxcel's share.
    env = {"MLXCEL_BLAS": "mkl", "MLXCEL_BLAS_THREADS": "1", "MKL_NUM_THREADS": "2"}
    assert _py(code, env).endswith(", 2 threads")
    assert _py(code, {"MLXCEL_BLAS": "MKL"}).startswith("mkl ")  # names in any case
    problem = "from mlxcel.runtime.blas import blas_problem; print(blas_problem())"
    assert "not a positive integer" in _py(problem, {"MLXCEL_BLAS_THREADS": "-1"})
    assert _py(problem, {"MLXCEL_BLAS_THREADS": "1", "MLXCEL_BLAS": "mkl"}) == "None"
    assert "not usable" in _py(problem, {"MLXCEL_BLAS": "/no/such.so"})


def test_colocated_processes_split_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.runtime import blas

    monkeypatch.delenv("MLXCEL_BLAS_THREADS", raising=False)
    monkeypatch.setattr(blas.os, "sched_getaffinity", lambda _pid: set(range(17)))
    assert blas.default_threads(1) == 17
    assert blas.default_threads(4) == 4
    assert blas.default_threads(40) == 1
    assert blas.colocated_env(3)["MLXCEL_BLAS_THREADS"] == "5"
    monkeypatch.setenv("MLXCEL_BLAS_THREADS", "7")
    assert blas.colocated_env(3)["MLXCEL_BLAS_THREADS"] == "7"


def test_bench_batching_prints_json_lines(tiny: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "bench",
            "batching",
            "--json",
            "-m",
            str(tiny),
            "--streams",
            "1,2",
            "--tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["streams"] for row in rows] == [1, 2]
    for row in rows:
        assert row["tok_per_s"] > 0 and row["blas"] in ("mkl", "openblas", "bundled")
        assert row["tokens"] == 8 * row["streams"]


@pytest.mark.slow
def test_bench_batching_small_full() -> None:
    """The issue's benchmark on the `small` checkpoint; prints figures, asserts only their shape."""
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "bench", "batching", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["streams"] for row in rows] == [1, 4, 8]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_bench_frames_moves_activations_between_two_namespace_hosts() -> None:
    """--netns-rate: the peer on a second host behind a shaped link; a 1 MiB activation takes
    its time on a 100 Mbit/s wire (about 42 ms one way, past the bucket's 512 KiB burst)."""
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "bench", "frames", "--json", "--scale", "0.02",
         "--sizes", "8K,1M", "--modes", "reference,aes-256-gcm", "--netns-rate", "100mbit"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {
        (row["mode"], row["payload_bytes"]): row for row in map(json.loads, r.stdout.splitlines())
    }
    assert {m for m, _ in rows} == {"reference", "aes-256-gcm", "handshake"}
    big = rows[("aes-256-gcm", 1 << 20)]
    assert big["link"] == "two netns hosts, tc tbf 100mbit"
    assert big["p50_us"] > 20_000  # shaped: far slower than loopback's ~1 ms
    bad = subprocess.run(
        [sys.executable, "-m", "mlxcel", "bench", "frames", "--netns-rate", "fast"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 2 and "'fast' is not a tc rate" in bad.stderr


def test_bench_frames_prints_json_lines_for_every_mode() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "bench",
            "frames",
            "--json",
            "--scale",
            "0.01",
            "--sizes",
            "8K,64K",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    modes = {row["mode"] for row in rows}
    assert modes == {
        "reference",
        "unprotected",
        "hmac-sha256",
        "aes-256-gcm",
        "chacha20-poly1305",
        "handshake",
    }
    for row in rows:
        assert {
            "mode",
            "payload_bytes",
            "iterations",
            "p50_us",
            "p95_us",
            "p99_us",
            "gib_per_s",
        } <= set(row)
        assert row["p50_us"] > 0 and row["iterations"] >= 10


def test_bench_disagg_reports_latency_percentiles_for_both_modes(tiny: Path) -> None:
    argv = ["bench", "disagg", "--json", "-m", str(tiny), "--streams", "2", "--tokens", "8"]
    argv += ["--long-prompts", "1", "--long-len", "64"]
    r = _bench(argv)
    assert " ERROR " not in r.stderr and "Traceback" not in r.stderr, r.stderr  # a clean stop
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["mode"] for row in rows] == ["hybrid", "disagg-1p1d"]
    # The split row really ran through the router and its nodes: warm-up, 2 streams, 1 long.
    assert rows[1]["completed_via_router"] == 4 and "completed_via_router" not in rows[0]
    for row in rows:
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
    assert rows[0]["itl_p99_vs_hybrid"] == 1.0


def test_bench_engine_prints_both_engines_from_one_run(tiny: Path) -> None:
    argv = ["bench", "engine", "--json", "-m", str(tiny), "--streams", "1,3"]
    argv += ["--prompt-tokens", "12", "--tokens", "6", "--repeats", "3"]
    r = _bench(argv)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    engines = [(row.get("engine"), row["streams"]) for row in rows]
    assert engines == [
        ("mlx-lm", 1),
        ("mlxcel", 1),
        (None, 1),
        ("mlx-lm", 3),
        ("mlxcel", 3),
        (None, 3),
    ]
    for row in rows:
        if "engine" in row:
            assert row["prompt_tokens"] == 12 and row["decode_tok_per_s"] > 0
            assert row["ttft_ms"] > 0 and 1 <= row["tokens"] <= 6 * row["streams"]
        else:  # the median of three rounds, with their spread
            assert 0 < row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
            assert row["rounds"] == 3
    # The same greedy work on both sides: the same number of tokens per stream count.
    by = {(row["engine"], row["streams"]): row["tokens"] for row in rows if "engine" in row}
    assert by[("mlx-lm", 1)] == by[("mlxcel", 1)] and by[("mlx-lm", 3)] == by[("mlxcel", 3)]


def test_bench_prompt_cache_prints_every_mode_beside_mlx_lm(tiny: Path) -> None:
    argv = ["bench", "prompt-cache", "--json", "-m", str(tiny), "--modes", "local,pipeline"]
    r = _bench([*argv, "--history", "100,60", "--turn-tokens", "7", "--tokens", "5"])
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(row["engine"], row["history"]) for row in rows] == [
        ("mlx-lm", 100),
        ("mlx-lm", 60),
        ("mlxcel local", 100),
        ("mlxcel local", 60),
        ("mlxcel pipeline", 100),
        ("mlxcel pipeline", 60),
    ]
    for row in rows:
        assert row["turn1_ms"] > 0 and row["cached_ms"] > 0 and row["uncached_ms"] > 0
        # (Ratios of the unrounded times: within rounding of the printed ones.)
        assert row["cached_vs_uncached"] == pytest.approx(
            row["cached_ms"] / row["uncached_ms"], abs=0.02
        )
        # Turn 2 is the history, the reply (5 tokens at most) and 7 more; the cache held the
        # history and the reply (a pipeline never fed the reply's last token: one less).
        h = row["history"]
        assert h + 8 <= row["prompt_tokens"] <= h + 12
        fed = 8 if row["engine"] == "mlxcel pipeline" else 7
        assert row["cached_tokens"] == row["prompt_tokens"] - fed
        if row["engine"] != "mlx-lm":
            local = next(x for x in rows if (x["engine"], x["history"]) == ("mlxcel local", h))
            want = row["cached_ms"] / local["cached_ms"]
            assert row["cached_vs_local"] == pytest.approx(want, rel=0.05, abs=0.02)


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--modes", "local,ring", "modes are local, pipeline, stages, tp, disagg"),
        ("--history", "8,100", "16"),
        ("--history", "100,9000", "the model holds"),
    ],
)
def test_bench_prompt_cache_refuses_unknown_modes_and_sizes(
    tiny: Path, flag: str, value: str, needle: str
) -> None:
    r = run_cli("bench", "prompt-cache", "-m", str(tiny), flag, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = error_line(r.stderr)
    assert flag in line and needle in line


def test_pipeline_load_tool_reports_rate_overhead_and_cpu_per_process(tiny: Path) -> None:
    """``tools/pipeline_load.py`` (the harness behind the H200 profile in benchmarks.md): a
    real 2-stage loopback pipeline under steady load, with the per-step split and each
    process's CPU per token; a bad flag is refused naming it."""
    cmd = [sys.executable, "-m", "tools.pipeline_load", "-m", str(tiny)]
    r = subprocess.run(
        [*cmd, "--streams", "2", "--tokens", "8", "--seconds", "1", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "measuring" in r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["mode"] == "remote" and row["tok_per_s"] > 0 and row["decode_steps"] >= 2
    assert row["overhead_ms_per_step"] >= 0 and row["stage_compute_ms_per_step"] > 0
    names = {"coordinator", "stage-0", "stage-1"}
    assert set(row["cpu_fraction"]) == names and set(row["cpu_ms_per_token"]) == names
    # /proc counts CPU in clock ticks (10 ms): over a second of load the sum shows, while one
    # process's share may round to zero.
    cpu = row["cpu_ms_per_token"].values()
    assert all(v >= 0 for v in cpu) and sum(cpu) > 0
    bad = subprocess.run(
        [*cmd, "--streams", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--streams" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "tools.pipeline_load", "-m", str(ROOT / "no-such-model")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "no-such-model" in missing.stderr
    assert "Traceback" not in missing.stderr


async def test_inter_token_gaps_spread_a_several_token_result_over_its_tokens() -> None:
    """The engine delivers a run's tokens as one result: the latency bench must count one
    gap per token (the result's gap spread over them), not one per result."""
    import asyncio
    import time

    from mlxcel.bench.disagg import _one
    from mlxcel.serving.frontend import Delta

    class Paced:
        async def stream(self, ids: list[int], params: object, usage: object) -> object:
            usage.submitted_at = usage.first_token_at = time.perf_counter()  # type: ignore[attr-defined]
            yield Delta("a", (1,))
            await asyncio.sleep(0.04)
            yield Delta("bcd", (2, 3, 4))
            await asyncio.sleep(0.02)
            yield Delta("e", (5,), "length")

    gaps: list[float] = []
    await _one(Paced(), [1], 5, gaps)  # type: ignore[arg-type]
    assert len(gaps) == 4  # tokens after the first
    # The 40 ms result's gap, spread evenly over its three tokens (lower bounds only: a
    # sleep never ends early, a busy machine may end it late).
    assert gaps[0] == gaps[1] == gaps[2] and 3 * gaps[0] >= 0.04 and gaps[3] >= 0.02, gaps


def test_mlx_lm_batch_ttft_reaches_the_first_tokens(tiny: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """mlx-lm's side of ``bench engine`` at several streams times each stream's first token,
    not only the prefill (``batch_generate``'s ``prompt_time``): a first step made 100 ms
    slower shows in its TTFT."""
    import time

    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    from mlxcel.bench.engine import mlx_lm_batch

    model, tokenizer = load(str(tiny))
    inner, calls = BatchGenerator.next_generated, []

    def slow_first(self):  # type: ignore[no-untyped-def]
        out = inner(self)
        if not calls:  # the step that produced the first tokens
            time.sleep(0.1)
        calls.append(len(out))
        return out

    monkeypatch.setattr(BatchGenerator, "next_generated", slow_first)
    row = mlx_lm_batch(model, tokenizer, [[20, 21, 22, 23], [30, 31, 32]], 4)
    assert calls[0] == 2  # both streams' first tokens came from the first step
    assert row["ttft_ms"] >= 100
    assert row["tokens"] >= 2 and row["decode_tok_per_s"] > 0


def test_a_program_that_imports_mlx_first_is_told_in_one_warning_line() -> None:
    if sys.platform != "linux":
        pytest.skip("the BLAS choice is Linux's (macOS uses Accelerate)")
    first = subprocess.run([sys.executable, "-c", "import mlx.core; import mlxcel"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = first.stderr.strip().splitlines()
    assert len(lines) == 1 and "WARNING" in lines[0], first.stderr
    assert (
        "mlx.core was imported before mlxcel" in lines[0] and "import mlxcel before mlx" in lines[0]
    )
    ok = subprocess.run([sys.executable, "-c", "import mlxcel; import mlx.core"],
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.stderr == ""
