"""The public gRPC server's edge (docs/security.md#the-public-grpc-server, docs/limits.md#grpc-connections):
a call without an API key is refused from its metadata before its message is read, and holds no
place that health checks and calls with a key need, even when it never finishes sending its
message (the raw HTTP/2 attack of scripts/abuse_check.py, on a coordinator with keys and a small
--max-concurrent-rpcs); a request message still arriving past --grpc-request-message-timeout-s
ends its call and frees what it sent; every gRPC server (coordinator, draft, verify) applies its HTTP/2
connection limits: streams per connection, idle and age limits, keepalive enforcement."""

import contextlib
import ctypes
import socket
import time

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from coordinator.api.client import generate, stream
from coordinator.settings import CoordinatorSettings
from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from scripts.abuse_check import GENERATE, HEALTH_CHECK, StalledStreams
from specdec.rpc.health_check import health_status
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2
from tests.conftest import CoordinatorThread
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings

KEY = "edge-key-0123456789abcdef"
MAX_CALLS = 4  # the coordinator's --max-concurrent-rpcs here: far fewer than the stalled streams
STALLED = 300  # 3 connections of 100 streams
MESSAGE_TIMEOUT_S = 2.0  # the coordinator's --grpc-request-message-timeout-s here
PATIENT_MESSAGE_TIMEOUT_S = 8.0  # the same, where a test's client sends 100 MiB (see patient)
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
LONG = coordinator_pb2.GenerateRequest(text="Tell me a long story.", max_new_tokens=200, num_speculative_tokens=0)
SHORT = coordinator_pb2.GenerateRequest(text="hello", max_new_tokens=2)


def keyed_coordinator(tiny_pipeline, tiny_models, message_timeout_s: float) -> CoordinatorThread:
    """A coordinator with an API key and a bound on calls, on the tiny pipeline's services."""
    return CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=tiny_pipeline.draft_address,
            verify_addresses=[tiny_pipeline.verify_address],
            tokenizer=str(tiny_models.target_dir),
            api_keys=[KEY],
            max_concurrent_rpcs=MAX_CALLS,
            grpc_request_message_timeout_s=message_timeout_s,
        )
    )


@pytest.fixture(scope="module")
def keyed(tiny_pipeline, tiny_models):
    thread = keyed_coordinator(tiny_pipeline, tiny_models, MESSAGE_TIMEOUT_S)
    yield thread
    thread.stop()


def server_connections(port: int) -> list:
    """This process's TCP connections accepted on ``port`` (the coordinator runs in it)."""
    return [c for c in psutil.Process().net_connections("tcp") if c.laddr.port == port and c.raddr]


def eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def serves_as_usual(address: str) -> None:
    """The health check answers SERVING, a keyed request completes, and MAX_CALLS keyed streams run
    at once: no place is held by anyone else."""
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
    assert len(generate(address, SHORT, timeout_s=30, api_key=KEY).token_ids) == 2
    running = [stream(address, LONG, timeout_s=60, api_key=KEY) for _ in range(MAX_CALLS)]
    try:
        assert all(next(call).token_ids for call in running)
    finally:
        for call in running:
            call.close()


@pytest.mark.parametrize(
    "path,metadata",
    [(GENERATE, ()), (GENERATE, (("authorization", "Bearer not-a-key"),))],
    ids=["no-key", "wrong-key"],
)
def test_stalled_streams_without_a_key_are_refused_at_once_and_hold_nothing(keyed, path, metadata):
    address = f"127.0.0.1:{keyed.port}"
    started = time.monotonic()
    streams = StalledStreams("127.0.0.1", keyed.port, path, STALLED, metadata=metadata)
    try:
        assert streams.wait_answered(10.0), streams.statuses()
        assert streams.statuses() == {"UNAUTHENTICATED": STALLED}
        assert time.monotonic() - started < 10.0
        serves_as_usual(address)  # the attacker's connections still open
    finally:
        streams.close()
    eventually(lambda: not server_connections(keyed.port))


