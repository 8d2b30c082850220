"""Simulated nodes: the unchanged role cores, driven on virtual time.

Each host is the simulator's adapter for one core -- what :class:`mlxcel.adapter.CoreAdapter`
is over asyncio: it hands the core each message with its authenticated source and the host's
own clock (which may be skewed), carries out the effects, and arms the core's next timer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxcel.bus import LOCAL
from mlxcel.effects import (
    Answer,
    Deliver,
    Effect,
    FreeCache,
    ResetPeer,
    Send,
    StartCompute,
    Stopped,
    Warn,
)
from mlxcel.messages import (
    BUNDLED,
    MAX_BUNDLE,
    Bundle,
    CancelRequest,
    Error,
    Message,
    RunEntry,
    RunResult,
    SamplingParams,
)
from mlxcel.pipeline.coordinator_core import CoordinatorCore
from mlxcel.pipeline.stage_core import StageConfig, StageCore
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.model import FakeModel
from mlxcel.sim.network import SimNetwork


class SimHost:
    """Common plumbing: clock skew, timers, sends, and the effects every core emits."""

    def __init__(self, identity: str, sched: Scheduler, net: SimNetwork, skew: float = 0.0) -> None:
        self.identity = identity
        self.sched = sched
        self.net = net
        self.skew = skew  # this host's clock at true time 0
        self.rate = 1.0  # how fast this host's clock runs (a drifting oscillator)
        self.up = True
        self.has_secret = True
        self.incarnation = 0
        self.warnings: Counter[str] = Counter()
        self.errors: list[str] = []
        self._timer_at: float | None = None
        self.core: StageCore | CoordinatorCore

    def now(self) -> float:
        return self.skew + self.sched.now * self.rate

    def call(self, fn: Callable[..., list[Effect]], *args: object) -> None:
        """Run one core entry point and carry out its effects. A core that raises is a bug
        the harness reports (the real adapter logs it and keeps serving), not a crash."""
        try:
            effects = fn(*args)
        except Exception as exc:
            self.errors.append(f"{self.identity}: {fn.__name__} raised {type(exc).__name__}: {exc}")
            return
        self.feed(effects)

    def feed(self, effects: list[Effect]) -> None:
        sends: dict[str, list[Message]] = {}
        for e in effects:
            if isinstance(e, Send):
                self.check_send(e)
                sends.setdefault(e.dest, []).append(e.msg)
            elif isinstance(e, Warn):
                self.warnings[e.kind] += 1
            elif isinstance(e, ResetPeer):
                self.net.reset_link(self.identity, e.dest)
            else:
                self.apply(e)
        # As the adapter's outboxes do: what one call sends one peer travels as one Bundle.
        for dest, msgs in sends.items():
            for part in _bundles(msgs):
                self.net.send(self.identity, dest, part)
        self._arm()

    def apply(self, effect: Effect) -> None:
        raise NotImplementedError(type(effect).__name__)

    def check_send(self, send: Send) -> None:
        """A hook for invariants on what this host sends."""

    def _arm(self) -> None:
        when = self.core.next_timer()
        if when is None:
            return
        true_when = (when - self.skew) / self.rate
        if self._timer_at is not None and self._timer_at <= true_when:
            return  # an earlier timer is armed; it re-arms after running
        self._timer_at = true_when
        self.sched.at(true_when, self._fire, self.incarnation, true_when, when)

    def _fire(self, incarnation: int, true_when: float, when: float) -> None:
        if not self.up or incarnation != self.incarnation or self._timer_at != true_when:
            return
        self._timer_at = None
        # max(): adding and removing the skew may round below the time the core asked for.
        self.call(self.core.on_timer, max(self.now(), when))

    # --- what the network calls ---------------------------------------------------------------
    def receive(self, msg: Message, source: str) -> None:
        if not isinstance(msg, Bundle):
            self.call(self.core.handle, msg, source, self.now())
        elif isinstance(self.core, StageCore):
            self.call(self.core.handle_bundle, msg.items, source, self.now())
        else:
            for item in msg.items:
                self.call(self.core.handle, item, source, self.now())

    def send_failed(self, dest: str, msg: Message, reason: str) -> None:
        for item in msg.items if isinstance(msg, Bundle) else (msg,):
            if self.up:
                self.call(self.core.undeliverable, Send(dest, item), reason, self.now())

    def peer_lost(self, identity: str) -> None:
        if self.up:
            self.call(self.core.peer_lost, identity, self.now())


class StageHost(SimHost):
    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        config: StageConfig,
        model: FakeModel,  # or mlxcel.sim.real_model.RealModel: same interface
        layers: tuple[int, int],
        inject: frozenset[str] = frozenset(),
        skew: float = 0.0,
    ) -> None:
        super().__init__(identity, sched, net, skew)
        self.config = config
        self.model = model
        self.layers = layers
        self.inject = inject
        self.slow = 1.0  # compute time multiplier (a slow node)
        self.stopped = False
        self.violations: list[str] = []
        # The final stage's results must go to whoever fed the inputs on the entry stage.
        self.entry_owner: Callable[[str], str | None] | None = None
        self._boot()

    def receive(self, msg: Message, source: str) -> None:
        # Ownership invariant, observed from outside the core: a message from anyone but a
        # sequence's owner must leave that sequence exactly as it was.
        items = msg.items if isinstance(msg, Bundle) else (msg,)
        before = {}
        for item in items:
            rid = getattr(item, "request_id", None)
            seq = self.core.seqs.get(rid) if isinstance(rid, str) else None
            if seq is not None and source != seq.owner:
                before[rid] = (seq.key, seq.owner, type(item).__name__)
        super().receive(msg, source)
        for rid, (key, owner, kind) in before.items():
            after = self.core.seqs.get(rid)
            if after is None or (after.key, after.owner) != (key, owner):
                self.violations.append(
                    f"{self.identity}: {kind} from {source} changed {rid!r}, owned by {owner}"
                )
        if len(self.core.seqs) > self.config.max_sequences:
            self.violations.append(f"{self.identity}: holds {len(self.core.seqs)} sequences")

    def check_send(self, send: Send) -> None:
        msg = send.msg
        if self.entry_owner is not None and isinstance(msg, RunResult):
            fed_by = self.entry_owner(msg.request_id)
            if fed_by is not None and fed_by != send.dest:
                self.violations.append(
                    f"{self.identity}: a result for {msg.request_id!r} went to {send.dest}, "
                    f"but {fed_by} owns the sequence on the entry stage"
                )

    def _boot(self) -> None:
        self.core = StageCore(
            self.config,
            width=self.model.width,
            vocab=self.model.vocab,
            layers=self.layers,
            inject=self.inject,
        )
        self.backend = self.model.stage(self.config.index, self.config.n_stages)
        self._busy_until = self.sched.now  # the compute thread runs one job after another

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute):
            job = effect.job
            took = self.model.compute_time(job) * self.slow
            start = max(self.sched.now, self._busy_until)
            self._busy_until = start + took
            self.sched.at(self._busy_until, self._done, self.incarnation, job, took)
        elif isinstance(effect, FreeCache):
            # In order with the jobs before it, as on the one compute thread.
            self.sched.at(self._busy_until, self._free, self.incarnation, effect.key)
        elif isinstance(effect, Stopped):
            self.stopped = True
        else:
            raise NotImplementedError(type(effect).__name__)

    def _done(self, incarnation: int, job: object, took: float) -> None:
        if self.up and incarnation == self.incarnation:
            outs = self.backend.run(job)  # type: ignore[arg-type]
            self.call(self.core.compute_done, job.id, outs, took, self.now())  # type: ignore[attr-defined]

    def _free(self, incarnation: int, key: tuple[str, int]) -> None:
        if incarnation == self.incarnation:
            self.backend.free(key)

    def crash(self) -> None:
        self.sched.trace("crash", self.identity)
        self.up = False
        self.incarnation += 1
        self._timer_at = None
        self.net.reset_connections(self.identity)

    def restart(self) -> None:
        self.sched.trace("restart", self.identity)
        self.up = True
        self.incarnation += 1
        self._boot()


@dataclass
class Outcome:
    """What one request's client saw."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    deadline: float
    submitted: float
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # stop / length, or "error:<code>", or "cancelled"
    ended_at: float | None = None

    def record(self, msg: Message, now: float) -> None:
        """What the frontend got for this request: tokens, a finish, or an error."""
        if self.finish is not None:
            return
        if isinstance(msg, Error):
            self.finish, self.ended_at = f"error:{msg.code}", now
        elif isinstance(msg, RunResult):
            self.tokens.extend(msg.token_ids)
            if msg.finish_reason is not None:
                self.finish, self.ended_at = msg.finish_reason, now


