"""specdec.engine.ragged_lm alone, without the engine or services: every sequence of a ragged batched
step gets the logits transformers' own forward gives it alone (within float tolerance), through
steps of mixed sizes (decodes, verifies and prefill chunks, attending in groups by their number
of new tokens and context),
rollback then append, a freed sequence's blocks reused, a pool that grows from two blocks, grouped
query attention (the tiny Llama has 4 query and 2 KV heads) and a sliding window. With prefix
caching: a sequence that starts from cached blocks, blocks shared by live sequences and never
written, reference counts after free, eviction under the bound and before the pool grows. Within a
KV budget: the pool grows up to it and never past it, a context is admitted by the blocks it needs
with room left to grow, a sequence that cannot grow preempts the most recently admitted one (the
others' logits unchanged), and the pool shrinks back as sequences end."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from specdec.engine.batching import SequenceStep
from specdec.engine.ragged_lm import BLOCK_SIZE, MAX_PADDED_QUERIES, RaggedLM, _padded_groups, _Sequence
from specdec.rpc.errors import ResourceExhausted
from tests.conftest import tiny_llama

VOCAB = 1024  # the attention is under test, not the output layer: a small vocabulary keeps the models small
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE  # the tiny Llama's: layers x (key, value) x KV heads x head_dim x float32


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]``: transformers' own forward over the whole sequence, no cache."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def random_tokens(count: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=generator).tolist()


class Checked:
    """A RaggedLM next to its reference model, with every sequence's tokens kept to compare."""

    def __init__(
        self, build, num_blocks: int = 2, prefix_cache_max_tokens: int | None = None, kv_cache_max_bytes: int = 0
    ):
        self.reference = build()
        self.lm = RaggedLM(build(), num_blocks, prefix_cache_max_tokens, kv_cache_max_bytes)
        self.tokens: dict[int, list[int]] = {}

    def allocate(self, owner: str = "") -> int:
        seq_id = self.lm.allocate(owner)
        self.tokens[seq_id] = []
        return seq_id

    def step(self, new: dict[int, list[int]], num_logits: int = 3) -> None:
        """One forward over ``new`` tokens per sequence; asserts each sequence's logits."""
        steps = [SequenceStep(seq, tokens, min(num_logits, len(tokens))) for seq, tokens in new.items()]
        for step, logits in zip(steps, self.lm.forward(steps), strict=True):
            self.tokens[step.seq_id] += step.token_ids
            expected = reference_logits(self.reference, self.tokens[step.seq_id])[
                len(self.tokens[step.seq_id]) - step.num_logits :
            ]
            assert torch.allclose(logits, expected, atol=1e-4), (logits - expected).abs().max()

    def truncate(self, seq_id: int, length: int) -> None:
        self.lm.truncate(seq_id, length)
        del self.tokens[seq_id][length:]

    def attach(self, tokens: list[int]) -> tuple[int, int]:
        """A new sequence started from the prefix cache's blocks of ``tokens``: its id and the
        tokens found."""
        seq_id = self.allocate()
        found = self.lm.attach_prefix(seq_id, tokens)
        self.tokens[seq_id] = tokens[:found]
        return seq_id, found

    def commit_all(self, seq_id: int) -> None:
        """Every cached position of the sequence is committed (registers its full blocks)."""
        self.lm.commit(seq_id, len(self.tokens[seq_id]))


@pytest.fixture
def checked() -> Checked:
    return Checked(lambda: tiny_llama(seed=0, vocab_size=VOCAB))


def test_ragged_steps_equal_each_sequence_alone(checked):
    """Steps of 1 to 4 sequences bringing 1, K + 1 or a prefill chunk each, with rollbacks
    between them; the pool starts at two blocks and grows."""
    generator = torch.Generator().manual_seed(0)
    seqs = [checked.allocate() for _ in range(4)]
    sizes = [MAX_PADDED_QUERIES + 9, 5, 1, 3]  # one prefill chunk attends in a group of its own
    for round_ in range(6):
        batch = seqs[: 1 + round_ % 4]
        checked.step({seq: random_tokens(sizes[(i + round_) % 4], generator) for i, seq in enumerate(batch)})
        for seq in batch[::2]:  # rejected drafts: a length change
            checked.truncate(seq, max(1, len(checked.tokens[seq]) - 2))
    assert checked.lm.kv_usage().pool > 2  # the pool grew while sequences kept their blocks


