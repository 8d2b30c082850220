"""The membership lines every watching role logs (mlxcel.base.membership): joined once, lost with
the reason, back with how long and why; a flapping node's lines held and counted."""

from __future__ import annotations

from mlxcel.base.effects import Warn
from mlxcel.base.membership import BURST, WINDOW, MembershipLog


def texts(out: list[Warn]) -> list[str]:
    return [w.text for w in out]


def test_joined_lost_and_back_each_say_what_happened() -> None:
    m = MembershipLog("router")
    assert m.joined("decode-0", "", 0.0) == [Warn("info", "router: decode-0 joined")]
    assert m.joined("decode-0", "", 1.0) == []  # known and up: nothing to say
    assert m.back("decode-0", "", 1.0) == []  # never lost
    assert m.lost("decode-0", "no answer to a ping within 2.0s", 2.0) == [
        Warn("warning", "router: decode-0 lost: no answer to a ping within 2.0s")
    ]
    assert m.lost("decode-0", "refused", 3.0) == []  # already lost: said once
    assert m.back("decode-0", "refused", 5.5) == [
        Warn("info", "router: decode-0 is back after 3.5s down (refused)")
    ]
    assert texts(m.lost("stage-1", "", 6.0)) == ["router: stage-1 lost: no reason given"]
    assert texts(m.joined("s", "s0, layers 0-4", 7.0)) == ["router: s joined (s0, layers 0-4)"]


def test_a_flapping_node_is_counted_not_logged_line_by_line() -> None:
    m = MembershipLog("coordinator")
    out = m.joined("n", "", 0.0)
    t = 0.0
    for _ in range(20):  # down and up every second
        t += 1
        out += m.lost("n", "refused", t)
        t += 1
        out += m.back("n", "refused", t)
    assert len(out) == BURST  # joined, lost, back, lost; the other 37 changes held
    assert texts(out)[-1] == "coordinator: n lost: refused"
    # The log says "lost" while the held "back"s leave it up; once the window has passed,
    # the next change is logged with the count of those not.
    t += WINDOW
    (line,) = m.lost("n", "reset", t)
    assert line.text == "coordinator: n lost: reset (37 more changes not logged: it is flapping)"
    assert texts(m.back("n", "reset", t + 2)) == ["coordinator: n is back after 2.0s down (reset)"]


def test_the_log_never_says_back_while_the_node_is_down() -> None:
    m = MembershipLog("router")
    said = "up"
    up = True
    for i in range(200):
        t = i * 0.5
        lines = m.back("x", "", t) if not up else m.lost("x", "gone", t)
        up = not up
        for w in lines:
            said = "up" if "back" in w.text else "down"
        assert said == "down" or up  # a logged "back" is true
