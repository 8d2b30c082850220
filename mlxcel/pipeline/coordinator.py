"""The pipeline coordinator: turns each local RunEntry into a sequence of stage exchanges.

It takes the engine's place on the serving node's bus: the Frontend publishes ``RunEntry``
and ``CancelRequest`` locally, and gets one local ``RunResult`` per token back. For each
request the coordinator prepares the sequence on every stage (each answers Ack), then per
step sends one RunEntry to the entry stage and waits for the RunResult of that exchange from
the final stage -- three frames per decoded token. When the request ends for any reason, the
sequence is released on every stage.

The prompt runs as mlx-lm's batch generator runs it: all tokens but the last in chunks of
``prefill_chunk`` that only fill the stages' caches (``sample=False``, answered with an empty
RunResult), then the last token as the first sampling step -- so each exchange's deadline
bounds one chunk of work, not the whole prompt, the stages run other sequences' decode steps
between chunks, and the arithmetic (shapes included) is the one-process engine's. At most
``max_in_flight`` sequences are in the stages at once; later requests wait for one to finish
(within their own deadline).

What it accepts from the network: Ack/State only from the stage it addressed, RunResult only
from the final stage and only with the fresh nonce of the exchange that is waiting, for the
same request and micro-batch (and, with ``return_logits``, logits of shape
``[1, seq_len, vocab]``); Error carrying a waiting exchange's nonce from any stage of the
pipeline (a stage downstream reports a bad activation that way). Everything else is dropped
and counted while the exchange keeps waiting on its absolute deadline.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from loguru import logger

from mlxcel.bus import LOCAL, Envelope, Node
from mlxcel.deadlines import deadline_in, until
from mlxcel.errors import DeadlineExceeded, MlxcelError
from mlxcel.messages import (
    Ack,
    CancelRequest,
    Error,
    Message,
    PrepareSequence,
    QueryState,
    ReleaseSequence,
    RunEntry,
    RunResult,
    State,
    Undecodable,
)
from mlxcel.net.network import Endpoint, SendFailed
from mlxcel.net.ratelimit import WarningLimiter


class PipelineError(MlxcelError):
    """A pipeline exchange failed (stage error, unreachable stage, deadline)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Exchange:
    kind: type[Message]  # what answers it: Ack, State or RunResult
    dest: str  # the stage addressed (Ack/State must come from it)
    request_id: str
    micro_batch: int
    future: asyncio.Future[Any]
    seq_len: int = 0
    tokens: int = 1  # a RunResult's token count: 0 for a cache-filling prompt chunk