def test_sequences_attend_with_those_of_their_width_and_context():
    """A padded SDPA groups sequences bringing the same number of new tokens and contexts within
    MAX_CONTEXT_RATIO of each other: a verify pads no decode to its K + 1 queries, a long document
    no short chat to its context; prefill chunks are left to groups of their own."""
    sequences = [_Sequence(length=n) for n in (100, 120, 110, 300, 105, 40)]
    counts = [1, 5, 1, 1, 3, MAX_PADDED_QUERIES + 1]
    assert _padded_groups(sequences, counts) == [[0, 2], [3], [4], [1]]


def test_a_sequence_grows_past_many_blocks_and_rolls_back_inside_one(checked):
    generator = torch.Generator().manual_seed(1)
    seq = checked.allocate()
    checked.step({seq: random_tokens(3 * BLOCK_SIZE + 5, generator)})
    for _ in range(3):
        checked.step({seq: random_tokens(BLOCK_SIZE - 1, generator)})
        checked.truncate(seq, len(checked.tokens[seq]) - BLOCK_SIZE // 2)
    assert checked.lm.cache_bytes(seq) == len(checked.tokens[seq]) * checked.lm.bytes_per_token


def test_freed_blocks_serve_a_new_sequence(checked):
    generator = torch.Generator().manual_seed(2)
    first, other = checked.allocate(), checked.allocate()
    checked.step({first: random_tokens(40, generator), other: random_tokens(7, generator)})
    checked.lm.free(first)
    reused = checked.allocate()
    checked.step({reused: random_tokens(30, generator), other: random_tokens(2, generator)})
    checked.step({reused: random_tokens(1, generator), other: random_tokens(1, generator)})


def test_a_sequence_freed_before_its_step_does_not_disturb_the_others(checked):
    """Its caller gave up after the step was scheduled: it runs on a scratch sequence whose
    blocks go back to the pool, and the others' logits are right."""
    generator = torch.Generator().manual_seed(3)
    gone, kept = checked.allocate(), checked.allocate()
    checked.step({gone: random_tokens(20, generator), kept: random_tokens(20, generator)})
    checked.lm.free(gone)
    free_blocks = len(checked.lm._free)
    steps = [SequenceStep(gone, random_tokens(5, generator), 1), SequenceStep(kept, random_tokens(5, generator), 5)]
    logits = checked.lm.forward(steps)[1]
    checked.tokens[kept] += steps[1].token_ids
    assert torch.allclose(logits, reference_logits(checked.reference, checked.tokens[kept])[-5:], atol=1e-4)
    assert len(checked.lm._free) == free_blocks


def tiny_mistral(window: int):
    torch.manual_seed(5)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=window,
        initializer_range=0.3,
        attn_implementation="eager",
    )
    return MistralForCausalLM(config).eval()


def test_a_sliding_window_limits_what_each_query_attends():
    checked = Checked(lambda: tiny_mistral(window=8))
    generator = torch.Generator().manual_seed(4)
    short, long = checked.allocate(), checked.allocate()
    checked.step({short: random_tokens(5, generator), long: random_tokens(20, generator)}, num_logits=5)
    checked.step({short: random_tokens(6, generator), long: random_tokens(3, generator)}, num_logits=3)
    window_matters = reference_logits(tiny_mistral(window=64), checked.tokens[long])[-1]
    assert not torch.allclose(window_matters, reference_logits(checked.reference, checked.tokens[long])[-1], atol=1e-3)


def test_rows_no_step_wrote_are_zeros(checked):
    """A padded step reads rows no step wrote (masked out, weight 0): they must hold no NaN, as
    uninitialised memory may (0 x NaN is NaN), so a new pool and each growth of it are zeros."""
    generator = torch.Generator().manual_seed(6)
    seq = checked.allocate()
    checked.step({seq: random_tokens(3 * BLOCK_SIZE, generator)})  # grows the pool from two blocks
    used = sum(len(s.blocks) for s in checked.lm._sequences.values()) * BLOCK_SIZE
    assert checked.lm.kv_usage().pool * BLOCK_SIZE > used
    assert not any(layer[:, used:].any() for layer in checked.lm._pool)


