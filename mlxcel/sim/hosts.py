"""The pipeline's simulated processes: the production stage and coordinator services.

Each host is a :class:`~mlxcel.sim.process.SimProcess` running what ``serve`` runs --
:class:`StageService` or :class:`PipelineCoordinator`, their cores, the one effect runner
(:class:`~mlxcel.reactor.adapter.CoreAdapter`) -- on the virtual loop, with a skewable clock. Only the
compute (the fake model on a simulated compute thread) and the network are simulated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.base.effects import Effect
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    Message,
    RunEntry,
    RunResult,
    SamplingParams,
    StepResult,
)
from mlxcel.pipeline.coordinator import PipelineCoordinator
from mlxcel.pipeline.coordinator_core import CoordinatorCore
from mlxcel.pipeline.stage import StageService
from mlxcel.pipeline.stage_core import StageConfig, StageCore
from mlxcel.reactor.bus import Envelope, Node, Origin
from mlxcel.reactor.faults import FaultPlan
from mlxcel.sim.clock import Scheduler
from mlxcel.sim.compute import SimCompute, SimStageRuntime
from mlxcel.sim.model import FakeModel
from mlxcel.sim.network import SimNetwork
from mlxcel.sim.process import SimEndpoint, SimProcess


class OwnershipCheck:
    """The stage core as its adapter sees it, with the ownership invariant observed at its
    door: a message from anyone but a sequence's owner must leave that sequence exactly as it
    was. Everything else passes through unchanged."""

    def __init__(self, core: StageCore, host: StageHost) -> None:
        self._core = core
        self._host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        return self._checked((msg,), source, lambda: self._core.handle(msg, source, now))

    def handle_bundle(self, items: tuple[Message, ...], source: str, now: float) -> list[Effect]:
        return self._checked(items, source, lambda: self._core.handle_bundle(items, source, now))

    def _checked(
        self, items: tuple[Message, ...], source: str, call: Callable[[], list[Effect]]
    ) -> list[Effect]:
        seqs, before = self._core.seqs, {}
        for item in items:
            rid = getattr(item, "request_id", None)
            seq = seqs.get(rid) if isinstance(rid, str) else None
            if seq is not None and source != seq.owner:
                before[rid] = (seq.key, seq.owner, type(item).__name__)
        effects = call()
        host = self._host
        for rid, (key, owner, kind) in before.items():
            after = seqs.get(rid)
            if after is None or (after.key, after.owner) != (key, owner):
                host.violations.append(
                    f"{host.identity}: {kind} from {source} changed {rid!r}, owned by {owner}"
                )
        if len(seqs) > host.config.max_sequences:
            host.violations.append(f"{host.identity}: holds {len(seqs)} sequences")
        return effects


class StageHost(SimProcess):
    """A stage process: the production :class:`StageService` (adapter and core) computing
    with the simulated model on a simulated compute thread."""

    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        config: StageConfig,
        model: FakeModel,  # or mlxcel.sim.real_model.RealModel: same interface
        layers: tuple[int, int],
        skew: float = 0.0,
        prefix_capacity: int = 0,
    ) -> None:
        super().__init__(identity, sched, net, skew)
        self.config = config
        self.prefix_capacity = prefix_capacity  # positions its prompt-cache entries may hold
        self.model = model
        self.layers = layers
        self.violations: list[str] = []
        # The final stage's results must go to whoever fed the inputs on the entry stage.
        self.entry_owner: Callable[[str], str | None] | None = None
        self.runtime: SimStageRuntime | None = None
        self._compute: SimCompute | None = None
        self._slow = 1.0
        self.boot()

    @property
    def slow(self) -> float:
        """Compute time multiplier (a slow node)."""
        return self._slow

    @slow.setter
    def slow(self, value: float) -> None:
        self._slow = value
        if self.runtime is not None:
            self.runtime.slow = value

    @property
    def stage(self) -> StageCore | None:
        return self.service.stage if self.service is not None else None

    @property
    def backend(self) -> Any:
        return self.runtime.backend if self.runtime is not None else None

    def build(self, node: Node, endpoint: SimEndpoint) -> StageService:
        backend = self.model.stage(self.config.index, self.config.n_stages)
        if self.prefix_capacity:  # a restarted stage holds no entry
            backend.capacity = self.prefix_capacity
        self.runtime = runtime = SimStageRuntime(backend, self.model, self.layers)
        runtime.slow = self._slow
        runtime.traced = lambda *fields: self.sched.trace(self.identity, *fields)
        self._compute = SimCompute(self.sched, runtime.cost)
        svc = StageService(node, endpoint, runtime, self._compute, self.config)  # type: ignore[arg-type]
        svc.core = OwnershipCheck(svc.stage, self)
        return svc

    def started(self, service: StageService) -> None:
        service.attach()

    def check_send(self, dest: str, msg: Message) -> None:
        if self.entry_owner is None or not isinstance(msg, RunResult | StepResult):
            return
        for rid in msg.request_ids if isinstance(msg, StepResult) else (msg.request_id,):
            fed_by = self.entry_owner(rid)
            if fed_by is not None and fed_by != dest:
                self.violations.append(
                    f"{self.identity}: a result for {rid!r} went to {dest}, "
                    f"but {fed_by} owns the sequence on the entry stage"
                )

    def on_crash(self) -> None:
        if self._compute is not None:
            self._compute.alive = False  # what was computing dies with the process


# The prompt-cache namespaces requests come from (the open one, and two tenants').
TENANTS = ("", "tenant-a", "tenant-b")


@dataclass
class Outcome:
    """What one request's client saw."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    deadline: float
    submitted: float
    namespace: str = ""  # its tenant's prompt-cache namespace
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

    def problems(self, want: list[int], targeted: bool, plan: FaultPlan) -> list[str]:
        """What is wrong with what the client saw, against the reference tokens ``want``:
        it never ended, or hung until its own deadline; it failed where no planned fault
        explains a failure (a request an attack ``targeted`` may fail); it completed with
        other tokens or the wrong finish; it streamed tokens that are not the reference."""
        rid = self.request_id
        if self.finish is None or self.ended_at is None:
            return [f"{rid} never ended"]
        if self.finish == "error:client_deadline":
            return [f"{rid} hung until the client's deadline"]
        if self.finish.startswith("error:") and not targeted:
            why = plan.unexplained(self.submitted, self.ended_at)
            if why:
                return [f"{rid} failed ({self.finish}) {why}"]
        if self.finish in ("stop", "length"):
            expect = "stop" if len(want) < self.max_tokens else "length"
            if self.tokens != want or self.finish != expect:
                return [
                    f"{rid} completed ({self.finish}) with {self.tokens[:12]}..., "
                    f"expected ({expect}) {want[:12]}..."
                ]
        elif self.tokens != want[: len(self.tokens)]:
            return [f"{rid} ({self.finish}) streamed tokens that are not the reference"]
        return []


