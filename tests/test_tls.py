"""TLS and mutual TLS (specdec/rpc/tls.py): the coordinator's public gRPC and HTTP APIs over TLS, the
draft and verify services accepting only clients whose certificate the configured CA signed,
certificate rotation without a restart, startup errors naming the setting, Redis over rediss://
with a password, `specdec health` over TLS as the Kubernetes tls component's probes run it.
Certificates come from trustme (the services' own CA for ``specdec up --tls``, specdec_app/local_ca.py,
is checked too)."""

import asyncio
import datetime
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
import trustme
from fastapi import FastAPI
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from coordinator.api.client import generate
from coordinator.api.http_api import HttpServer
from coordinator.request_store.store import RedisStore, StoredRequest, StoreUnavailable
from coordinator.settings import CoordinatorSettings
from coordinator.speculation import upstream
from coordinator.speculation.upstream import ServiceClients
from coordinator.speculation.verify_client import VerifyClient
from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.rpc.errors import Unavailable
from specdec.rpc.server import start_server
from specdec.rpc.tls import ReloadingSSLContext, channel_credentials, reloading_channel_credentials, server_credentials
from specdec.settings import parse_settings
from specdec.v1 import coordinator_pb2
from specdec_app.launcher import LocalCluster, free_port
from specdec_app.local_ca import write_local_certificates
from tests.conftest import CoordinatorThread, RedisClusterNodes
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings

# a fresh connection per channel: gRPC would otherwise share one between channels to an address
FRESH = [("grpc.use_local_subchannel_pool", 1)]
HOSTS = ["127.0.0.1", "localhost"]
SETTINGS = {"coordinator": CoordinatorSettings, "draft": DraftSettings, "verify": VerifySettings}


class Files:
    """PEM files of trustme certificates in a directory."""

    def __init__(self, root: Path):
        self.root = root

    def ca(self, ca: trustme.CA, name: str) -> str:
        path = self.root / f"{name}.pem"
        ca.cert_pem.write_to_path(str(path))
        return str(path)

    def leaf(self, leaf: trustme.LeafCert, name: str) -> tuple[str, str]:
        """(certificate chain, key) files, each replaced atomically (as a Secret update swaps them)."""
        paths = (self.root / f"{name}.pem", self.root / f"{name}-key.pem")
        chain = b"".join(blob.bytes() for blob in leaf.cert_chain_pems)
        for data, path in ((leaf.private_key_pem.bytes(), paths[1]), (chain, paths[0])):
            staged = path.with_suffix(".new")
            staged.write_bytes(data)
            os.replace(staged, path)
        return str(paths[0]), str(paths[1])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    files = Files(tmp_path_factory.mktemp("pki"))
    ca, other_ca = trustme.CA(), trustme.CA()
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    return {
        "files": files,
        "ca_obj": ca,
        "ca": files.ca(ca, "ca"),
        "server": files.leaf(ca.issue_cert(*HOSTS), "server"),
        "public": files.leaf(ca.issue_cert(*HOSTS), "public"),
        "client": files.leaf(ca.issue_cert("specdec-coordinator"), "client"),
        "other_client": files.leaf(other_ca.issue_cert("specdec-coordinator"), "other-client"),
        "expired_client": files.leaf(
            ca.issue_cert("specdec-coordinator", not_before=past - datetime.timedelta(days=1), not_after=past),
            "expired",
        ),
    }


def server_tls(pki) -> dict:
    cert, key = pki["server"]
    return {"tls_cert_file": cert, "tls_key_file": key, "tls_client_ca_file": pki["ca"]}