def cached(num_blocks: int = 2, max_tokens: int = 1024) -> Checked:
    return Checked(lambda: tiny_llama(seed=0, vocab_size=VOCAB), num_blocks, prefix_cache_max_tokens=max_tokens)


def test_logits_after_a_cached_prefix_equal_a_fresh_prefill():
    checked, generator = cached(), torch.Generator().manual_seed(7)
    context = random_tokens(2 * BLOCK_SIZE + 9, generator)
    first = checked.allocate()
    checked.step({first: context})
    checked.commit_all(first)
    checked.lm.free(first)
    second, found = checked.attach([*context, *random_tokens(4, generator)])
    assert found == 2 * BLOCK_SIZE  # whole blocks only
    checked.step({second: context[found:]})  # asserts the logits against transformers' forward over all tokens
    checked.step({second: random_tokens(3, generator)})


def test_shared_blocks_are_never_written():
    """Two live sequences share a prefix: one rolls back to its committed length and extends
    differently, then is freed and a third sequence takes every free block; the other's logits
    and the shared blocks' keys and values do not change."""
    checked, generator = cached(), torch.Generator().manual_seed(8)
    context = random_tokens(2 * BLOCK_SIZE + 3, generator)
    owner = checked.allocate()
    checked.step({owner: context})
    checked.lm.commit(owner, 2 * BLOCK_SIZE)
    sharer, found = checked.attach(context)
    shared_rows = checked.lm._sequences[owner].blocks[:2]
    assert checked.lm._sequences[sharer].blocks == shared_rows and found == 2 * BLOCK_SIZE
    before = [layer.clone() for layer in checked.lm._pool]
    checked.truncate(owner, 2 * BLOCK_SIZE)  # rollback to the committed length
    checked.step({owner: random_tokens(BLOCK_SIZE + 2, generator), sharer: random_tokens(5, generator)})
    checked.step({sharer: random_tokens(1, generator), owner: random_tokens(2, generator)})
    checked.lm.free(owner)  # the shared blocks stay held by the sharer
    third = checked.allocate()
    checked.step({third: random_tokens(6 * BLOCK_SIZE, generator), sharer: random_tokens(2, generator)})
    rows = torch.tensor([b * BLOCK_SIZE + i for b in shared_rows for i in range(BLOCK_SIZE)])
    assert all(torch.equal(now[:, rows], then[:, rows]) for now, then in zip(checked.lm._pool, before, strict=True))
    with pytest.raises(ValueError, match="committed"):
        checked.lm.truncate(sharer, 2 * BLOCK_SIZE - 1)  # below the shared, committed blocks


def test_shared_blocks_are_counted_and_kept_within_the_bound_after_free():
    checked, generator = cached(max_tokens=2 * BLOCK_SIZE), torch.Generator().manual_seed(9)
    context = random_tokens(3 * BLOCK_SIZE + 1, generator)
    first = checked.allocate()
    checked.step({first: context})
    checked.commit_all(first)
    second, _ = checked.attach(context)
    checked.lm.free(first)
    assert checked.lm.prefix_cache_tokens() == 0  # every block still held by the second
    checked.lm.free(second)
    assert checked.lm.prefix_cache_tokens() == 2 * BLOCK_SIZE  # the bound: the last block went first
    third, found = checked.attach(context)
    assert found == 2 * BLOCK_SIZE
    checked.step({third: context[found:]})