class CoordinatorHost(SimProcess):
    """The production :class:`PipelineCoordinator` plus a client in the frontend's place: it
    subscribes to the node's results as the frontend does, submits requests, collects tokens
    and cancels what passes its deadline (as the real frontend does)."""

    def __init__(
        self,
        identity: str,
        sched: Scheduler,
        net: SimNetwork,
        make: Callable[[Node, SimEndpoint, int], PipelineCoordinator],
        skew: float = 0.0,
    ) -> None:
        super().__init__(identity, sched, net, skew)
        self.make = make  # (node, endpoint, incarnation): a fresh coordinator
        self.outcomes: dict[str, Outcome] = {}
        self.boot()

    @property
    def coord(self) -> CoordinatorCore | None:
        return self.service.coord if self.service is not None else None

    def build(self, node: Node, endpoint: SimEndpoint) -> PipelineCoordinator:
        return self.make(node, endpoint, self.incarnation)

    def started(self, service: PipelineCoordinator) -> None:
        service.attach()
        for cls in (RunResult, Error):
            service.node.bus.subscribe(
                cls, self._route, maxsize=1024, origin=Origin.LOCAL, sync=True, leaf=True
            )

    def _route(self, env: Envelope[Any]) -> None:
        msg = env.msg
        out = self.outcomes.get(getattr(msg, "request_id", "") or "")
        if out is None or out.finish is not None:
            return
        out.record(msg, self.sched.now)
        tokens = getattr(msg, "token_ids", ())
        cached = getattr(msg, "cached_tokens", 0)  # what the client sees of the prompt cache
        self.sched.trace("deliver", out.request_id, type(msg).__name__, tokens, out.finish, cached)

    def submit(
        self, rid: str, prompt: tuple[int, ...], max_tokens: int, timeout: float, ns: str = ""
    ) -> None:
        out = Outcome(rid, prompt, max_tokens, self.sched.now + timeout, self.sched.now, ns)
        self.outcomes[rid] = out
        self.sched.trace("submit", rid)
        if self.node is None:  # the client cannot connect
            out.finish, out.ended_at = "error:coordinator_down", self.sched.now
            return
        entry = RunEntry(rid, 0, prompt, 0, SamplingParams(max_tokens=max_tokens), 1, cache_ns=ns)
        if not self.node.bus.publish_now(entry):
            out.finish, out.ended_at = "error:coordinator_busy", self.sched.now
            return
        self.sched.at(out.deadline, self._deadline, rid)

    def on_crash(self) -> None:
        """Its clients see their connections drop (and every stage sees the coordinator's
        connections reset)."""
        for out in self.outcomes.values():
            if out.finish is None:
                out.finish, out.ended_at = "error:coordinator_crashed", self.sched.now

    def cancel(self, rid: str, finish: str = "cancelled") -> None:
        out = self.outcomes[rid]
        if out.finish is None and self.node is not None:
            out.finish, out.ended_at = finish, self.sched.now
            self.sched.trace("cancel", rid, finish)
            self.node.bus.publish_now(CancelRequest(rid, finish))

    def _deadline(self, rid: str) -> None:
        self.cancel(rid, "error:client_deadline")


class Intruder:
    """A host that sends what the scenario tells it to, straight onto the simulated network
    (it runs no mlxcel), and records what reaches it."""

    def __init__(self, identity: str, sched: Scheduler, net: SimNetwork, has_secret: bool) -> None:
        self.identity = identity
        self.sched = sched
        self.net = net
        self.up = True
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
