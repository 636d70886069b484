"""specdec_app/launcher.py: what the services started on one machine get besides their flags
(the processes themselves: tests/test_supervision.py and the multi-process tests)."""

from specdec_app.launcher import service_env


def test_the_draft_sleeps_between_forwards_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert service_env("draft") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert service_env("verify") == service_env("coordinator") == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice is kept (inherited)
    assert service_env("draft") == {}
