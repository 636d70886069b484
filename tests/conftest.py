"""Shared fixtures: tiny random Llama models saved to disk, the three services started as real
gRPC servers on free ports inside the test process, a real Redis server and a real Redis Cluster;
and the helpers several test modules use (plain greedy decoding, chat prompts, a chi-square test,
a wrong acceptance rule for negative controls, a recorder of the engine's batch sizes, question
files)."""

import asyncio
import contextlib
import gc
import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The services the tests start (in this process, or as children, which inherit this) serve callers
# without an API key or a client certificate, which they otherwise refuse to start for (the
# --insecure setting); tests/test_secure_default.py clears these to check that refusal.
INSECURE_VARIABLES = ("SPECDEC_COORDINATOR_INSECURE", "SPECDEC_DRAFT_INSECURE", "SPECDEC_VERIFY_INSECURE")
os.environ.update(dict.fromkeys(INSECURE_VARIABLES, "true"))
# Tests name their API keys for what they are ("ka", "key-a"): short keys, which a coordinator
# otherwise refuses to start with (tests/test_secure_default.py checks that refusal).
os.environ["SPECDEC_COORDINATOR_ALLOW_SHORT_API_KEYS"] = "true"
# scripts/test.sh runs the suite in two pytest-xdist workers, a file to a worker
# (pytest_collection_modifyitems):
# each then computes on one thread (two would make four on two cores), and hands out only its half
# of the ports (specdec_app.launcher.free_port), so neither starts a service on a port the other
# has handed out and not yet bound.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["SPECDEC_PORT_PARTITION"] = f"{worker.removeprefix('gw')}/{os.environ['PYTEST_XDIST_WORKER_COUNT']}"
else:
    torch.set_num_threads(2)

from coordinator.api.client import Completion, generate  # noqa: E402
from coordinator.request_store.store import MemoryStore, RedisStore, StoredRequest  # noqa: E402
from coordinator.service import serve as serve_coordinator  # noqa: E402
from coordinator.settings import CoordinatorSettings  # noqa: E402
from draft_service.drafters.contract import Drafter, DraftSession, Proposal  # noqa: E402
from draft_service.drafters.ngram import NgramDrafter  # noqa: E402
from draft_service.drafters.transformers_lm import TransformersDrafter  # noqa: E402
from draft_service.service import build as build_draft  # noqa: E402
from draft_service.settings import DraftSettings  # noqa: E402
from specdec.engine.model_files import load_tokenizer  # noqa: E402
from specdec.engine.models import load_causal_lm  # noqa: E402
from specdec.observability.prometheus import EngineMetrics  # noqa: E402
from specdec.rpc.server import GRPC_OPTIONS  # noqa: E402
from specdec.sampling.grammar import GrammarMatcher  # noqa: E402
from specdec.sampling.probs import sample  # noqa: E402
from specdec.sampling.sampling_params import SamplingParams  # noqa: E402
from specdec.sampling.structured_output import GrammarLimits, StructuredOutput, grammar_tokenizer  # noqa: E402
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from specdec_app.bench.dns_server import DnsServer  # noqa: E402
from specdec_app.launcher import ServiceProcess, free_port, start_all, stop_all  # noqa: E402
from verify_service.service import build as build_verify  # noqa: E402
from verify_service.settings import VerifySettings  # noqa: E402
from verify_service.target import Target  # noqa: E402

TINY_VOCAB = 49152
SUMMARY: list[str] = []  # lines for the end of the run (measured figures worth seeing in CI's log)


