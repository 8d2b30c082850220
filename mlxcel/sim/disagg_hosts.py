"""The hosts of the disaggregated scenarios: the production router, prefill and decode
services (adapters and cores) and the production engine as simulated processes, the fake
runtimes that engine steps, and the ledger the invariants read.

The fake model: a prompt's "KV cache" is a 64-bit hash of its tokens, carried as a real
tensor under the real handoff digest; token ``k`` of a request is a mix of that hash and
``k``. A decode node that read the wrong cache, read one twice, or skipped a token streams
tokens that differ from :func:`reference`.

The hash is a fold over the tokens, so its value after each position is that position's
"KV row": a prompt cache (:class:`SimPromptCache`, mlx-lm's LRU faked) keeps a prompt's rows
and a later prompt that starts alike folds on from the row where they part. A decode node
keeps a conversation's rows as its stream ends, computed from the prompt tokens the handoff
carried -- rows that do not match the handed-off hash are kept wrong, as a real engine would
keep a cache under the wrong tokens -- so a turn answered from a wrong entry streams wrong
tokens. Every lookup that reuses an entry is written to the ledger with the tenant that left
the entry and the tenant that reads it.
"""

from __future__ import annotations

import itertools
import random
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mlxcel.base.handoff import Packed, digest_of, tensor_digest
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    HandoffVerdict,
    KvHandoff,
    Message,
    ResumeSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    Tensor,
)
from mlxcel.disagg.decode_core import DecodeConfig, DecodeCore
from mlxcel.disagg.prefill_core import PrefillConfig, PrefillCore
from mlxcel.disagg.protocol import NODE_CAPACITY, ResumeJob
from mlxcel.disagg.router_core import RouterCore
from mlxcel.disagg.service import RouterService
from mlxcel.disagg.worker_service import DecodeService, PrefillService
from mlxcel.reactor.bus import Envelope, Node, Origin
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.engine_state import EngineJob, EngineStep, Insert
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


SEED_HASH = 0x5EED


def prompt_hash(prompt: tuple[int, ...]) -> int:
    return fold(SEED_HASH, prompt)[-1] if prompt else SEED_HASH


def fold(h: int, tokens: tuple[int, ...] | list[int]) -> list[int]:
    """The hash after each of ``tokens``, starting from ``h``: the fake model's KV rows."""
    rows = []
    for t in tokens:
        h = mix(h, t, 17)
        rows.append(h)
    return rows


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


@dataclass
class CacheEntry:
    rows: list[int]  # the hash after each position
    owner: str  # the tenant whose request left it (the ledger's truth, not a namespace)


class SimPromptCache:
    """mlx-lm's LRU prompt cache, faked: entries by namespace, bounded in positions, the least
    recently stored evicted first; a lookup leaves at least one token to run."""

    def __init__(self, positions: int) -> None:
        self.positions = positions
        self.entries: OrderedDict[tuple[str, tuple[int, ...]], CacheEntry] = OrderedDict()

    def fetch(self, ns: str, tokens: tuple[int, ...]) -> tuple[list[int], str]:
        """The rows of ``tokens``' longest prefix kept in ``ns`` (empty: none) and the tenant
        that left that entry."""
        best: tuple[list[int], str] = ([], "")
        for (entry_ns, toks), e in self.entries.items():
            if entry_ns != ns:
                continue
            n = 0
            for a, b in zip(toks, tokens[:-1], strict=False):
                if a != b:
                    break
                n += 1
            if n > len(best[0]):
                best = (e.rows[:n], e.owner)
        return best

    def store(self, ns: str, tokens: tuple[int, ...], rows: list[int], owner: str) -> bool:
        """Keep ``rows`` under ``tokens``; whether it was kept (one over the whole budget
        is not)."""
        if not tokens or len(tokens) > self.positions:
            return False
        self.entries.pop((ns, tokens), None)
        self.entries[(ns, tokens)] = CacheEntry(rows, owner)
        while sum(len(k[1]) for k in self.entries) > self.positions:
            self.entries.popitem(last=False)
        return True


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

    def submit(self, rid: str, prompt: tuple[int, ...], max_tokens: int, ns: str = "") -> None:
        o = Outcome(rid, prompt, max_tokens, self.sched.now + CLIENT_TIMEOUT, self.sched.now, ns)
        self.outcomes[rid] = o
        self.sched.at(o.deadline, self._client_deadline, rid)
        sampling = SamplingParams(max_tokens=max_tokens)
        entry = RunEntry(rid, 0, prompt, 0, sampling, 1, cache_ns=ns)
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
    tenants: dict[str, str] = field(default_factory=dict)  # the client's request id -> tenant
    # Each prompt-cache reuse: (host, wire id, the reader's tenant, the entry's tenant)
    reused: list[tuple[str, str, str, str]] = field(default_factory=list)

    def tenant(self, wire_id: str) -> str:
        return self.tenants.get(wire_id.partition("@")[0], "")


