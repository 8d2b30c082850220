"""Scenarios: a cluster shape, a workload and a fault schedule, all drawn from one seed.

:func:`run_scenario` builds the cluster (a coordinator core and N stage cores on the
simulated network, with the fake model), runs the workload with its faults on virtual time,
and checks the invariants afterwards. The same (name, seed, stages, inject) gives the same
event trace, byte for byte; :attr:`Result.replay` is the command that reruns it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from mlxcel.base.messages import (
    Activation,
    Bundle,
    CancelRequest,
    Error,
    Message,
    PrepareSequence,
    ReleaseSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    StepActivation,
    StepEntry,
    StepResult,
    Tensor,
)
from mlxcel.pipeline.coordinator import PipelineCoordinator
from mlxcel.pipeline.stage_protocol import StageConfig, keep_alive_interval
from mlxcel.reactor.bus import Node
from mlxcel.reactor.faults import Fault, FaultPlan, window
from mlxcel.sim.bugs import planted
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.hosts import TENANTS, CoordinatorHost, Intruder, StageHost
from mlxcel.sim.model import FakeModel
from mlxcel.sim.network import Link, SimNetwork
from mlxcel.sim.process import RUNNER_BUGS, logged_errors
from mlxcel.sim.real_model import real_model

FAULT_KINDS = ("drop", "delay", "duplicate", "reorder", "partition", "crash", "slow", "skew")
FAULT_KINDS += ("outsider", "insider")
SCENARIOS = ("mixed", "scale", "tiny", "bringup", "disagg", "engine")
# The pipeline scenarios' own bugs (mlxcel.sim.bugs plants them; test_sim runs each).
BUGS = ("skip-owner-check", "accept-stale-nonce", "shared-prefix-index", *RUNNER_BUGS)
COORDINATOR = "10.0.0.1:7000"
INTRUDER = "10.0.0.66:7000"  # on the coordinator's port: passes a wildcard coordinator check
REQUEST_TIMEOUT = 600.0  # the client's own deadline; the pipeline must end requests well before
STEP_TIMEOUT = 2.0  # the coordinator's per-exchange deadline
FORWARD_TIMEOUT = 1.0  # a stage's per-step compute deadline
DELAY_MAX = 3.0  # the longest extra delay the delay fault adds


@dataclass
class Result:
    name: str
    seed: int
    stages: int
    faults: list[str]
    requests: int
    completed: int
    failed: int
    events: int
    trace_hash: str
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    inject: tuple[str, ...] = ()
    forced_stages: int | None = None
    model: str | None = None  # the checkpoint of a real-model scenario
    bundles: int = 0  # Bundles the nodes sent each other

    @property
    def replay(self) -> str:
        cmd = f"python -m mlxcel sim --scenario {self.name} --seed {self.seed}"
        if self.forced_stages is not None:
            cmd += f" --stages {self.forced_stages}"
        if self.inject:
            cmd += f" --inject {','.join(self.inject)}"
        if self.model is not None:
            cmd += f" --model {self.model}"
        return cmd


@dataclass
class Cluster:
    sched: Scheduler
    net: SimNetwork
    model: Any  # FakeModel or RealModel
    coordinator: CoordinatorHost
    stages: list[StageHost]
    intruder: Intruder | None = None
    # When each fault is on (loss, delay, partition, crash, slow node...); and request ids an
    # intruder targeted. A request that overlaps no harmful window and was not targeted must
    # complete. Duplicates, reordering, clock skew and outsiders must never fail anything.
    plan: FaultPlan = field(default_factory=FaultPlan)
    targeted: set[str] = field(default_factory=set)


def build(
    rng: random.Random,
    seed: int,
    n_stages: int,
    wildcard: bool,
    model: Any = None,
) -> Cluster:
    """A coordinator and ``n_stages`` stages on a simulated network. ``model``: the compute
    (a :class:`RealModel`); by default a seeded :class:`FakeModel`."""
    sched = Scheduler()
    net = SimNetwork(sched, rng, Link(latency=rng.choice([0.0002, 0.001, 0.01])))
    fake = FakeModel(
        n_layers=n_stages * rng.randint(1, 3),
        vocab=rng.choice([64, 512, 4096]),
        width=rng.choice([4, 64, 256]),
        seed=seed,
    )
    model = model or fake
    names = [f"10.0.1.{i + 1}:7100" for i in range(n_stages)]
    # A coordinator configured with an unspecified IP accepts any identity on its port.
    coordinator_id = "0.0.0.0:7000" if wildcard else COORDINATOR
    max_batch = rng.randint(1, 8)
    # The prompt cache (fake model only): the coordinator's index and each stage's store,
    # sometimes smaller than the index plans for (entries refused, then prefilled in full).
    # (Drawn from a stream of their own: a seed's other choices stay what they were.)
    own = random.Random(f"prompt-cache:{seed}")
    cached = model is fake and own.random() < 0.7
    index_tokens = own.choice([40, 120, 600]) if cached else 0
    store_tokens = own.choice([index_tokens // 2, index_tokens, 4 * index_tokens])
    stages = []
    per = model.n_layers // n_stages
    for i, name in enumerate(names):
        cfg = StageConfig(
            name,
            i,
            n_stages,
            coordinator_id,
            upstream=names[i - 1] if i else None,
            downstream=names[i + 1] if i + 1 < n_stages else None,
            max_batch=max_batch,
            lease=30.0,
            forward_timeout=FORWARD_TIMEOUT,
            progress_interval=keep_alive_interval(STEP_TIMEOUT, n_stages),
        )
        host = StageHost(
            name, sched, net, cfg, model, (i * per, (i + 1) * per), prefix_capacity=store_tokens
        )
        stages.append(host)
        net.add(host)
    max_in_flight = rng.randint(1, 8)
    chunk = getattr(model, "prefill_step_size", None) or rng.choice([4, 8, 32])

    def make_coordinator(node: Node, endpoint: Any, incarnation: int) -> PipelineCoordinator:
        # A restarted process starts its nonces somewhere else (drawn from the seed).
        return PipelineCoordinator(
            node,
            endpoint,
            names,
            eos={model.eos},
            vocab=model.vocab,
            max_len=4096,
            step_timeout=STEP_TIMEOUT,
            max_sequences=max_in_flight,
            prefill_step_size=chunk,
            first_nonce=1 if incarnation == 1 else rng.randrange(1 << 48),
            prompt_cache_tokens=index_tokens,
            first_entry=1 if incarnation == 1 else own.randrange(1 << 48),
        )

    cluster = Cluster(sched, net, model, None, stages)  # type: ignore[arg-type]

    def entry_owner(rid: str) -> str | None:
        entry = stages[0].stage
        seq = entry.seqs.get(rid) if entry is not None else None
        return seq.owner if seq is not None else None

    stages[-1].entry_owner = entry_owner
    coord = CoordinatorHost(COORDINATOR, sched, net, make_coordinator)
    net.add(coord)
    cluster.coordinator = coord
    return cluster


def schedule_faults(
    cluster: Cluster,
    rng: random.Random,
    kinds: list[str],
    horizon: float,
    arrivals: list[tuple[str, float]] = (),  # type: ignore[assignment]
) -> None:
    sched, net, stages, plan = cluster.sched, cluster.net, cluster.stages, cluster.plan
    f = net.faults
    # How long a fault's effects outlast it: a step deadline to notice, a message delayed
    # past the window's end, a stuck step's forward timeout, and a deadline for the retry.
    tail = 2 * STEP_TIMEOUT + DELAY_MAX + FORWARD_TIMEOUT

    def toggle(attr: str, value: float, hurts: bool = True) -> None:
        on, off = partial(setattr, f, attr, value), partial(setattr, f, attr, 0.0)
        plan.add(Fault(attr, on, off, hurts, tail), *window(rng, horizon))

    for kind in kinds:
        if kind == "drop":
            toggle("drop", rng.uniform(0.01, 0.1))
        elif kind == "delay":
            f.delay_max = max(f.delay_max, rng.uniform(0.1, DELAY_MAX))
            toggle("delay", rng.uniform(0.05, 0.3))
        elif kind == "duplicate":
            f.delay_max = max(f.delay_max, rng.uniform(0.05, 1.0))
            toggle("duplicate", rng.uniform(0.1, 0.4), hurts=False)
        elif kind == "reorder":
            toggle("reorder", rng.uniform(0.2, 0.6), hurts=False)
        elif kind == "partition":
            victim = rng.choice([*stages, cluster.coordinator]).identity
            cut = partial(net.cut, frozenset({victim}), frozenset(net.hosts) - {victim})
            plan.add(Fault(f"partition {victim}", cut, net.heal, tail=tail), *window(rng, horizon))
        elif kind == "crash":
            host = rng.choice([*stages, cluster.coordinator])
            crash = Fault(f"crash {host.identity}", host.crash, host.restart, tail=tail)
            plan.add(crash, *window(rng, horizon))
        elif kind == "slow":
            stage = rng.choice(stages)
            t0, t1 = window(rng, horizon)
            on = partial(setattr, stage, "slow", rng.choice([20.0, 100.0, 400.0]))
            off = partial(setattr, stage, "slow", 1.0)
            plan.add(Fault(f"slow {stage.identity}", on, off, tail=tail), t0, t1)
        elif kind == "skew":
            for host in [*stages, cluster.coordinator]:
                host.skew = rng.uniform(-30.0, 30.0)  # clocks disagree...
                host.rate = 1.0 + rng.uniform(-0.01, 0.01)  # ...and drift apart
        elif kind in ("outsider", "insider"):
            _intrude(cluster, rng, horizon, kind == "insider", arrivals)
    plan.install(sched.at)


def _intrude(
    cluster: Cluster,
    rng: random.Random,
    horizon: float,
    has_secret: bool,
    arrivals: list[tuple[str, float]],
) -> None:
    """A host that sends commands, activations and forged results for live request ids --
    and, knowing that request ids are predictable, races their owner for some of them."""
    sched, net = cluster.sched, cluster.net
    if cluster.intruder is None:
        cluster.intruder = Intruder(INTRUDER, sched, net, has_secret)
        net.add(cluster.intruder)
    evil = cluster.intruder
    stages = [s.identity for s in cluster.stages]
    outcomes = cluster.coordinator.outcomes
    width = cluster.model.width

    def forge(rid: str, to_coordinator: bool) -> Message:
        nonce = rng.randint(1, 64)
        if to_coordinator:  # a forged result or error, with a guessed nonce
            return rng.choice(
                [
                    RunResult(rid, 0, (rng.randint(0, 63),), None, nonce),
                    StepResult(0, (rid,), (nonce,), (rng.randint(0, 63),), (0.0,)),
                    Error("forged", "evil", rid, nonce),
                ]
            )
        sp, pos = SamplingParams(max_tokens=4), rng.randint(0, 8)
        hidden = Tensor("float32", (1, 1, width), bytes(4 * width))
        commands = [PrepareSequence(rid, 64, nonce), ReleaseSequence(rid), CancelRequest(rid, "")]
        steps = [
            RunEntry(rid, 0, (1, 2), pos, sp, nonce),
            StepEntry(0, (rid,), (1,), (pos,), (nonce,)),
        ]
        acts = [Activation(rid, 0, hidden, pos, sp, nonce),
                StepActivation(0, (rid,), (pos,), (nonce,), hidden, 0, COORDINATOR)]  # fmt: skip
        return rng.choice([*commands, *steps, *acts])

    def strike() -> None:
        live = [rid for rid, o in outcomes.items() if o.finish is None] or ["nobody"]
        to_coordinator = rng.random() < 0.3
        dest = COORDINATOR if to_coordinator else rng.choice(stages)
        msgs = [forge(rng.choice(live), to_coordinator) for _ in range(rng.choice((1, 1, 3)))]
        for m in msgs:
            ids = getattr(m, "request_ids", None) or (m.request_id,)  # type: ignore[attr-defined]
            cluster.targeted.update(ids)
        evil.inject(dest, msgs[0] if len(msgs) == 1 else Bundle(tuple(msgs)))

    for _ in range(rng.randint(5, 30)):
        sched.at(rng.uniform(0.0, horizon), strike)
    # The race: claim a request id on the entry stage just before its owner does, then, once
    # the owner has prepared the later stages, run a step under it -- the entry stage runs it
    # for the intruder, and the stages after it must not run it on the owner's sequence.
    latency = net.link.latency
    for rid, at in rng.sample(arrivals, min(len(arrivals), 3)):
        cluster.targeted.add(rid)
        sched.at(at - latency / 2, evil.inject, stages[0], PrepareSequence(rid, 64, 1))
        step = RunEntry(rid, 0, (1,), 0, SamplingParams(max_tokens=4), 2)
        sched.at(at + rng.uniform(0.5, 2.0) * latency, evil.inject, stages[0], step)


def run_scenario(
    name: str,
    seed: int,
    *,
    stages: int | None = None,
    inject: frozenset[str] = frozenset(),
    model_path: Path | None = None,
) -> Result:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
    with planted(inject):
        return _run_scenario(name, seed, stages, inject, model_path)


def _run_scenario(
    name: str, seed: int, stages: int | None, inject: frozenset[str], model_path: Path | None
) -> Result:
    wall0 = time.perf_counter()
    if name == "bringup":
        return _bringup_result(seed, stages, inject, wall0)
    if name == "disagg":
        return _disagg_result(seed, stages, inject, wall0)
    if name == "engine":
        return _engine_result(seed, model_path, wall0)
    rng = random.Random(f"{name}:{seed}")
    model = None
    if name == "scale":
        n_stages = stages or 32
        kinds = [FAULT_KINDS[seed % len(FAULT_KINDS)]]
    elif name == "tiny":  # the real checkpoint: 2-4 stages, a light workload
        if model_path is None:
            raise ValueError("the tiny scenario needs a checkpoint (--model)")
        model = real_model(model_path)
        if stages is not None and stages > model.n_layers:
            raise ValueError(
                f"the checkpoint has {model.n_layers} layers: at most that many stages"
            )
        n_stages = stages or rng.randint(2, min(4, model.n_layers))
        kinds = [FAULT_KINDS[seed % len(FAULT_KINDS)]]
    else:
        n_stages = stages or rng.randint(2, 8)
        kinds = [FAULT_KINDS[seed % len(FAULT_KINDS)]]
        kinds += [k for k in FAULT_KINDS if k not in kinds and rng.random() < 0.12]
    cluster = build(rng, seed, n_stages, "insider" in kinds, model)
    low, high = {"scale": (8, 24), "tiny": (2, 5)}.get(name, (3, 12))
    n_requests = rng.randint(low, high)
    horizon = 3.0
    coord = cluster.coordinator
    arrivals = []
    earlier: list[tuple[tuple[int, ...], int, float]] = []  # (prompt, max_tokens, at)
    for i in range(n_requests):
        prompt = tuple(rng.randrange(cluster.model.vocab) for _ in range(rng.randint(1, 40)))
        max_tokens = rng.randint(1, 8 if name == "tiny" else 24)
        at = rng.uniform(0.0, horizon)
        # Tenants, and conversations: a later turn resends an earlier request's prompt and
        # reply (from any tenant: the same tokens in another namespace must reuse nothing).
        ns = rng.choice(TENANTS)
        if earlier and rng.random() < 0.5:
            before, before_max, before_at = rng.choice(earlier)
            reply = tuple(cluster.model.reference(n_stages, before, before_max))
            prompt = before + reply + prompt[: rng.randint(1, 8)]
            at = before_at + rng.uniform(0.2, 1.5)
        earlier.append((prompt, max_tokens, at))
        rid = f"req-{i}"
        arrivals.append((rid, at))
        cluster.sched.at(at, coord.submit, rid, prompt, max_tokens, REQUEST_TIMEOUT, ns)
        if rng.random() < 0.1:
            cluster.sched.at(at + rng.uniform(0.0, 1.0), coord.cancel, rid)
    schedule_faults(cluster, rng, kinds, horizon, arrivals)
    with logged_errors() as logged:
        # Long enough for every deadline and lease to pass after the last request ends.
        cluster.sched.run(horizon + REQUEST_TIMEOUT + 120.0)
        violations = check(cluster) + logged
        cluster.sched.close()
    outcomes = coord.outcomes.values()
    return Result(
        name,
        seed,
        n_stages,
        kinds,
        n_requests,
        sum(o.finish in ("stop", "length") for o in outcomes),
        sum(bool(o.finish and o.finish.startswith("error")) for o in outcomes),
        cluster.sched.events,
        cluster.sched.trace_hash,
        violations,
        time.perf_counter() - wall0,
        tuple(sorted(inject)),
        stages,
        str(model_path) if model_path is not None else None,
        cluster.net.bundles,
    )


def _bringup_result(seed: int, peers: int | None, inject: frozenset[str], wall0: float) -> Result:
    """One bring-up (:mod:`mlxcel.sim.bringup`) as a scenario result: one "request", completed
    when every stage activated, failed when the bring-up failed cleanly."""
    from mlxcel.sim.bringup import run_bringup

    if peers is not None and peers > 64:
        raise ValueError("a bring-up scenario takes at most 64 peers")
    run, violations = run_bringup(seed, peers)
    done = run.coordinator.done
    return Result(
        "bringup",
        seed,
        len(run.peers),
        [f"bringup-{k}" for k in run.faults],
        1,
        int(done is not None and done.ok),
        int(done is not None and not done.ok),
        run.sched.events,
        run.sched.trace_hash,
        violations,
        time.perf_counter() - wall0,
        tuple(sorted(inject)),
        peers,
    )


def _disagg_result(seed: int, nodes: int | None, inject: frozenset[str], wall0: float) -> Result:
    """One disaggregated run (:mod:`mlxcel.sim.disagg`); ``stages`` counts its prefill and
    decode nodes, ``--stages`` caps each pool."""
    from mlxcel.sim.disagg import run_disagg

    if nodes is not None and nodes > 64:
        raise ValueError("a disagg scenario takes at most 64 nodes per pool")
    run, violations, n = run_disagg(seed, inject, nodes)
    outcomes = run.router.outcomes.values()
    return Result(
        "disagg",
        seed,
        len(run.prefill) + len(run.decode),
        [f"disagg-{k}" for k in run.faults],
        n,
        sum(o.finish in ("stop", "length") for o in outcomes),
        sum(bool(o.finish and o.finish.startswith("error")) for o in outcomes),
        run.sched.events,
        run.sched.trace_hash,
        violations,
        time.perf_counter() - wall0,
        tuple(sorted(inject)),
        nodes,
    )


def _engine_result(seed: int, model_path: Path | None, wall0: float) -> Result:
    """The one-process engine and frontend (:mod:`mlxcel.sim.engine`) on the real checkpoint."""
    from mlxcel.sim.engine import run_engine

    if model_path is None:
        raise ValueError("the engine scenario needs a checkpoint (--model)")
    run, violations = run_engine(seed, model_path)
    ends = [c.finish or "" for c in run.clients]
    kinds = ["engine-" + k for k in sorted({c.kind for c in run.clients})]
    kinds += ["engine-" + p.fault.name.replace(" ", "-") for p in run.plan.planned]
    done = sum(e in ("stop", "length") for e in ends)
    failed = sum(e in ("refused", "deadline") or e.startswith("error") for e in ends)
    s = run.sched
    return Result("engine", seed, 1, kinds, len(ends), done, failed, s.events, s.trace_hash,
                  violations, time.perf_counter() - wall0, (), None, str(model_path))  # fmt: skip


def check(cluster: Cluster) -> list[str]:
    """Every invariant, after the run. An empty list means the scenario passed."""
    bad: list[str] = []
    n = len(cluster.stages)
    for o in cluster.coordinator.outcomes.values():
        want = cluster.model.reference(n, o.prompt, o.max_tokens)
        bad.extend(o.problems(want, o.request_id in cluster.targeted, cluster.plan))
    for host in [*cluster.stages, cluster.coordinator]:
        bad.extend(host.errors + host.conservation())
    outcomes = cluster.coordinator.outcomes
    for host in cluster.stages:
        bad.extend(host.violations)
        for rid, creator in getattr(host.backend, "loads", ()):
            mine, theirs = outcomes[rid].namespace, outcomes[creator].namespace
            if mine != theirs:
                bad.append(
                    f"{host.identity}: {rid} (tenant {mine!r}) started from the cache "
                    f"{creator} (tenant {theirs!r}) left"
                )
        held = sum(len(h) for h, _ in getattr(host.backend, "entries", {}).values())
        if held > getattr(host.backend, "capacity", 0) and held:
            bad.append(f"{host.identity} holds {held} cached positions, past its budget")
        stage = host.stage
        if stage is not None:
            if stage.seqs:
                bad.append(f"{host.identity} still holds {sorted(stage.seqs)}")
            if host.backend.caches:
                bad.append(f"{host.identity} still holds {len(host.backend.caches)} caches")
    core = cluster.coordinator.coord
    if core is not None and (core.reqs or core.held):
        bad.append(f"coordinator still holds {sorted(core.reqs)} ({core.held} slots)")
    if core is not None and core.peak_in_flight > core.max_in_flight:
        bad.append(f"coordinator ran {core.peak_in_flight} > {core.max_in_flight} in flight")
    return bad


def run_many(
    seeds: range,
    *,
    name: str = "mixed",
    stages: int | None = None,
    inject: frozenset[str] = frozenset(),
    model_path: Path | None = None,
    progress: Callable[[Result], None] | None = None,
) -> list[Result]:
    results = []
    for seed in seeds:
        r = run_scenario(name, seed, stages=stages, inject=inject, model_path=model_path)
        results.append(r)
        if progress is not None:
            progress(r)
    return results