def pytest_addoption(parser):
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the long checks (marked long), left out of the suite for their time: scripts/long_checks.sh",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` run only with --long (scripts/long_checks.sh): checks run before
    resolving a change to sessions, cancels, resume, memory or fault recovery, as deploy/smoke.sh
    is for deploy/. Each file is one xdist group (scripts/test.sh with workers: ``--dist loadgroup``), and
    the files that use ``tiny_pipeline`` share one, so they run in one worker in the order they
    run alone: the services of that session fixture are shared, and in another order the tests
    that count the sessions left after a cut or cancelled stream (test_concurrency.py,
    test_admission.py) met a session an earlier test had left to the idle timeout. It runs before
    xdist's own hook (tryfirst), which reads the groups into the test ids."""
    shared = {item.path for item in items if "tiny_pipeline" in item.fixturenames}
    for item in items:
        group = "tiny_pipeline" if item.path in shared else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a long check: run scripts/long_checks.sh (pytest --long)")
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist's controller, under ``--dist loadgroup``: stops the run if a worker's test id lacks its
    group, rather than deal every test out alone (why the groups can be lost: pyproject.toml's
    pytest bound)."""
    lost = [nodeid for nodeid in ids if "@" not in nodeid]
    if node.config.getoption("dist") == "loadgroup" and lost:
        pytest.exit(
            f"xdist's loadgroup lost the group of {len(lost)} tests (first: {lost[0]})",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_sessionfinish(session):
    """In an xdist worker, hands its measured lines to the controller (``pytest_testnodedown``)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["summary"] = SUMMARY


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: gathers a finished worker's measured lines for the end of the run."""
    SUMMARY.extend(getattr(node, "workeroutput", {}).get("summary", []))


def pytest_terminal_summary(terminalreporter):
    if SUMMARY:
        terminalreporter.section("measured")
        for line in SUMMARY:
            terminalreporter.write_line(line)


# SmolLM2's tokenizer, so chat templates and detokenization are real


def tiny_llama(seed: int, vocab_size: int = TINY_VOCAB, init_std: float = 0.3, layers: int = 2):
    """A random 2-layer Llama. The large init spreads the logits so argmax ties cannot occur."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def perturbed_copy(model, scale: float, seed: int):
    """A copy of ``model`` with Gaussian noise on every weight: a draft that agrees only partly."""
    import copy

    torch.manual_seed(seed)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for param in clone.parameters():
            param.add_(torch.randn_like(param) * scale * param.std())
    return clone


def word_tokenizer(size: int):
    """A word-level tokenizer whose vocabulary differs from SmolLM2's."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2")


@dataclass
class TinyModels:
    target_dir: Path
    draft_dir: Path
    other_vocab_dir: Path


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_tokenizer) -> TinyModels:
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_llama(seed=0)
    dirs = TinyModels(root / "target", root / "draft", root / "other-vocab")
    for model, path, tokenizer in [
        (target, dirs.target_dir, smollm2_tokenizer),
        (perturbed_copy(target, 0.6, seed=1), dirs.draft_dir, smollm2_tokenizer),
        (tiny_llama(seed=2, vocab_size=64), dirs.other_vocab_dir, word_tokenizer(64)),
    ]:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return dirs


class WrongDrafter(Drafter):
    """Always proposes a token the target will not choose (under greedy decoding it is rejected at
    position 0 unless the target's argmax happens to be that token)."""

    name = "wrong"

    def new_session(self, sampling: SamplingParams, cache_salt: str = "", owner: str = "") -> DraftSession:
        return _WrongSession(sampling)


class _WrongSession(DraftSession):
    def propose(self, k: int) -> Proposal:
        return Proposal([(self.committed[-1] * 7919 + i) % TINY_VOCAB for i in range(k)])


class SwitchingDrafter(Drafter):
    """A scripted, free drafter whose accuracy switches mid-request: it proposes the continuation
    of ``script`` (set it to prompt + the target's greedy output: every draft passes) except while
    ``wrong_from`` <= generated tokens < ``wrong_to``, when every draft token is wrong."""

    name = "switching"

    def __init__(self, wrong_from: int, wrong_to: int):
        self.wrong_from, self.wrong_to = wrong_from, wrong_to
        self.script: list[int] = []

    def new_session(self, sampling: SamplingParams, cache_salt: str = "", owner: str = "") -> DraftSession:
        return _SwitchingSession(sampling, self)


class _SwitchingSession(DraftSession):
    def __init__(self, sampling: SamplingParams, drafter: SwitchingDrafter):
        super().__init__(sampling)
        self.drafter, self.prompt_len = drafter, 0

    def prefill(self, committed):
        super().prefill(committed)
        self.prompt_len = len(committed)

    def propose(self, k: int) -> Proposal:
        at = len(self.committed)
        tokens = self.drafter.script[at : at + k]
        if self.drafter.wrong_from <= at - self.prompt_len < self.drafter.wrong_to:
            return Proposal([(t + 1) % TINY_VOCAB for t in tokens])
        return Proposal(tokens)


