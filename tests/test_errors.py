"""specdec.rpc.errors: the status of a call to another service becomes the error this process
raises, and so the status its own caller sees."""

import grpc
import pytest

from specdec.rpc.errors import InvalidArgument, NotFound, SpecdecError, Unavailable, from_status


@pytest.mark.parametrize(
    ("code", "raised"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.DEADLINE_EXCEEDED, Unavailable),  # retried on another replica
        (grpc.StatusCode.CANCELLED, Unavailable),  # a stopping server cancels its calls in flight
        (grpc.StatusCode.DATA_LOSS, SpecdecError),  # anything else: INTERNAL
    ],
)
def test_a_status_becomes_its_error(code, raised):
    error = from_status(code, "details", "verify service 127.0.0.1:1")
    assert type(error) is raised
    assert "verify service 127.0.0.1:1" in str(error)
    assert error.code == (raised.code if raised is not SpecdecError else grpc.StatusCode.INTERNAL)
