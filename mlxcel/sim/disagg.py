"""Disaggregated-serving scenarios: a router, 1-8 prefill and 1-8 decode nodes on the
simulated network, the production cores, a fake model, seeded faults.

The hosts and the fake model are in :mod:`mlxcel.sim.disagg_hosts`. Faults: loss, delay, duplication, reordering, a
partition, a prefill crash, a decode node crashing right after it took a handoff, a decode
node so slow to verify that the lease expires, skewed clocks, and a secret holder that is no
configured peer forging results. Prompt caches on most seeds: prefill nodes keep prompts,
decode nodes conversations, within budgets small enough to evict; requests come from three
tenants, and later turns resend an earlier request's prompt and reply plus new tokens (from
its tenant mostly, sometimes another's). :func:`check` adds to the pipeline invariants
(every request ends, completed ones are exact -- a turn answered from a wrong or half-gone
entry is not -- nothing leaks): **no handoff is read unless its prefill node committed it
while holding the lease**, **no request is computed again after a failure** (the only
second dispatch is the failover of a request that never reached its first prefill node),
and **no request starts from an entry another tenant left**.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from functools import partial

from mlxcel.base.handoff import digest_of, tensor_digest
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    Message,
    SamplingParams,
    TokenResult,
)
from mlxcel.disagg.decode_core import DecodeConfig
from mlxcel.disagg.prefill_core import PrefillConfig
from mlxcel.disagg.protocol import LEASE
from mlxcel.reactor.faults import Fault, FaultPlan, window
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.disagg_hosts import (
    CLIENT_TIMEOUT,
    ROUTER,
    VOCAB,
    DecodeHost,
    Ledger,
    PrefillHost,
    RouterHost,
    cache_tensor,
    reference,
)
from mlxcel.sim.hosts import TENANTS, Intruder
from mlxcel.sim.network import Link, SimNetwork
from mlxcel.sim.process import logged_errors

DISAGG_FAULTS = (
    "drop",
    "delay",
    "duplicate",
    "reorder",
    "partition",
    "crash-prefill",
    "crash-decode",
    "lease-expire",
    "skew",
    "insider",
)
DISAGG_BUGS = ("read-uncommitted", "prefill-drops-namespace")
FORGER = "10.0.3.99:8300"
# Faults that may legitimately fail the requests they overlap (plus how long they echo).
HARMFUL = frozenset({"drop", "partition", "crash-prefill", "crash-decode", "lease-expire"})
TAIL = 60.0


@dataclass
class DisaggRun:
    sched: Scheduler
    net: SimNetwork
    router: RouterHost
    prefill: list[PrefillHost]
    decode: list[DecodeHost]
    ledger: Ledger
    faults: list[str]
    plan: FaultPlan = field(default_factory=FaultPlan)  # when each fault is on
    forged: int = 0
    # Requests whose id an insider used on a prefill or decode intake: those intakes trust
    # any member (as documented), so these may fail -- but never stream a wrong token.
    targeted: set[str] = field(default_factory=set)


def build_disagg(
    rng: random.Random,
    n_prefill: int,
    n_decode: int,
    faults: list[str],
    inject: frozenset[str],
    caches: tuple[int, int] = (0, 0),
) -> DisaggRun:
    """``caches``: the positions each prefill and each decode node's prompt cache holds (0:
    none)."""
    sched = Scheduler()
    net = SimNetwork(sched, rng, Link(latency=rng.choice([0.0002, 0.001, 0.005])))
    pre = [f"10.0.3.{10 + i}:8305" for i in range(n_prefill)]
    dec = [f"10.0.3.{40 + i}:8304" for i in range(n_decode)]
    ledger = Ledger()
    router = RouterHost(sched, net, pre, dec, rng.getrandbits(40) + 1)
    net.add(router)
    # 1-4 "layers" of 16 bytes, sent one layer per message: handoffs arrive in parts.
    layers = rng.randint(1, 4)
    pcfg = PrefillConfig(tuple(dec[:1]), None, None, VOCAB, 1 << 20, LEASE, 64, part_bytes=16)
    dcfg = DecodeConfig(VOCAB, 1 << 20, 64, keeps=caches[1] > 0)
    run = DisaggRun(sched, net, router, [], [], ledger, faults)
    for a in pre:
        run.prefill.append(PrefillHost(a, sched, net, pcfg, ledger, rng, caches[0]))
        run.prefill[-1].layers = layers
        net.add(run.prefill[-1])
    for a in dec:
        run.decode.append(DecodeHost(a, sched, net, dcfg, ledger, inject, caches[1]))
        net.add(run.decode[-1])
    return run


def _faults(run: DisaggRun, rng: random.Random, horizon: float) -> None:
    sched, net, f, plan = run.sched, run.net, run.net.faults, run.plan
    for kind in run.faults:
        t0, t1 = window(rng, horizon)
        if kind in ("drop", "delay", "duplicate", "reorder"):
            value = {"drop": 0.05, "delay": 0.2, "duplicate": 0.3, "reorder": 0.5}[kind]
            f.delay_max = max(f.delay_max, rng.uniform(0.1, 2.0))
            on = partial(setattr, f, kind, rng.uniform(0.2, 1.0) * value)
            off = partial(setattr, f, kind, 0.0)
            plan.add(Fault(kind, on, off, kind in HARMFUL, TAIL), t0, t1)
        elif kind == "partition":
            victim = rng.choice([*run.prefill, *run.decode]).identity
            cut = partial(net.cut, frozenset({victim}), frozenset(net.hosts) - {victim})
            plan.add(Fault(f"partition {victim}", cut, net.heal, tail=TAIL), t0, t1)
        elif kind == "crash-prefill":
            victim_p = rng.choice(run.prefill)
            restart = t1 + rng.uniform(0.5, 10.0)
            crash = Fault(f"crash {victim_p.identity}", victim_p.crash, victim_p.restart, tail=TAIL)
            plan.add(crash, t0, restart)
        elif kind == "crash-decode":
            # It dies on reading a handoff (its 1st to 3rd), whenever that comes.
            victim_d = rng.choice(run.decode)
            arm = partial(setattr, victim_d, "crash_after_reads", rng.randint(1, 3))
            crash = Fault(f"crash {victim_d.identity} on a read", arm, victim_d.restart, tail=TAIL)
            plan.add(crash, 0.0, horizon + rng.uniform(1.0, 20.0))
        elif kind == "lease-expire":
            victim_d = rng.choice(run.decode)
            slow = partial(setattr, victim_d, "verify_s", LEASE + rng.uniform(1.0, 10.0))
            fast = partial(setattr, victim_d, "verify_s", 0.001)
            name = f"slow verify on {victim_d.identity}"
            plan.add(Fault(name, slow, fast, tail=2 * LEASE + TAIL), t0, t1)
        elif kind == "skew":
            for h in [run.router, *run.prefill, *run.decode]:
                h.skew = rng.uniform(-30.0, 30.0)
                h.rate = 1.0 + rng.uniform(-0.01, 0.01)
        elif kind == "insider":
            evil = Intruder(FORGER, sched, net, True)
            net.add(evil)

            def forge(evil: Intruder = evil) -> None:
                live = [r.wire for r in run.router.router.routes.values()] or ["x@1"]
                rid = rng.choice(live)
                n = rng.randint(1, 1 << 40)
                run.forged += 1
                if rng.random() < 0.5:  # a forged result for the router
                    msg: Message = rng.choice(
                        [TokenResult(rid, 0, (7,), "stop", n), Error("forged", "evil", rid, n)]
                    )
                    evil.inject(ROUTER, msg)
                    return
                # ... or commands to the intakes, which trust any member: they must change
                # nothing that belongs to the router's requests.
                k = cache_tensor(n)
                h = KvHandoff(
                    rid, n, ROUTER, n, 7, SamplingParams(max_tokens=4), (), 1, (k,), (k,), b""
                )
                h = dataclasses.replace(h, digest=digest_of(h, tensor_digest((k,), (k,))))
                target = rng.choice([*run.prefill, *run.decode]).identity
                run.targeted.add(rid.partition("@")[0])
                evil.inject(
                    target,
                    rng.choice(
                        [
                            CancelRequest(rid, "evil"),
                            h,
                            HandoffVerdict(rid, n, True),
                            HandoffAck(rid, n, True),
                        ]
                    ),
                )

            for _ in range(rng.randint(3, 20)):
                sched.at(rng.uniform(0.0, horizon), forge)
    plan.install(sched.at)


def run_disagg(
    seed: int, inject: frozenset[str] = frozenset(), nodes: int | None = None
) -> tuple[DisaggRun, list[str], int]:
    rng = random.Random(f"disagg:{seed}")
    n_prefill = rng.randint(1, nodes or 8)
    n_decode = rng.randint(1, nodes or 8)
    faults = [DISAGG_FAULTS[seed % len(DISAGG_FAULTS)]]
    faults += [k for k in DISAGG_FAULTS if k not in faults and rng.random() < 0.1]
    # The prompt caches, tenants and conversations draw from a stream of their own: a seed's
    # other choices stay what they were.
    own = random.Random(f"disagg-cache:{seed}")
    cached = own.random() < 0.8
    caches = (
        own.choice([0, 300, 3000]) if cached else 0,
        own.choice([0, 150, 600, 6000]) if cached else 0,
    )
    run = build_disagg(rng, n_prefill, n_decode, faults, inject & frozenset(DISAGG_BUGS), caches)
    horizon = 3.0
    n_requests = rng.randint(3, 24)
    sent: list[tuple[tuple[int, ...], int, str, float]] = []
    for i in range(n_requests):
        # Long prompts arrive while short ones decode.
        plen = rng.choice([rng.randint(1, 40), rng.randint(200, 2000)])
        prompt = tuple(rng.randrange(VOCAB) for _ in range(plen))
        at = 1.5 + rng.uniform(0.0, horizon)  # after the first probe round
        max_tokens = rng.randint(1, 32)
        tenant = own.choice(TENANTS)
        if sent and own.random() < 0.5:  # an earlier request's next turn
            before, n, tenant_before, then = own.choice(sent)
            new = tuple(own.randrange(VOCAB) for _ in range(own.randint(1, 30)))
            prompt = (*before, *reference(before, n), *new)
            at = then + own.uniform(0.2, 3.0)
            # Mostly its own tenant's; else another's probe with the very same tokens.
            tenant = tenant_before if own.random() < 0.7 else own.choice(TENANTS)
        sent.append((prompt, max_tokens, tenant, at))
        run.ledger.tenants[f"req-{i}"] = tenant
        run.sched.at(at, run.router.submit, f"req-{i}", prompt, max_tokens, tenant)
        if rng.random() < 0.1:
            run.sched.at(at + rng.uniform(0.0, 0.5), run.router.cancel, f"req-{i}")
    _faults(run, rng, 1.5 + horizon)
    last_restart = max(at for *_, at in sent) + 40.0  # every crashed node is back by then

    def settled() -> bool:  # nothing left to happen but probes: stop early
        if run.sched.now < last_restart or any(
            o.finish is None for o in run.router.outcomes.values()
        ):
            return False
        return _idle(run)

    with logged_errors() as logged:
        run.sched.run(horizon + CLIENT_TIMEOUT + 60.0, settled)
        bad = check_disagg(run) + logged
        run.sched.close()
    return run, bad, n_requests


def _idle(run: DisaggRun) -> bool:
    if run.router.router.routes:
        return False
    if any(p.prefill.leases or p.computing for p in run.prefill if p.service is not None):
        return False
    return not any(d.decode.slots or d.running for d in run.decode if d.service is not None)


def check_disagg(run: DisaggRun) -> list[str]:
    bad: list[str] = []
    for o in run.router.outcomes.values():
        want = reference(o.prompt, o.max_tokens)
        bad.extend(o.problems(want, o.request_id in run.targeted, run.plan))
    for host, rid, reader, owner in run.ledger.reused:
        if reader != owner:
            bad.append(
                f"{host}: {rid} (tenant {reader!r}) started from a cached prefix tenant "
                f"{owner!r} left"
            )
    for prefill, lease, decode, at in run.ledger.reads:
        committed = run.ledger.commits.get((prefill, lease))
        if committed is None or committed > at:
            bad.append(f"{decode} read handoff {lease} of {prefill} before it was committed")
    # No recomputation: a wire id's prompt runs once at most, anywhere in the cluster; a
    # second dispatch of one happens only as the failover of a request that never left the
    # router. (A request whose node was lost before its first token starts over under a new
    # wire id -- "restart" -- and its old one is cancelled.)
    computed: dict[str, int] = {}
    for _p, rid, _n in run.ledger.computed:
        computed[rid] = computed.get(rid, 0) + 1
    for rid, n in computed.items():
        if n > 1:
            bad.append(f"{rid} was computed {n} times")
    for h in [run.router, *run.prefill, *run.decode]:
        bad.extend(h.errors + h.conservation())
    r = run.router.router
    if r.routes:
        bad.append(f"the router still holds {sorted(r.routes)}")
    if any(n.active for n in r.nodes.values()):
        bad.append("the router's per-node in-flight counts did not return to 0")
    for p in run.prefill:
        if p.service is not None and (p.prefill.leases or p.computing):
            bad.append(f"{p.identity} still holds leases {sorted(p.prefill.leases)}")
    for d in run.decode:
        if d.service is not None and (d.decode.slots or d.running):
            bad.append(f"{d.identity} still holds slots {sorted(d.decode.slots)}")
    if run.forged and any(
        o.tokens[:1] == [7] and o.finish == "stop"
        for o in run.router.outcomes.values()
        if reference(o.prompt, o.max_tokens)[:1] != [7]
    ):
        bad.append("a forged result reached a client")
    return bad