class CoordinatorThread:
    """The asyncio coordinator served from a background thread's event loop."""

    def __init__(self, settings: CoordinatorSettings):
        if "http_port" not in settings.model_fields_set:  # HTTP API off unless asked for: never port 8000
            settings = settings.model_copy(update={"http_port": 0})
        self.http_port = settings.http_port
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            ready = self.loop.create_future()
            task = asyncio.ensure_future(serve_coordinator(settings, ready, handle_signals=False))
            return await ready, task

        self.port, self._task = asyncio.run_coroutine_threadsafe(start(), self.loop).result(120)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._task.cancel)


@dataclass
class Pipeline:
    address: str
    verify_address: str
    draft_address: str
    target: Target
    plain_model: object  # the target with transformers' own attention (see plain_target_model)
    verify: object
    draft: object


@pytest.fixture(scope="session")
def plain_target_model(tiny_models):
    """The tiny target loaded on its own, with transformers' own attention and cache: the reference
    that plain decoding and fresh prefills are computed with (the verify service's copy runs the
    ragged attention of :mod:`specdec.engine.ragged_lm`)."""
    model, _ = load_causal_lm(str(tiny_models.target_dir), dtype="float32")
    return model


@pytest.fixture(scope="session")
def tiny_target(tiny_models) -> Target:
    model, tokenizer = load_causal_lm(str(tiny_models.target_dir), dtype="float32")
    target = Target(model, tokenizer, str(tiny_models.target_dir), max_num_speculative_tokens=16)
    target.measure_costs()
    return target


@pytest.fixture(scope="session")
def tiny_drafters(tiny_models, tiny_target) -> dict[str, Drafter]:
    other_model, other_tokenizer = load_causal_lm(str(tiny_models.other_vocab_dir), dtype="float32")
    drafters = {
        "transformers": TransformersDrafter.load(str(tiny_models.draft_dir), dtype="float32"),
        "self": TransformersDrafter(tiny_target.lm.model, load_tokenizer(str(tiny_models.target_dir)), "tiny-target"),
        "close": TransformersDrafter(  # a draft that agrees with the target mostly: hits and misses
            perturbed_copy(tiny_target.lm.model, 0.03, seed=5),
            load_tokenizer(str(tiny_models.target_dir)),
            "tiny-close",
        ),
        "ngram": NgramDrafter(1, 3),
        "wrong": WrongDrafter(),
        "other-vocab": TransformersDrafter(other_model, other_tokenizer, str(tiny_models.other_vocab_dir)),
        "switching": SwitchingDrafter(wrong_from=20, wrong_to=60),
    }
    for drafter in drafters.values():
        drafter.measure_step_ms()
    return drafters


# The least Propose deadline of the coordinators the tests run beside the in-process services
# (tiny_pipeline, tests/test_http_api.py): the test process, and the suite's other worker beside
# it, may stall a Propose past the default 250 ms, and a round that then decodes without the draft
# consumes a seeded sample's random draws differently (another completion for the same seed). The
# deadline itself is tested with coordinators of its own (tests/test_draft_client.py, the fault matrix).
IN_PROCESS_PROPOSE_FLOOR_S = 5.0


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_models, tiny_target, tiny_drafters, plain_target_model) -> Pipeline:
    """Coordinator, draft and verify services on free ports, serving the tiny models."""
    verify = build_verify(VerifySettings(port=0, max_sessions=8), target=tiny_target)
    draft = build_draft(
        DraftSettings(port=0, drafters=list(tiny_drafters), default_drafter="transformers", max_sessions=8),
        drafters=tiny_drafters,
    )
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=f"127.0.0.1:{draft.port}",
            verify_addresses=[f"127.0.0.1:{verify.port}"],
            tokenizer=str(tiny_models.target_dir),
            max_new_tokens_limit=256,
            propose_timeout_floor_s=IN_PROCESS_PROPOSE_FLOOR_S,
        )
    )
    # The services run in this process: a full garbage collection stops their threads while it
    # scans every object, and with all the session's models and modules that took longer than a
    # Propose's 250 ms deadline. Frozen, they are not scanned again.
    gc.collect()
    gc.freeze()
    yield Pipeline(
        f"127.0.0.1:{coordinator.port}",
        f"127.0.0.1:{verify.port}",
        f"127.0.0.1:{draft.port}",
        tiny_target,
        plain_target_model,
        verify,
        draft,
    )
    coordinator.stop()
    draft.stop(0)
    verify.stop(0)


