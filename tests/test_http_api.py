"""The OpenAI-compatible HTTP API: the official openai SDK (sync and async, streamed and not) gets
what the gRPC Generate API gives for the same request; bad requests get OpenAI's error shape with
the gRPC path's messages; API keys guard HTTP and gRPC, not health; a client that leaves mid-stream
cancels its request; requests fuzzed from the OpenAPI document (schemathesis) never get a 5xx."""

import asyncio
import http.client
import json
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Literal

import grpc
import hypothesis
import openai
import pytest
import schemathesis
from pydantic import BaseModel, Field, ValidationError

from coordinator.api.auth import ApiKeys, Unauthenticated
from coordinator.api.client import generate
from coordinator.api.logprobs import token_texts
from coordinator.settings import CoordinatorSettings
from specdec.settings import parse_settings
from specdec.v1 import coordinator_pb2
from specdec_app.launcher import ServiceProcess, free_port, is_serving
from tests.conftest import IN_PROCESS_PROPOSE_FLOOR_S, CoordinatorThread

KEY = "test-key"
PROMPT = "Tell me about cats."


@dataclass
class Api:
    grpc_address: str
    port: int
    model: str  # the target's name
    metrics_port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=KEY, max_retries=0, timeout=60)


def coordinator_settings(tiny_pipeline, tiny_models, **fields) -> CoordinatorSettings:
    return CoordinatorSettings(
        port=0,
        draft_address=tiny_pipeline.draft_address,
        verify_addresses=[tiny_pipeline.verify_address],
        tokenizer=str(tiny_models.target_dir),
        max_new_tokens_limit=256,
        **{"propose_timeout_floor_s": IN_PROCESS_PROPOSE_FLOOR_S, **fields},
    )


@pytest.fixture(scope="module")
def api(tiny_pipeline, tiny_models):
    """A coordinator with its HTTP API and an API key, on the tiny pipeline's draft and verify services."""
    metrics_port = free_port()
    coordinator = CoordinatorThread(
        coordinator_settings(
            tiny_pipeline,
            tiny_models,
            http_port=free_port(),
            api_keys=[KEY],
            served_model_name=["tiny"],
            metrics_port=metrics_port,
        )
    )
    yield Api(f"127.0.0.1:{coordinator.port}", coordinator.http_port, str(tiny_models.target_dir), metrics_port)
    coordinator.stop()


def grpc_completion(address: str, api_key: str | None = None, **fields):
    return generate(address, coordinator_pb2.GenerateRequest(**fields), timeout_s=60, api_key=api_key)