@pytest.fixture(scope="module")
def tls_pipeline(pki, tiny_models, tiny_target):
    """Verify and draft services on mutual TLS, a coordinator with TLS on its gRPC and HTTP APIs."""
    ngram = NgramDrafter(1, 3)
    ngram.measure_step_ms()
    verify = build_verify(VerifySettings(port=0, max_sessions=8, **server_tls(pki)), target=tiny_target)
    draft = build_draft(
        DraftSettings(port=0, drafters=["ngram"], default_drafter="ngram", max_sessions=8, **server_tls(pki)),
        drafters={"ngram": ngram},
    )
    (cert, key), (client_cert, client_key) = pki["public"], pki["client"]
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            http_port=free_port(),
            draft_address=f"127.0.0.1:{draft.port}",
            verify_addresses=[f"127.0.0.1:{verify.port}"],
            tokenizer=str(tiny_models.target_dir),
            tls_cert_file=cert,
            tls_key_file=key,
            internal_tls_ca_file=pki["ca"],
            internal_tls_cert_file=client_cert,
            internal_tls_key_file=client_key,
        )
    )
    yield {
        "coordinator": f"127.0.0.1:{coordinator.port}",
        "http_port": coordinator.http_port,
        "draft": f"127.0.0.1:{draft.port}",
        "verify": f"127.0.0.1:{verify.port}",
    }
    coordinator.stop()
    draft.stop(0)
    verify.stop(0)


def health(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    """The health status, or raises grpc.RpcError."""
    channel = (
        grpc.secure_channel(address, credentials, options=FRESH)
        if credentials
        else grpc.insecure_channel(address, options=FRESH)
    )
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def assert_unavailable(call) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value


def request(max_new_tokens: int = 8) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(text="Hello there", max_new_tokens=max_new_tokens, raw_prompt=True)


def test_generate_over_tls(tls_pipeline, pki):
    credentials = channel_credentials(pki["ca"])
    completion = generate(tls_pipeline["coordinator"], request(), timeout_s=60, credentials=credentials)
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"


def test_http_api_over_tls(tls_pipeline, pki):
    with httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"])) as http:
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{tls_pipeline['http_port']}/v1", api_key="none", http_client=http
        )
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="Hello there", max_tokens=6)
    assert completion.usage.completion_tokens == 6


def test_plaintext_or_a_wrong_ca_fails_and_servers_go_on(tls_pipeline, pki, tmp_path):
    for service in ("coordinator", "draft", "verify"):
        assert_unavailable(lambda address=tls_pipeline[service]: health(address, None))
    assert_unavailable(lambda: generate(tls_pipeline["coordinator"], request(), timeout_s=10))
    other_ca = Files(tmp_path).ca(trustme.CA(), "other-ca")
    other = channel_credentials(other_ca)
    assert_unavailable(lambda: generate(tls_pipeline["coordinator"], request(), timeout_s=10, credentials=other))
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{tls_pipeline['http_port']}/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # a CA that did not sign the coordinator's certificate
        httpx.get(f"https://127.0.0.1:{tls_pipeline['http_port']}/health", verify=other_ca_context(), timeout=5)
    test_generate_over_tls(tls_pipeline, pki)  # nothing crashed


def other_ca_context() -> ssl.SSLContext:
    return ssl.create_default_context(cadata=trustme.CA().cert_pem.bytes().decode())


@pytest.mark.parametrize("service", ["draft", "verify"])
def test_internal_services_take_only_the_cas_clients(tls_pipeline, pki, service):
    address, ca = tls_pipeline[service], pki["ca"]
    assert health(address, channel_credentials(ca, *pki["client"])) == health_pb2.HealthCheckResponse.SERVING
    assert_unavailable(lambda: health(address, channel_credentials(ca)))  # no client certificate
    assert_unavailable(lambda: health(address, channel_credentials(ca, *pki["other_client"])))  # another CA's
    assert_unavailable(lambda: health(address, channel_credentials(ca, *pki["expired_client"])))  # expired


def test_an_expired_server_certificate_is_refused(pki, tmp_path):
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    expired = pki["ca_obj"].issue_cert(*HOSTS, not_before=past - datetime.timedelta(days=1), not_after=past)
    credentials = server_credentials(*Files(tmp_path).leaf(expired, "old"))
    server, port = start_server(lambda _server: [], "127.0.0.1", 0, 2, credentials)
    try:
        assert_unavailable(lambda: health(f"127.0.0.1:{port}", channel_credentials(pki["ca"])))
    finally:
        server.stop(0)


