"""The cluster simulator: seeded scenarios over the unchanged role cores, with invariants."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mlxcel.sim.bringup import BRINGUP_FAULTS
from mlxcel.sim.disagg import DISAGG_FAULTS
from mlxcel.sim.scenarios import BUGS, FAULT_KINDS, run_many, run_scenario

ROOT = Path(__file__).resolve().parents[2]


def sim(*args: str, hashseed: str = "0") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", "sim", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )


def test_300_seeds_cover_every_fault_kind_and_keep_every_invariant() -> None:
    """The default run: every seed serves a pipeline (mixed), brings one up (bringup) and
    serves a disaggregated cluster (disagg)."""
    r = sim("--seeds", "300", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    print(f"\n{summary['events']} events in {summary['wall_s']}s ({summary['events_per_s']}/s)")
    assert summary["scenarios"] == 900 and summary["violations"] == 0
    assert summary["stages"] == [2, 16]
    bringup_kinds = {f"bringup-{k}" for k in BRINGUP_FAULTS}
    disagg_kinds = {f"disagg-{k}" for k in DISAGG_FAULTS}
    assert set(summary["faults"]) == set(FAULT_KINDS) | bringup_kinds | disagg_kinds
    # Faults do bite: some requests complete and some fail with an error, none hang.
    assert summary["completed"] > 0 and summary["failed"] > 0
    assert summary["bundles"] > 0  # micro-batches and forgeries travelled in Bundles
    # Some bring-ups activate every stage, some fail having started none (the check of each
    # run holds them to exactly that), and crashed coordinators account for the rest.
    runs, activated, failed = summary["bringups"]
    assert runs == 300 and activated > 0 and failed > 0 and activated + failed <= runs
    runs, requests, completed, failed = summary["disagg"]
    assert runs == 300 and completed > 0 and failed > 0 and completed + failed <= requests


def test_disaggregated_clusters_keep_the_handoff_invariants() -> None:
    from mlxcel.sim.disagg import run_disagg

    shapes = set()
    caches: Counter[str] = Counter()
    for seed in range(60):
        run, bad, _n = run_disagg(seed)
        assert bad == [], (seed, run.faults, bad[:5])
        shapes.add((len(run.prefill), len(run.decode)))
        # Every handoff read was committed first; leases that expired were never read.
        assert all(r[:2] in run.ledger.commits for r in run.ledger.reads)
        caches["reused"] += len(run.ledger.reused)
        caches.update(run.router.router.counts)
    assert max(p for p, _ in shapes) == 8 and max(d for _, d in shapes) == 8
    assert min(p for p, _ in shapes) == 1 and min(d for _, d in shapes) == 1
    # The prompt caches were at work: turns routed to the prefill node holding their
    # prompt, continued on the decode node holding their conversation, and sent the usual
    # way when that node had evicted it -- exact tokens all the same (checked above).
    assert caches["reused"] > 20 and caches["cache_routed"] > 5
    assert caches["continued"] > 10 and caches["continue_missed"] > 0


def test_a_prefill_node_that_ignores_the_tenant_is_caught() -> None:
    results = [
        run_scenario("disagg", s, inject=frozenset({"prefill-drops-namespace"})) for s in range(12)
    ]
    failing = [r for r in results if r.violations]
    assert failing, "prefill-drops-namespace went unnoticed in 12 seeds"
    assert any("started from a cached prefix tenant" in v for v in failing[0].violations)
    first = failing[0]
    r = sim(*first.replay.split()[4:], "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["violations"] == len(first.violations)
    assert run_scenario("disagg", first.seed).violations == []


def test_reading_a_handoff_before_its_commit_is_caught() -> None:
    results = [run_scenario("disagg", s, inject=frozenset({"read-uncommitted"})) for s in range(10)]
    failing = [r for r in results if r.violations]
    assert len(failing) == 10
    assert any("before it was committed" in v for v in failing[0].violations)
    first = failing[0]
    r = sim(*first.replay.split()[4:], "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["violations"] == len(first.violations)
    assert run_scenario("disagg", first.seed).violations == []


def test_a_bring_up_bug_is_found_and_replayed() -> None:
    """A coordinator that moves on when one peer answered instead of every peer must be
    caught: some stages activated while the others were never committed."""
    results = [run_scenario("bringup", s, inject=frozenset({"activate-early"})) for s in range(40)]
    failing = [r for r in results if r.violations]
    assert failing, "activate-early went unnoticed in 40 bring-ups"
    first = failing[0]
    assert first.replay.endswith(f"--scenario bringup --seed {first.seed} --inject activate-early")
    r = sim(*first.replay.split()[4:], "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["violations"] == len(first.violations)
    assert run_scenario("bringup", first.seed).violations == []


def test_one_seed_gives_one_trace_whatever_the_hash_seed() -> None:
    a = json.loads(sim("--seed", "7", "--json", hashseed="1").stdout)
    b = json.loads(sim("--seed", "7", "--json", hashseed="2").stdout)
    c = json.loads(sim("--seed", "8", "--json", hashseed="1").stdout)
    assert a["trace_hash"] == b["trace_hash"] and a["events"] == b["events"]
    assert c["trace_hash"] != a["trace_hash"]


@pytest.mark.parametrize("bug", BUGS)
def test_a_deliberate_bug_is_found_and_its_replay_reproduces_it(bug: str) -> None:
    results = run_many(range(40), inject=frozenset({bug}))
    failing = [r for r in results if r.violations]
    assert failing, f"{bug} went unnoticed in 40 seeds"
    first = failing[0]
    assert first.replay.endswith(f"--seed {first.seed} --inject {bug}")
    # The printed command replays exactly that scenario.
    argv = first.replay.split()[4:]  # after "python -m mlxcel sim"
    r = sim(*argv, "--json")
    assert r.returncode == 1
    replay = json.loads(r.stdout)
    assert replay["violations"] == len(first.violations)
    assert replay["failures"][0]["violations"] == first.violations[:10]
    # Without the bug, the same scenario passes.
    clean = run_scenario(first.name, first.seed)
    assert clean.violations == [] and clean.trace_hash != first.trace_hash


def test_a_32_stage_pipeline() -> None:
    results = run_many(range(3), name="scale")
    assert all(r.stages == 32 and r.violations == [] for r in results)
    assert sum(r.completed for r in results) > 0
    events, wall = sum(r.events for r in results), sum(r.wall_s for r in results)
    print(f"\n32 stages: {events} events in {wall:.2f}s ({events / wall:.0f}/s)")


def test_the_cli_names_a_bad_flag() -> None:
    r = sim("--inject", "no-such-bug")
    assert r.returncode == 2 and "no-such-bug" in r.stderr


def test_the_real_tiny_checkpoint_computes_a_small_cluster(tiny: Path) -> None:
    """The same scenarios with mlx-lm layers as the stages' compute: completed requests carry
    exactly the tokens of the whole model run as one range; one seed, one trace."""
    results = run_many(range(5), name="tiny", model_path=tiny)
    assert all(r.violations == [] for r in results), [r.violations for r in results]
    assert sum(r.completed for r in results) > 0
    again = run_scenario("tiny", 3, model_path=tiny)
    assert again.trace_hash == results[3].trace_hash
    # An insider seed with the owner check skipped is caught with real compute too.
    bad = run_scenario("tiny", 9, model_path=tiny, inject=frozenset({"skip-owner-check"}))
    assert "insider" in bad.faults and bad.violations


def test_the_serving_engine_runs_under_the_simulator(tiny: Path) -> None:
    """The one-process engine and frontend on the real checkpoint: clients that read to the
    end, hang up or run out of time, bursts past admission, a slow device -- every request
    ends, finished ones hold mlx-lm's greedy tokens, nothing is left held; replayable."""
    results = run_many(range(8), name="engine", model_path=tiny)
    assert [r.violations for r in results] == [[]] * 8
    kinds = {k for r in results for k in r.faults}
    assert {"engine-plain", "engine-hang-up", "engine-deadline", "engine-slow-compute"} <= kinds
    assert sum(r.completed for r in results) > 20
    # Deterministic on any machine (a run of decode steps never ends on the wall clock).
    assert len({r.trace_hash for r in results}) == 8
    again = run_scenario("engine", 5, model_path=tiny)
    assert (again.trace_hash, again.events) == (results[5].trace_hash, results[5].events)


