"""Every message that crosses the bus, in one place.

Messages are frozen, slotted dataclasses. The bus routes by class; the codec
(:mod:`mlxcel.wire.codec`) gives each exactly one CBOR encoding, derived from the field
annotations below, so adding a message means adding a class here and nothing else.

Sequences are tuples (not lists) so a message is immutable all the way down. Tensors travel
as raw bytes with a dtype name and a shape; :mod:`mlxcel.runtime.tensors` converts them to
and from MLX arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mlxcel.base.error_codes import ErrorCode as ErrorCode  # part of the Error contract
from mlxcel.base.sampling_params import EXTENDED_SAMPLING as EXTENDED_SAMPLING
from mlxcel.base.sampling_params import FINISH_REASONS as FINISH_REASONS
from mlxcel.base.sampling_params import SamplingParams as SamplingParams

# The source of a message published in this process (a peer's is its identity, "ip:port").
LOCAL = "local"


# --- tensors: a dense array as raw bytes, or -- inside one process -- a device array ------
# bfloat16 has no NumPy dtype; mlxcel.runtime.tensors converts between these and MLX.

# dtype name -> bytes per element. The names match MLX's dtype names.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
}


@dataclass(frozen=True, slots=True)
class Tensor:
    """A dense array as raw little-endian bytes. Validated on construction."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        # Imported lazily to keep this module free of import cycles.
        from mlxcel.base.errors import TensorSizeError

        if self.dtype not in DTYPE_SIZES:
            raise TensorSizeError(f"unknown tensor dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise TensorSizeError(f"negative dimension in shape {self.shape}")
        want = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if len(self.data) != want:
            raise TensorSizeError(
                f"tensor {self.dtype}{list(self.shape)} needs {want} bytes, got {len(self.data)}"
            )

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class DeviceTensor(Tensor):
    """Hidden states that stay on the device: rows ``rows`` of ``array`` (along its first
    axis, in that order), an MLX array that may still be evaluating. Only stages of one process
    that share a compute thread pass these (the next stage's graph is then built on the array
    while the device still computes it: no synchronisation, no host copy). ``data`` is empty;
    the codec refuses to encode one, so a device tensor can never reach a socket."""

    array: object = field(default=None, repr=False, compare=False)
    rows: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if (
            self.dtype not in DTYPE_SIZES
            or any(d < 0 for d in self.shape)
            or not self.shape
            or len(self.rows) != self.shape[0]
        ):
            from mlxcel.base.errors import TensorSizeError

            raise TensorSizeError(f"bad device tensor {self.dtype}{list(self.shape)}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def take_rows(t: Tensor, rows: Sequence[int]) -> Tensor:
    """Rows ``rows`` of ``t`` (along its first axis, in that order) as one tensor; ``t`` itself
    when that is all of it in order. No MLX: a device tensor names the rows it takes."""
    if len(rows) == t.shape[0] and all(r == i for i, r in enumerate(rows)):
        return t
    shape = (len(rows), *t.shape[1:])
    if isinstance(t, DeviceTensor):
        return DeviceTensor(t.dtype, shape, b"", t.array, tuple(t.rows[r] for r in rows))
    size = len(t.data) // t.shape[0]
    return Tensor(t.dtype, shape, b"".join(t.data[r * size : (r + 1) * size] for r in rows))


def join_rows(parts: Sequence[Tensor]) -> Tensor:
    """``parts`` (each ``[k, ...]``, one dtype and row shape) stacked along the first axis.
    Device tensors join only rows of one array (a stage's job has one output array)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    if isinstance(first, DeviceTensor):
        if any(not isinstance(p, DeviceTensor) or p.array is not first.array for p in parts):
            raise ValueError("device tensors of different arrays cannot be joined here")
        rows = tuple(r for p in parts for r in p.rows)  # type: ignore[attr-defined]
        return DeviceTensor(first.dtype, shape, b"", first.array, rows)
    return Tensor(first.dtype, shape, b"".join(p.data for p in parts))


class Message:
    """Marker base. ``KIND`` is the stable wire tag; never reuse a retired number."""

    KIND: ClassVar[int]


@dataclass(frozen=True, slots=True)
class PrepareSequence(Message):
    """Claim ``request_id`` on a node: build fresh per-sequence state, discarding older state."""

    KIND: ClassVar[int] = 1
    request_id: str
    max_len: int
    nonce: int = 0
    # The prompt's last tokens (as many as a penalty looks back on): the final stage's
    # logits processors see what a one-process engine's would.
    context: tuple[int, ...] = ()
    # How the sequence samples, sent once: a StepEntry's rows carry none (None: the sequence
    # runs only RunEntry steps, which carry their own).
    sampling: SamplingParams | None = None
    # Start the sequence's cache from the prompt-cache entry ``prefix`` (one this owner asked
    # the stage to keep), its first ``prefix_len`` positions; 0: an empty cache. A stage that
    # does not hold it fails the sequence's first step with ``prefix_not_cached``.
    prefix: int = 0
    prefix_len: int = 0


@dataclass(frozen=True, slots=True)
class RunEntry(Message):
    """Coordinator -> entry stage (or the local engine): tokens to run and how to sample."""

    KIND: ClassVar[int] = 2
    request_id: str
    micro_batch: int
    token_ids: tuple[int, ...]
    start_pos: int
    sampling: SamplingParams
    nonce: int
    # False: a prompt chunk that only fills caches; the final stage answers with no token.
    sample: bool = True
    # The prompt cache's namespace (mlxcel.base.prefix_index.cache_namespace): the entry may
    # start from a prefix cached for this namespace only. Set by the frontend; "" is the
    # namespace of requests with no API key and no cache_salt.
    cache_ns: str = ""


def prompt_problem(
    token_ids: tuple[int, ...], max_tokens: int, vocab: int, max_len: int
) -> str | None:
    """Why a prompt of ``token_ids`` with ``max_tokens`` to generate cannot run on a model with
    this vocabulary and context (None: it can), in the one wording every node that admits a
    request (the engine, a coordinator, a router, a prefill node) answers with."""
    if not token_ids:
        return "empty prompt"
    if any(not 0 <= t < vocab for t in token_ids):
        return f"token id outside the vocabulary [0, {vocab})"
    if max_tokens < 1:
        return "max_tokens must be >= 1"
    if len(token_ids) + max_tokens > max_len:
        return (
            f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_len}"
        )
    return None


@dataclass(frozen=True, slots=True)
class Activation(Message):
    """Stage -> next stage: hidden states for the tokens of one exchange."""

    KIND: ClassVar[int] = 3
    request_id: str
    micro_batch: int
    hidden: Tensor
    start_pos: int
    sampling: SamplingParams
    nonce: int
    sample: bool = True
    compute_us: int = 0  # time the stages upstream spent computing this step
    # Who prepared the sequence on the entry stage: each stage runs it only on a sequence the
    # same identity prepared there, so one request id can never join two owners' caches.
    owner: str = ""


@dataclass(frozen=True, slots=True)
class RunResult(Message):
    """Final stage (or the local engine) -> the owner of the sequence: sampled tokens."""

    KIND: ClassVar[int] = 4
    request_id: str
    micro_batch: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    nonce: int
    logprobs: tuple[float, ...] | None = None
    logits: Tensor | None = None
    compute_us: int = 0  # pipeline: time every stage spent computing this step, summed
    # sampling.top_logprobs alternatives per token, flattened: token i's are [i*k, (i+1)*k).
    top_ids: tuple[int, ...] | None = None
    top_logprobs: tuple[float, ...] | None = None
    cached_tokens: int = 0  # on a sequence's first result: prompt tokens served from cache
    # On its last result: the engine kept the finished sequence in its prompt cache.
    kept: bool = False


@dataclass(frozen=True, slots=True)
class StepEntry(Message):
    """Coordinator -> entry stage: one decode step of a micro-batch, one row per sequence.

    Row ``i`` runs ``token_ids[i]`` at ``start_pos[i]`` on ``request_ids[i]``'s cache under the
    exchange ``nonces[i]``; the sequence samples as its PrepareSequence said. Each row is
    authorised and answered on its own, as a RunEntry would be."""

    KIND: ClassVar[int] = 34
    micro_batch: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]  # one per row
    start_pos: tuple[int, ...]
    nonces: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepActivation(Message):
    """Stage -> next stage: a StepEntry's rows passed on, their hidden states as one tensor
    ``[rows, 1, width]`` (row ``i`` is ``request_ids[i]``'s), all of one ``owner``."""

    KIND: ClassVar[int] = 35
    micro_batch: int
    request_ids: tuple[str, ...]
    start_pos: tuple[int, ...]
    nonces: tuple[int, ...]
    hidden: Tensor
    compute_us: int = 0  # time the stages upstream spent computing this step
    owner: str = ""


@dataclass(frozen=True, slots=True)
class StepResult(Message):
    """Final stage -> the owner: one sampled token per row of a StepEntry that went through.

    ``logprobs[i]`` is row ``i``'s token's; ``top_ids``/``top_logprobs``, when any row asked
    for alternatives, hold one tuple per row (empty for a row that asked none)."""

    KIND: ClassVar[int] = 36
    micro_batch: int
    request_ids: tuple[str, ...]
    nonces: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    compute_us: int = 0  # every stage's compute for this step, summed
    top_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class CancelRequest(Message):
    """Stop generating for ``request_id``; its state is freed."""

    KIND: ClassVar[int] = 5
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseSequence(Message):
    """Free every cache held for ``request_id`` -- with ``keep``, after keeping its first
    ``keep_len`` positions as the prompt-cache entry ``keep`` (a stage whose cache does not
    hold exactly that many, or whose budget cannot take it, keeps nothing)."""

    KIND: ClassVar[int] = 6
    request_id: str
    keep: int = 0
    keep_len: int = 0


@dataclass(frozen=True, slots=True)
class EvictPrefixes(Message):
    """Coordinator -> every stage: forget these prompt-cache entries (eviction is decided by
    the owner of the index, once, and carried out everywhere); at most ``MAX_EVICTIONS``."""

    KIND: ClassVar[int] = 37
    entries: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Ack(Message):
    KIND: ClassVar[int] = 7
    request_id: str
    nonce: int


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A typed refusal or failure, answered to the sender of the offending message."""

    KIND: ClassVar[int] = 8
    code: str
    message: str
    request_id: str | None = None
    nonce: int | None = None


@dataclass(frozen=True, slots=True)
class BeginDrain(Message):
    """Stop admitting new sequences; finish the ones in flight."""

    KIND: ClassVar[int] = 9
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Exit cleanly (after draining)."""

    KIND: ClassVar[int] = 10
    reason: str = ""


@dataclass(frozen=True, slots=True)
class State(Message):
    """A node's answer to a state query: who it is and what it holds."""

    KIND: ClassVar[int] = 11
    node_id: str
    layers: tuple[int, ...]  # (start, end) of the layer range it runs, end exclusive
    sequences: int
    draining: bool
    nonce: int
    wire_bytes_out: int = 0  # bytes this node has written to cluster connections
    compute_us: int = 0  # time this node has spent computing, in microseconds
    largest_batch: int = 0  # most sequences this node has run in one forward pass
    # Where a stage's compute went, in microseconds (see StageTiming): building graphs,
    # waiting for the device, copying results to the host; and how many jobs it ran.
    build_us: int = 0
    eval_us: int = 0
    copy_us: int = 0
    jobs: int = 0
    # The node's model identity (mlxcel.bringup.identity): its shape and its weight digest
    # ("": not computed -- the operator trusts the copies).
    model: str = ""
    weights: str = ""
    # KV-cache positions held, and held plus what still fits (mlxcel.runtime.kv_usage).
    kv_tokens: int = 0
    kv_capacity: int = 0
    # A prefill node's KV handoffs acknowledged, and their time from send to ack.
    handoffs: int = 0
    handoff_us: int = 0


@dataclass(frozen=True, slots=True)
class QueryState(Message):
    """Ask a node for its State (answered to the authenticated source)."""

    KIND: ClassVar[int] = 12
    nonce: int


@dataclass(frozen=True, slots=True)
class Progress(Message):
    """From a stage to a sequence's owner: the steps of these exchanges are still queued or
    computing here. Sent once per keep-alive interval while the stage holds steps, so that a
    coordinator tells a slow stage (kernels compiling on a fresh GPU, a long queue) from a
    silent one."""

    KIND: ClassVar[int] = 29
    nonces: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TpInsert:
    """A sequence joining the tensor-parallel batch (what rank 0 inserted this step)."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    # Rank 0 starts it from its prompt cache's entry for ``token_ids[:cached]`` in the
    # namespace ``cache_ns``: every rank starts from its own shard of that entry, or -- if
    # any rank lacks it -- every rank prefills it in full (mlxcel.tp.group.agree).
    cached: int = 0
    cache_ns: str = ""


@dataclass(frozen=True, slots=True)
class TpStep(Message):
    """Rank 0 -> every other tensor-parallel rank: replay exactly this batch step.

    Travels over MLX's own collective (``mx.distributed``), not a cluster connection: the
    followers apply the same joins and leaves to their batch and run the same forward pass.
    """

    KIND: ClassVar[int] = 13
    inserts: tuple[TpInsert, ...]
    removals: tuple[int, ...]
    stop: bool = False


@dataclass(frozen=True, slots=True)
class TpJoin(Message):
    """A tensor-parallel rank -> rank 0, before MLX's group forms, over an authenticated
    connection (the secret proved): I am ``rank``; my ring listener will be ``ring``
    (HOST:PORT); I hold the model whose config.json hashes to ``model`` and was started with
    the hostfile hashing to ``hostfile`` ("": started by rank 0), running mlxcel ``version``."""

    KIND: ClassVar[int] = 32
    rank: int
    ring: str
    model: str
    hostfile: str
    version: str


@dataclass(frozen=True, slots=True)
class TpRing(Message):
    """Rank 0 -> each rank once every rank has joined: the ring to form (one HOST:PORT per
    rank, rank 0 first), the collective backend, and this launch's step key
    (:mod:`mlxcel.tp.step_seal`). It travels only inside the encrypted connection."""

    KIND: ClassVar[int] = 33
    ring: tuple[str, ...]
    backend: str
    step_key: bytes
    # Rank 0's prompt-cache budget: every rank keeps its shard of the same entries, so every
    # rank's cache makes the same choices (0: none).
    prompt_cache_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Undecodable(Message):
    """Local only (never on the wire): a message from the envelope's source failed to decode.

    The connection publishes what it could still read of it, so a role can answer the
    sender's exchange with an ``Error`` at once instead of letting it wait out its deadline.
    """

    KIND: ClassVar[int] = 1000
    kind: int | None
    request_id: str | None
    nonce: int | None
    reason: str
    # A batched message's (request id, nonce) rows, as far as they could be read: each row's
    # exchange is answered.
    rows: tuple[tuple[str, int], ...] = ()


# --- local only: a disaggregated node's service and its engine, on one bus ------------------
# (``cache`` fields hold the runtime's own objects: never encoded, never on the wire.)


@dataclass(frozen=True, slots=True)
class PrefillEntry(Message):
    """Local only: run ``entry`` (its prompt, then its first token) and hand back its KV
    cache with its last result, as a :class:`CacheKept` (a prefill node)."""

    KIND: ClassVar[int] = 1001
    entry: RunEntry


@dataclass(frozen=True, slots=True)
class CacheKept(Message):
    """Local only: a :class:`PrefillEntry`'s last result, its packed KV cache (a
    :class:`~mlxcel.base.handoff.Packed`) and the PRNG key its sampling goes on from."""

    KIND: ClassVar[int] = 1002
    result: RunResult
    cache: Any
    key_state: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ResumeSequence(Message):
    """Local only: decode ``entry`` (its one token, the handoff's first) after a KV cache
    computed elsewhere (a decode node). ``cache`` is that cache as the runtime loaded it,
    holding ``positions`` tokens; ``context`` the tokens before it that its penalties see;
    ``key_state`` the PRNG key."""

    KIND: ClassVar[int] = 1003
    entry: RunEntry
    cache: Any
    positions: int
    key_state: tuple[int, ...]
    context: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ContinueEntry(Message):
    """Local only: run ``entry`` from its namespace's prompt cache, which must supply at
    least ``min_cached`` of its prompt tokens; otherwise it ends at once with
    ``prefix_not_cached``, nothing prefilled (a decode node continuing a conversation)."""

    KIND: ClassVar[int] = 1004
    entry: RunEntry
    min_cached: int


LOCAL_ONLY: tuple[type[Message], ...] = (
    Undecodable,
    PrefillEntry,
    CacheKept,
    ResumeSequence,
    ContinueEntry,
)


# --- zero-config bring-up (mlxcel.bringup): the assignment channel and discovery beacons -----


@dataclass(frozen=True, slots=True)
class AssignOffer(Message):
    """Coordinator -> peer: run stage ``stage`` of this cluster (``cluster_toml``, the body
    every node writes). ``attempt`` names one bring-up; answers carry it back."""

    KIND: ClassVar[int] = 14
    protocol: int
    attempt: int
    mlxcel_version: str
    cluster_name: str
    model_sha256: str  # see mlxcel.bringup.identity: config.json, weight files, layer count
    n_layers: int
    n_stages: int
    stage: int
    layers: tuple[int, ...]  # (start, end) of the offered range, end exclusive
    node_id: str
    coordinator: str  # the coordinator's control address (stages reply there)
    cluster_toml: str
    weights: str = ""  # the coordinator's weight digest ("": not computed, not compared)


@dataclass(frozen=True, slots=True)
class AssignAccepted(Message):
    """Peer -> coordinator: the offer passed every check. ``memory``: the bytes this peer can
    hold (its usable memory, or what its operator allows it; 0: not said), which the
    coordinator places stages by."""

    KIND: ClassVar[int] = 15
    protocol: int
    attempt: int
    node_id: str
    memory: int = 0


@dataclass(frozen=True, slots=True)
class AssignRefused(Message):
    """Peer -> coordinator: the offer (or a later phase) failed a check. ``final``: the peer
    ends (a retry against this coordinator cannot succeed); otherwise it waits again."""

    KIND: ClassVar[int] = 16
    attempt: int
    code: str
    reason: str
    final: bool


@dataclass(frozen=True, slots=True)
class AssignCommit(Message):
    KIND: ClassVar[int] = 17
    attempt: int


@dataclass(frozen=True, slots=True)
class AssignCommitted(Message):
    KIND: ClassVar[int] = 18
    attempt: int


@dataclass(frozen=True, slots=True)
class AssignActivate(Message):
    KIND: ClassVar[int] = 19
    attempt: int


@dataclass(frozen=True, slots=True)
class AssignActivated(Message):
    """Peer -> coordinator: the stage is starting (answered again to a repeated Activate)."""

    KIND: ClassVar[int] = 20
    attempt: int


@dataclass(frozen=True, slots=True)
class AssignAbort(Message):
    """Coordinator -> peer: this bring-up failed (``summary`` says why); wait again."""

    KIND: ClassVar[int] = 21
    attempt: int
    summary: str


@dataclass(frozen=True, slots=True)
class Beacon(Message):
    """A peer's UDP announcement (``--cluster-discovery=mdns``). ``mac`` is an HMAC over the
    encoding of every other field (see mlxcel.bringup.beacon); the payload is readable."""

    KIND: ClassVar[int] = 22
    version: str
    cluster: str  # the peer's --cluster-name: a coordinator counts only its own cluster's
    address: str  # the peer's assignment listener, at the IP its beacons leave from
    timestamp: float  # the peer's wall clock
    nonce: bytes
    mac: bytes = b""


# --- disaggregated serving (mlxcel.disagg) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillRequest(Message):
    """Router -> prefill node: run the prompt, send the first token back, hand the KV cache
    to ``decode_target`` ("" means the prefill node's first ``--decode-peers`` entry)."""

    KIND: ClassVar[int] = 23
    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    decode_target: str
    nonce: int  # the router's per-request nonce; every result for the request carries it
    cache_ns: str = ""  # the prompt cache's namespace (its tenant's): see RunEntry
    # Sent to a decode node (a conversation it keeps): the prompt tokens its cache must
    # supply at least, or it answers ``prefix_not_cached`` and prefills nothing (a stale
    # record at the router never costs a decode node a whole prompt). 0 for a prefill node.
    cached: int = 0


@dataclass(frozen=True, slots=True)
class KvHandoff(Message):
    """Prefill -> decode node: one request's KV cache (every layer, trimmed to the prompt,
    dtype preserved) and how to go on. Held by the prefill node under ``lease`` until the
    decode node acknowledges it; read by the decode node only after the commit verdict.

    A larger cache travels as ``parts`` messages with the same header and digest: each
    carries, in ``keys``, pieces of the cache's tensors (in wire order: layer 0's keys, its
    values, layer 1's keys, ...) as 2-D row ranges ``[rows, last dim]``; ``pieces`` names the
    tensor each piece continues, ``layout`` every tensor's full shape, and ``values`` is
    empty. The decode node joins the pieces in part order (see :mod:`mlxcel.base.handoff`)."""

    KIND: ClassVar[int] = 24
    request_id: str
    lease: int  # the prefill node's handoff id; acks and verdicts name it
    router: str  # the identity the request came from: where the tokens go
    nonce: int  # the router's request nonce
    first_token: int
    sampling: SamplingParams  # max_tokens: what is left to generate after first_token
    rng_key: tuple[int, ...]  # the sampler's PRNG key after the first token (empty: greedy)
    prompt_len: int
    keys: tuple[Tensor, ...]  # one per layer: [1, kv_heads, prompt_len, head_dim]
    values: tuple[Tensor, ...]
    digest: bytes  # SHA-256 over the whole handoff but ``lease`` and the split (see mlxcel.base.handoff)
    part: int = 0
    parts: int = 1
    # The prompt's tokens, all of them (in the first part only): the decode node's penalties
    # look back on them, and a decode node that keeps conversations stores the cache under
    # them when the stream ends, in ``cache_ns``.
    context: tuple[int, ...] = ()
    pieces: tuple[int, ...] = ()  # a part: the tensor index of each piece in ``keys``
    layout: tuple[tuple[int, ...], ...] = ()  # a part: the shape of every tensor, wire order
    cache_ns: str = ""  # the request's prompt-cache namespace (its tenant's): see RunEntry


@dataclass(frozen=True, slots=True)
class HandoffAck(Message):
    """Decode -> prefill: the handoff arrived and verified (``ok``), or why not."""

    KIND: ClassVar[int] = 25
    request_id: str
    lease: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HandoffVerdict(Message):
    """Prefill -> decode: ``commit`` (the lease was still held: start decoding) or abort."""

    KIND: ClassVar[int] = 26
    request_id: str
    lease: int
    commit: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SlotRequest(Message):
    """Prefill -> decode, as the prompt starts: will you take this request's handoff? Sent
    before any prefill work is spent, so a full decode node costs nothing but a round trip.
    ``router`` is the identity the request came from (where the tokens will go)."""

    KIND: ClassVar[int] = 30
    request_id: str
    lease: int
    router: str


@dataclass(frozen=True, slots=True)
class SlotAnswer(Message):
    """Decode -> prefill: a slot is held for ``lease`` until its handoff comes (``ok``), or
    why not (full, draining, a router that never connected here)."""

    KIND: ClassVar[int] = 31
    request_id: str
    lease: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class TokenResult(Message):
    """Prefill (index 0) or decode node (index 1 on) -> router: generated tokens in order."""

    KIND: ClassVar[int] = 27
    request_id: str
    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    nonce: int
    logprobs: tuple[float, ...] | None = None
    # top_logprobs alternatives, as in RunResult: per token, sampling.top_logprobs (id, logprob)
    top_ids: tuple[int, ...] | None = None
    top_logprobs: tuple[float, ...] | None = None
    # Index 0: prompt tokens the node took from its prompt cache. ``kept``: at index 0 from a
    # prefill node, it now keeps this prompt; on the last token from a decode node, it keeps
    # the whole conversation (the prompt and what it generated). What a router routes the
    # next turn by.
    cached_tokens: int = 0
    kept: bool = False


@dataclass(frozen=True, slots=True)
class Bundle(Message):
    """Several pipeline messages for one peer in one frame, in order.

    The pipeline adapters coalesce what a core sends one peer in one go (a micro-batch's
    RunEntries, a job's activations or results) so a step of N sequences costs one frame, one
    decode and one bus hop instead of N. The receiver handles every item exactly as if it had
    arrived alone from the same authenticated source: each is authorised on its own. Items are
    only ``BUNDLED`` kinds (never a Bundle), at most ``MAX_BUNDLE`` of them.
    """

    KIND: ClassVar[int] = 28
    items: tuple[Message, ...]


# Every message that may cross the wire: each class above but the local-only ones.
# (``slots=True`` replaces each class, and the replaced ones linger among the subclasses.)
ALL_MESSAGES: tuple[type[Message], ...] = tuple(
    c for c in Message.__subclasses__() if globals().get(c.__name__) is c and c not in LOCAL_ONLY
)

MAX_BUNDLE = 256  # items per Bundle: more is refused whole, before any item is built
MAX_STEP_ROWS = 256  # rows per StepEntry, StepActivation or StepResult
MAX_EVICTIONS = 4096  # prompt-cache entries per EvictPrefixes
# What a Bundle may carry: the pipeline's per-sequence traffic.
BUNDLED: tuple[type[Message], ...] = (PrepareSequence, RunEntry, Activation, RunResult)
BUNDLED += (StepEntry, StepActivation, StepResult, CancelRequest, ReleaseSequence, Ack, Error)
BUNDLED += (EvictPrefixes,)
