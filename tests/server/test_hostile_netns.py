"""A heavy client and a few addresses against a serving node, on real network stacks
(:mod:`mlxcel.bench.hostile`). Each of these failed on the code before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.bench.hostile import FLOOD_CAP, big_prompts, http_flood
from mlxcel.bench.hostile_cluster import full_decode, restart_under_flood, slow_handoff
from mlxcel.bench.netns import unavailable
from mlxcel.server.http_guard import raise_fd_limit

why = unavailable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")


def test_six_concurrent_prompts_far_over_the_context_cost_no_gigabytes(tiny: Path) -> None:
    """Six 3.9 MB prompts at once, each under the body cap and far over the context: each is
    refused by name, and the server's peak memory grows by at most 256 MiB (before: 4.7 GiB,
    2.6 GiB of it kept; every prompt was tokenized whole before its length was checked)."""
    r = big_prompts(tiny, n=6, chars=3_900_000)
    assert r.statuses == {"400": 6}, r
    assert r.codes == {"context_length_exceeded": 6}, r
    assert r.peak_growth_mib <= 256, r


def test_five_addresses_trickling_960_connections_each_leave_room_for_a_sixth(
    tiny: Path,
) -> None:
    """Five addresses hold 960 trickling connections each against a cap of 3,840 (a host
    whose descriptor limit is 4,096): a sixth address still gets its health probes answered
    (before: 0 of 20, the cap full of a quarter per address)."""
    raise_fd_limit()
    r = http_flood(tiny, 5, 960, 20, *FLOOD_CAP)
    assert r.cut > 1000, r  # the flood was real: the server kept closing its extra sockets
    assert r.answered >= 18, r


def test_at_the_cap_a_new_address_takes_the_place_of_the_busiest_ones_oldest(
    tiny: Path,
) -> None:
    """Forty addresses hold their whole share (8 each) of a 256-connection cap: the cap is
    full, and a new address is let in by closing an unfinished connection of the busiest."""
    raise_fd_limit()
    r = http_flood(tiny, 40, 8, 10, "--max-http-connections", "256")
    assert r.answered >= 9, r


def test_a_long_prompt_crosses_a_one_megabit_prefill_link_and_short_ones_go_meanwhile(
    tiny: Path, tmp_path: Path
) -> None:
    """A 2,000-token prompt (2 MB of KV) whose prefill node's link is shaped to 1 Mbit/s,
    and 40 short requests meanwhile, one every 0.2 s, all to the one decode node: the long
    one completes (its lease renewed by every part written; the router's deadline moved by
    the prefill node's progress reports) and the short ones pass between its parts (before:
    504 after 10.5 s, and all 40 short ones failed behind it)."""
    r = slow_handoff(tiny, tmp_path, prompt_tokens=2000, shorts=40, every=0.2, rate="1mbit")
    assert r.long_status == 200, r
    assert r.shorts_ok >= 38, r


def test_a_member_that_fills_a_decode_node_sends_the_requests_to_the_other_one(
    tiny: Path, tmp_path: Path
) -> None:
    """A member keeps decode-0's 256 slots busy with handoffs it never commits: each request
    the router gives decode-0 is refused before its prompt's first token (the prefill node
    asks for a slot as the prompt starts) and starts over on decode-1; every client is
    served (before: a third failed with handoff_failed while decode-1 sat idle)."""
    r = full_decode(tiny, tmp_path, requests=40, every=0.1)
    assert r.filled >= 200, r  # the attack was real: decode-0 took the member's handoffs
    assert r.ok == r.requests, r


def test_a_restarted_decode_node_told_its_router_is_back_during_a_half_open_flood(
    tiny: Path, tmp_path: Path
) -> None:
    """Seventy addresses hold every unfinished-handshake slot of decode-1's port while it
    restarts. Told the router's address (--router-peers), decode-1 lets the router's dial in
    from the members' pool: back in rotation in seconds, not when the flood ends (before, and
    still without the flag: 39 s of a 40 s flood)."""
    r = restart_under_flood(tiny, tmp_path, sources=70, flood_s=30.0, router_peers=True)
    assert r.attacker.get("closed_by_server", 0) > 1000, r  # the flood was real
    assert r.back_s is not None and r.back_s < 15.0, r
