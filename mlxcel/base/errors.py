"""Typed errors, grouped by where they come from.

Local errors describe something this process refused or failed at; remote errors describe
something a peer sent. Every limit and every timeout has its own type so callers (and tests)
can tell them apart without parsing messages.
"""

from __future__ import annotations

import enum
from typing import Any


class MlxcelError(Exception):
    """Base of every error mlxcel raises on purpose."""


# --- configuration ---------------------------------------------------------------------------


class ConfigError(MlxcelError):
    """A flag, environment variable or config file value is invalid."""

    def __init__(self, flag: str, problem: str) -> None:
        super().__init__(f"{flag}: {problem}")
        self.flag = flag
        self.problem = problem


# --- codec -----------------------------------------------------------------------------------


class DecodeError(MlxcelError):
    """Bytes that do not decode to a valid message. Nothing half-built escapes."""


class UnknownKindError(DecodeError):
    """The message kind tag is not one this build knows."""


class FieldError(DecodeError):
    """A field is missing, unexpected, or of the wrong type."""


class TensorSizeError(DecodeError):
    """A tensor's byte length differs from what its dtype and shape require."""


# --- bus -------------------------------------------------------------------------------------


class BusError(MlxcelError):
    """Misuse of the bus (publishing after close, subscribing twice, ...)."""


class DeadlineExceeded(MlxcelError, TimeoutError):
    """A wait passed its absolute deadline."""


class QueueFull(BusError):
    """A blocking subscription stayed full until the publisher's deadline."""


# --- runtime ---------------------------------------------------------------------------------


class PartitionError(MlxcelError):
    """A layer split is malformed or cannot fit."""


class ModelLoadError(MlxcelError):
    """A checkpoint could not be loaded (missing files, unsupported family, bad config)."""


class RequestError(MlxcelError):
    """A generation request is invalid (bad sampling values, prompt too long, ...)."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # the API's machine-readable error code (never null on a 400)


class AdmissionRejected(MlxcelError):
    """The admission queue is full; the caller should retry later."""


class RequestCancelled(MlxcelError):
    """The request was cancelled (client disconnect or explicit CancelRequest)."""


class PlatformUnsupported(MlxcelError):
    """A flag asks for something this platform cannot do (distributed modes on Windows)."""


class NotServing(MlxcelError):
    """A node that serves no requests of its own (a stage, a prefill or decode node) was
    asked to generate."""


class ListenError(MlxcelError):
    """A listening socket could not be opened (address in use, not local, no permission)."""


# --- errors that carry a wire code (mlxcel.base.error_codes) --------------------------------------


class CodedError(MlxcelError):
    """A failure named by one of the wire's error codes: what the sender, the client or the
    HTTP status (``error_codes.http_status``) is told."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ProtocolError(CodedError):
    """A message a role refuses; ``code`` is what the role answers the sender with."""


class IllegalTransition(ProtocolError):
    """An event that a state machine's table does not allow in the current state."""

    def __init__(self, machine: str, state: enum.Enum, event: enum.Enum, code: str) -> None:
        super().__init__(code, f"{machine}: {event.name} is not allowed in state {state.name}")
        self.machine = machine
        self.state = state
        self.event = event


class PipelineError(CodedError):
    """A pipeline exchange failed (stage error, unreachable stage, deadline)."""


class EngineError(CodedError):
    """The generating side (engine, pipeline, router) reported an error for this request."""


class OfferRefused(CodedError):
    """A bring-up peer refuses an offer; ``code`` is the assignment protocol's Refusal."""


# --- transport: frames, Noise, handshakes, connections ---------------------------------------


class TransportError(MlxcelError):
    """A cluster connection failed or could not be made; the connection (if any) is closed."""


class FrameError(TransportError):
    """Base for frame-layer failures; every one of them closes the connection."""


class FrameTooLarge(FrameError):
    """A header announced more bytes than the configured cap (refused before allocation)."""


class FrameAuthFailed(FrameError):
    """A frame failed authentication: altered, replayed, reordered, truncated or foreign."""


class CounterExhausted(FrameError):
    """A direction used its last nonce; the connection must be replaced."""


class FrameTimeout(FrameError):
    """A frame's body did not follow its header in time, or a peer stayed silent too long."""


class BudgetExceeded(FrameError):
    """Reassembling a message would pass the connection's or the node's memory budget."""


class NoiseError(TransportError):
    """A Noise operation failed: authentication, sequencing, or exhausted nonces."""


class DecryptFailed(NoiseError):
    """A ciphertext did not authenticate under the current key (wrong key or altered bytes)."""


class HandshakeError(TransportError):
    """A handshake failed; ``failure`` (wire.handshake_fields.Failure) says why."""

    def __init__(self, failure: Any, message: str) -> None:
        super().__init__(message)
        self.failure = failure


class ConnectFailed(TransportError):
    """Could not establish an authenticated connection; ``failure`` says why (None: network)."""

    def __init__(self, message: str, failure: Any = None) -> None:
        super().__init__(message)
        self.failure = failure


class ConnectionClosed(TransportError):
    """The connection is closed (by either side, or after a failure)."""


class PeerSilent(TransportError):
    """A round trip (``ping``) got no answer in time: the peer is gone or stopped."""


class SendFailed(TransportError):
    """A message could not be delivered to its destination. ``unsent``: it certainly never
    left this node (no connection could be made), so the destination does not have it."""

    def __init__(self, message: str, unsent: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent


# --- setting up a node: secrets, interfaces, bring-up, tensor-parallel groups ----------------


class SecretError(MlxcelError):
    """The cluster secret is missing, ambiguous, unreadable or too short."""


class InterfaceError(MlxcelError):
    """The named interface does not exist or has no IPv4 address."""


class BringupError(MlxcelError):
    """Zero-config bring-up could not form the cluster."""


class AssignmentRefused(BringupError):
    """The peer ends: an offer it can never accept, or no assignment in time."""


class BringupFailed(BringupError):
    """The coordinator's bring-up failed; no stage was started (or, during activation, the
    message says which already run)."""


class BeaconRejected(BringupError):
    """A discovery beacon was refused; ``why`` is a bringup.protocol.Rejection."""

    def __init__(self, why: enum.Enum, detail: str) -> None:
        super().__init__(f"beacon rejected: {why.value}: {detail}")
        self.why = why


class TpGroupFailed(MlxcelError):
    """A tensor-parallel rank died or the group broke."""


class StepForged(MlxcelError):
    """A tensor-parallel step's MAC did not verify: the group's control traffic was altered,
    injected, replayed or reordered (mlxcel.tp.step_seal)."""