class FakeModel:
    """What the engine reads of a loaded model, for the fake one: its vocabulary and its
    end-of-sequence token. (No layer shapes: a State's KV figures say "unknown", 0.)"""

    config = {"vocab_size": VOCAB}
    n_layers = 1

    def eos_token_ids(self) -> set[int]:
        return {EOS}


class FakeRuntime:
    """The engine's runtime over the fake model: what :class:`LocalEngine` (the real engine
    core and adapter) steps on its simulated compute thread. Rows are the batch's sequences."""

    recoverable = True
    step_timeout = None
    failure_code = ErrorCode.ENGINE_FAILED
    failure_prefix = ""
    decoding_alone = False

    def __init__(self) -> None:
        self.interrupt = threading.Event()
        self.rows: dict[int, list[Any]] = {}
        self._uids = itertools.count()

    def start(self) -> None:
        pass

    def reset(self) -> None:
        self.rows.clear()

    def batch_cache_rows(self) -> int:
        return len(self.rows)

    def step(self, job: EngineJob) -> EngineStep:
        out = EngineStep(steps=1)
        for uid in job.removals:
            self.rows.pop(uid, None)
        for i in job.inserts:
            uid = next(self._uids)
            if self.insert(uid, i, out) is False:
                continue  # never started (a continuation its cache fell short for)
            out.new_uids[i.entry.request_id] = uid
            out.prompt_tokens += len(i.entry.token_ids)
        for uid, row in list(self.rows.items()):
            self.decode(uid, row, out)
        return out

    def insert(self, uid: int, i: Insert, out: EngineStep) -> bool:
        raise NotImplementedError

    def decode(self, uid: int, row: list[Any], out: EngineStep) -> None:
        pass


class PrefillRuntime(FakeRuntime):
    """A prompt's "cache" is its hash; computing prompts takes a fixed cost plus one per
    token (:meth:`cost`). Each prompt gives its first token and its packed cache at once."""

    def __init__(self, host: PrefillHost) -> None:
        super().__init__()
        self.host = host
        self.cache = SimPromptCache(host.cache_positions) if host.cache_positions else None

    def reset(self) -> None:
        super().reset()
        if self.cache is not None:
            self.cache.entries.clear()

    def cost(self, fn: Any, args: tuple[Any, ...]) -> float:
        if fn != self.step:
            return 0.0
        return 0.002 + PREFILL_PER_TOKEN_S * sum(len(i.entry.token_ids) for i in args[0].inserts)

    def insert(self, uid: int, i: Insert, out: EngineStep) -> bool:
        host, rid = self.host, i.entry.request_id
        x = host.prefill.leases.get(i.entry.nonce)
        if x is not None:
            host.ledger.computed.append((host.identity, x.request.request_id, x.request.nonce))
        rows = run_prompt(self.cache, host.identity, host.ledger, i.entry, out)
        assert rows is not None  # (no minimum asked)
        h = rows[-1]
        t0 = token(h, 0)
        # One tensor per "layer"; at 16 bytes a layer, a small part size splits the handoff.
        layers = range(host.layers)
        ks = tuple(cache_tensor(h ^ layer) for layer in layers)
        vs = tuple(cache_tensor(~h & MASK ^ layer) for layer in layers)
        n = len(i.entry.token_ids)
        out.kept[rid] = (Packed(n, t0, ks, vs, tensor_digest(ks, vs)), ())
        out.tokens.append((rid, t0, "stop" if t0 == EOS else "length", None, None))
        return True