SESSIONS_RELEASED_S = 15.0  # a test's requests release their sessions on the shared services within this, seconds


@pytest.fixture(autouse=True)
def no_sessions_left_behind(request):
    """A test on the shared in-process services (``tiny_pipeline``) leaves no session open there:
    within SESSIONS_RELEASED_S of its end every request it started has released its sessions,
    whether it finished, was cancelled or its coordinator stopped. Otherwise the test fails
    naming them, and they are released, so that the next test starts with the room it expects."""
    yield
    if "tiny_pipeline" not in request.fixturenames:
        return
    pipeline = request.getfixturevalue("tiny_pipeline")
    registries = {"verify": pipeline.verify.servicer.sessions, "draft": pipeline.draft.servicer.sessions}
    deadline = time.monotonic() + SESSIONS_RELEASED_S
    while any(len(sessions) for sessions in registries.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {name: sorted(sessions._entries) for name, sessions in registries.items() if len(sessions)}
    for name, sessions in registries.items():
        for session_id in left.get(name, []):
            sessions.release(session_id)
    assert not left, f"sessions still open {SESSIONS_RELEASED_S:g} s after the test: {left}"


class RedisServer:
    """A real ``redis-server`` on a free port, without persistence: killed, it comes back empty.
    Its memory policy is the manifests' (``noeviction``: a full Redis refuses writes, evicts
    nothing), its memory unbounded unless ``args`` (more of its flags, a manifest's) give a
    ``--maxmemory``; ``password``: the one they set (``--requirepass``). With ``tls`` (PEM files:
    CA, certificate, key) its port speaks TLS only, and asks clients for no certificate."""

    def __init__(
        self, args: tuple[str, ...] = (), password: str | None = None, tls: tuple[str, str, str] | None = None
    ):
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed: run scripts/setup.sh --test (it installs Debian's package)")
        self.port = free_port()
        self.args, self.password, self.tls = args, password, tls
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        port = ["--port", str(self.port)]
        if self.tls:
            ca, cert, key = self.tls
            port = ["--port", "0", "--tls-port", str(self.port), "--tls-ca-cert-file", ca, "--tls-cert-file", cert]
            port += ["--tls-key-file", key, "--tls-auth-clients", "no"]
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--maxmemory-policy",
                "noeviction",
                *self.args,
                *port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not answer within 10 s"
                time.sleep(0.05)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def client(self) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": self.tls[0]} if self.tls else {}
        return redis.Redis(port=self.port, password=self.password, **tls)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    if server.process.poll() is None:
        server.kill()


class RedisClusterNodes:
    """A real Redis Cluster on free loopback ports: ``masters`` masters, each with ``replicas``
    replicas (``redis-cli --cluster create``), every node a :class:`RedisServer` in cluster mode
    with the manifests' memory policy, ``password`` (``--requirepass``, and ``--masterauth`` for
    its replicas) and ``tls`` (as RedisServer's, for the cluster bus and replication too), ``args``
    (more flags of every node, a manifest's; this class's own come after them) and a node timeout
    of 1 s, so that a master killed is replaced by its replica within about 3 s.
    ``url``: a seed node's, with the password, for a store with ``cluster=True``. Each node keeps
    its cluster configuration and log in a folder of its own under ``root``, so a node killed and
    started again rejoins (as a replica of the master promoted in its place)."""

    def __init__(
        self,
        root: Path,
        masters: int = 3,
        replicas: int = 1,
        password: str = "cluster-password",
        tls: tuple[str, str, str] | None = None,
        args: tuple[str, ...] = (),
    ):
        if shutil.which("redis-cli") is None:
            pytest.fail("redis-cli is not installed: run scripts/setup.sh --test (it installs Debian's redis-tools)")
        self.replicas, self.password, self.tls = replicas, password, tls
        self.nodes: list[RedisServer] = []
        for i in range(masters * (1 + replicas)):
            folder = root / f"node{i}"
            folder.mkdir()
            cluster = (*args, "--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--dir", str(folder))
            # the cluster bus on a port of its own: the default, port + 10000, may be taken or above 65535
            cluster += ("--cluster-config-file", str(folder / "nodes.conf"), "--cluster-port", str(free_port()))
            # a replica's first sync at once, not after the 5 s Redis waits for more replicas by default
            cluster += ("--repl-diskless-sync-delay", "0", "--logfile", str(folder / "redis.log"))
            cluster += ("--requirepass", password, "--masterauth", password)
            if tls:
                cluster += ("--tls-cluster", "yes", "--tls-replication", "yes")
            self.nodes.append(RedisServer(cluster, password, tls))
        self.url = self.nodes[0].url.replace("://", f"://:{password}@", 1)

    def start(self) -> None:
        """Starts the nodes, makes them a cluster and waits until every node serves every slot and
        every replica is in sync."""
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        tls = ["--tls", "--cacert", self.tls[0]] if self.tls else []
        created = subprocess.run(
            [
                "redis-cli",
                *tls,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "REDISCLI_AUTH": self.password},  # the password off the command line
        )
        assert created.returncode == 0, f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}"
        self._wait_until_whole()

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.kill()

    def master_of(self, key: str) -> RedisServer:
        """The node that is the master of ``key``'s slot now."""
        client = self.live()[0].client()
        slot = client.execute_command("CLUSTER", "KEYSLOT", key)
        (port,) = [
            master[1] for start, end, master, *_ in client.execute_command("CLUSTER SLOTS") if start <= slot <= end
        ]
        return next(node for node in self.nodes if node.port == port)

    def masters(self) -> list[RedisServer]:
        """The nodes that are masters now."""
        ports = self._master_ports(self.live()[0])
        return [node for node in self.nodes if node.port in ports]

    def hash_tag_on(self, master: RedisServer) -> str:
        """A hash tag (``{...}``) of a slot that ``master`` serves: keys holding it are its keys."""
        return next(tag for tag in (f"{{t{i}}}" for i in itertools.count()) if self.master_of(tag) is master)

    def kill_master(self, key: str) -> RedisServer:
        """SIGKILLs the master of ``key``'s slot (its replica is promoted in about 3 s:
        :meth:`wait_for_failover`); returns it, for :meth:`rejoin`."""
        master = self.master_of(key)
        master.kill()
        return master

    def wait_for_failover(self, killed: RedisServer, timeout_s: float = 20.0) -> None:
        """Waits until every live node reports the cluster whole (``cluster_state:ok``) with another
        node as master of the slots ``killed`` served."""
        deadline = time.monotonic() + timeout_s
        while not all(killed.port not in self._master_ports(node) and self._ok(node) for node in self.live()):
            assert time.monotonic() < deadline, f"no replica took over from the killed master within {timeout_s:g} s"
            time.sleep(0.05)

    def rejoin(self, node: RedisServer) -> None:
        """Starts a killed ``node`` again and waits until it is a replica in sync, and the cluster whole."""
        if node.process is not None and node.process.poll() is None:
            return
        node.start()
        deadline = time.monotonic() + 20
        while not (node.client().info("replication").get("master_link_status") == "up" and self._whole()):
            assert time.monotonic() < deadline, f"redis-server on port {node.port} did not rejoin as a replica in 20 s"
            time.sleep(0.05)

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None and node.process.poll() is None]

    def _wait_until_whole(self) -> None:
        deadline = time.monotonic() + 30
        while not self._whole():
            assert time.monotonic() < deadline, "the Redis Cluster did not come up whole (cluster_state:ok) in 30 s"
            time.sleep(0.05)

    def _whole(self) -> bool:
        """Every node up and ``cluster_state:ok``, and every replica's link to its master up."""
        if len(self.live()) < len(self.nodes) or not all(self._ok(node) for node in self.nodes):
            return False
        roles = [node.client().info("replication") for node in self.nodes]
        return all(role["role"] == "master" or role.get("master_link_status") == "up" for role in roles)

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        return node.client().execute_command("CLUSTER INFO").get("cluster_state") == "ok"

    @staticmethod
    def _master_ports(node: RedisServer) -> set[int]:
        return {master[1] for _, _, master, *_ in node.client().execute_command("CLUSTER SLOTS")}


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """The session's Redis Cluster (:class:`RedisClusterNodes`: three masters, a replica each),
    started by the first test that uses it, stopped at the session's end."""
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class RedisOutage:
    """One Redis (:class:`RedisServer`) down for a test: killed, then started again, empty."""

    cluster = False

    def __init__(self, server: RedisServer):
        self.server, self.url = server, server.url

    def begin(self, stored_as: str) -> None:
        self.server.kill()

    def end(self) -> None:
        self.server.start()

    def heal(self) -> None:
        if self.server.process is not None and self.server.process.poll() is not None:
            self.server.start()


