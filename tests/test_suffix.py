"""SuffixDecoding (:mod:`specdec.lookups.suffix`) on hand-made token sequences, and the ``suffix`` drafter
lossless through the tiny pipeline."""

import gc
import random

import pytest

from coordinator.api.client import generate
from coordinator.settings import CoordinatorSettings
from draft_service.drafters.suffix import SuffixDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.lookups.suffix import (
    MAX_SPARE_NODES,
    ROOT,
    ProposalLimits,
    SuffixCache,
    SuffixIndex,
    SuffixMatch,
    SuffixTree,
)
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import coordinator_pb2
from tests.conftest import CoordinatorThread, chat_ids, plain_greedy

UNLIMITED = ProposalLimits(max_spec_factor=100.0, min_token_prob=0.0)


def shape(tree: SuffixTree) -> dict:
    """The tree as nested dicts {token: (count, children)}, for comparing trees."""

    def walk(node: int) -> dict:
        return {token: (tree.count(child), walk(child)) for token, child in tree.children(node).items()}

    return walk(ROOT)


def index(prompt: list[int], cache: SuffixCache | None = None, limits: ProposalLimits = UNLIMITED) -> SuffixIndex:
    return SuffixIndex(cache or SuffixCache(max_depth=16, max_requests=0), len(prompt), limits)


def test_proposes_what_followed_a_repeat_in_the_prompt():
    prompt = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    match = index(prompt).lookup(prompt, 3)
    assert (match.n, match.tokens, match.probs) == (3, [8, 9, 1], [1.0, 1.0, 1.0])


def test_proposes_from_the_requests_own_output():
    prompt = [1, 2, 3]
    request = index(prompt)
    assert request.lookup(prompt, 4) is None  # nothing in the prompt repeats
    match = request.lookup([*prompt, 40, 41, 42, 43, 40, 41], 4)
    assert (match.n, match.tokens) == (2, [42, 43, 40, 41])  # "41" alone scores the same: the longer wins


def test_prefers_the_most_frequent_continuation_over_the_latest():
    tokens = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    match = index(tokens).lookup(tokens, 2)
    assert match.tokens == [3, 9] and match.probs == pytest.approx([2 / 3, 2 / 3])


def test_confidence_cutoff_stops_the_proposal():
    tree = SuffixTree(8)
    for key, tokens in enumerate([[5, 6, 1], [5, 6, 2], [5, 6, 3], [5, 7]]):
        tree.extend(key, tokens)
    # after "5": 6 three times in four (confidence 3/4); after "5 6": 1, 2 or 3 (3/4 * 1/3)
    assert tree.propose([9, 5], 4, ProposalLimits(100.0, 0.3)) == SuffixMatch(1, [6], [0.75])
    assert tree.propose([9, 5], 4, ProposalLimits(100.0, 0.2)) == SuffixMatch(1, [6, 1], [0.75, 0.25])


def test_proposal_length_follows_the_match_length():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert index(tokens, limits=ProposalLimits(1.0, 0.1)).lookup(tokens, 8).tokens == [3, 4]  # n = 2
    assert index(tokens, limits=ProposalLimits(1.5, 0.1)).lookup(tokens, 8).tokens == [3, 4, 5]


def test_depth_bounds_match_plus_proposal():
    period = list(range(10, 30))
    tokens = period * 3
    match = SuffixIndex(SuffixCache(max_depth=8, max_requests=0), len(tokens), UNLIMITED).lookup(tokens, 16)
    assert match.n + len(match.tokens) <= 8 and match.tokens == period[: len(match.tokens)]
    tree = SuffixTree(8)
    tree.extend(0, tokens)

    def depth(children):
        return 1 + max((depth(grand) for _, grand in children.values()), default=0) if children else 0

    assert depth(shape(tree)) == 8


def test_outputs_are_shared_across_requests_and_prompts_are_not():
    cache = SuffixCache(max_depth=16, max_requests=4, max_tokens=1000)
    first = index([1, 2, 3, 4, 5], cache)
    first.lookup([1, 2, 3, 4, 5, 60, 61, 62, 63], 4)
    second = index([9, 2, 3], cache)  # "2 3" continues "4 5" only in the first prompt
    assert second.lookup([9, 2, 3], 4) is None
    assert second.lookup([9, 2, 3, 60, 61], 4).tokens == [62, 63]


