"""The hosts of the disaggregated scenarios: the production router, prefill and decode cores
on simulated nodes, the fake model they compute with, and the ledger the invariants read.

The fake model: a prompt's "KV cache" is a 64-bit hash of its tokens, carried as a real
tensor under the real handoff digest; token ``k`` of a request is a mix of that hash and
``k``. A decode node that read the wrong cache, read one twice, or skipped a token streams
tokens that differ from :func:`reference`.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from typing import Any

from mlxcel.disagg.decode_core import DecodeConfig, DecodeCore
from mlxcel.disagg.prefill_core import PrefillConfig, PrefillCore
from mlxcel.disagg.protocol import PrefillJob, ResumeJob, VerifyJob
from mlxcel.disagg.router_core import LOCAL, RouterCore
from mlxcel.effects import Deliver, Effect, FreeCache, Send, StartCompute
from mlxcel.handoff import Packed, digest_of, tensor_digest
from mlxcel.messages import (
    CancelRequest,
    HandoffVerdict,
    KvHandoff,
    Message,
    RunEntry,
    RunResult,
    SamplingParams,
    Tensor,
)
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.hosts import Outcome, SimHost
from mlxcel.sim.model import MASK, mix
from mlxcel.sim.network import SimNetwork

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


class RouterHost(SimHost):
    """The router core plus a client in the frontend's place, and the liveness prober."""

    def __init__(
        self,
        sched: Scheduler,
        net: SimNetwork,
        prefill: list[str],
        decode: list[str],
        first_nonce: int,
    ) -> None:
        super().__init__(ROUTER, sched, net)
        self.core = RouterCore(prefill, decode, first_nonce=first_nonce)  # type: ignore[assignment]
        self.outcomes: dict[str, Outcome] = {}
        self.sched.after(0.0, self._probe_round)

    @property
    def router(self) -> RouterCore:
        assert isinstance(self.core, RouterCore)
        return self.core

    def send_failed(self, dest: str, msg: Message, reason: str) -> None:
        # The simulated network fails a send only when no connection could be made.
        if self.up:
            self.call(self.router.undeliverable, Send(dest, msg), reason, self.now(), True)

    def _probe_round(self) -> None:
        for a in self.router.nodes:
            self._probe(a)
        self.sched.after(1.0, self._probe_round)

    def _probe(self, address: str) -> None:
        peer = self.net.hosts.get(address)
        ok = bool(peer and peer.up and peer.has_secret and not self.net.parted(ROUTER, address))
        self.sched.after(2 * self.net.link.latency, self._probe_done, address, ok)

    def peer_lost(self, identity: str) -> None:
        super().peer_lost(identity)
        if self.up and identity in self.router.nodes:
            self._probe(identity)  # as the real router does

    def _probe_done(self, address: str, ok: bool) -> None:
        self.call(self.router.probe_result, address, ok, "" if ok else "unreachable", self.now())

    def submit(self, rid: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        o = Outcome(rid, prompt, max_tokens, self.sched.now + CLIENT_TIMEOUT, self.sched.now)
        self.outcomes[rid] = o
        self.sched.at(o.deadline, self._client_deadline, rid)
        entry = RunEntry(rid, 0, prompt, 0, SamplingParams(max_tokens=max_tokens), 1)
        self.call(self.router.handle, entry, LOCAL, self.now())

    def cancel(self, rid: str) -> None:
        o = self.outcomes[rid]
        if o.finish is None:
            o.finish, o.ended_at = "cancelled", self.sched.now
            self.call(self.router.handle, CancelRequest(rid, "client"), LOCAL, self.now())

    def _client_deadline(self, rid: str) -> None:
        o = self.outcomes[rid]
        if o.finish is None:
            o.finish, o.ended_at = "error:client_deadline", self.sched.now

    def apply(self, effect: Effect) -> None:
        if not isinstance(effect, Deliver):
            raise NotImplementedError(type(effect).__name__)
        m = effect.msg
        o = self.outcomes.get(getattr(m, "request_id", "") or "")
        if o is not None:
            o.record(m, self.sched.now)


@dataclass
class Ledger:
    """What the invariants compare across hosts."""

    # (prefill, lease) -> when the prefill node sent the commit
    commits: dict[tuple[str, int], float] = field(default_factory=dict)
    reads: list[tuple[str, int, str, float]] = field(default_factory=list)  # ..., decode, when
    computed: list[tuple[str, str, int]] = field(default_factory=list)  # (prefill, rid, nonce)


class WorkerHost(SimHost):
    """A prefill or decode node's process: a crash loses its connections and its compute
    state; a restart brings a fresh core."""

    def crash(self) -> None:
        if self.up:
            self.sched.trace("crash", self.identity)
            self.up, self._timer_at = False, None
            self.incarnation += 1
            self.forget()
            self.net.reset_connections(self.identity)

    def restart(self) -> None:
        if not self.up:
            self.sched.trace("restart", self.identity)
            self.up = True
            self.core = self.fresh_core()

    def forget(self) -> None:
        raise NotImplementedError

    def fresh_core(self) -> Any:
        raise NotImplementedError


class PrefillHost(WorkerHost):
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
        self.caches: set[int] = set()  # leases whose cache the "engine" holds
        self.core = PrefillCore(cfg, first_lease=rng.getrandbits(40) + 1)  # type: ignore[assignment]

    @property
    def prefill(self) -> PrefillCore:
        assert isinstance(self.core, PrefillCore)
        return self.core

    def check_send(self, send: Send) -> None:
        if isinstance(send.msg, HandoffVerdict) and send.msg.commit:
            self.ledger.commits[(self.identity, send.msg.lease)] = self.sched.now

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, PrefillJob):
            job = effect.job
            x = self.prefill.leases[job.lease]
            self.ledger.computed.append((self.identity, x.request.request_id, x.request.nonce))
            self.caches.add(job.lease)
            took = 0.002 + PREFILL_PER_TOKEN_S * len(job.token_ids)
            self.sched.after(took, self._computed, self.incarnation, job)
        elif isinstance(effect, FreeCache):
            self.caches.discard(effect.key)
        else:
            raise NotImplementedError(type(effect).__name__)

    def _computed(self, incarnation: int, job: PrefillJob) -> None:
        if not self.up or incarnation != self.incarnation or job.lease not in self.caches:
            return
        h = prompt_hash(job.token_ids)
        t0 = token(h, 0)
        # One tensor per "layer"; at 16 bytes a layer, a small part size splits the handoff.
        ks = tuple(cache_tensor(h ^ layer) for layer in range(self.layers))
        vs = tuple(cache_tensor(~h & MASK ^ layer) for layer in range(self.layers))
        packed = Packed(len(job.token_ids), t0, ks, vs, tensor_digest(ks, vs))
        ids = () if t0 == EOS else (t0,)
        finish = "stop" if t0 == EOS else "length"
        self.call(self.prefill.compute_done, job.lease, ids, finish, None, packed, (), self.now())

    def forget(self) -> None:
        self.caches.clear()

    def fresh_core(self) -> PrefillCore:
        return PrefillCore(self.cfg, first_lease=self.rng.getrandbits(40) + 1)


class DecodeHost(WorkerHost):
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
        self.running: dict[int, tuple[int, int]] = {}  # slot -> (cache hash, tokens left)
        self.staged: dict[int, int] = {}  # slot -> the verified cache (its hash), unread
        self.crash_after_reads: int | None = None
        self.core = DecodeCore(cfg)  # type: ignore[assignment]

    @property
    def decode(self) -> DecodeCore:
        assert isinstance(self.core, DecodeCore)
        return self.core

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, VerifyJob):
            self.staged[effect.job.slot] = cache_hash(effect.job.handoff.keys[0])
            self.sched.after(self.verify_s, self._verified, self.incarnation, effect.job)
        elif isinstance(effect, StartCompute) and isinstance(effect.job, ResumeJob):
            self._read(effect.job.slot, effect.job.handoff)
        elif isinstance(effect, FreeCache):
            self.staged.pop(effect.key, None)
            self.running.pop(effect.key, None)
        else:
            raise NotImplementedError(type(effect).__name__)

    def _verified(self, incarnation: int, job: VerifyJob) -> None:
        if not self.up or incarnation != self.incarnation or job.slot not in self.staged:
            return
        h = job.handoff
        ok = digest_of(h, tensor_digest(h.keys, h.values)) == h.digest
        self.call(self.decode.verified, job.slot, None if ok else "digest mismatch", self.now())
        if "read-uncommitted" in self.inject and ok and job.slot in self.decode.slots:
            self._read(job.slot, h)  # the bug: decode before the prefill node committed

    def _read(self, slot: int, h: KvHandoff) -> None:
        if slot in self.running or slot not in self.staged:
            return
        s = self.decode.slots.get(slot)
        prefill = s.prefill if s is not None else "?"
        self.ledger.reads.append((prefill, h.lease, self.identity, self.sched.now))
        self.running[slot] = (self.staged.pop(slot), h.sampling.max_tokens)
        self.sched.after(STEP_S, self._step, self.incarnation, slot, 1)
        if self.crash_after_reads is not None:
            self.crash_after_reads -= 1
            if self.crash_after_reads <= 0:
                self.crash_after_reads = None
                self.sched.after(STEP_S * 2, self.crash)  # mid-stream, right after the handoff

    def _step(self, incarnation: int, slot: int, k: int) -> None:
        if not self.up or incarnation != self.incarnation or slot not in self.running:
            return
        h, left = self.running[slot]
        t = token(h, k)
        done = t == EOS or left <= 1
        finish = ("stop" if t == EOS else "length") if done else None
        if done:
            del self.running[slot]
        else:
            self.running[slot] = (h, left - 1)
            self.sched.after(STEP_S, self._step, incarnation, slot, k + 1)
        result = RunResult(f"slot-{slot}", 0, () if t == EOS else (t,), finish, 0)
        self.call(self.decode.token, slot, result, self.now())

    def forget(self) -> None:
        self.running.clear()
        self.staged.clear()

    def fresh_core(self) -> DecodeCore:
        return DecodeCore(self.cfg)
