"""The session services' limits are checked against each other at start-up (specdec/settings.py):
a combination under which a step could never fill, or never hold a verify of the largest K, is
refused with a message naming the settings to change, before any model loads."""

import pytest
from pydantic import ValidationError

from draft_service.settings import DraftSettings
from specdec.settings import RESERVED_WORKERS, parse_settings
from verify_service.settings import VerifySettings


@pytest.mark.parametrize("cls", [VerifySettings, DraftSettings])
def test_handler_threads_default_to_one_per_session(cls):
    settings = cls(port=0, max_sessions=32)
    assert settings.max_workers == 32 + RESERVED_WORKERS >= settings.max_num_seqs


@pytest.mark.parametrize(
    ("args", "named"),
    [
        # 16 sequences a step, but only 4 calls served at once: no step could hold more than 4
        (["--max-workers", "4", "--max-num-seqs", "16"], ("max_workers (4)", "max_num_seqs (16)")),
        # a verify of K = 16 is 17 tokens, more than a step takes
        (["--max-num-batched-tokens", "8"], ("max_num_batched_tokens (8)", "max_num_speculative_tokens + 1 (17)")),
    ],
)
@pytest.mark.parametrize("cls", [VerifySettings, DraftSettings])
def test_limits_that_contradict_each_other_are_refused_at_start_up(cls, args, named):
    with pytest.raises(ValidationError) as refused:
        parse_settings(cls, args, prog="specdec serve")
    message = str(refused.value)
    assert all(name in message for name in named), message
    assert "raise" in message and "lower" in message  # it says what to change


def test_an_explicit_thread_count_that_fits_is_kept():
    assert VerifySettings(port=0, max_workers=20, max_num_seqs=16).max_workers == 20
