"""The bodies of the CLI commands. Imported lazily: ``--help`` never loads MLX."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import aclosing
from pathlib import Path

from loguru import logger

from mlxcel.config import (
    BenchBatchingSettings,
    BenchFramesSettings,
    CheckpointSettings,
    GenerateSettings,
    KeygenSettings,
    ServeSettings,
)
from mlxcel.frontend import Usage
from mlxcel.home import embedded_model
from mlxcel.messages import SamplingParams


def resolve_model(model: str | None, shape: str = "tiny") -> Path:
    if model is not None:
        return Path(model).expanduser()
    path = embedded_model(shape)
    logger.info("no --model given: using the embedded {} checkpoint at {}", shape, path)
    return path


def checkpoint(s: CheckpointSettings) -> int:
    from mlxcel.runtime.checkpoint import stderr_progress, write_checkpoint

    write_checkpoint(s.out, s.shape, s.family, s.seed, s.quantize, progress=stderr_progress)
    return 0


async def generate(s: GenerateSettings) -> int:
    from mlxcel.runtime.blas import ensure_blas
    from mlxcel.server.run import local_stack

    logger.info("BLAS: {}", ensure_blas())
    path = resolve_model(s.model)
    async with local_stack(
        path, max_batch_size=1, prefill_step_size=s.prefill_step_size, parallel=1, name="generate"
    ) as stack:
        fe = stack.frontend
        if s.chat:
            ids = fe.apply_chat_template([{"role": "user", "content": s.prompt}])
        else:
            ids = fe.encode_prompt(s.prompt)
        params = SamplingParams(
            temperature=s.temp, top_p=s.top_p, top_k=s.top_k, seed=s.seed, max_tokens=s.max_tokens
        )
        usage = Usage()
        async with aclosing(fe.stream(ids, params, usage=usage)) as it:
            async for d in it:
                sys.stdout.write(d.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        print(_stats_line(usage), flush=True)
    return 0


def _stats_line(u: Usage) -> str:
    prefill = decode = 0.0
    if u.first_token_at is not None:
        dt = u.first_token_at - u.submitted_at
        prefill = u.prompt_tokens / dt if dt > 0 else 0.0
        if u.last_token_at is not None and u.completion_tokens > 1:
            dd = u.last_token_at - u.first_token_at
            decode = (u.completion_tokens - 1) / dd if dd > 0 else 0.0
    return (
        f"prompt tokens: {u.prompt_tokens}, generated tokens: {u.completion_tokens}, "
        f"prefill: {prefill:.1f} tok/s, decode: {decode:.1f} tok/s"
    )


async def serve(s: ServeSettings) -> int:
    from mlxcel.server.run import serve as run_server

    await run_server(s, resolve_model(s.model))
    return 0


async def bench_batching(s: BenchBatchingSettings) -> int:
    """Aggregate greedy decode throughput at each stream count, one model load, one run."""
    from mlxcel.runtime.blas import blas_name, ensure_blas
    from mlxcel.server.run import local_stack

    desc = ensure_blas()
    counts = [int(x) for x in s.streams.split(",") if x.strip()]
    path = resolve_model(s.model, shape="small")
    top = max(counts)
    async with local_stack(
        path,
        max_batch_size=max(top, s.max_batch_size),
        parallel=top,
        prefill_step_size=s.prefill_step_size,
        name="bench",
    ) as stack:
        fe = stack.frontend

        async def one(i: int, n: int) -> Usage:
            u = Usage()
            ids = fe.encode_prompt(f"Benchmark stream {i}: the quick brown fox number {i * 7}")
            async with aclosing(fe.stream(ids, SamplingParams(max_tokens=n), usage=u)) as it:
                async for _ in it:
                    pass
            return u

        await asyncio.gather(*(one(i, 8) for i in range(top)))  # warm-up: compile and fill caches
        if not s.json_lines:
            print(f"model {path} | BLAS: {desc}")
        base = None
        for n in counts:
            t0 = time.perf_counter()
            usages = await asyncio.gather(*(one(i, s.tokens) for i in range(n)))
            wall = time.perf_counter() - t0
            total = sum(u.completion_tokens for u in usages)
            # Decode-only rate: tokens after each stream's first, over the span they were made in.
            first = max(u.first_token_at or 0.0 for u in usages)
            last = max(u.last_token_at or 0.0 for u in usages)
            after_first = sum(max(0, u.completion_tokens - 1) for u in usages)
            start = min(u.first_token_at or 0.0 for u in usages)
            decode = after_first / (last - start) if last > start else 0.0
            rate = total / wall
            base = base or rate
            row = {
                "bench": "batching",
                "streams": n,
                "tokens": total,
                "wall_s": round(wall, 4),
                "tok_per_s": round(rate, 2),
                "decode_tok_per_s": round(decode, 2),
                "speedup_vs_first": round(rate / base, 2),
                "blas": blas_name(),
                "all_started_s": round(first - start, 4),
            }
            if s.json_lines:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"streams {n:>3}: {rate:8.1f} tok/s aggregate ({decode:.1f} decode-only), "
                    f"x{rate / base:.2f} vs {counts[0]} stream(s), {total} tokens in {wall:.2f}s",
                    flush=True,
                )
    return 0


async def bench_frames(s: BenchFramesSettings) -> int:
    from mlxcel.net.bench_frames import parse_sizes, run_bench

    modes = [m.strip() for m in s.modes.split(",")]
    return await run_bench(s.json_lines, parse_sizes(s.sizes), s.scale, modes)


def keygen(s: KeygenSettings) -> int:
    from mlxcel.net.secret import keygen as write_secret

    path = write_secret(s.out, force=s.force)
    print(
        f"wrote a new cluster secret to {path} (mode 0600); copy it to every node", file=sys.stderr
    )
    return 0