def test_cached_blocks_are_evicted_before_the_pool_grows():
    checked, generator = cached(num_blocks=4), torch.Generator().manual_seed(10)
    context = random_tokens(4 * BLOCK_SIZE, generator)
    first = checked.allocate()
    checked.step({first: context})
    checked.commit_all(first)
    checked.lm.free(first)
    assert checked.lm.prefix_cache_tokens() == 4 * BLOCK_SIZE
    other = checked.allocate()
    checked.step({other: random_tokens(3 * BLOCK_SIZE, generator)})  # three blocks: all free ones are cached
    assert checked.lm.kv_usage().pool == 4  # no growth: three cached blocks evicted instead
    assert checked.lm.prefix_cache_tokens() == BLOCK_SIZE  # the first block, evicted last
    again, found = checked.attach(context)
    assert found == BLOCK_SIZE
    checked.step({again: context[found:]})  # the pool grows now: every block is held
    assert checked.lm.kv_usage().pool > 4


def budgeted(blocks: int, max_tokens: int | None = None) -> Checked:
    """A pool of two blocks at first, within a budget of ``blocks`` blocks."""
    return Checked(lambda: tiny_llama(seed=0, vocab_size=VOCAB), 2, max_tokens, kv_cache_max_bytes=blocks * BLOCK_BYTES)


def pool_bytes(lm: RaggedLM) -> int:
    return sum(layer.numel() * layer.element_size() for layer in lm._pool)


def test_the_pool_grows_up_to_its_budget_and_never_past_it():
    """Two blocks, doubled to four, then to the budget's five (not eight); a sixth block is had by
    preempting a sequence, not by growing."""
    checked, generator = budgeted(5), torch.Generator().manual_seed(11)
    assert checked.lm.block_bytes == BLOCK_BYTES
    first, second = checked.allocate(), checked.allocate()
    checked.step({first: random_tokens(3 * BLOCK_SIZE, generator)})
    assert checked.lm.kv_usage().pool == 4
    checked.step({second: random_tokens(2 * BLOCK_SIZE, generator)})
    assert (
        checked.lm.kv_usage().pool == 5 and pool_bytes(checked.lm) == 5 * BLOCK_BYTES == checked.lm.kv_cache_max_bytes
    )
    checked.step({first: random_tokens(1, generator)})  # its fourth block: the second sequence is preempted
    assert pool_bytes(checked.lm) == 5 * BLOCK_BYTES
    assert "kv_cache_max_bytes = 40960 bytes" in checked.lm.lost(second)
    assert checked.lm.kv_usage().num_preemptions == 1 and checked.lm.lost(first) is None


def test_a_context_is_admitted_by_the_blocks_it_needs_with_room_left_to_grow():
    checked = budgeted(8)  # the watermark: one block
    first, second = checked.allocate(), checked.allocate()
    checked.lm.admit(first, 6 * BLOCK_SIZE + 1)  # seven blocks and the watermark: the whole budget
    assert checked.lm.kv_usage().used == 7  # promised, while the pool holds two
    full = r"kv_cache_max_bytes = 65536 bytes\) is full: a context of 5 tokens needs 1 more blocks of 16 tokens, 0 "
    with pytest.raises(ResourceExhausted, match=full):
        checked.lm.admit(second, 5)
    never = r"more than the KV budget .* can ever hold; raise --kv-cache-max-bytes to at least 73728 bytes"
    with pytest.raises(ResourceExhausted, match=never):
        checked.lm.admit(second, 8 * BLOCK_SIZE)
    checked.step({first: random_tokens(6 * BLOCK_SIZE + 1, generator=torch.Generator().manual_seed(12))})
    assert checked.lm.kv_usage().used == 7  # taken as promised
    checked.lm.free(first)
    checked.lm.admit(second, 5)


def test_a_sequence_that_cannot_grow_preempts_the_most_recently_admitted():
    """Three sequences fill a budget of six blocks. The oldest grows: the newest is preempted. The
    second asks for more than is left: being the newest that holds any KV now, it is preempted
    itself, and its step does not run. The oldest's logits stay those of transformers' forward."""
    checked, generator = budgeted(6), torch.Generator().manual_seed(13)
    oldest, middle, newest = checked.allocate(), checked.allocate(), checked.allocate()
    checked.step({seq: random_tokens(2 * BLOCK_SIZE, generator) for seq in (oldest, middle, newest)})
    checked.step({oldest: random_tokens(1, generator)})
    assert checked.lm.lost(newest) and checked.lm.lost(middle) is None and checked.lm.cache_bytes(newest) == 0
    steps = [SequenceStep(middle, random_tokens(3 * BLOCK_SIZE, generator), 1), SequenceStep(oldest, [5], 1)]
    skipped, logits = checked.lm.forward(steps)
    checked.tokens[oldest].append(5)
    assert torch.allclose(logits, reference_logits(checked.reference, checked.tokens[oldest])[-1:], atol=1e-4)
    assert checked.lm.lost(middle) and not skipped.any() and checked.lm.lost(oldest) is None
    assert checked.lm.kv_usage().num_preemptions == 2
    checked.step({oldest: random_tokens(2 * BLOCK_SIZE, generator)})  # the preempted sequences' blocks serve it