def call(
    api: Api, method: str, path: str, body=None, key: str | None = KEY, raw: bytes | None = None
) -> tuple[int, dict]:
    """A plain HTTP call: its status and JSON body."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"http://127.0.0.1:{api.port}{path}", data=data, headers=headers, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_no_sessions(tiny_pipeline) -> None:
    deadline = time.monotonic() + 10
    while len(tiny_pipeline.verify.servicer.sessions) or len(tiny_pipeline.draft.servicer.sessions):
        assert time.monotonic() < deadline, "sessions were not released"
        time.sleep(0.05)


# --- same output as gRPC ----------------------------------------------------------------------


def test_chat_equals_grpc_greedy(api, tiny_pipeline):
    expected = grpc_completion(tiny_pipeline.address, text=PROMPT, max_new_tokens=24, temperature=0)
    response = api.client().chat.completions.create(
        model=api.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason == "length"
    assert response.object == "chat.completion" and response.model == api.model
    assert response.usage.completion_tokens == len(expected.token_ids) == 24
    assert response.usage.prompt_tokens == expected.metrics.num_prompt_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24
    metrics = response.specdec
    assert metrics["num_generated_tokens"] == 24 and metrics["num_prompt_tokens"] == response.usage.prompt_tokens
    for name in ("draft_acceptance_rate", "mean_acceptance_length", "num_spec_steps", "acceptance_histogram", "seed"):
        assert name in metrics
    assert isinstance(metrics["seed"], int)


def test_chat_stream_equals_grpc_greedy_with_usage(api, tiny_pipeline):
    expected = grpc_completion(
        api.grpc_address, KEY, text=PROMPT, max_new_tokens=30, temperature=0, num_speculative_tokens=3
    )
    stream = api.client().chat.completions.create(
        model=api.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_completion_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"num_speculative_tokens": 3},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].specdec["num_speculative_tokens"] == 3 and finish[0].specdec["adaptive"] is False
    assert finish[0].specdec["num_generated_tokens"] == 30
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 30
    assert usage.usage.prompt_tokens == expected.metrics.num_prompt_tokens


def test_completions_raw_prompt_sync_and_async(api, tiny_pipeline):
    prompt = "Once upon a time"
    expected = grpc_completion(tiny_pipeline.address, text=prompt, raw_prompt=True, max_new_tokens=20, temperature=0)
    response = api.client().completions.create(model=api.model, prompt=prompt, max_tokens=20, temperature=0)
    assert response.object == "text_completion"
    assert response.choices[0].text == expected.text and response.usage.completion_tokens == 20
    assert response.usage.prompt_tokens == expected.metrics.num_prompt_tokens

    async def streamed() -> tuple[str, list]:
        async with api.async_client() as client:
            stream = await client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            again = await client.completions.create(model=api.model, prompt=prompt, max_tokens=20, temperature=0)
        return "".join(c.choices[0].text for c in chunks if c.choices), [chunks, again]

    text, (chunks, again) = asyncio.run(streamed())
    assert text == expected.text == again.choices[0].text
    assert chunks[-1].usage.completion_tokens == 20


def test_seeded_sampling_reproduces(api, tiny_pipeline):
    request = dict(
        model=api.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        extra_body={"top_k": 50, "num_speculative_tokens": 2, "drafter": "transformers"},
    )
    first, second = (api.client().chat.completions.create(**request) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.specdec["seed"] == 1234
    expected = grpc_completion(
        tiny_pipeline.address,
        text=PROMPT,
        max_new_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        top_k=50,
        num_speculative_tokens=2,
        drafter="transformers",
    )
    assert first.choices[0].message.content == expected.text


def test_stop_strings(api, tiny_pipeline):
    full = grpc_completion(tiny_pipeline.address, text=PROMPT, max_new_tokens=40, temperature=0).text
    plain = [i for i in range(len(full) // 3, len(full) - 3) if full[i : i + 3].isalnum()]
    assert plain, f"no usable stop string in {full!r}"
    stop = full[plain[0] : plain[0] + 3]
    expected = grpc_completion(tiny_pipeline.address, text=PROMPT, max_new_tokens=40, temperature=0, stop=[stop])
    for value in (stop, [stop, "never appears here"]):
        response = api.client().chat.completions.create(
            model=api.model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=40,
            temperature=0,
            stop=value,
        )
        assert response.choices[0].message.content == expected.text == full[: full.index(stop)]
        assert response.choices[0].finish_reason == "stop"
        assert response.usage.completion_tokens == len(expected.token_ids)


def test_models_and_health(api):
    models = api.client().models.list()
    assert [m.id for m in models.data] == [api.model, "tiny"]
    assert call(api, "GET", "/health", key=None) == (200, {"status": "ok"})


# --- errors -----------------------------------------------------------------------------------

CHAT = {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    # name, changes to CHAT, HTTP status, param, start of the message
    ("unknown model", {"model": "gpt-4"}, 404, "model", "model 'gpt-4' does not exist"),
    ("n above the limit", {"n": 9}, 400, "n", "n is 9: it must lie in [1, 8]"),
    (
        "top_logprobs above the limit",
        {"logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "top_logprobs is 21: it must lie in [0, 20] (the coordinator's --max-logprobs)",
    ),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, 400, "top_logprobs", "top_logprobs is 2 without logprobs"),
    ("negative top_logprobs", {"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "top_logprobs is -1"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "tools="),
    ("penalty out of range", {"frequency_penalty": 2.5}, 400, "frequency_penalty", "frequency_penalty is 2.5"),
    ("logit_bias id", {"logit_bias": {"99999999": 1}}, 400, "logit_bias", "logit_bias names token 99999999"),
    ("min_tokens", {"min_tokens": 5}, 400, "min_tokens", "min_tokens is 5: it must not exceed max_tokens (4)"),
    (
        "json_schema without a schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format.json_schema",
        "response_format of type json_schema needs json_schema.schema",
    ),
    (
        "bad schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        400,
        "response_format",
        "response_format.json_schema.schema is not valid: Invalid type: objekt",
    ),
    (
        "bad regex",
        {"structured_outputs": {"regex": "(a|b"}},
        400,
        "structured_outputs",
        "structured_outputs.regex is not valid",
    ),
    (
        "two structured outputs",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
        400,
        "structured_outputs",
        "response_format and structured_outputs both constrain the output",
    ),
    (
        "two kinds in structured_outputs",
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        400,
        "structured_outputs",
        "structured_outputs sets regex, choice: set exactly one",
    ),
    ("unknown field", {"max_token": 4}, 400, "max_token", "unsupported field 'max_token'"),
    (
        "max_tokens 0",
        {"max_tokens": 0},
        400,
        "max_tokens",
        "max_tokens is 0: it must lie in [1, 256] (the coordinator's --max-new-tokens-limit)",
    ),
    (
        "max_completion_tokens 0",
        {"max_tokens": None, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "max_completion_tokens is 0: it must lie in [1, 256] (the coordinator's --max-new-tokens-limit)",
    ),
    (
        "max_tokens beyond the context window",
        {"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 250},
        400,
        "max_tokens",
        "max_tokens is 250: after the prompt's ",
    ),
    (
        "max_completion_tokens beyond the context window",
        {"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": None, "max_completion_tokens": 250},
        400,
        "max_completion_tokens",
        "max_completion_tokens is 250: after the prompt's ",
    ),
    (
        "min_tokens with a grammar",
        {"min_tokens": 1, "response_format": {"type": "json_object"}},
        400,
        "min_tokens",
        "min_tokens cannot be combined with response_format (the grammar decides where the output ends): remove "
        "min_tokens",
    ),
    ("max_tokens beyond int32", {"max_tokens": 2**40}, 400, "max_tokens", f"max_tokens is {2**40}"),
    (
        "max_tokens not a number",
        {"max_tokens": "many"},
        400,
        "max_tokens",
        "max_tokens: Input should be a valid integer",
    ),
    (
        "both token limits",
        {"max_completion_tokens": 5},
        400,
        "max_completion_tokens",
        "max_tokens and max_completion_tokens differ",
    ),
    ("negative temperature", {"temperature": -0.5}, 400, "temperature", "temperature is -0.5"),
    ("top_p 0", {"top_p": 0}, 400, "top_p", "top_p is 0.0"),
    ("negative seed", {"seed": -1}, 400, "seed", "seed is -1"),
    ("no messages", {"messages": []}, 400, "messages", "messages: List should have at least 1 item"),
    (
        "empty prompt",
        {"messages": [{"role": "user", "content": "  "}]},
        400,
        "messages",
        "prompt is empty: give `messages` a message that is not blank",
    ),
    (
        "tool role",
        {"messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].role",
        "messages[0].role is 'tool'",
    ),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0]",
        "messages[0].content[0] is of type 'image_url'",
    ),
    (
        "stream_options alone",
        {"stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream_options applies",
    ),
    ("unknown drafter", {"drafter": "eagle"}, 400, "drafter", "unknown drafter 'eagle'"),
    (
        "other vocabulary",
        {"drafter": "other-vocab", "num_speculative_tokens": 2},
        400,
        "drafter",
        "drafter 'other-vocab'",
    ),
    (
        "K beyond the limit",
        {"num_speculative_tokens": 99},
        400,
        "num_speculative_tokens",
        "num_speculative_tokens is 99",
    ),
]
# GenerateRequest's names of fields the bodies name otherwise
GRPC_NAMES = re.compile(r"(?<![\w-])(max_new_tokens|token_ids|`text`|`chat`|structured_output)(?![\w-])")


@pytest.mark.parametrize("case,changes,status,param,message", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_openai_error(api, case, changes, status, param, message):
    body = CHAT | {"model": api.model} | changes
    got_status, got = call(api, "POST", "/v1/chat/completions", body)
    assert got_status == status, got
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"].startswith(message) and error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert not GRPC_NAMES.search(error["message"]), error["message"]  # only the body's names


COMPLETION = {"model": "MODEL", "prompt": "hi", "max_tokens": 4}
BAD_COMPLETIONS = [
    # name, changes to COMPLETION, param, start of the message: the completions body's names
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens", "max_tokens is 0: it must lie in [1, 256]"),
    ("logprobs above the limit", {"logprobs": 21}, "logprobs", "logprobs is 21: it must lie in [0, 20]"),
    ("blank prompt", {"prompt": "  "}, "prompt", "prompt is empty: set `prompt` to a prompt that is not blank"),
    ("bad json", {"structured_outputs": {"json": "{"}}, "structured_outputs", "structured_outputs.json must be"),
]


@pytest.mark.parametrize("case,changes,param,message", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_a_completions_error_names_the_fields_of_its_body(api, case, changes, param, message):
    got_status, got = call(api, "POST", "/v1/completions", COMPLETION | {"model": api.model} | changes)
    assert got_status == 400, got
    error = got["error"]
    assert error["message"].startswith(message) and error["param"] == param, error
    assert not GRPC_NAMES.search(error["message"]), error["message"]


def test_errors_through_the_sdk_and_same_messages_as_grpc(api, tiny_pipeline):
    client = api.client()
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    with pytest.raises(openai.BadRequestError) as caught:  # streamed: the error before the 200
        client.completions.create(model=api.model, prompt="hi", max_tokens=100000, stream=True)
    with pytest.raises(grpc.RpcError) as grpc_error:
        grpc_completion(tiny_pipeline.address, text="hi", raw_prompt=True, max_new_tokens=100000)
    # the same message, naming the field the client sent
    assert caught.value.body["message"] == grpc_error.value.details().replace("max_new_tokens", "max_tokens")
    assert caught.value.body["message"].startswith("max_tokens is 100000")
    assert caught.value.code == "invalid_argument"


def test_malformed_bodies_and_paths(api):
    status, got = call(api, "POST", "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and got["error"]["type"] == "invalid_request_error"
    status, got = call(api, "POST", "/v1/completions", {"model": api.model, "prompt": ["a", "b"]})
    assert status == 400 and got["error"]["param"] == "prompt" and "one prompt per request" in got["error"]["message"]
    status, got = call(api, "POST", "/v1/completions", {"model": api.model})
    assert status == 400 and got["error"]["message"] == "prompt: Field required"
    status, got = call(api, "GET", "/v1/nothing")
    assert status == 404 and got["error"]["message"]


def test_token_id_prompts_give_the_same_tokens_as_the_texts_ids(api, tiny_pipeline):
    prompt = "Once upon a time"
    ids = tiny_pipeline.target.tokenizer(prompt).input_ids
    expected = api.client().completions.create(model=api.model, prompt=prompt, max_tokens=16, temperature=0)
    for form in (ids, [ids]):
        got = api.client().completions.create(model=api.model, prompt=form, max_tokens=16, temperature=0)
        assert got.choices[0].text == expected.choices[0].text
        assert got.usage.prompt_tokens == expected.usage.prompt_tokens == len(ids)
    by_grpc = grpc_completion(
        api.grpc_address, KEY, token_ids=coordinator_pb2.PromptTokenIds(ids=ids), max_new_tokens=16, temperature=0
    )
    assert by_grpc.text == expected.choices[0].text
    vocab = tiny_pipeline.target.vocab_size
    for bad, word in (
        ([1, vocab], f"prompt holds {vocab}: token ids lie in"),
        ([1, 2**40], "32-bit"),
        ([], "one prompt per"),
    ):
        status, got = call(api, "POST", "/v1/completions", {"model": api.model, "prompt": bad, "max_tokens": 2})
        assert status == 400 and got["error"]["param"] == "prompt" and word in got["error"]["message"], got
    status, got = call(api, "POST", "/v1/completions", {"model": api.model, "prompt": [ids, ids]})
    assert status == 400 and "one prompt per request" in got["error"]["message"]


def test_json_nested_too_deep_is_a_400(api):
    deep = b'{"model": "m", "prompt": "hi", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, got = call(api, "POST", "/v1/completions", raw=deep)
    assert status == 400 and got["error"]["code"] == "invalid_json", got
    assert "nested too deeply" in got["error"]["message"]


def test_stop_strings_over_the_limits_are_refused_at_once_and_stall_nobody(api):
    """A 1 MB stop string or 10,000 of them: 400 naming the setting within 0.5 s (matching them
    would take far longer), while /health answers within 0.5 s and a concurrent stream's tokens
    keep coming at their pace. The bounds leave room for a loaded 2-core host: 100 ms failed once
    at 112 ms there."""
    gaps: list[float] = []

    def read_stream() -> None:
        stream = api.client().chat.completions.create(
            model=api.model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "num_speculative_tokens": 0},
        )
        last = time.perf_counter()
        for _ in stream:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    reader = threading.Thread(target=read_stream)
    reader.start()
    time.sleep(0.2)
    for stop, setting in (
        ("x" * 1_000_000, "max_stop_string_bytes"),
        ([f"s{i}" for i in range(10_000)], "max_stop_strings"),
    ):
        started = time.perf_counter()
        status, got = call(api, "POST", "/v1/completions", {"model": api.model, "prompt": "hi", "stop": stop})
        assert time.perf_counter() - started < 0.5 and status == 400, got
        assert got["error"]["param"] == "stop" and setting.replace("_", "-") in got["error"]["message"], got
        started = time.perf_counter()
        assert call(api, "GET", "/health", key=None)[0] == 200 and time.perf_counter() - started < 0.5
    reader.join(60)
    assert gaps and max(gaps) < 1.0, max(gaps)


def test_the_key_is_checked_before_the_body_is_read(api):
    """An 8 MiB body without a key is refused from its headers: the server answers 401 though the
    body never comes."""
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=5)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(8 * 1024 * 1024))
        connection.endheaders()  # and no body
        response = connection.getresponse()
        assert response.status == 401 and "missing API key" in json.loads(response.read())["error"]["message"]
    finally:
        connection.close()


def test_slow_headers_are_cut(tiny_pipeline, tiny_models):
    coordinator = CoordinatorThread(
        coordinator_settings(tiny_pipeline, tiny_models, http_port=free_port(), http_header_timeout_s=0.5)
    )
    try:
        with socket.create_connection(("127.0.0.1", coordinator.http_port), timeout=10) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the header's end never comes
            started = time.monotonic()
            assert slow.recv(1024) == b""  # closed by the server
            assert time.monotonic() - started < 5
        with socket.create_connection(("127.0.0.1", coordinator.http_port), timeout=10) as prompt:
            prompt.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert prompt.recv(1024).startswith(b"HTTP/1.1 200")
    finally:
        coordinator.stop()


def test_harmless_fields_are_accepted(api):
    body = CHAT | {
        "model": api.model,
        "user": "u1",
        "metadata": {"a": "b"},
        "logprobs": False,
        "n": 1,
        "frequency_penalty": 0,
        "tool_choice": "none",
        "top_k": -1,
    }
    status, got = call(api, "POST", "/v1/chat/completions", body)
    assert status == 200, got
    assert got["usage"]["completion_tokens"] == 4


def test_unavailable_target_is_503(tiny_pipeline, tiny_models):
    dead = f"127.0.0.1:{free_port()}"
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            http_port=free_port(),
            draft_address=dead,
            verify_addresses=[dead],
            tokenizer=str(tiny_models.target_dir),
        )
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{coordinator.http_port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 503 and caught.value.code == "unavailable"
        assert dead in caught.value.message
    finally:
        coordinator.stop()


@pytest.mark.multiprocess
def test_coordinator_process_serves_http_and_stops_on_sigterm(tiny_models):
    """``specdec serve coordinator`` as ``specdec up`` starts it (through the launcher): HTTP on
    the given port beside gRPC, both stopped by SIGTERM."""
    dead = f"127.0.0.1:{free_port()}"
    coordinator = ServiceProcess(
        "coordinator",
        free_port(),
        args=["--tokenizer", str(tiny_models.target_dir), "--verify-addresses", dead],
        http_port=free_port(),
    )
    coordinator.start()
    try:
        coordinator.wait_serving(time.monotonic() + 60)
        api = Api(coordinator.address, coordinator.http_port, "")
        assert call(api, "GET", "/health", key=None) == (200, {"status": "ok"})
    finally:
        coordinator.signal(signal.SIGTERM)
        coordinator.wait_stopped(time.monotonic() + 30)
    assert coordinator.process.returncode == 0


# --- API keys ---------------------------------------------------------------------------------


def test_api_keys_guard_http_and_grpc_not_health(api):
    for key, word in ((None, "missing API key"), ("wrong", "invalid API key")):
        status, got = call(api, "POST", "/v1/chat/completions", CHAT | {"model": api.model}, key=key)
        assert status == 401 and got["error"]["message"].startswith(word), got
        assert got["error"]["type"] == "authentication_error" and got["error"]["code"] == "unauthenticated"
        assert call(api, "GET", "/v1/models", key=key)[0] == 401
        with pytest.raises(grpc.RpcError) as caught:
            grpc_completion(api.grpc_address, key, text="hi", max_new_tokens=2)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED and word in caught.value.details()
    with pytest.raises(openai.AuthenticationError):
        api.client(key="wrong").chat.completions.create(model=api.model, messages=[{"role": "user", "content": "hi"}])
    assert call(api, "GET", "/health", key=None)[0] == 200
    assert is_serving(api.grpc_address)  # the gRPC health check needs no key
    assert len(grpc_completion(api.grpc_address, KEY, text="hi", max_new_tokens=2).token_ids) == 2


def test_api_key_settings(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nc\n\n  d  \n")
    args = ["--api-key", "a", "--api-key", "b", "--api-key-file", str(key_file)]
    assert parse_settings(CoordinatorSettings, args, prog="test").api_keys == ["a", "b", "c", "d"]
    monkeypatch.setenv("SPECDEC_API_KEYS", "e,f")  # the name without the service prefix
    assert parse_settings(CoordinatorSettings, [], prog="test").api_keys == ["e", "f"]
    assert parse_settings(CoordinatorSettings, ["--api-key", "a"], prog="test").api_keys == ["a"]  # the flag wins
    monkeypatch.delenv("SPECDEC_API_KEYS")
    monkeypatch.setenv("SPECDEC_COORDINATOR_API_KEYS", "g,h")  # the prefixed name still works
    assert parse_settings(CoordinatorSettings, [], prog="test").api_keys == ["g", "h"]
    assert CoordinatorSettings(api_keys=["i"]).api_keys == ["i"]
    with pytest.raises(ValidationError, match="No such file"):
        CoordinatorSettings(api_key_file=str(tmp_path / "missing"))
    keys = ApiKeys(["a", "b"])
    keys.check("Bearer b")
    keys.check("bearer  a ")
    for header, word in (
        (None, "missing"),
        ("Bearer", "malformed"),
        ("Basic YQ==", "malformed"),
        ("Bearer c", "invalid"),
    ):
        with pytest.raises(Unauthenticated, match=word):
            keys.check(header)
    ApiKeys([]).check(None)  # no keys: open


def test_demo_sends_the_key_its_coordinator_requires(tmp_path, monkeypatch):
    """``specdec demo`` starts a coordinator from this environment: it sends the first key that
    coordinator will require, from either variable or the key file, and none when there is none."""
    from specdec_app.cli import configured_api_key

    for name in ("SPECDEC_API_KEYS", "SPECDEC_COORDINATOR_API_KEYS", "SPECDEC_COORDINATOR_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert configured_api_key() is None
    monkeypatch.setenv("SPECDEC_API_KEYS", "k1,k2")
    assert configured_api_key() == "k1"
    monkeypatch.delenv("SPECDEC_API_KEYS")
    (tmp_path / "keys").write_text("# keys\nfrom-file\n")
    monkeypatch.setenv("SPECDEC_COORDINATOR_API_KEY_FILE", str(tmp_path / "keys"))
    assert configured_api_key() == "from-file"


def test_cli_generate_sends_the_api_key(api):
    from typer.testing import CliRunner

    from specdec_app.cli import app

    args = ["generate", "hi", "--coordinator", api.grpc_address, "--max-new-tokens", "3", "--json"]
    result = CliRunner().invoke(app, [*args, "--api-key", KEY])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["metrics"]["num_generated_tokens"] == 3
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "UNAUTHENTICATED" in result.output


# --- cancellation -----------------------------------------------------------------------------


def test_client_disconnect_mid_stream_releases_both_sessions(api, tiny_pipeline):
    body = {
        "model": api.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 250,
        "temperature": 0,
        "stream": True,
        "num_speculative_tokens": 2,
    }
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
    connection.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    response = connection.getresponse()
    assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = 0
    while events < 3:  # the role chunk and the first tokens
        line = response.fp.readline()
        events += line.startswith(b"data: {")
    assert len(tiny_pipeline.verify.servicer.sessions) == 1  # the request is running
    connection.sock.close()  # the client goes away mid-stream
    connection.close()
    wait_no_sessions(tiny_pipeline)
    status, got = call(api, "POST", "/v1/chat/completions", CHAT | {"model": api.model})
    assert status == 200 and got["usage"]["completion_tokens"] == 4


def generated_tokens(api: Api) -> float:
    """The coordinator's ``specdec_generation_tokens`` counter (tokens committed to requests)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{api.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("specdec_generation_tokens_total ")
    )