def test_a_rotated_certificate_is_served_without_a_restart(pki, tmp_path):
    files, old_ca, new_ca = Files(tmp_path), pki["ca_obj"], trustme.CA()
    old_ca_file, new_ca_file = pki["ca"], files.ca(new_ca, "new-ca")
    cert, key = files.leaf(old_ca.issue_cert(*HOSTS), "rotating")
    server, port = start_server(lambda _server: [], "127.0.0.1", 0, 2, server_credentials(cert, key))
    address = f"127.0.0.1:{port}"
    try:
        assert health(address, channel_credentials(old_ca_file)) == health_pb2.HealthCheckResponse.SERVING
        files.leaf(new_ca.issue_cert(*HOSTS), "rotating")
        assert health(address, channel_credentials(new_ca_file)) == health_pb2.HealthCheckResponse.SERVING
        assert_unavailable(lambda: health(address, channel_credentials(old_ca_file)))
        (Path(key)).write_bytes(trustme.CA().issue_cert(*HOSTS).private_key_pem.bytes())  # a key of no certificate
        assert health(address, channel_credentials(new_ca_file)) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_coordinator_follows_its_rotated_client_certificate(tls_pipeline, pki, tmp_path, monkeypatch):
    """The coordinator's client certificate files rewritten: its next calls go over new channels
    with the new certificate (one of another CA: refused; the CA's own again: accepted)."""
    monkeypatch.setattr(upstream, "TLS_CHECK_INTERVAL_S", 0.0)
    files, ca = Files(tmp_path), pki["ca_obj"]
    cert, key = files.leaf(ca.issue_cert("specdec-coordinator"), "coordinator")
    names = ("internal_tls_ca_file", "internal_tls_cert_file", "internal_tls_key_file")
    tls = reloading_channel_credentials(pki["ca"], cert, key, names)

    async def run() -> None:
        clients = ServiceClients([tls_pipeline["draft"]], [tls_pipeline["verify"]], 10, 10, tls=tls)
        replicas = VerifyClient(clients)
        try:
            assert (await clients.draft_info(tls_pipeline["draft"])).drafters
            files.leaf(trustme.CA().issue_cert("specdec-coordinator"), "coordinator")
            with pytest.raises(Unavailable):
                await replicas.info()
            files.leaf(ca.issue_cert("specdec-coordinator"), "coordinator")
            assert (await replicas.info()).model
        finally:
            await clients.close()

    asyncio.run(run())


def test_http_api_serves_a_rotated_certificate(pki, tmp_path):
    files, new_ca = Files(tmp_path), trustme.CA()
    cert, key = files.leaf(pki["ca_obj"].issue_cert(*HOSTS), "http")
    new_ca_context = ssl.create_default_context(cadata=new_ca.cert_pem.bytes().decode())

    async def handshake(context: ssl.SSLContext, port: int) -> None:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        writer.close()

    async def run() -> None:
        port = free_port()
        http = HttpServer(FastAPI(), "127.0.0.1", port, ReloadingSSLContext(cert, key))
        await http.start()
        try:
            await handshake(ssl.create_default_context(cafile=pki["ca"]), port)
            with pytest.raises(ssl.SSLCertVerificationError):
                await handshake(new_ca_context, port)
            files.leaf(new_ca.issue_cert(*HOSTS), "http")
            await handshake(new_ca_context, port)
        finally:
            await http.stop()

    asyncio.run(run())


def test_misconfigured_tls_fails_at_start_naming_the_setting(pki, tmp_path):
    cert, key = pki["server"]
    other_key = pki["other_client"][1]
    with pytest.raises(ValidationError, match=r"tls_cert_file /missing\.pem: No such file"):
        VerifySettings(tls_cert_file="/missing.pem", tls_key_file=key)
    with pytest.raises(ValidationError, match=r"tls_cert_file .* / tls_key_file .*private key it was issued for"):
        DraftSettings(tls_cert_file=cert, tls_key_file=other_key)
    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file: set both"):
        DraftSettings(tls_client_ca_file=pki["ca"])
    with pytest.raises(ValidationError, match="internal_tls_cert_file and internal_tls_key_file"):
        CoordinatorSettings(internal_tls_ca_file=pki["ca"], internal_tls_cert_file=cert)
    with pytest.raises(ValidationError, match="redis_url rediss://"):
        CoordinatorSettings(redis_tls_ca_file=pki["ca"])
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate")
    with pytest.raises(ValidationError, match="tls_client_ca_file"):
        VerifySettings(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=str(not_pem))


