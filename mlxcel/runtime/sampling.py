"""Per-request samplers built from mlx-lm's sampling pieces, plus stop-string matching.

mlx-lm's ``make_sampler`` draws from MLX's global random state, so two requests with the
same seed would not reproduce inside a shared batch. Here a seeded request carries its own
PRNG key and splits it once per token; the filtering (top-p, top-k) is mlx-lm's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlxcel.messages import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def make_sampler(p: SamplingParams) -> Sampler | None:
    """``None`` means greedy (the batch generator's shared argmax path)."""
    if p.temperature == 0:
        return None
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < p.top_p < 1:
        filters.append(lambda x: apply_top_p(x, p.top_p))
    if p.top_k > 0:
        filters.append(lambda x: apply_top_k(x, p.top_k))
    inv_temp = 1.0 / p.temperature
    key = [mx.random.key(p.seed)] if p.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


class StopStrings:
    """Finds stop strings in streamed text and holds back what might be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
