"""The in-process baselines on the target in transformers: plain greedy ``generate``, prompt lookup
(``prompt_lookup_num_tokens``, Saxena 2023) and assisted generation with a draft model
(``assistant_model``, Leviathan et al. 2023), each measured with forward hooks on the models."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from coordinator.api.request import prompt_ids
from coordinator.observability.metrics import histogram
from specdec.timing import ms_since
from specdec_app.bench.cpu_pinning import pinned
from specdec_app.bench.measurement import Measurement
from specdec_app.bench.questions import Question, generate_request


@dataclass
class ForwardRecord:
    """One forward pass: ``cache_len`` tokens already in the KV cache, ``input_len`` new ones, ``ms`` long."""

    cache_len: int
    input_len: int
    ms: float = 0.0


@dataclass
class ForwardProbe:
    """Records every forward pass of a transformers model through forward hooks."""

    model: PreTrainedModel
    records: list[ForwardRecord] = field(default_factory=list)

    def __post_init__(self):
        self._start = 0.0
        self._handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after),
        ]

    def _before(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        cache_len = cache.get_seq_length() if cache is not None else 0
        self.records.append(ForwardRecord(cache_len, int(input_ids.shape[1])))
        self._start = time.perf_counter()

    def _after(self, module, args, output):
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.records[-1].ms = ms_since(self._start)

    def take(self) -> list[ForwardRecord]:
        records, self.records = self.records, []
        return records


def rounds_from_forwards(records: list[ForwardRecord], prompt_len: int, num_generated: int) -> list[tuple[int, int]]:
    """``(drafted, accepted)`` per target forward of a transformers generate call.

    A forward covers the committed tokens not yet in the cache followed by the candidate (draft)
    tokens; after it, generate keeps the accepted candidates plus one token of the target and crops
    the cache to the committed length - 1, so the next forward's cache length tells how many tokens
    the previous one committed. The last forward commits what is left of ``num_generated``.
    """
    rounds, committed = [], prompt_len
    final = prompt_len + num_generated
    for i, record in enumerate(records):
        drafted = record.cache_len + record.input_len - committed
        after = records[i + 1].cache_len + 1 if i + 1 < len(records) else final
        rounds.append((drafted, max(0, min(drafted, after - committed - 1))))
        committed = after
    return rounds


def forward_costs(records: list[ForwardRecord]) -> list[list]:
    """``[num_tokens, forwards, ms, ms]`` per number of new tokens (a :class:`Measurement`'s
    ``verify_costs``: in process, a call is its forward)."""
    by_tokens: dict[int, list[float]] = {}
    for record in records:
        by_tokens.setdefault(record.input_len, []).append(record.ms)
    return [[n, len(ms), sum(ms), sum(ms)] for n, ms in sorted(by_tokens.items())]


class _FirstTokenTimer(BaseStreamer):
    """generate() puts the prompt first, then each step's new tokens: the second put is the first token."""

    def __init__(self):
        self.start, self.puts, self.first_token_ms = time.perf_counter(), 0, 0.0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first_token_ms = ms_since(self.start)

    def end(self):
        pass


class TransformersMethod:
    """One way of running the target's ``generate``: ``plain``, ``hf-prompt-lookup/K=k`` or
    ``hf-assisted/K=k`` (``assistant`` = the draft model; constant K, no confidence cut-off, so
    that it matches a fixed-K pipeline). ``cpus``: run pinned to them with one torch thread
    (:func:`specdec_app.bench.cpu_pinning.pinned`; ``name`` then says where). ``constraint``: a
    question's schema (``Question.schema``) to logits processors for ``generate`` (plain
    constrained decoding, :func:`specdec_app.bench.structured.grammar_constraint`)."""

    def __init__(
        self,
        target,
        tokenizer,
        k: int = 0,
        kind: str = "plain",
        assistant=None,
        cpus: frozenset[int] | None = None,
        name: str | None = None,
        constraint: Callable[[str, int], LogitsProcessorList] | None = None,
    ):
        self.target, self.tokenizer, self.k, self.kind, self.cpus = target, tokenizer, k, kind, cpus
        self.constraint = constraint
        self.name = name or ("plain" if kind == "plain" else f"{kind}/K={k}")
        self.probe = ForwardProbe(target)
        self.draft_probe = ForwardProbe(assistant) if assistant is not None else None
        self.extra: dict = {}
        if kind == "hf-prompt-lookup":
            self.extra = {"prompt_lookup_num_tokens": k}
        elif kind == "hf-assisted":
            config = assistant.generation_config
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
            config.assistant_confidence_threshold = 0.0
            self.extra = {"assistant_model": assistant}

    def run(self, question: Question, max_new_tokens: int, seed: int) -> Measurement:
        # the coordinator's own tokenization, so every method starts from the same ids
        ids = torch.tensor([prompt_ids(generate_request(question), self.tokenizer)], device=self.target.device)
        torch.manual_seed(seed)
        self.probe.take()
        if self.draft_probe:
            self.draft_probe.take()
        timer = _FirstTokenTimer()
        extra = dict(self.extra)
        if question.schema and self.constraint is not None:
            extra["logits_processor"] = self.constraint(question.schema, ids.shape[1])
        with pinned(self.cpus), torch.inference_mode():
            output = self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                streamer=timer,
                **extra,
            )
        wall_ms = ms_since(timer.start)
        generated = output[0, ids.shape[1] :].tolist()
        forwards = self.probe.take()
        rounds = [r for r in rounds_from_forwards(forwards, ids.shape[1], len(generated)) if r[0] > 0]
        return Measurement(
            method=self.name,
            question_id=question.question_id,
            category=question.category,
            token_ids=generated,
            num_prompt_tokens=ids.shape[1],
            wall_ms=wall_ms,
            ttft_ms=timer.first_token_ms,
            num_target_forwards=len(forwards),
            num_spec_steps=len(rounds),
            num_draft_tokens=sum(d for d, _ in rounds),
            num_accepted_tokens=sum(a for _, a in rounds),
            acceptance_histogram=histogram((a for _, a in rounds), max((d for d, _ in rounds), default=-1) + 1),
            draft_ms=sum(r.ms for r in self.draft_probe.take()) if self.draft_probe else 0.0,
            verify_ms=sum(r.ms for r in forwards[1:]),
            num_verify_rounds=len(forwards) - 1,
            verify_costs=forward_costs(forwards[1:]),
        )
