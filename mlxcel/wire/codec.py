"""CBOR encoding of bus messages, strict in both directions.

A message is one CBOR map: ``{"kind": <int>, <field>: <value>, ...}`` where the kind is the
class's ``KIND`` and every dataclass field appears exactly once. Nested dataclasses
(``SamplingParams``, ``Tensor``) are maps of their own fields; a tensor's ``data`` is a CBOR
byte string (major type 2) holding the raw little-endian elements, never base64 or a number
array.

Decoding checks everything before building anything: the kind is known, no field is missing
or extra, every value has exactly the annotated type (a bool is not an int, an int is not a
float), integers fit in 64 bits, a tensor's byte length equals dtype size x shape, and no
bytes trail the message. Any violation raises a :class:`~mlxcel.errors.DecodeError`
subclass; nothing else escapes :func:`decode`.
"""

from __future__ import annotations

import dataclasses
import io
import types
import typing
from functools import cache
from typing import Any

import cbor2

from mlxcel.errors import DecodeError, FieldError, TensorSizeError, UnknownKindError
from mlxcel.messages import (
    ALL_MESSAGES,
    BUNDLED,
    MAX_BUNDLE,
    Bundle,
    Message,
    SamplingParams,
    Tensor,
    TpInsert,
    Undecodable,
)

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
MAX_DEPTH = 16  # our messages nest at most 3 deep; anything deeper is an attack

_BY_KIND: dict[int, type[Message]] = {cls.KIND: cls for cls in ALL_MESSAGES}
if len(_BY_KIND) != len(ALL_MESSAGES):  # pragma: no cover - a programming error
    raise RuntimeError("two message classes share a KIND")

_NESTED = (SamplingParams, Tensor, TpInsert)


def encode(msg: Message) -> bytes:
    """Encode a message to its one CBOR form."""
    if type(msg) not in _BY_KIND.values():
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    return cbor2.dumps(_body(msg))


def _body(msg: Message) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": msg.KIND}
    if isinstance(msg, Bundle):
        if not 0 < len(msg.items) <= MAX_BUNDLE or any(type(m) not in BUNDLED for m in msg.items):
            raise TypeError(f"a Bundle holds 1 to {MAX_BUNDLE} items of the bundled kinds")
        body["items"] = [_body(m) for m in msg.items]
    else:
        body.update(_to_plain(msg))
    return body


def _to_plain(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, _NESTED):
            value = _to_plain(value)
        elif isinstance(value, tuple):
            value = [_to_plain(v) if isinstance(v, _NESTED) else v for v in value]
        out[f.name] = value
    return out


def tensor_bytes(msg: Message) -> int:
    """Bytes of tensor data ``msg`` carries (what its encoding mostly copies)."""
    if isinstance(msg, Bundle):
        return sum(tensor_bytes(m) for m in msg.items)
    total = 0
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        value = getattr(msg, f.name)
        if isinstance(value, Tensor):
            total += value.nbytes
        elif isinstance(value, tuple):
            total += sum(v.nbytes for v in value if isinstance(v, Tensor))
    return total


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode one message. Raises :class:`DecodeError` (or a subclass) on any problem."""
    buf = io.BytesIO(data)
    try:
        raw = cbor2.CBORDecoder(buf, max_depth=MAX_DEPTH, allow_duplicate_keys=False).decode()
    except DecodeError:
        raise
    except Exception as exc:  # cbor2 raises several types (and ValueError from tag decoders)
        raise DecodeError(f"malformed CBOR: {exc}") from None
    if buf.tell() != len(data):
        raise DecodeError(f"{len(data) - buf.tell()} trailing bytes after the message")
    if not isinstance(raw, dict):
        raise DecodeError(f"message must be a CBOR map, got {type(raw).__name__}")
    kind = raw.pop("kind", None)
    if type(kind) is not int:
        raise FieldError("message has no integer 'kind'")
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise UnknownKindError(f"unknown message kind {kind}")
    if cls is Bundle:
        return _build_bundle(raw)
    return _build(cls, raw, cls.__name__)


_BUNDLED_BY_KIND = {cls.KIND: cls for cls in BUNDLED}


def _build_bundle(raw: dict[Any, Any]) -> Bundle:
    """A Bundle whose shape is wrong is refused whole; an item that does not decode becomes
    :class:`Undecodable` in its place, so its exchange is answered and the rest still run."""
    items = raw.pop("items", None)
    if raw:
        raise FieldError(f"Bundle: unexpected field(s) {sorted(map(str, raw))}")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_BUNDLE:
        raise FieldError(f"Bundle: items must be an array of 1 to {MAX_BUNDLE} messages")
    out: list[Message] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise FieldError(f"Bundle.items[{i}]: expected a map, got {type(item).__name__}")
        kind = item.get("kind")
        cls = _BUNDLED_BY_KIND.get(kind) if type(kind) is int else None
        try:
            if cls is None:
                raise UnknownKindError(f"kind {kind!r} cannot travel in a Bundle")
            body = dict(item)
            del body["kind"]
            out.append(_build(cls, body, f"Bundle.items[{i}].{cls.__name__}"))
        except DecodeError as exc:
            k, rid, nonce = _salvage_map(item)
            out.append(Undecodable(k, rid, nonce, str(exc)[:300]))
    return Bundle(tuple(out))


def salvage(data: bytes | bytearray | memoryview) -> tuple[int | None, str | None, int | None]:
    """(kind, request_id, nonce) of a message that failed :func:`decode`, where its CBOR
    still parses; Nones otherwise. Only for answering the sender; never trusted further."""
    try:
        raw = cbor2.CBORDecoder(io.BytesIO(data), max_depth=MAX_DEPTH).decode()
    except Exception:
        return None, None, None
    if not isinstance(raw, dict):
        return None, None, None
    return _salvage_map(raw)


def _salvage_map(raw: dict[Any, Any]) -> tuple[int | None, str | None, int | None]:
    def pick(key: str, tp: type) -> Any:
        v = raw.get(key)
        if type(v) is not tp or (tp is int and not _INT_MIN <= v <= _INT_MAX):
            return None
        return v if tp is not str or len(v) <= 256 else None

    return pick("kind", int), pick("request_id", str), pick("nonce", int)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, raw: dict[Any, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = [k for k in raw if k not in fields]
    if extra:
        raise FieldError(f"{where}: unexpected field(s) {sorted(map(str, extra))}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is not dataclasses.MISSING:
                # Optional fields with defaults may be omitted by older encoders.
                continue
            raise FieldError(f"{where}: missing field {name!r}")
        values[name] = _check(hints[name], raw[name], f"{where}.{name}")
    try:
        return cls(**values)
    except TensorSizeError:
        raise
    except (TypeError, ValueError) as exc:  # pragma: no cover - checks above are complete
        raise FieldError(f"{where}: {exc}") from None


def _check(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is types.UnionType or origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(inner, value, where)
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        if not isinstance(value, list):
            raise FieldError(f"{where}: expected an array, got {type(value).__name__}")
        return tuple(_check(elem, v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp in _NESTED:
        if not isinstance(value, dict):
            raise FieldError(f"{where}: expected a map, got {type(value).__name__}")
        return _build(tp, dict(value), where)
    if tp is int:
        if type(value) is not int:
            raise FieldError(f"{where}: expected an integer, got {type(value).__name__}")
        if not _INT_MIN <= value <= _INT_MAX:
            raise FieldError(f"{where}: integer out of 64-bit range")
        return value
    if tp in (float, str, bool, bytes):
        if type(value) is not tp:
            raise FieldError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise FieldError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover
