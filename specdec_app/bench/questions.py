"""Spec-Bench questions (Xia et al. 2024, https://github.com/hemingkx/Spec-Bench): one JSON object
per line with ``question_id``, ``category`` and ``turns``; the benchmark uses the first turn."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Question:
    """A prompt; ``schema``: the JSON schema its answer must follow (``specdec bench --structured``,
    :mod:`specdec_app.bench.structured`), as JSON text; empty: none."""

    question_id: int
    category: str
    prompt: str
    schema: str = ""


def load_questions(path: Path, categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """The first ``limit`` questions (all when None) of each category, grouped by category in the
    order of ``categories`` (file order when None).

    Raises:
        ValueError: the file is missing or malformed, or a category is not in it.
    """
    if not path.is_file():
        raise ValueError(f"question file {path} not found: pass --questions FILE (Spec-Bench JSONL)")
    by_category: dict[str, list[Question]] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                question = Question(int(record["question_id"]), str(record["category"]), str(record["turns"][0]))
            except (ValueError, KeyError, IndexError, TypeError) as err:
                raise ValueError(
                    f"{path}:{number}: not a Spec-Bench question ({err!r}); each line needs "
                    "question_id, category and turns"
                ) from None
            by_category.setdefault(question.category, []).append(question)
    unknown = [name for name in categories or [] if name not in by_category]
    if unknown:
        raise ValueError(f"categories {unknown} are not in {path}; it has {sorted(by_category)}")
    return [q for name in categories or list(by_category) for q in by_category[name][:limit]]
