"""The K policy: each round's proposer and number of draft tokens (K = ``num_speculative_tokens``).

Every request has one policy object (:class:`coordinator.speculation.policy.k_policy.KPolicy`):
:class:`~coordinator.speculation.policy.fixed.FixedK` for a request that set its K (or with
adaptive K off), :class:`~coordinator.speculation.policy.adaptive.AdaptiveK` for the others. The
adaptive policy prices each option of a round from its acceptance estimates
(:mod:`~coordinator.speculation.policy.acceptance_model`) and the step costs under the current load
(:mod:`~coordinator.speculation.policy.step_costs`), caps its K at its share of the step budget
(:mod:`~coordinator.speculation.policy.step_budget`), turns off the lookups that do not pay
(:mod:`~coordinator.speculation.policy.lookup_ledger`), and starts from, and blends into, the
estimates the coordinator's requests share (:mod:`~coordinator.speculation.policy.adaptive_state`).
"""