def test_client_disconnect_before_a_non_streamed_answer_cancels_it(api, tiny_pipeline):
    """A non-streamed request whose client gives up (a read timeout) is cancelled: both sessions
    are released long before its 250 tokens, and the coordinator stops generating for it."""
    before = generated_tokens(api)
    body = {
        "model": api.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 250,
        "temperature": 0,
        "num_speculative_tokens": 0,
    }  # plain decode: 250 rounds
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
    connection.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    deadline = time.monotonic() + 30
    while generated_tokens(api) == before:  # decoding has begun
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.01)
    connection.sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        connection.getresponse()  # the client's timeout: nothing came yet
    connection.close()
    wait_no_sessions(tiny_pipeline)
    time.sleep(0.2)  # a request still running would keep adding tokens
    cancelled_at = generated_tokens(api) - before
    assert cancelled_at < 250
    assert generated_tokens(api) - before == cancelled_at
    status, got = call(api, "POST", "/v1/chat/completions", CHAT | {"model": api.model})
    assert status == 200 and got["usage"]["completion_tokens"] == 4


def sse_chunks(api: Api, body: dict) -> list[dict]:
    """The JSON chunks of a streamed request, checked to end with ``data: [DONE]``."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{api.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=60) as response:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_continuous_usage_stats(api):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it): with
    ``include_usage``, every chunk carries the usage so far, ending at the final usage."""
    body = {
        "model": api.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = sse_chunks(api, body)
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 12
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-2] == 12 and len(set(counts)) > 2
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["prompt_tokens"]}
    body["stream_options"] = {"continuous_usage_stats": True}  # without include_usage: no usage at all, as in vLLM
    assert not any("usage" in c for c in sse_chunks(api, body))