def test_the_owner_holding_the_most_kv_gives_first():
    """Owner A's two long sequences and owner B's short one, admitted last, fill a budget of eight
    blocks. When A's first grows, A's newest is preempted, not B's (the newest of all); when B's
    grows, A's last one gives too. Owners holding as many blocks: the newest sequence gives, as
    without owners."""
    checked, generator = budgeted(8), torch.Generator().manual_seed(15)
    a_first, a_second, b_short = checked.allocate("a"), checked.allocate("a"), checked.allocate("b")
    checked.step(
        {a_first: random_tokens(3 * BLOCK_SIZE, generator), a_second: random_tokens(3 * BLOCK_SIZE, generator)}
    )
    checked.step({b_short: random_tokens(2 * BLOCK_SIZE, generator)})
    checked.step({a_first: random_tokens(1, generator)})
    assert checked.lm.lost(a_second) and checked.lm.lost(b_short) is None and checked.lm.lost(a_first) is None
    checked.step({b_short: random_tokens(3 * BLOCK_SIZE, generator)})  # 5 blocks: A's 4 must give
    assert checked.lm.lost(a_first) and checked.lm.lost(b_short) is None
    even, generator = budgeted(4), torch.Generator().manual_seed(16)
    older, newer = even.allocate("a"), even.allocate("b")
    even.step({older: random_tokens(2 * BLOCK_SIZE, generator), newer: random_tokens(2 * BLOCK_SIZE, generator)})
    even.step({older: random_tokens(1, generator)})
    assert even.lm.lost(newer) and even.lm.lost(older) is None


def test_the_pool_shrinks_back_as_sequences_end():
    """A long sequence grows the pool to 16 blocks; once it is freed, with nothing cached, the pool
    halves to 4, the short sequence's two blocks in its first half; once every sequence is freed,
    it is back at its first two blocks."""
    checked, generator = budgeted(64), torch.Generator().manual_seed(14)
    short, long = checked.allocate(), checked.allocate()
    checked.step({short: random_tokens(BLOCK_SIZE + 1, generator)})
    checked.step({long: random_tokens(14 * BLOCK_SIZE, generator)})
    assert checked.lm.kv_usage().pool == 16
    checked.lm.free(long)
    assert checked.lm.kv_usage().pool == 4 and pool_bytes(checked.lm) == 4 * BLOCK_BYTES
    checked.step({short: random_tokens(2, generator)})
    checked.lm.free(short)
    assert checked.lm.kv_usage().pool == 2 and pool_bytes(checked.lm) == 2 * BLOCK_BYTES


def test_a_shrinking_pool_keeps_the_prefix_caches_blocks():
    """A shared prefix's blocks, kept by the prefix cache above the live sequences' blocks, stay
    when the pool could otherwise shrink: the next context that begins with it finds all of it."""
    checked, generator = budgeted(64, max_tokens=14 * BLOCK_SIZE), torch.Generator().manual_seed(15)
    short, long = checked.allocate(), checked.allocate()
    checked.step({short: random_tokens(BLOCK_SIZE + 1, generator)})
    context = random_tokens(14 * BLOCK_SIZE, generator)
    checked.step({long: context})
    checked.commit_all(long)
    checked.lm.free(long)
    assert checked.lm.kv_usage().pool == 16 and checked.lm.prefix_cache_tokens() == 14 * BLOCK_SIZE
    _, found = checked.attach(context)
    assert found >= 13 * BLOCK_SIZE  # all of it (but the block of the last token, which is computed)
