"""A stage's warm-up: throwaway sequences through its runtime before it reports ready.

A GPU compiles a kernel the first time it meets a shape class, so the serving path's shapes
are met here first. Compute thread only, like the runtime itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

import mlx.core as mx
from loguru import logger

from mlxcel.base.messages import SamplingParams
from mlxcel.pipeline.stage_protocol import ComputeJob, SeqKey, Step
from mlxcel.runtime.tensors import to_tensor


class WarmUpTarget(Protocol):
    """What warming up needs of :class:`~mlxcel.pipeline.stage_runtime.StageRuntime`."""

    width: int
    layers: Any
    regroups: int

    def run(self, job: ComputeJob) -> Any: ...
    def free(self, key: SeqKey) -> None: ...


WARM_UP_ROWS = 32  # the largest batch warm-up runs: each row is a throwaway prompt to fill
# Prompt chunks of these many tokens meet every tile class of MLX's quantized matmul on a
# GPU: it takes fewer than 8 rows as vectors and tiles 8 or more by the next power of two,
# 16 to 64 (a 21-token prompt compiled the 32-row kernel for 32 s on a fresh H200).
TILE_CLASS_ROWS = (16, 32, 64)
WARM_UP_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, seed=0)


def warm_up(rt: WarmUpTarget, tokens: int, first: bool, last: bool, batch: int = 1) -> None:
    """Serve throwaway sequences through ``rt.run``, as the coordinator would, then free
    them: one ``tokens``-long prompt and its first decode step alone (sampled with top-p,
    top-k and min-p filters); then up to ``WARM_UP_ROWS`` short prompts whose decode steps
    run as batches of 2, 4, ... ``batch`` rows (gathered into a batch cache, regrouped as
    the size changes; greedy); and prompts of ``TILE_CLASS_ROWS`` tokens, alone.

    A GPU compiles a kernel the first time it meets a shape class (on a fresh H200, about
    30 s for each of MLX's quantized matmul kernels); this compiles the serving path's
    (prompt chunks of every tile class, batched decode with padded masks, batch caches that
    grow and shrink, batched greedy and filtered sampling) before the stage reports ready.
    MLX keeps what it compiled on disk, so a later start on the same machine is quick."""
    most = max(1, min(batch, WARM_UP_ROWS))
    sizes = sorted({1 << k for k in range(1, most.bit_length())} | {most}) if most > 1 else []
    lengths = [tokens + 1] + [3 + i % 5 for i in range(most if sizes else 0)]
    lengths += [n + 1 for n in TILE_CLASS_ROWS if n < tokens]  # prompt-only sequences
    keys = [("warm-up", -1 - i) for i in range(len(lengths))]
    groups = [keys[:1]] + [keys[1 : 1 + b] for b in sizes for _ in range(2)]

    def forwards() -> Iterator[list[Step]]:
        for key, n in zip(keys, lengths, strict=True):
            yield [_warm_step(rt, key, n - 1, 0, first, False)]
        pos = {key: n - 1 for key, n in zip(keys, lengths, strict=True)}
        for group in groups:
            steps = [_warm_step(rt, k, 1, pos[k], first, True) for k in group]
            if group[0] == keys[0]:  # the long prompt samples: filters, categorical draw
                steps = [replace(steps[0], sampling=WARM_UP_SAMPLING)]
            yield steps
            pos.update({k: pos[k] + 1 for k in group})

    total, t0 = len(keys) + len(groups), time.monotonic()
    said = t0
    for i, steps in enumerate(forwards(), 1):
        rt.run(_warm_job(steps, first, last))
        if time.monotonic() - said > 5.0:  # compiling: say so, for whoever waits on us
            said = time.monotonic()
            logger.info("warm-up: {} of {} forwards in {:.0f}s", i, total, said - t0)
    for key in keys:
        rt.free(key)
    rt.regroups = 0  # counts serving only


def _warm_step(
    rt: WarmUpTarget, key: SeqKey, n: int, start: int, first: bool, sample: bool
) -> Step:
    tokens = (0,) * n if first else None
    hidden = None if first else to_tensor(mx.zeros((1, n, rt.width), rt.layers.dtype))
    return Step(key, 0, tokens, hidden, n, start, SamplingParams(), 0, sample)


def _warm_job(steps: list[Step], first: bool, last: bool) -> ComputeJob:
    return ComputeJob(0, tuple(steps), first, last, False)
