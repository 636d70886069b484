"""The fault tests' RPC delay hook: its option's parsing (the interceptor itself runs in tests/test_faults.py)."""

import pytest

from specdec.rpc.delay_hook import parse_delays


def test_parse_delays_in_seconds():
    assert parse_delays([]) == {}
    assert parse_delays(["Prefill=1000", "Verify=2.5"]) == {"Prefill": 1.0, "Verify": 0.0025}


@pytest.mark.parametrize("pair", ["Prefill", "=100", "Prefill=-1", "Prefill=soon"])
def test_a_bad_pair_is_named(pair):
    with pytest.raises(ValueError, match=f"{pair!r} is not METHOD=MS"):
        parse_delays([pair])


def test_delayed_starters_hold_the_named_calls_and_keep_their_deadline():
    """A Propose held 50 ms starts on a pool thread with its deadline counted from its arrival; a
    call of another RPC, and one after the delays are cleared, start at once on the caller's thread."""
    import threading
    import time

    from specdec.rpc.delay_hook import delayed_starters

    started = []

    def propose(request, timeout_s, abandoned, reply):
        started.append((request, timeout_s, threading.current_thread().name, time.monotonic()))
        reply(None)

    delays = {"Propose": 0.05}
    starters = delayed_starters({"propose": propose, "verify": propose}, delays, max_workers=1)
    replies = []
    sent = time.monotonic()
    starters["propose"]("held", 1.0, lambda: False, replies.append)
    starters["verify"]("not held", None, lambda: False, replies.append)
    assert [s[0] for s in started] == ["not held"] and started[0][2] == threading.current_thread().name
    deadline = time.monotonic() + 5
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    request, timeout_s, thread, at = started[1]
    assert request == "held" and thread.startswith("step-call") and at - sent >= 0.05
    assert 0.8 < timeout_s <= 0.95
    delays.clear()
    starters["propose"]("at once", None, lambda: False, replies.append)
    assert started[-1][0] == "at once" and len(replies) == 3
    assert delayed_starters({"propose": propose}, {}, 1)["propose"] is propose  # production: unwrapped