def run_prompt(
    cache: SimPromptCache | None,
    host: str,
    ledger: Ledger,
    e: RunEntry,
    out: EngineStep,
    min_cached: int = 0,
) -> list[int] | None:
    """The rows of ``e``'s prompt: its namespace's longest cached prefix's (the reuse written
    to the ledger), the rest computed on from there; then the prompt is kept. None, with
    nothing run, when the cache supplies fewer than ``min_cached`` tokens."""
    prompt, rid = e.token_ids, e.request_id
    reused, owner = cache.fetch(e.cache_ns, prompt) if cache is not None else ([], "")
    if len(reused) < min_cached:
        out.uncached[rid] = len(reused)
        return None
    rows = [*reused, *fold(reused[-1] if reused else SEED_HASH, prompt[len(reused) :])]
    if reused:
        out.cached[rid] = len(reused)
        ledger.reused.append((host, rid, ledger.tenant(rid), owner))
    if cache is not None and cache.store(e.cache_ns, prompt, rows, ledger.tenant(rid)):
        out.stored.add(rid)
    return rows


class PrefillHost(SimProcess):
    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        cfg: PrefillConfig,
        ledger: Ledger,
        rng: random.Random,
        cache_positions: int = 0,
    ) -> None:
        super().__init__(identity, sched, net)
        self.cfg, self.ledger, self.rng = cfg, ledger, rng
        self.cache_positions = cache_positions  # its prompt cache (0: none; lost on a crash)
        self.layers = 1
        self.engine: LocalEngine | None = None
        self.boot()

    @property
    def prefill(self) -> PrefillCore:
        return self.service.prefill  # type: ignore[no-any-return]

    @property
    def computing(self) -> int:
        """Prompts the engine holds now (each leaves it with its first token)."""
        return self.engine.active if self.engine is not None else 0

    async def prepare(self, node: Node) -> None:
        self.engine = await _engine(self, node, PrefillRuntime(self))

    def build(self, node: Node, endpoint: SimEndpoint) -> PrefillService:
        assert self.engine is not None
        lease = self.rng.getrandbits(40) + 1
        return PrefillService(node, endpoint, self.engine, self.cfg, first_lease=lease)

    def started(self, service: PrefillService) -> None:
        service.attach()

    def check_send(self, dest: str, msg: Message) -> None:
        if isinstance(msg, HandoffVerdict) and msg.commit:
            self.ledger.commits[(self.identity, msg.lease)] = self.sched.now

    def on_crash(self) -> None:
        if self.engine is not None:
            self.engine.compute.alive = False  # nothing it runs completes


@dataclass(frozen=True)
class FakeCache:
    """A loaded handoff: its cache's hash, and whose lease it was (for the ledger)."""

    hash: int
    prefill: str
    lease: int
    positions: int = 0  # the prompt's length


class DecodeRuntime(FakeRuntime):
    """Decoding streams one token per row a step (``STEP_S``); checking a handoff takes
    ``verify_s`` on a worker "thread", loading it no time on the compute one."""

    def __init__(self, host: DecodeHost) -> None:
        super().__init__()
        self.host = host
        self.worker = SimCompute(host.sched, lambda _fn, _args: host.verify_s)
        self.cache = SimPromptCache(host.cache_positions) if host.cache_positions else None

    def reset(self) -> None:
        super().reset()
        if self.cache is not None:
            self.cache.entries.clear()

    def cost(self, fn: Any, args: tuple[Any, ...]) -> float:
        return STEP_S if fn == self.step else 0.0

    def check(self, h: KvHandoff) -> str | None:
        ok = digest_of(h, tensor_digest(h.keys, h.values)) == h.digest
        return None if ok else "digest mismatch"

    def load(self, h: KvHandoff) -> FakeCache:
        host = self.host
        slot = next((s for s in host.decode.slots.values() if s.handoff.lease == h.lease), None)
        if slot is not None and "read-uncommitted" in host.inject:
            # The bug: decode before the prefill committed (once the service holds the
            # cache, a moment later: 0.1 ms).
            host.sched.after(1e-4, self._early, slot.id, h)
        prefill = slot.prefill if slot is not None else "?"
        return FakeCache(cache_hash(h.keys[0]), prefill, h.lease, h.prompt_len)

    def _early(self, slot: int, h: KvHandoff) -> None:
        svc = self.host.service
        s = svc.decode.slots.get(slot) if svc is not None else None
        if s is not None and s.cache is not None:
            svc.resume(ResumeJob(slot, h, s.cache))

    def insert(self, uid: int, i: Insert, out: EngineStep) -> bool:
        e, host = i.entry, self.host
        if i.cache is None:  # a conversation's next turn, from this node's own cache
            rows = run_prompt(self.cache, host.identity, host.ledger, e, out, i.min_cached)
            if rows is None:
                return False
            # (request id, cache hash, tokens left, the next token's index, prompt rows,
            # the prompt, tokens generated, its namespace)
            self.rows[uid] = [e.request_id, rows[-1], e.sampling.max_tokens, 0, rows,
                              e.token_ids, [], e.cache_ns]  # fmt: skip
            return True
        # After a handoff: token 0 came from the prefill node; the prompt's rows are what
        # the tokens the handoff carried fold to -- kept only if they are all of its
        # positions, and wrong if they are not the handed-off cache's.
        c: FakeCache = i.cache
        rows = None
        if len(i.context) == c.positions:
            rows = fold(SEED_HASH, i.context)
            if rows and rows[-1] != c.hash:
                rows = [r ^ 1 for r in rows]
        self.rows[uid] = [e.request_id, c.hash, e.sampling.max_tokens, 1, rows, i.context,
                          list(e.token_ids), e.cache_ns]  # fmt: skip
        return True

    def decode(self, uid: int, row: list[Any], out: EngineStep) -> None:
        rid, h, left, k, rows, prompt, generated, ns = row
        t = token(h, k)
        generated.append(t)
        done = t == EOS or left <= 1
        if done:
            del self.rows[uid]
            if self.cache is not None and rows:  # the conversation, for its next turn
                fed = generated[:-1]
                kept = [*rows, *fold(rows[-1], fed)]
                owner = self.host.ledger.tenant(rid)
                if self.cache.store(ns, (*prompt, *fed), kept, owner):
                    out.stored.add(rid)
        else:
            row[2:4] = [left - 1, k + 1]
        out.tokens.append(
            (rid, t, ("stop" if t == EOS else "length") if done else None, None, None)
        )