def test_stalled_health_checks_hold_no_place_either(keyed):
    """Health checks are open without a key: one that never finishes sending its message stays
    open (until --grpc-request-message-timeout-s), and holds nothing the others need."""
    streams = StalledStreams("127.0.0.1", keyed.port, HEALTH_CHECK, STALLED, declared=1024)
    try:
        time.sleep(0.5)
        assert streams.statuses() == {"open": STALLED}
        serves_as_usual(f"127.0.0.1:{keyed.port}")
    finally:
        streams.close()
    eventually(lambda: not server_connections(keyed.port))


def test_a_call_without_a_key_is_refused_with_what_to_send(keyed):
    address = f"127.0.0.1:{keyed.port}"
    for api_key, words in ((None, "missing API key"), ("nope", "invalid API key")):
        with pytest.raises(grpc.RpcError) as refused:
            generate(address, SHORT, timeout_s=10, api_key=api_key)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert words in refused.value.details() and "--api-key" in refused.value.details()


def test_a_call_that_ends_without_its_request_message_is_told_to_send_one(keyed):
    with grpc.insecure_channel(f"127.0.0.1:{keyed.port}", options=GRPC_OPTIONS) as channel:
        call = channel.stream_stream(GENERATE)  # Generate's path, its request stream ended empty
        with pytest.raises(grpc.RpcError) as refused:
            list(call(iter(()), metadata=[("authorization", f"Bearer {KEY}")], timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "the call ended without its request message: send one before ending it"


def test_calls_with_a_key_past_the_limit_are_refused_naming_it_while_health_answers(keyed):
    address = f"127.0.0.1:{keyed.port}"
    running = [stream(address, LONG, timeout_s=60, api_key=KEY) for _ in range(MAX_CALLS)]
    try:
        assert all(next(call).token_ids for call in running)
        with pytest.raises(grpc.RpcError) as refused:
            generate(address, SHORT, timeout_s=10, api_key=KEY)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-rpcs" in refused.value.details()
        assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for call in running:
            call.close()
    eventually(lambda: _completes(address))


def _completes(address: str) -> bool:
    try:
        return len(generate(address, SHORT, timeout_s=30, api_key=KEY).token_ids) == 2
    except grpc.RpcError:
        return False


@pytest.mark.parametrize(
    "path,metadata",
    [(HEALTH_CHECK, ()), (GENERATE, (("authorization", f"Bearer {KEY}"),)), (REFLECTION, ())],
    ids=["health-check", "keyed-generate", "reflection"],
)
def test_a_request_message_still_arriving_past_its_deadline_ends_the_call(keyed, path, metadata):
    """100 calls that each send 60 KiB of a 64 KiB message, then nothing: gRPC holds what arrived
    until the message is whole, so each ends with DEADLINE_EXCEEDED naming
    --grpc-request-message-timeout-s once that has passed (not before), while the others serve as
    usual."""
    started = time.monotonic()
    streams = StalledStreams("127.0.0.1", keyed.port, path, 100, sent=b"\x0a" * 61440, metadata=metadata)
    try:
        time.sleep(MESSAGE_TIMEOUT_S / 2)
        assert streams.statuses() == {"open": 100}
        assert streams.wait_answered(MESSAGE_TIMEOUT_S + 10.0), streams.statuses()
        assert time.monotonic() - started > MESSAGE_TIMEOUT_S
        assert streams.statuses() == {"DEADLINE_EXCEEDED": 100}
        assert all("--grpc-request-message-timeout-s" in details for details in streams.details.values())
        serves_as_usual(f"127.0.0.1:{keyed.port}")
    finally:
        streams.close()
    eventually(lambda: not server_connections(keyed.port))


def resident_bytes() -> int:
    """This process's resident memory once glibc has handed back what is free (malloc_trim)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


@pytest.fixture
def patient(tiny_pipeline, tiny_models):
    """A keyed coordinator whose message deadline leaves a client time to send 100 MiB on a loaded
    machine (the suite's other worker computing beside it slows this process's client to about
    15 MB/s, which the module's 2 s deadline cut at 22 MB)."""
    thread = keyed_coordinator(tiny_pipeline, tiny_models, PATIENT_MESSAGE_TIMEOUT_S)
    yield thread
    thread.stop()


def test_what_a_stalled_request_message_sent_is_freed_when_its_call_ends(patient):
    """100 health checks that each send 1 MiB of their message but not its last bytes: the server
    holds about 100 MiB meanwhile, and hands it back once --grpc-request-message-timeout-s has ended
    the calls, though the client keeps its connection open: closing the connection afterwards frees
    little more."""
    before = resident_bytes()
    streams = StalledStreams(
        "127.0.0.1", patient.port, HEALTH_CHECK, 100, declared=1 << 20, sent=b"\x0a" * ((1 << 20) - 16)
    )
    try:
        streams.wait_sent(PATIENT_MESSAGE_TIMEOUT_S * 0.75)
        held = resident_bytes() - before
        assert streams.sent > 50 << 20 and held > streams.sent / 2  # what the calls sent is held: the attack is real
        assert streams.wait_answered(PATIENT_MESSAGE_TIMEOUT_S + 10.0), streams.statuses()
        assert streams.statuses() == {"DEADLINE_EXCEEDED": 100}
        after_the_calls = resident_bytes()
        assert server_connections(patient.port)  # the calls ended, not the connection
    finally:
        streams.close()
    eventually(lambda: not server_connections(patient.port))
    assert after_the_calls - resident_bytes() < streams.sent / 4


def test_health_watch_and_reflection_answer_without_a_key(keyed):
    """The open services work through the interceptor: a health Watch (whose behaviour writes its
    responses rather than yielding them) and a reflection client listing the services."""
    address = f"127.0.0.1:{keyed.port}"
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "specdec.v1.CoordinatorService" in services and "grpc.health.v1.Health" in services


# --- HTTP/2 connection limits on every gRPC server ------------------------------------------------


class RawConnection:
    """A raw HTTP/2 client connection (the ``h2`` package): what the server sends, as events."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=0.1)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.events: list = []
        self.buffer = b""
        self.flush()

    def flush(self) -> None:
        self.sock.sendall(self.h2.data_to_send())

    def read_until(self, found, timeout_s: float):
        """The first event ``found(event)`` accepts, reading for up to ``timeout_s`` seconds; None
        when none came (or the server closed the connection first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if match := next((event for event in self.events if found(event)), None):
                return match
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            self.receive(data)
        return next((event for event in self.events if found(event)), None)

    def receive(self, data: bytes) -> None:
        """Hands h2 one frame at a time: it refuses any frame after a GOAWAY (the server's
        WINDOW_UPDATEs), losing the events of the frames read with it."""
        self.buffer += data
        while len(self.buffer) >= 9 and len(self.buffer) >= 9 + int.from_bytes(self.buffer[:3], "big"):
            end = 9 + int.from_bytes(self.buffer[:3], "big")
            frame, self.buffer = self.buffer[:end], self.buffer[end:]
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.events += self.h2.receive_data(frame)
        with contextlib.suppress(OSError):
            self.flush()

    def open_stalled(self, path: str, count: int) -> list[int]:
        """``count`` calls to ``path`` that send part of their message, then nothing."""
        ids = []
        for _ in range(count):
            stream_id = self.h2.get_next_available_stream_id()
            headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x")]
            self.h2.send_headers(stream_id, [*headers, ("content-type", "application/grpc"), ("te", "trailers")])
            self.h2.send_data(stream_id, b"\x00\x00\x00\x04\x00\x0a")
            ids.append(stream_id)
        self.flush()
        return ids

    def close(self) -> None:
        self.sock.close()


LIMITS = {
    "grpc_max_concurrent_streams": 3,
    "grpc_max_connection_idle_s": 0.5,
    "grpc_max_connection_age_s": 3.0,
    "grpc_max_connection_age_grace_s": 0.5,
    "grpc_min_ping_interval_s": 60.0,
    "grpc_max_ping_strikes": 2,
}


@pytest.fixture(scope="module", params=["coordinator", "draft", "verify"])
def limited_port(request, tiny_pipeline, tiny_models, tiny_target):
    """A server of each kind with small HTTP/2 connection limits (LIMITS): its port."""
    if request.param == "coordinator":
        thread = CoordinatorThread(
            CoordinatorSettings(
                port=0,
                draft_address=tiny_pipeline.draft_address,
                verify_addresses=[tiny_pipeline.verify_address],
                tokenizer=str(tiny_models.target_dir),
                **LIMITS,
            )
        )
        yield thread.port
        thread.stop()
        return
    if request.param == "draft":
        service = build_draft(
            DraftSettings(port=0, default_drafter="ngram", **LIMITS), drafters={"ngram": NgramDrafter()}
        )
    else:
        service = build_verify(VerifySettings(port=0, **LIMITS), target=tiny_target)
    yield service.port
    service.stop(0)


def test_streams_per_connection_are_bounded(limited_port):
    connection = RawConnection(limited_port)
    try:
        stalled = connection.open_stalled(HEALTH_CHECK, 5)  # sent before the server's settings arrive
        settings = connection.read_until(lambda e: isinstance(e, h2.events.RemoteSettingsChanged), 5.0)
        assert settings.changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value == 3
        connection.read_until(lambda e: False, 1.0)
        reset = {event.stream_id for event in connection.events if isinstance(event, h2.events.StreamReset)}
        assert reset == {stalled[3], stalled[4]}  # those past the 3 the server announced
    finally:
        connection.close()


def test_an_idle_connection_is_closed(limited_port):
    connection = RawConnection(limited_port)
    try:
        started = time.monotonic()
        assert connection.read_until(lambda e: isinstance(e, h2.events.ConnectionTerminated), 5.0)
        assert time.monotonic() - started < 2.5  # before the age limit (3 s)
    finally:
        connection.close()


def test_an_old_connection_is_closed_and_its_calls_cut_after_the_grace(limited_port):
    connection = RawConnection(limited_port)
    try:
        connection.open_stalled(HEALTH_CHECK, 1)  # in flight: the connection is not idle
        started = time.monotonic()
        goaway = connection.read_until(lambda e: isinstance(e, h2.events.ConnectionTerminated), 10.0)
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
        assert 2.5 < time.monotonic() - started < 6.0  # at 3 s, give or take gRPC's jitter
        # past the grace the call is cut (its stream reset or the connection closed)
        ended = connection.read_until(lambda e: isinstance(e, h2.events.StreamReset | h2.events.StreamEnded), 5.0)
        assert ended is not None or connection.sock.recv(1) == b""
    finally:
        connection.close()


def test_a_client_pinging_too_often_is_closed(limited_port):
    connection = RawConnection(limited_port)
    try:
        goaway = None
        for n in range(10):
            connection.h2.ping(n.to_bytes(8, "big"))
            connection.flush()
            if goaway := connection.read_until(lambda e: isinstance(e, h2.events.ConnectionTerminated), 0.05):
                break
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert goaway.additional_data == b"too_many_pings"
    finally:
        connection.close()


def test_the_connection_age_limit_is_on_the_public_server_only():
    """Off on the draft and verify services, whose callers (coordinators) keep a Step stream open
    as long as the connection lives: cutting it would fail the calls in flight on it."""
    assert CoordinatorSettings(insecure=True).grpc_max_connection_age_s == 3600.0
    assert DraftSettings(port=0).grpc_max_connection_age_s == 0.0
    assert VerifySettings(port=0).grpc_max_connection_age_s == 0.0
