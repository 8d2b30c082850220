"""The bodies of the CLI commands. Imported lazily: ``--help`` never loads MLX."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from mlxcel.base.errors import ConfigError
from mlxcel.config.settings import GenerateSettings, ServeSettings
from mlxcel.config.tools import (
    BenchBatchingSettings,
    BenchFramesSettings,
    CheckpointSettings,
    DemoSettings,
    KeygenSettings,
)
from mlxcel.process.home import embedded_model
from mlxcel.serving.assembly import (
    Generation,
    LocalSpec,
    PipelineSpec,
    StackSpec,
    TensorParallelSpec,
    assemble,
)
from mlxcel.serving.prompts import generate_messages

if TYPE_CHECKING:
    from mlxcel.serving.frontend import Usage
from mlxcel.base.messages import SamplingParams


def resolve_model(model: str | None, shape: str = "tiny", family: str = "qwen3") -> Path:
    if model is not None:
        from mlxcel.runtime.hub import resolve

        return resolve(model)
    path = embedded_model(shape, family)
    logger.info("no --model given: using the embedded {} {} checkpoint at {}", shape, family, path)
    return path


def checkpoint(s: CheckpointSettings) -> int:
    if s.out.exists() and not s.out.is_dir():
        raise ConfigError("--out", f"{s.out} is a file, not a folder")
    if s.out.is_dir() and any(s.out.iterdir()) and not s.force:
        raise ConfigError("--out", f"{s.out} is not empty (--force writes into it anyway)")
    from mlxcel.process.progress import log_step
    from mlxcel.runtime.checkpoint import write_checkpoint

    write_checkpoint(s.out, s.shape, s.family, s.seed, s.quantize, progress=log_step)
    log_step(f"ready at {s.out}")
    return 0


async def generate(s: GenerateSettings) -> int:
    prompt = _read_prompt(s.prompt)  # before the model loads: a bad prompt fails at once
    path = resolve_model(s.model)
    if await _tp_follower(s, path):
        return 0
    if s.dry_run:
        return _print_plan(path, s.pp_size, s.pp_layers)
    if s.one_stream_only:  # a quantized KV cache or a draft model: mlx-lm's own path
        from mlxcel.cli.one_stream import generate_one_stream

        draft = resolve_model(s.draft_model) if s.draft_model is not None else None
        return await generate_one_stream(s, path, draft, prompt)
    gen = Generation(parallel=1, max_batch_size=1, prefill_step_size=s.prefill_step_size)
    async with assemble(single_host_spec(s, path), gen) as stack:
        logger.info("{}", stack.summary)
        fe = stack.frontend
        ids = _prompt_ids(fe, s, prompt)
        params = SamplingParams(
            temperature=s.temp,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            max_tokens=s.max_tokens,
            min_p=s.min_p,
        )
        from mlxcel.serving.frontend import Usage

        usage = Usage()
        async with aclosing(fe.stream(ids, params, usage=usage)) as it:
            async for d in it:
                sys.stdout.write(d.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        print(_stats_line(usage), flush=True)
    return 0


def _read_prompt(prompt: str) -> str:
    """``-p -`` reads the prompt from stdin (UTF-8); an empty prompt is refused either way."""
    if prompt == "-":
        raw = sys.stdin.buffer.read()
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError("-p/--prompt", f"'-' read text that is not UTF-8 ({exc})") from None
        if not prompt:
            raise ConfigError("-p/--prompt", "'-' read an empty prompt from stdin")
    if not prompt:
        raise ConfigError("-p/--prompt", "the prompt is empty")
    return prompt


def _prompt_ids(fe: Any, s: GenerateSettings, prompt: str) -> list[int]:
    """As ``mlx_lm generate``: the chat template when the tokenizer has one, unless --raw."""
    messages = generate_messages(fe.tokenizer, prompt, s.raw, s.system_prompt)
    return fe.encode_prompt(prompt) if messages is None else fe.apply_chat_template(messages)


def _tp_rank(s: GenerateSettings | ServeSettings) -> int:
    import os as _os

    if s.tp_rank is not None:
        return s.tp_rank
    return int(_os.environ.get("MLX_RANK", "0"))


async def _tp_follower(s: GenerateSettings | ServeSettings, path: Path) -> bool:
    """With --tp-hostfile, every rank but 0 only follows: run that here and report True.
    It meets rank 0 at rank 0's hostfile address and forms the ring at its own."""
    if s.tp_hostfile is None or _tp_rank(s) == 0:
        return False
    from mlxcel.base.errors import ConfigError, MlxcelError
    from mlxcel.tp.follower import join_message, run_follower
    from mlxcel.tp.group import cleartext_hosts, ring_digest, ring_of
    from mlxcel.tp.launch import HOSTFILE_NEEDS_SECRET
    from mlxcel.tp.rendezvous import attend

    rank, ring = _tp_rank(s), ring_of(s.tp_hostfile)
    if not 0 < rank < len(ring):
        raise ConfigError("--tp-rank", f"{rank} is not a rank of the hostfile's {len(ring)}")
    warning = cleartext_hosts([[a] for a in ring], s.tp_allow_cleartext)  # refused: raises
    if warning:
        from loguru import logger

        logger.warning("{}", warning)
    secret = _tp_secret(s)
    if secret is None:
        raise ConfigError("--tp-hostfile", HOSTFILE_NEEDS_SECRET)
    join = join_message(path, rank, ring[rank], ring_digest(ring))
    meeting = await attend(secret, ring[0], join, s.startup_timeout)  # TpGroupFailed: one line
    # From here this process only follows rank 0's steps: nothing else runs on its loop.
    code = run_follower(path, rank, meeting, getattr(s, "max_batch_size", 1), s.prefill_step_size)
    if code:
        raise MlxcelError(f"tensor-parallel rank {rank} left a failed group")
    return True


