"""``python -m mlxcel bench tp``: greedy decode tok/s at tensor-parallel sizes 1 and 2, one run."""

from __future__ import annotations

import json
from pathlib import Path

from mlxcel.bench.pipeline import aggregate_rate, decode_rate


async def run_bench(
    model: Path, tokens: int, json_lines: bool, sizes: tuple[int, ...] = (1, 2), streams: int = 4
) -> int:
    from mlxcel.runtime.blas import blas_name
    from mlxcel.serving.assembly import (
        Generation,
        LocalSpec,
        StackSpec,
        TensorParallelSpec,
        assemble,
    )
    from mlxcel.tp.group import pick_backend

    rows = []
    for n in sizes:
        spec: StackSpec = LocalSpec(model) if n == 1 else TensorParallelSpec(model, n)
        async with assemble(spec, Generation(parallel=streams, max_batch_size=streams)) as st:
            await decode_rate(st.frontend, 8)  # warm-up
            rate = max([(await decode_rate(st.frontend, tokens))[0] for _ in range(2)])
            agg = await aggregate_rate(st.frontend, tokens, streams)
        rows.append(
            {
                "bench": "tp",
                "tp_size": n,
                "tok_per_s": round(rate, 2),
                f"tok_per_s_{streams}_streams": round(agg, 2),
                "tokens": tokens,
                "backend": pick_backend() if n > 1 else "none",
                "blas": blas_name(),
            }
        )
    base = rows[0]["tok_per_s"]
    for r in rows:
        r["ratio_vs_tp1"] = round(float(r["tok_per_s"]) / float(base), 3)
        if json_lines:
            print(json.dumps(r), flush=True)
    if not json_lines:
        print(
            f"model {model} | {tokens} greedy tokens; ranks are processes on mx.distributed "
            f"({pick_backend()})"
        )
        for r in rows:
            print(
                f"tp {r['tp_size']}: {r['tok_per_s']:>8} tok/s one stream (x{r['ratio_vs_tp1']}), "
                f"{r[f'tok_per_s_{streams}_streams']:>8} tok/s with {streams} streams"
            )
    return 0
