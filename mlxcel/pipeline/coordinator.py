"""The pipeline coordinator node: the coordinator core on the bus, in the engine's place.

The Frontend publishes ``RunEntry`` and ``CancelRequest`` locally and gets one local
``RunResult`` per token back, exactly as from the one-process engine. The protocol -- the
exchanges, their nonces and deadlines, what is accepted from whom -- is
:class:`~mlxcel.pipeline.coordinator_core.CoordinatorCore`'s; this adapter moves messages
between the bus, the network and the core, and answers state queries for ``/health``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections import Counter
from collections.abc import Callable
from typing import Any

from loguru import logger

from mlxcel.base.defaults import PREFILL_STEP_SIZE
from mlxcel.base.effects import Answer, Deliver, Effect
from mlxcel.base.errors import BusError, MlxcelError, PipelineError
from mlxcel.base.messages import (
    EXTENDED_SAMPLING,
    Ack,
    Bundle,
    CancelRequest,
    Error,
    Progress,
    RunEntry,
    RunResult,
    SamplingParams,
    State,
    StepResult,
    Tensor,
    Undecodable,
)
from mlxcel.base.topology import Topology, pipeline_topology
from mlxcel.pipeline.coordinator_core import CoordinatorCore
from mlxcel.reactor.adapter import CoreAdapter, LocalOutbox
from mlxcel.reactor.bus import Node, Origin
from mlxcel.reactor.endpoint import Endpoint
from mlxcel.serving.frontend import Frontend
from mlxcel.serving.stack import Serving

__all__ = ["PipelineCoordinator", "PipelineError", "coordinator_serving"]

PROBE_INTERVAL = 1.0  # seconds between liveness probes of each stage
PROBE_TIMEOUT = 2.0  # a stage that does not answer a probe within this is down


def pick_token(logits: Tensor, sampling: SamplingParams, sampler: Any) -> tuple[int, Any]:
    """``--pp-return-logits``: sample the last position's logits here (the reference path)."""
    import mlx.core as mx

    from mlxcel.runtime.sampling import make_sampler
    from mlxcel.runtime.tensors import from_tensor

    last = from_tensor(logits)[:, -1, :]
    logprobs = last - mx.logsumexp(last, axis=-1, keepdims=True)
    if sampler is None:
        sampler = make_sampler(sampling) or (lambda lp: mx.argmax(lp, axis=-1))
    return int(sampler(logprobs).item()), sampler


def layer_text(layers: tuple[int, ...]) -> str:
    """A stage's (start, end) range as the one notation of logs, plans and /health: the
    first and the last layer, ``0-4`` (the TOML's ``layers`` and ``--pp-layers`` too)."""
    return f"{layers[0]}-{layers[1] - 1}" if len(layers) == 2 else str(list(layers))


