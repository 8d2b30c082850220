"""The stage protocol's tables and data: who may send what, the state machines, the steps.

Authorization (by the authenticated source of each message) is ``MAY_SEND``: commands --
PrepareSequence, RunEntry, CancelRequest, ReleaseSequence, BeginDrain, Shutdown, QueryState,
EvictPrefixes -- only from the configured coordinator; activations only from the upstream stage. On top, the
identity that prepared a request id owns it on that stage (checked by the core).

``SEQ_TABLE`` is one sequence's life on a stage; ``NODE_TABLE`` the stage's own. A pair that is
not in a table is refused with the code the table names for it.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

from mlxcel.base.defaults import PREFILL_STEP_SIZE
from mlxcel.base.fsm import Table
from mlxcel.base.messages import (
    Activation,
    BeginDrain,
    CancelRequest,
    ErrorCode,
    EvictPrefixes,
    Message,
    PrepareSequence,
    QueryState,
    ReleaseSequence,
    RunEntry,
    SamplingParams,
    Shutdown,
    StepActivation,
    StepEntry,
    Tensor,
)

MAX_ACTIVATION_TOKENS = 1 << 20
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


# --- the tables -------------------------------------------------------------------------------


class Sender(enum.Enum):
    COORDINATOR = "coordinator"
    UPSTREAM = "upstream"


MAY_SEND: dict[type[Message], Sender] = {
    PrepareSequence: Sender.COORDINATOR,
    RunEntry: Sender.COORDINATOR,
    StepEntry: Sender.COORDINATOR,
    CancelRequest: Sender.COORDINATOR,
    ReleaseSequence: Sender.COORDINATOR,
    BeginDrain: Sender.COORDINATOR,
    Shutdown: Sender.COORDINATOR,
    QueryState: Sender.COORDINATOR,
    EvictPrefixes: Sender.COORDINATOR,
    Activation: Sender.UPSTREAM,
    StepActivation: Sender.UPSTREAM,
}
REFUSAL = {Sender.COORDINATOR: ErrorCode.NOT_COORDINATOR, Sender.UPSTREAM: ErrorCode.NOT_UPSTREAM}


class SeqState(enum.Enum):
    IDLE = "idle"  # prepared; its cache holds exactly ``tokens`` positions
    QUEUED = "queued"  # one step waits for the compute backend
    RUNNING = "running"  # its step is in the current compute job
    FAILED = "failed"  # a step failed; only a release is accepted


class SeqEvent(enum.Enum):
    STEP = "step"
    START = "start"
    DONE = "done"
    FAIL = "fail"
    EXPIRE = "expire"  # its lease ran out while nothing was in flight


SEQ_TABLE: Table[SeqState, SeqEvent] = Table(
    "stage sequence",
    {
        (SeqState.IDLE, SeqEvent.STEP): SeqState.QUEUED,
        (SeqState.QUEUED, SeqEvent.START): SeqState.RUNNING,
        (SeqState.RUNNING, SeqEvent.DONE): SeqState.IDLE,
        (SeqState.RUNNING, SeqEvent.FAIL): SeqState.FAILED,
        (SeqState.IDLE, SeqEvent.EXPIRE): SeqState.IDLE,
        (SeqState.FAILED, SeqEvent.EXPIRE): SeqState.FAILED,
    },
    {
        (SeqState.QUEUED, SeqEvent.STEP): ErrorCode.STEP_IN_FLIGHT,
        (SeqState.RUNNING, SeqEvent.STEP): ErrorCode.STEP_IN_FLIGHT,
        (SeqState.FAILED, SeqEvent.STEP): ErrorCode.SEQUENCE_FAILED,
    },
    ErrorCode.BAD_REQUEST,
)


class StageState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # no new sequences; the ones held run to their end
    STOPPING = "stopping"  # draining, and stops once the last sequence is released
    STOPPED = "stopped"


class StageEvent(enum.Enum):
    PREPARE = "prepare"
    DRAIN = "drain"
    SHUTDOWN = "shutdown"
    EMPTY = "empty"  # the last sequence left
    RESUME = "resume"  # a coordinator's drain ran its bound with no Shutdown after it


NODE_TABLE: Table[StageState, StageEvent] = Table(
    "stage",
    {
        (StageState.SERVING, StageEvent.PREPARE): StageState.SERVING,
        (StageState.SERVING, StageEvent.DRAIN): StageState.DRAINING,
        (StageState.DRAINING, StageEvent.DRAIN): StageState.DRAINING,
        (StageState.STOPPING, StageEvent.DRAIN): StageState.STOPPING,
        (StageState.SERVING, StageEvent.SHUTDOWN): StageState.STOPPING,
        (StageState.DRAINING, StageEvent.SHUTDOWN): StageState.STOPPING,
        (StageState.STOPPING, StageEvent.SHUTDOWN): StageState.STOPPING,
        (StageState.STOPPING, StageEvent.EMPTY): StageState.STOPPED,
        (StageState.STOPPED, StageEvent.DRAIN): StageState.STOPPED,  # a second SIGTERM
        (StageState.DRAINING, StageEvent.RESUME): StageState.SERVING,
        (StageState.STOPPED, StageEvent.SHUTDOWN): StageState.STOPPED,
    },
    {StageEvent.PREPARE: ErrorCode.DRAINING},
    ErrorCode.DRAINING,
)


# --- configuration, steps and jobs ------------------------------------------------------------


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
    warm_up_tokens: int = (
        PREFILL_STEP_SIZE  # the prompt-chunk size, so its kernels compile before serving
    )
    max_sequences: int = 256  # prepared sequences held at once (each holds KV caches)
    lease: float = 300.0  # a sequence untouched this long is freed (a lost ReleaseSequence)
    forward_timeout: float = 120.0  # one step on the compute thread; past it, its requests fail
    # A coordinator's BeginDrain lasts this long unless a Shutdown follows: one drain asked
    # for (or forged by a member that shares the coordinator's IP) cannot last for ever.
    drain_bound: float = 60.0
    progress_interval: float = 5.0  # keep_alive_interval() of the default 30 s step deadline
    # The downstream stage runs in this process, on the same compute thread: activations are
    # handed over as device arrays still being evaluated (no synchronisation, no bytes).
    device_handoff: bool = False
    # This node's model identity (shape, weight digest), reported in State so that the
    # coordinator refuses a stage holding other weights.
    model: str = ""
    weights: str = ""


SeqKey = tuple[str, int]  # (request id, generation): a re-prepared id gets a fresh key


@dataclass(frozen=True, slots=True)
class Step:
    """One step of one sequence, as plain data for the compute backend."""

    key: SeqKey
    micro_batch: int
    tokens: tuple[int, ...] | None  # the entry stage's input
    hidden: Tensor | None  # every other stage's input: row ``row`` of it is this step's
    n: int
    start_pos: int
    sampling: SamplingParams
    nonce: int
    sample: bool = True
    compute_us: int = 0  # spent upstream on this step
    owner: str = ""  # who prepared the sequence on the entry stage
    context: tuple[int, ...] = ()  # the prompt's tail (final stage: what penalties look back on)
    row: int = 0
    # A row of a StepEntry or StepActivation: passed on in one batched message per owner.
    batched: bool = False

    @property
    def request_id(self) -> str:
        return self.key[0]

    @property
    def decode(self) -> bool:
        return self.n == 1 and self.start_pos > 0


@dataclass(frozen=True, slots=True)
class ComputeJob:
    """Steps that run as one forward pass: one prompt chunk, or up to ``max_batch`` decodes."""

    id: int
    steps: tuple[Step, ...]
    first: bool  # the entry stage (takes token ids)
    last: bool  # the final stage (samples, or returns logits)
    return_logits: bool


def keep_alive_interval(step_timeout: float, n_stages: int = 2) -> float:
    """How often a stage reports the steps it holds, for a coordinator whose step deadline is
    ``step_timeout``. A step held across a tick is reported, so between two reports an
    exchange spends less than an interval in each stage it crosses, plus up to an interval on
    either side: (stages + 1) intervals, at most two thirds of the deadline."""
    return step_timeout / (2 * max(3, n_stages))


class KeepAlive:
    """When a stage reports the steps it holds: every ``interval`` while it holds any (``at``
    is None otherwise). One small message per owner per interval, only while busy."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.at: float | None = None

    def arm(self, now: float) -> None:
        if self.at is None:
            self.at = now + self.interval

    def tick(self, held: set[tuple[str, int]], now: float) -> dict[str, tuple[int, ...]]:
        """``held``'s (owner, nonce) pairs grouped by owner; schedules the next tick."""
        self.at = now + self.interval if held else None
        by_owner: dict[str, list[int]] = {}
        for owner, nonce in sorted(held):
            by_owner.setdefault(owner, []).append(nonce)
        return {owner: tuple(nonces) for owner, nonces in by_owner.items()}


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: float
    top: tuple[tuple[int, ...], tuple[float, ...]] | None = None  # top_logprobs (ids, values)


