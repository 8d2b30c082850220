"""The pipeline's prompt cache as tables: the coordinator's index decides (which entry a request
starts from, what a finished one is kept as, what is evicted), the stages carry it out, and
every refusal or mismatch ends in a full prefill, never in wrong tokens. No model, no loop."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxcel.base.effects import DropPrefixes, FreeCache, KeepPrefix, LoadPrefix, Send, Warn
from mlxcel.base.messages import (
    Ack,
    Error,
    ErrorCode,
    EvictPrefixes,
    PrepareSequence,
    ReleaseSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    StepEntry,
    StepResult,
)
from mlxcel.base.prefix_index import PrefixIndex, common_prefix
from mlxcel.pipeline.coordinator_core import CoordinatorCore
from mlxcel.reactor.bus import LOCAL
from tests.pipeline.test_stage_core import EVE, C, core, errors, prepared, sends

S0, S1 = "10.0.1.1:7100", "10.0.1.2:7100"
EOS = 15
ALICE, BOB = "a" * 32, "b" * 32


def coordinator(capacity: int = 1000) -> CoordinatorCore:
    return CoordinatorCore(
        [S0, S1],
        eos={EOS},
        vocab=16,
        max_len=200,
        prefill_step_size=64,
        prompt_cache_tokens=capacity,
        first_entry=500,
    )


def msgs(out: list, cls: type) -> list:  # type: ignore[type-arg]
    return [(e.dest, e.msg) for e in out if isinstance(e, Send) and isinstance(e.msg, cls)]


def run_request(
    c: CoordinatorCore, rid: str, prompt: tuple[int, ...], ns: str, replies: tuple[int, ...]
) -> tuple[list[PrepareSequence], list]:  # type: ignore[type-arg]
    """Drive one request to its end, playing both stages; (its PrepareSequences, the
    effects of its last step)."""
    sp = SamplingParams(max_tokens=len(replies))
    out = c.handle(RunEntry(rid, 0, prompt, 0, sp, 9, cache_ns=ns), LOCAL, 0.0)
    preps = msgs(out, PrepareSequence)
    for dest, p in preps:
        out = c.handle(Ack(rid, p.nonce), dest, 0.1)
    for token in replies:
        (entry,) = [m for _, m in msgs(out, RunEntry)] or [None]
        if entry is not None and not entry.sample:  # a prompt chunk
            out = c.handle(RunResult(rid, 0, (), None, entry.nonce), S1, 0.2)
        (step,) = [m for _, m in msgs(out, StepEntry)]
        out = c.handle(StepResult(0, (rid,), step.nonces, (token,), (0.0,)), S1, 0.3)
    return [p for _, p in preps], out


# --- the coordinator decides -----------------------------------------------------------------


def test_a_finished_request_is_kept_and_a_later_one_of_its_namespace_starts_from_it() -> None:
    c = coordinator()
    prompt = tuple(range(1, 11))
    preps, out = run_request(c, "r1", prompt, ALICE, (3, 4, 5))
    assert all(p.prefix == 0 and p.prefix_len == 0 for p in preps)
    # 10 prompt tokens and two of the three sampled were fed: 12 positions, kept as entry 500.
    releases = msgs(out, ReleaseSequence)
    assert [m for _, m in releases] == [ReleaseSequence("r1", 500, 12)] * 2
    turn2 = (*prompt, 3, 4, 5, 7, 8)
    preps, out = run_request(c, "r2", turn2, ALICE, (6,))
    assert {(p.prefix, p.prefix_len) for p in preps} == {(500, 12)}
    (first,) = [e.msg for e in out if not isinstance(e, Send) and hasattr(e, "msg")]
    assert first.cached_tokens == 12
    # Its own entry replaces the one it grew from, evicted on every stage first.
    evicts = msgs(out, EvictPrefixes)
    assert [m for _, m in evicts] == [EvictPrefixes((500,))] * 2
    assert [m for _, m in msgs(out, ReleaseSequence)] == [ReleaseSequence("r2", 501, 15)] * 2
    assert c.prefixes is not None and list(c.prefixes.entries) == [501]


def test_another_namespace_never_starts_from_an_entry() -> None:
    c = coordinator()
    prompt = tuple(range(1, 11))
    run_request(c, "r1", prompt, ALICE, (3, 4))
    for i, ns in enumerate((BOB, "")):
        preps, out = run_request(c, f"o{i}", prompt, ns, (3,))
        assert {(p.prefix, p.prefix_len) for p in preps} == {(0, 0)}
    # Both were kept in their own namespaces: three entries of the same tokens.
    assert c.prefixes is not None
    assert sorted(e.namespace for e in c.prefixes.entries.values()) == ["", ALICE, BOB]


def test_a_stage_without_the_entry_makes_the_request_prefill_in_full() -> None:
    c = coordinator()
    prompt = tuple(range(1, 11))
    run_request(c, "r1", prompt, ALICE, (3, 4))
    sp = SamplingParams(max_tokens=2)
    out = c.handle(RunEntry("r2", 0, (*prompt, 3, 9), 0, sp, 9, cache_ns=ALICE), LOCAL, 1.0)
    for dest, p in msgs(out, PrepareSequence):
        assert (p.prefix, p.prefix_len) == (500, 11)
        out = c.handle(Ack("r2", p.nonce), dest, 1.1)
    ((_, step),) = msgs(out, StepEntry)  # 11 of 12 cached: straight to the first decode step
    why = "prompt-cache entry 500 is not held here"
    out = c.handle(Error(ErrorCode.PREFIX_NOT_CACHED, why, "r2", step.nonces[0]), S1, 1.2)
    assert not [e for e in out if hasattr(e, "msg") and isinstance(e.msg, Error)]  # no failure
    assert [m for _, m in msgs(out, ReleaseSequence)] == [ReleaseSequence("r2")] * 2
    assert [m for _, m in msgs(out, EvictPrefixes)] == [EvictPrefixes((500,))] * 2
    assert {(p.prefix, p.prefix_len) for _, p in msgs(out, PrepareSequence)} == {(0, 0)}
    assert any(isinstance(e, Warn) and e.kind == "prefix-mismatch" for e in out)
    assert c.refilled == 1 and c.prefixes is not None and len(c.prefixes) == 0


def test_not_cached_from_a_request_that_started_from_nothing_is_a_failure() -> None:
    c = coordinator()
    out = c.handle(RunEntry("r", 0, (1, 2, 3), 0, SamplingParams(max_tokens=2), 9), LOCAL, 0.0)
    for dest, p in msgs(out, PrepareSequence):
        out = c.handle(Ack("r", p.nonce), dest, 0.1)
    ((_, chunk),) = msgs(out, RunEntry)
    out = c.handle(Error(ErrorCode.PREFIX_NOT_CACHED, "?", "r", chunk.nonce), S0, 0.2)
    (err,) = [e.msg for e in out if hasattr(e, "msg") and isinstance(e.msg, Error)]
    assert err.code == ErrorCode.PREFIX_NOT_CACHED and c.refilled == 0


def test_losing_a_stage_forgets_the_index_everywhere() -> None:
    c = coordinator()
    run_request(c, "r1", tuple(range(1, 11)), ALICE, (3, 4))
    out = c.peer_lost(S0, 2.0)
    assert [m for _, m in msgs(out, EvictPrefixes)] == [EvictPrefixes((500,))] * 2
    assert c.prefixes is not None and len(c.prefixes) == 0


def test_without_a_budget_nothing_is_indexed_or_kept() -> None:
    c = coordinator(capacity=0)
    _, out = run_request(c, "r1", tuple(range(1, 11)), ALICE, (3, 4))
    assert c.prefixes is None
    assert [m for _, m in msgs(out, ReleaseSequence)] == [ReleaseSequence("r1")] * 2


# --- the stages carry it out -------------------------------------------------------------------


def test_a_stage_starts_a_sequence_from_an_entry_at_its_length() -> None:
    c = core(index=0, n=2)
    out = c.handle(PrepareSequence("r", 64, 1, prefix=7, prefix_len=20), C, 0.0)
    key = c.seqs["r"].key
    assert out == [LoadPrefix(key, C, 7, 20), Send(C, Ack("r", 1))]
    assert c.seqs["r"].tokens == 20
    # Its first step must start after the prefix.
    out = c.handle(RunEntry("r", 0, (1, 2), 0, SamplingParams(), 5, sample=False), C, 0.1)
    assert errors(out) == [(C, ErrorCode.BAD_REQUEST, 5)]


def test_a_prefix_that_does_not_fit_is_refused() -> None:
    for prefix, length in ((7, 0), (0, 5), (7, 64), (7, -1)):
        c = core(index=0, n=2)
        out = c.handle(PrepareSequence("r", 64, 1, prefix=prefix, prefix_len=length), C, 0.0)
        assert errors(out) == [(C, ErrorCode.BAD_REQUEST, None)] or errors(out)[0][1] == (
            ErrorCode.BAD_REQUEST
        )
        assert "r" not in c.seqs and not any(isinstance(e, LoadPrefix) for e in out)


def test_a_release_keeps_only_a_cache_of_exactly_the_named_length() -> None:
    c = prepared(core(index=0, n=2))
    c.seqs["r"].tokens = 12  # as if its steps had run
    key = c.seqs["r"].key
    out = c.handle(ReleaseSequence("r", 3, 12), C, 1.0)
    assert out[:2] == [KeepPrefix(key, C, 3, 12), FreeCache(key)]
    c = prepared(core(index=0, n=2))
    c.seqs["r"].tokens = 12
    out = c.handle(ReleaseSequence("r", 3, 13), C, 1.0)
    assert not any(isinstance(e, KeepPrefix) for e in out)
    assert any(isinstance(e, Warn) and e.kind == "prefix-mismatch" for e in out)
    assert any(isinstance(e, FreeCache) for e in out)


def test_only_the_coordinator_evicts_and_only_its_own_entries() -> None:
    c = core(index=0, n=2)
    assert c.handle(EvictPrefixes((1, 2)), C, 0.0) == [DropPrefixes(C, (1, 2))]
    out = c.handle(EvictPrefixes((1, 2)), EVE, 0.0)
    assert errors(out) == [(EVE, ErrorCode.NOT_COORDINATOR, None)]
    assert not any(isinstance(e, DropPrefixes) for e in out)
    out = c.handle(EvictPrefixes(tuple(range(4097))), C, 0.0)
    assert errors(out) == [(C, ErrorCode.BAD_REQUEST, None)]


def test_a_lost_owner_connection_drops_its_entries() -> None:
    c = prepared(core(index=0, n=2))
    c.seqs["r"].tokens = 4
    c.handle(ReleaseSequence("r", 3, 4), C, 1.0)
    assert DropPrefixes(C) in c.peer_lost(C, 2.0)
    assert not any(isinstance(e, DropPrefixes) for e in c.peer_lost(EVE, 2.0))
    assert sends(c.peer_lost(C, 3.0)) == []


# --- the index ---------------------------------------------------------------------------------


def test_the_index_pins_what_requests_load_and_evicts_the_oldest_first() -> None:
    ix = PrefixIndex(capacity=10, first_id=1)
    a, gone = ix.insert("n", (1, 2, 3, 4), 0.0)
    assert (a, gone) == (1, [])
    hit = ix.lookup("n", (1, 2, 3, 4), 1.0)  # an exact hit leaves the last token to compute
    assert hit is not None and (hit.entry, hit.tokens) == (1, 3)
    b, gone = ix.insert("n", (5, 6, 7, 8), 2.0)
    assert (b, gone) == (2, [])
    c, gone = ix.insert("n", (9, 9, 9), 3.0)  # full: the oldest unpinned (2) goes, not 1
    assert (c, gone) == (3, [2])
    ix.unpin(1)
    assert ix.insert("n", (7, 7, 7, 7, 7), 4.0) == (4, [1])  # 3 + 5 fit
    assert ix.insert("n", tuple(range(11)), 5.0) == (0, [])  # longer than everything
    assert ix.lookup("m", (7, 7, 7, 7, 7, 1), 6.0) is None  # another namespace


@given(
    st.lists(st.integers(0, 3), max_size=40).map(tuple),
    st.lists(st.integers(0, 3), max_size=40).map(tuple),
)
def test_common_prefix_is_the_first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


@given(
    st.lists(
        st.tuples(st.sampled_from(["x", "y"]), st.lists(st.integers(0, 2), max_size=12)),
        max_size=30,
    )
)
def test_an_index_never_answers_across_namespaces_or_past_its_capacity(ops: list) -> None:  # type: ignore[type-arg]
    ix = PrefixIndex(capacity=30)
    for i, (ns, toks) in enumerate(ops):
        tokens = tuple(toks)
        hit = ix.lookup(ns, tokens, float(i)) if tokens else None
        if hit is not None:
            e = ix.entries[hit.entry]
            assert e.namespace == ns and e.tokens[: hit.tokens] == tokens[: hit.tokens]
            assert 1 <= hit.tokens < len(tokens)
            ix.unpin(hit.entry)
        ix.insert(ns, tokens, float(i))
        assert ix.held == sum(len(e.tokens) for e in ix.entries.values()) <= ix.capacity


def test_a_large_eviction_goes_in_messages_a_stage_accepts() -> None:
    c = coordinator(capacity=20_000)
    assert c.prefixes is not None
    for i in range(5000):
        c.prefixes.insert(f"tenant-{i}", (i + 16, i), 0.0)  # one scan each: fast
    out = c.peer_lost(S0, 1.0)
    per_stage = [[m for d, m in msgs(out, EvictPrefixes) if d == s] for s in (S0, S1)]
    assert [[len(m.entries) for m in ms] for ms in per_stage] == [[4096, 904]] * 2
    stage = core(index=0, n=2)
    for m in per_stage[0]:
        assert stage.handle(m, C, 2.0) == [DropPrefixes(C, m.entries)]
