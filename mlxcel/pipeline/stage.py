"""A pipeline stage: runs one contiguous layer range for every sequence it was prepared for.

Authorization (by the authenticated source of each message):

* commands -- PrepareSequence, RunEntry, CancelRequest, ReleaseSequence, BeginDrain,
  Shutdown, QueryState -- only from the configured coordinator;
* activations only from the upstream stage;
* the identity that prepared a request id owns it here: a command for that id from anyone
  else is answered with Error and changes nothing; re-preparing discards older caches;
* results go to the owner (the authenticated source of PrepareSequence), never to an address
  named in a payload; other replies go to the authenticated source.

Tensors are bounded before anything is built from them: hidden states must be ``[1, n, width]``
float with ``n <= 2**20`` and ``width`` the model's. A bad activation is answered with an Error
carrying the exchange nonce, so the coordinator fails that request at once.

The last stage samples (the RunEntry's sampling parameters travel with the activation) and
returns token ids; with ``return_logits`` it returns the logits instead. A step marked
``sample=False`` is a prompt chunk that only fills caches: it is answered with no token.

Every MLX object of a stage -- caches, input arrays, samplers -- is created and used on the
stage's compute thread: MLX streams belong to the thread that made them (on GPUs, and on
CPUs for any op), so the reactor only ever holds plain bytes and ints.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import ipaddress
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from loguru import logger

from mlxcel.bus import Envelope, Node
from mlxcel.deadlines import deadline_in
from mlxcel.errors import MlxcelError
from mlxcel.messages import (
    Ack,
    Activation,
    BeginDrain,
    CancelRequest,
    Error,
    Message,
    PrepareSequence,
    QueryState,
    ReleaseSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    Shutdown,
    State,
    Tensor,
    Undecodable,
)
from mlxcel.net.network import Endpoint, SendFailed
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.model import LayerRange, merge_rows, split_row
from mlxcel.runtime.sampling import Sampler, make_sampler
from mlxcel.runtime.tensors import from_tensor, to_tensor

MAX_ACTIVATION_TOKENS = 1 << 20
OUTBOX_SIZE = 1024  # messages queued for one destination before they are dropped
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


class StageState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class StageConfig:
    node_id: str
    index: int
    n_stages: int
    coordinator: str  # identity; an unspecified IP ("0.0.0.0:port") accepts any IP on that port
    upstream: str | None = None
    downstream: str | None = None
    return_logits: bool = False
    reply_deadline: float = 30.0
    max_batch: int = 8  # decode steps of different sequences run as one forward
    warm_up_tokens: int = 512  # the prompt-chunk size, so its kernels compile before serving
    max_sequences: int = 256  # prepared sequences held at once (each holds KV caches)
    lease: float = 300.0  # a sequence untouched this long is freed (a lost ReleaseSequence)
    forward_timeout: float = 120.0  # one step on the compute thread; past it, its requests fail


@dataclass
class _Seq:
    owner: str
    max_len: int
    touched: float = 0.0  # loop time of the last command or step: the lease runs from here
    cache: list[Any] | None = None  # built on the compute thread at the first step
    sampler: Sampler | None = None
    sampling: SamplingParams | None = None
    tokens: int = 0


@dataclass
class _Work:
    """One step of one sequence waiting for the stage's worker (no MLX objects: plain data)."""

    seq: _Seq
    request_id: str
    micro_batch: int
    tokens: tuple[int, ...] | None  # the entry stage's input
    hidden: Tensor | None  # every other stage's input
    n: int
    sampling: SamplingParams
    nonce: int
    sample: bool = True
    compute_us: int = 0  # spent upstream on this step; this stage adds its own


@dataclass(frozen=True)
class _Failed:
    """One sequence's step failed while the rest of its batch completed."""

    code: str
    why: str


@dataclass
class StageStats:
    forwards: int = 0
    batches: int = 0
    largest_batch: int = 0
    discarded: int = 0  # queued steps dropped because their sequence was released
    compute_s: float = 0.0
    refused: int = 0
    errors: int = 0
    leases_expired: int = 0
    dropped: int = 0
    by_code: dict[str, int] = field(default_factory=dict)


