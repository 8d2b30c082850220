"""The coordinator protocol's tables and records: a request's states, its exchanges.

``REQ_TABLE`` is one request's life on the coordinator: WAITING (for an in-flight slot) ->
PREPARING (Acks outstanding) -> PREFILL (a prompt chunk in the pipeline) / DECODE (a sampling
step in the pipeline) -> DONE (finished, failed or cancelled). An event that is not in the
table raises from the lookup.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.errors import MlxcelError
from mlxcel.fsm import Table
from mlxcel.messages import ErrorCode, Message, RunEntry, SamplingParams, Tensor


class PipelineError(MlxcelError):
    """A pipeline exchange failed (stage error, unreachable stage, deadline)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


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