class PipelineCoordinator:
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
        prefill_chunk: int = 512,
        max_in_flight: int | None = None,
    ) -> None:
        self.node = node
        self.endpoint = endpoint
        self.stages = stages
        self.eos = eos
        self.vocab = vocab
        self.max_len = max_len
        self.step_timeout = step_timeout
        self.return_logits = return_logits
        self.max_sequences = max_sequences
        self.prefill_chunk = prefill_chunk
        self.max_in_flight = max_in_flight or max_sequences
        self._in_flight = asyncio.Semaphore(self.max_in_flight)
        self.peak_in_flight = 0
        self._held = 0
        self._last_seen: dict[str, dict[str, Any]] = {}  # stage -> id and layers it reported
        self.limiter = WarningLimiter(asyncio.get_running_loop().time)
        # Decode steps (one token in, one out), measured at the hand-offs: wall time from
        # sending the RunEntry to receiving its RunResult, and the compute time the stages
        # report for that same step. Their difference is what the protocol costs.
        self.decode_steps = 0
        self.decode_wall_s = 0.0
        self.decode_compute_s = 0.0
        self._nonces = itertools.count(1)
        self._exchanges: dict[int, _Exchange] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Keyed by a fixed reason (never by peer-supplied text), so it cannot grow unbounded.
        self.dropped: Counter[str] = Counter()
        self.completed = 0
        self.failed = 0
        self.steps = 0

    @property
    def final(self) -> str:
        return self.stages[-1]

    @property
    def active(self) -> int:
        return len(self._tasks)

    def attach(self) -> None:
        # Either direction lost is the stage lost: our connection to it (pool) and its
        # connection to us, which carries its replies (listener).
        for side in ("pool", "listener"):
            conns = getattr(self.endpoint, side, None)
            if conns is not None:
                conns.on_lost.append(self._stage_lost)
        bus = self.node.bus
        bus.subscribe(
            RunEntry, self._on_local_entry, maxsize=self.max_sequences, name="coordinator.entry"
        )
        bus.subscribe(CancelRequest, self._on_local_cancel, maxsize=256, name="coordinator.cancel")
        bus.subscribe(RunResult, self._on_result, maxsize=1024, name="coordinator.results")
        bus.subscribe(Ack, self._on_reply, maxsize=1024, name="coordinator.acks")
        bus.subscribe(State, self._on_reply, maxsize=256, name="coordinator.state")
        bus.subscribe(Error, self._on_error, maxsize=1024, name="coordinator.errors")
        bus.subscribe(
            Undecodable, self._on_undecodable, maxsize=256, name="coordinator.undecodable"
        )

    # --- inbound checks ------------------------------------------------------------------------
    def _drop(self, why: str, env: Envelope[Any], detail: str = "") -> None:
        self.dropped[why] += 1
        self.limiter.warn(
            "router-drop",
            f"coordinator: dropping {type(env.msg).__name__} from {env.source}: {why}"
            + (f" ({detail})" if detail else ""),
        )

    async def _on_result(self, env: Envelope[RunResult]) -> None:
        if env.source == LOCAL:
            return  # our own result to the frontend
        m = env.msg
        if env.source != self.final:
            self._drop("not from the final stage", env)
            return
        ex = self._exchanges.get(m.nonce)
        if ex is None or ex.kind is not RunResult:
            self._drop("stale or unknown nonce", env)
            return
        if ex.request_id != m.request_id or ex.micro_batch != m.micro_batch:
            self._drop("request or micro-batch does not match the exchange", env)
            return
        if ex.tokens == 0:
            if m.token_ids or m.logits is not None:
                self._drop("a prompt-chunk RunResult carries no token and no logits", env)
                return
        elif self.return_logits:
            t = m.logits
            if t is None or t.shape != (1, ex.seq_len, self.vocab):
                shape = None if t is None else list(t.shape)
                self._drop(
                    "logits of the wrong shape",
                    env,
                    f"{shape}, expected [1, {ex.seq_len}, {self.vocab}]",
                )
                return
        elif len(m.token_ids) != 1:
            self._drop("a sampled RunResult carries exactly one token", env)
            return
        del self._exchanges[m.nonce]
        if not ex.future.done():
            ex.future.set_result(m)

    async def _on_reply(self, env: Envelope[Ack | State]) -> None:
        if env.source == LOCAL:
            return
        ex = self._exchanges.get(env.msg.nonce)
        if ex is None or ex.kind is not type(env.msg):
            self._drop("stale or unknown nonce", env)
            return
        if env.source != ex.dest:
            self._drop("not from the stage the exchange addressed", env, ex.dest)
            return
        del self._exchanges[env.msg.nonce]
        if not ex.future.done():
            ex.future.set_result(env.msg)

    async def _on_error(self, env: Envelope[Error]) -> None:
        if env.source == LOCAL:
            return
        m = env.msg
        ex = self._exchanges.get(m.nonce) if m.nonce is not None else None
        if (
            ex is None
            or env.source not in self.stages
            or ex.request_id != (m.request_id or ex.request_id)
        ):
            self._drop("unmatched error", env, f"{m.code}: {m.message[:200]}")
            return
        if ex.kind is not RunResult and env.source != ex.dest:
            self._drop("not from the stage the exchange addressed", env, ex.dest)
            return
        del self._exchanges[m.nonce]
        if not ex.future.done():
            ex.future.set_exception(PipelineError(m.code, f"{env.source}: {m.message}"))

    async def _on_undecodable(self, env: Envelope[Undecodable]) -> None:
        """A stage's answer that failed to decode fails its exchange now (not at the deadline)."""
        m = env.msg
        why = f"undecodable message (kind {m.kind}): {m.reason}"
        await self._on_error(Envelope(Error("bad_message", why, m.request_id, m.nonce), env.source))

    def _stage_lost(self, address: str) -> None:
        """A stage connection closed: every exchange that needs that stage fails now."""
        if address not in self.stages:
            return
        for nonce, ex in list(self._exchanges.items()):
            if ex.kind is RunResult or ex.dest == address:
                del self._exchanges[nonce]
                if not ex.future.done():
                    ex.future.set_exception(
                        PipelineError(
                            "stage_unreachable", f"lost the connection to stage {address}"
                        )
                    )

    # --- exchanges -----------------------------------------------------------------------------
    async def exchange(
        self,
        dest: str,
        msg_for: Any,
        kind: type[Message],
        request_id: str,
        micro_batch: int = 0,
        seq_len: int = 0,
        timeout: float | None = None,
        tokens: int = 1,
        reset: bool = True,
    ) -> Any:
        """Send ``msg_for(nonce)`` to ``dest`` and wait for its matching answer."""
        nonce = next(self._nonces)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._exchanges[nonce] = _Exchange(
            kind, dest, request_id, micro_batch, fut, seq_len, tokens
        )
        budget = timeout or self.step_timeout
        deadline = deadline_in(budget)
        if kind is RunResult:
            what = f"no result for {request_id} from the pipeline ({dest} -> {self.final})"
        else:
            what = f"no {kind.__name__} from {dest} for {request_id or 'a query'}"
        try:
            await self.endpoint.send(dest, msg_for(nonce), deadline)
            async with until(deadline, f"{what} within {budget:g}s"):
                return await fut
        except SendFailed as exc:
            raise PipelineError("stage_unreachable", str(exc)) from None
        except DeadlineExceeded:
            # A stream that missed a deadline may be wedged mid-frame: replace it, so the
            # next request dials afresh instead of waiting out its own deadline too. (Not for
            # a health probe's short deadline: a busy stage is not a wedged one.)
            if reset:
                logger.warning("coordinator: {}; resetting the connections to {}", what, dest)
                self.endpoint.reset(dest)
            raise
        finally:
            self._exchanges.pop(nonce, None)

    async def query_states(self, timeout: float = 10.0) -> list[State]:
        """Ask every stage for its State (also proves each connection authenticates)."""
        states = list(
            await asyncio.gather(
                *(
                    self.exchange(s, lambda n: QueryState(n), State, "", timeout=timeout)
                    for s in self.stages
                )
            )
        )
        for stage, st in zip(self.stages, states, strict=True):
            self._last_seen[stage] = {"id": st.node_id, "layers": list(st.layers)}
        return states

    async def health(self) -> dict[str, Any]:
        """Per-stage state for /health: reachability, layers, sequences held, draining."""

        async def one(stage: str) -> dict[str, Any]:
            try:
                st = await self.exchange(
                    stage, lambda n: QueryState(n), State, "", timeout=1.0, reset=False
                )
            except (PipelineError, MlxcelError) as exc:
                # What it last said about itself, so a dashboard still knows which one it is.
                known = self._last_seen.get(stage, {})
                return {"address": stage, **known, "error": str(exc)}
            self._last_seen[stage] = {"id": st.node_id, "layers": list(st.layers)}
            return {
                "address": stage,
                "id": st.node_id,
                "layers": list(st.layers),  # [start, end): end exclusive
                "sequences": st.sequences,
                "draining": st.draining,
                "wire_bytes_out": st.wire_bytes_out,
                "largest_batch": st.largest_batch,
            }

        # All stages at once, each bounded: a load balancer gets its answer within ~1 s.
        out = list(await asyncio.gather(*(one(s) for s in self.stages)))
        ready = all("error" not in st and not st["draining"] for st in out)
        return {
            "ready": ready,
            "pipeline": {
                "stages": out,
                "active": self.active,
                "max_in_flight": self.max_in_flight,
                "peak_in_flight": self.peak_in_flight,
                "completed": self.completed,
                "failed": self.failed,
                "steps": self.steps,
                "decode_steps": self.decode_steps,
                "decode_overhead_ms": round(self.decode_overhead_ms(), 3),
                "dropped": dict(self.dropped),
                "wire_bytes_out": int(getattr(self.endpoint, "wire_bytes", 0)),
            },
        }

    def decode_overhead_ms(self) -> float:
        """Mean protocol time per decode step: wall time minus the stages' compute for it."""
        if not self.decode_steps:
            return 0.0
        return 1e3 * (self.decode_wall_s - self.decode_compute_s) / self.decode_steps

    # --- the local side -------------------------------------------------------------------------
    async def _on_local_entry(self, env: Envelope[RunEntry]) -> None:
        if env.source != LOCAL:
            self._drop("RunEntry is only accepted from this node's frontend", env)
            return
        m = env.msg
        if m.request_id in self._tasks:
            await self._local(
                Error("bad_request", "request id already running", m.request_id, m.nonce)
            )
            return
        self._tasks[m.request_id] = self.node.spawn(self._drive(m), name=f"pipeline:{m.request_id}")

    async def _on_local_cancel(self, env: Envelope[CancelRequest]) -> None:
        if env.source != LOCAL:
            self._drop("CancelRequest is only accepted from this node's frontend", env)
            return
        task = self._tasks.get(env.msg.request_id)
        if task is not None:
            task.cancel()

    async def _local(self, msg: Message) -> None:
        await self.node.bus.publish(msg, deadline=deadline_in(30))

    async def _drive(self, entry: RunEntry) -> None:
        rid = entry.request_id
        admitted = False
        try:
            await self._in_flight.acquire()
            admitted = True
            self._held += 1
            self.peak_in_flight = max(self.peak_in_flight, self._held)
            await self._run(entry)
            self.completed += 1
        except asyncio.CancelledError:
            pass  # the frontend cancelled (client gone, stop string): release below
        except (PipelineError, DeadlineExceeded) as exc:
            self.failed += 1
            code = exc.code if isinstance(exc, PipelineError) else "deadline_exceeded"
            logger.warning("coordinator: request {} failed: {}", rid, exc)
            await self._local(Error(code, str(exc), rid, entry.nonce))
        finally:
            self._tasks.pop(rid, None)
            if admitted:
                self._held -= 1
                self._in_flight.release()
                await self._release_everywhere(rid)

    async def _run(self, entry: RunEntry) -> None:
        rid = entry.request_id
        p = entry.sampling
        total = len(entry.token_ids) + p.max_tokens
        if any(not 0 <= t < self.vocab for t in entry.token_ids) or not entry.token_ids:
            raise PipelineError(
                "bad_request",
                f"prompt empty or token id outside the vocabulary [0, {self.vocab})",
            )
        if total > self.max_len:
            raise PipelineError(
                "bad_request",
                f"prompt ({len(entry.token_ids)} tokens) + max_tokens "
                f"({p.max_tokens}) exceeds the model's context of {self.max_len}",
            )
        await asyncio.gather(
            *(
                self.exchange(s, lambda n: PrepareSequence(rid, total, n), Ack, rid)
                for s in self.stages
            )
        )
        # As mlx-lm's batch generator does: every prompt token but the last fills caches in
        # chunks; the last one runs as the first decode step. Same shapes, same numerics.
        prefix, tokens = entry.token_ids[:-1], entry.token_ids[-1:]
        pos = 0
        chunk = self.prefill_chunk
        while prefix:
            piece, prefix = prefix[:chunk], prefix[chunk:]
            await self.exchange(
                self.stages[0],
                lambda n, t=piece, q=pos: RunEntry(
                    rid, entry.micro_batch, t, q, p, n, sample=False
                ),
                RunResult,
                rid,
                entry.micro_batch,
                seq_len=len(piece),
                tokens=0,
            )
            self.steps += 1
            pos += len(piece)
        generated = 0
        sampler = None
        loop = asyncio.get_running_loop()
        while True:
            step_tokens = tokens
            t0 = loop.time()
            res: RunResult = await self.exchange(
                self.stages[0],
                lambda n, t=step_tokens, q=pos: RunEntry(rid, entry.micro_batch, t, q, p, n),
                RunResult,
                rid,
                entry.micro_batch,
                seq_len=len(step_tokens),
            )
            self.steps += 1
            self.decode_steps += 1
            self.decode_wall_s += loop.time() - t0
            self.decode_compute_s += res.compute_us / 1e6
            if self.return_logits:
                token, sampler = self._sample_logits(res, p, sampler)
                lp = None
            else:
                token = res.token_ids[0]
                lp = res.logprobs
            pos += len(step_tokens)
            generated += 1
            if token in self.eos:
                await self._local(RunResult(rid, entry.micro_batch, (), "stop", entry.nonce))
                break
            finish = "length" if generated >= p.max_tokens else None
            await self._local(
                RunResult(rid, entry.micro_batch, (token,), finish, entry.nonce, logprobs=lp)
            )
            if finish:
                break
            tokens = (token,)

    def _sample_logits(self, res: RunResult, p: Any, sampler: Any) -> tuple[int, Any]:
        import mlx.core as mx

        from mlxcel.runtime.sampling import make_sampler
        from mlxcel.runtime.tensors import from_tensor

        assert res.logits is not None
        logits = from_tensor(res.logits)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if sampler is None:
            sampler = make_sampler(p) or (lambda lp: mx.argmax(lp, axis=-1))
        return int(sampler(logprobs).item()), sampler

    async def _release_everywhere(self, rid: str) -> None:
        async def one(stage: str) -> None:
            try:
                await self.endpoint.send(stage, ReleaseSequence(rid), deadline_in(5))
            except (SendFailed, MlxcelError) as exc:
                logger.debug("coordinator: release of {} on {} failed: {}", rid, stage, exc)

        await asyncio.shield(asyncio.gather(*(one(s) for s in self.stages)))
