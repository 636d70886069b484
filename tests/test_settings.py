"""Settings checked against each other at start-up, refused with a message naming the settings to
change before any model loads: the session services' limits (specdec/settings.py), under which a
step could never fill, or never hold a verify of the largest K; the coordinator's Redis Cluster,
which needs a URL of database 0; and the variable of a renamed setting."""

import pytest
from pydantic import ValidationError

from coordinator.settings import CoordinatorSettings
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


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "redis_cluster needs redis_url: set it to a node of the cluster"),
        ("redis://redis-cluster:6379/2", "redis_url names database 2, but a Redis Cluster has database 0 only"),
    ],
)
def test_a_redis_cluster_needs_a_url_of_database_0(url, message):
    with pytest.raises(ValidationError, match=message):
        CoordinatorSettings(redis_url=url, redis_cluster=True)
    assert CoordinatorSettings(redis_url="rediss://:pw@redis-cluster:6379/0", redis_cluster=True).redis_cluster


def test_the_variable_of_a_renamed_setting_stops_the_start(monkeypatch):
    """The coordinator's cap on adaptive K was max_num_speculative_tokens, the name of the services'
    per-call limit: its old variable is refused, naming the new one, rather than ignored."""
    assert CoordinatorSettings(adaptive_k_max=4).adaptive_k_max == 4
    monkeypatch.setenv("SPECDEC_COORDINATOR_MAX_NUM_SPECULATIVE_TOKENS", "4")
    with pytest.raises(ValidationError) as refused:
        CoordinatorSettings()
    assert "SPECDEC_COORDINATOR_ADAPTIVE_K_MAX (--adaptive-k-max)" in str(refused.value)
