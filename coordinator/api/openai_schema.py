"""The OpenAI request and response shapes of the HTTP API, mapped onto the gRPC messages: a request
body becomes the GenerateRequest that gRPC clients send, GenerateResponse messages become a
completion, stream chunks and usage, and a SpecdecError becomes OpenAI's error shape.

Fields that would change the output and that specdec does not implement (``tools``, ``echo``,
...) are refused by name, never ignored; fields that do not change it (``user``, ``metadata``,
...) are accepted. Structured output comes as OpenAI's ``response_format`` (``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (``json``, ``json_object``, ``regex``,
``choice``, ``grammar``), one of them, and becomes ``GenerateRequest.structured_output``.
Log-probabilities come as chat's ``logprobs`` and ``top_logprobs`` or the completions'
``logprobs: int``; their response shapes are :mod:`coordinator.api.logprobs`'.

An error of the gRPC path names GenerateRequest's fields; answered over HTTP, it names the body's
instead (``max_tokens`` or ``max_completion_tokens`` for ``max_new_tokens``, ``messages`` for
``chat``, ...: :meth:`_Request.field_names`), in its message and its ``param``, so that a client
reads the name it sent.
"""

import json
import re
import time
from typing import Any, Literal

import grpc
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ConfigDict, Field

from coordinator.api.client import Completion
from specdec.rpc.errors import SpecdecError
from specdec.sampling.structured_output import KINDS
from specdec.v1 import common_pb2, coordinator_pb2

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

