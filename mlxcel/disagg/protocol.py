"""Disaggregated serving, the data: bounds, per-role states and their transition tables.

Three roles share one request: the router (serves HTTP, picks a prefill and a decode node),
the prefill node (runs the prompt, sends the first token, holds the KV cache under a lease)
and the decode node (verifies the handoff, waits for the commit, streams the rest)::

    router --PrefillRequest--> prefill --KvHandoff--> decode
    router <--TokenResult 0--- prefill <--HandoffAck-- decode
                               prefill --HandoffVerdict(commit)--> decode
    router <------------------TokenResult 1.. / Error------------- decode

A handoff is read (inserted into the decode batch) only after the prefill node committed it
while it still held the lease; an expired, refused, corrupt or undeliverable handoff ends the
request with an error at the router, never with a silent recomputation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

# router: dispatch -> first token (a long prompt takes a while); a setting, --prefill-timeout
from mlxcel.base.defaults import HANDOFF_LEASE, HANDOFF_LEASE_MAX
from mlxcel.base.defaults import PREFILL_TIMEOUT as PREFILL_TIMEOUT
from mlxcel.base.fsm import Table
from mlxcel.base.messages import ErrorCode, KvHandoff, SamplingParams

# --- bounds (seconds) ---------------------------------------------------------------------------
HANDOFF_TIMEOUT = 30.0  # router: first token -> decode's first token, and between tokens
# prefill: a handoff's lease lasts this long past its last progress -- a part written to the
# decode node's connection, or the last one (then the ack is awaited)...
LEASE = HANDOFF_LEASE  # (--handoff-lease)
LEASE_BYTES_PER_S = 100e6  # ...plus one second per 100 MB of cache once sent (verification)
LEASE_MAX = HANDOFF_LEASE_MAX  # the longest a handoff may take in all (--handoff-lease-max)
PART_WINDOW = 1  # prefill: parts of one handoff queued at once (the next goes once it is written)
PART_BYTES = (8 << 10, 32 << 20)  # prefill: a part's size bounds; between, 1/256 of the cache
SEND_WAIT = 5.0  # router: how long a prompt's send may wait for its prefill node
VERDICT_WAIT = LEASE + 5.0  # decode: how long a verified handoff waits for the verdict
PROBE_INTERVAL = 1.0  # router: liveness probe period per node
TOMBSTONE_TTL = 60.0  # decode: a cancel that came before its handoff is remembered this long
MAX_TOMBSTONES = 4096  # also the prefill node's memory of requests it finished
MAX_EARLY = 256  # router: tokens that arrived ahead of an earlier index, per request
MAX_PARTS = 16384  # decode: messages one handoff may be split into (512 GiB of parts)
NODE_CAPACITY = 256  # router: requests in flight per node before it counts as full
DROP_GRACE = 5.0  # router: a stream whose decode node dropped a connection must go on within
MAX_RESTARTS = 2  # router: times a request with no token out yet starts over on other nodes
# router: a conversation's next turn runs on the decode node that keeps its history when at
# most this many of its prompt tokens are new there (that node prefills them between its other
# streams' steps: a short stall for them, where a handoff would carry the whole history)
CONTINUE_MAX = 1024


def parse_allowlist(raw: str | None) -> tuple[frozenset[str] | None, list[str]]:
    """``MLXCEL_DECODE_ALLOWLIST``: numeric IP:port entries, comma-separated (IPv6 as
    ``[IP]:PORT``). Returns the set (None: permissive -- unset, empty, or nothing parsed) and
    the entries it skipped: host names, bad ports, IPv6 without brackets, and unspecified
    addresses (0.0.0.0, ::), which no decode node can be."""
    import ipaddress

    good: set[str] = set()
    skipped: list[str] = []
    for item in (raw or "").split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            bracketed = host.startswith("[") and host.endswith("]")
            if (ip.version == 6) != bracketed or ip.is_unspecified:
                raise ValueError
            if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError
        except ValueError:
            skipped.append(item)
            continue
        good.add(canonical(str(ip), int(port)))
    return (frozenset(good) or None), skipped


def canonical(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- router: one request ---------------------------------------------------------------------
class RouteState(enum.Enum):
    PREFILLING = "prefilling"  # sent to the prefill node, no token yet
    HANDOFF = "handoff"  # first token in; the decode node has not spoken yet
    DECODING = "decoding"  # the decode node streams
    DONE = "done"


class RouteEvent(enum.Enum):
    FIRST_TOKEN = "first_token"  # index 0, from the prefill node
    DECODE_TOKEN = "decode_token"  # index 1.., from the decode node
    FINISH = "finish"
    FAIL = "fail"  # an error, a deadline, a lost node, a cancel


ROUTE_TABLE: Table[RouteState, RouteEvent] = Table(
    "router request",
    {
        (RouteState.PREFILLING, RouteEvent.FIRST_TOKEN): RouteState.HANDOFF,
        (RouteState.PREFILLING, RouteEvent.FINISH): RouteState.DONE,
        (RouteState.PREFILLING, RouteEvent.FAIL): RouteState.DONE,
        (RouteState.HANDOFF, RouteEvent.DECODE_TOKEN): RouteState.DECODING,
        (RouteState.HANDOFF, RouteEvent.FINISH): RouteState.DONE,  # token 1 was the last
        (RouteState.HANDOFF, RouteEvent.FAIL): RouteState.DONE,
        (RouteState.DECODING, RouteEvent.DECODE_TOKEN): RouteState.DECODING,
        (RouteState.DECODING, RouteEvent.FINISH): RouteState.DONE,
        (RouteState.DECODING, RouteEvent.FAIL): RouteState.DONE,
    },
    {},
    ErrorCode.BAD_MESSAGE,
)


# --- prefill: one lease ----------------------------------------------------------------------
class LeaseState(enum.Enum):
    COMPUTING = "computing"  # the prompt runs
    LEASED = "leased"  # handoff sent; the cache is held until ack or expiry
    ENDED = "ended"


class LeaseEvent(enum.Enum):
    HANDED_OFF = "handed_off"
    FINISHED = "finished"  # the first token ended the stream: nothing to hand off
    ACKED = "acked"  # the decode node verified it: commit, release
    REFUSED = "refused"  # the decode node refused it
    EXPIRED = "expired"
    FAILED = "failed"  # compute failed, the send failed, a peer was lost
    CANCELLED = "cancelled"


LEASE_TABLE: Table[LeaseState, LeaseEvent] = Table(
    "prefill lease",
    {
        (LeaseState.COMPUTING, LeaseEvent.HANDED_OFF): LeaseState.LEASED,
        (LeaseState.COMPUTING, LeaseEvent.FINISHED): LeaseState.ENDED,
        (LeaseState.COMPUTING, LeaseEvent.FAILED): LeaseState.ENDED,
        (LeaseState.COMPUTING, LeaseEvent.CANCELLED): LeaseState.ENDED,
        (LeaseState.LEASED, LeaseEvent.ACKED): LeaseState.ENDED,
        (LeaseState.LEASED, LeaseEvent.REFUSED): LeaseState.ENDED,
        (LeaseState.LEASED, LeaseEvent.EXPIRED): LeaseState.ENDED,
        (LeaseState.LEASED, LeaseEvent.FAILED): LeaseState.ENDED,
        (LeaseState.LEASED, LeaseEvent.CANCELLED): LeaseState.ENDED,
    },
    {},
    ErrorCode.BAD_MESSAGE,
)


# --- decode: one handoff ---------------------------------------------------------------------
class SlotState(enum.Enum):
    RECEIVING = "receiving"  # a handoff in several parts: some have arrived
    VERIFYING = "verifying"  # digest and shapes checked on the compute thread
    STAGED = "staged"  # acknowledged; waiting for the verdict, not read yet
    DECODING = "decoding"  # committed: in the batch
    ENDED = "ended"


class SlotEvent(enum.Enum):
    RECEIVED = "received"  # the last part arrived
    VERIFIED = "verified"
    COMMIT = "commit"
    TOKEN = "token"
    FINISH = "finish"
    ABORT = "abort"  # the prefill node's abort verdict
    FAIL = "fail"  # verification failed, a timeout, a lost peer, an engine error
    CANCEL = "cancel"


SLOT_TABLE: Table[SlotState, SlotEvent] = Table(
    "decode handoff",
    {
        (SlotState.RECEIVING, SlotEvent.RECEIVED): SlotState.VERIFYING,
        (SlotState.RECEIVING, SlotEvent.ABORT): SlotState.ENDED,
        (SlotState.RECEIVING, SlotEvent.FAIL): SlotState.ENDED,
        (SlotState.RECEIVING, SlotEvent.CANCEL): SlotState.ENDED,
        (SlotState.VERIFYING, SlotEvent.VERIFIED): SlotState.STAGED,
        (SlotState.VERIFYING, SlotEvent.ABORT): SlotState.ENDED,
        (SlotState.VERIFYING, SlotEvent.FAIL): SlotState.ENDED,
        (SlotState.VERIFYING, SlotEvent.CANCEL): SlotState.ENDED,
        (SlotState.STAGED, SlotEvent.COMMIT): SlotState.DECODING,
        (SlotState.STAGED, SlotEvent.ABORT): SlotState.ENDED,
        (SlotState.STAGED, SlotEvent.FAIL): SlotState.ENDED,
        (SlotState.STAGED, SlotEvent.CANCEL): SlotState.ENDED,
        (SlotState.DECODING, SlotEvent.TOKEN): SlotState.DECODING,
        (SlotState.DECODING, SlotEvent.FINISH): SlotState.ENDED,
        (SlotState.DECODING, SlotEvent.FAIL): SlotState.ENDED,
        (SlotState.DECODING, SlotEvent.CANCEL): SlotState.ENDED,
    },
    {
        (SlotState.VERIFYING, SlotEvent.COMMIT): ErrorCode.NOT_PREPARED,
        (SlotState.RECEIVING, SlotEvent.COMMIT): ErrorCode.NOT_PREPARED,
    },
    ErrorCode.BAD_MESSAGE,
)


# --- jobs the adapters run on the compute side --------------------------------------------------
@dataclass(frozen=True, slots=True)
class PrefillJob:
    lease: int
    request_id: str  # the request's one id (the router's), the engine's for the prompt too
    token_ids: tuple[int, ...]
    sampling: SamplingParams  # max_tokens=1: the prefill samples only the first token
    cache_ns: str = ""  # the prompt cache's namespace: its tenant's


@dataclass(frozen=True, slots=True)
class VerifyJob:
    slot: int
    handoff: KvHandoff  # to check and stage


@dataclass(frozen=True, slots=True)
class ContinueJob:
    """A decode node runs a conversation's next turn from its own prompt cache."""

    slot: int
    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_ns: str
    min_cached: int  # prompt tokens the cache must supply, or the turn goes elsewhere


def decode_namespace(router: str, cache_ns: str) -> str:
    """Where a decode node keeps a conversation, and looks for it: the request's namespace
    (its tenant's) under the router it came through. A conversation kept for one router is
    continued for that router only -- another member that polls the node, or names a
    namespace it saw pass, finds nothing there to probe."""
    return f"{router}|{cache_ns}"


def min_cached(expected: int, prompt_len: int) -> int:
    """The prompt tokens a node's cache must supply for a turn the router expected it to hold
    ``expected`` of: never the whole prompt (the last token is always run again)."""
    return max(0, min(expected, prompt_len - 1))


@dataclass(frozen=True, slots=True)
class ResumeJob:
    slot: int
    handoff: KvHandoff  # committed: start decoding it
    cache: Any = None  # the checked cache, as the compute side loaded it (opaque here)
