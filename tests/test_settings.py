"""Settings checked against each other at start-up, refused with a message naming the settings to
change before any model loads: the session services' limits (specdec/settings.py), under which a
step could never fill, or never hold a verify of the largest K; the draft service's default
drafter, which must be among the drafters it hosts; the coordinator's Redis Cluster, which needs a
URL of database 0; and the variable of a renamed setting."""

import subprocess
import sys

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


def test_a_default_drafter_the_draft_service_does_not_host_is_refused_naming_both_settings(monkeypatch):
    """``--drafters ngram`` alone leaves out the default drafter (llama-cpp): refused with both
    settings by flag and variable, and what to change."""
    with pytest.raises(ValidationError) as refused:
        parse_settings(DraftSettings, ["--drafters", "ngram"], prog="specdec serve draft")
    message = str(refused.value)
    for words in (
        "--default-drafter (SPECDEC_DRAFT_DEFAULT_DRAFTER) is 'llama-cpp'",
        "--drafters (SPECDEC_DRAFT_DRAFTERS) does not list (it lists ngram)",
        "add it (--drafters ngram,llama-cpp), or set --default-drafter to one it lists",
    ):
        assert words in message, message
    with pytest.raises(ValidationError, match=r"'eagle', a drafter .* set --default-drafter to one it lists"):
        DraftSettings(port=0, default_drafter="eagle")  # not a drafter at all: no "add it"
    monkeypatch.setenv("SPECDEC_DRAFT_DRAFTERS", "ngram")
    monkeypatch.setenv("SPECDEC_DRAFT_DEFAULT_DRAFTER", "ngram")
    assert parse_settings(DraftSettings, [], prog="specdec serve draft").default_drafter == "ngram"


def test_specdec_serve_draft_refuses_it_before_any_model_loads():
    """From the command line: an error line and exit code 2 within seconds, no traceback, no model."""
    command = [sys.executable, "-m", "specdec_app", "serve", "draft", "--drafters", "ngram", "--insecure"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "error: specdec serve draft: --default-drafter (SPECDEC_DRAFT_DEFAULT_DRAFTER)" in refused.stderr
    assert "Traceback" not in refused.stderr and "llama" not in refused.stderr.replace("llama-cpp", "")


def test_the_variable_of_a_renamed_setting_stops_the_start(monkeypatch):
    """The coordinator's cap on adaptive K was max_num_speculative_tokens, the name of the services'
    per-call limit: its old variable is refused, naming the new one, rather than ignored."""
    assert CoordinatorSettings(adaptive_k_max=4).adaptive_k_max == 4
    monkeypatch.setenv("SPECDEC_COORDINATOR_MAX_NUM_SPECULATIVE_TOKENS", "4")
    with pytest.raises(ValidationError) as refused:
        CoordinatorSettings()
    assert "SPECDEC_COORDINATOR_ADAPTIVE_K_MAX (--adaptive-k-max)" in str(refused.value)
