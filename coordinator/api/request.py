"""Validation of a GenerateRequest into the parameters of its speculative rounds
(:class:`coordinator.speculation.plan.ResolvedRequest`)."""

import dataclasses
import functools
import secrets

from llguidance import LLTokenizer

from coordinator.api.prompt_bound import token_bound
from coordinator.settings import CoordinatorSettings
from coordinator.speculation.plan import LOOKUPS, DraftPlan, ResolvedRequest
from specdec.rpc.errors import FailedPrecondition, InvalidArgument
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import GrammarTooLarge, StructuredOutput, grammar_tokenizer
from specdec.v1 import coordinator_pb2, draft_pb2, verify_pb2

# The roles a chat message may have: those the chat templates know (OpenAI's developer is a system message)
CHAT_ROLES = ("system", "user", "assistant")


def draft_plan(settings: CoordinatorSettings, sampling: SamplingParams, model_drafter: bool) -> DraftPlan:
    """The plan (:class:`coordinator.speculation.plan.DraftPlan`) of a request with ``sampling``
    whose drafter runs a model or not."""
    ahead, shares = settings.draft_ahead and model_drafter, settings.draft_shares_target_cores
    return DraftPlan(
        drafts_ahead=ahead,
        hidden_behind_verify=ahead and not shares,
        branches=settings.draft_ahead_branches if ahead and sampling.greedy and not shares else 1,
        prefill_with_target=not shares or not sampling.greedy,
    )


def _field(request, name: str, default):
    return getattr(request, name) if request.HasField(name) else default


