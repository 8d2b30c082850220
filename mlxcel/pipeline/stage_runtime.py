"""What a stage computes: its layer range over mlx-lm, one compute job at a time.

Every MLX object of a stage -- caches, input arrays, samplers -- is created and used here,
on the stage's compute thread: MLX streams belong to the thread that made them (on GPUs, and
on CPUs for any op), so the reactor and the protocol core only ever hold plain bytes and
ints. The core (:mod:`mlxcel.pipeline.stage_core`) names sequences by key; this keeps their
caches under that key until the core frees it.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mlxcel.messages import ErrorCode, Tensor
from mlxcel.pipeline.stage_protocol import ComputeJob, Sampled, SeqKey, Step, StepFailed, StepOutput
from mlxcel.runtime.model import LayerRange, merge_rows, split_row
from mlxcel.runtime.sampling import Sampler, make_sampler
from mlxcel.runtime.tensors import from_tensor, to_tensor


class StageRuntime:
    """A layer range plus the per-sequence caches and samplers. Call only on one thread."""

    def __init__(self, layers: LayerRange) -> None:
        self.layers = layers
        self.width = layers.loaded.hidden_size
        self.vocab = int(layers.loaded.config["vocab_size"])
        self.caches: dict[SeqKey, list[Any]] = {}
        self.samplers: dict[SeqKey, Sampler | None] = {}

    def free(self, key: SeqKey) -> None:
        self.caches.pop(key, None)
        self.samplers.pop(key, None)

    def run(self, job: ComputeJob) -> tuple[list[StepOutput], float]:
        """The job's outputs and how long it ran *on this thread*: timed here, not on the
        reactor, so the hand-offs to and from the thread count as protocol overhead."""
        t0 = time.perf_counter()
        outs = self._run(job)
        return outs, time.perf_counter() - t0

    def warm_up(self, tokens: int, first: bool, last: bool) -> None:
        """A throwaway prompt chunk and decode step: a GPU compiles its kernels on first use
        (tens of seconds on a fresh machine), better before the stage reports ready."""
        cache = self.layers.make_batch_cache()
        for n in (tokens, 1):
            if first:
                x = mx.zeros((1, n), dtype=mx.int32)
            else:
                x = mx.zeros((1, n, self.width), dtype=self.layers.dtype)
            h = self.layers(x, cache, head="last")
            if last:
                logits = h[:, -1, :]
                h = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
            mx.eval(h)

    def _run(self, job: ComputeJob) -> list[StepOutput]:
        """One sequence runs on its own cache. Several (single-token decode steps) run as one
        batch: their caches are merged into mlx-lm's BatchKVCache (left-padded to a common
        length, with the matching attention mask), and split back afterwards."""
        steps = job.steps
        caches = [self.caches.setdefault(s.key, self.layers.make_batch_cache()) for s in steps]
        xs = [
            mx.array([list(s.tokens)], dtype=mx.int32)
            if s.tokens is not None
            else from_tensor(s.hidden)  # type: ignore[arg-type]
            for s in steps
        ]
        head = "none" if not any(s.sample for s in steps) else "all"
        if job.last and not job.return_logits and head != "none":
            head = "last"  # sampling needs the last position's logits only
        if len(steps) == 1:
            h = self.layers(xs[0], caches[0], head=head)
        else:
            batch = [merge_rows([c[i] for c in caches]) for i in range(len(caches[0]))]
            h = self.layers(mx.concatenate(xs, axis=0), batch, head=head)
            mx.eval(h)
            for row, s in enumerate(steps):
                caches[row] = self.caches[s.key] = [split_row(c, row) for c in batch]
        if not job.last:
            mx.eval(h)
            return [to_tensor(h[row : row + 1]) for row in range(len(steps))]
        if head == "none":
            mx.eval([c.state for cache in caches for c in cache])
            return [None] * len(steps)
        if job.return_logits:
            mx.eval(h)
            return [to_tensor(h[row : row + 1].astype(mx.float32)) for row in range(len(steps))]
        return [
            self._sample(s, h[row : row + 1, -1, :]) if s.sample else None
            for row, s in enumerate(steps)
        ]

    def _sample(self, step: Step, logits: mx.array) -> Sampled | StepFailed:
        """One row's token; a failure here fails this sequence only."""
        try:
            if step.key not in self.samplers:
                self.samplers[step.key] = make_sampler(step.sampling)
            sampler = self.samplers[step.key]
            # Exactly the one-process engine's arithmetic (mlx-lm's batch generator): normalise
            # in the model's dtype, then argmax or sample. In bf16 the normalisation rounds, so
            # skipping it would break near-ties differently.
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tok = sampler(logprobs) if sampler is not None else mx.argmax(logprobs, -1)
            mx.eval(tok, logprobs)
            t = int(tok.item())
            return Sampled(t, float(logprobs[0, t].item()))
        except Exception as exc:
            why = f"sampling failed: {type(exc).__name__}: {exc}"
            return StepFailed(ErrorCode.SAMPLING_FAILED, why)


__all__ = ["StageRuntime", "Tensor"]
