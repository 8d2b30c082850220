"""The coordinator protocol's tables and records: a request's states, its exchanges.

``REQ_TABLE`` is one request's life on the coordinator: WAITING (for an in-flight slot) ->
PREPARING (Acks outstanding) -> PREFILL (a prompt chunk in the pipeline) / DECODE (a sampling
step in the pipeline) -> DONE (finished, failed or cancelled). An event that is not in the
table raises from the lookup.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mlxcel.base.effects import Effect, Send
from mlxcel.base.fsm import Table
from mlxcel.base.messages import (
    MAX_STEP_ROWS,
    ErrorCode,
    Message,
    PrepareSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    StepEntry,
    StepResult,
    Tensor,
    prompt_problem,
)
from mlxcel.base.prefix_index import Hit

PENALTY_CONTEXT = 20  # prompt tokens the final stage's penalties look back on (mlx-lm's)


class ReqState(enum.Enum):
    WAITING = "waiting"
    PREPARING = "preparing"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class ReqEvent(enum.Enum):
    ADMIT = "admit"
    ACK = "ack"
    SEND_CHUNK = "send_chunk"
    SEND_STEP = "send_step"
    RESULT = "result"
    FINISH = "finish"
    FAIL = "fail"
    CANCEL = "cancel"


_LIVE = (ReqState.WAITING, ReqState.PREPARING, ReqState.PREFILL, ReqState.DECODE)
REQ_TABLE: Table[ReqState, ReqEvent] = Table(
    "coordinator request",
    {
        (ReqState.WAITING, ReqEvent.ADMIT): ReqState.PREPARING,
        (ReqState.PREPARING, ReqEvent.ACK): ReqState.PREPARING,
        (ReqState.PREPARING, ReqEvent.SEND_CHUNK): ReqState.PREFILL,
        (ReqState.PREPARING, ReqEvent.SEND_STEP): ReqState.DECODE,
        (ReqState.PREFILL, ReqEvent.RESULT): ReqState.PREFILL,
        (ReqState.PREFILL, ReqEvent.SEND_CHUNK): ReqState.PREFILL,
        (ReqState.PREFILL, ReqEvent.SEND_STEP): ReqState.DECODE,
        (ReqState.DECODE, ReqEvent.RESULT): ReqState.DECODE,
        (ReqState.DECODE, ReqEvent.SEND_STEP): ReqState.DECODE,
        (ReqState.DECODE, ReqEvent.FINISH): ReqState.DONE,
        **{(s, ReqEvent.FAIL): ReqState.DONE for s in _LIVE},
        **{(s, ReqEvent.CANCEL): ReqState.DONE for s in _LIVE},
    },
    {},
    ErrorCode.BAD_REQUEST,
)

# Turns a logits RunResult into a token (``--pp-return-logits``): (logits, sampling, state)
# -> (token, state). Injected, so the core stays free of MLX.
PickToken = Callable[[Tensor, SamplingParams, Any], tuple[int, Any]]


@dataclass
class Exchange:
    kind: type[Message]  # what answers it: Ack, State or RunResult
    dest: str  # the stage addressed (Ack/State must come from it)
    request_id: str  # "" for a state query
    micro_batch: int
    deadline: float
    seq_len: int = 0
    tokens: int = 1  # a RunResult's token count: 0 for a cache-filling prompt chunk
    sent_at: float = 0.0
    reset: bool = True  # a missed deadline replaces the connections (not for health probes)
    kept: bool = False  # a stage's Progress carried it past a deadline it would have missed
    reported: bool = False  # a stage's Progress restarted its deadline


class Exchanges:
    """The exchanges in flight by nonce, with their deadlines on a heap (an entry of a closed
    exchange lingers until it comes up; one that a stage's Progress extended goes back on at
    its new deadline, once per exchange)."""

    def __init__(self, first_nonce: int, step_timeout: float) -> None:
        self.by_nonce: dict[int, Exchange] = {}
        self.deadlines: list[tuple[float, int]] = []
        # A restarted coordinator must not reuse its predecessor's nonces (a stage that missed
        # the restart would take them for copies): the adapter starts from a random point.
        self._nonces = itertools.count(first_nonce)
        self.step_timeout = step_timeout
        self.kept_alive = 0  # exchanges a stage's Progress carried past a missed deadline

    def open(self, kind: type[Message], dest: str, rid: str, micro_batch: int, now: float,
             seq_len: int = 0, tokens: int = 1, timeout: float | None = None,
             reset: bool = True) -> int:  # fmt: skip
        nonce = next(self._nonces)
        deadline = now + (timeout or self.step_timeout)
        self.by_nonce[nonce] = Exchange(
            kind, dest, rid, micro_batch, deadline, seq_len, tokens, now, reset
        )
        heapq.heappush(self.deadlines, (deadline, nonce))
        return nonce

    def missed(self, now: float) -> Iterator[tuple[int, Exchange]]:
        """The open exchanges whose deadline has passed (each once; still open)."""
        while self.deadlines and self.deadlines[0][0] <= now:
            _, nonce = heapq.heappop(self.deadlines)
            ex = self.by_nonce.get(nonce)
            if ex is None:
                continue
            if ex.deadline > now:  # extended by a stage's Progress: one entry per exchange
                self.kept_alive += not ex.kept
                ex.kept = True
                heapq.heappush(self.deadlines, (ex.deadline, nonce))
                continue
            yield nonce, ex

    def next_deadline(self) -> float | None:
        while self.deadlines and self.deadlines[0][1] not in self.by_nonce:
            heapq.heappop(self.deadlines)
        return self.deadlines[0][0] if self.deadlines else None


@dataclass
class Req:
    entry: RunEntry
    state: ReqState = ReqState.WAITING
    pending: set[int] = field(default_factory=set)  # nonces of exchanges in flight
    prefix: tuple[int, ...] = ()  # prompt tokens still to fill caches with
    next_tokens: tuple[int, ...] = ()  # the next sampling step's input
    pos: int = 0
    generated: int = 0
    picker: Any = None  # PickToken's state
    admitted: bool = False  # holds an in-flight slot (and sequences on the stages)
    micro_batch: int = 0  # which micro-batch its decode steps travel in
    parked: bool = False  # its decode step waits for the rest of its micro-batch
    # The prompt-cache entry its stages start from (pinned in the index while it runs), and
    # how many of its prompt tokens that covers; the tokens it sampled (the eos included).
    from_entry: int = 0
    cached: int = 0
    sampled: list[int] = field(default_factory=list)


class MicroBatches:
    """Which micro-batch each admitted request is in, and whose decode steps wait for it.

    A request joins the emptiest of ``n`` micro-batches. Decode steps of one micro-batch
    travel together: a request whose step is ready waits (parked) while others of its
    micro-batch still have a step in the stages, and the whole micro-batch goes as soon as its
    last result is in. Each stage runs a micro-batch as one batch on persistent caches, and with
    one micro-batch per stage in flight stage k computes one while stage k+1 computes the next.
    """

    def __init__(self, n: int) -> None:
        self.members = [0] * n  # admitted requests per micro-batch
        self.out: list[set[str]] = [set() for _ in range(n)]  # ids with a step in the stages
        self.parked: list[list[Req]] = [[] for _ in range(n)]
        self.holding = False  # while set, nothing is released (a stage is being given up)

    def join(self, req: Req) -> None:
        req.micro_batch = min(range(len(self.members)), key=self.members.__getitem__)
        self.members[req.micro_batch] += 1

    def park(self, req: Req) -> None:
        req.parked = True
        self.parked[req.micro_batch].append(req)

    def release(self, mb: int) -> list[Req]:
        """The parked requests of ``mb`` to send now (marked in flight), if none is out."""
        if self.out[mb] or self.holding or not self.parked[mb]:
            return []
        ready, self.parked[mb] = self.parked[mb], []
        for req in ready:
            req.parked = False
            self.out[mb].add(req.entry.request_id)
        return ready

    def leave(self, req: Req, admitted: bool) -> None:
        mb = req.micro_batch
        self.out[mb].discard(req.entry.request_id)
        if req.parked:
            req.parked = False
            self.parked[mb].remove(req)
        if admitted:
            self.members[mb] -= 1


def result_problem(
    m: RunResult, ex: Exchange, return_logits: bool, vocab: int
) -> tuple[str, str] | None:
    """Why a RunResult carrying a waiting exchange's nonce does not answer it, as (reason,
    detail) -- the reason a fixed string, so the drop counters stay bounded -- or None."""
    if ex.request_id != m.request_id or ex.micro_batch != m.micro_batch:
        return "request or micro-batch does not match the exchange", ""
    if ex.tokens == 0:
        if m.token_ids or m.logits is not None:
            return "a prompt-chunk RunResult carries no token and no logits", ""
    elif return_logits:
        t = m.logits
        if t is None or t.shape != (1, ex.seq_len, vocab):
            shape = None if t is None else list(t.shape)
            return "logits of the wrong shape", f"{shape}, expected [1, {ex.seq_len}, {vocab}]"
    elif len(m.token_ids) != 1:
        return "a sampled RunResult carries exactly one token", ""
    elif len(m.top_ids or ()) != len(m.top_logprobs or ()):
        return "top_logprobs alternatives that do not pair up", ""
    return None


def admission_problem(
    m: RunEntry, down: dict[str, str], vocab: int, max_len: int
) -> tuple[str, str] | None:
    """(error code, why) a local RunEntry is refused at once, or None: a bad entry; or, while
    a stage is ``down``, any entry (it could only wait out a deadline; the client may retry)."""
    if not m.request_id:
        return ErrorCode.BAD_REQUEST, "empty request id"
    problem = prompt_problem(m.token_ids, m.sampling.max_tokens, vocab, max_len)
    if problem is not None:
        return ErrorCode.BAD_REQUEST, problem
    if down:
        stage, why = next(iter(down.items()))
        return ErrorCode.STAGE_UNREACHABLE, f"stage {stage} is unreachable: {why}"
    return None


def match_result(
    m: RunResult,
    from_final: bool,
    exchanges: dict[int, Exchange],
    return_logits: bool,
    vocab: int,
) -> tuple[tuple[int, Exchange] | None, tuple[str, str] | None]:
    """The waiting exchange a RunResult answers, or why it is dropped (reason, detail)."""
    if not from_final:
        return None, ("not from the final stage", "")
    ex = exchanges.get(m.nonce)
    if ex is None or ex.kind is not RunResult:
        return None, ("stale or unknown nonce", "")
    problem = result_problem(m, ex, return_logits, vocab)
    if problem is not None:
        return None, problem
    return (m.nonce, ex), None


def missed_text(ex: Exchange, final: str, step_timeout: float, now: float) -> str:
    """Why exchange ``ex`` failed at its deadline (``final``: the pipeline's last stage)."""
    if ex.kind is RunResult:
        what = f"no result for {ex.request_id} from the pipeline {ex.dest}..{final}"
    else:
        what = f"no {ex.kind.__name__} from {ex.dest} for {ex.request_id or 'a query'}"
    if ex.reported:
        waited = now - ex.sent_at
        return f"{what} within {step_timeout:g}s of the last progress report ({waited:.1f}s in all)"
    return f"{what} within {ex.deadline - ex.sent_at:g}s"


def claim(req: Req, nonce: int) -> PrepareSequence:
    """A stage's claim on ``req``: its whole length, the prompt's tail that the final stage's
    logits processors look back on (as the one-process engine's would), how it samples
    (sent once: the decode steps' StepEntry rows carry none), and the cached prefix its cache
    starts from."""
    e = req.entry
    total = len(e.token_ids) + e.sampling.max_tokens
    tail = tuple(e.token_ids[-PENALTY_CONTEXT:])
    return PrepareSequence(e.request_id, total, nonce, tail, e.sampling, req.from_entry, req.cached)


def fresh(e: RunEntry, hit: Hit | None = None) -> Req:
    """A request as it waits for admission. As mlx-lm's batch generator does: every prompt
    token but the last fills caches in chunks; the last one runs as the first decode step
    (same shapes, same numerics). A prompt-cache ``hit`` covers the first chunks' tokens."""
    n = hit.tokens if hit is not None else 0
    req = Req(e, prefix=e.token_ids[n:-1], next_tokens=e.token_ids[-1:], pos=n, cached=n)
    req.from_entry = hit.entry if hit is not None else 0
    return req


@dataclass(frozen=True, slots=True)
class Picked:
    """One decode step's answer for one request: from a RunResult, or a row of a StepResult."""

    token: int | None  # None: the final stage returned logits
    logprobs: tuple[float, ...] | None
    logits: Tensor | None
    compute_us: int
    top_ids: tuple[int, ...] | None = None
    top_logprobs: tuple[float, ...] | None = None


def picked(m: RunResult) -> Picked:
    token = m.token_ids[0] if m.token_ids else None
    return Picked(token, m.logprobs, m.logits, m.compute_us, m.top_ids, m.top_logprobs)


def step_entries(mb: int, ready: list[Req], nonces: list[int]) -> list[StepEntry]:
    """Micro-batch ``mb``'s decode step for the ``ready`` requests (each under its exchange's
    nonce): one StepEntry, or several where there are more rows than one may hold."""
    out = []
    for i in range(0, len(ready), MAX_STEP_ROWS):
        rows, cut = ready[i : i + MAX_STEP_ROWS], tuple(nonces[i : i + MAX_STEP_ROWS])
        ids, tokens = tuple(r.entry.request_id for r in rows), tuple(r.next_tokens[0] for r in rows)
        out.append(StepEntry(mb, ids, tokens, tuple(r.pos for r in rows), cut))
    return out


def step_rows(
    m: StepResult, from_final: bool, exchanges: dict[int, Exchange], return_logits: bool
) -> tuple[list[tuple[int, Exchange, Picked]], list[str]]:
    """The rows of ``m`` that answer waiting decode exchanges, as (nonce, exchange, answer),
    and why each other row is dropped (fixed reasons, so the drop counters stay bounded). A
    StepResult malformed as a whole is dropped whole."""
    n = len(m.request_ids)
    columns = (m.nonces, m.token_ids, m.logprobs)
    if not from_final:
        return [], ["not from the final stage"]
    if return_logits:
        return [], ["a StepResult where logits were asked for"]
    if (
        not 1 <= n <= MAX_STEP_ROWS
        or any(len(c) != n for c in columns)
        or len(m.top_ids) not in (0, n)
        or len(m.top_logprobs) != len(m.top_ids)
        or any(len(i) != len(v) for i, v in zip(m.top_ids, m.top_logprobs, strict=True))
    ):
        return [], ["a malformed StepResult"]
    rows, dropped = [], []
    for i, (rid, nonce, token, lp) in enumerate(zip(m.request_ids, *columns, strict=True)):
        ex = exchanges.get(nonce)
        if ex is None or ex.kind is not RunResult:
            dropped.append("stale or unknown nonce")
        elif ex.request_id != rid or ex.micro_batch != m.micro_batch or ex.tokens != 1:
            dropped.append("request or micro-batch does not match the exchange")
        else:
            top = (m.top_ids[i], m.top_logprobs[i]) if m.top_ids else (None, None)
            rows.append((nonce, ex, Picked(token, (lp,), None, m.compute_us, *top)))
    return rows, dropped


def sends_first(effects: list[Effect]) -> list[Effect]:
    """``effects`` with the sends first (each group in its order): a step's next step leaves
    before its tokens go to the frontend, so the stages compute while this process hands
    them over."""
    return [e for e in effects if isinstance(e, Send)] + [
        e for e in effects if not isinstance(e, Send)
    ]


def for_client(
    e: RunEntry, token: int, finish: str | None, lp: Any, p: Picked, cached: int = 0
) -> RunResult:
    """What the frontend gets for one decoded token: the final stage's logprob (when the
    request asked for logprobs) and its top_logprobs alternatives travel on; the first one
    says how many prompt tokens came from the prompt cache (``cached``)."""
    return RunResult(
        e.request_id,
        e.micro_batch,
        (token,),
        finish,
        e.nonce,
        logprobs=lp if e.sampling.logprobs else None,
        top_ids=p.top_ids or None,
        top_logprobs=p.top_logprobs or None,
        cached_tokens=cached,
    )