def test_local_ca_for_specdec_up_tls(tmp_path):
    """The CA `specdec up --tls` makes: its server certificate passes the server's checks, and a
    client with its CA and client certificate gets through mutual TLS; the flags each service
    starts with give mutual TLS inside and TLS outside."""
    files = write_local_certificates(tmp_path, ["127.0.0.1"])
    cluster = LocalCluster(tls=files)
    flags = {name: parse_settings(cls, cluster.tls_args(name), prog=name) for name, cls in SETTINGS.items()}
    assert flags["draft"].tls_client_ca_file == flags["verify"].tls_client_ca_file == str(files.ca_file)
    coordinator = flags["coordinator"]
    assert coordinator.tls_cert_file and not coordinator.tls_client_ca_file
    assert coordinator.internal_tls_cert_file == str(files.client_cert_file)
    assert oct(files.server_key_file.stat().st_mode & 0o777) == "0o600"
    credentials = server_credentials(str(files.server_cert_file), str(files.server_key_file), str(files.ca_file))
    server, port = start_server(lambda _server: [], "127.0.0.1", 0, 2, credentials)
    try:
        client = channel_credentials(str(files.ca_file), str(files.client_cert_file), str(files.client_key_file))
        assert health(f"127.0.0.1:{port}", client) == health_pb2.HealthCheckResponse.SERVING
        assert_unavailable(lambda: health(f"127.0.0.1:{port}", channel_credentials(str(files.ca_file))))
    finally:
        server.stop(0)


