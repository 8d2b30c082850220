from __future__ import annotations

from collections.abc import Iterator

import cbor2
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from mlxcel.base.errors import DecodeError, FieldError, TensorSizeError, UnknownKindError
from mlxcel.base.messages import (
    ALL_MESSAGES,
    BUNDLED,
    DTYPE_SIZES,
    MAX_BUNDLE,
    Ack,
    Activation,
    AssignAbort,
    AssignAccepted,
    AssignActivate,
    AssignActivated,
    AssignCommit,
    AssignCommitted,
    AssignOffer,
    AssignRefused,
    Beacon,
    BeginDrain,
    Bundle,
    CancelRequest,
    Error,
    EvictPrefixes,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    PrefillRequest,
    PrepareSequence,
    Progress,
    QueryState,
    ReleaseSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    Shutdown,
    SlotAnswer,
    SlotRequest,
    State,
    StepActivation,
    StepEntry,
    StepResult,
    Tensor,
    TokenResult,
    TpInsert,
    TpJoin,
    TpRing,
    TpStep,
    Undecodable,
)
from mlxcel.wire import codec
from mlxcel.wire.codec import decode, encode

u64 = st.integers(min_value=0, max_value=2**64 - 1)
small_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
ids = st.text(max_size=40)
floats = st.floats(allow_nan=False)


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    n = int(np.prod(shape)) * DTYPE_SIZES[dtype]
    return Tensor(dtype, shape, draw(st.binary(min_size=n, max_size=n)))


sampling = st.builds(
    SamplingParams,
    temperature=floats,
    top_p=floats,
    top_k=small_ints,
    seed=st.none() | small_ints,
    max_tokens=small_ints,
    logprobs=st.booleans(),
)

int_rows = st.lists(u64, max_size=6).map(tuple)

