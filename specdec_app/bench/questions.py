"""Spec-Bench questions (Xia et al. 2024, https://github.com/hemingkx/Spec-Bench): one JSON object
per line with ``question_id``, ``category`` and ``turns``; the benchmark uses the first turn."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdec.v1 import coordinator_pb2


@dataclass(frozen=True)
class Question:
    """A prompt: the user message ``prompt``, after the conversation ``messages`` (``(role,
    content)`` pairs, role ``system``, ``user`` or ``assistant``: a system prompt and earlier turns,
    :mod:`specdec_app.bench.conversation`; empty: the prompt alone). ``schema``: the JSON schema its
    answer must follow (``specdec bench structured``, :mod:`specdec_app.bench.structured`), as
    JSON text; empty: none."""

    question_id: int
    category: str
    prompt: str
    schema: str = ""
    messages: tuple[tuple[str, str], ...] = ()


def generate_request(question: Question) -> coordinator_pb2.GenerateRequest:
    """The question as the coordinator takes it, the same for every method (the in-process ones
    tokenize it with the coordinator's ``prompt_ids``): ``text`` for a prompt alone, else ``chat``
    with the conversation and the prompt as its last user message."""
    if not question.messages:
        return coordinator_pb2.GenerateRequest(text=question.prompt)
    messages = [*question.messages, ("user", question.prompt)]
    chat = coordinator_pb2.ChatMessages(
        messages=[coordinator_pb2.ChatMessage(role=role, content=content) for role, content in messages]
    )
    return coordinator_pb2.GenerateRequest(chat=chat)


def load_questions(path: Path, categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """The first ``limit`` Spec-Bench questions (all when None) of each category, grouped by
    category in the order of ``categories`` (file order when None).

    Raises:
        ValueError: the file is missing or malformed, or a category is not in it.
    """

    def question(record: dict) -> Question:
        return Question(int(record["question_id"]), str(record["category"]), str(record["turns"][0]))

    return load_jsonl(
        path, question, "a Spec-Bench question (each line needs question_id, category and turns)", categories, limit
    )


def load_jsonl(
    path: Path,
    parse: Callable[[dict], Question],
    what: str,
    categories: list[str] | None = None,
    limit: int | None = None,
) -> list[Question]:
    """The first ``limit`` questions (all when None) of each category, grouped by category in the
    order of ``categories`` (file order when None), from ``path``'s JSON lines, each read by
    ``parse`` (which raises ValueError, KeyError, IndexError or TypeError for a malformed record).

    Raises:
        ValueError: the file is missing, a line is not ``what`` (named in the message), or a
            category is not in it.
    """
    if not path.is_file():
        raise ValueError(f"question file {path} not found: pass --questions FILE ({what})")
    by_category: dict[str, list[Question]] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                question = parse(json.loads(line))
            except (ValueError, KeyError, IndexError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not {what}: {err!r}") from None
            by_category.setdefault(question.category, []).append(question)
    unknown = [name for name in categories or [] if name not in by_category]
    if unknown:
        raise ValueError(f"categories {unknown} are not in {path}; it has {sorted(by_category)}")
    return [q for name in categories or list(by_category) for q in by_category[name][:limit]]