class DecodeHost(SimProcess):
    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        cfg: DecodeConfig,
        ledger: Ledger,
        inject: frozenset[str],
        cache_positions: int = 0,
    ) -> None:
        super().__init__(identity, sched, net)
        self.cfg, self.ledger, self.inject = cfg, ledger, inject
        self.cache_positions = cache_positions  # its prompt cache (0: none; lost on a crash)
        self.verify_s = 0.001
        self.crash_after_reads: int | None = None
        self.engine: LocalEngine | None = None
        self.runtime: DecodeRuntime | None = None
        self.boot()

    @property
    def decode(self) -> DecodeCore:
        return self.service.decode  # type: ignore[no-any-return]

    @property
    def running(self) -> int:
        """Streams the engine decodes now."""
        return self.engine.active if self.engine is not None else 0

    async def prepare(self, node: Node) -> None:
        self.runtime = DecodeRuntime(self)
        self.engine = await _engine(self, node, self.runtime)

    def build(self, node: Node, endpoint: SimEndpoint) -> DecodeService:
        assert self.engine is not None and self.runtime is not None
        rt = self.runtime
        return DecodeService(
            node, endpoint, self.engine, self.cfg, check=rt.check, offload=rt.worker.run,
            load=rt.load,
        )  # fmt: skip

    def started(self, service: DecodeService) -> None:
        service.attach()
        # What the service hands its engine, seen as it goes: the moment a handoff is read.
        service.node.bus.subscribe(
            ResumeSequence, self._read, maxsize=1024, origin=Origin.LOCAL, sync=True, leaf=True
        )

    def _read(self, env: Envelope[ResumeSequence]) -> None:
        cache = env.msg.cache
        self.ledger.reads.append((cache.prefill, cache.lease, self.identity, self.sched.now))
        if self.crash_after_reads is not None:
            self.crash_after_reads -= 1
            if self.crash_after_reads <= 0:
                self.crash_after_reads = None
                self.sched.after(STEP_S * 2, self.crash)  # mid-stream, right after the handoff

    def on_crash(self) -> None:
        if self.engine is not None and self.runtime is not None:
            self.engine.compute.alive = False  # nothing it runs completes
            self.runtime.worker.alive = False


async def _engine(
    host: SimProcess, node: Node, runtime: PrefillRuntime | DecodeRuntime
) -> LocalEngine:
    """The production engine (core and adapter) over a fake runtime, on the host's clock."""
    compute = SimCompute(host.sched, runtime.cost)
    engine = LocalEngine(node, FakeModel(), compute, max_sequences=NODE_CAPACITY, runtime=runtime)  # type: ignore[arg-type]
    engine.clock = host
    await engine.attach()
    return engine
