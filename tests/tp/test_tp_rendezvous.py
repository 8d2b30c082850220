"""Tensor-parallel ranks meet rank 0 over the cluster transport before MLX's group forms:
the roll call's rules exactly, and the rendezvous over real loopback sockets."""

from __future__ import annotations

import asyncio
import os

import pytest

from mlxcel.base.errors import TpGroupFailed
from mlxcel.base.messages import TpJoin
from mlxcel.net.secret import ClusterSecret
from mlxcel.tp.rendezvous import Rendezvous, attend, free_port, ring_address
from mlxcel.tp.roll_call import RollCall
from tests.conftest import until_true

M, H, V = "m" * 64, "h" * 64, "1.0"
A, B, C = "127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.2:5003"


def join(rank: int, ring: str, model: str = M, hostfile: str = H, version: str = V) -> TpJoin:
    return TpJoin(rank, ring, model, hostfile, version)


def test_the_roll_takes_each_rank_once_from_its_own_host() -> None:
    roll = RollCall(3, M, H, V)
    assert roll.missing() == [1, 2] and not roll.complete
    assert roll.join(A, join(1, A)) is None
    assert roll.join(A, join(1, A)) is None  # the same peer again: harmless
    assert roll.join(C, join(2, C)) is None
    assert roll.complete and roll.ring("127.0.0.1:5000") == ("127.0.0.1:5000", A, C)
    assert roll.sources() == [A, C]


@pytest.mark.parametrize(
    ("msg", "source", "why"),
    [
        (join(1, A, version="0.9"), A, "rank 1 runs mlxcel 0.9, rank 0 runs 1.0"),
        (join(0, A), A, "there is no rank 0 in this group of 3 (ranks 1..2 join rank 0)"),
        (join(3, A), A, "there is no rank 3 in this group of 3"),
        (join(1, A, model="x" * 64), A, "rank 1 holds another model"),
        (join(1, A, hostfile=""), A, "rank 1 was started with another hostfile than rank 0's"),
        (join(1, C), A, "rank 1 names ring address 127.0.0.2:5003, which is not on the host"),
        (join(2, B), A, "rank 2 has already joined, from 127.0.0.1:5002"),
        (join(1, B), A, "ring address 127.0.0.1:5002 is already rank 2's"),
    ],
)
def test_a_join_that_does_not_fit_is_refused_by_name(msg: TpJoin, source: str, why: str) -> None:
    roll = RollCall(3, M, H, V)
    assert roll.join(B, join(2, B)) is None
    got = roll.join(source, msg)
    assert got is not None and got.startswith(why), got
    assert roll.missing() == [1]  # nothing of the refused join was kept


def test_a_rank_whose_connection_closed_must_join_again() -> None:
    roll = RollCall(3, M, H, V)
    roll.join(A, join(1, A))
    roll.left(A)
    assert roll.missing() == [1, 2]
    assert roll.join(B, join(1, B)) is None  # the restarted rank, from its new identity


def _secret(fill: int = 7) -> ClusterSecret:
    return ClusterSecret(bytes([fill]) * 32, "test")


def _ring() -> str:
    return ring_address("127.0.0.1", free_port("127.0.0.1"))


async def test_every_rank_learns_one_ring_and_one_step_key_from_rank_0() -> None:
    async with Rendezvous(_secret(), "127.0.0.1:0", RollCall(3, M, H, V)) as rv:
        one, two = _ring(), _ring()
        joins = [
            attend(_secret(), rv.address, join(1, one), 10),
            attend(_secret(), rv.address, join(2, two), 10),
        ]
        lead, *ranks = await asyncio.gather(rv.meet(None, "ring"), *joins)
    assert ranks[0] == ranks[1] == lead
    assert lead.ring[1:] == (one, two) and lead.ring[0].startswith("127.0.0.1:")
    assert lead.ring[0] != rv.address  # rank 0's ring port is not the one it met on
    assert lead.backend == "ring" and len(lead.step_key) == 32


async def test_a_rank_with_another_secret_fails_in_seconds_and_rank_0_waits_on() -> None:
    roll = RollCall(2, M, H, V)
    async with Rendezvous(_secret(), "127.0.0.1:0", roll) as rv:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TpGroupFailed, match="could not join rank 0: .*secret mismatch"):
            await attend(_secret(9), rv.address, join(1, _ring()), 30)
        assert loop.time() - t0 < 5
        assert roll.missing() == [1]
        meet = asyncio.ensure_future(rv.meet(None, "ring"))
        await attend(_secret(), rv.address, join(1, _ring()), 10)  # the right rank still can
        assert (await meet).ring


