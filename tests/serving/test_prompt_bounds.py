"""A prompt's length is checked before its memory is spent; request bodies share a budget;
the HTTP guard's deadline tightens as its connection cap fills."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mlxcel.base.errors import AdmissionRejected, RequestError
from mlxcel.server.body_budget import BodyBudget
from mlxcel.server.http_guard import MIN_HEADER_TIMEOUT, HttpGuard
from mlxcel.serving.prompts import CHUNK_CHARS, encode_within, render_chat
from mlxcel.serving.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(tiny)[0]


WORDS = "hello world <|im_start|> ünïcödé 日本語 12345\n  the quick brown fox "


@pytest.mark.parametrize("chars", [10, CHUNK_CHARS - 1, CHUNK_CHARS + 1, 3 * CHUNK_CHARS + 17])
def test_a_prompt_that_fits_gets_exactly_one_passs_ids(tok, chars: int) -> None:  # type: ignore[no-untyped-def]
    text = (WORDS * (chars // len(WORDS) + 1))[:chars]
    want = list(tok.encode(text))
    assert encode_within(tok, text, len(want) + 10) == want
    msgs = [{"role": "user", "content": text}]
    chat = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
    rendered = render_chat(tok, msgs, add_generation_prompt=True)
    assert encode_within(tok, rendered, len(chat) + 10, special=False) == chat


def test_a_prompt_over_the_context_is_refused_from_its_first_piece(tok) -> None:  # type: ignore[no-untyped-def]
    text = (WORDS * 100_000)[:3_900_000]
    with pytest.raises(RequestError) as exc:
        encode_within(tok, text, 4096, param="messages")
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "messages"
    assert f"its first {CHUNK_CHARS} of 3900000 characters" in str(exc.value)


def test_a_prompt_just_over_the_context_in_its_last_piece_is_refused_there(tok) -> None:  # type: ignore[no-untyped-def]
    text = (WORDS * 10_000)[: 2 * CHUNK_CHARS + 20_000]
    n = len(tok.encode(text, add_special_tokens=False))
    with pytest.raises(RequestError, match=f"its first {len(text)} of {len(text)}"):
        encode_within(tok, text, n - 1000)
    assert encode_within(tok, text, n) == list(tok.encode(text))  # at the limit: not refused


async def test_bodies_wait_in_order_for_the_budget_and_are_refused_after_the_wait() -> None:
    budget = BodyBudget(100)
    order: list[str] = []
    release = asyncio.Event()

    async def body(name: str, size: int, wait: float) -> None:
        async with budget.hold(size, wait):
            order.append(name)
            await release.wait()

    big = asyncio.create_task(body("first", 80, 1))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(body("second", 50, 5))
    await asyncio.sleep(0)
    small = asyncio.create_task(body("small", 10, 5))  # fits, but waits its turn (no starving)
    await asyncio.sleep(0.01)
    assert order == ["first"] and budget.used == 80
    with pytest.raises(AdmissionRejected, match="budget of"):
        async with budget.hold(100, 0.05):
            pass
    assert budget.refused == 1
    release.set()
    await asyncio.gather(big, waiting, small)
    assert order == ["first", "second", "small"] and budget.used == 0


async def test_a_cancelled_wait_gives_nothing_away() -> None:
    budget = BodyBudget(10)
    async with budget.hold(10, 1):
        t = asyncio.create_task(budget.hold(5, 5).__aenter__())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
    assert budget.used == 0
    async with budget.hold(10, 0.1):
        assert budget.used == 10


async def test_the_header_deadline_shrinks_as_the_cap_fills() -> None:
    g = HttpGuard(max_connections=100, header_timeout=10.0)
    assert g.max_per_source == 8  # 100 // 32 is below the floor of 8
    for n, want in ((0, 10.0), (50, 10.0), (75, 5.0), (99, MIN_HEADER_TIMEOUT)):
        g.open = {object(): None for _ in range(n)}  # type: ignore[misc]
        assert g.header_deadline() == pytest.approx(want)
    assert HttpGuard(max_connections=3840).max_per_source == 120


class _Transport:
    def __init__(self, ip: str) -> None:
        self.ip, self.aborted = ip, False

    def get_extra_info(self, key: str) -> object:
        return (self.ip, 1234) if key == "peername" else None

    def abort(self) -> None:
        self.aborted = True

    close = abort

    def get_write_buffer_size(self) -> int:
        return 0


class _Inner:
    def connection_made(self, transport: object) -> None: ...

    def connection_lost(self, exc: object) -> None: ...


async def test_at_the_cap_eviction_looks_past_an_address_whose_connections_are_all_busy() -> None:
    """The busiest address holds only connections inside requests: the next busiest pays."""
    g = HttpGuard(max_connections=64)
    make = g.factory(_Inner)  # type: ignore[arg-type]

    def connect(ip: str) -> tuple[object, _Transport]:
        conn, t = make(), _Transport(ip)
        conn.connection_made(t)  # type: ignore[arg-type]
        return conn, t

    for _ in range(8):
        conn, _ = connect("10.0.0.1")
        conn.begin()  # type: ignore[attr-defined]  # headers in: inside a request
    idle = {f"10.0.0.{a}": [connect(f"10.0.0.{a}")[1] for _ in range(7)] for a in range(2, 10)}
    assert len(g.open) == 64
    _, newcomer = connect("192.168.1.1")
    assert not newcomer.aborted and g.evicted == 1
    assert sum(t.aborted for ts in idle.values() for t in ts) == 1


async def test_a_cancelled_tokenization_keeps_its_share_until_the_thread_ends() -> None:
    """A client that leaves cannot stop the worker thread tokenizing its prompt, so the
    caller (and the body budget it holds) waits for the thread before letting go."""
    import threading

    from mlxcel.serving.frontend import _to_the_end

    release = threading.Event()
    done: list[str] = []

    def slow() -> str:
        release.wait(5)
        done.append("x")
        return "ids"

    task = asyncio.create_task(_to_the_end(slow))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the thread
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == ["x"]