class ClusterOutage:
    """A Redis Cluster (:class:`RedisClusterNodes`) losing the master of a request's slot: killed,
    until its replica is promoted (the record kept there); it rejoins as a replica after the test."""

    cluster = True

    def __init__(self, nodes: RedisClusterNodes):
        self.nodes, self.url = nodes, nodes.url
        self.killed: RedisServer | None = None

    def begin(self, stored_as: str) -> None:
        self.killed = self.nodes.kill_master(f"specdec:request:{{{stored_as}}}")

    def end(self) -> None:
        assert self.killed is not None, "end() before begin()"
        self.nodes.wait_for_failover(self.killed)

    def heal(self) -> None:
        if self.killed is not None:
            self.nodes.rejoin(self.killed)


@pytest.fixture(params=["redis", "cluster"])
def store_outage(request):
    """An outage of the Redis a store test runs on (one Redis, or a Redis Cluster's master): the
    test makes it ``begin(stored_as)`` the store of the record under ``stored_as`` and ``end()``;
    the Redis is whole again after the test, whatever the test did. ``url``, ``cluster``: the
    RedisStore's arguments."""
    if request.param == "redis":
        outage: RedisOutage | ClusterOutage = RedisOutage(request.getfixturevalue("redis_server"))
    else:
        outage = ClusterOutage(request.getfixturevalue("redis_cluster"))
    yield outage
    outage.heal()


