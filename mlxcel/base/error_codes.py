"""The codes an ``Error`` message carries (re-exported by :mod:`mlxcel.base.messages`)."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Every ``Error.code`` this build sends. ``Error.code`` stays a plain string on the wire
    (a newer peer may send a code this build does not know); compare against these."""

    # refusals: the sender is not allowed to send this here
    NOT_COORDINATOR = "not_coordinator"  # a command from anyone but the coordinator
    NOT_UPSTREAM = "not_upstream"  # an activation from anyone but the upstream stage
    NOT_OWNER = "not_owner"  # a command for a sequence another identity prepared
    NOT_ENTRY = "not_entry"  # a RunEntry sent to a stage that is not the entry stage
    # protocol state: the message does not fit the sequence's (or node's) state
    NOT_PREPARED = "not_prepared"  # a step for a sequence this node does not hold
    STEP_IN_FLIGHT = "step_in_flight"  # a second step before the first was answered
    SEQUENCE_FAILED = "sequence_failed"  # a step for a sequence whose earlier step failed
    DRAINING = "draining"  # new sequences while draining
    TOO_MANY_SEQUENCES = "too_many_sequences"  # the node holds its maximum already
    # bad input
    BAD_REQUEST = "bad_request"  # token ids, positions or lengths that do not fit
    BAD_ACTIVATION = "bad_activation"  # hidden states of the wrong dtype, shape or size
    BAD_MESSAGE = "bad_message"  # bytes that did not decode to a message
    # failures
    FORWARD_TIMEOUT = "forward_timeout"  # one step overran its compute deadline
    FORWARD_FAILED = "forward_failed"  # the runtime raised while running a step
    SAMPLING_FAILED = "sampling_failed"  # this sequence's sampler raised
    ENGINE_FAILED = "engine_failed"  # the one-process engine failed
    # a step started from a prompt-cache entry the stage does not hold (restarted, evicted, or
    # over its budget): the coordinator prefills the request in full instead
    PREFIX_NOT_CACHED = "prefix_not_cached"
    DOWNSTREAM_UNREACHABLE = "downstream_unreachable"  # a stage could not pass a step on
    STAGE_UNREACHABLE = "stage_unreachable"  # the coordinator lost or cannot reach a stage
    DEADLINE_EXCEEDED = "deadline_exceeded"  # an exchange passed its deadline
    QUEUE_FULL = "queue_full"  # admission queue full
    SERVER_SHUTTING_DOWN = "server_shutting_down"  # still running when the drain ran out
    # disaggregated serving
    NO_NODE_AVAILABLE = "no_node_available"  # the router has no online node for a role
    NODE_UNREACHABLE = "node_unreachable"  # a prefill or decode node was lost mid-request
    UNSUPPORTED_MODEL = "unsupported_model"  # the model's cache cannot be handed off
    DECODE_TARGET_REFUSED = "decode_target_refused"  # not in MLXCEL_DECODE_ALLOWLIST
    HANDOFF_FAILED = "handoff_failed"  # the KV handoff was refused, corrupt or undeliverable
    HANDOFF_TIMEOUT = "handoff_timeout"  # a lease expired, or results stopped arriving
    DECODE_REFUSED = "decode_refused"  # the decode target will not take it (full, draining)
    # tensor parallelism
    TP_JOIN_REFUSED = "tp_join_refused"  # rank 0 will not take this rank into its group
    TP_GROUP_FAILED = "tp_group_failed"  # a rank failed: the group cannot go on


# Codes that mean "not now", not "broken": the client (or a load balancer) may retry.
UNAVAILABLE = frozenset(
    {
        ErrorCode.SERVER_SHUTTING_DOWN,
        ErrorCode.STAGE_UNREACHABLE,
        ErrorCode.DOWNSTREAM_UNREACHABLE,
        ErrorCode.DRAINING,
        ErrorCode.NOT_PREPARED,
        ErrorCode.TOO_MANY_SEQUENCES,
        ErrorCode.NO_NODE_AVAILABLE,
        ErrorCode.NODE_UNREACHABLE,
        ErrorCode.DECODE_REFUSED,
        ErrorCode.PREFIX_NOT_CACHED,
    }
)
TIMEOUTS = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.HANDOFF_TIMEOUT})


def http_status(code: str) -> tuple[int, str, dict[str, str] | None]:
    """The HTTP status, OpenAI error type and headers a client gets for an error the engine,
    a stage or a node reported (``code``: any string; an unknown one is a server error)."""
    if code in TIMEOUTS:
        return 504, "timeout", None
    if code in UNAVAILABLE:
        return 503, "server_busy", {"Retry-After": "1"}
    return 500, "server_error", None
