"""One sequence alone: decoded on its own cache, the way mlx-lm's ``generate_step`` does.

mlx-lm's ``BatchGenerator`` pays on every step for what a batch needs (a padded batch cache
and its masks, per-row bookkeeping). With one sequence on a fast GPU the host's Python is the
bottleneck, and that costs about a quarter of the decode rate of ``stream_generate`` (H200,
Qwen3-0.6B shapes, 4-bit, one process: 175 vs 239 tok/s). So a sequence that starts while
the engine is idle decodes here, pipelined as ``generate_step`` is: the next token's graph
is queued before this token is read (from the second token on: the first is read at once).

``generate_step`` itself cannot let go of a live sequence, and a second request must not
wait for the first to finish: :meth:`Solo.hand_over` gives the batch generator everything it
needs to continue the same sequence (the cache, the tokens in it, the token already sampled,
the same sampler with its key chain), so the tokens are those the sequence would have had.

Compute thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxcel.runtime.sampling import Sampler


@dataclass(frozen=True, slots=True)
class SoloToken:
    token: int
    logprobs: mx.array  # the step's normalized log-probabilities (vocabulary,)
    finish: str | None  # "stop" (an end-of-sequence token), "length" or None
    first: bool  # the sequence's first generated token


@dataclass(frozen=True, slots=True)
class HandOver:
    """What the batch generator continues from: feed ``prompt`` on top of ``cache``, which
    holds ``fed``; ``max_tokens`` more may be generated. ``prompt`` is the rest of the prompt
    (handed over mid-prompt) or the one token generated but not yet fed (mid-decode)."""

    cache: list[Any]
    fed: list[int]
    prompt: list[int]
    max_tokens: int


class Solo:
    def __init__(
        self,
        model: Any,
        request_id: str,
        uid: int,
        prompt: list[int],
        cache: list[Any],
        fed: list[int],
        sampler: Sampler | None,
        max_tokens: int,
        eos: set[int],
        prefill_step_size: int,
    ) -> None:
        self.model = model
        self.request_id = request_id
        self.uid = uid
        self.cache = cache
        self.fed = list(fed)  # tokens the cache holds
        self.rest = list(prompt)  # prompt tokens not yet fed
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.eos = eos
        self.prefill_step_size = prefill_step_size
        self.generated = 0
        self._pending: tuple[mx.array, mx.array] | None = None  # sampled, not yet read
        self._unfed: int | None = None  # the first token: returned, fed by the next step

    def _forward(self, inputs: mx.array) -> tuple[mx.array, mx.array]:
        logits = self.model(inputs[None], cache=self.cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self.sampler(logprobs) if self.sampler else mx.argmax(logprobs, axis=-1)
        return token, logprobs.squeeze(0)

    def step(self) -> SoloToken | None:
        """One prefill chunk (None) or one generated token."""
        with mx.stream(generation_stream):
            if len(self.rest) > 1:
                # Every prompt token but the last, a chunk at a time, then the last one alone:
                # the batch generator's order. Feeding the last chunk and the last token in one
                # forward would round differently under a CPU BLAS (a matmul of n rows against
                # one of n-1, then 1), and a near-tie would then pick another token alone than
                # in the batch.
                n = min(self.prefill_step_size, len(self.rest) - 1)
                chunk, self.rest = self.rest[:n], self.rest[n:]
                self.model(mx.array(chunk)[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                self.fed += chunk
                return None
            if self.rest:
                return self._first()
            if self._pending is None:  # the first token, returned unfed: feed it now
                assert self._unfed is not None
                self._queue(mx.array([self._unfed]))
                self.fed.append(self._unfed)
                self._unfed = None
            token, logprobs = self._pending
            # Queue the next step before reading this token. Every token returned is fed,
            # the last one too (as generate_step and the batch generator do): the cache
            # then holds the whole sequence, for the prompt cache.
            self._queue(token)
            out = self._read(token, logprobs)
            self.fed.append(out.token)
            return out

    def _first(self) -> SoloToken:
        """The last prompt token's forward gives the first token, read at once and fed by
        the next step: on a GPU, queueing a step costs milliseconds of host time (building
        the graph, launching its kernels), which the first token would otherwise wait
        behind."""
        token, logprobs = self._forward(mx.array(self.rest))
        self.fed += self.rest
        self.rest = []
        out = self._read(token, logprobs)
        if out.finish is None:
            self._unfed = out.token
        else:  # fed now, so the cache holds the whole sequence for the prompt cache
            self._queue(token)
            self.fed.append(out.token)
        return out

    def _queue(self, token: mx.array) -> None:
        """Feed ``token`` and sample the next one, evaluated in the background."""
        self._pending = self._forward(token)
        mx.async_eval(*self._pending)

    def _read(self, token: mx.array, logprobs: mx.array) -> SoloToken:
        t = int(token.item())
        self.generated += 1
        finish = (
            "stop" if t in self.eos else "length" if self.generated >= self.max_tokens else None
        )
        return SoloToken(t, logprobs, finish, self.generated == 1)

    def hand_over(self) -> tuple[SoloToken | None, HandOver | None]:
        """Stop decoding alone. A token sampled but not yet read is read and returned (it
        belongs to the sequence); if the sequence goes on, the batch generator continues it
        from the returned :class:`HandOver` (None: that token finished it)."""
        if self._unfed is not None:  # after its first token, which the next step feeds
            left = self.max_tokens - self.generated
            return None, HandOver(self.cache, self.fed, [self._unfed], left)
        if self._pending is None:  # still in its prompt: the batch generator prefills the rest
            return None, HandOver(self.cache, self.fed, self.rest, self.max_tokens)
        token, logprobs = self._pending
        self._pending = None
        with mx.stream(generation_stream):
            out = self._read(token, logprobs)
        if out.finish is not None:
            return out, None
        return out, HandOver(self.cache, self.fed, [out.token], self.max_tokens - self.generated)
