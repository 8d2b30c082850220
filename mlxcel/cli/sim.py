"""``python -m mlxcel sim``: run seeded scenarios and print one summary (or replay one)."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter

from mlxcel.base.errors import ConfigError
from mlxcel.config.tools import SimSettings
from mlxcel.process.logs import setup_logging
from mlxcel.sim.scenarios import Result, run_scenario


def summarize(results: list[Result], wall_s: float) -> dict[str, object]:
    combined = hashlib.blake2b(digest_size=16)
    for r in results:
        combined.update(f"{r.name}:{r.seed}:{r.trace_hash}\n".encode())
    events = sum(r.events for r in results)
    faults = Counter(k for r in results for k in r.faults)
    failures = [
        {"seed": r.seed, "replay": r.replay, "violations": r.violations[:10]}
        for r in results
        if r.violations
    ]
    serving = [r for r in results if r.name not in ("bringup", "disagg")]
    ups = [r for r in results if r.name == "bringup"]
    di = [r for r in results if r.name == "disagg"]
    return {
        "scenarios": len(results),
        "stages": [min(r.stages for r in results), max(r.stages for r in results)],
        "requests": sum(r.requests for r in serving),
        "completed": sum(r.completed for r in serving),
        "failed": sum(r.failed for r in serving),
        "bundles": sum(r.bundles for r in serving),
        # bring-ups: how many ran, activated every stage, failed having started none
        "bringups": [len(ups), sum(r.completed for r in ups), sum(r.failed for r in ups)],
        # disaggregated runs: how many, their requests, completed, failed with an error
        "disagg": [
            len(di),
            sum(r.requests for r in di),
            sum(r.completed for r in di),
            sum(r.failed for r in di),
        ],
        "violations": sum(len(r.violations) for r in results),
        "events": events,
        "wall_s": round(wall_s, 3),
        "events_per_s": round(events / wall_s) if wall_s > 0 else 0,
        "trace_hash": combined.hexdigest(),
        "faults": dict(sorted(faults.items())),
        "failures": failures,
    }


def run_sim(settings: SimSettings) -> int:
    # The production services log as they would on a node (a dropped forgery, a failed
    # request) thousands of times a run; only what is logged as an error is reported (each
    # is also a violation of the scenario that logged it).
    setup_logging("ERROR")
    inject = frozenset(b.strip() for b in (settings.inject or "").split(",") if b.strip())
    seeds = (
        [settings.seed]
        if settings.seed is not None
        else range(settings.first_seed, settings.first_seed + settings.seeds)
    )
    model_path = None
    if settings.scenario in ("tiny", "engine"):
        from mlxcel.cli.commands import resolve_model

        model_path = resolve_model(settings.model)
    t0 = time.perf_counter()
    names = ["mixed", "bringup", "disagg"] if settings.scenario == "all" else [settings.scenario]
    try:
        results = [
            run_scenario(name, s, stages=settings.stages, inject=inject, model_path=model_path)
            for s in seeds
            for name in names
        ]
    except ValueError as exc:  # a shape the scenario cannot build
        raise ConfigError("--stages", str(exc)) from None
    summary = summarize(results, time.perf_counter() - t0)
    if settings.json_lines:
        print(json.dumps(summary), flush=True)
    else:
        lo, hi = summary["stages"]  # type: ignore[misc]
        line = f"sim {settings.scenario}: {summary['scenarios']} scenarios"
        if summary["requests"]:
            line += (
                f", {lo}-{hi} stages, {summary['requests']} requests ({summary['completed']} "
                f"completed, {summary['failed']} failed with an error, the rest cancelled)"
            )
        print(line)
        runs, up, down = summary["bringups"]  # type: ignore[misc]
        if runs:
            print(f"bring-ups: {runs} ({up} activated every stage, {down} failed and started none)")
        runs, n, done, failed = summary["disagg"]  # type: ignore[misc]
        if runs:
            print(
                f"disaggregated: {runs} clusters, {n} requests ({done} completed, {failed} "
                "failed with an error, the rest cancelled by their clients)"
            )
        faults = ", ".join(f"{k} {v}" for k, v in summary["faults"].items())  # type: ignore[attr-defined]
        print(f"faults: {faults}")
        print(
            f"events: {summary['events']} in {summary['wall_s']}s "
            f"({summary['events_per_s']} simulated events/s)"
        )
        print(f"trace hash: {summary['trace_hash']}")
        print(f"violations: {summary['violations']}")
        for f, r in zip(summary["failures"], [r for r in results if r.violations], strict=True):  # type: ignore[call-overload]
            more = len(r.violations) - 3
            print(
                f"  seed {f['seed']}: "
                + "; ".join(r.violations[:3])
                + (f" (and {more} more)" if more > 0 else "")
            )
            print(f"    replay: {f['replay']}")
    return 1 if summary["violations"] else 0
