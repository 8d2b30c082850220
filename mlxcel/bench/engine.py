"""``python -m mlxcel bench engine``: mlxcel's engine beside mlx-lm's own path, one run.

For each stream count, both engines get the same random prompts (seeded token ids) and
generate greedily up to ``tokens`` each:

- mlx-lm, untuned, as a user would call it: ``stream_generate`` for one stream,
  ``batch_generate``'s loop for several (timed per stream, see :func:`mlx_lm_batch`);
- mlxcel's engine through its frontend (``assemble(LocalSpec)``: the path ``serve`` uses), the
  streams submitted at once.

Each row has ``engine``, ``streams``, ``prompt_tokens``, ``decode_tok_per_s`` (tokens after
each stream's first, over the time they took) and ``ttft_ms`` (mean time to the first token);
a ``ratio`` row divides mlxcel's decode rate by mlx-lm's. Both engines stop a stream at an
end-of-sequence token, so ``tokens`` counts what they really generated (the same, greedy).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any


def _prompts(vocab: int, streams: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(streams)]


def mlx_lm_stream(
    model: Any, tokenizer: Any, ids: list[int], tokens: int, cache: list | None = None
) -> tuple[float, list[int], Any]:
    """mlx-lm's ``stream_generate`` as a user calls it: time to first token (ms), the tokens,
    and its last response (with its own rates)."""
    from mlx_lm.generate import stream_generate

    t0 = time.perf_counter()
    first = last = None
    out: list[int] = []
    for r in stream_generate(model, tokenizer, ids, max_tokens=tokens, prompt_cache=cache):
        first = first or time.perf_counter()
        out.append(int(r.token))
        last = r
    assert first is not None and last is not None
    return (first - t0) * 1e3, out, last


async def mlxcel_stream(fe: Any, ids: list[int], tokens: int) -> tuple[Any, list[int]]:
    """One greedy request through mlxcel's frontend (the path ``serve`` takes): its
    :class:`~mlxcel.serving.frontend.Usage` and tokens."""
    from mlxcel.base.messages import SamplingParams
    from mlxcel.serving.frontend import Usage

    u = Usage()
    out: list[int] = []
    async with aclosing(fe.stream(ids, SamplingParams(max_tokens=tokens), usage=u)) as it:
        async for d in it:
            out.extend(d.token_ids)
    return u, out


def _mlx_lm_row(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int) -> dict:
    import mlx.core as mx

    if len(prompts) == 1:
        ttft, _, last = mlx_lm_stream(model, tokenizer, prompts[0], tokens)
        mx.synchronize()
        return {
            "decode_tok_per_s": last.generation_tps,
            "ttft_ms": ttft,
            "tokens": last.generation_tokens,
        }
    return mlx_lm_batch(model, tokenizer, prompts, tokens)


def mlx_lm_batch(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int) -> dict:
    """``batch_generate``'s own loop (mlx-lm's ``BatchGenerator``, the same calls in the same
    order), with each stream's first token timed: ``batch_generate`` itself reports only
    ``prompt_time``, the prefill, which leaves out the step that samples the first tokens."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    t0 = time.perf_counter()
    uids = gen.insert(prompts, [tokens] * len(prompts))
    firsts: dict[int, float] = {}
    generated = 0
    with gen.stats() as stats:
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                firsts.setdefault(r.uid, now)
                generated += r.finish_reason != "stop"  # as batch_generate counts its tokens
    gen.close()
    return {
        "decode_tok_per_s": stats.generation_tps,
        "ttft_ms": sum(firsts[u] - t0 for u in uids) / len(uids) * 1e3,
        "tokens": generated,
    }