class StageService:
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        layers: LayerRange,
        compute: ComputeThread,
        config: StageConfig,
    ) -> None:
        self.node = node
        self.endpoint = endpoint
        self.layers = layers
        self.compute = compute
        self.config = config
        self.width = layers.loaded.hidden_size
        self.vocab = int(layers.loaded.config["vocab_size"])
        self.state = StageState.SERVING
        self.seqs: dict[str, _Seq] = {}
        self.stats = StageStats()
        self.stopped = asyncio.Event()
        self._shutdown = False
        self._work: collections.deque[_Work] = collections.deque()
        self._outboxes: dict[str, asyncio.Queue[Any]] = {}
        self.limiter = WarningLimiter(asyncio.get_running_loop().time)
        self._wake = asyncio.Event()

    @property
    def is_first(self) -> bool:
        return self.config.index == 0

    @property
    def is_last(self) -> bool:
        return self.config.index == self.config.n_stages - 1

    def attach(self) -> None:
        bus = self.node.bus
        for cls, handler in (
            (PrepareSequence, self._on_prepare),
            (RunEntry, self._on_run_entry),
            (Activation, self._on_activation),
            (CancelRequest, self._on_release),
            (ReleaseSequence, self._on_release),
            (BeginDrain, self._on_drain),
            (Shutdown, self._on_shutdown),
            (QueryState, self._on_query),
            (Undecodable, self._on_undecodable),
        ):
            bus.subscribe(
                cls, handler, maxsize=256, name=f"stage{self.config.index}.{cls.__name__}"
            )
        self.node.spawn(self._worker(), name=f"stage{self.config.index}.worker", critical=True)
        self.node.spawn(self._sweep_leases(), name=f"stage{self.config.index}.leases")
        # Losing the coordinator (either direction) frees everything it holds here: nobody
        # is left to release it, and a drain must not wait for it.
        for side in ("pool", "listener"):
            conns = getattr(self.endpoint, side, None)
            if conns is not None:
                conns.on_lost.append(self._peer_lost)

    def _free(self, request_ids: list[str], why: str) -> None:
        for rid in request_ids:
            self.seqs.pop(rid, None)
        if request_ids:
            if why == "lease":
                self.stats.leases_expired += len(request_ids)
            logger.info(
                "stage {}: freed {} sequence(s) ({})", self.config.index, len(request_ids), why
            )
        self._maybe_stopped()

    def _peer_lost(self, identity: str) -> None:
        owned = [rid for rid, seq in self.seqs.items() if seq.owner == identity]
        self._free(owned, f"lost the connection to their owner {identity}")

    async def _sweep_leases(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self.config.lease / 4)))
            stale = loop.time() - self.config.lease
            busy = {w.request_id for w in self._work}
            idle = [r for r, q in self.seqs.items() if q.touched < stale and r not in busy]
            self._free(idle, "lease")

    async def warm_up(self) -> float:
        """Run a throwaway prompt chunk and decode step before serving; returns the seconds.

        A GPU compiles its kernels on first use (tens of seconds on a fresh machine); done
        here, that happens before the stage reports ready instead of inside the first
        request's step deadline.
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self.compute.run(self._warm_up)
        took = loop.time() - t0
        logger.info("stage {}: warmed up in {:.2f}s", self.config.index, took)
        return took

    def _warm_up(self) -> None:
        cache = self.layers.make_batch_cache()
        dtype = self.layers.dtype
        for n in (self.config.warm_up_tokens, 1):
            if self.is_first:
                x = mx.zeros((1, n), dtype=mx.int32)
            else:
                x = mx.zeros((1, n, self.width), dtype=dtype)
            h = self.layers(x, cache, head="last")
            if self.is_last:
                logits = h[:, -1, :]
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                h = mx.argmax(logprobs, axis=-1)
            mx.eval(h)

    # --- authorization --------------------------------------------------------------------
    def _is_coordinator(self, source: str) -> bool:
        want = self.config.coordinator
        if source == want:
            return True
        host, _, port = want.rpartition(":")
        try:
            unspecified = ipaddress.ip_address(host.strip("[]")).is_unspecified
        except ValueError:
            return False
        return unspecified and source.rpartition(":")[2] == port

    async def _refuse(
        self, env: Envelope[Any], code: str, why: str, request_id: str | None, nonce: int | None
    ) -> None:
        self.stats.refused += 1
        self.stats.by_code[code] = self.stats.by_code.get(code, 0) + 1
        self.limiter.warn(
            "router-drop",
            f"stage {self.config.index}: refusing {type(env.msg).__name__} "
            f"from {env.source}: {why}",
        )
        await self._send(env.source, Error(code, why, request_id, nonce))

    async def _send(
        self,
        dest: str,
        msg: Message,
        on_fail: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Queue ``msg`` for ``dest``; never waits on the network.

        Each known peer (the coordinator, the stages up- and downstream) has its own outbox
        and sender task, so a slow or dead destination delays only what goes to it -- never a
        handler, and so never a whole message class. Refusals to anyone else share one
        outbox with a short deadline. A full outbox drops the message and counts it.
        """
        known = dest in (self.config.upstream, self.config.downstream) or self._is_coordinator(dest)
        key = dest if known else "*"
        box = self._outboxes.get(key)
        if box is None:
            box = self._outboxes[key] = asyncio.Queue(OUTBOX_SIZE if known else 64)
            self.node.spawn(self._drain(box, known), name=f"stage{self.config.index}.out:{key}")
        try:
            box.put_nowait((dest, msg, on_fail))
        except asyncio.QueueFull:
            self.stats.dropped += 1
            self.limiter.warn(
                "router-drop",
                f"stage {self.config.index}: outbox for {dest} is full; "
                f"dropping a {type(msg).__name__}",
            )

    async def _drain(self, box: asyncio.Queue[Any], known: bool) -> None:
        budget = self.config.reply_deadline if known else 1.0
        while True:
            dest, msg, on_fail = await box.get()
            try:
                await self.endpoint.send(dest, msg, deadline_in(budget))
            except (SendFailed, MlxcelError) as exc:
                self.stats.dropped += 1
                self.limiter.warn(
                    "router-drop",
                    f"stage {self.config.index}: could not send {type(msg).__name__} "
                    f"to {dest}: {exc}",
                )
                if on_fail is not None:
                    await on_fail()
            finally:
                if not known:
                    # A refusal to someone who is not a peer of this stage travels on a
                    # one-off connection: addresses a member claims cannot pile up here.
                    self.endpoint.reset(dest)

    def _command_ok(self, env: Envelope[Any]) -> bool:
        return self._is_coordinator(env.source)

    async def _from_coordinator(
        self, env: Envelope[Any], request_id: str | None = None, nonce: int | None = None
    ) -> bool:
        """True for a command from the coordinator; anything else is refused with Error."""
        if self._command_ok(env):
            return True
        await self._refuse(
            env,
            "not_coordinator",
            "commands are accepted only from the coordinator",
            request_id,
            nonce,
        )
        return False

    # --- commands ---------------------------------------------------------------------------
    async def _on_prepare(self, env: Envelope[PrepareSequence]) -> None:
        m = env.msg
        if not await self._from_coordinator(env, m.request_id, m.nonce):
            return
        old = self.seqs.get(m.request_id)
        if old is not None and old.owner != env.source:
            await self._refuse(
                env,
                "not_owner",
                f"request {m.request_id!r} is owned by another identity",
                m.request_id,
                m.nonce,
            )
            return
        if self.state is not StageState.SERVING:
            await self._refuse(
                env, "draining", "stage is draining; no new sequences", m.request_id, m.nonce
            )
            return
        if old is None and len(self.seqs) >= self.config.max_sequences:
            await self._refuse(
                env,
                "too_many_sequences",
                f"stage holds its maximum of {self.config.max_sequences} sequences",
                m.request_id,
                m.nonce,
            )
            return
        # A fresh claim: whatever was cached under this id is discarded.
        self.seqs[m.request_id] = _Seq(env.source, m.max_len, asyncio.get_running_loop().time())
        await self._send(env.source, Ack(m.request_id, m.nonce))

    async def _on_release(self, env: Envelope[CancelRequest | ReleaseSequence]) -> None:
        m = env.msg
        seq = self.seqs.get(m.request_id)
        if not self._command_ok(env) or (seq is not None and seq.owner != env.source):
            await self._refuse(
                env,
                "not_owner",
                f"{type(m).__name__} for {m.request_id!r} from a non-owner",
                m.request_id,
                None,
            )
            return
        if seq is not None:
            del self.seqs[m.request_id]
            queued = sum(1 for w in self._work if w.seq is seq)
            if queued:
                self.stats.discarded += queued
                logger.info(
                    "stage {}: released {} ({} tokens cached); discarding {} queued step(s)",
                    self.config.index,
                    m.request_id,
                    seq.tokens,
                    queued,
                )
        self._maybe_stopped()

    async def _on_drain(self, env: Envelope[BeginDrain]) -> None:
        if not await self._from_coordinator(env):
            return
        self.begin_drain()
        await self._send(env.source, Ack("", 0))

    async def _on_shutdown(self, env: Envelope[Shutdown]) -> None:
        if not await self._from_coordinator(env):
            return
        logger.info("stage {}: shutdown requested by the coordinator", self.config.index)
        self.request_shutdown()

    async def _on_query(self, env: Envelope[QueryState]) -> None:
        if not await self._from_coordinator(env, None, env.msg.nonce):
            return
        wire = int(getattr(self.endpoint, "wire_bytes", 0))
        await self._send(
            env.source,
            State(
                self.config.node_id,
                (self.layers.start, self.layers.end),
                len(self.seqs),
                self.state is not StageState.SERVING,
                env.msg.nonce,
                wire,
                int(self.stats.compute_s * 1e6),
                self.stats.largest_batch,
            ),
        )

    def begin_drain(self) -> None:
        """Refuse new sequences; the ones in flight run to their end."""
        if self.state is StageState.SERVING:
            self.state = StageState.DRAINING
            logger.info(
                "stage {}: draining ({} sequences in flight)", self.config.index, len(self.seqs)
            )

    def request_shutdown(self) -> None:
        """Drain, then stop once the last sequence is released (``stopped`` is set)."""
        self.begin_drain()
        self._shutdown = True
        self._maybe_stopped()

    def _maybe_stopped(self) -> None:
        if self._shutdown and not self.seqs and self.state is not StageState.STOPPED:
            self.state = StageState.STOPPED
            self.stopped.set()

    # --- the data path ----------------------------------------------------------------------
    async def _on_run_entry(self, env: Envelope[RunEntry]) -> None:
        m = env.msg
        if not self.is_first:
            await self._refuse(
                env, "not_entry", "this stage is not the entry stage", m.request_id, m.nonce
            )
            return
        seq = self.seqs.get(m.request_id)
        if not self._command_ok(env) or seq is None or seq.owner != env.source:
            code = (
                "not_coordinator"
                if not self._command_ok(env)
                else ("not_prepared" if seq is None else "not_owner")
            )
            await self._refuse(
                env, code, f"RunEntry for {m.request_id!r} refused ({code})", m.request_id, m.nonce
            )
            return
        if not m.token_ids or seq.tokens + len(m.token_ids) > seq.max_len:
            await self._refuse(
                env,
                "bad_request",
                "token ids empty or beyond the prepared length",
                m.request_id,
                m.nonce,
            )
            return
        if m.start_pos != seq.tokens + sum(w.n for w in self._work if w.seq is seq):
            # The cache holds exactly the tokens before start_pos; anything else would
            # silently attend to the wrong history.
            await self._refuse(
                env,
                "bad_request",
                f"start_pos {m.start_pos} does not follow the "
                f"{seq.tokens} tokens cached for {m.request_id!r}",
                m.request_id,
                m.nonce,
            )
            return
        vocab = self.vocab
        if any(not 0 <= t < vocab for t in m.token_ids):
            await self._refuse(
                env, "bad_request", f"token id outside [0, {vocab})", m.request_id, m.nonce
            )
            return
        self._enqueue(
            _Work(
                seq,
                m.request_id,
                m.micro_batch,
                tuple(m.token_ids),
                None,
                len(m.token_ids),
                m.sampling,
                m.nonce,
                m.sample,
            )
        )

    async def _on_undecodable(self, env: Envelope[Undecodable]) -> None:
        """A message that failed to decode (a tensor whose bytes do not match its shape, an
        integer out of range): answer its exchange now instead of letting it time out."""
        m = env.msg
        seq = self.seqs.get(m.request_id) if m.request_id is not None else None
        err = Error(
            "bad_message",
            f"stage {self.config.index}: undecodable message (kind {m.kind}): {m.reason}",
            m.request_id,
            m.nonce,
        )
        self.stats.errors += 1
        if env.source == self.config.upstream and seq is not None:
            await self._send(seq.owner, err)  # a bad activation: its owner's exchange fails
        elif self._is_coordinator(env.source):
            await self._send(env.source, err)
        else:
            logger.warning(
                "stage {}: undecodable message from {}: {}", self.config.index, env.source, m.reason
            )

    def _check_hidden(self, t: Tensor) -> str | None:
        if t.dtype not in FLOAT_DTYPES:
            return f"hidden states must be float, got {t.dtype}"
        if len(t.shape) != 3 or t.shape[0] != 1:
            return f"hidden states must be [1, n, width], got {list(t.shape)}"
        if not 1 <= t.shape[1] <= MAX_ACTIVATION_TOKENS:
            return f"hidden states claim {t.shape[1]} tokens (1..{MAX_ACTIVATION_TOKENS})"
        if t.shape[2] != self.width:
            return f"hidden width {t.shape[2]} differs from the model's {self.width}"
        return None

    async def _on_activation(self, env: Envelope[Activation]) -> None:
        m = env.msg
        seq = self.seqs.get(m.request_id)
        if env.source != self.config.upstream:
            # Only the upstream stage feeds this one. Tell the owner if there is one to tell.
            self.limiter.warn(
                "router-drop",
                f"stage {self.config.index}: activation from {env.source} is not from the "
                "upstream stage",
            )
            self.stats.refused += 1
            if seq is not None:
                # Reported without the sender's nonce: a non-upstream sender must not be able
                # to fail a live exchange by guessing its nonce.
                await self._send(
                    seq.owner,
                    Error(
                        "not_upstream",
                        f"activation from {env.source} refused",
                        m.request_id,
                        None,
                    ),
                )
            return
        if seq is None:
            self.stats.dropped += 1
            self.limiter.warn(
                "router-drop",
                f"stage {self.config.index}: activation for unprepared request "
                f"{m.request_id[:64]!r}; dropped",
            )
            return
        problem = self._check_hidden(m.hidden)
        if problem is None and seq.tokens + m.hidden.shape[1] > seq.max_len:
            problem = "activation beyond the prepared length"
        if problem is not None:
            self.stats.errors += 1
            await self._send(seq.owner, Error("bad_activation", problem, m.request_id, m.nonce))
            return
        self._enqueue(
            _Work(
                seq,
                m.request_id,
                m.micro_batch,
                None,
                m.hidden,
                m.hidden.shape[1],
                m.sampling,
                m.nonce,
                m.sample,
                m.compute_us,
            )
        )

    def _enqueue(self, work: _Work) -> None:
        """Queue one step for the worker; steps queued together decode as one batch."""
        work.seq.touched = asyncio.get_running_loop().time()
        # Bounded by construction: each prepared sequence has at most one step in flight.
        self._work.append(work)
        self._wake.set()

    async def _worker(self) -> None:
        """Take everything queued; decode steps (one token each) run as one batched forward."""
        while True:
            if not self._work:
                self._wake.clear()
                await self._wake.wait()
                continue
            items = [w for w in self._work if self.seqs.get(w.request_id) is w.seq]
            self._work.clear()
            decode = [w for w in items if w.n == 1 and w.seq.tokens > 0][: self.config.max_batch]
            rest = [w for w in items if w not in decode]
            self._work.extend(w for w in rest[1:])  # prompts run one at a time, after this batch
            groups = ([decode] if decode else []) + ([[rest[0]]] if rest else [])
            for group in groups:
                try:
                    async with asyncio.timeout(self.config.forward_timeout):
                        outs, took = await asyncio.shield(
                            self.compute.run(self._timed_compute, group)
                        )
                except TimeoutError:
                    # The thread may still finish it; the requests cannot wait that long.
                    why = f"a step took longer than {self.config.forward_timeout:g}s"
                    await self._fail_group(group, "forward_timeout", why)
                    continue
                except Exception as exc:  # an execution failure is reported like a bad activation
                    logger.exception("stage {}: forward failed", self.config.index)
                    await self._fail_group(group, "forward_failed", str(exc))
                    continue
                self.stats.compute_s += took
                for w in group:  # each member waited for the whole batched forward
                    w.compute_us += int(took * 1e6)
                self.stats.forwards += len(group)
                self.stats.batches += 1
                self.stats.largest_batch = max(self.stats.largest_batch, len(group))
                for w, out in zip(group, outs, strict=True):
                    w.seq.tokens += w.n
                    if self.seqs.get(w.request_id) is not w.seq:
                        continue  # released while we computed
                    if isinstance(out, _Failed):
                        self.stats.errors += 1
                        err = Error(out.code, out.why, w.request_id, w.nonce)
                        await self._send(w.seq.owner, err)
                    else:
                        await self._deliver(w, out)

    async def _fail_group(self, group: list[_Work], code: str, why: str) -> None:
        self.stats.errors += len(group)
        for w in group:
            text = f"stage {self.config.index}: {why}"
            await self._send(w.seq.owner, Error(code, text, w.request_id, w.nonce))

    async def _deliver(self, w: _Work, out: Any) -> None:
        if not self.is_last:
            assert self.config.downstream is not None
            act = Activation(
                w.request_id, w.micro_batch, out, 0, w.sampling, w.nonce, w.sample, w.compute_us
            )

            async def tell_owner() -> None:
                await self._send(
                    w.seq.owner,
                    Error(
                        "downstream_unreachable",
                        f"stage {self.config.index} cannot reach {self.config.downstream}",
                        w.request_id,
                        w.nonce,
                    ),
                )

            await self._send(self.config.downstream, act, tell_owner)
            return
        result = RunResult(w.request_id, w.micro_batch, (), None, w.nonce, compute_us=w.compute_us)
        if not w.sample:  # a cache-filling prompt chunk: progress, no token
            pass
        elif self.config.return_logits:
            result = dataclasses.replace(result, logits=out)
        else:
            token, logprob = out
            lp = (logprob,) if w.sampling.logprobs else None
            result = dataclasses.replace(result, token_ids=(token,), logprobs=lp)
        await self._send(w.seq.owner, result)

    def _timed_compute(self, group: list[_Work]) -> tuple[list[Any], float]:
        """Compute thread: the step and how long it ran *on this thread*. Timed here, not on
        the reactor, so the hand-offs to and from the thread count as protocol overhead."""
        t0 = time.perf_counter()
        outs = self._compute(group)
        return outs, time.perf_counter() - t0

    def _compute(self, group: list[_Work]) -> list[Any]:
        """Compute thread: run the range for one step of each sequence in ``group``.

        Caches, inputs and samplers are made here, on the thread that evaluates them. One
        sequence runs on its own cache. Several (single-token decode steps) run as one batch:
        their caches are merged into mlx-lm's BatchKVCache (left-padded to a common length,
        with the matching attention mask), and split back afterwards.
        """
        for w in group:
            if w.seq.cache is None:
                w.seq.cache = self.layers.make_batch_cache()
        xs = [
            mx.array([list(w.tokens)], dtype=mx.int32)
            if w.tokens is not None
            else from_tensor(w.hidden)  # type: ignore[arg-type]
            for w in group
        ]
        head = "none" if not any(w.sample for w in group) else "all"
        if self.is_last and not self.config.return_logits and head != "none":
            head = "last"  # sampling needs the last position's logits only
        if len(group) == 1:
            w = group[0]
            h = self.layers(xs[0], w.seq.cache, head=head)
        else:
            n_layers = len(group[0].seq.cache)  # type: ignore[arg-type]
            batch = [
                merge_rows([w.seq.cache[i] for w in group])  # type: ignore[index]
                for i in range(n_layers)
            ]
            h = self.layers(mx.concatenate(xs, axis=0), batch, head=head)
            mx.eval(h)
            for row, w in enumerate(group):
                w.seq.cache = [split_row(c, row) for c in batch]
        if not self.is_last:
            mx.eval(h)
            return [to_tensor(h[row : row + 1]) for row in range(len(group))]
        if head == "none":
            mx.eval([c.state for w in group for c in w.seq.cache])  # type: ignore[union-attr]
            return [None] * len(group)
        if self.config.return_logits:
            mx.eval(h)
            return [to_tensor(h[row : row + 1].astype(mx.float32)) for row in range(len(group))]
        return [
            self._sample(w, h[row : row + 1, -1, :]) if w.sample else None
            for row, w in enumerate(group)
        ]

    @staticmethod
    def _sample(w: _Work, logits: mx.array) -> tuple[int, float] | _Failed:
        """Compute thread: one row's token; a failure here fails this sequence only."""
        seq = w.seq
        try:
            if seq.sampling is None:
                seq.sampling = w.sampling
                seq.sampler = make_sampler(w.sampling)
            # Exactly the one-process engine's arithmetic (mlx-lm's batch generator): normalise
            # in the model's dtype, then argmax or sample. In bf16 the normalisation rounds, so
            # skipping it would break near-ties differently.
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tok = seq.sampler(logprobs) if seq.sampler is not None else mx.argmax(logprobs, -1)
            mx.eval(tok, logprobs)
            t = int(tok.item())
            return t, float(logprobs[0, t].item())
        except Exception as exc:
            return _Failed("sampling_failed", f"sampling failed: {type(exc).__name__}: {exc}")
