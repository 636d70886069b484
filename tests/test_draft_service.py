"""draft_service/service.py: Propose calls of a Step stream start on the stream's reading thread
and are answered from the drafter's engine (no thread waits per call), their errors as the unary
RPC's; the process set-up: ``--nice`` lowers the CPU priority of every thread of the service's
process, those started before it too (Linux keeps a niceness per thread), and a drafter name it
does not know is refused before any model loads."""

import subprocess
import sys
import threading

import grpc
import pytest
from pydantic import ValidationError

from draft_service.drafters import llama_cpp
from draft_service.drafters.model_drafting import ModelDraftSession
from draft_service.service import DraftServicer, load_drafters
from draft_service.settings import DraftSettings
from specdec.observability.prometheus import ServiceMetrics
from specdec.rpc.sessions import SessionRegistry
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import common_pb2, draft_pb2

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 12, 300, 45, 9]


class Context:
    """What a Step stream asks of the servicer context: whether the caller is still there."""

    def is_active(self) -> bool:
        return True


def propose_call(call_id: int, session_id: str, k: int = 4, **fields) -> draft_pb2.DraftCall:
    request = draft_pb2.ProposeRequest(session_id=session_id, num_speculative_tokens=k, **fields)
    return draft_pb2.DraftCall(header=common_pb2.CallHeader(call_id=call_id, timeout_ms=10_000), propose=request)


def test_streamed_proposals_start_on_the_reading_thread_and_answer_from_the_engine(tiny_drafters, monkeypatch):
    """Eight sessions' Propose calls in one message: each starts on the stream's reading thread
    (no pool thread holds it while its K steps run), its proposal is the one the session proposes
    in process; a bad call fails as the unary RPC would and leaves its session usable."""
    drafter = tiny_drafters["transformers"]
    metrics = ServiceMetrics()
    sessions: SessionRegistry = SessionRegistry(16, 60.0)
    servicer = DraftServicer({"transformers": drafter}, "transformers", sessions, 8, metrics, max_workers=1)
    expected = {}
    for i in range(8):
        prompt = [*PROMPT, i]
        sessions.open(f"s{i}", lambda prompt=prompt: _prefilled(drafter, prompt))
        reference = _prefilled(drafter, prompt)
        expected[i] = reference.propose(4).tokens
        reference.close()
    started_on = set()
    start_proposal = ModelDraftSession.start_proposal

    def recording(self, *args):
        started_on.add(threading.current_thread().name)
        return start_proposal(self, *args)

    monkeypatch.setattr(ModelDraftSession, "start_proposal", recording)
    calls = [propose_call(i, f"s{i}") for i in range(8)]
    calls += [propose_call(8, "gone"), propose_call(9, "s0", k=9), propose_call(10, "s1", predicted_token_ids=[10**6])]
    try:
        stream = servicer.step_calls.serve(iter([draft_pb2.DraftStepRequest(calls=calls)]), Context())
        results = {r.call_id: r for message in stream for r in message}
        assert {i: list(results[i].propose.token_ids) for i in range(8)} == expected
        assert started_on == {"step-stream-reader"}
        codes = {i: grpc.StatusCode.NOT_FOUND if i == 8 else grpc.StatusCode.INVALID_ARGUMENT for i in (8, 9, 10)}
        assert {i: results[i].error.code for i in codes} == {i: code.value[0] for i, code in codes.items()}
        assert results[9].error.message == (
            "num_speculative_tokens is 9: it must lie in [1, 8] (the draft service's --max-num-speculative-tokens)"
        )
        with sessions.use("s1"):  # the failed proposal gave its session back
            pass
    finally:
        for i in range(8):
            sessions.release(f"s{i}")
        metrics.close()


def _prefilled(drafter, prompt: list[int]) -> ModelDraftSession:
    session = drafter.new_session(SamplingParams())
    session.prefill(prompt)
    return session


CHILD = """
import os, threading
from draft_service.service import lower_priority
started = threading.Event()
early = threading.Thread(target=started.wait, daemon=True)  # a thread started before, as at import
early.start()
lower_priority(7)
later = threading.Thread(target=started.wait, daemon=True)
later.start()
print(sorted({os.getpriority(os.PRIO_PROCESS, int(task)) for task in os.listdir("/proc/self/task")}))
started.set()
"""


def test_every_thread_runs_at_the_niceness_asked_for():
    niceness = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    assert niceness.strip() == "[7]"


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_niceness_outside_0_to_19_is_refused(nice):
    with pytest.raises(ValidationError, match="nice"):
        DraftSettings(port=0, nice=nice)


def test_an_unknown_drafter_is_refused_before_any_model_loads(monkeypatch):
    monkeypatch.setattr(llama_cpp, "LlamaCppDrafter", lambda *args, **kwargs: pytest.fail("a model loaded"))
    with pytest.raises(ValueError, match=r"--drafters \(SPECDEC_DRAFT_DRAFTERS\) names 'eagle', no drafter"):
        load_drafters(DraftSettings(port=0, drafters=["llama-cpp", "eagle"]))