async def _mlxcel_row(fe: Any, prompts: list[list[int]], tokens: int) -> dict:
    runs = await asyncio.gather(*(mlxcel_stream(fe, p, tokens) for p in prompts))
    usages = [u for u, _ in runs]
    firsts = [u.first_token_at or 0.0 for u in usages]
    start, end = min(firsts), max(u.last_token_at or 0.0 for u in usages)
    after_first = sum(max(0, u.completion_tokens - 1) for u in usages)
    ttft = sum(f - u.submitted_at for f, u in zip(firsts, usages, strict=True)) / len(usages)
    return {
        "decode_tok_per_s": after_first / (end - start) if end > start else 0.0,
        "ttft_ms": ttft * 1e3,
        "tokens": sum(u.completion_tokens for u in usages),
    }


async def run_bench(
    model: Path,
    streams: list[int],
    prompt_tokens: int,
    tokens: int,
    json_lines: bool,
    repeats: int = 3,
) -> int:
    """At each stream count, ``repeats`` rounds, each mlx-lm then mlxcel on the same prompts:
    rows hold the median round's rates and the ratio row the median, least and greatest of
    the rounds' ratios (the spread says how far one run can be trusted on a shared machine)."""
    import statistics

    from mlx_lm.utils import load

    from mlxcel.runtime.blas import blas_name
    from mlxcel.serving.assembly import Generation, LocalSpec, assemble

    ref_model, ref_tok = load(str(model))
    vocab = int(ref_model.args.vocab_size) if hasattr(ref_model, "args") else 256
    top = max(streams)
    rows: list[dict] = []
    gen = Generation(parallel=top, max_batch_size=top, prefill_step_size=2048)
    async with assemble(LocalSpec(model), gen) as st:
        for n in streams:
            prompts = _prompts(vocab, n, prompt_tokens, seed=n)
            # Warm-up at this batch shape first: kernels compile on first use of a shape.
            # mlx-lm runs on this thread, as a user's script would (mlxcel is idle meanwhile).
            _mlx_lm_row(ref_model, ref_tok, prompts, 8)
            await _mlxcel_row(st.frontend, prompts, 8)
            rounds = []
            for _ in range(repeats):
                ref = _mlx_lm_row(ref_model, ref_tok, prompts, tokens)
                ours = await _mlxcel_row(st.frontend, prompts, tokens)
                rate = ref["decode_tok_per_s"]
                rounds.append((ours["decode_tok_per_s"] / rate if rate else 0.0, ref, ours))
            rounds.sort(key=lambda r: r[0])
            ratios = [r[0] for r in rounds]
            _, ref, ours = rounds[len(rounds) // 2]  # the median round
            for engine, r in (("mlx-lm", ref), ("mlxcel", ours)):
                rows.append(
                    {
                        "bench": "engine",
                        "engine": engine,
                        "streams": n,
                        "prompt_tokens": prompt_tokens,
                        "tokens": r["tokens"],
                        "decode_tok_per_s": round(r["decode_tok_per_s"], 2),
                        "ttft_ms": round(r["ttft_ms"], 1),
                        "blas": blas_name(),
                    }
                )
            rows.append(
                {
                    "bench": "engine",
                    "streams": n,
                    "ratio": round(statistics.median(ratios), 3),
                    "ratio_min": round(ratios[0], 3),
                    "ratio_max": round(ratios[-1], 3),
                    "rounds": repeats,
                }
            )
    if json_lines:
        for r in rows:
            print(json.dumps(r), flush=True)
        return 0
    print(
        f"model {model} | {prompt_tokens}-token random prompts, up to {tokens} greedy tokens, "
        f"median of {repeats} rounds"
    )
    for r in rows:
        if "ratio" in r:
            print(
                f"  streams {r['streams']:>3}: mlxcel / mlx-lm decode = x{r['ratio']} "
                f"(rounds from x{r['ratio_min']} to x{r['ratio_max']})"
            )
        else:
            print(
                f"{r['engine']:>7} streams {r['streams']:>3}: {r['decode_tok_per_s']:>9.1f} "
                f"decode tok/s, TTFT {r['ttft_ms']:>8.1f} ms, {r['tokens']} tokens"
            )
    return 0