def _tp_secret(s: GenerateSettings | ServeSettings) -> Any:
    """The cluster secret for ranks started by hand (None: none given)."""
    import os

    from mlxcel.net.secret import load_cluster_secret

    return load_cluster_secret(getattr(s, "cluster_secret_file", None), os.environ, required=False)


def single_host_spec(s: GenerateSettings | ServeSettings, path: Path) -> StackSpec:
    """What ``serve`` and ``generate`` run without a cluster: a tensor-parallel group, an
    in-process pipeline or one process, as the flags say."""
    if s.tp_size > 1 or s.tp_hostfile is not None:
        secret = _tp_secret(s) if s.tp_hostfile is not None else None
        return TensorParallelSpec(
            path,
            s.tp_size,
            s.tp_hostfile,
            s.startup_timeout,
            s.tp_backend,
            s.tp_allow_cleartext,
            secret,
        )
    if s.pp_size > 1 or s.pp_layers is not None:
        return PipelineSpec(path, s.pp_size, s.pp_layers, s.pp_return_logits, s.pp_micro_batch_size)
    return LocalSpec(path, s.adapter_path, s.max_kv_size)


def _print_plan(
    path: Path,
    pp_size: int,
    pp_layers: str | None,
    memory: list[float] | None = None,
    sources: tuple[str, str] | None = None,
) -> int:
    """The plan a pipeline of this checkpoint would run (checked as a real start checks it)."""
    from mlxcel.pipeline.partition import format_plan
    from mlxcel.pipeline.split import FLAG_SOURCES, make_plan

    plan = make_plan(path, pp_size, pp_layers, memory, sources=sources or FLAG_SOURCES)
    print(format_plan(plan))
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


