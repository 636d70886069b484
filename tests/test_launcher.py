"""specdec_app/launcher.py: what the services started on one machine get besides their flags
(the processes themselves: tests/test_supervision.py and the multi-process tests)."""

from types import SimpleNamespace

import pytest

from specdec_app import launcher
from specdec_app.launcher import service_env


def test_the_draft_sleeps_between_forwards_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert service_env("draft") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert service_env("verify") == service_env("coordinator") == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice is kept (inherited)
    assert service_env("draft") == {}


def kernel_gives(monkeypatch, *ports: int) -> None:
    """Makes free_port's sockets bind to ``ports`` in turn (as the kernel's choices), this process
    having handed out none and no partition set."""
    kernel_ports = iter(ports)

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
    monkeypatch.delenv("SPECDEC_PORT_PARTITION", raising=False)


def test_free_port_never_returns_a_port_twice(monkeypatch):
    """The kernel may give a port it just released again: free_port skips one it returned before."""
    kernel_gives(monkeypatch, 40001, 40002, 40002, 40001, 40003)
    assert [launcher.free_port() for _ in range(3)] == [40001, 40002, 40003]


def test_free_port_keeps_to_its_partition(monkeypatch):
    """With SPECDEC_PORT_PARTITION=i/n only ports of the blocks of 64 numbered i modulo n come out
    (the test workers'), whatever their parity (a kernel may give bind ports of one parity only)."""
    block = launcher.PORT_BLOCK
    kernel_gives(monkeypatch, 0 * block + 2, 1 * block + 2, 2 * block + 4, 4 * block + 6, 5 * block)
    monkeypatch.setenv("SPECDEC_PORT_PARTITION", "1/3")
    assert [launcher.free_port() for _ in range(2)] == [1 * block + 2, 4 * block + 6]


@pytest.mark.parametrize("value", ["2/2", "1", "a/2", "-1/2"])
def test_a_malformed_port_partition_is_refused(monkeypatch, value):
    kernel_gives(monkeypatch, 40001)
    monkeypatch.setenv("SPECDEC_PORT_PARTITION", value)
    with pytest.raises(ValueError, match="SPECDEC_PORT_PARTITION"):
        launcher.free_port()