def prompt_ids(request: coordinator_pb2.GenerateRequest, tokenizer) -> list[int]:
    """The prompt's token ids: ``token_ids`` as they are; else tokenized, through the chat template
    (one user message for ``text``) with the generation prompt added, or verbatim when
    ``raw_prompt`` is set. Raises InvalidArgument."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        if request.raw_prompt:
            raise InvalidArgument("raw_prompt applies to a text prompt, not to token ids (used as they are)")
        if not request.token_ids.ids:
            raise InvalidArgument("prompt is empty: give token_ids at least one token id")
        return list(request.token_ids.ids)
    if kind == "chat":
        if request.raw_prompt:
            raise InvalidArgument("raw_prompt applies to a text prompt, not to chat messages")
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    else:
        messages = [{"role": "user", "content": request.text}]
    if not any(m["content"].strip() for m in messages):
        where = "give `chat` a message" if kind == "chat" else "set `text` to a prompt"  # backquoted: field names
        raise InvalidArgument(f"prompt is empty: {where} that is not blank")
    if request.raw_prompt:
        return tokenizer(request.text).input_ids
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def too_many_messages(field: str, num_messages: int | str, max_chat_messages: int) -> str:
    """The error message of a chat of ``num_messages`` messages (a number, or "more than N") in
    ``field``, more than the limit."""
    return (
        f"{field} has {num_messages} messages: at most {max_chat_messages} are allowed (the coordinator's "
        "--max-chat-messages)"
    )


def check_chat(request: coordinator_pb2.GenerateRequest, max_chat_messages: int) -> None:
    """Refuses, before the chat template sees them, more chat messages than ``max_chat_messages``
    and a role outside CHAT_ROLES (a template puts the role in the prompt's text: a free-form one
    could forge turns or special tokens). Raises InvalidArgument."""
    if request.WhichOneof("prompt") != "chat":
        return
    messages = request.chat.messages
    if len(messages) > max_chat_messages:
        raise InvalidArgument(too_many_messages("chat", len(messages), max_chat_messages))
    bad = next((i for i, m in enumerate(messages) if m.role not in CHAT_ROLES), None)
    if bad is not None:
        raise InvalidArgument(
            f"chat.messages[{bad}].role is {messages[bad].role[:64]!r}: it must be one of {', '.join(CHAT_ROLES)}"
        )


def check_prompt_bytes(request: coordinator_pb2.GenerateRequest, tokenizer, window: int) -> None:
    """Refuses, before any tokenizing, a text prompt too long to fit the context window of
    ``window`` tokens whatever its tokens: it has at least the tokens
    :mod:`coordinator.api.prompt_bound` finds from its bytes (after the tokenizer's normalizer),
    and a chat's template adds more. No check where that bound would not hold for the tokenizer.
    Raises InvalidArgument."""
    bound = token_bound(tokenizer)
    if bound is None or request.WhichOneof("prompt") == "token_ids":
        return
    contents = [request.text] if request.WhichOneof("prompt") != "chat" else [m.content for m in request.chat.messages]
    num_tokens = 0
    for content in contents:
        num_tokens += bound.min_tokens(content, enough=window - num_tokens)
        if num_tokens >= window:
            num_bytes = sum(len(content.encode()) for content in contents)
            raise InvalidArgument(
                f"prompt has {num_bytes} bytes, at least {num_tokens} tokens; the target's context window is "
                f"{window}: shorten the prompt"
            )


def check_stop(request: coordinator_pb2.GenerateRequest, max_stop_strings: int, max_stop_string_bytes: int) -> None:
    """Raises InvalidArgument for more stop strings than ``max_stop_strings`` or one longer than
    ``max_stop_string_bytes`` UTF-8 bytes."""
    if len(request.stop) > max_stop_strings:
        raise InvalidArgument(
            f"stop has {len(request.stop)} strings: at most {max_stop_strings} are allowed (the coordinator's "
            "--max-stop-strings)"
        )
    longest = max((len(s.encode()) for s in request.stop), default=0)
    if longest > max_stop_string_bytes:
        raise InvalidArgument(
            f"stop has a string of {longest} bytes: each may have at most {max_stop_string_bytes} (the "
            "coordinator's --max-stop-string-bytes)"
        )


def resolve(
    request: coordinator_pb2.GenerateRequest,
    settings: CoordinatorSettings,
    tokenizer,
    tokenizer_fingerprint: str,
    verify_info: verify_pb2.VerifyServiceGetInfoResponse,
    draft_info: draft_pb2.DraftServiceGetInfoResponse | None,
) -> ResolvedRequest:
    """Checks every field and fills in defaults. ``draft_info`` None: the draft service's drafters
    are unknown (it was never reached), and the request runs without it. Tokenizes the prompt and
    compiles its grammar: CPU work that grows with the request, bounded by the checks before it
    (stop strings, chat messages, the prompt's bytes against the context window); the coordinator
    runs it off its event loop.

    Raises:
        InvalidArgument: a field out of range (the message names it and the allowed range).
        FailedPrecondition: the coordinator's tokenizer or the drafter's vocabulary differs from
            the target's.
    """
    if tokenizer_fingerprint != verify_info.vocab_fingerprint:
        raise FailedPrecondition(
            f"the coordinator's tokenizer ({settings.tokenizer}) differs from the target's "
            f"({verify_info.model}): start the coordinator with --tokenizer {verify_info.model}"
        )
    window = verify_info.max_context_length
    check_stop(request, settings.max_stop_strings, settings.max_stop_string_bytes)
    check_chat(request, settings.max_chat_messages)
    check_prompt_bytes(request, tokenizer, window)
    ids = prompt_ids(request, tokenizer)
    bad = next((i for i in ids if not 0 <= i < verify_info.vocab_size), None)
    if bad is not None:  # only token_ids can hold one
        raise InvalidArgument(f"token_ids holds {bad}: token ids lie in [0, {verify_info.vocab_size - 1}]")
    if len(ids) >= window:
        raise InvalidArgument(
            f"prompt has {len(ids)} tokens; the target's context window is {window}: shorten the prompt"
        )
    max_new = _field(request, "max_new_tokens", settings.default_max_new_tokens)
    if not 1 <= max_new <= settings.max_new_tokens_limit:
        raise InvalidArgument(
            f"max_new_tokens is {max_new}: it must lie in [1, {settings.max_new_tokens_limit}] (the coordinator's "
            "--max-new-tokens-limit)"
        )
    if len(ids) + max_new > window:
        raise InvalidArgument(
            f"max_new_tokens is {max_new}: after the prompt's {len(ids)} tokens, the target's context window of "
            f"{window} holds {window - len(ids)} more: lower max_new_tokens to at most {window - len(ids)}, or "
            "shorten the prompt"
        )
    sampling = _sampling(request, ids, max_new, verify_info, settings.max_logprobs)
    vocab = None
    if sampling.structured_output is not None:
        vocab = _check_structured_output(sampling, tokenizer, verify_info, settings)
    max_k = verify_info.max_num_speculative_tokens
    adaptive = settings.adaptive and not request.HasField("num_speculative_tokens")
    if adaptive:
        k = min(settings.adaptive_k_max, max_k)
    else:
        k = _field(request, "num_speculative_tokens", settings.num_speculative_tokens)
        if not 0 <= k <= max_k:
            raise InvalidArgument(
                f"num_speculative_tokens is {k}: it must lie in [0, {max_k}] (0 = plain decode; the verify "
                "service's --max-num-speculative-tokens)"
            )
    drafter = request.drafter
    if (k > 0 or drafter) and not (adaptive and drafter in LOOKUPS):  # adaptive lookups: no draft service
        drafter = _check_drafter(drafter, draft_info, verify_info)
    adaptive = adaptive and k > 0
    resolved = ResolvedRequest(
        ids,
        max_new,
        sampling,
        list(request.stop),
        k,
        drafter,
        adaptive,
        request.ignore_eos,
        vocab if adaptive and settings.grammar_aware_drafting else None,
        settings.grammar_limits(),
    )
    if not resolved.uses_draft_service:
        return resolved
    assert draft_info is not None  # _check_drafter gives no drafter where the draft service was never reached
    model = any(d.name == drafter and d.model for d in draft_info.drafters)
    return dataclasses.replace(resolved, draft=draft_plan(settings, sampling, model))


def _sampling(
    request: coordinator_pb2.GenerateRequest,
    prompt: list[int],
    max_new_tokens: int,
    verify_info: verify_pb2.VerifyServiceGetInfoResponse,
    max_logprobs: int,
) -> SamplingParams:
    """The request's sampling transform, logits processors and log-probabilities, every default
    filled in. Raises InvalidArgument for a value out of range."""
    min_tokens = _field(request, "min_tokens", 0)
    if min_tokens > max_new_tokens:
        raise InvalidArgument(f"min_tokens is {min_tokens}: it must not exceed max_new_tokens ({max_new_tokens})")
    if not 0 <= request.top_logprobs <= max_logprobs:
        raise InvalidArgument(
            f"top_logprobs is {request.top_logprobs}: it must lie in [0, {max_logprobs}] (the coordinator's "
            "--max-logprobs)"
        )
    bad_ids = sorted(i for i in request.logit_bias if not 0 <= i < verify_info.vocab_size)
    if bad_ids:
        raise InvalidArgument(
            f"logit_bias names token {bad_ids[0]}: token ids lie in [0, {verify_info.vocab_size - 1}]"
        )
    return SamplingParams(  # raises InvalidArgument for a value out of range
        temperature=_field(request, "temperature", 0.0),
        top_k=_field(request, "top_k", 0),
        top_p=_field(request, "top_p", 1.0),
        seed=_field(request, "seed", secrets.randbits(63)),
        frequency_penalty=_field(request, "frequency_penalty", 0.0),
        presence_penalty=_field(request, "presence_penalty", 0.0),
        repetition_penalty=_field(request, "repetition_penalty", 1.0),
        logit_bias=tuple(sorted(request.logit_bias.items())),
        min_tokens=min_tokens,
        eos_token_ids=tuple(verify_info.eos_token_ids),
        num_prompt_tokens=len(prompt),
        structured_output=StructuredOutput.from_proto(request.structured_output),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
    )


def _check_structured_output(
    sampling: SamplingParams,
    tokenizer,
    verify_info: verify_pb2.VerifyServiceGetInfoResponse,
    settings: CoordinatorSettings,
) -> LLTokenizer:
    """Compiles the request's structured output against the target's vocabulary within the
    settings' limits (the only check: the services trust it), so that a bad spec fails here and
    not in a service; returns the vocabulary it compiled against. Raises InvalidArgument naming
    the part that fails, and for a spec over a limit, the limit and the setting that raises it."""
    assert sampling.structured_output is not None
    if sampling.min_tokens:
        raise InvalidArgument(
            "min_tokens cannot be combined with structured_output (the grammar decides where the output ends): "
            "remove min_tokens"
        )
    vocab = _grammar_tokenizer(tokenizer, verify_info.vocab_size, tuple(verify_info.eos_token_ids))
    try:
        sampling.structured_output.check(vocab, settings.grammar_limits())
    except GrammarTooLarge as err:
        setting = f"grammar_{err.limit}"
        raise InvalidArgument(
            f"{err} (the coordinator's {setting} is {getattr(settings, setting)}: an operator raises it with "
            f"--{setting.replace('_', '-')} or SPECDEC_COORDINATOR_{setting.upper()})"
        ) from None
    return vocab


@functools.cache
def _grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """The llguidance view of the coordinator's tokenizer, built once (about 0.4 s)."""
    return grammar_tokenizer(tokenizer, vocab_size, list(eos_token_ids))


def _check_drafter(name: str, draft_info, verify_info) -> str:
    """The drafter to use; "" when the draft service's GetInfo is unknown (it was never reached:
    the request then runs without it, in plain decode or the coordinator's n-gram lookup)."""
    if draft_info is None:
        return ""
    name = name or draft_info.default_drafter
    drafters = {d.name: d for d in draft_info.drafters}
    if name not in drafters:
        raise InvalidArgument(f"unknown drafter {name!r}: the draft service hosts {', '.join(drafters)}")
    fingerprint = drafters[name].vocab_fingerprint
    if fingerprint and fingerprint != verify_info.vocab_fingerprint:
        raise FailedPrecondition(
            f"drafter {name!r} ({drafters[name].model}) has a different vocabulary from the target "
            f"({verify_info.model}): choose a draft model that shares the target's tokenizer, "
            "or a model-free drafter (ngram, suffix)"
        )
    return name