async def bench_batching(s: BenchBatchingSettings) -> int:
    """Aggregate greedy decode throughput at each stream count, one model load, one run."""
    from mlxcel.runtime.blas import blas_name, ensure_blas

    desc = ensure_blas()
    counts = [int(x) for x in s.streams.split(",") if x.strip()]
    path = resolve_model(s.model, shape="small")
    top = max(counts)
    # Every stream in one batch: what the benchmark measures.
    gen = Generation(parallel=top, max_batch_size=top, prefill_step_size=s.prefill_step_size)
    async with assemble(LocalSpec(path), gen) as stack:
        fe = stack.frontend

        from mlxcel.serving.frontend import Usage

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
    from mlxcel.bench.frames import parse_sizes, run_bench, two_hosts

    modes = [m.strip() for m in s.modes.split(",")]
    netns = s.netns or s.netns_rate is not None
    if netns:
        from mlxcel.bench.netns import unavailable

        why = unavailable()
        if why is not None:
            raise ConfigError("--netns", why)
    with two_hosts(netns, s.netns_rate) as where:
        return await run_bench(s.json_lines, parse_sizes(s.sizes), s.scale, modes, where)


def keygen(s: KeygenSettings) -> int:
    from mlxcel.net.secret import keygen as write_secret

    path = write_secret(s.out, force=s.force)
    logger.info("wrote a new cluster secret to {} (mode 0600); copy it to every node", path)
    return 0


async def demo(s: DemoSettings) -> int:
    """A real loopback cluster: 2 stage processes + a coordinator process, one streamed chat."""
    import tempfile
    import time as _time

    import aiohttp

    from mlxcel.pipeline.launch import LoopbackCluster
    from mlxcel.process.home import RANDOM_WEIGHTS_NOTE, is_embedded
    from mlxcel.runtime.blas import ensure_blas

    model = resolve_model(s.model)
    with tempfile.TemporaryDirectory(prefix="mlxcel-demo-") as tmp:
        print(f"BLAS: {ensure_blas()} (every process)", flush=True)
        print(
            f"starting a 2-stage pipeline on loopback (model {model.name}, secret and config in {tmp}) ...",
            flush=True,
        )
        async with LoopbackCluster(model, 2, Path(tmp)) as cluster:
            base = f"http://127.0.0.1:{cluster.http_port}"
            async with aiohttp.ClientSession() as http:
                before = await _wire_bytes(http, base)
                print(f"cluster up: stages on 127.0.0.2 and 127.0.0.3, API on {base}", flush=True)
                if is_embedded(model):
                    print(f"note: {RANDOM_WEIGHTS_NOTE}", flush=True)
                print(f"> {s.prompt}", flush=True)
                body = {
                    "model": model.name,
                    "messages": [{"role": "user", "content": s.prompt}],
                    "max_tokens": s.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                gaps: list[float] = []
                last = _time.perf_counter()
                usage = {}
                async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        logger.error("HTTP {}: {}", resp.status, await resp.text())
                        return 1
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            print(flush=True)
                            logger.error("{}", chunk["error"]["message"])
                            return 1
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for choice in chunk.get("choices", []):
                            text = choice.get("delta", {}).get("content")
                            if text:
                                now = _time.perf_counter()
                                gaps.append(now - last)
                                last = now
                                sys.stdout.write(text)
                                sys.stdout.flush()
                after = await _wire_bytes(http, base)
            tokens = int(usage.get("completion_tokens", len(gaps)))
            per_token = sorted(gaps[1:]) or [0.0]
            print("\n")
            print(
                f"tokens: {tokens}; first token after {gaps[0] * 1e3:.1f} ms; per-token latency "
                f"p50 {per_token[len(per_token) // 2] * 1e3:.2f} ms, max {per_token[-1] * 1e3:.2f} ms",
                flush=True,
            )
            wire = after - before
            print(
                f"bytes on the wire (all nodes, encrypted frames): {wire} total, "
                f"{wire / max(tokens, 1):.0f} per token",
                flush=True,
            )
            codes = await cluster.stop()
            print("shut down: " + ", ".join(f"{k} exit {v}" for k, v in codes.items()), flush=True)
    return 0


async def _wire_bytes(http, base: str) -> int:  # type: ignore[no-untyped-def]
    async with http.get(f"{base}/health") as r:
        h = await r.json()
    p = h.get("pipeline", {})
    return int(p.get("wire_bytes_out", 0)) + sum(
        int(s.get("wire_bytes_out", 0)) for s in p.get("stages", [])
    )