@pytest.fixture(params=["redis", "cluster"])
def shared_redis(request) -> tuple[str, bool]:
    """(url, cluster) of the session's Redis ("redis") or Redis Cluster ("cluster"): a RedisStore's
    arguments, and a coordinator's redis_url and redis_cluster."""
    cluster = request.param == "cluster"
    return request.getfixturevalue("redis_cluster" if cluster else "redis_server").url, cluster


def error_counter() -> Counter:
    return Counter("store_errors", "", ["operation"], registry=CollectorRegistry())


def record(request_id: str, generated=()) -> StoredRequest:
    request = coordinator_pb2.GenerateRequest(text="hi", max_new_tokens=8, seed=7, stop=["\n"])
    return StoredRequest(request_id, request, "tiny-target", "fingerprint", generated=list(generated))


@pytest.fixture(params=["redis", "memory", "cluster"])
def with_store(request):
    """A request store test's runner: runs ``scenario(store)`` with a store of the parameter's
    kind (one Redis, the process's own, a Redis Cluster), closed afterwards."""
    cluster = request.param == "cluster"
    if request.param != "memory":
        url = request.getfixturevalue("redis_cluster" if cluster else "redis_server").url

    def run(scenario, ttl_s: float = 60.0) -> None:
        async def main():
            store = (
                MemoryStore(ttl_s)
                if request.param == "memory"
                else RedisStore(url, ttl_s, error_counter(), cluster=cluster)
            )
            try:
                await scenario(store)
            finally:
                await store.close()

        asyncio.run(main())

    return run


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square p-value of observed ``counts`` against the exact distribution ``probs`` (both
    ``[N]``); 0.0 when a count fell where the probability is 0. Cells expecting fewer than 5 are
    pooled into one (the test needs at least 5 expected per cell)."""
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    if counts[expected == 0].sum() > 0:  # an outcome that can never happen
        return 0.0
    large, small = expected >= 5, (expected > 0) & (expected < 5)
    observed, wanted = counts[large], expected[large]
    if small.any():
        observed = torch.cat([observed, counts[small].sum(0, keepdim=True)])
        wanted = torch.cat([wanted, expected[small].sum(0, keepdim=True)])
    wanted *= observed.sum() / wanted.sum()
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


def wrong_rejection_sample(draft_token_ids, draft_probs, target_probs, generators):
    """A plausible bug in :func:`specdec.sampling.acceptance.rejection_sample` (same arguments), for negative
    controls: at a rejection, resample from p instead of normalise(max(0, p - q))."""
    return [_wrong_rule(*args) for args in zip(draft_token_ids, draft_probs, target_probs, generators, strict=True)]


def _wrong_rule(draft_tokens, draft_probs, target_probs, generator):
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            continue
        return i, sample(p, generator)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], generator)


class StepRecorder(EngineMetrics):
    """Engine metrics that keep every step's batch size (set it as an engine's ``metrics``)."""

    def __init__(self):
        self.batch_sizes: list[int] = []

    def observe_step(self, num_seqs: int, num_tokens: int, step_ms: float) -> None:
        self.batch_sizes.append(num_seqs)


def plain_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """Plain greedy decoding of the target with transformers' own generate."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=2, pad_token_id=0
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def tiny_grammar_vocab(smollm2_tokenizer):
    """The grammar library's view of the tiny models' vocabulary (SmolLM2's tokenizer, EOS 2)."""
    return grammar_tokenizer(smollm2_tokenizer, TINY_VOCAB, [2])