def test_cache_evicts_the_oldest_output_beyond_its_bounds():
    cache = SuffixCache(max_depth=16, max_requests=2, max_tokens=1000)
    for i in range(3):
        index([0], cache).lookup([0, 100 + i, 200 + i, 300 + i], 4)
    assert list(cache.partitions[""].sequences.values()) == [[101, 201, 301], [102, 202, 302]]
    assert index([0, 100], cache).lookup([0, 100], 4) is None  # evicted
    assert index([0, 101], cache).lookup([0, 101], 4).tokens == [201, 301]

    by_tokens = SuffixCache(max_depth=16, max_requests=100, max_tokens=5)
    for i in range(3):
        index([0], by_tokens).lookup([0, 2 * i, 2 * i + 1], 4)
    assert (
        list(by_tokens.partitions[""].sequences.values()) == [[2, 3], [4, 5]]
        and by_tokens.partitions[""].num_tokens == 4
    )
    # the running request's output keeps growing past the bound: the oldest goes first, then itself
    running = index([0], by_tokens)
    running.lookup([0, *range(50, 54)], 1)
    assert list(by_tokens.partitions[""].sequences.values()) == [[50, 51, 52, 53]]
    running.lookup([0, *range(50, 60)], 1)
    assert by_tokens.partitions[""].num_tokens == 0 and not by_tokens.partitions[""].sequences


def salted(prompt: list[int], cache: SuffixCache, cache_salt: str) -> SuffixIndex:
    return SuffixIndex(cache, len(prompt), UNLIMITED, cache_salt)


def test_a_partition_drafts_only_its_own_outputs():
    """One tenant's output is proposed to a later request of its own salt, never to another's."""
    cache = SuffixCache(max_depth=16, max_requests=8, max_tokens=1000)
    salted([9, 2, 3], cache, "ka").lookup([9, 2, 3, 60, 61, 62, 63], 4)
    assert salted([7], cache, "kb").lookup([7, 60, 61], 4) is None
    assert index([7], cache).lookup([7, 60, 61], 4) is None  # nor to the unsalted partition
    assert salted([7], cache, "ka").lookup([7, 60, 61], 4).tokens == [62, 63]


def test_the_largest_partition_gives_first_and_the_least_recently_used_goes_whole():
    """Over the bound in tokens, the partition holding most loses its oldest output, not the small
    one's; past max_partitions a new salt drops the least recently used partition."""
    cache = SuffixCache(max_depth=16, max_requests=100, max_tokens=8, max_partitions=2)
    salted([0], cache, "small").lookup([0, 1, 2], 1)
    big = salted([0], cache, "big")
    big.lookup([0, 10, 11, 12], 1)
    salted([0], cache, "big").lookup([0, 20, 21, 22], 1)  # 8 tokens: at the bound
    salted([0], cache, "big").lookup([0, 30, 31], 1)
    assert list(cache.partitions["small"].sequences.values()) == [[1, 2]]
    assert list(cache.partitions["big"].sequences.values()) == [[20, 21, 22], [30, 31]]
    big.lookup([0, 10, 11, 12, 13], 1)  # evicted: adds no more
    assert salted([5], cache, "small").lookup([5, 1], 1).tokens == [2]  # "small" used last
    salted([0], cache, "new").lookup([0, 40], 1)
    assert list(cache.partitions) == ["small", "new"]  # "big" dropped whole