messages = st.one_of(
    st.builds(
        PrepareSequence, ids, small_ints, u64, int_rows, st.none() | sampling, u64, small_ints
    ),
    st.builds(
        StepEntry, small_ints, st.lists(ids, max_size=4).map(tuple), int_rows, int_rows, int_rows
    ),
    st.builds(
        StepActivation,
        small_ints,
        st.lists(ids, max_size=4).map(tuple),
        int_rows,
        int_rows,
        tensors(),
        small_ints,
        ids,
    ),
    st.builds(
        StepResult,
        small_ints,
        st.lists(ids, max_size=4).map(tuple),
        int_rows,
        int_rows,
        st.lists(floats, max_size=4).map(tuple),
        small_ints,
        st.lists(int_rows, max_size=3).map(tuple),
        st.lists(st.lists(floats, max_size=3).map(tuple), max_size=3).map(tuple),
    ),
    st.builds(
        RunEntry,
        ids,
        small_ints,
        st.lists(u64, max_size=20).map(tuple),
        small_ints,
        sampling,
        u64,
        st.booleans(),
        ids,
    ),
    st.builds(Activation, ids, small_ints, tensors(), small_ints, sampling, u64),
    st.builds(
        RunResult,
        ids,
        small_ints,
        st.lists(u64, max_size=5).map(tuple),
        st.none() | st.sampled_from(["stop", "length"]),
        u64,
        st.none() | st.lists(floats, max_size=5).map(tuple),
        st.none() | tensors(),
    ),
    st.builds(CancelRequest, ids, ids),
    st.builds(ReleaseSequence, ids, u64, small_ints),
    st.builds(EvictPrefixes, st.lists(u64, max_size=5).map(tuple)),
    st.builds(Ack, ids, u64),
    st.builds(Error, ids, ids, st.none() | ids, st.none() | u64),
    st.builds(BeginDrain, ids),
    st.builds(Shutdown, ids),
    st.builds(
        State,
        ids,
        st.lists(small_ints, max_size=2).map(tuple),
        small_ints,
        st.booleans(),
        u64,
        u64,
        u64,
    ),
    st.builds(QueryState, u64),
    st.builds(Progress, st.lists(u64, max_size=5).map(tuple)),
    st.builds(
        TpStep,
        st.lists(
            st.builds(
                TpInsert, ids, st.lists(u64, max_size=5).map(tuple), sampling, small_ints, ids
            ),
            max_size=3,
        ).map(tuple),
        st.lists(small_ints, max_size=4).map(tuple),
        st.booleans(),
    ),
    st.builds(TpJoin, small_ints, ids, ids, ids, ids),
    st.builds(
        TpRing, st.lists(ids, max_size=4).map(tuple), ids, st.binary(max_size=32), small_ints
    ),
    st.builds(
        AssignOffer,
        small_ints,
        u64,
        ids,
        ids,
        ids,
        small_ints,
        small_ints,
        small_ints,
        st.lists(small_ints, max_size=3).map(tuple),
        ids,
        ids,
        st.text(max_size=200),
    ),
    st.builds(AssignAccepted, small_ints, u64, ids),
    st.builds(AssignRefused, u64, ids, ids, st.booleans()),
    st.builds(AssignCommit, u64),
    st.builds(AssignCommitted, u64),
    st.builds(AssignActivate, u64),
    st.builds(AssignActivated, u64),
    st.builds(AssignAbort, u64, ids),
    st.builds(Beacon, ids, ids, ids, floats, st.binary(max_size=32), st.binary(max_size=32)),
    st.builds(PrefillRequest, ids, st.lists(u64, max_size=5).map(tuple), sampling, ids, u64, ids),
    st.builds(
        KvHandoff,
        ids,
        u64,
        ids,
        u64,
        u64,
        sampling,
        st.lists(u64, max_size=2).map(tuple),
        small_ints,
        st.lists(tensors(), max_size=2).map(tuple),
        st.lists(tensors(), max_size=2).map(tuple),
        st.binary(max_size=32),
        u64,
        u64,
    ),
    st.builds(HandoffAck, ids, u64, st.booleans(), ids),
    st.builds(HandoffVerdict, ids, u64, st.booleans(), ids),
    st.builds(SlotRequest, ids, u64, ids),
    st.builds(SlotAnswer, ids, u64, st.booleans(), ids),
    st.builds(
        TokenResult,
        ids,
        small_ints,
        st.lists(u64, max_size=3).map(tuple),
        st.none() | ids,
        u64,
        st.none() | st.lists(floats, max_size=3).map(tuple),
        st.none() | st.lists(u64, max_size=3).map(tuple),
        st.none() | st.lists(floats, max_size=3).map(tuple),
        small_ints,
        st.booleans(),
    ),
)


bundles = st.lists(messages.filter(lambda m: type(m) in BUNDLED), min_size=1, max_size=4).map(
    lambda items: Bundle(tuple(items))
)


@given(messages | bundles)
def test_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def fresh_plans() -> Iterator[None]:
    """The codec builds each class's decoding plan on first use and keeps it. Each test here
    builds its own, so the code that builds plans is exercised (and mutation testing maps it)
    by every test, not only by the first one that happened to decode."""
    codec._plan.cache_clear()
    codec._tensor_fields.cache_clear()
    yield


def test_every_message_class_is_covered_by_the_strategy() -> None:
    names = {
        "PrepareSequence",
        "RunEntry",
        "Activation",
        "RunResult",
        "StepEntry",
        "StepActivation",
        "StepResult",
        "CancelRequest",
        "ReleaseSequence",
        "EvictPrefixes",
        "Ack",
        "Error",
        "BeginDrain",
        "Shutdown",
        "State",
        "QueryState",
        "Progress",
        "TpStep",
        "TpJoin",
        "TpRing",
        "AssignOffer",
        "AssignAccepted",
        "AssignRefused",
        "AssignCommit",
        "AssignCommitted",
        "AssignActivate",
        "AssignActivated",
        "AssignAbort",
        "Beacon",
        "PrefillRequest",
        "KvHandoff",
        "HandoffAck",
        "HandoffVerdict",
        "SlotRequest",
        "SlotAnswer",
        "TokenResult",
        "Bundle",
    }
    assert {c.__name__ for c in ALL_MESSAGES} == names


def _raw_bundle(items: object, **extra: object) -> bytes:
    return cbor2.dumps({"kind": Bundle.KIND, "items": items, **extra})


