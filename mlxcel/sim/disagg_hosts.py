"""The hosts of the disaggregated scenarios: the production router, prefill and decode
services (adapters and cores) as simulated processes, the fake engines they compute with, and
the ledger the invariants read.

The fake model: a prompt's "KV cache" is a 64-bit hash of its tokens, carried as a real
tensor under the real handoff digest; token ``k`` of a request is a mix of that hash and
``k``. A decode node that read the wrong cache, read one twice, or skipped a token streams
tokens that differ from :func:`reference`.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from mlxcel.base.handoff import Packed, digest_of, tensor_digest
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    HandoffVerdict,
    KvHandoff,
    Message,
    RunEntry,
    RunResult,
    SamplingParams,
    Tensor,
)
from mlxcel.disagg.decode_core import DecodeConfig, DecodeCore
from mlxcel.disagg.prefill_core import PrefillConfig, PrefillCore
from mlxcel.disagg.protocol import ResumeJob
from mlxcel.disagg.router_core import RouterCore
from mlxcel.disagg.service import RouterService
from mlxcel.disagg.worker_service import DecodeService, PrefillService
from mlxcel.reactor.bus import Envelope, Node, Origin
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.compute import SimCompute
from mlxcel.sim.hosts import Outcome
from mlxcel.sim.model import MASK, mix
from mlxcel.sim.network import SimNetwork
from mlxcel.sim.process import SimEndpoint, SimProcess

ROUTER = "10.0.3.1:8300"
VOCAB = 512
EOS = 0
STEP_S = 0.005  # one decode step
PREFILL_PER_TOKEN_S = 0.0005
CLIENT_TIMEOUT = 900.0  # the client's own deadline: the cluster must end requests first


def prompt_hash(prompt: tuple[int, ...]) -> int:
    h = 0x5EED
    for t in prompt:
        h = mix(h, t, 17)
    return h


def token(h: int, k: int) -> int:
    return mix(h, k, 31) % VOCAB


def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """What a single node streams: tokens until max_tokens or EOS (EOS is not streamed)."""
    out: list[int] = []
    h = prompt_hash(prompt)
    for k in range(max_tokens):
        t = token(h, k)
        if t == EOS:
            break
        out.append(t)
    return out


def cache_tensor(h: int) -> Tensor:
    return Tensor("float32", (1, 1, 1, 2), struct.pack("<Q", h))


def cache_hash(t: Tensor) -> int:
    return int(struct.unpack("<Q", t.data)[0])


class RouterHost(SimProcess):
    """The production :class:`RouterService` (its prober included, probing over the simulated
    network) plus a client in the frontend's place."""

    def __init__(
        self,
        sched: Scheduler,
        net: SimNetwork,
        prefill: list[str],
        decode: list[str],
        first_nonce: int,
    ) -> None:
        super().__init__(ROUTER, sched, net)
        self.nodes = (prefill, decode)
        self.first_nonce = first_nonce
        self.outcomes: dict[str, Outcome] = {}
        self.boot()

    @property
    def router(self) -> RouterCore:
        return self.service.router  # type: ignore[no-any-return]

    def build(self, node: Node, endpoint: SimEndpoint) -> RouterService:
        core = RouterCore(*self.nodes, first_nonce=self.first_nonce)
        return RouterService(node, endpoint, core, self._probe, probe_interval=1.0)

    def started(self, service: RouterService) -> None:
        service.attach()
        for cls in (RunResult, Error):
            service.node.bus.subscribe(
                cls, self._route, maxsize=1024, origin=Origin.LOCAL, sync=True, leaf=True
            )

    async def _probe(self, address: str, deadline: float, fresh: bool) -> None:
        """A ping: a handshake over the simulated network (``SimNetwork.handshake``)."""
        await self.net.handshake(ROUTER, address, deadline)

    def _route(self, env: Envelope[Any]) -> None:
        o = self.outcomes.get(getattr(env.msg, "request_id", "") or "")
        if o is not None:
            o.record(env.msg, self.sched.now)

    def submit(self, rid: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        o = Outcome(rid, prompt, max_tokens, self.sched.now + CLIENT_TIMEOUT, self.sched.now)
        self.outcomes[rid] = o
        self.sched.at(o.deadline, self._client_deadline, rid)
        entry = RunEntry(rid, 0, prompt, 0, SamplingParams(max_tokens=max_tokens), 1)
        assert self.node is not None
        if not self.node.bus.publish_now(entry):
            o.finish, o.ended_at = "error:router_busy", self.sched.now

    def cancel(self, rid: str) -> None:
        o = self.outcomes[rid]
        if o.finish is None and self.node is not None:
            o.finish, o.ended_at = "cancelled", self.sched.now
            self.node.bus.publish_now(CancelRequest(rid, "client"))

    def _client_deadline(self, rid: str) -> None:
        o = self.outcomes[rid]
        if o.finish is None:
            o.finish, o.ended_at = "error:client_deadline", self.sched.now


@dataclass
class Ledger:
    """What the invariants compare across hosts."""

    # (prefill, lease) -> when the prefill node sent the commit
    commits: dict[tuple[str, int], float] = field(default_factory=dict)
    reads: list[tuple[str, int, str, float]] = field(default_factory=list)  # ..., decode, when
    computed: list[tuple[str, str, int]] = field(default_factory=list)  # (prefill, rid, nonce)


# The engine figures a State reports: an empty config says "capacity unknown" (0).
_NO_MODEL = SimpleNamespace(config={}, n_layers=1)


class PrefillEngine:
    """What :class:`PrefillService` asks of its engine, over the fake model: a prompt's
    "cache" is its hash; computing it takes a fixed cost plus one per token."""

    def __init__(self, host: PrefillHost) -> None:
        self.host = host
        self.loaded = _NO_MODEL
        self.kept: dict[str, tuple[Packed, tuple[int, ...]]] = {}
        self.caches: set[int] = set()  # leases whose cache the "engine" holds
        self.alive = True

    def kv_tokens(self) -> int:
        return 0

    def submit(self, entry: RunEntry, role: str, sink: Any, **_: Any) -> str | None:
        host, lease = self.host, int(entry.request_id.partition("-")[2])
        x = host.prefill.leases[lease]
        host.ledger.computed.append((host.identity, x.request.request_id, x.request.nonce))
        self.caches.add(lease)
        took = 0.002 + PREFILL_PER_TOKEN_S * len(entry.token_ids)
        host.sched.after(took, self._computed, entry, lease, sink)
        return None

    def _computed(self, entry: RunEntry, lease: int, sink: Any) -> None:
        if not self.alive or lease not in self.caches:
            return
        h = prompt_hash(entry.token_ids)
        t0 = token(h, 0)
        # One tensor per "layer"; at 16 bytes a layer, a small part size splits the handoff.
        layers = range(self.host.layers)
        ks = tuple(cache_tensor(h ^ layer) for layer in layers)
        vs = tuple(cache_tensor(~h & MASK ^ layer) for layer in layers)
        rid = entry.request_id
        self.kept[rid] = (Packed(len(entry.token_ids), t0, ks, vs, tensor_digest(ks, vs)), ())
        ids = () if t0 == EOS else (t0,)
        sink(RunResult(rid, 0, ids, "stop" if t0 == EOS else "length", 0))

    def cancel(self, request_id: str, role: str) -> None:
        self.caches.discard(int(request_id.partition("-")[2]))
        self.kept.pop(request_id, None)


class PrefillHost(SimProcess):
    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        cfg: PrefillConfig,
        ledger: Ledger,
        rng: random.Random,
    ) -> None:
        super().__init__(identity, sched, net)
        self.cfg, self.ledger, self.rng = cfg, ledger, rng
        self.layers = 1
        self.engine: PrefillEngine | None = None
        self.boot()

    @property
    def prefill(self) -> PrefillCore:
        return self.service.prefill  # type: ignore[no-any-return]

    @property
    def caches(self) -> set[int]:
        return self.engine.caches if self.engine is not None else set()

    def build(self, node: Node, endpoint: SimEndpoint) -> PrefillService:
        self.engine = PrefillEngine(self)
        lease = self.rng.getrandbits(40) + 1
        return PrefillService(node, endpoint, self.engine, self.cfg, first_lease=lease)  # type: ignore[arg-type]

    def started(self, service: PrefillService) -> None:
        service.attach()

    def check_send(self, dest: str, msg: Message) -> None:
        if isinstance(msg, HandoffVerdict) and msg.commit:
            self.ledger.commits[(self.identity, msg.lease)] = self.sched.now

    def on_crash(self) -> None:
        if self.engine is not None:
            self.engine.alive = False


class DecodeEngine:
    """What :class:`DecodeService` asks of its engine, over the fake model: checking a
    handoff takes ``verify_s`` on a worker "thread" (loading it then takes no time on the
    compute "thread"); decoding streams one token a step."""

    def __init__(self, host: DecodeHost) -> None:
        self.host = host
        self.loaded = _NO_MODEL
        self.worker = SimCompute(host.sched, lambda _fn, _args: host.verify_s)
        self.compute = SimCompute(host.sched, lambda _fn, _args: 0.0)
        self.running: dict[int, tuple[int, int]] = {}  # slot -> (cache hash, tokens left)
        self.alive = True

    def kv_tokens(self) -> int:
        return 0

    def check(self, h: KvHandoff) -> str | None:
        ok = digest_of(h, tensor_digest(h.keys, h.values)) == h.digest
        return None if ok else "digest mismatch"

    def load(self, h: KvHandoff) -> int:
        host = self.host
        if "read-uncommitted" in host.inject:  # the bug: decode before the prefill committed
            slot = next(
                (s.id for s in host.decode.slots.values() if s.handoff.lease == h.lease), None
            )
            if slot is not None:  # once the service staged it (a moment later: 0.1 ms)
                host.sched.after(1e-4, self._early, slot, h)
        return cache_hash(h.keys[0])

    def _early(self, slot: int, h: KvHandoff) -> None:
        svc = self.host.service
        if self.alive and svc is not None and slot in svc.staged:
            svc._resume(ResumeJob(slot, h))

    def submit(
        self, entry: RunEntry, role: str, sink: Any, cache: Any = None, **_: Any
    ) -> str | None:
        host, slot = self.host, int(entry.request_id.partition("-")[2])
        s = host.decode.slots.get(slot)
        prefill, lease = (s.prefill, s.handoff.lease) if s is not None else ("?", -1)
        host.ledger.reads.append((prefill, lease, host.identity, host.sched.now))
        self.running[slot] = (int(cache), entry.sampling.max_tokens)
        host.sched.after(STEP_S, self._step, slot, 1, sink)
        if host.crash_after_reads is not None:
            host.crash_after_reads -= 1
            if host.crash_after_reads <= 0:
                host.crash_after_reads = None
                host.sched.after(STEP_S * 2, host.crash)  # mid-stream, right after the handoff
        return None

    def _step(self, slot: int, k: int, sink: Any) -> None:
        if not self.alive or slot not in self.running:
            return
        h, left = self.running[slot]
        t = token(h, k)
        done = t == EOS or left <= 1
        finish = ("stop" if t == EOS else "length") if done else None
        if done:
            del self.running[slot]
        else:
            self.running[slot] = (h, left - 1)
            self.host.sched.after(STEP_S, self._step, slot, k + 1, sink)
        sink(RunResult(f"slot-{slot}", 0, () if t == EOS else (t,), finish, 0))

    def cancel(self, request_id: str, role: str) -> None:
        self.running.pop(int(request_id.partition("-")[2]), None)


class DecodeHost(SimProcess):
    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        cfg: DecodeConfig,
        ledger: Ledger,
        inject: frozenset[str],
    ) -> None:
        super().__init__(identity, sched, net)
        self.cfg, self.ledger, self.inject = cfg, ledger, inject
        self.verify_s = 0.001
        self.crash_after_reads: int | None = None
        self.engine: DecodeEngine | None = None
        self.boot()

    @property
    def decode(self) -> DecodeCore:
        return self.service.decode  # type: ignore[no-any-return]

    @property
    def running(self) -> dict[int, tuple[int, int]]:
        return self.engine.running if self.engine is not None else {}

    @property
    def staged(self) -> dict[int, Any]:
        return self.service.staged if self.service is not None else {}

    def build(self, node: Node, endpoint: SimEndpoint) -> DecodeService:
        self.engine = engine = DecodeEngine(self)
        return DecodeService(
            node,
            endpoint,
            engine,  # type: ignore[arg-type]
            self.cfg,
            check=engine.check,
            offload=engine.worker.run,
            load=engine.load,
        )

    def started(self, service: DecodeService) -> None:
        service.attach()

    def on_crash(self) -> None:
        if self.engine is not None:
            self.engine.alive = False
            self.engine.compute.alive = False
