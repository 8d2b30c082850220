"""Typed errors, grouped by where they come from.

Local errors describe something this process refused or failed at; remote errors describe
something a peer sent. Every limit and every timeout has its own type so callers (and tests)
can tell them apart without parsing messages.
"""

from __future__ import annotations


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


class ListenError(MlxcelError):
    """A listening socket could not be opened (address in use, not local, no permission)."""
