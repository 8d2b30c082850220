"""What splitting a decode step costs with no framework at all: plain mlx-lm, timed three ways.

The reference rows of ``bench pipeline``. On one checkpoint, ``batch`` rows decoding after a
short random prompt, milliseconds per step:

* ``loop`` -- mlx-lm's own generation loop: step t+1's graph is built while step t evaluates
  (``mx.async_eval``), the best one process does;
* ``split`` -- the layers in two halves with an evaluation between them, then the head and an
  argmax, evaluated: what two stages in one process must do at the least;
* ``split_host`` -- the same with the activation copied to host memory and back between the
  halves: what two stage processes must do at the least.

No mlxcel code runs in the timed loops. Call on one thread (the bench's compute thread).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 32
WARM_STEPS = 8


def split_reference(
    model_path: Path, batches: list[int], steps: int
) -> dict[int, dict[str, float]]:
    """{batch: {"loop": ms, "split": ms, "split_host": ms}} per decode step."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _tok = load(str(model_path))
    inner = model.model
    n = len(inner.layers)
    tied = getattr(model.args, "tie_word_embeddings", True)

    def head(h: Any) -> Any:
        h = inner.norm(h)
        return inner.embed_tokens.as_linear(h) if tied else model.lm_head(h)

    def layers(h: Any, cache: list[Any], lo: int, hi: int) -> Any:
        for i in range(lo, hi):
            h = inner.layers[i](h, None, cache[i])
        return h

    def fresh(b: int) -> tuple[list[Any], Any]:
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(0, 1000, (b, PROMPT_TOKENS))
        y = mx.argmax(model(prompt, cache=cache)[:, -1, :], -1)
        mx.eval(y)
        return cache, y

    def full(y: Any, cache: list[Any]) -> Any:
        return mx.argmax(model(y[:, None], cache=cache)[:, -1, :], -1)

    def split(y: Any, cache: list[Any], host: bool) -> Any:
        h = layers(inner.embed_tokens(y[:, None]), cache, 0, n // 2)
        mx.eval(h)
        if host:  # to host memory and back, as between two processes
            h = mx.array(np.array(h.astype(mx.float32))).astype(h.dtype)
        y = mx.argmax(head(layers(h, cache, n // 2, n))[:, -1, :], -1)
        mx.eval(y)
        y.tolist()
        return y

    def timed_split(b: int, host: bool) -> float:
        cache, y = fresh(b)
        for _ in range(WARM_STEPS):
            y = split(y, cache, host)
        t0 = time.perf_counter()
        for _ in range(steps):
            y = split(y, cache, host)
        return (time.perf_counter() - t0) * 1e3 / steps

    def timed_loop(b: int) -> float:
        cache, y = fresh(b)
        y = full(y, cache)
        mx.async_eval(y)
        t0 = 0.0
        for i in range(WARM_STEPS + steps):
            if i == WARM_STEPS:
                t0 = time.perf_counter()
            nxt = full(y, cache)
            mx.async_eval(nxt)
            y.tolist()
            y = nxt
        y.tolist()
        return (time.perf_counter() - t0) * 1e3 / steps

    out = {}
    for b in batches:
        out[b] = {
            "loop": timed_loop(b),
            "split": timed_split(b, False),
            "split_host": timed_split(b, True),
        }
    mx.clear_cache()
    return out
