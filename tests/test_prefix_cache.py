"""Prefix caching: specdec.engine.prefix_cache alone (the chain of registered blocks, reference counts,
LRU eviction under the bound), the prefill path's counts (kv.prefill, the Prometheus counters),
and through the pipeline: greedy output identical to plain decoding with the cache on, for a
second request with the same system prompt and for a chat's second turn, with the cached prompt
tokens in the request's metrics. The KV stores' own tests: test_ragged_lm.py (blocks shared,
never written) and test_llama_batched.py (llama.cpp donors)."""

import uuid

import pytest
import torch

from coordinator.api.client import generate
from specdec.engine.prefix_cache import ROOT, PrefixCache
from specdec.engine.ragged_lm import BLOCK_SIZE
from specdec.observability.prometheus import ServiceMetrics
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import coordinator_pb2
from tests.conftest import plain_greedy

B = 4  # block size of the algorithm-level tests


def blocks_of(tokens: list[int]) -> list[list[int]]:
    return [tokens[i : i + B] for i in range(0, len(tokens) - B + 1, B)]


def register_chain(cache: PrefixCache, tokens: list[int], first_block: int, cache_salt: str = ROOT) -> list[int]:
    """Registers ``tokens``' full blocks as blocks first_block, first_block + 1, ... of a sequence
    of ``cache_salt``; their nodes."""
    nodes: list[int] = []
    parent: int | str = cache_salt
    for i, block_tokens in enumerate(blocks_of(tokens)):
        parent = cache.register(parent, block_tokens, first_block + i)
        nodes.append(parent)
    return nodes


def release_all(cache: PrefixCache, blocks: list[int]) -> list[int]:
    """Releases a sequence's blocks, last first (as the KV store does); the ones to free."""
    return [block for block in reversed(blocks) if cache.release(block)]


def test_a_context_finds_the_longest_chain_of_whole_blocks_it_begins_with():
    cache = PrefixCache(B, max_blocks=8)
    tokens = list(range(10, 22))  # three blocks
    nodes = register_chain(cache, tokens, first_block=0)
    assert cache.match([*tokens, 99]) == ([0, 1, 2], nodes)
    assert cache.match(tokens[:7]) == ([0], nodes[:1])  # a partial block is not matched
    assert cache.match([*tokens[:4], 0, *tokens[5:]]) == ([0], nodes[:1])  # stops at the first differing block
    assert cache.match(tokens[4:]) == ([], [])  # the same tokens at another place: another chain


def test_a_block_is_kept_while_held_and_evicted_least_recently_released_first():
    cache = PrefixCache(B, max_blocks=3)
    first, second = list(range(0, 8)), list(range(100, 108))
    first_nodes = register_chain(cache, first, first_block=0)
    register_chain(cache, second, first_block=2)
    found, _ = cache.match(first)  # a second sequence holds blocks 0 and 1
    assert release_all(cache, [0, 1]) == [] and cache.num_evictable == 0  # still held
    assert release_all(cache, found) == [] and cache.num_evictable == 2
    assert release_all(cache, [2, 3]) == [] and cache.num_evictable == 4
    assert cache.trim() == [1]  # over the bound: the least recently released, a sequence's last block first
    assert cache.match(first) == ([0], first_nodes[:1])  # found again: held, no longer evictable
    assert cache.num_evictable == 2
    assert [cache.evict(), cache.evict()] == [3, 2]
    with pytest.raises(KeyError):
        cache.evict()  # nothing unreferenced left: the KV store grows instead
    assert cache.match(second) == ([], [])


def test_a_block_computed_twice_is_registered_once():
    """Two sequences prefilled the same context at once: the second's blocks stay its own (freed
    with it), and its later blocks chain on the first's nodes, so one lookup finds them all."""
    cache = PrefixCache(B, max_blocks=8)
    tokens = list(range(30, 42))
    nodes = register_chain(cache, tokens[:8], first_block=0)
    twin = register_chain(cache, tokens, first_block=5)  # blocks 5, 6 duplicate 0, 1; block 7 is new
    assert twin[:2] == nodes and twin[2] not in nodes
    assert cache.match(tokens) == ([0, 1, 7], twin)
    assert release_all(cache, [5, 6, 7]) == [6, 5]  # the duplicates are freed; block 7 stays (held by the match)


def test_keys_hold_the_token_ids_and_a_block_holds_a_whole_block():
    cache = PrefixCache(B, max_blocks=8)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.register(ROOT, [1, 2, 3], 0)
    (node,) = register_chain(cache, [1, 2, 3, 4], first_block=0)
    cache.register(node, [5, 6, 7, 8], 1)
    assert cache.match([5, 6, 7, 8]) == ([], [])  # the same block after another parent is another key
    with pytest.raises(ValueError):
        PrefixCache(0, 1)


def test_sequences_of_different_cache_salts_never_share_a_block():
    """vLLM's cache_salt: the salt is the first block's parent, so a chain registered under one
    salt is found under that salt only, and the same tokens under another salt are another chain."""
    cache = PrefixCache(B, max_blocks=8)
    tokens = list(range(50, 62))
    nodes = register_chain(cache, tokens, first_block=0, cache_salt="ka")
    assert cache.match(tokens, "ka") == ([0, 1, 2], nodes)
    assert cache.match(tokens, "kb") == ([], []) and cache.match(tokens) == ([], [])
    theirs = register_chain(cache, tokens, first_block=3, cache_salt="kb")  # computed again: blocks of its own
    assert not set(theirs) & set(nodes)
    assert cache.match(tokens, "kb") == ([3, 4, 5], theirs)


