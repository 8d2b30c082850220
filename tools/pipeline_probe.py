"""Probe the in-process pipeline's knobs on one checkpoint: the GIL switch interval, a
compute thread per stage and the entry stage's step started ahead, at a few stream counts,
with each stage's build/eval split.

    python tools/pipeline_probe.py CHECKPOINT [STREAMS,...] [TOKENS] [CONFIG,...]

CONFIG is one of default, no-ahead, switch-0.5ms, stage-threads (all, by default).

A measurement aid for the people tuning the pipeline (GPU runs); ``bench pipeline`` is the
benchmark users run.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from mlxcel.bench.pipeline import aggregate_rate, decode_rate
from mlxcel.serving.assembly import Generation, PipelineSpec, assemble


async def one(
    model: Path, streams: list[int], tokens: int, interval: float, threads: bool, ahead: bool
) -> None:
    sys.setswitchinterval(interval)
    most = max(streams)
    spec = PipelineSpec(model, 2, stage_threads=threads)
    async with assemble(spec, Generation(parallel=most, max_batch_size=most)) as ps:
        stages = ps.parts.stages
        if not ahead:
            stages[-1].runtime.ahead_to = None
        for n in streams:
            await aggregate_rate(ps.frontend, 8, n)
            before = [
                (s.runtime.timing.build_s, s.runtime.timing.eval_s, s.runtime.timing.jobs)
                for s in stages
            ]
            t0 = time.perf_counter()
            if n == 1:
                rate = (await decode_rate(ps.frontend, tokens))[0]
            else:
                rate = await aggregate_rate(ps.frontend, tokens, n)
            wall = time.perf_counter() - t0
            parts = []
            for s, (b, e, j) in zip(stages, before, strict=True):
                t = s.runtime.timing
                jobs = max(1, t.jobs - j)
                parts.append(
                    f"build {1e3 * (t.build_s - b) / jobs:.2f} eval {1e3 * (t.eval_s - e) / jobs:.2f}"
                )
            print(
                f"interval {interval * 1e3:.1f}ms threads={threads} ahead={ahead} streams {n}: {rate:.1f} tok/s "
                f"({wall:.1f}s) | " + " | ".join(parts),
                flush=True,
            )


def main() -> None:
    model = Path(sys.argv[1])
    streams = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,32").split(",")]
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    configs = {
        "default": (0.005, False, True),
        "no-ahead": (0.005, False, False),
        "switch-0.5ms": (0.0005, False, True),
        "stage-threads": (0.005, True, False),
    }
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else list(configs)
    for name in names:
        asyncio.run(one(model, streams, tokens, *configs[name]))


if __name__ == "__main__":
    main()
