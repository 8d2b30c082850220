"""CBOR encoding of bus messages, strict in both directions.

A message is one CBOR map: ``{"kind": <int>, <field>: <value>, ...}`` where the kind is the
class's ``KIND`` and every dataclass field appears exactly once. Nested dataclasses
(``SamplingParams``, ``Tensor``) are maps of their own fields; a tensor's ``data`` is a CBOR
byte string (major type 2) holding the raw little-endian elements, never base64 or a number
array.

Decoding checks everything before building anything: the kind is known, no field is missing
or extra, every value has exactly the annotated type (a bool is not an int, an int is not a
float), integers fit in 64 bits, a tensor's byte length equals dtype size x shape, and no
bytes trail the message. Any violation raises a :class:`~mlxcel.base.errors.DecodeError`
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

from mlxcel.base.errors import DecodeError, FieldError, TensorSizeError, UnknownKindError
from mlxcel.base.messages import (
    ALL_MESSAGES,
    BUNDLED,
    MAX_BUNDLE,
    MAX_STEP_ROWS,
    Bundle,
    DeviceTensor,
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
    for name in _field_names(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, DeviceTensor):
            raise TypeError(f"{name}: a device tensor cannot leave its process")
        if isinstance(value, _NESTED):
            value = _to_plain(value)
        elif isinstance(value, tuple):
            value = [_to_plain(v) if isinstance(v, _NESTED) else v for v in value]
        out[name] = value
    return out


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def tensor_bytes(msg: Message) -> int:
    """Bytes of tensor data ``msg`` carries (what its encoding mostly copies)."""
    if isinstance(msg, Bundle):
        return sum(tensor_bytes(m) for m in msg.items)
    total = 0
    for name in _tensor_fields(type(msg)):
        value = getattr(msg, name)
        if isinstance(value, Tensor):
            total += value.nbytes
        elif isinstance(value, tuple):
            total += sum(v.nbytes for v in value if isinstance(v, Tensor))
    return total


@cache
def _tensor_fields(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` whose annotation can hold a Tensor (asked on every send)."""
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if _holds_tensor(hints[f.name]))


def _holds_tensor(tp: Any) -> bool:
    return tp is Tensor or any(_holds_tensor(a) for a in typing.get_args(tp))


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
            k, rid, nonce, rows = _salvage_map(item)
            out.append(Undecodable(k, rid, nonce, str(exc)[:300], rows))
    return Bundle(tuple(out))


Salvaged = tuple[int | None, str | None, int | None, tuple[tuple[str, int], ...]]


def salvage(data: bytes | bytearray | memoryview) -> Salvaged:
    """(kind, request_id, nonce, rows) of a message that failed :func:`decode`, where its CBOR
    still parses (``rows``: a batched message's (request id, nonce) pairs, as many as read
    well, at most MAX_STEP_ROWS); Nones otherwise. Only for answering the sender; never
    trusted further."""
    try:
        raw = cbor2.CBORDecoder(io.BytesIO(data), max_depth=MAX_DEPTH).decode()
    except Exception:
        return None, None, None, ()
    if not isinstance(raw, dict):
        return None, None, None, ()
    return _salvage_map(raw)


def _salvage_map(raw: dict[Any, Any]) -> Salvaged:
    def ok(v: Any, tp: type) -> bool:
        if type(v) is not tp:
            return False
        return _INT_MIN <= v <= _INT_MAX if tp is int else tp is not str or len(v) <= 256

    def pick(key: str, tp: type) -> Any:
        v = raw.get(key)
        return v if ok(v, tp) else None

    ids, nonces = raw.get("request_ids"), raw.get("nonces")
    rows: tuple[tuple[str, int], ...] = ()
    if isinstance(ids, list) and isinstance(nonces, list):
        pairs = zip(ids[:MAX_STEP_ROWS], nonces[:MAX_STEP_ROWS], strict=False)
        rows = tuple(dict.fromkeys((r, n) for r, n in pairs if ok(r, str) and ok(n, int)))
    return pick("kind", int), pick("request_id", str), pick("nonce", int), rows


# --- decoding: a checker per field, built once per class ----------------------------------------
# A checker returns the value (a tuple or a nested dataclass where the field wants one) or
# raises _Bad. The path in an error ("RunEntry.sampling.top_k") is assembled only when one is
# raised, so a well-formed message costs one call per field.

Check = typing.Callable[[Any], Any]


class _Bad(Exception):
    def __init__(self, what: str) -> None:
        self.what = what
        self.path: list[str] = []  # innermost first: ".top_k", ".sampling"


def _build(cls: type, raw: dict[Any, Any], where: str) -> Any:
    try:
        return _struct(cls, raw)
    except _Bad as bad:
        why = f"{where}{''.join(reversed(bad.path))}: {bad.what}"
    raise FieldError(why)  # outside the handler: the error holds no reference to the peer's data


def _struct(cls: type, raw: dict[Any, Any]) -> Any:
    names, plan = _plan(cls)
    if not names.issuperset(raw):
        raise _Bad(f"unexpected field(s) {sorted(str(k) for k in raw if k not in names)}")
    try:  # every field present and well-formed: one pass
        values = {name: check(raw[name]) for name, _, check in plan}
    except (_Bad, KeyError):
        values = _fields(plan, raw)  # again, field by field, to name what is wrong
    try:
        return cls(**values)
    except TensorSizeError:
        raise
    except (TypeError, ValueError) as exc:  # pragma: no cover - checks above are complete
        raise _Bad(str(exc)) from None


def _fields(plan: tuple[tuple[str, bool, Check], ...], raw: dict[Any, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, optional, check in plan:
        if name not in raw:
            if optional:
                continue  # optional fields with defaults may be omitted by older encoders
            raise _Bad(f"missing field {name!r}")
        try:
            values[name] = check(raw[name])
        except _Bad as bad:
            bad.path.append(f".{name}")
            raise
    return values


@cache
def _plan(cls: type) -> tuple[frozenset[str], tuple[tuple[str, bool, Check], ...]]:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    plan = tuple(
        (f.name, f.default is not dataclasses.MISSING, _checker(hints[f.name])) for f in fields
    )
    return frozenset(f.name for f in fields), plan


def _checker(tp: Any) -> Check:
    """The check for a value of annotated type ``tp``: exactly that type (a bool is not an
    int, an int is not a float), integers within 64 bits, arrays and maps where they belong."""
    origin = typing.get_origin(tp)
    if origin is types.UnionType or origin is typing.Union:
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        some = _checker(inner)
        return lambda v: None if v is None else some(v)
    if origin is tuple:
        return _array(_checker(typing.get_args(tp)[0]))
    if tp in _NESTED:
        return lambda v: _struct(tp, v) if isinstance(v, dict) else _wrong("a map", v)
    if tp is int:
        return _int
    if tp in (float, str, bool, bytes):
        name = tp.__name__
        return lambda v: v if type(v) is tp else _wrong(name, v)

    def unsupported(v: Any) -> Any:  # pragma: no cover - a programming error
        raise _Bad(f"unsupported field type {tp!r}")

    return unsupported


def _wrong(expected: str, value: Any) -> Any:
    raise _Bad(f"expected {expected}, got {type(value).__name__}")


def _int(v: Any) -> int:
    if type(v) is not int:
        _wrong("an integer", v)
    if not _INT_MIN <= v <= _INT_MAX:
        raise _Bad("integer out of 64-bit range")
    return v


def _array(elem: Check) -> Check:
    def check(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            _wrong("an array", value)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(elem(v))
            except _Bad as bad:
                bad.path.append(f"[{i}]")
                raise
        return tuple(out)

    return check