class CoordinatorHost(SimHost):
    """The coordinator core plus a client in the frontend's place: it submits requests,
    collects tokens, and cancels what passes its deadline (as the real frontend does)."""

    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        core: CoordinatorCore,
        skew: float = 0.0,
        remake: Callable[[], CoordinatorCore] | None = None,
    ) -> None:
        super().__init__(identity, sched, net, skew)
        self.core = core
        self.remake = remake  # a fresh core for a restarted process
        self.outcomes: dict[str, Outcome] = {}

    def submit(self, rid: str, prompt: tuple[int, ...], max_tokens: int, timeout: float) -> None:
        out = Outcome(rid, prompt, max_tokens, self.sched.now + timeout, self.sched.now)
        self.outcomes[rid] = out
        self.sched.trace("submit", rid)
        if not self.up:  # the client cannot connect
            out.finish, out.ended_at = "error:coordinator_down", self.sched.now
            return
        entry = RunEntry(rid, 0, prompt, 0, SamplingParams(max_tokens=max_tokens), 1)
        self.call(self.core.handle, entry, LOCAL, self.now())
        self.sched.at(out.deadline, self._deadline, rid)

    def crash(self) -> None:
        """The coordinator process dies: its clients see their connections drop, and every
        stage sees the coordinator's connections reset."""
        self.sched.trace("crash", self.identity)
        self.up = False
        self.incarnation += 1
        self._timer_at = None
        for out in self.outcomes.values():
            if out.finish is None:
                out.finish, out.ended_at = "error:coordinator_crashed", self.sched.now
        self.net.reset_connections(self.identity)

    def restart(self) -> None:
        assert self.remake is not None
        self.sched.trace("restart", self.identity)
        self.up = True
        self.incarnation += 1
        self.core = self.remake()

    def cancel(self, rid: str, finish: str = "cancelled") -> None:
        out = self.outcomes[rid]
        if out.finish is None and self.up:
            out.finish, out.ended_at = finish, self.sched.now
            self.sched.trace("cancel", rid, finish)
            self.call(self.core.handle, CancelRequest(rid, finish), LOCAL, self.now())

    def _deadline(self, rid: str) -> None:
        self.cancel(rid, "error:client_deadline")

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, Deliver):
            msg = effect.msg
            rid = getattr(msg, "request_id", None)
            out = self.outcomes.get(rid) if rid else None
            if out is None or out.finish is not None:
                return
            out.record(msg, self.sched.now)
            tokens = getattr(msg, "token_ids", ())
            self.sched.trace("deliver", rid, type(msg).__name__, tokens, out.finish)
        elif isinstance(effect, Answer):
            pass
        else:
            raise NotImplementedError(type(effect).__name__)


