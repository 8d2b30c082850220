"""Steady load on a 2-stage loopback pipeline (or the one-process engine), for profiling.

    python -m tools.pipeline_load -m MODEL [--mode remote|single] [--streams 8] [--tokens 512]
                                  [--seconds 0] [--json]

``remote``: two stage processes on 127.0.0.2/127.0.0.3 (as ``bench pipeline``'s remote-2 row)
and the coordinator in this process; ``single``: the one-process engine. After a warm-up it
prints ``measuring <pids>`` on stderr -- the moment to attach a sampling profiler (py-spy
``--pid``) to each process -- then runs ``--streams`` concurrent greedy streams of
``--tokens`` tokens, again and again until ``--seconds`` have passed, and prints aggregate
tok/s; for ``remote`` also the protocol and stage-compute time per decode step (the figures
``bench pipeline`` reports) and each process's CPU time per decoded token, read from
``/proc`` (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mlxcel.base.errors import MlxcelError
from mlxcel.bench.pipeline import aggregate_rate, loopback_pipeline, per_step_ms, step_totals
from mlxcel.process.loop import run_async


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def steady(fe: Any, streams: int, tokens: int, seconds: float) -> float:
    """Aggregate tok/s over rounds of ``streams`` streams, at least one round."""
    t0, rates = time.perf_counter(), []
    while not rates or time.perf_counter() - t0 < seconds:
        rates.append(await aggregate_rate(fe, tokens, streams))
    return sum(rates) / len(rates)


async def run(model: Path, mode: str, streams: int, tokens: int, seconds: float) -> dict:
    row: dict[str, Any] = {"mode": mode, "streams": streams, "tokens": tokens}
    if mode == "single":
        from mlxcel.serving.assembly import Generation, LocalSpec, assemble

        gen = Generation(parallel=streams, max_batch_size=streams)
        async with assemble(LocalSpec(model), gen) as st:
            await aggregate_rate(st.frontend, 8, streams)
            print(f"measuring {os.getpid()}", file=sys.stderr, flush=True)
            row["tok_per_s"] = round(await steady(st.frontend, streams, tokens, seconds), 2)
        return row
    async with loopback_pipeline(model, streams) as (cl, rc):
        await aggregate_rate(rc.frontend, 8, streams)
        pids = [os.getpid()] + [proc.pid for _, proc, _ in cl.procs]
        print("measuring", *pids, file=sys.stderr, flush=True)
        cpu0, t0, before = (
            [cpu_seconds(p) for p in pids],
            time.perf_counter(),
            step_totals(rc.parts.coordinator),
        )
        rate = await steady(rc.frontend, streams, tokens, seconds)
        after, wall = step_totals(rc.parts.coordinator), time.perf_counter() - t0
        cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
    overhead, compute = per_step_ms(before, after)
    names = ["coordinator", "stage-0", "stage-1"]
    row.update(
        tok_per_s=round(rate, 2),
        decode_steps=after[0] - before[0],
        overhead_ms_per_step=round(overhead, 3),
        stage_compute_ms_per_step=round(compute, 3),
        cpu_fraction={n: round(c / wall, 3) for n, c in zip(names, cpu, strict=True)},
        cpu_ms_per_token={
            n: round(1e3 * c / (rate * wall), 3) for n, c in zip(names, cpu, strict=True)
        },
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.pipeline_load", description=__doc__.split("\n")[0]
    )
    p.add_argument("-m", "--model", type=Path, required=True, help="model folder")
    p.add_argument("--mode", choices=("remote", "single"), default="remote")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--seconds", type=float, default=0.0, help="keep the load up this long")
    p.add_argument("--json", action="store_true", help="one JSON object")
    a = p.parse_args(argv)
    if a.streams < 1 or a.tokens < 2 or a.seconds < 0:
        p.error("--streams must be >= 1, --tokens >= 2 and --seconds >= 0")
    if not (a.model / "config.json").is_file():
        p.error(f"-m {a.model}: not a model folder (no config.json)")
    try:
        # uvloop, as `python -m mlxcel` runs: the coordinator's loop is part of what is measured
        row = run_async(run(a.model, a.mode, a.streams, a.tokens, a.seconds))
    except MlxcelError as exc:
        print(f"pipeline_load: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(row) if a.json else "  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
