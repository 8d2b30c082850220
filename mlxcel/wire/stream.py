"""The frame stream after the handshake, sans-I/O: bytes in; typed events (or one error) out.

:class:`FrameStream` is the receiving half of one connection. The I/O layer feeds it whatever
the socket gave (``receive_data``) and takes events (``next_event`` / ``events``)::

    MessageReceived(payload)  a whole message: one MESSAGE frame, or PART... END reassembled
    KeepaliveReceived         an empty KEEPALIVE (the peer is alive; nothing to deliver)
    PingReceived              an empty PING (the peer asks for a frame back at once)
    ConfirmReceived           the dialer's CONFIRM, when the stream was told to expect it first
    FrameDropped(kind, ...)   an authenticated frame this build does not handle (dropped)

Any protocol problem -- an oversize ``len`` in a header, a frame that fails authentication, an
exhausted counter, a message over ``max_message``, a record the :class:`MemoryBudget` cannot
cover, a first frame that is not a CONFIRM -- is a :class:`~mlxcel.base.errors.FrameError`.
It is raised by ``next_event`` once the events that came before it have been taken, and the
stream stays failed. ``receive_data`` itself never raises. The stream has no clock: it says
what it is waiting for (``in_frame``: a frame or a multi-record message is partly received,
so the peer is owed ``frame_timeout``, not the idle allowance) and how many bytes would move
it on (``bytes_needed``); the I/O layer arms the timer.

No per-byte work and no extra copies on the large-message path: a frame body that lies whole
in one feed is opened where it lies (``decrypt_into`` writes the plaintext once); only a
header or body split across feeds is gathered, once, since a body must be contiguous to
decrypt. An I/O layer that reads exactly ``bytes_needed`` bytes each time never splits one.

The sending half is :func:`message_frames`: the sealed frames of one message, in order, made
one by one so the I/O layer can drain the socket between records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from mlxcel.base.errors import BudgetExceeded, FrameError, FrameTooLarge
from mlxcel.wire.frames import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_MESSAGE,
    HEADER,
    HEADER_LEN,
    KIND_CONFIRM,
    KIND_END,
    KIND_KEEPALIVE,
    KIND_MESSAGE,
    KIND_PART,
    KIND_PING,
    Protection,
)

DEFAULT_MEMORY_BUDGET = 1 << 30  # reassembly buffers of all connections of one node

Payload = bytes | bytearray | memoryview


class MemoryBudget:
    """One node's allowance for message reassembly across all its connections."""

    def __init__(self, limit: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.refusals = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            self.refusals += 1
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """One complete message payload (CBOR, not yet decoded)."""

    payload: Payload


@dataclass(frozen=True, slots=True)
class KeepaliveReceived:
    """An empty KEEPALIVE frame outside a multi-record message."""


@dataclass(frozen=True, slots=True)
class PingReceived:
    """An empty PING outside a multi-record message: the peer wants a frame back now."""


@dataclass(frozen=True, slots=True)
class ConfirmReceived:
    """The listener side's first frame: an empty CONFIRM that opened under the session keys."""


@dataclass(frozen=True, slots=True)
class FrameDropped:
    """An authenticated frame of a kind this build does not handle here (an unknown kind, a
    non-empty KEEPALIVE, a CONFIRM after the first frame, a MESSAGE or KEEPALIVE inside a
    PART run). A message being reassembled is abandoned with it: ``discarded`` bytes."""

    kind: int
    discarded: int


StreamEvent = MessageReceived | KeepaliveReceived | PingReceived | ConfirmReceived | FrameDropped
_KEEPALIVE = KeepaliveReceived()
_PING = PingReceived()
_CONFIRM = ConfirmReceived()


class FrameStream:
    """The receiving half of one connection's frames (see the module docstring)."""

    def __init__(
        self,
        protection: Protection,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_message: int = DEFAULT_MAX_MESSAGE,
        budget: MemoryBudget | None = None,
        confirm_first: bool = False,
    ) -> None:
        self.protection = protection
        self.max_frame = max_frame
        self.max_message = max_message
        self.budget = budget if budget is not None else MemoryBudget()
        self._confirm_first = confirm_first
        self._overhead = protection.overhead
        self._buf = bytearray()  # the start of a header or body that a feed split
        self._header = b""  # the current frame's header once complete (b"": none yet)
        self._kind = 0
        self._body_len = 0  # ciphertext + tag of the current frame
        self._parts: list[Payload] = []  # records of the message being reassembled
        self._total = 0  # their size: what this stream holds of the budget
        self._events: deque[StreamEvent] = deque()
        self.error: FrameError | None = None
        self.frames_in = 0
        self.bytes_in = 0

    # --- what the I/O layer asks -----------------------------------------------------------
    @property
    def in_frame(self) -> bool:
        """True while a frame, or a message of several records, is partly received: the peer
        then gets ``frame_timeout`` for the rest, not the idle allowance."""
        return bool(self._header or self._buf or self._parts)

    @property
    def bytes_needed(self) -> int:
        """How many bytes complete the current header or frame body (always at least 1).
        Reading exactly this many keeps every feed on the fast, no-copy path."""
        if not self._header:
            return HEADER_LEN - len(self._buf)
        return self._body_len - len(self._buf)

    @property
    def reassembling(self) -> int:
        """Bytes of a multi-record message received so far (held against the budget)."""
        return self._total

    # --- input -------------------------------------------------------------------------------
    def receive_data(self, data: Payload) -> None:
        """Feed bytes from the peer. Never raises: a failure surfaces from ``next_event``."""
        if self.error is not None or not data:
            return
        # Views into immutable bytes may outlive this call; into anything else they may not.
        stable = type(data) is bytes
        try:
            if not self._buf:  # the exact reads an I/O layer makes: no view, no copy
                if not self._header:
                    if len(data) == HEADER_LEN:
                        self._start(bytes(data))
                        return
                elif stable and len(data) == self._body_len:
                    self._open(data, stable=True)  # decrypted straight from the read
                    return
            else:  # finish the split header or body first, from the front of data
                need = self.bytes_needed
                view = memoryview(data)
                self._buf += view[:need]
                if len(view) < need:
                    return
                piece, self._buf = self._buf, bytearray()  # now ours alone: views may keep it
                if self._header:
                    self._open(piece, stable=True)
                else:
                    self._start(bytes(piece))
                data = view[need:]
                if not data:
                    return
            view = memoryview(data)
            used = self._parse(view, stable=stable)
            if used < len(view):
                self._buf = bytearray(view[used:])  # only ever a header or one body's start
        except FrameError as exc:
            self._fail(exc)

    def next_event(self) -> StreamEvent | None:
        """The next event, or None when more bytes are needed. After a failure: the events
        that preceded it, then the :class:`FrameError` (again on every later call)."""
        if self._events:
            return self._events.popleft()
        if self.error is not None:
            raise self.error.with_traceback(None)
        return None

    def events(self) -> Iterator[StreamEvent]:
        """Every event available now (raises the stream's FrameError after the last)."""
        while (event := self.next_event()) is not None:
            yield event

    def close(self) -> None:
        """The connection is gone: give back the budget; later calls raise FrameError."""
        if self.error is None:
            self._fail(FrameError("frame stream closed"))
        self._events.clear()

    # --- parsing -------------------------------------------------------------------------------
    def _parse(self, view: memoryview, *, stable: bool) -> int:
        """Open every whole frame in ``view``; return how many bytes were used."""
        pos, end = 0, len(view)
        while True:
            if not self._header:
                if end - pos < HEADER_LEN:
                    return pos
                pos += HEADER_LEN
                self._start(bytes(view[pos - HEADER_LEN : pos]), parse_empty=False)
            stop = pos + self._body_len
            if stop > end:
                return pos
            self._open(view[pos:stop], stable=stable)
            pos = stop

    def _start(self, header: bytes, *, parse_empty: bool = True) -> None:
        """A complete header: refused here if oversize, before any body is waited for."""
        self._kind, length = HEADER.unpack(header)
        if length > self.max_frame:  # parse_header's rule, inline: this runs for every frame
            raise FrameTooLarge(f"frame announces {length} bytes, cap is {self.max_frame}")
        self._header = header
        self._body_len = length + self._overhead
        if parse_empty and not self._body_len:  # an empty unprotected frame: nothing follows
            self._open(b"", stable=True)

    def _open(self, body: Payload, *, stable: bool) -> None:
        plain = self.protection.open(self._header, body)
        if not stable and isinstance(plain, memoryview):
            plain = bytes(plain)  # a view into a buffer that may change must not escape
        self.frames_in += 1
        self.bytes_in += HEADER_LEN + self._body_len
        self._header = b""
        self._frame(self._kind, plain)

    def _frame(self, kind: int, plain: Payload) -> None:
        """Act on one opened frame (the reassembly rules)."""
        if self._confirm_first:
            if kind != KIND_CONFIRM or plain:
                raise FrameError(f"first frame is not a confirmation (kind {kind})")
            self._confirm_first = False
            self._events.append(_CONFIRM)
        elif kind == KIND_MESSAGE and not self._parts:
            self._events.append(MessageReceived(plain))
        elif kind == KIND_KEEPALIVE and not self._parts and not plain:
            self._events.append(_KEEPALIVE)
        elif kind == KIND_PING and not self._parts and not plain:
            self._events.append(_PING)
        elif kind == KIND_PART or kind == KIND_END:
            n = len(plain)
            if self._total + n > self.max_message:
                raise FrameTooLarge(f"message exceeds the {self.max_message}-byte cap")
            if not self.budget.take(n):
                raise BudgetExceeded(
                    f"reassembling a message would pass this node's {self.budget.limit}-byte "
                    "budget for messages in flight"
                )
            self._parts.append(plain)
            self._total += n
            if kind == KIND_END:
                payload = b"".join(self._parts)
                self._release()
                self._events.append(MessageReceived(payload))
        else:
            discarded = self._total
            self._release()
            self._events.append(FrameDropped(kind, discarded))

    def _release(self) -> None:
        self.budget.give(self._total)
        self._parts.clear()
        self._total = 0

    def _fail(self, exc: FrameError) -> None:
        self.error = exc.with_traceback(None)  # its frames would pin the buffers it names
        self._release()
        self._header = b""
        self._buf = bytearray()


def message_frames(
    protection: Protection,
    payload: Payload,
    *,
    record_size: int = DEFAULT_MAX_FRAME,
    max_message: int = DEFAULT_MAX_MESSAGE,
) -> Iterator[bytearray]:
    """The frames of one message, ready to write: one MESSAGE frame, or above ``record_size``
    PART frames and an END frame. The size check is immediate (FrameTooLarge); each frame is
    sealed only when asked for, so the frames must be written in the order given."""
    if len(payload) > max_message:
        raise FrameTooLarge(f"message of {len(payload)} bytes exceeds the {max_message}-byte cap")
    if not 0 < record_size <= DEFAULT_MAX_FRAME:
        raise ValueError(f"record_size must be 1..{DEFAULT_MAX_FRAME}")
    return _records(protection, memoryview(payload), record_size)


def _records(protection: Protection, mv: memoryview, record_size: int) -> Iterator[bytearray]:
    if len(mv) <= record_size:
        yield protection.seal(KIND_MESSAGE, mv)
        return
    for off in range(0, len(mv), record_size):
        stop = min(off + record_size, len(mv))
        yield protection.seal(KIND_END if stop == len(mv) else KIND_PART, mv[off:stop])
