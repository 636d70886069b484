"""Invariant 3: after proposals are partly rejected and the KV cache rolled back, the next logits
equal those of a fresh prefill of the committed prefix, on the verify and on the draft side, also
for a session that started from the prefix cache; and the KV bytes a llama.cpp session reports."""

import llama_cpp
import pytest
import torch

from draft_service.drafters.llama_cpp import LlamaCppDrafter
from specdec.engine.models import load_causal_lm
from specdec.engine.ragged_lm import BLOCK_SIZE
from specdec.sampling.sampling_params import SamplingParams

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]


def fresh_next_logits(model, committed: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([committed])).logits[0, -1].float()


def test_verify_side_rollback_matches_fresh_prefill(tiny_target, plain_target_model):
    check_rollbacks(tiny_target.new_session(PROMPT, SamplingParams()), plain_target_model)


def test_a_session_from_the_prefix_cache_rolls_back_like_a_fresh_one(tiny_target, plain_target_model):
    """Its first blocks are another session's (shared, committed): rounds roll back past them and
    append, and its next logits stay those of a fresh prefill."""
    context = [3 + (i * 7919) % 40000 for i in range(2 * BLOCK_SIZE + 6)]  # ids no other test's context starts with
    tiny_target.new_session(context, SamplingParams()).close()
    session = tiny_target.new_session([*context, 5], SamplingParams())
    assert session.kv_cache.num_cached_tokens == 2 * BLOCK_SIZE
    check_rollbacks(session, plain_target_model)


def check_rollbacks(session, plain_target_model) -> None:
    """Four verify rounds, each the target's own next token then tokens it rejects; after each the
    cache holds the committed tokens but the last, and the next logits equal a fresh prefill's."""
    rounds = 0
    for wrong_tail in ([], [7, 7, 7], [11], [5, 6, 7, 8, 9, 10]):
        # Proposal = the target's own next token followed by tokens it will reject.
        own = int(session.next_logits()[0].argmax())
        session.rollback()  # the probe above must not leave KV behind
        n, _ = session.verify([own, *wrong_tail], None)
        assert n >= 1
        rounds += 1
        assert len(session.kv_cache.cached_tokens) == len(session.committed) - 1
        assert torch.allclose(
            session.next_logits()[0], fresh_next_logits(plain_target_model, session.committed), atol=1e-4
        )
    assert rounds == 4
    session.close()


def test_transformers_draft_rollback_matches_fresh_prefill(tiny_drafters, tiny_models):
    drafter = tiny_drafters["transformers"]
    reference, _ = load_causal_lm(str(tiny_models.draft_dir), dtype="float32")  # transformers' own attention
    session = drafter.new_session(SamplingParams())
    session.prefill(PROMPT)
    for accepted in (2, 0, 4, 1):
        proposal = session.propose(4)
        correction = (proposal.tokens[accepted] + 1) % 49152 if accepted < 4 else 42
        session.sync([*proposal.tokens[:accepted], correction])  # the rest was rejected
        next_logits = session.kv_cache.extend(session.kv_cache.reconcile(session.committed))[-1]
        expected = fresh_next_logits(reference, session.committed)
        assert torch.allclose(next_logits, expected, atol=1e-4)


@pytest.fixture(scope="module")
def llama_cpp_drafter():
    """Prefix caching off, so that a fresh session computes its prefill (no copy of another's)."""
    return LlamaCppDrafter("smollm2", n_ctx=512, n_threads=1, max_num_seqs=4, prefix_caching=False)


def test_llama_cpp_draft_rollback_matches_fresh_prefill(llama_cpp_drafter):
    lm = llama_cpp_drafter.lm
    session = llama_cpp_drafter.new_session(SamplingParams())
    other = llama_cpp_drafter.new_session(SamplingParams())  # a neighbour sequence in the same context
    session.prefill(PROMPT)
    other.prefill(PROMPT[::-1])
    for accepted in (1, 3, 0, 4):
        proposal = session.propose(4)
        other.propose(2)
        correction = (proposal.tokens[accepted] + 1) % 49152 if accepted < 4 else 42
        session.sync([*proposal.tokens[:accepted], correction])
        next_logits = session.kv_cache.extend(session.kv_cache.reconcile(session.committed))[-1]
        fresh = llama_cpp_drafter.new_session(SamplingParams())
        fresh.prefill(session.committed)
        expected = fresh.kv_cache.extend(fresh.kv_cache.reconcile(fresh.committed))[-1]
        fresh.close()
        # The sequence's KV holds exactly the committed positions: nothing rejected survives.
        memory = llama_cpp.llama_get_memory(lm.ctx)
        assert (
            llama_cpp.llama_memory_seq_pos_max(memory, lm.llama_seq(session.kv_cache.seq_id))
            == len(session.committed) - 1
        )
        assert lm.length(session.kv_cache.seq_id) == len(session.committed)
        # A cache left with rejected tokens is off by 10 or more on SmolLM2's logits (|logit| ~ 27); the
        # CPU build gives identical logits here, other kernels may round batched steps differently.
        assert int(next_logits.argmax()) == int(expected.argmax())
        assert (next_logits - expected).abs().max() <= 1e-3 * expected.abs().max()
    session.close()
    other.close()


def test_llama_cpp_session_reports_its_sequence_kv_bytes(llama_cpp_drafter):
    """A llama.cpp session's KV bytes (the /metrics gauge): its cached positions x the bytes per
    token, for SmolLM2 30 layers x (key + value) x 3 KV heads x head size 64 x 2 bytes (f16)."""
    session = llama_cpp_drafter.new_session(SamplingParams())
    assert session.kv_cache_bytes() == 0
    session.prefill(PROMPT)  # caches all but the last committed token
    assert session.kv_cache_bytes() == (len(PROMPT) - 1) * 30 * 2 * 3 * 64 * 2
    session.propose(3)  # + the last committed token and 2 drafts (the 3rd is never fed)
    assert session.kv_cache_bytes() == (len(PROMPT) + 2) * 30 * 2 * 3 * 64 * 2
    session.close()
    assert session.kv_cache_bytes() == 0