class Intruder(SimHost):
    """A host that sends what the scenario tells it to and records what reaches it."""

    def __init__(self, identity: str, sched: Scheduler, net: SimNetwork, has_secret: bool) -> None:
        super().__init__(identity, sched, net)
        self.has_secret = has_secret
        self.received: list[tuple[str, Message]] = []

    def receive(self, msg: Message, source: str) -> None:
        self.received.append((source, msg))

    def send_failed(self, dest: str, msg: Message, reason: str) -> None:
        pass

    def peer_lost(self, identity: str) -> None:
        pass

    def inject(self, dest: str, msg: Message) -> None:
        self.sched.trace("intrude", self.identity, dest, type(msg).__name__)
        self.net.send(self.identity, dest, msg)


def _bundles(msgs: list[Message]) -> list[Message]:
    """Runs of bundled kinds become Bundles (of at most MAX_BUNDLE); the rest go alone."""
    out: list[Message] = []
    run: list[Message] = []
    for m in [*msgs, None]:
        if m is not None and type(m) in BUNDLED and len(run) < MAX_BUNDLE:
            run.append(m)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else Bundle(tuple(run)))
        run = [m] if m is not None and type(m) in BUNDLED else []
        if m is not None and type(m) not in BUNDLED:
            out.append(m)
    return out
