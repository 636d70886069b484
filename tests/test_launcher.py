"""specdec_app/launcher.py: what the services started on one machine get besides their flags
(the processes themselves: tests/test_supervision.py and the multi-process tests)."""

from types import SimpleNamespace

from specdec_app import launcher
from specdec_app.launcher import service_env


def test_the_draft_sleeps_between_forwards_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert service_env("draft") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert service_env("verify") == service_env("coordinator") == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice is kept (inherited)
    assert service_env("draft") == {}


def test_free_port_never_returns_a_port_twice(monkeypatch):
    """The kernel may give a port it just released again: free_port skips one it returned before."""
    kernel_ports = iter([40001, 40002, 40002, 40001, 40003])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(kernel_ports)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launcher, "socket", SimpleNamespace(socket=Socket))
    monkeypatch.setattr(launcher, "_handed_out", set())
    assert [launcher.free_port() for _ in range(3)] == [40001, 40002, 40003]