def unique_tokens(count: int) -> list[int]:
    """Token ids no other test's context begins with (the tiny target's cache is shared)."""
    start = uuid.uuid4().int % 40000 + 1000
    return [start + i for i in range(count)]


def test_a_prefill_attaches_the_cached_prefix_and_counts_it(tiny_target):
    """The verify side's prefill path: a second context that shares 3 blocks with the first
    prefills only the rest; the generated tokens' blocks are registered as rounds commit, so a
    chat's next turn finds the answer too; queries, hits and the cache's size reach Prometheus."""
    metrics = ServiceMetrics()
    saved = tiny_target.engine.metrics
    tiny_target.engine.metrics = metrics.engine_metrics("verify", tiny_target.lm.prefix_cache_tokens)
    context = unique_tokens(3 * BLOCK_SIZE + 5)
    try:
        first = tiny_target.new_session(context, SamplingParams())
        second = tiny_target.new_session([*context[:-1], 7, 8], SamplingParams())
        for _ in range(20):  # 20 plain decode rounds: the first session's log grows to 73 tokens
            first.verify([], None)
        next_turn = tiny_target.new_session([*first.committed, 9], SamplingParams())
        sessions = [first, second, next_turn]
        assert [s.kv_cache.num_cached_tokens for s in sessions] == [0, 3 * BLOCK_SIZE, 4 * BLOCK_SIZE]
        for session in sessions:
            session.close()
        sample = metrics.registry.get_sample_value
        assert sample("specdec_prefix_cache_queries_total", {"engine": "verify"}) == 53 + 54 + 74
        assert sample("specdec_prefix_cache_hits_total", {"engine": "verify"}) == 7 * BLOCK_SIZE
        assert sample("specdec_prefix_cache_tokens", {"engine": "verify"}) >= 4 * BLOCK_SIZE  # kept for later
    finally:
        tiny_target.engine.metrics = saved


def test_a_session_finds_only_its_own_salts_prefix(tiny_target):
    """The verify side: a session salted otherwise computes the whole context again (0 cached),
    while one of the first session's salt finds it; each session's logits stay a fresh prefill's."""
    context = unique_tokens(3 * BLOCK_SIZE + 5)
    first = tiny_target.new_session(context, SamplingParams(), cache_salt="ka")
    other = tiny_target.new_session(context, SamplingParams(), cache_salt="kb")
    unsalted = tiny_target.new_session(context, SamplingParams())
    same = tiny_target.new_session(context, SamplingParams(), cache_salt="ka")
    sessions = [first, other, unsalted, same]
    try:
        assert [s.kv_cache.num_cached_tokens for s in sessions] == [0, 0, 0, 3 * BLOCK_SIZE]
        logits = [s.next_logits() for s in sessions]
        for row in logits[1:]:
            assert torch.allclose(row, logits[0], atol=1e-5)
    finally:
        for session in sessions:
            session.close()


MAX_NEW = 24  # rounds enough for the draft session, prefilled in the background, to be in use


def chat(messages: list[tuple[str, str]]) -> coordinator_pb2.ChatMessages:
    return coordinator_pb2.ChatMessages(
        messages=[coordinator_pb2.ChatMessage(role=role, content=content) for role, content in messages]
    )


def chat_template_ids(tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """The prompt the coordinator builds for ``messages``."""
    conversation = [{"role": role, "content": content} for role, content in messages]
    return list(
        tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def generate_plain(pipeline, tokenizer, messages: list[tuple[str, str]]):
    """A greedy request through the pipeline (K = 4, the transformers drafter), asserted equal to
    plain greedy decoding of the target; its completion and prompt ids."""
    ids = chat_template_ids(tokenizer, messages)
    request = coordinator_pb2.GenerateRequest(
        chat=chat(messages), max_new_tokens=MAX_NEW, num_speculative_tokens=4, drafter="transformers"
    )
    completion = generate(pipeline.address, request, timeout_s=120)
    assert completion.token_ids == plain_greedy(pipeline.plain_model, ids, MAX_NEW)
    return completion, ids


def system_prompt() -> str:
    """A system prompt of about 60 tokens that no other test sends."""
    return f"Conversation {uuid.uuid4().hex}. You answer in one short line, plainly, without lists or code."


def test_a_shared_system_prompt_is_computed_once_and_output_stays_plain(tiny_pipeline, smollm2_tokenizer):
    system = system_prompt()
    first, first_ids = generate_plain(tiny_pipeline, smollm2_tokenizer, [("system", system), ("user", "Name a prime.")])
    second, second_ids = generate_plain(tiny_pipeline, smollm2_tokenizer, [("system", system), ("user", "A colour?")])
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b)
    assert shared >= 2 * BLOCK_SIZE
    assert first.metrics.num_cached_prompt_tokens == first.metrics.num_draft_cached_prompt_tokens == 0
    # whole blocks of the shared system prompt, on the verify and on the (transformers) draft service
    assert second.metrics.num_cached_prompt_tokens == shared // BLOCK_SIZE * BLOCK_SIZE
    assert second.metrics.num_draft_cached_prompt_tokens == shared // BLOCK_SIZE * BLOCK_SIZE


def test_a_chats_second_turn_finds_the_first_cached(tiny_pipeline, smollm2_tokenizer):
    turn = [("system", system_prompt()), ("user", "Tell me about cats.")]
    answer, first_ids = generate_plain(tiny_pipeline, smollm2_tokenizer, turn)
    second, _ = generate_plain(tiny_pipeline, smollm2_tokenizer, [*turn, ("assistant", answer.text), ("user", "More.")])
    assert second.metrics.num_cached_prompt_tokens >= len(first_ids) // BLOCK_SIZE * BLOCK_SIZE > 0
