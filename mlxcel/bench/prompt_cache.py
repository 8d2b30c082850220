"""``python -m mlxcel bench prompt-cache``: what a cached history saves on a chat's next turn.

Turn 1 sends ``history`` random tokens (seeded) and generates ``tokens`` greedily; turn 2
resends all of it, the reply and ``turn_tokens`` new tokens, as a chat client does. Measured
in one run, time to first token (TTFT) of each turn:

- mlxcel's engine through its frontend (``assemble(LocalSpec)``, the path ``serve`` uses) with its
  prompt cache, and turn 2 again on an engine without one;
- mlx-lm as its own chat loop uses it: one ``make_prompt_cache`` carried from turn 1 into
  turn 2, which then feeds only the tokens the cache lacks.

The ``ratio`` row is turn 2's TTFT over turn 1's, for each engine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from mlxcel.bench.engine import mlx_lm_stream, mlxcel_stream


def _mlx_lm_chat(model: Any, tokenizer: Any, history: list[int], user: list[int], n: int) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ttft1, reply, _ = mlx_lm_stream(model, tokenizer, history, n, cache)
    second = history + reply + user
    held = int(cache[0].offset)  # what the cache already holds of turn 2's tokens
    ttft2, _, _ = mlx_lm_stream(model, tokenizer, second[held:], n, cache)
    return [(1, len(history), 0, ttft1), (2, len(second), held, ttft2)]


async def _mlxcel_turn(fe: Any, ids: list[int], tokens: int) -> tuple[float, list[int], int]:
    u, reply = await mlxcel_stream(fe, ids, tokens)
    assert u.first_token_at is not None
    return (u.first_token_at - u.submitted_at) * 1e3, reply, u.cached_tokens


async def run_bench(model: Path, s: Any) -> int:
    from mlx_lm.utils import load

    from mlxcel.runtime.blas import blas_name
    from mlxcel.serving.assembly import Generation, LocalSpec, assemble

    ref_model, ref_tok = load(str(model))
    vocab = int(ref_model.args.vocab_size) if hasattr(ref_model, "args") else 256
    rng = random.Random(0)

    def draw(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    # Each engine first runs a whole chat of the same sizes on other tokens: kernels compile
    # on a shape's first use (10-30 s on a GPU), which is not what a second turn costs.
    warm, warm_user = draw(s.history), draw(s.turn_tokens)
    history, user = draw(s.history), draw(s.turn_tokens)
    rows: list[dict] = []

    def row(engine: str, turn: int, prompt: int, cached: int, ttft: float) -> None:
        rows.append(
            {
                "bench": "prompt-cache",
                "engine": engine,
                "turn": turn,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "ttft_ms": round(ttft, 1),
                "blas": blas_name(),
            }
        )

    _mlx_lm_chat(ref_model, ref_tok, warm, warm_user, s.tokens)
    for turn, prompt, cached, ttft in _mlx_lm_chat(ref_model, ref_tok, history, user, s.tokens):
        row("mlx-lm", turn, prompt, cached, ttft)
    async with assemble(LocalSpec(model), Generation(prompt_cache_bytes=4 << 30)) as st:
        _, warm_reply, _ = await _mlxcel_turn(st.frontend, warm, s.tokens)
        await _mlxcel_turn(st.frontend, warm + warm_reply + warm_user, s.tokens)
        ttft1, reply, _ = await _mlxcel_turn(st.frontend, history, s.tokens)
        second = history + reply + user
        ttft2, _, cached = await _mlxcel_turn(st.frontend, second, s.tokens)
    row("mlxcel", 1, len(history), 0, ttft1)
    row("mlxcel", 2, len(second), cached, ttft2)
    async with assemble(LocalSpec(model), Generation(prompt_cache_bytes=0)) as st:
        await _mlxcel_turn(st.frontend, warm + warm_reply + warm_user, s.tokens)
        off, _, _ = await _mlxcel_turn(st.frontend, second, s.tokens)
    row("mlxcel, no cache", 2, len(second), 0, off)
    ref1, ref2 = rows[0]["ttft_ms"], rows[1]["ttft_ms"]
    rows.append(
        {
            "bench": "prompt-cache",
            "ratio": round(ttft2 / ttft1, 3),  # mlxcel: turn 2 / turn 1
            "mlx_lm_ratio": round(ref2 / ref1, 3) if ref1 else 0.0,
        }
    )
    if s.json_lines:
        for r in rows:
            print(json.dumps(r), flush=True)
        return 0
    print(f"model {model} | {s.history}-token history, +{s.turn_tokens} tokens in turn 2")
    for r in rows[:-1]:
        print(
            f"{r['engine']:>17} turn {r['turn']}: TTFT {r['ttft_ms']:>8.1f} ms "
            f"({r['prompt_tokens']} prompt tokens, {r['cached_tokens']} from cache)"
        )
    last = rows[-1]
    print(f"turn 2 / turn 1 TTFT: mlxcel x{last['ratio']}, mlx-lm x{last['mlx_lm_ratio']}")
    return 0