def test_a_partition_gives_back_the_memory_of_what_it_evicted():
    """A partition that held many tokens and then few keeps few nodes: its tree is built again."""
    cache = SuffixCache(max_depth=16, max_requests=100, max_tokens=MAX_SPARE_NODES // 4, max_partitions=2)
    tokens = list(range(1000, 1000 + MAX_SPARE_NODES // 4))
    salted([0], cache, "ka").lookup([0, *tokens], 1)
    grown = len(cache.partitions["ka"]._counts)
    assert grown > MAX_SPARE_NODES
    salted([0], cache, "kb").lookup([0, *range(10)], 1)  # ka's output goes: its nodes with it
    assert not cache.partitions["ka"].sequences
    assert len(cache.partitions["ka"]._counts) < grown // 4
    assert shape(cache.partitions["kb"]) == shape(cache.partitions["kb"].rebuilt())


def test_a_disabled_cache_holds_nothing():
    cache = SuffixCache(max_depth=16, max_requests=0)
    index([1], cache).lookup([1, 2, 3, 2], 2)
    assert not cache.partitions


def test_incremental_updates_and_removal_equal_a_fresh_build():
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
    incremental = SuffixTree(7)
    cuts = [0] * len(sequences)
    while any(cut < len(tokens) for cut, tokens in zip(cuts, sequences, strict=True)):  # random chunks, interleaved
        key, step = rng.randrange(len(sequences)), rng.randrange(1, 6)
        incremental.extend(key, sequences[key][cuts[key] : cuts[key] + step])
        cuts[key] += step
    fresh = SuffixTree(7)
    for key, tokens in enumerate(sequences):
        fresh.extend(key, tokens)
    assert shape(incremental) == shape(fresh)
    for key, tokens in enumerate(sequences):  # a sequence's open suffixes are what a walk finds
        assert list(incremental.suffixes(key)) == list(incremental.matches(tokens))
    first = sequences[0][0]
    assert incremental.count(incremental.children(ROOT)[first]) == sum(s.count(first) for s in sequences)

    incremental.remove(1)
    incremental.remove(3)
    without = SuffixTree(7)
    for key in (0, 2):
        without.extend(key, sequences[key])
    assert shape(incremental) == shape(without) and incremental.num_tokens == without.num_tokens
    num_nodes = len(incremental._counts)
    for key in (1, 3):  # the removed nodes are reused
        incremental.extend(key, sequences[key])
    assert shape(incremental) == shape(fresh) and len(incremental._counts) == num_nodes


def test_each_node_keeps_its_childrens_total_and_most_frequent_child():
    """What a proposal reads instead of scanning children, after appends and removals alike."""
    rng = random.Random(2)
    tree = SuffixTree(6)
    for step in range(300):
        key = rng.randrange(8)
        if key in tree.sequences and rng.random() < 0.3:
            tree.remove(key)
        else:
            tree.extend(key, [rng.randrange(4) for _ in range(rng.randrange(1, 6))])
        if step % 10:
            continue
        for node in range(len(tree._counts)):
            children = tree.children(node)
            assert tree._totals[node] == sum(tree.count(child) for child in children.values())
            if children:  # a proposal from this node takes a most frequent child, at its share
                tokens, probs = tree._most_frequent_path(node, 1, 0.0)
                most = max(tree.count(child) for child in children.values())
                assert tree.count(children[tokens[0]]) == most
                assert probs == [pytest.approx(most / tree._totals[node])]


def test_the_tree_is_no_work_for_the_garbage_collector():
    """Its nodes are entries of lists, their children dicts of ints: nothing a cyclic garbage
    collection has to visit, however many nodes (see :class:`specdec.lookups.suffix.SuffixTree`)."""
    tree = SuffixTree(24)
    tree.extend(0, list(range(300)) * 2)
    tracked = [node for node in range(len(tree._counts)) if gc.is_tracked(tree.children(node))]
    assert len(tree._counts) > 7000 and tracked == []


def test_lookup_matches_a_fresh_index_at_every_length():
    rng = random.Random(1)
    tokens = [rng.randrange(5) for _ in range(80)]
    running = index(tokens[:10])
    for end in range(10, len(tokens)):
        assert running.lookup(tokens[:end], 4) == index(tokens[:end]).lookup(tokens[:end], 4)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(1)
    with pytest.raises(ValueError, match="negative"):
        SuffixCache(max_requests=-1)
    with pytest.raises(ValueError, match="max_spec_factor"):
        ProposalLimits(max_spec_factor=0.0)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixDrafter(min_token_prob=1.5)


def test_drafter_sessions_share_their_outputs():
    drafter = SuffixDrafter()
    first = drafter.new_session(SamplingParams())
    first.prefill([1, 2, 3])
    first.sync([70, 71, 72, 73])
    assert first.propose(4).tokens == []  # no repeat yet: the session's output went to the cache
    second = drafter.new_session(SamplingParams())
    second.prefill([4, 70, 71])
    proposal = second.propose(4)
    assert proposal.tokens == [72, 73] and proposal.probs is None  # a point mass on each token


def test_drafter_sessions_of_another_salt_do_not_share_outputs():
    drafter = SuffixDrafter()
    first = drafter.new_session(SamplingParams(), "ka")
    first.prefill([1, 2, 3])
    first.sync([70, 71, 72, 73])
    first.propose(4)  # its output goes to the cache, in ka's partition
    other = drafter.new_session(SamplingParams(), "kb")
    other.prefill([4, 70, 71])
    assert other.propose(4).tokens == []
    same = drafter.new_session(SamplingParams(), "ka")
    same.prefill([4, 70, 71])
    assert same.propose(4).tokens == [72, 73]


@pytest.fixture(scope="module")
def suffix_pipeline(tiny_pipeline, tiny_models):
    """A draft service hosting the suffix drafter (built from its settings) and a coordinator in
    front of it and the tiny pipeline's verify service."""
    draft = build_draft(DraftSettings(port=0, drafters=["suffix"], default_drafter="suffix", max_sessions=8))
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=f"127.0.0.1:{draft.port}",
            verify_addresses=[tiny_pipeline.verify_address],
            tokenizer=str(tiny_models.target_dir),
            max_new_tokens_limit=256,
        )
    )
    yield f"127.0.0.1:{coordinator.port}"
    coordinator.stop()
    draft.stop(0)


@pytest.mark.parametrize("k", [4, None])  # None: adaptive K
def test_suffix_drafter_equals_plain_greedy(suffix_pipeline, tiny_pipeline, smollm2_tokenizer, k):
    """The same prompt twice: both equal plain greedy decoding, and the second drafts from the
    first's output in the shared cache."""
    prompt, max_new = "Repeat after me: one two three, one two three.", 40
    expected = plain_greedy(tiny_pipeline.plain_model, chat_ids(smollm2_tokenizer, prompt), max_new)
    runs = []
    for _ in range(2):
        request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=max_new, drafter="suffix")
        if k is not None:
            request.num_speculative_tokens = k
        completion = generate(suffix_pipeline, request, timeout_s=60)
        assert completion.token_ids == expected, f"suffix K={k} diverged"
        runs.append(completion.metrics)
    # the tiny target's text does not repeat itself: the second request's drafts come from the cache
    assert runs[1].num_accepted_draft_tokens > 0
