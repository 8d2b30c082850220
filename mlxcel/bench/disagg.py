"""``python -m mlxcel bench disagg``: latency under a mixed workload, one hybrid node vs a
router with one prefill and one decode node, in one run.

The workload: ``streams`` short prompts decode ``tokens`` tokens each; while they decode,
``long_prompts`` long prompts (``long_len`` tokens, a few output tokens) arrive one after
another. On one node a long prompt's prefill runs in the decode loop, so every short stream
stalls behind it; split, the prefill node runs it while the decode node keeps stepping.
Reported per mode: time to first token (TTFT, every request) and inter-token latency (ITL,
the gaps between a short stream's tokens) at p50 and p99. The disaggregated prefill and
decode nodes run as processes on 127.0.0.x (as on separate hosts), the router in this
process, all over authenticated, encrypted loopback TCP.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

from mlxcel.base.messages import SamplingParams
from mlxcel.base.model_config import vocab_size
from mlxcel.serving.frontend import Frontend, Usage


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def _one(fe: Frontend, ids: list[int], n: int, gaps: list[float] | None) -> float:
    """Run one request; returns its TTFT (s) and appends its inter-token gaps to ``gaps``
    (a result that brings several tokens spreads its gap evenly over them)."""
    u = Usage()
    last = None
    async with aclosing(fe.stream(ids, SamplingParams(max_tokens=n), usage=u)) as it:
        async for d in it:
            now = time.perf_counter()
            if d.token_ids and last is not None and gaps is not None:
                gaps.extend([(now - last) / len(d.token_ids)] * len(d.token_ids))
            if d.token_ids:
                last = now
    assert u.first_token_at is not None
    return u.first_token_at - u.submitted_at


async def workload(
    fe: Frontend, vocab: int, streams: int, tokens: int, long_prompts: int, long_len: int
) -> dict[str, float]:
    rng = secrets.SystemRandom()

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    await _one(fe, prompt(long_len), 2, None)  # warm-up: compile both paths once
    gaps: list[float] = []
    short = [asyncio.create_task(_one(fe, prompt(16), tokens, gaps)) for _ in range(streams)]
    await asyncio.sleep(0.3)  # the short streams are decoding
    longs = []
    for _ in range(long_prompts):
        longs.append(asyncio.create_task(_one(fe, prompt(long_len), 4, None)))
        await asyncio.sleep(0.2)
    ttfts = list(await asyncio.gather(*short, *longs))
    ms = 1e3
    return {
        "ttft_p50_ms": round(ms * percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(ms * percentile(ttfts, 99), 1),
        "long_ttft_p50_ms": round(ms * percentile(ttfts[streams:], 50), 1),
        "itl_p50_ms": round(ms * percentile(gaps, 50), 2),
        "itl_p99_ms": round(ms * percentile(gaps, 99), 2),
        "itl_max_ms": round(ms * max(gaps, default=0.0), 2),
    }


async def run_bench(
    model: Path,
    *,
    streams: int = 4,
    tokens: int = 64,
    long_prompts: int = 3,
    long_len: int = 1536,
    json_lines: bool = False,
) -> int:
    from mlxcel.net.network import free_port
    from mlxcel.net.secret import keygen, load_cluster_secret
    from mlxcel.pipeline.launch import start_serve
    from mlxcel.runtime.blas import blas_name, colocated_env
    from mlxcel.serving.assembly import DisaggSpec, Generation, LocalSpec, assemble
    from mlxcel.serving.tokenizer import load_tokenizer

    _tok, config = load_tokenizer(model)
    vocab = vocab_size(config)
    args = (streams, tokens, long_prompts, long_len)
    rows: list[dict[str, Any]] = []
    n = streams + long_prompts
    gen = Generation(parallel=n, max_batch_size=n)
    async with assemble(LocalSpec(model), gen) as st:
        rows.append({"mode": "hybrid", **await workload(st.frontend, vocab, *args)})

    # Prefill and decode run as processes, as on separate hosts: MLX serialises the CPU work
    # of threads in one process, so two roles in one process would stall each other.
    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp:
        secret_file = keygen(Path(tmp) / "cluster.secret")
        secret = load_cluster_secret(secret_file, {}, None, required=True)
        assert secret is not None
        pa, da, ra = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (41, 42, 43))
        common = ["-m", str(model), "--cluster-secret-file", str(secret_file)]
        common += ["--parallel", str(n), "--max-batch-size", str(n)]
        procs = []
        try:
            env = colocated_env(3)
            env["MLXCEL_DECODE_ALLOWLIST"] = da
            procs = list(
                await asyncio.gather(
                    start_serve(
                        [
                            *common,
                            "--node-role",
                            "prefill",
                            "--serving-bind",
                            pa,
                            "--decode-peers",
                            da,
                        ],
                        Path(tmp) / "prefill.log",
                        "mlxcel prefill node",
                        env,
                    ),
                    start_serve(
                        [*common, "--node-role", "decode", "--serving-bind", da],
                        Path(tmp) / "decode.log",
                        "mlxcel decode node",
                        env,
                    ),
                )
            )
            router = DisaggSpec("router", model, secret, ra, (pa,), (da,))
            async with assemble(router, Generation(parallel=n)) as rt:
                listener = rt.serving.listener
                await listener.start()
                try:
                    row = await workload(rt.frontend, vocab, *args)
                finally:
                    await listener.close()
                # Evidence that this row went through the nodes: requests the router completed
                # with a token 0 from the prefill process and the rest from the decode process.
                row["completed_via_router"] = rt.parts.service.router.counts["completed"]
                rows.append({"mode": "disagg-1p1d", **row})
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                await proc.wait()

    base = rows[0]
    for r in rows:
        r["itl_p99_vs_hybrid"] = (
            round(r["itl_p99_ms"] / base["itl_p99_ms"], 3) if base["itl_p99_ms"] else 0.0
        )
        r["ttft_p99_vs_hybrid"] = (
            round(r["ttft_p99_ms"] / base["ttft_p99_ms"], 3) if base["ttft_p99_ms"] else 0.0
        )
        r.update(
            streams=streams,
            tokens=tokens,
            long_prompts=long_prompts,
            long_len=long_len,
            blas=blas_name(),
        )
        if json_lines:
            print(json.dumps(r), flush=True)
    if not json_lines:
        print(
            f"model {model} | {streams} streams x {tokens} tokens, {long_prompts} prompts of "
            f"{long_len} tokens arriving while they decode"
        )
        head = ("mode", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max", "p99 x hybrid")
        print(f"{head[0]:<13}" + "".join(f"{h:>13}" for h in head[1:]))
        for r in rows:
            cells = (
                r["ttft_p50_ms"],
                r["ttft_p99_ms"],
                r["itl_p50_ms"],
                r["itl_p99_ms"],
                r["itl_max_ms"],
                r["itl_p99_vs_hybrid"],
            )
            print(f"{r['mode']:<13}" + "".join(f"{c:>13}" for c in cells))
        print("(milliseconds; 'p99 x hybrid' is the ITL p99 ratio to the hybrid node)")
    return 0
