"""The llama.cpp drafter's batching: every session is one sequence of one llama.cpp context, and a
step decodes many sequences in one ``llama_decode``. Each sequence must behave as if it ran alone
(in a fresh context), through ragged steps, rollback and reuse of freed sequences; with prefix
caching, also a sequence that starts from a freed sequence's cells (in place) or from a copy of a
live one's, and the donors' eviction. Uses the bundled SmolLM2 GGUF."""

import os
import threading

import gguf
import llama_cpp
import pytest
import torch

from draft_service.drafters.llama_cpp import LlamaCppDrafter, LlamaCppLM, requantized
from specdec.engine.batching import SequenceStep
from specdec.engine.model_files import derived_path, load_tokenizer, resolve_model
from specdec.observability.prometheus import EngineMetrics
from specdec.rpc.errors import ResourceExhausted
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import GrammarLimits, StructuredOutput, grammar_tokenizer

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365],
    [1, 2683, 359, 253],
    [1, 504, 2365, 282, 4649, 314, 3575, 30],
    [1, 9690, 198, 378, 1056, 2365, 30],
]
MAX_SEQS = 4


@pytest.fixture(scope="module")
def drafter():
    """Prefix caching off: each sequence is computed from its own tokens (the cache's tests below)."""
    return LlamaCppDrafter("smollm2", n_ctx=512, n_threads=1, max_num_seqs=MAX_SEQS, prefix_caching=False)


@pytest.fixture(scope="module")
def alone(drafter):
    """A second context of one sequence: the reference each batched sequence is compared with."""
    lm = LlamaCppLM(drafter.path, n_ctx=512, max_num_seqs=1, n_threads=1)
    yield lm
    lm.close()


def fresh_logits(lm: LlamaCppLM, chunks: list[list[int]]) -> list[torch.Tensor]:
    """A new sequence fed ``chunks`` one step each: the last position's logits after each."""
    seq = lm.allocate()
    try:
        return [lm.forward([SequenceStep(seq, chunk, 1)])[0][-1] for chunk in chunks]
    finally:
        lm.free(seq)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # llama.cpp's kernels may round a batched step differently: within 1e-3 of the logits' scale.
    assert int(actual.argmax()) == int(expected.argmax())
    assert (actual - expected).abs().max() <= 1e-3 * expected.abs().max()


def test_one_forward_over_many_sequences_equals_each_alone(drafter, alone):
    lm = drafter.lm
    seqs = [lm.allocate() for _ in PROMPTS]
    try:
        # A ragged prefill of four prompts in one step, every logit of the first two.
        logits = lm.forward(
            [SequenceStep(s, p, len(p) if i < 2 else 1) for i, (s, p) in enumerate(zip(seqs, PROMPTS, strict=True))]
        )
        assert [tuple(rows.shape) for rows in logits] == [
            (10, lm.vocab_size),
            (4, lm.vocab_size),
            (1, lm.vocab_size),
            (1, lm.vocab_size),
        ]
        for prompt, rows in zip(PROMPTS, logits, strict=True):
            assert_close(rows[-1], fresh_logits(alone, [prompt])[0])
        # Every position's logits of a prompt equal those of that prompt's prefix alone.
        assert_close(logits[0][3], fresh_logits(alone, [PROMPTS[0][:4]])[0])
        # Decode steps: one token per sequence, in a different order than the sequences were allocated.
        tokens = [[42, 7], [13, 99], [5, 5], [2000, 3]]
        steps_logits = [
            lm.forward([SequenceStep(s, [t[j]]) for s, t in reversed(list(zip(seqs, tokens, strict=True)))])[::-1]
            for j in range(2)
        ]
        for i, prompt in enumerate(PROMPTS):
            expected = fresh_logits(alone, [prompt, [tokens[i][0]], [tokens[i][1]]])
            for j in range(2):
                assert_close(steps_logits[j][i][-1], expected[j + 1])
            assert lm.length(seqs[i]) == len(prompt) + 2
    finally:
        for s in seqs:
            lm.free(s)


