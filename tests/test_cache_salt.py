"""Tenants in the shared caches (coordinator.api.cache_salt): the salt's derivation alone, then a
real coordinator with API keys ka and kb in front of the tiny pipeline's services. A key finds
nothing of what another key's requests left in the verify and draft services' prefix caches (0
cached prompt tokens) while its own repeat still hits; a request's own cache_salt partitions
within its key (gRPC and the HTTP body); ``--shared-caches`` shares them again; and neither suffix
cache (the draft service's drafter, the coordinator's own lookup) drafts one key's outputs for
another; adaptive K's estimates are stored per key. Greedy output stays plain greedy decoding's
throughout."""

import time
import uuid

import httpx
import pytest

from coordinator.api.auth import owner_hash
from coordinator.api.cache_salt import cache_salt
from coordinator.api.client import Completion, generate
from coordinator.settings import CoordinatorSettings
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.engine.ragged_lm import BLOCK_SIZE
from specdec.v1 import coordinator_pb2
from specdec_app.launcher import free_port
from tests.conftest import CoordinatorThread, Pipeline, chat_ids, plain_greedy
from tests.test_prefix_cache import chat_template_ids

KEYS = ["ka", "kb"]
MAX_NEW = 24  # rounds enough for the draft session, prefilled in the background, to be in use


def test_a_salt_names_one_owner_and_one_request_salt():
    assert cache_salt("") == "" and cache_salt("", shared=True) == ""  # a keyless deployment: one partition
    salts = {cache_salt(owner, salt) for owner in ("o1", "o2", "") for salt in ("", "s", "o1")}
    assert len(salts) == 9 and "" in salts and all(len(s) in (0, 32) for s in salts)
    assert cache_salt("ab", "c") != cache_salt("a", "bc")  # each part length-prefixed
    assert cache_salt("o1", shared=True) == "" and cache_salt("o1", "s", shared=True) == cache_salt("", "s")
    assert "o1" not in cache_salt("o1") and cache_salt("o1") == cache_salt("o1", "")


def coordinator(pipeline: Pipeline, tokenizer_dir, draft_address: str | None = None, **settings) -> CoordinatorThread:
    return CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=draft_address or pipeline.draft_address,
            verify_addresses=[pipeline.verify_address],
            tokenizer=str(tokenizer_dir),
            max_new_tokens_limit=256,
            api_keys=KEYS,
            **settings,
        )
    )


@pytest.fixture(scope="module")
def tenants(tiny_pipeline, tiny_models):
    """The address of a coordinator with keys ka and kb (each key its own partition), its HTTP
    port, and the address of one that shares the caches across keys (``--shared-caches``)."""
    port = free_port()
    isolated = coordinator(tiny_pipeline, tiny_models.target_dir, http_port=port, served_model_name=["tiny"])
    shared = coordinator(tiny_pipeline, tiny_models.target_dir, shared_caches=True)
    yield f"127.0.0.1:{isolated.port}", port, f"127.0.0.1:{shared.port}"
    isolated.stop()
    shared.stop()


def system_prompt() -> str:
    """A system prompt of about 60 tokens that no other test sends."""
    return f"Conversation {uuid.uuid4().hex}. You answer in one short line, plainly, without lists or code."


def ask(pipeline, tokenizer, address: str, key: str, system: str, question: str, salt: str = "") -> Completion:
    """A greedy request of ``key`` (K = 4, the transformers drafter) with ``system`` as its system
    prompt, asserted equal to plain greedy decoding of the target."""
    messages = [("system", system), ("user", question)]
    request = coordinator_pb2.GenerateRequest(
        chat=coordinator_pb2.ChatMessages(
            messages=[coordinator_pb2.ChatMessage(role=role, content=content) for role, content in messages]
        ),
        max_new_tokens=MAX_NEW,
        num_speculative_tokens=4,
        drafter="transformers",
        cache_salt=salt,
    )
    completion = generate(address, request, timeout_s=120, api_key=key)
    assert completion.token_ids == plain_greedy(pipeline.plain_model, chat_template_ids(tokenizer, messages), MAX_NEW)
    return completion


def cached(completion: Completion) -> tuple[int, int]:
    """The prompt tokens the request found in the verify and in the draft service's prefix caches."""
    return completion.metrics.num_cached_prompt_tokens, completion.metrics.num_draft_cached_prompt_tokens


def system_blocks(tokenizer, system: str) -> int:
    """The tokens of the whole blocks two requests with ``system`` and different questions share."""
    a = chat_template_ids(tokenizer, [("system", system), ("user", "Q1?")])
    b = chat_template_ids(tokenizer, [("system", system), ("user", "Q2!")])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return shared // BLOCK_SIZE * BLOCK_SIZE


def test_a_key_finds_nothing_of_another_keys_prompt_and_its_own_repeat_hits(tenants, tiny_pipeline, smollm2_tokenizer):
    address, _, _ = tenants
    system = system_prompt()
    hit = system_blocks(smollm2_tokenizer, system)
    assert hit >= 2 * BLOCK_SIZE
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "ka", system, "Q1?")) == (0, 0)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "kb", system, "Q2!")) == (0, 0)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "ka", system, "Q2!")) == (hit, hit)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "kb", system, "Q1?")) == (hit, hit)  # its own