# The GenerateRequest field an error message is about, from how the validation's message starts
# (the prompt: whichever of its fields the request gave).
_PARAMS = [
    ("max_new_tokens", "max_new_tokens"),
    ("prompt", "prompt"),
    ("chat", "prompt"),
    ("token_ids", "prompt"),
    ("stop", "stop"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("num_speculative_tokens", "num_speculative_tokens"),
    ("unknown drafter", "drafter"),
    ("drafter", "drafter"),
    ("structured_output", "structured_output"),
    ("frequency_penalty", "frequency_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("logit_bias", "logit_bias"),
    ("min_tokens", "min_tokens"),
    ("top_logprobs", "top_logprobs"),
    ("n is", "n"),
]


class ApiError(Exception):
    """An error answered in OpenAI's shape with HTTP status ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, the Retry-After header of a 429

    @classmethod
    def from_specdec(cls, err: SpecdecError, names: dict[str, str] | None = None) -> "ApiError":
        """The HTTP form of an error of the gRPC path: its status mapped, its message with the
        fields of ``names`` (the body's names of GenerateRequest's fields:
        :meth:`_Request.field_names`) renamed, its ``param`` the body's field it is about."""
        names = names or {}
        message = str(err)
        field = next((f for prefix, f in _PARAMS if message.startswith(prefix)), None)
        param = None if field is None else names.get(field, field)
        retry_after = getattr(err, "retry_after", None)  # an Overloaded's (coordinator.api.admission)
        return cls(HTTP_STATUS.get(err.code, 500), _renamed(message, names), param, err.code.name.lower(), retry_after)

    def to_json(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _renamed(message: str, names: dict[str, str]) -> str:
    """``message`` with every field of ``names`` it names renamed. A field is named as an
    identifier (``max_new_tokens``, ``structured_output.regex``) or a word in backquotes
    (`` `chat` ``); a plain word (``prompt``) is prose and keeps its name."""
    fields = sorted((name for name in names if not name.isalpha()), key=len, reverse=True)
    if not fields:
        return message
    pattern = re.compile(rf"(?<![\w.-])({'|'.join(map(re.escape, fields))})(?![\w-])")
    return pattern.sub(lambda match: names[match[1]], message)


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


# --- requests ---------------------------------------------------------------------------------


def _off(value) -> bool:
    return value is None or value is False or value == [] or value == {}


def _zero(value) -> bool:
    return value is None or (not isinstance(value, bool) and value == 0)


def _one(value) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


# Fields accepted and not acted on: they do not change the output.
HARMLESS = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"}
# Fields accepted only at the value that leaves the output unchanged.
NEUTRAL = {
    "echo": _off,
    "tools": _off,
    "functions": _off,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "modalities": lambda v: v is None or v == ["text"],
    "best_of": _one,
    "min_p": _zero,
    "suffix": lambda v: v in (None, ""),
    "include_stop_str_in_output": _off,
    "skip_special_tokens": lambda v: v is None or v is True,
}
# The body's roles, as the chat template's (coordinator.api.request.CHAT_ROLES)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the request's usage and no choices (OpenAI).
    ``continuous_usage_stats`` (vLLM's extension, sent by load generators such as guidellm): with
    ``include_usage``, every chunk also carries the usage so far."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema is enforced whatever ``strict`` says
    (specdec has no best-effort mode)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> common_pb2.StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise invalid(
                "response_format.json_schema",
                "response_format of type json_schema needs json_schema.schema: the JSON schema the output follows",
            )
        return common_pb2.StructuredOutput(json_schema=json.dumps(self.json_schema.schema_))


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of ``json`` (a JSON schema, as an
    object or its text), ``json_object``, ``regex``, ``choice`` or ``grammar`` (Lark or GBNF)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def structured_output(self) -> common_pb2.StructuredOutput:
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if self._value(name)]
        if len(given) != 1:
            raise invalid(
                "structured_outputs",
                f"structured_outputs sets {', '.join(given) or 'nothing'}: set exactly one of json, json_object, "
                "regex, choice or grammar",
            )
        value = self._value(given[0])
        if given[0] == "json":
            text = value if isinstance(value, str) else json.dumps(value)
            return common_pb2.StructuredOutput(json_schema=text)
        if given[0] == "choice":
            return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=value))
        return common_pb2.StructuredOutput(**{given[0]: value})

    def _value(self, name: str):
        return self.json_ if name == "json" else getattr(self, name)


class _Request(BaseModel):
    """Fields of both endpoints. ``top_k``, ``num_speculative_tokens``, ``drafter``,
    ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``structured_outputs`` and
    ``cache_salt`` are vLLM-style extensions (in the OpenAI SDK: ``extra_body``)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    top_k: int | None = None
    num_speculative_tokens: int | None = None
    drafter: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None

    def check_supported(self) -> None:
        """Raises ApiError (400) for a field specdec does not implement, naming it."""
        for name, value in (self.model_extra or {}).items():
            if name in HARMLESS or NEUTRAL.get(name, lambda _: False)(value):
                continue
            if name in NEUTRAL:
                raise invalid(
                    name,
                    f"{name}={value!r} is not supported by specdec (it would change the output): remove {name}",
                    "unsupported_parameter",
                )
            raise invalid(
                name,
                f"unsupported field {name!r}: remove it (docs/api.md lists the fields specdec takes)",
                "unsupported_parameter",
            )
        if self.stream_options is not None and not self.stream:
            raise invalid(
                "stream_options",
                "stream_options applies to streamed requests: set stream to true or remove stream_options",
            )

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def field_names(self) -> dict[str, str]:
        """The body's name of each GenerateRequest field (or part of one, or the prompt) it gives
        under another name: the names its errors use (:meth:`ApiError.from_specdec`)."""
        names = {"max_new_tokens": "max_tokens"}
        if self.structured_outputs is None:
            return names | {
                "structured_output": "response_format",
                "structured_output.json_schema": "response_format.json_schema.schema",
                "structured_output.json_object": "response_format",
            }
        return names | {
            "structured_output": "structured_outputs",
            **{
                f"structured_output.{kind}": f"structured_outputs.{'json' if kind == 'json_schema' else kind}"
                for kind in KINDS
            },
        }

    def structured_output(self) -> common_pb2.StructuredOutput | None:
        """The body's structured output; raises ApiError (400) when it sets two."""
        from_format = self.response_format.structured_output() if self.response_format else None
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise invalid(
                "structured_outputs",
                "response_format and structured_outputs both constrain the output: set only one of them",
            )
        return self.structured_outputs.structured_output()

    def logprobs_fields(self) -> tuple[bool | None, int | None]:
        """The body's (logprobs, top_logprobs), as GenerateRequest's fields."""
        return None, None

    def generate_request(self) -> coordinator_pb2.GenerateRequest:
        """The GenerateRequest of this body (the prompt set by the subclass; ``n`` choices of it,
        see :mod:`coordinator.api.choices`)."""
        self.check_supported()
        request = coordinator_pb2.GenerateRequest()
        top_k = 0 if self.top_k == -1 else self.top_k  # vLLM's "off"
        temperature = 1.0 if self.temperature is None else self.temperature  # OpenAI's default
        logprobs, top_logprobs = self.logprobs_fields()
        names = self.field_names()
        for name, value in [
            ("n", self.n),
            ("logprobs", logprobs),
            ("top_logprobs", top_logprobs),
            ("max_new_tokens", self.max_new_tokens()),
            ("temperature", temperature),
            ("top_p", self.top_p),
            ("top_k", top_k),
            ("seed", self.seed),
            ("num_speculative_tokens", self.num_speculative_tokens),
            ("drafter", self.drafter),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
            ("repetition_penalty", self.repetition_penalty),
            ("min_tokens", self.min_tokens),
            ("ignore_eos", self.ignore_eos),
            ("cache_salt", self.cache_salt),
        ]:
            if value is not None:
                _set(request, name, value, names.get(name, name))
        request.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop or [])
        try:
            request.logit_bias.update(self.logit_bias or {})
        except (ValueError, TypeError):
            raise invalid("logit_bias", "logit_bias keys must be token ids (32-bit integers)") from None
        structured_output = self.structured_output()
        if structured_output is not None:
            request.structured_output.CopyFrom(structured_output)
        return request