def test_an_engine_that_streams_a_wrong_token_is_caught(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted engine bug -- every unfinished result repeats its last token -- breaks the
    parity invariant at once."""
    import dataclasses

    from mlxcel.runtime.engine_core import EngineCore

    real = EngineCore._result

    def doubled(self, seq, items):  # type: ignore[no-untyped-def]
        msg = real(self, seq, items)
        if msg.finish_reason is None and msg.token_ids:
            return dataclasses.replace(msg, token_ids=msg.token_ids + msg.token_ids[-1:])
        return msg

    monkeypatch.setattr(EngineCore, "_result", doubled)
    results = run_many(range(3), name="engine", model_path=tiny)
    found = [v for r in results for v in r.violations]
    assert found and all("mlx-lm gives" in v or "not a prefix" in v for v in found), found


def test_an_engine_that_forgets_a_finished_sequence_is_caught(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted leak -- a finished sequence stays in the engine's books (its KV figures and
    its slot with it) -- is found by the end-of-run check."""
    from mlxcel.runtime.engine_core import EngineCore

    real = EngineCore._result

    def forgetful(self, seq, items):  # type: ignore[no-untyped-def]
        msg = real(self, seq, items)
        if msg.finish_reason is not None:
            self.seqs[seq.entry.request_id] = seq  # the pop undone
        return msg

    monkeypatch.setattr(EngineCore, "_result", forgetful)
    results = run_many(range(2), name="engine", model_path=tiny)
    found = [v for r in results for v in r.violations]
    assert any("the engine still holds" in v for v in found), found


@pytest.mark.parametrize("keep_alive", [True, False])
def test_steps_queued_behind_a_slow_stage_outlive_the_step_deadline(keep_alive: bool) -> None:
    """A stage whose every job is slow (as on a fresh GPU, compiling kernels) but within its
    forward timeout holds a queue that takes longer than the coordinator's step deadline. Its
    Progress messages keep those exchanges alive, so every request completes; without them
    (the control) the same run fails requests that no fault touched."""
    import math
    import random

    from mlxcel.sim.scenarios import REQUEST_TIMEOUT, STEP_TIMEOUT, build, check

    rng = random.Random(11)
    cluster = build(rng, 11, 2, False)
    for host in cluster.stages:
        host.slow = 60.0  # a decode job ~0.25 s, a prompt chunk up to ~0.7 s (< 1 s timeout)
        if not keep_alive:  # its service is built on the loop's first turn, from this config
            host.config.progress_interval = math.inf
    coord = cluster.coordinator
    for i in range(12):
        prompt = tuple(rng.randrange(cluster.model.vocab) for _ in range(24))
        cluster.sched.at(0.0, coord.submit, f"req-{i}", prompt, 4, REQUEST_TIMEOUT)
    cluster.sched.run(REQUEST_TIMEOUT + 120.0)
    verdict = check(cluster)
    cluster.sched.close()  # every simulated process ends with its loop
    outcomes = list(coord.outcomes.values())
    ended = max(o.ended_at or 0.0 for o in outcomes)
    assert ended > 2 * STEP_TIMEOUT  # the queue really outlasted the step deadline
    failed = [o.finish for o in outcomes if o.finish and o.finish.startswith("error")]
    if keep_alive:
        assert verdict == [] and not failed
    else:
        assert "error:deadline_exceeded" in failed
        assert any("though no fault touched it" in v for v in verdict)
