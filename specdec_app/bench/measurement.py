"""One method's run on one prompt: what every method reports, in the same units."""

from dataclasses import dataclass, field


@dataclass
class Measurement:
    """A method's completion of one prompt (batch size 1, greedy).

    Times are wall-clock ms seen by the caller (``wall_ms``, ``ttft_ms``) or the compute time of a
    step (``draft_ms``, ``verify_ms``). ``num_target_forwards`` counts every forward pass of the
    target, the prefill included, so plain decoding of N tokens makes N. ``verify_ms`` covers the
    ``num_verify_rounds`` decode-phase target forwards (verify calls, or plain decode steps).
    ``coordination_ms``, ``wire_bytes``, ``rounds_per_drafter`` (decode-phase rounds by the
    drafter that proposed, ``plain`` for plain decode steps) and ``draft_ahead`` (proposals drafted
    ahead that a round checked, and the hits among them) are the pipeline's only (None elsewhere).
    ``verify_costs``: ``[num_tokens, rounds, call_ms, forward_ms]`` summed per number of new tokens
    of a decode-phase target forward (the pipeline's verify service call and its step's forward;
    in process, the forward both). ``num_forced_draft_tokens``: the pipeline's draft tokens the
    grammar forced (structured output), None elsewhere. ``num_prompt_tokens``: the prompt's tokens
    after the chat template (None where not reported). ``num_cached_prompt_tokens`` and
    ``num_draft_cached_prompt_tokens``: the pipeline's prompt tokens the verify service and the draft
    service found in their prefix caches (``RequestMetrics``; 0 with the caches off), None elsewhere.
    """

    method: str
    question_id: int
    category: str
    token_ids: list[int] = field(repr=False)
    wall_ms: float
    ttft_ms: float
    num_target_forwards: int
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_histogram: list[int]
    draft_ms: float
    verify_ms: float
    num_verify_rounds: int
    coordination_ms: float | None = None
    wire_bytes: int | None = None
    rounds_per_drafter: dict[str, int] | None = None
    draft_ahead: tuple[int, int] | None = None  # (proposals checked, hits)
    # the hits by branch (main, bonus, recovered) and the proposals drafted for branches but the main
    draft_ahead_hits_per_branch: dict[str, int] | None = None
    num_draft_ahead_branches: int | None = None
    verify_costs: list[list] = field(default_factory=list)
    num_forced_draft_tokens: int | None = None
    num_prompt_tokens: int | None = None
    num_cached_prompt_tokens: int | None = None
    num_draft_cached_prompt_tokens: int | None = None
    first_mismatch: int | None = None  # index of the first token that differs from plain's; None = identical

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)

    def compare_to(self, reference: list[int]) -> None:
        """Sets ``first_mismatch`` against the baseline's ``reference`` token ids."""
        if self.token_ids == reference:
            self.first_mismatch = None
            return
        pairs = zip(self.token_ids, reference, strict=False)
        self.first_mismatch = next(
            (i for i, (a, b) in enumerate(pairs) if a != b), min(len(self.token_ids), len(reference))
        )

    def to_json(self) -> dict:
        record = {name: value for name, value in vars(self).items() if name != "token_ids"}
        return record | {"num_generated": self.num_generated, "identical": self.first_mismatch is None}