def constrained_greedy(model, prompt_ids: list[int], spec: StructuredOutput, vocab, max_new: int) -> list[int]:
    """Plain constrained greedy decoding: the target's logits after each prefix (a full forward
    with transformers' own attention), masked by the grammar (:mod:`specdec.sampling.grammar`), argmax,
    until EOS (2, the tiny models') or max_new tokens."""
    matcher = GrammarMatcher.from_log(spec, vocab, GrammarLimits())
    ids: list[int] = []
    with torch.inference_mode():
        while len(ids) < max_new and (not ids or ids[-1] != 2):
            logits = model(torch.tensor([prompt_ids + ids])).logits[0, -1]
            token = int(logits.masked_fill(~torch.from_numpy(matcher.allowed()), float("-inf")).argmax())
            matcher.advance([token])
            ids.append(token)
    return ids


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of ``prompt`` as one user message through the chat template, as the
    coordinator builds a request's prompt."""
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


def write_questions(path: Path, per_category: dict[str, list[str]]) -> Path:
    """A Spec-Bench style question file: one JSON line per prompt, numbered from 1 in order."""
    qid = 1
    with path.open("w") as out:
        for category, prompts in per_category.items():
            for prompt in prompts:
                out.write(json.dumps({"question_id": qid, "category": category, "turns": [prompt]}) + "\n")
                qid += 1
    return path


def scrape(url: str) -> dict[str, float]:
    """{sample name: value summed over its labels} of a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for value in family.samples:
            totals[value.name] = totals.get(value.name, 0.0) + value.value
    return totals


@dataclass
class FaultedStream:
    """A stream a fault hit (:func:`stream_with_fault`): the completion, and the time.monotonic()
    seconds at which the fault came and at which each later message arrived."""

    completion: Completion
    fault_at: float
    arrivals: list[float]

    @property
    def recovery_s(self) -> float:
        """Seconds from the fault to the client's next message."""
        return self.arrivals[0] - self.fault_at

    @property
    def longest_wait_s(self) -> float:
        """The client's longest wait for a message after the fault, seconds."""
        return max(b - a for a, b in itertools.pairwise([self.fault_at, *self.arrivals]))


