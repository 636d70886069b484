"""Secure by default (docs/security.md#secure-by-default): a draft or verify service without mutual
TLS, and a coordinator without API keys, refuse to start unless started insecure (``--insecure``,
``SPECDEC_<SERVICE>_INSECURE``), with a message that names what to set; with mutual TLS, or keys,
they start. ``specdec up``, ``demo`` and ``bench`` (specdec_app/launcher.py) start each service
with ``--insecure`` exactly where it would refuse otherwise. Every test here runs without the
variables tests/conftest.py sets for the other tests, and without API keys in the environment."""

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from coordinator.api.auth import MIN_KEY_BITS, ApiKeys, key_bits, owner_hash
from coordinator.api.client import generate
from coordinator.settings import CoordinatorSettings
from draft_service.settings import DraftSettings
from specdec.rpc.tls import channel_credentials
from specdec.settings import parse_settings
from specdec.v1.coordinator_pb2 import GenerateRequest
from specdec_app.launcher import LocalCluster, free_port
from specdec_app.local_ca import LocalCertificates, write_local_certificates
from tests.conftest import INSECURE_VARIABLES
from verify_service.settings import VerifySettings

SETTINGS = {"coordinator": CoordinatorSettings, "draft": DraftSettings, "verify": VerifySettings}
KEY_VARIABLES = ("SPECDEC_API_KEYS", "SPECDEC_COORDINATOR_API_KEYS", "SPECDEC_COORDINATOR_API_KEY_FILE")
# What each service's refusal names: what is missing and the flags that supply it.
REFUSALS = {
    "coordinator": ["no API keys", "--api-key", "SPECDEC_COORDINATOR_API_KEYS", "--api-key-file"],
    "draft": ["no mutual TLS", "--tls-client-ca-file"],
    "verify": ["no mutual TLS", "--tls-client-ca-file"],
}


@pytest.fixture(autouse=True)
def secure_environment(monkeypatch):
    for name in (*INSECURE_VARIABLES, *KEY_VARIABLES):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> LocalCertificates:
    return write_local_certificates(tmp_path_factory.mktemp("tls"), ["127.0.0.1"])


def assert_refused(message: str, service: str) -> None:
    for words in [*REFUSALS[service], "not --insecure", f"--insecure (SPECDEC_{service.upper()}_INSECURE=true)"]:
        assert words in message, (words, message)


@pytest.mark.parametrize("service", SETTINGS)
def test_refuses_to_start_unauthenticated_unless_insecure(service, monkeypatch):
    with pytest.raises(ValidationError) as refused:
        SETTINGS[service](port=0)
    assert_refused(str(refused.value), service)
    assert SETTINGS[service](port=0, insecure=True).insecure
    monkeypatch.setenv(f"SPECDEC_{service.upper()}_INSECURE", "true")  # the variable the message names
    assert SETTINGS[service](port=0).insecure


@pytest.mark.parametrize("cls", [DraftSettings, VerifySettings])
def test_draft_and_verify_start_with_mutual_tls(cls, certificates):
    server = {"tls_cert_file": str(certificates.server_cert_file), "tls_key_file": str(certificates.server_key_file)}
    assert not cls(port=0, **server, tls_client_ca_file=str(certificates.ca_file)).insecure
    with pytest.raises(ValidationError, match="no mutual TLS"):  # TLS alone lets any client in
        cls(port=0, **server)


def test_coordinator_starts_with_keys(tmp_path, monkeypatch, certificates):
    assert CoordinatorSettings(api_keys=["k1"]).api_keys == ["k1"]
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nk2\n")
    assert CoordinatorSettings(api_key_file=str(keys)).api_keys == ["k2"]
    monkeypatch.setenv("SPECDEC_COORDINATOR_API_KEYS", "k3")
    assert CoordinatorSettings().api_keys == ["k3"]
    monkeypatch.delenv("SPECDEC_COORDINATOR_API_KEYS")
    keys.write_text("# no key yet\n")  # an API keys Secret with no key in it
    with pytest.raises(ValidationError, match="no API keys"):
        CoordinatorSettings(api_key_file=str(keys))
    with pytest.raises(ValidationError, match="no API keys"):  # client certificates do not name tenants: keys do
        CoordinatorSettings(
            tls_cert_file=str(certificates.server_cert_file),
            tls_key_file=str(certificates.server_key_file),
            tls_client_ca_file=str(certificates.ca_file),
        )


