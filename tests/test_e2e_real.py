"""End to end over real gRPC on the real SmolLM2-135M-Instruct weights: the three services as
separate processes on free ports (target in transformers, llama.cpp Q4_1 self-draft), greedy
output equal to transformers' plain generate, and the CLI's --json contract."""

import json
import subprocess
import sys

import pytest
import torch

from coordinator.client import generate
from specdec.launcher import LocalCluster, free_port
from specdec.models import load_causal_lm
from specdec.v1 import coordinator_pb2
from tests.conftest import chat_ids

pytestmark = [pytest.mark.real_model, pytest.mark.multiprocess]
PROMPTS = [
    "Translate German to English: Pfandhäuser boomen in Singapur, da die Krise in der Mittelschicht angekommen ist",
    "What is the capital of France? Answer in one sentence, then repeat the answer.",
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=tmp_path_factory.mktemp("logs"))
    cluster.extra_args = {"draft": ["--drafters", "llama-cpp,ngram"]}
    cluster.start_all(timeout_s=600)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def smollm2():
    return load_causal_lm("smollm2", dtype="float32")


@pytest.fixture(scope="module")
def references(smollm2) -> dict[str, list[int]]:
    """transformers' plain greedy generate of each prompt (computed once for every drafter)."""
    model, tokenizer = smollm2
    outputs = {}
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        with torch.inference_mode():
            outputs[prompt] = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids) :].tolist()
    return outputs


@pytest.mark.parametrize("drafter", ["llama-cpp", "ngram"])
def test_real_model_pipeline_equals_transformers_generate(real_cluster, smollm2, references, drafter):
    _, tokenizer = smollm2
    for prompt, expected in references.items():
        request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=4, drafter=drafter)
        completion = generate(real_cluster.address("coordinator"), request, timeout_s=300)
        assert completion.token_ids == expected
        assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)
        if drafter == "llama-cpp":  # the quantized self-draft agrees with the target most of the time
            assert completion.metrics.draft_acceptance_rate > 0.3


def test_cli_generate_json_contract(real_cluster):
    out = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", PROMPTS[1], "--coordinator", real_cluster.address("coordinator"),
         "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"token_ids", "text", "finish_reason", "metrics"}
    assert result["finish_reason"] in {"stop", "length"} and 0 < len(result["token_ids"]) <= 12
    assert result["text"] and result["text"] in out.stdout
    for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "draft_acceptance_rate",
                 "mean_acceptance_length", "acceptance_histogram", "tokens_per_second", "time_to_first_token_ms"):
        assert name in result["metrics"]