def test_fuzzed_requests_never_get_a_server_error(api):
    """Requests generated from the coordinator's OpenAPI document (schemathesis) for every
    operation, with the API key: every answer is a success or a client error in OpenAI's shape,
    never a 5xx or a hang."""
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{api.port}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    for operation in operations:
        _fuzz(operation)


def _fuzz(operation) -> None:
    """Sends ``operation``'s generated requests with the API key; none may get a 5xx."""

    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(max_examples=25, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
    def answered(case):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
        response = case.call(timeout=60)
        assert response.status_code < 500, f"{operation.path}: {response.status_code} {response.text}"
        if response.status_code >= 400:
            assert set(response.json()["error"]) >= {"message", "type", "param", "code"}

    answered()


def test_still_serving_after_the_fuzzing(api):
    completion = api.client().completions.create(model=api.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4


# --- a third-party load generator ---------------------------------------------------------------


@pytest.mark.long  # a load generator's run: scripts/long_checks.sh
def test_guidellm_load_completes_without_errors(api, tiny_models, tmp_path, monkeypatch):
    """guidellm, the load generator of vLLM's project, run as its users run it (``guidellm run``,
    a subprocess) against the endpoint: 2 concurrent streams, 4 streamed chat requests of 8 tokens,
    the tokenizer from the tiny target's folder (nothing downloaded). Every request completes,
    none errors, and its figures come from our usage (8 output tokens each). The output folder is
    relative, as the bench's --out usually is."""
    from pathlib import Path

    from specdec_app.bench.load_generator import LoadTarget, run_guidellm

    monkeypatch.chdir(tmp_path)
    target = LoadTarget("specdec", api.base_url, api.model, str(tiny_models.target_dir), KEY, {"temperature": 0})
    summary = run_guidellm(
        target,
        [PROMPT, "Name three colors."],
        concurrency=2,
        num_requests=4,
        max_tokens=8,
        out_dir=Path("out"),
        timeout_s=120,
    )
    assert summary["concurrency"] == 2
    assert (summary["num_completed"], summary["num_errored"], summary["num_incomplete"]) == (4, 0, 0), summary["errors"]
    assert summary["num_output_tokens"] == 4 * 8
    assert summary["requests_per_second"] > 0 and summary["output_tokens_per_second"] > 0
    assert 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_p99"] and summary["itl_ms_p50"] > 0
    report = json.loads((tmp_path / "out" / summary["report_file"]).read_text())
    sent = json.loads(report["benchmarks"][0]["requests"]["successful"][0]["request_args"])["body"]
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


# --- structured output, penalties and limits from the SDK -----------------------------------------


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)
    ok: bool


def test_sdk_parse_with_a_pydantic_model_returns_the_object(api):
    completion = api.client().chat.completions.parse(
        model=api.model,
        messages=[{"role": "user", "content": "Pick a color"}],
        response_format=Pick,
        max_tokens=40,
        temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop" and isinstance(message.parsed, Pick)


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"structured_outputs": {"regex": "[0-9]{3}"}},
        {"structured_outputs": {"grammar": 'root ::= "a" [b-d]+ "e"'}},
    ],
)
def test_structured_output_fields_constrain_the_text(api, extra):
    body = {"model": api.model, "messages": [{"role": "user", "content": "Answer"}], "max_tokens": 24, "temperature": 0}
    status, got = call(api, "POST", "/v1/chat/completions", body | extra)
    assert status == 200, got
    text = got["choices"][0]["message"]["content"]
    if "response_format" in extra:
        assert got["choices"][0]["finish_reason"] == "length" or isinstance(json.loads(text), dict)
    elif "choice" in extra["structured_outputs"]:
        assert text in ("yes", "no")
    elif "regex" in extra["structured_outputs"]:
        assert len(text) == 3 and text.isdigit()
    else:
        assert got["choices"][0]["finish_reason"] == "length" or (text[0], text[-1]) == ("a", "e")