@pytest.mark.parametrize("service", ["coordinator", "draft"])
def test_a_refused_service_says_what_to_set_without_a_traceback(service):
    """`specdec serve` as a process: exit status 2, one line per error, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "serve", service, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: specdec serve {service}: ")
    assert_refused(line, service)


@pytest.mark.parametrize(
    ("tls", "keys", "insecure"),
    [
        (False, False, {"coordinator", "draft", "verify"}),
        (True, False, {"coordinator"}),
        (False, True, {"draft", "verify"}),
        (True, True, set()),
    ],
)
def test_the_launcher_sets_insecure_where_a_service_would_refuse(tls, keys, insecure, certificates, monkeypatch):
    """`specdec up [--tls]` with and without API keys in its environment: each service's flags
    start it (its settings validate), with --insecure on exactly the services that need it."""
    if keys:
        monkeypatch.setenv("SPECDEC_API_KEYS", "k1")
    cluster = LocalCluster(tls=certificates if tls else None)
    assert set(cluster.insecure) == insecure
    for service, cls in SETTINGS.items():
        settings = parse_settings(cls, cluster.service_process(service).args, prog=service)
        assert settings.insecure == (service in insecure), service


def test_the_launcher_leaves_an_unreadable_key_file_to_the_coordinator(monkeypatch, tmp_path):
    """Not --insecure: the coordinator then refuses to start on the file, naming it."""
    monkeypatch.setenv("SPECDEC_COORDINATOR_API_KEY_FILE", str(tmp_path / "missing"))
    cluster = LocalCluster()
    assert "coordinator" not in cluster.insecure
    with pytest.raises(ValidationError, match=r"api_key_file .*missing: No such file"):
        parse_settings(CoordinatorSettings, cluster.service_process("coordinator").args, prog="coordinator")


@pytest.mark.multiprocess
def test_specdec_up_tls_leaves_only_the_coordinator_insecure(tiny_models, tmp_path):
    """`specdec up --tls` in an environment with no opt-out and no key: the draft and verify
    services start on mutual TLS alone, the coordinator with --insecure, the banner says so, and a
    request over TLS is served."""
    env = {
        **os.environ,
        "SPECDEC_VERIFY_MODEL": str(tiny_models.target_dir),
        "SPECDEC_VERIFY_NUM_THREADS": "1",
        "SPECDEC_DRAFT_DRAFTERS": "ngram",
        "SPECDEC_DRAFT_DEFAULT_DRAFTER": "ngram",
        "SPECDEC_COORDINATOR_TOKENIZER": str(tiny_models.target_dir),
    }
    ports = {name: free_port() for name in ("coordinator", "draft", "verify")}
    args = [f"--{name}-port={port}" for name, port in ports.items()]
    args += ["--http-port=0", *(f"--{name}-metrics-port=0" for name in ports), "--tls", f"--tls-dir={tmp_path}"]
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "specdec", "up", *args], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 180
        while "all services SERVING" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        banner = log.read_text()
        assert f"insecure (--insecure): the coordinator at 127.0.0.1:{ports['coordinator']}" in banner
        assert "the draft service at" not in banner and "the verify service at" not in banner
        credentials = channel_credentials(str(tmp_path / "ca.pem"))
        request = GenerateRequest(text="Hello", max_new_tokens=4, raw_prompt=True)
        completion = generate(f"127.0.0.1:{ports['coordinator']}", request, timeout_s=60, credentials=credentials)
        assert len(completion.token_ids) == 4
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def test_api_keys_under_128_bits_are_refused_unless_allowed(monkeypatch, tmp_path):
    """A key under 128 bits (length x log2 of its alphabet) stops the start, named by its place
    (never the key itself), with what to do; --allow-short-api-keys lets it through."""
    monkeypatch.delenv("SPECDEC_COORDINATOR_ALLOW_SHORT_API_KEYS", raising=False)
    strong = secrets.token_urlsafe(16)  # 22 characters, 128 random bits
    assert CoordinatorSettings(api_keys=[strong, secrets.token_hex(16)]).api_keys[0] == strong
    keys = tmp_path / "keys"
    keys.write_text(f"{strong}\n0123456789abcdef0123\n")  # 20 hex characters: 80 bits
    with pytest.raises(ValidationError) as refused:
        CoordinatorSettings(api_keys=["ka"], api_key_file=str(keys))
    (error,) = refused.value.errors()
    message = error["msg"]
    for words in ("API key number 1, 3 of 3", "under 128 bits", "--allow-short-api-keys", "openssl rand -hex 32"):
        assert words in message, message
    assert "ka" not in message.replace("--api-key", "") and "0123456789" not in message
    assert CoordinatorSettings(api_keys=["ka"], allow_short_api_keys=True).api_keys == ["ka"]


def test_the_owner_hash_is_keyed_with_the_deployments_secret():
    """Coordinators with the same owner_hash_secret store a key's requests under the same owner;
    another secret, or none (the public constant), gives another owner."""
    key = secrets.token_urlsafe(16)
    owners = [ApiKeys([key], secret).caller(f"Bearer {key}", "h").owner for secret in ("s1", "s1", "s2", "")]
    assert owners[0] == owners[1] and len(set(owners)) == 3
    assert owners[3] == owner_hash(key)


def test_the_owner_hash_secret_comes_from_a_file_as_kubernetes_mounts_it(tmp_path):
    """The Kubernetes base writes the Secret's owner-hash-secret to a file (an empty one without it)."""
    secret_file = tmp_path / "owner-hash-secret"
    secret_file.write_text("s1\n")
    settings = CoordinatorSettings(api_keys=["k1"], owner_hash_secret_file=str(secret_file))
    assert settings.owner_hash_secret == "s1"
    secret_file.write_text("")
    assert CoordinatorSettings(api_keys=["k1"], owner_hash_secret_file=str(secret_file)).owner_hash_secret == ""
    with pytest.raises(ValidationError, match="not both"):
        CoordinatorSettings(api_keys=["k1"], owner_hash_secret="s2", owner_hash_secret_file=str(secret_file))
    with pytest.raises(ValidationError, match="give a readable file"):
        CoordinatorSettings(api_keys=["k1"], owner_hash_secret_file=str(tmp_path / "missing"))


def test_a_random_base64_key_of_128_bits_is_strong_enough_without_digits():
    """22 characters of base64 hold 132 random bits however few of its classes a draw happens to
    use (digits, ``-`` and ``_`` are missing from about 1 in 100 draws); 20 are too few."""
    assert key_bits("xEpJGUtuMZqaRbWkLdnYsH") >= MIN_KEY_BITS
    assert key_bits("xEpJGUtuMZqaRbWkLdnY") < MIN_KEY_BITS
    assert key_bits("abcdefghijklmnopqrstuv") < MIN_KEY_BITS  # one case only: 26 letters, not base64