class PipelineCoordinator(CoreAdapter):
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        stages: list[str],
        *,
        eos: set[int],
        vocab: int,
        max_len: int,
        step_timeout: float = 30.0,
        return_logits: bool = False,
        max_sequences: int = 64,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        micro_batch_size: int | None = None,
        stage_max_batch: int | None = None,
        first_nonce: int | None = None,
        prompt_cache_tokens: int = 0,
        first_entry: int | None = None,
    ) -> None:
        core = CoordinatorCore(
            stages,
            eos=eos,
            vocab=vocab,
            max_len=max_len,
            step_timeout=step_timeout,
            return_logits=return_logits,
            max_in_flight=max_sequences,
            micro_batch_size=micro_batch_size,
            stage_max_batch=stage_max_batch,
            prefill_step_size=prefill_step_size,
            pick_token=pick_token if return_logits else None,
            # Unpredictable per process (the simulator draws it from its seed).
            first_nonce=secrets.randbits(48) + 1 if first_nonce is None else first_nonce,
            prompt_cache_tokens=prompt_cache_tokens,
            first_entry=secrets.randbits(48) + 1 if first_entry is None else first_entry,
        )
        super().__init__(node, endpoint, core, "coordinator", step_timeout)
        self.coord = core
        self.stages = core.stages
        self.max_sequences = max_sequences
        self._answers: dict[int, asyncio.Future[Any]] = {}
        self._last_seen: dict[str, dict[str, Any]] = {}  # stage -> id and layers it reported
        # What the background probe last learned of each stage: /health answers from this,
        # never by waiting on a stage.
        self._view: dict[str, dict[str, Any]] = {}
        self._seen_at: dict[str, float] = {}  # when each stage last answered a probe
        self.probe_interval = PROBE_INTERVAL
        self._probing = False
        self._local = LocalOutbox(node, "coordinator")

    # What /health, the CLI and tests read.
    @property
    def active(self) -> int:
        return self.coord.active

    @property
    def dropped(self) -> Counter[str]:
        return self.coord.dropped

    @property
    def steps(self) -> int:
        return self.coord.steps

    def decode_overhead_ms(self) -> float:
        return self.coord.decode_overhead_ms()

    def attach(self) -> None:
        # RunEntry/CancelRequest from anywhere reach the core, which drops non-local ones
        # (counted); replies are heard only from the network, so the core's own local results
        # to the frontend never come back to it.
        self.subscribe([RunEntry, CancelRequest], Origin.ANY, maxsize=max(self.max_sequences, 256))
        self.subscribe(
            [RunResult, StepResult, Ack, State, Progress, Error, Undecodable, Bundle],
            Origin.REMOTE,
            maxsize=1024,
        )
        self.bundles = True
        self._local.start()
        self.start()

    def start_probing(self) -> None:
        """Ask every stage for its state once per ``probe_interval`` (a round trip through its
        core); a stage that does not answer within PROBE_TIMEOUT is down: its requests fail
        and new ones are refused at once until it answers again."""
        self._probing = True
        self.node.spawn(self._probe_loop(), name="coordinator.probe")

    def _peer_lost(self, identity: str) -> None:
        super()._peer_lost(identity)
        if self._probing and identity in self.stages:  # gone, or a glitch? ask now
            try:
                self.node.spawn(self._probe(identity), name="coordinator.probe-now")
            except BusError:
                pass  # shutting down: its connections close, nothing to probe

    async def _probe_loop(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._probe(s) for s in self.stages))
            except Exception:  # a bug must not end the probing: nothing would clear `down`
                logger.exception("coordinator: stage probe failed")
            await asyncio.sleep(self.probe_interval)

    async def _probe(self, stage: str, judge: bool = True) -> None:
        """Down only when the stage answers nothing for all of PROBE_TIMEOUT: a query that
        fails early (a connection that just dropped, redialled) is asked again. ``judge``
        False: only refresh what /health shows (stages in this process are never down)."""
        end = self.now() + PROBE_TIMEOUT
        st: State | None = None
        why = ""
        while st is None and self.now() < end:
            try:
                st = await self.query(stage, timeout=max(0.05, end - self.now()), reset=False)
            except (PipelineError, MlxcelError) as exc:
                why = str(exc)
                await asyncio.sleep(min(0.1, max(0.0, end - self.now())))
        if st is None:
            known = self._last_seen.get(stage, {})
            self._view[stage] = {"address": stage, **known, "error": why}
            if judge:
                self.feed(self.coord.stage_health(stage, False, why, self.now()))
            return
        self._last_seen[stage] = {"id": st.node_id, "layers": layer_text(st.layers)}
        self._seen_at[stage] = self.now()
        self._view[stage] = {
            "address": stage,
            "id": st.node_id,
            "layers": layer_text(st.layers),  # "0-4": first and last, as everywhere
            "sequences": st.sequences,
            "draining": st.draining,
            "wire_bytes_out": st.wire_bytes_out,
            "largest_batch": st.largest_batch,
            "kv_tokens": st.kv_tokens,
            "kv_capacity": st.kv_capacity,
        }
        if judge:
            detail = f"{st.node_id}, layers {layer_text(st.layers)}"
            self.feed(self.coord.stage_health(stage, True, "", self.now(), detail))

    def redact(self, text: str) -> str:
        """``text`` with every stage address replaced by the stage's name (what an HTTP client
        may see; the log keeps the addresses)."""
        for i, stage in enumerate(self.stages):
            name = self._last_seen.get(stage, {}).get("id") or f"stage-{i}"
            text = text.replace(f"stage {stage}", name).replace(stage, name)
        return text

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, Deliver):
            msg = effect.msg
            if isinstance(msg, Error):  # the client learns which stage, never its address
                msg = dataclasses.replace(msg, message=self.redact(msg.message))
            self._local.put(msg)
        elif isinstance(effect, Answer):
            fut = self._answers.pop(effect.token, None)
            if fut is not None and not fut.done():
                if isinstance(effect.value, BaseException):
                    fut.set_exception(effect.value)
                else:
                    fut.set_result(effect.value)
        else:
            super().apply(effect)

    # --- state queries ------------------------------------------------------------------------
    async def query(self, stage: str, timeout: float, reset: bool = True) -> State:
        token, effects = self.coord.query(stage, self.now(), timeout, reset)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._answers[token] = fut
        self.feed(effects)
        try:
            return await fut
        finally:
            self._answers.pop(token, None)

    async def query_states(self, timeout: float = 10.0) -> list[State]:
        """Ask every stage for its State (also proves each connection authenticates)."""
        states = list(await asyncio.gather(*(self.query(s, timeout) for s in self.stages)))
        for stage, st in zip(self.stages, states, strict=True):
            self._last_seen[stage] = {"id": st.node_id, "layers": layer_text(st.layers)}
        return states

    async def health(self, verbose: bool = False) -> dict[str, Any]:
        """Per-stage state for /health, from the background probe (answered at once, never
        by waiting on a stage): reachability, layers, sequences held, draining. Stage
        addresses only when ``verbose``. In one process (nothing probes: no network lies
        between the stages) it asks them now."""
        if not self._probing:
            await asyncio.gather(*(self._probe(s, judge=False) for s in self.stages))
        out = []
        for i, stage in enumerate(self.stages):
            view = dict(
                self._view.get(stage) or {"address": stage, **self._last_seen.get(stage, {})}
            )
            if stage in self.coord.down:
                view["error"] = self.coord.down[stage]
            if stage in self._seen_at:
                view["last_seen_s"] = round(self.now() - self._seen_at[stage], 2)
            if not verbose:
                view.pop("address", None)
                view.setdefault("id", f"stage-{i}")
                if "error" in view:
                    view["error"] = self.redact(view["error"])
            out.append(view)
        ready = not self.coord.down and all(
            "error" not in st and not st.get("draining") for st in out
        )
        c = self.coord
        return {
            "ready": ready,
            "pipeline": {
                "stages": out,
                "active": c.active,
                "max_in_flight": c.max_in_flight,
                "micro_batch_size": c.micro_batch_size,
                "peak_in_flight": c.peak_in_flight,
                "completed": c.completed,
                "failed": c.failed,
                "steps": c.steps,
                "decode_steps": c.decode_steps,
                "decode_overhead_ms": round(c.decode_overhead_ms(), 3),
                "kept_alive": c.kept_alive,
                "dropped": dict(c.dropped),
                "wire_bytes_out": self.endpoint.wire_bytes,
            },
        }


def coordinator_serving(
    node: Node,
    fe: Frontend,
    coordinator: PipelineCoordinator,
    return_logits: bool,
    verbose: Callable[[], bool] = lambda: False,
) -> Serving:
    """What a runner serves for a pipeline's coordinator, in-process or remote. ``verbose``
    (read per request): stage addresses in /health."""

    async def topology() -> Topology:
        return pipeline_topology(await coordinator.health(verbose=False))

    return Serving(
        node,
        fe,
        lambda: coordinator.active,
        lambda: coordinator.health(verbose()),
        # The final stage samples with every parameter (processors, top_logprobs); with
        # --pp-return-logits the coordinator samples the returned logits itself, plainly.
        sampling=frozenset() if return_logits else EXTENDED_SAMPLING,
        label="pipeline",
        topology=topology,
        prompt_cache=None if (index := coordinator.coord.prefixes) is None else index.stats,
    )
