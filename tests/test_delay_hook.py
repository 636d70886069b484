"""The fault tests' RPC delay hook: its option's parsing (the interceptor itself runs in tests/test_faults.py)."""

import pytest

from specdec.delay_hook import parse_delays


def test_parse_delays_in_seconds():
    assert parse_delays([]) == {}
    assert parse_delays(["Prefill=1000", "Verify=2.5"]) == {"Prefill": 1.0, "Verify": 0.0025}


@pytest.mark.parametrize("pair", ["Prefill", "=100", "Prefill=-1", "Prefill=soon"])
def test_a_bad_pair_is_named(pair):
    with pytest.raises(ValueError, match=f"{pair!r} is not METHOD=MS"):
        parse_delays([pair])