def _item(msg: object) -> dict[str, object]:
    return cbor2.loads(encode(msg))  # type: ignore[arg-type,no-any-return]


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (_raw_bundle([]), "1 to 256"),
        (_raw_bundle([_item(ReleaseSequence("r"))] * (MAX_BUNDLE + 1)), "1 to 256"),
        (_raw_bundle({"kind": 6}), "1 to 256"),
        (_raw_bundle([7]), "expected a map"),
        (_raw_bundle([_item(ReleaseSequence("r"))], extra=1), "unexpected field"),
    ],
    ids=["empty", "too-many", "not-an-array", "item-not-a-map", "extra-field"],
)
def test_a_malformed_bundle_is_refused_whole(raw: bytes, why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        decode(raw)


def test_a_bad_bundle_item_becomes_undecodable_and_the_rest_still_arrive() -> None:
    """A nested Bundle, a kind a Bundle may not carry and a broken RunEntry each turn into an
    Undecodable naming what could be salvaged (so the exchange is answered at once); the good
    item around them is decoded as usual."""
    nested = _item(Bundle((ReleaseSequence("n"),)))
    not_bundled = _item(QueryState(5))
    broken = {"kind": RunEntry.KIND, "request_id": "r1", "nonce": 9}
    good = _item(ReleaseSequence("ok"))
    rows = {"kind": StepEntry.KIND, "request_ids": ["a", "b"], "nonces": [1, 2]}
    out = decode(_raw_bundle([nested, not_bundled, broken, good, rows]))
    assert isinstance(out, Bundle)
    first, second, third, fourth, fifth = out.items
    assert isinstance(fifth, Undecodable) and fifth.rows == (("a", 1), ("b", 2))
    assert isinstance(first, Undecodable) and first.kind == Bundle.KIND
    assert isinstance(second, Undecodable) and second.nonce == 5
    assert isinstance(third, Undecodable) and (third.request_id, third.nonce) == ("r1", 9)
    assert "micro_batch" in third.reason
    assert fourth == ReleaseSequence("ok")


def test_encode_refuses_a_bundle_it_could_not_decode() -> None:
    with pytest.raises(TypeError):
        encode(Bundle(()))
    with pytest.raises(TypeError):
        encode(Bundle((QueryState(1),)))


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_parse_or_raise_decode_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except DecodeError:
        return
    assert type(msg) in ALL_MESSAGES


@given(messages, st.integers(0, 10**6), st.integers(0, 255))
def test_mutated_messages_parse_or_raise_decode_error(msg: object, pos: int, byte: int) -> None:
    data = bytearray(encode(msg))  # type: ignore[arg-type]
    data[pos % len(data)] = byte
    try:
        got = decode(bytes(data))
    except DecodeError:
        return
    # What still parses is a message of a known kind, and encodes back to what was read.
    assert type(got) in ALL_MESSAGES
    assert encode(decode(encode(got))) == encode(got)  # (bytes: a NaN is equal to itself)


def _raw(msg: object) -> dict:
    return cbor2.loads(encode(msg))  # type: ignore[arg-type]


ENTRY = RunEntry("r", 0, (1, 2), 0, SamplingParams(), 7)


def test_unknown_kind() -> None:
    raw = _raw(ENTRY) | {"kind": 99}
    with pytest.raises(UnknownKindError, match="99"):
        decode(cbor2.dumps(raw))


def test_missing_field() -> None:
    raw = _raw(ENTRY)
    del raw["nonce"]
    with pytest.raises(FieldError, match="missing field 'nonce'"):
        decode(cbor2.dumps(raw))


def test_extra_field() -> None:
    with pytest.raises(FieldError, match="unexpected"):
        decode(cbor2.dumps(_raw(ENTRY) | {"evil": 1}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nonce", True),
        ("nonce", 1.5),
        ("nonce", "7"),
        ("request_id", b"r"),
        ("token_ids", b"\x01"),
        ("token_ids", [1, "2"]),
        ("nonce", 2**64),
        ("sampling", [0.0]),
    ],
)
def test_mistyped_field(field: str, value: object) -> None:
    with pytest.raises(FieldError, match=field):
        decode(cbor2.dumps(_raw(ENTRY) | {field: value}))


def test_int_is_not_a_float() -> None:
    raw = _raw(ENTRY)
    raw["sampling"]["temperature"] = 1
    with pytest.raises(FieldError, match="temperature"):
        decode(cbor2.dumps(raw))


def test_tensor_byte_length_must_match_dtype_and_shape() -> None:
    act = Activation("r", 0, Tensor("float32", (1, 2), b"\0" * 8), 0, SamplingParams(), 1)
    raw = _raw(act)
    raw["hidden"]["data"] = b"\0" * 7
    with pytest.raises(TensorSizeError, match="needs 8 bytes, got 7"):
        decode(cbor2.dumps(raw))
    raw["hidden"]["data"] = b"\0" * 8
    raw["hidden"]["dtype"] = "complex64"
    with pytest.raises(TensorSizeError, match="dtype"):
        decode(cbor2.dumps(raw))


def test_trailing_bytes_and_non_map() -> None:
    with pytest.raises(DecodeError, match="trailing"):
        decode(encode(ENTRY) + b"\x00")
    with pytest.raises(DecodeError, match="map"):
        decode(cbor2.dumps([1, 2]))
    with pytest.raises(DecodeError):
        decode(b"")


def test_tensor_data_is_a_raw_byte_string() -> None:
    data = bytes(range(16))
    act = Activation("r", 0, Tensor("float32", (4,), data), 0, SamplingParams(), 1)
    blob = encode(act)
    assert b"\x50" + data in blob  # CBOR major type 2, length 16, then the raw bytes


def test_bfloat16_round_trips_bit_exactly() -> None:
    import mlx.core as mx

    from mlxcel.runtime.tensors import from_tensor, to_tensor

    a = (mx.random.normal((3, 5)) * 1e3).astype(mx.bfloat16)
    t = to_tensor(a)
    assert t.dtype == "bfloat16" and t.shape == (3, 5) and len(t.data) == 30
    back = from_tensor(decode(encode(Activation("r", 0, t, 0, SamplingParams(), 1))).hidden)  # type: ignore[attr-defined]
    assert back.dtype == mx.bfloat16
    assert mx.array_equal(back.view(mx.uint16), a.view(mx.uint16)).item()


# --- bounds at their edges; what is salvaged from a message that does not decode -------------
def test_a_bundle_of_exactly_max_bundle_items_and_nesting_up_to_max_depth_decode() -> None:
    from mlxcel.wire.codec import MAX_DEPTH

    full = decode(_raw_bundle([_item(ReleaseSequence(f"r{i}")) for i in range(MAX_BUNDLE)]))
    assert isinstance(full, Bundle) and len(full.items) == MAX_BUNDLE
    deep: object = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    with pytest.raises(DecodeError, match="^malformed CBOR: "):
        decode(cbor2.dumps({"kind": ReleaseSequence.KIND, "request_id": deep}))
    with pytest.raises(DecodeError, match=r"^Bundle\.items\[0\]: expected a map, got int$"):
        decode(_raw_bundle([7]))
    with pytest.raises(DecodeError, match="^1 trailing bytes after the message$"):
        decode(encode(ReleaseSequence("r")) + b"\x00")


def test_an_item_that_cannot_travel_in_a_bundle_is_named_with_what_was_salvaged() -> None:
    from mlxcel.wire.codec import salvage

    long_id = "x" * 257
    items = [
        {"kind": 99, "request_id": "a", "nonce": 5},
        {"kind": "x", "request_id": "b", "nonce": 2**64},
        {"kind": RunEntry.KIND, "request_id": long_id, "nonce": -(2**63)},
        {"kind": RunEntry.KIND, "request_id": "y" * 256, "nonce": 2**64 - 1},
    ]
    b = decode(_raw_bundle(items))
    assert isinstance(b, Bundle)
    got = [(u.kind, u.request_id, u.nonce) for u in b.items]  # type: ignore[attr-defined]
    assert got == [
        (99, "a", 5),
        (None, "b", None),  # a kind that is not an integer, a nonce out of range
        (RunEntry.KIND, None, -(2**63)),  # an id longer than 256 is not echoed
        (RunEntry.KIND, "y" * 256, 2**64 - 1),
    ]
    assert b.items[0].reason == "kind 99 cannot travel in a Bundle"  # type: ignore[attr-defined]
    assert b.items[1].reason == "kind 'x' cannot travel in a Bundle"  # type: ignore[attr-defined]
    assert b.items[2].reason.startswith("Bundle.items[2].RunEntry")  # type: ignore[attr-defined]
    assert salvage(cbor2.dumps({"kind": 3, "request_id": "r", "nonce": 1})) == (3, "r", 1, ())
    assert salvage(cbor2.dumps([1, 2])) == (None, None, None, ())
    assert salvage(b"\xff\xff") == (None, None, None, ())
    # A batched message's rows: the pairs that read well, each once, at most 256.
    rows = {"kind": 35, "request_ids": ["a", "b", 7, "a", "c"], "nonces": [1, 2, 3, 1, "x"]}
    assert salvage(cbor2.dumps(rows)) == (35, None, None, (("a", 1), ("b", 2)))
    many = {"kind": 34, "request_ids": [f"r{i}" for i in range(300)], "nonces": list(range(300))}
    assert len(salvage(cbor2.dumps(many))[3]) == 256
    # Pairs as far as both lists go; no rows without both lists.
    short = {"kind": 35, "request_ids": ["a", "b", "c"], "nonces": [1, 2]}
    assert salvage(cbor2.dumps(short)) == (35, None, None, (("a", 1), ("b", 2)))
    assert salvage(cbor2.dumps({"kind": 35, "request_ids": ["a"]})) == (35, None, None, ())
    assert salvage(cbor2.dumps({"kind": 35, "nonces": [1]})) == (35, None, None, ())


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("token_ids", "x", "RunEntry.token_ids: expected an array, got str"),
        ("token_ids", [1, "a"], r"RunEntry.token_ids\[1\]: expected an integer, got str"),
        ("sampling", 5, "RunEntry.sampling: expected a map, got int"),
        ("temperature", "x", "RunEntry.sampling.temperature: expected float, got str"),
        ("request_id", 3, "RunEntry.request_id: expected str, got int"),
        ("micro_batch", True, "RunEntry.micro_batch: expected an integer, got bool"),
    ],
)
def test_a_mistyped_field_is_named_by_its_whole_path(field: str, value: object, why: str) -> None:
    raw = cbor2.loads(encode(RunEntry("r", 0, (1, 2), 0, SamplingParams(), 1)))
    if field == "temperature":
        raw["sampling"] = {**raw["sampling"], "temperature": value}
    else:
        raw[field] = value
    with pytest.raises(FieldError, match=f"^{why}$"):
        decode(cbor2.dumps(raw))


def test_odd_bundle_items_and_old_encoders_are_handled_without_a_crash() -> None:
    from mlxcel.wire.codec import salvage

    with pytest.raises(FieldError, match="items must be an array of 1 to 256 messages"):
        decode(cbor2.dumps({"kind": Bundle.KIND}))
    long_name = "f" * 400
    b = decode(_raw_bundle([{"kind": [1]}, {**_item(ReleaseSequence("r")), long_name: 1}]))
    assert isinstance(b, Bundle)
    assert b.items[0].reason == "kind [1] cannot travel in a Bundle"  # type: ignore[attr-defined]
    assert len(b.items[1].reason) == 300  # type: ignore[attr-defined]
    # An encoder that omits an optional field in the middle: the later ones still count.
    raw = _item(Activation("a", 0, Tensor("uint8", (1,), b"x"), 0, SamplingParams(), 1, owner="o"))
    del raw["compute_us"]
    got = decode(cbor2.dumps(raw))
    assert isinstance(got, Activation) and got.owner == "o" and got.compute_us == 0
    # What is salvaged is parsed with the same depth limit as a message.
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    assert salvage(cbor2.dumps({"kind": 3, "x": deep})) == (None, None, None, ())