def test_penalties_and_limits_from_the_sdk(api, tiny_pipeline):
    fields = {"frequency_penalty": 0.8, "presence_penalty": 0.3, "logit_bias": {"2": -100}}
    response = api.client().chat.completions.create(
        model=api.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        temperature=0,
        **fields,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True},
    )
    expected = grpc_completion(
        tiny_pipeline.address, text=PROMPT, max_new_tokens=12, temperature=0, frequency_penalty=0.8,
        presence_penalty=0.3, logit_bias={2: -100}, repetition_penalty=1.2, min_tokens=3, ignore_eos=True,
    )  # fmt: skip
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == 12


def test_n_choices_are_independent_requests_seeded_by_index(api, tiny_pipeline):
    """A fixed K: under adaptive K the choices' load (they run at once) could choose other K than
    a request alone, and a seed reproduces a sampled completion at the same K."""
    response = api.client().chat.completions.create(
        model=api.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=1.0,
        seed=5,
        n=3,
        extra_body={"num_speculative_tokens": 2},
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for i, choice in enumerate(response.choices):  # choice i: the request with seed 5 + i
        expected = grpc_completion(
            tiny_pipeline.address, text=PROMPT, max_new_tokens=8, temperature=1.0, seed=5 + i, num_speculative_tokens=2
        )
        assert choice.message.content == expected.text
    assert len({choice.message.content for choice in response.choices}) > 1
    assert response.usage.completion_tokens == sum(c.specdec["num_generated_tokens"] for c in response.choices)


# --- logprobs and n > 1 from the SDK --------------------------------------------------------------


def test_chat_logprobs_streamed_and_not(api, tiny_pipeline, smollm2_tokenizer):
    """The SDK parses ``choices[0].logprobs.content``: the gRPC API's values for the same request,
    each token's text, bytes and top alternatives; a stream's chunks carry the same entries (the
    values within float rounding: another run's rounds may verify in other forwards)."""
    expected = grpc_completion(
        tiny_pipeline.address, text=PROMPT, max_new_tokens=16, temperature=0, num_speculative_tokens=3,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    request = dict(
        model=api.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"num_speculative_tokens": 3},
    )
    content = api.client().chat.completions.create(**request).choices[0].logprobs.content
    assert [entry.token for entry in content] == token_texts(smollm2_tokenizer, expected.token_ids)
    assert [entry.logprob for entry in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3 for entry in content)
    tops = [[top.token for top in entry.top_logprobs] for entry in content]
    assert tops == [token_texts(smollm2_tokenizer, e.top_token_ids) for e in expected.logprobs]
    chunks = list(api.client().chat.completions.create(**request, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_completions_logprobs_streamed_and_not(api, tiny_pipeline):
    prompt = "Once upon a time"
    expected = grpc_completion(
        tiny_pipeline.address, text=prompt, raw_prompt=True, max_new_tokens=12, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    request = dict(model=api.model, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    logprobs = api.client().completions.create(**request).choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == 12
    assert all(logprobs.tokens[i] in top and len(top) <= 3 for i, top in enumerate(logprobs.top_logprobs))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    chunks = list(api.client().completions.create(**request, stream=True))
    streamed = {
        key: [v for c in chunks if c.choices and c.choices[0].logprobs for v in getattr(c.choices[0].logprobs, key)]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert (streamed["tokens"], streamed["text_offset"]) == (logprobs.tokens, logprobs.text_offset)
    assert [list(top) for top in streamed["top_logprobs"]] == [list(top) for top in logprobs.top_logprobs]
    assert streamed["token_logprobs"] == pytest.approx(logprobs.token_logprobs, abs=1e-4)
    with pytest.raises(openai.BadRequestError) as caught:
        api.client().completions.create(**request | {"logprobs": 21})
    assert caught.value.param == "logprobs" and caught.value.body["message"].startswith(
        "logprobs is 21: it must lie in [0, 20]"
    )


def test_n_choices_stream_interleaved(api):
    """Streamed n > 1: every chunk names its choice, each choice opens with the role and ends with
    its finish chunk, the usage counts every choice, and the texts are the non-streamed ones."""
    request = dict(
        model=api.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body={"num_speculative_tokens": 2},
    )
    whole = api.client().chat.completions.create(**request)
    chunks = list(api.client().chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    texts, roles, finishes = {0: "", 1: ""}, [], []
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles += [choice.index] if choice.delta.role else []
        finishes += [(choice.index, chunk.specdec["num_generated_tokens"])] if choice.finish_reason else []
    assert sorted(roles) == [0, 1] and sorted(index for index, _ in finishes) == [0, 1]
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
    assert chunks[-1].usage.completion_tokens == sum(n for _, n in finishes) == whole.usage.completion_tokens