def stream_with_fault(
    address: str, request, fault: Callable[[], object], after_tokens: int, timeout_s: float = 180
) -> FaultedStream:
    """Streams ``request`` from the coordinator at ``address``, calls ``fault()`` once the client
    has ``after_tokens`` tokens and a round speculated (a message of more than one token: a plain
    round commits one), and reads on to the end. Waiting for speculation makes the fault find the
    draft in use: a greedy request does not wait for the draft's prefill. Asserts that the fault
    came and a message followed it."""
    completion, fault_at, arrivals, speculated = Completion(), None, [], False
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=timeout_s):
            if fault_at is not None:
                arrivals.append(time.monotonic())
            completion.add(response)
            speculated = speculated or len(response.token_ids) > 1
            if fault_at is None and speculated and len(completion.token_ids) >= after_tokens:
                fault()
                fault_at = time.monotonic()
    assert fault_at is not None, "no round speculated before the stream ended"
    assert arrivals, "the stream ended before the fault took effect"
    return FaultedStream(completion, fault_at, arrivals)


def speculates_again(address: str, request, expected: list[int], timeout_s: float = 30.0) -> bool:
    """Sends ``request`` (a speculative GenerateRequest) to the coordinator at ``address`` until one
    completion accepts draft tokens (speculating again, on a restarted or resumed draft service),
    each asserted identical to ``expected`` token ids. Gives up (False) after ``timeout_s``
    seconds. More than one can be needed: the coordinator's channel to a restarted service
    reconnects within a second (upstream.RECONNECT_OPTIONS), a request that finds the draft
    unreachable meanwhile runs without it for draft_retry_s, and a greedy request does not wait
    for the draft's prefill, so a short one can end before a restarted draft answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        later = generate(address, request, timeout_s=180)
        assert later.token_ids == expected
        if later.metrics.num_accepted_draft_tokens > 0:
            return True
    return False


@dataclass
class ProcessFleet:
    """The services as separate OS processes on free ports (:func:`process_fleet`)."""

    verify: list[ServiceProcess]
    draft: ServiceProcess
    coordinators: list[ServiceProcess]

    @property
    def services(self) -> dict[str, ServiceProcess]:
        """Every process by name: verify0.., draft, coordinator0.."""
        return {
            **{f"verify{i}": v for i, v in enumerate(self.verify)},
            "draft": self.draft,
            **{f"coordinator{i}": c for i, c in enumerate(self.coordinators)},
        }

    def restart(self, service: ServiceProcess) -> None:
        service.start()
        service.wait_serving(time.monotonic() + 180)


@contextlib.contextmanager
def process_fleet(
    tiny_models: TinyModels,
    redis_url: str,
    logs: Path,
    service_args: list[str],
    coordinator_args: list[str],
    num_verify: int = 1,
    num_coordinators: int = 2,
) -> Iterator[ProcessFleet]:
    """Starts ``num_verify`` verify services (the tiny target), one draft service (a self-draft:
    the target's own weights, so every draft passes, with the transformers and n-gram drafters),
    and ``num_coordinators`` coordinators sharing Redis at ``redis_url``; ``service_args`` go to
    the draft and verify services, ``coordinator_args`` to the coordinators. Waits until all
    serve, yields them, and stops them; each writes its log under ``logs``."""

    def service(kind: str, name: str, args: list[str]) -> ServiceProcess:
        return ServiceProcess(
            kind,
            free_port(),
            args=args,
            metrics_port=free_port(),
            log_file=logs / f"{name}.log",
            env={"SPECDEC_REDIS_URL": redis_url},
        )

    target = str(tiny_models.target_dir)
    verify = [service("verify", f"verify{i}", ["--model", target, *service_args]) for i in range(num_verify)]
    drafters = ["--drafters", "transformers,ngram", "--default-drafter", "transformers", "--transformers-model", target]
    draft = service("draft", "draft", [*drafters, *service_args])
    upstream = ["--tokenizer", target, "--draft-address", draft.address, "--verify-addresses"]
    upstream.append(",".join(v.address for v in verify))
    coordinators = [
        service("coordinator", f"coordinator{i}", [*upstream, *coordinator_args]) for i in range(num_coordinators)
    ]
    fleet = ProcessFleet(verify, draft, coordinators)
    processes = list(fleet.services.values())
    try:
        start_all(processes, 180)
        yield fleet
    finally:
        stop_all(processes)


@pytest.fixture
def dns_server():
    server = DnsServer()
    yield server
    server.stop()