@pytest.fixture
def tls_redis(pki, tmp_path):
    """redis-server with TLS only (no plaintext port) and a password; skips when built without TLS."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh --test (it installs Debian's redis-server)")
    cert, key = pki["server"]
    port = free_port()
    log = tmp_path / "redis.log"
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            cert,
            "--tls-key-file",
            key,
            "--tls-ca-cert-file",
            pki["ca"],
            "--tls-auth-clients",
            "no",
            "--requirepass",
            "s3cret",
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(log),
        ],
    )
    client = redis.Redis(port=port, password="s3cret", ssl=True, ssl_ca_certs=pki["ca"])
    deadline = time.monotonic() + 10
    try:
        while True:
            if process.poll() is not None:
                output = log.read_text() if log.exists() else ""
                if "tls" in output.lower() and "not" in output.lower():
                    pytest.skip(f"this redis-server has no TLS support: {output.strip()[-200:]}")
                pytest.fail(f"redis-server with TLS exited: {output}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server over TLS did not answer within 10 s"
                time.sleep(0.05)
        yield port
    finally:
        process.kill()
        process.wait()


def test_redis_store_over_tls_with_a_password(tls_redis, pki):
    def store(url: str) -> RedisStore:
        errors = Counter("store_errors", "", ["operation"], registry=CollectorRegistry())
        return RedisStore(url, 60, errors, ssl_ca_certs=pki["ca"])

    async def run() -> None:
        good = store(f"rediss://:s3cret@127.0.0.1:{tls_redis}/0")
        record = StoredRequest("tls-1", coordinator_pb2.GenerateRequest(text="hi"), "target", "fp", generated=[1, 2])
        assert await good.create(record)
        assert (await good.load("tls-1")).generated == [1, 2]
        await good.close()
        wrong = store(f"rediss://:wrong@127.0.0.1:{tls_redis}/0")
        with pytest.raises(StoreUnavailable) as caught:
            await wrong.load("tls-1")
        assert "wrong" not in str(caught.value) and ":***@" in str(caught.value)
        await wrong.close()

    asyncio.run(run())


def test_redis_store_on_a_cluster_over_tls_with_a_password(pki, tmp_path):
    """A Redis Cluster of three masters whose nodes speak TLS only (clients, cluster bus,
    replication) and ask for a password: the store reaches each master as it reaches one Redis,
    from rediss://:PASSWORD@<a node> and the CA file (redis_tls_ca_file), and a wrong password is
    StoreUnavailable with the password masked."""
    cert, key = pki["server"]
    nodes = RedisClusterNodes(tmp_path, replicas=0, password="s3cret", tls=(pki["ca"], cert, key))

    def store(url: str) -> RedisStore:
        errors = Counter("store_errors", "", ["operation"], registry=CollectorRegistry())
        return RedisStore(url, 60, errors, cluster=True, ssl_ca_certs=pki["ca"])

    async def run() -> None:
        good = store(nodes.url)
        request = coordinator_pb2.GenerateRequest(text="hi")
        ids = [f"tls-{i}" for i in range(12)]  # over every master's slots
        for i, request_id in enumerate(ids):
            assert await good.create(StoredRequest(request_id, request, "target", "fp", generated=[i]))
        assert [(await good.load(request_id)).generated for request_id in ids] == [[i] for i in range(12)]
        await good.close()
        wrong = store(nodes.url.replace(":s3cret@", ":wrong@"))
        with pytest.raises(StoreUnavailable) as caught:
            await wrong.load("tls-1")
        assert "wrong" not in str(caught.value) and ":***@" in str(caught.value)
        await wrong.close()

    try:
        nodes.start()
        masters = {nodes.master_of(f"specdec:request:{{tls-{i}}}").port for i in range(12)}
        assert len(masters) == 3, masters
        asyncio.run(run())
    finally:
        nodes.stop()


SPECDEC = str(Path(sys.executable).parent / "specdec")  # the entry point a container's probe runs


def specdec_health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SPECDEC, "health", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("service", ["coordinator", "draft", "verify"])
def test_health_command_over_tls_as_the_probes_run_it(tls_pipeline, pki, service):
    """`specdec health` as the tls component's exec probes run it in each pod: against the
    coordinator with the CA of its certificate, against the draft and verify services (mutual TLS)
    with the service's own certificate as the client certificate; the certificate checked against
    --server-name rather than the address's host. Exit code 0 and the status."""
    cert, key = pki["server"]
    own = ["--tls-cert", cert, "--tls-key", key] if service != "coordinator" else []
    address = f"127.0.0.1:{tls_pipeline[service].rpartition(':')[2]}"
    result = specdec_health("--address", address, "--tls-ca", pki["ca"], *own, "--server-name", "localhost")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{address}: SERVING"


def test_health_command_fails_unless_the_server_answers_serving(pki):
    """Exit code 1, saying why, from a mutual-TLS server that answers NOT_SERVING (as a draft or
    verify service whose engine died or hung does), or refuses a client without a certificate; from
    one that never answers, within --timeout; from an address nothing listens on."""
    cert, key = pki["server"]
    tls = ["--tls-ca", pki["ca"], "--tls-cert", cert, "--tls-key", key]
    health_servicer = grpc_health.HealthServicer()
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', server_credentials(cert, key, pki['ca']))}"
    server.start()
    try:
        assert specdec_health("--address", address, *tls).returncode == 0
        health_servicer.enter_graceful_shutdown()  # every service NOT_SERVING
        not_serving = specdec_health("--address", address, *tls)
        assert not_serving.returncode == 1 and not_serving.stdout.strip() == f"{address}: NOT_SERVING"
        without_certificate = specdec_health("--address", address, "--tls-ca", pki["ca"])
        assert without_certificate.returncode == 1 and "no health answer: UNAVAILABLE" in without_certificate.stderr
    finally:
        server.stop(0)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes the connection, never answers
        started = time.monotonic()
        hanging = specdec_health("--address", f"127.0.0.1:{silent.getsockname()[1]}", *tls, "--timeout", "1")
        assert hanging.returncode == 1 and "no health answer: DEADLINE_EXCEEDED" in hanging.stderr
        assert time.monotonic() - started < 15  # the process's start included
    nothing = specdec_health("--address", f"127.0.0.1:{free_port()}", *tls)
    assert nothing.returncode == 1 and "no health answer: UNAVAILABLE" in nothing.stderr