@dataclass(frozen=True, slots=True)
class Row:
    """A step's hidden states: row ``index`` of ``tensor``, which holds its whole job's (so a
    job's output is copied to the host once, and passed on as one tensor where it can be)."""

    tensor: Tensor
    index: int


@dataclass(frozen=True, slots=True)
class StepFailed:
    """One sequence's step failed while the rest of its job completed."""

    code: str
    why: str


StepOutput = Tensor | Row | Sampled | StepFailed | None


@dataclass(eq=False)  # a sequence is itself: identity, not a field-by-field comparison
class Seq:
    key: SeqKey
    owner: str
    max_len: int
    touched: float  # the lease runs from the last command or step
    state: SeqState = SeqState.IDLE
    tokens: int = 0  # positions in the cache
    step: Step | None = None  # the queued or running step
    nonce: int = 0  # of the PrepareSequence that claimed it: a copy of that claim is a no-op
    step_nonce: int | None = None  # of the last step accepted: a copy of it is a no-op
    context: tuple[int, ...] = ()  # the prompt's tail, from PrepareSequence
    sampling: SamplingParams | None = None  # from PrepareSequence: a StepEntry row's


@dataclass
class StageStats:
    forwards: int = 0
    batches: int = 0
    largest_batch: int = 0
    discarded: int = 0  # queued steps dropped because their sequence was released
    duplicates: int = 0  # a copy of the step in flight, dropped
    compute_s: float = 0.0
    refused: int = 0
    errors: int = 0
    leases_expired: int = 0
    dropped: int = 0
    by_code: dict[str, int] = field(default_factory=dict)

    def ran(self, rows: int, took: float) -> None:
        """A forward pass of ``rows`` sequences took ``took`` seconds of compute."""
        self.compute_s += took
        self.forwards += rows
        self.batches += 1
        self.largest_batch = max(self.largest_batch, rows)


_KEY = operator.attrgetter("key")


def pick_job(queued: list[Seq], max_batch: int, last_was_decode: bool) -> list[Seq]:
    """What runs next, from the queued sequences (oldest first): the decode steps of one
    micro-batch -- the oldest queued decode's -- as one batch of at most ``max_batch`` (the
    stage keeps that micro-batch's caches as one persistent batch), or one prompt chunk.
    Prompt chunks alternate with decode batches, so a long prompt cannot stall decoding and
    decoding cannot starve a prompt."""
    decodes = [(s, s.step) for s in queued if s.step is not None and s.step.decode]
    prompts = [s for s in queued if s.step is not None and not s.step.decode]
    if decodes and not (prompts and last_was_decode):
        mb = decodes[0][1].micro_batch
        # A micro-batch larger than max_batch runs in chunks taken in a fixed order (by
        # sequence), so each chunk is the same rows every step and keeps its batch cache.
        members = sorted((s for s, step in decodes if step.micro_batch == mb), key=_KEY)
        return members[:max_batch]
    return prompts[:1]