def test_rollback_of_one_sequence_leaves_the_others_unchanged(drafter, alone):
    lm = drafter.lm
    a, b = lm.allocate(), lm.allocate()
    try:
        lm.forward([SequenceStep(a, PROMPTS[0] + [11, 12, 13, 14], 0), SequenceStep(b, PROMPTS[1], 0)])
        lm.truncate(a, len(PROMPTS[0]))  # the four drafts rejected
        assert lm.length(a) == len(PROMPTS[0]) and lm.length(b) == len(PROMPTS[1])
        assert lm.cache_bytes(a) == len(PROMPTS[0]) * lm.bytes_per_token
        next_a, next_b = lm.forward([SequenceStep(a, [42]), SequenceStep(b, [42])])
        assert_close(next_a[0], fresh_logits(alone, [PROMPTS[0] + [42]])[0])
        assert_close(next_b[0], fresh_logits(alone, [PROMPTS[1] + [42]])[0])
    finally:
        lm.free(a)
        lm.free(b)


def test_a_freed_sequence_is_reused_empty(drafter, alone):
    lm = drafter.lm
    old = lm.allocate()
    lm.forward([SequenceStep(old, PROMPTS[2], 0)])
    slot = lm.llama_seq(old)
    lm.free(old)
    assert lm.cache_bytes(old) == 0
    new = lm.allocate()
    try:
        assert new != old  # a new handle: work still queued for the old session cannot reach it
        assert lm.length(new) == 0 and lm.cache_bytes(new) == 0
        (logits,) = lm.forward([SequenceStep(new, PROMPTS[3])])
        assert lm.llama_seq(new) == slot  # the lowest free llama.cpp sequence, again
        assert_close(logits[-1], fresh_logits(alone, [PROMPTS[3]])[0])
        # A late step of the freed session decodes nothing and gets NaN logits.
        late, again = lm.forward([SequenceStep(old, [5]), SequenceStep(new, [6])])
        assert late.isnan().all() and lm.length(new) == len(PROMPTS[3]) + 1
        assert_close(again[-1], fresh_logits(alone, [PROMPTS[3], [6]])[1])
    finally:
        lm.free(new)


@pytest.fixture
def caching(drafter):
    """A new LM with prefix caching, three sequences of 128 tokens (a short stream: cheap copies)."""
    lm = LlamaCppLM(drafter.path, n_ctx=128, max_num_seqs=3, n_threads=1, prefix_caching=True)
    yield lm
    lm.close()


def prefill(lm: LlamaCppLM, context: list[int], cache_salt: str = "") -> tuple[int, int]:
    """A new sequence of ``cache_salt``: its prefix from the cache, then the rest of ``context`` but
    its last token (as a session's prefill); its handle and the tokens found."""
    seq = lm.allocate()
    found = lm.attach_prefix(seq, context[:-1], cache_salt)
    if found < len(context) - 1:
        lm.forward([SequenceStep(seq, context[found:-1], 0)])
    return seq, found


@pytest.mark.real_model
def test_a_freed_sequence_serves_a_later_context_in_place(caching, alone):
    """A chat's next turn: the first turn's sequence, freed, is the new one's llama.cpp sequence;
    its cells past the shared prefix are dropped and the next logits are a fresh prefill's."""
    first_turn = [*PROMPTS[0], 42, 7, 13]
    first, _ = prefill(caching, [*first_turn, 99])
    slot = caching.llama_seq(first)
    caching.free(first)
    assert caching.prefix_cache_tokens() == len(first_turn)
    next_turn = [*first_turn, 2683, 359]
    second, found = prefill(caching, next_turn)
    try:
        assert found == len(first_turn) and caching.llama_seq(second) == slot
        assert llama_cpp.llama_memory_seq_pos_max(caching.memory, slot) == len(next_turn) - 2
        (logits,) = caching.forward([SequenceStep(second, next_turn[-1:])])
        assert_close(logits[-1], fresh_logits(alone, [next_turn])[0])
    finally:
        caching.free(second)


@pytest.mark.real_model
def test_a_donor_that_shares_only_a_beginning_lends_it_by_a_copy_and_stays_whole(caching, alone):
    """A second request with the same system prompt must not cut the first's sequence, which its
    own next turn then finds whole, in place."""
    system = [*PROMPTS[0], *PROMPTS[2]]
    first_turn = [*system, 42, 7, 13]
    first, _ = prefill(caching, [*first_turn, 99])
    slot = caching.llama_seq(first)
    caching.free(first)
    other, found = prefill(caching, [*system, 2000, 3])
    assert found == len(system) and caching.llama_seq(other) != slot
    next_turn, found = prefill(caching, [*first_turn, 2683, 359])
    try:
        assert found == len(first_turn) and caching.llama_seq(next_turn) == slot
        (logits,) = caching.forward([SequenceStep(next_turn, [359])])
        assert_close(logits[-1], fresh_logits(alone, [[*first_turn, 2683, 359]])[0])
    finally:
        caching.free(other)
        caching.free(next_turn)