async def test_a_refused_rank_is_told_why_and_the_right_one_still_joins() -> None:
    roll = RollCall(2, M, H, V)
    async with Rendezvous(_secret(), "127.0.0.1:0", roll) as rv:
        with pytest.raises(TpGroupFailed, match="refused rank 1: rank 1 holds another model"):
            await attend(_secret(), rv.address, join(1, _ring(), model="y" * 64), 10)
        meet = asyncio.ensure_future(rv.meet(None, "ring"))
        got = await attend(_secret(), rv.address, join(1, _ring()), 10)
        assert got == await meet


async def test_a_rank_that_comes_before_rank_0_listens_keeps_dialling() -> None:
    port = free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    early = asyncio.ensure_future(attend(_secret(), address, join(1, _ring()), 20))
    await asyncio.sleep(0.5)
    async with Rendezvous(_secret(), address, RollCall(2, M, H, V)) as rv:
        lead = await rv.meet(address, "ring")
    assert await early == lead and lead.ring[0] == address


async def test_after_the_ring_went_out_rank_0_takes_no_more_connections() -> None:
    async with Rendezvous(_secret(), "127.0.0.1:0", RollCall(2, M, H, V)) as rv:
        meet = asyncio.ensure_future(rv.meet(None, "ring"))
        await attend(_secret(), rv.address, join(1, _ring()), 10)
        await meet
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", rv.port)


def test_the_launch_secret_leaves_the_environment_once_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlxcel.tp.rendezvous import LAUNCH_SECRET_ENV, secret_from_env

    monkeypatch.setenv(LAUNCH_SECRET_ENV, os.urandom(32).hex())
    assert secret_from_env() is not None and LAUNCH_SECRET_ENV not in os.environ
    assert secret_from_env() is None


async def test_a_second_copy_of_a_rank_is_refused_and_its_exit_forgets_nothing() -> None:
    """Two processes started as rank 1 (one hostfile, so one ring address): the second is
    refused, and when it goes the first is still in the roll."""
    roll = RollCall(3, M, H, V)
    ring = _ring()
    async with Rendezvous(_secret(), "127.0.0.1:0", roll) as rv:
        meet = asyncio.ensure_future(rv.meet(None, "ring"))
        first = asyncio.ensure_future(attend(_secret(), rv.address, join(1, ring), 10))
        await until_true(lambda: roll.missing() == [2])
        with pytest.raises(TpGroupFailed, match="refused rank 1: rank 1 has already joined"):
            await attend(_secret(), rv.address, join(1, ring), 10)
        await asyncio.sleep(0.2)  # the refused copy's connection is gone by now
        assert roll.missing() == [2]
        await attend(_secret(), rv.address, join(2, _ring()), 10)
        assert (await first) == (await meet)


async def test_a_rank_whose_rank_0_went_away_joins_the_next_one() -> None:
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    roll = RollCall(3, M, H, V)  # rank 2 never comes: this rank 0 gives up
    async with Rendezvous(_secret(), address, roll):
        waiting = asyncio.ensure_future(attend(_secret(), address, join(1, _ring()), 20))
        await until_true(lambda: roll.missing() == [2])
    async with Rendezvous(_secret(), address, RollCall(2, M, H, V)) as again:
        lead = await again.meet(address, "ring")
    assert await waiting == lead


def test_a_stranger_in_mlx_s_group_is_found_before_any_step(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each rank contributes its tag under the launch's key to one all-sum; a process that
    took a rank's place in MLX's ring cannot make that rank's tag."""
    import mlx.core as mx
    import numpy as np

    from mlxcel.tp.group import member_tag, prove_members

    key = os.urandom(32)

    class Group:
        def size(self) -> int:
            return 3

    def summed(stranger: int | None):  # type: ignore[no-untyped-def]
        def all_sum(x, group=None):  # type: ignore[no-untyped-def]
            total = np.array(x).copy()
            for r in (1, 2):  # what the other ranks added
                if r != stranger:
                    total[r] = np.frombuffer(member_tag(key, r, 3), dtype=np.uint8)
                else:
                    total[r] = np.frombuffer(os.urandom(16), dtype=np.uint8)
            return mx.array(total)

        return all_sum

    monkeypatch.setattr(mx.distributed, "all_sum", summed(None))
    prove_members(Group(), 0, key)  # everyone holds the key
    monkeypatch.setattr(mx.distributed, "all_sum", summed(2))
    with pytest.raises(TpGroupFailed, match=r"rank\(s\) 2 of MLX's group do not hold"):
        prove_members(Group(), 0, key)


async def test_a_second_rank_0_on_the_same_address_says_so() -> None:
    async with Rendezvous(_secret(), "127.0.0.1:0", RollCall(2, M, H, V)) as rv:
        with pytest.raises(TpGroupFailed, match="is another rank 0 of this hostfile running"):
            async with Rendezvous(_secret(), rv.address, RollCall(2, M, H, V)):
                pass