def test_a_request_salt_partitions_within_a_key(tenants, tiny_pipeline, smollm2_tokenizer):
    address, _, _ = tenants
    system = system_prompt()
    hit = system_blocks(smollm2_tokenizer, system)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "ka", system, "Q1?")) == (0, 0)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "ka", system, "Q2!", salt="left")) == (0, 0)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "kb", system, "Q2!", salt="left")) == (0, 0)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "ka", system, "Q1?", salt="left")) == (hit, hit)


def test_shared_caches_share_across_keys(tenants, tiny_pipeline, smollm2_tokenizer):
    _, _, address = tenants
    system = system_prompt()
    hit = system_blocks(smollm2_tokenizer, system)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "ka", system, "Q1?")) == (0, 0)
    assert cached(ask(tiny_pipeline, smollm2_tokenizer, address, "kb", system, "Q2!")) == (hit, hit)


def test_the_http_body_names_a_salt(tenants, smollm2_tokenizer):
    """vLLM's ``cache_salt`` in the body: a second request naming the same salt finds the first's
    system prompt, one naming another finds nothing."""
    _, port, _ = tenants
    system = system_prompt()
    hit = system_blocks(smollm2_tokenizer, system)

    def cached_tokens(question: str, salt: str) -> int:
        body = {
            "model": "tiny",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4,
            "temperature": 0,
            "num_speculative_tokens": 0,
            "cache_salt": salt,
        }
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer ka"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return response.json()["specdec"]["num_cached_prompt_tokens"]

    assert cached_tokens("Q1?", "http") == 0
    assert cached_tokens("Q2!", "other") == 0
    assert cached_tokens("Q2!", "http") == hit


@pytest.fixture(scope="module")
def suffix_tenants(tiny_pipeline, tiny_models):
    """A draft service hosting the suffix drafter, and a coordinator with keys ka and kb in front
    of it and the tiny pipeline's verify service."""
    draft = build_draft(DraftSettings(port=0, drafters=["suffix"], default_drafter="suffix", max_sessions=8))
    keyed = coordinator(tiny_pipeline, tiny_models.target_dir, draft_address=f"127.0.0.1:{draft.port}")
    yield f"127.0.0.1:{keyed.port}"
    keyed.stop()
    draft.stop(0)


@pytest.mark.parametrize("k", [4, None])  # 4: the draft service's suffix drafter; None: the coordinator's lookup
def test_a_key_is_never_drafted_another_keys_output(suffix_tenants, tiny_pipeline, smollm2_tokenizer, k):
    """The tiny target's text does not repeat itself, so a request drafts nothing it accepts but
    from an earlier output of the same prompt: ka's repeat does, kb's first run does not."""
    prompt, max_new = f"Say {uuid.uuid4().hex} back.", 40
    expected = plain_greedy(tiny_pipeline.plain_model, chat_ids(smollm2_tokenizer, prompt), max_new)

    def run(key: str) -> coordinator_pb2.RequestMetrics:
        request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=max_new, drafter="suffix")
        if k is not None:
            request.num_speculative_tokens = k
        completion = generate(suffix_tenants, request, timeout_s=60, api_key=key)
        assert completion.token_ids == expected
        return completion.metrics

    first = run("ka")
    other = run("kb")
    again = run("ka")
    assert other.num_accepted_draft_tokens == first.num_accepted_draft_tokens
    assert again.num_accepted_draft_tokens > other.num_accepted_draft_tokens


def test_an_adaptive_request_keeps_its_estimates_under_its_owner(tiny_pipeline, tiny_models, redis_server):
    """The coordinator saves an adaptive request's acceptance estimates in the request store under
    its key's owner, where the next request of that key (on any coordinator) starts from them and
    no other key's does."""
    keyed = coordinator(tiny_pipeline, tiny_models.target_dir, redis_url=redis_server.url)
    target = str(tiny_models.target_dir)
    client = redis_server.client()
    ka, kb = (f"specdec:acceptance-of:{owner_hash(key)}:{target}".encode() for key in KEYS)
    client.delete(ka, kb, f"specdec:acceptance:{target}")
    try:
        request = coordinator_pb2.GenerateRequest(text="Count from one to twenty.", max_new_tokens=24)
        generate(f"127.0.0.1:{keyed.port}", request, timeout_s=120, api_key="ka")
        deadline = time.monotonic() + 10
        while not client.exists(ka):  # written after the request, in the background
            assert time.monotonic() < deadline, f"no estimates of ka's: {client.keys('specdec:acceptance*')}"
            time.sleep(0.05)
        assert b"ngram/1" in client.hgetall(ka)
        assert not client.exists(kb) and not client.exists(f"specdec:acceptance:{target}")
    finally:
        keyed.stop()