@pytest.mark.real_model
def test_a_live_sequence_lends_its_prefix_by_a_copy_and_keeps_its_own(caching, alone):
    shared = [*PROMPTS[0], *PROMPTS[2]]  # 18 tokens: worth a copy (MIN_COPIED_TOKENS)
    owner, _ = prefill(caching, [*shared, 5, 6])
    borrower, found = prefill(caching, [*shared, 2000, 3])
    try:
        assert found == len(shared) and caching.llama_seq(borrower) != caching.llama_seq(owner)
        borrowed, owned = caching.forward([SequenceStep(borrower, [3]), SequenceStep(owner, [6])])
        assert_close(borrowed[-1], fresh_logits(alone, [[*shared, 2000, 3]])[0])
        assert_close(owned[-1], fresh_logits(alone, [[*shared, 5, 6]])[0])
    finally:
        caching.free(owner)
        caching.free(borrower)


@pytest.mark.real_model
def test_a_donor_away_from_the_live_ids_is_copied_next_to_them(caching, alone):
    """llama.cpp batches only consecutive sequence ids together: a new sequence takes the free id
    next to the live one, and the longer prefix held further away comes by a copy."""
    shared = [*PROMPTS[0], *PROMPTS[2]]
    live, near, far = (prefill(caching, context)[0] for context in (PROMPTS[1], PROMPTS[3][1:], [*shared, 1]))
    assert [caching.llama_seq(h) for h in (live, near, far)] == [0, 1, 2]
    caching.free(near)
    caching.free(far)
    new, found = prefill(caching, [*shared, 5, 6])
    try:
        assert caching.llama_seq(new) == 1 and found == len(shared)
        (logits,) = caching.forward([SequenceStep(new, [6])])
        assert_close(logits[-1], fresh_logits(alone, [[*shared, 5, 6]])[0])
    finally:
        caching.free(new)
        caching.free(live)


@pytest.mark.real_model
def test_a_donor_lends_only_to_sessions_of_its_own_cache_salt(caching, alone):
    """Neither a freed sequence (in place) nor a live one (by a copy) lends its prefix to a session
    of another salt, which computes the context itself; one of the same salt finds it."""
    shared = [*PROMPTS[0], *PROMPTS[2]]  # 18 tokens: worth a copy (MIN_COPIED_TOKENS)
    live, _ = prefill(caching, [*shared, 5, 6], "ka")
    freed, _ = prefill(caching, [*shared, 7, 8], "ka")
    caching.free(freed)
    other, found = prefill(caching, [*shared, 2000, 3], "kb")
    try:
        assert found == 0
        (logits,) = caching.forward([SequenceStep(other, [3])])
        assert_close(logits[-1], fresh_logits(alone, [[*shared, 2000, 3]])[0])
    finally:
        caching.free(other)
    same, found = prefill(caching, [*shared, 2000, 3], "ka")
    assert found == len(shared)
    caching.free(same)
    caching.free(live)


@pytest.mark.real_model
def test_donors_go_least_recently_freed_first(caching):
    contexts = [[314 + i, 504, 2365, 282, 4649, 30] for i in range(3)]
    handles = [prefill(caching, context)[0] for context in contexts]
    slots = [caching.llama_seq(h) for h in handles]
    for i in (1, 0, 2):
        caching.free(handles[i])
    unrelated, found = prefill(caching, [9690, 198, 378, 1056])
    assert found == 0 and caching.llama_seq(unrelated) == slots[1]  # the least recently freed donor
    again, found = prefill(caching, [*contexts[2][:-1], 11])
    assert found == len(contexts[2]) - 1 and caching.llama_seq(again) == slots[2]  # found in place
    other, found = prefill(caching, [*contexts[1][:-1], 11])
    assert found == 0 and caching.llama_seq(other) == slots[0]  # contexts[1]'s donor was evicted
    for handle in (unrelated, again, other):
        caching.free(handle)


class _Steps(EngineMetrics):
    def __init__(self):
        self.num_seqs: list[int] = []

    def observe_step(self, num_seqs: int, num_tokens: int, step_ms: float) -> None:
        self.num_seqs.append(num_seqs)


def _rounds(drafter, prompt: list[int], barrier: threading.Barrier | None = None) -> list[list[int]]:
    """Three greedy rounds of 5 drafts, the last 3 rejected each time (rollback in between)."""
    session = drafter.new_session(SamplingParams())
    proposals = []
    try:
        if barrier:
            barrier.wait()
        session.prefill(prompt)
        for _ in range(3):
            tokens = session.propose(5).tokens
            proposals.append(tokens)
            session.sync([*tokens[:2], (tokens[2] + 1) % 49152])
    finally:
        session.close()
    return proposals