def _set(request: coordinator_pb2.GenerateRequest, name: str, value, param: str) -> None:
    """Sets a field; a value its protobuf type cannot hold is a 400 naming the field."""
    try:
        setattr(request, name, value)
    except (ValueError, TypeError):
        kind = "an unsigned 64-bit integer" if name == "seed" else "a 32-bit integer"
        raise invalid(param, f"{param} is {value}: it must be {kind}") from None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def logprobs_fields(self) -> tuple[bool | None, int | None]:
        return self.logprobs, self.top_logprobs

    def max_new_tokens(self) -> int | None:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise invalid("max_completion_tokens", "max_tokens and max_completion_tokens differ: set only one of them")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_names(self) -> dict[str, str]:
        names = super().field_names() | {"prompt": "messages", "`chat`": "`messages`", "chat.messages": "messages"}
        if self.max_completion_tokens is not None:
            names["max_new_tokens"] = "max_completion_tokens"
        return names

    def generate_request(self) -> coordinator_pb2.GenerateRequest:
        request = super().generate_request()
        request.chat.messages.extend(self._message(i, m) for i, m in enumerate(self.messages))
        return request

    @staticmethod
    def _message(i: int, message: ChatMessage) -> coordinator_pb2.ChatMessage:
        where = f"messages[{i}]"
        for name in message.model_extra or {}:
            raise invalid(
                f"{where}.{name}", f"{where}.{name} is not supported by specdec: remove it", "unsupported_parameter"
            )
        if message.role not in ROLES:
            raise invalid(f"{where}.role", f"{where}.role is {message.role!r}: it must be one of {', '.join(ROLES)}")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise invalid(
                        f"{where}.content[{j}]",
                        f"{where}.content[{j}] is of type {part.type!r}: specdec takes text parts only",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        return coordinator_pb2.ChatMessage(role=ROLES[message.role], content=content or "")


class CompletionRequest(_Request):
    """``prompt``: text, or token ids (a list of ints), or a list of one of either (OpenAI's batch
    form; more than one prompt per request is refused). ``logprobs``: the number of most likely
    tokens listed at each position (GenerateRequest's top_logprobs, with logprobs on)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None

    def logprobs_fields(self) -> tuple[bool | None, int | None]:
        return (None, None) if self.logprobs is None else (True, self.logprobs)

    def field_names(self) -> dict[str, str]:
        return super().field_names() | {"top_logprobs": "logprobs", "token_ids": "prompt", "`text`": "`prompt`"}

    def _one_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return prompt  # type: ignore[return-value]  # a list of ints: pydantic checked every item
        if len(prompt) != 1:
            raise invalid("prompt", f"prompt is a list of {len(prompt)} prompts: give one prompt per request")
        return prompt[0]  # type: ignore[return-value]

    def generate_request(self) -> coordinator_pb2.GenerateRequest:
        request = super().generate_request()
        prompt = self._one_prompt()
        if isinstance(prompt, str):
            request.text, request.raw_prompt = prompt, True  # a completion continues the text as it is
            return request
        try:
            request.token_ids.ids.extend(prompt)
        except ValueError:  # outside int32: no token id
            raise invalid("prompt", f"prompt holds {max(prompt, key=abs)}: token ids are 32-bit integers") from None
        return request


# --- responses --------------------------------------------------------------------------------


def specdec_metrics(metrics: coordinator_pb2.RequestMetrics | None) -> dict[str, Any]:
    """The request's RequestMetrics as JSON (the ``specdec`` key); 64-bit integers as numbers."""
    metrics = metrics or coordinator_pb2.RequestMetrics()
    out = MessageToDict(metrics, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for field in metrics.DESCRIPTOR.fields:
        if field.type in (field.TYPE_INT64, field.TYPE_UINT64) and field.name in out:
            out[field.name] = int(out[field.name])
    return out


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


class ResponseShape:
    """The completion and chunk JSON of one request: ``chat`` (chat.completion) or not
    (text_completion), named ``id``, for ``model``."""

    def __init__(self, chat: bool, request_id: str, model: str):
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def completion(self, completions: list[Completion], logprobs: list[dict | None]) -> dict:
        """The response of a request's choices (``n`` of them), with their ``logprobs`` objects
        (:class:`coordinator.api.logprobs.ChoiceLogprobs`; None without); ``specdec`` is the first
        choice's metrics, and with n > 1 every choice carries its own too."""
        choices = [
            self._choice(i, completion, len(completions) > 1, choice_logprobs)
            for i, (completion, choice_logprobs) in enumerate(zip(completions, logprobs, strict=True))
        ]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        first = completions[0].metrics
        prompt_tokens = first.num_prompt_tokens if first else 0
        return body | {
            "usage": usage(prompt_tokens, sum(len(completion.token_ids) for completion in completions)),
            "specdec": specdec_metrics(first),
        }

    def _choice(self, index: int, completion: Completion, with_metrics: bool, logprobs: dict | None) -> dict:
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": completion.text}}
        else:
            choice = {"index": index, "text": completion.text}
        choice |= {"finish_reason": completion.finish_reason, "logprobs": logprobs}
        return choice | ({"specdec": specdec_metrics(completion.metrics)} if with_metrics else {})

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        usage_so_far: dict[str, int] | None = None,
        logprobs: dict | None = None,
    ) -> dict:
        """A stream chunk of choice ``index`` carrying ``text`` (None: nothing, as with the finish
        chunk) and the ``logprobs`` object of its tokens, a chat choice's first chunk also the
        assistant role; ``usage_so_far``: the ``usage`` of a chunk under
        ``continuous_usage_stats``."""
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice |= {"finish_reason": finish_reason, "logprobs": logprobs}
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return body if usage_so_far is None else body | {"usage": usage_so_far}

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, []) | {"usage": usage(num_prompt_tokens, num_completion_tokens)}