def test_concurrent_greedy_proposals_equal_one_at_a_time(drafter):
    one_at_a_time = [_rounds(drafter, prompt) for prompt in PROMPTS]
    steps = _Steps()
    drafter.engine.metrics = steps
    results: list = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def run(i: int) -> None:
        results[i] = _rounds(drafter, PROMPTS[i], barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        drafter.engine.metrics = EngineMetrics()
    assert results == one_at_a_time
    assert max(steps.num_seqs) > 1  # the sessions did share steps


def test_allocating_beyond_max_num_seqs_is_resource_exhausted(drafter):
    sessions = [drafter.new_session(SamplingParams()) for _ in range(MAX_SEQS)]
    try:
        with pytest.raises(ResourceExhausted) as refused:
            drafter.new_session(SamplingParams())
        assert "retry later, or raise --llama-cpp-max-num-seqs (SPECDEC_DRAFT_LLAMA_CPP_MAX_NUM_SEQS" in str(
            refused.value
        )
    finally:
        for session in sessions:
            session.close()
    drafter.new_session(SamplingParams()).close()  # room again


def test_a_context_llama_cpp_cannot_create_names_the_settings_that_size_it(drafter):
    """20 M tokens of KV (about 460 GB for SmolLM2) cannot be allocated: the error says what was
    asked and which settings to lower, by flag and variable."""
    with pytest.raises(ValueError) as refused:
        LlamaCppLM(drafter.path, n_ctx=20_000_000, max_num_seqs=1, n_threads=1)
    message = str(refused.value)
    assert "a context of 1 sequences x 20000000 tokens, 20000000 tokens of KV" in message
    assert "lower --llama-cpp-n-ctx (SPECDEC_DRAFT_LLAMA_CPP_N_CTX), the tokens one session holds" in message
    assert "or --llama-cpp-max-num-seqs (SPECDEC_DRAFT_LLAMA_CPP_MAX_NUM_SEQS)" in message


def test_requantized_is_converted_once_and_cached():
    """The draft's re-quantization (``--llama-cpp-requantize``): a Q8_0 copy in the cache (the one
    the services' default settings use), made once; a file already of the type is used as it is;
    an unknown type is refused."""
    source = resolve_model("smollm2").gguf_path
    converted = requantized(source, "q8_0")
    assert converted == str(derived_path(source, "gguf-q8_0").with_suffix(".gguf"))
    field = gguf.GGUFReader(converted).fields["general.file_type"]
    assert int(field.parts[field.data[0]][0]) == gguf.LlamaFileType.MOSTLY_Q8_0
    mtime = os.stat(converted).st_mtime_ns
    assert requantized(source, "q8_0") == converted and os.stat(converted).st_mtime_ns == mtime
    assert requantized(converted, "q8_0") == converted
    assert requantized(source, "") == source
    with pytest.raises(ValueError, match="q8_0"):
        requantized(source, "q3_k")
    lm = LlamaCppLM(converted, n_ctx=64, max_num_seqs=1, n_threads=1)
    try:
        assert lm.vocab_size == 49152
    finally:
        lm.close()


def test_proposals_under_a_grammar_stay_in_it_and_open_with_the_forced_tokens(drafter):
    """Structured output on the llama.cpp drafter: its grammar vocabulary comes from transformers'
    tokenizer of the same GGUF; a proposal opens with the tokens the schema forces and every
    token of it is one the grammar accepts."""
    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    spec = StructuredOutput("json_schema", schema)
    prompt = PROMPTS[0]
    params = SamplingParams(eos_token_ids=(2,), num_prompt_tokens=len(prompt), structured_output=spec)
    vocab = grammar_tokenizer(load_tokenizer("smollm2"), drafter.lm.vocab_size, [2])
    forced = GrammarMatcher.from_log(spec, vocab, GrammarLimits()).forced_tokens()
    session = drafter.new_session(params)
    session.prefill(prompt)
    try:
        proposal = session.propose(len(forced) + 4)
    finally:
        session.close()
    assert forced and proposal.tokens[: len(forced)] == forced
    matcher = GrammarMatcher.from_log(spec, vocab, GrammarLimits())
    assert matcher.valid_prefix(proposal.tokens) == len(proposal.tokens) == len(forced) + 4
