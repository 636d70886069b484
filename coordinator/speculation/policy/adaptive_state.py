"""What the coordinator's adaptive requests share per target: step costs per drafter, warm starts
of their acceptance estimates per owner, and the step budget's bids; and the factory of each new
request's :class:`~coordinator.speculation.policy.adaptive.AdaptiveK`."""

import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from coordinator.speculation.policy.acceptance_model import AcceptanceModel, ema
from coordinator.speculation.policy.adaptive import AdaptiveK
from coordinator.speculation.policy.lookup_ledger import LookupMemory
from coordinator.speculation.policy.step_budget import Bid
from coordinator.speculation.policy.step_costs import Load, StepCosts
from coordinator.speculation.upstream import TOKENS_PER_CATCH_UP_FORWARD
from specdec.sampling.grammar import FORCED
from specdec.v1.draft_pb2 import DrafterInfo
from specdec.v1.verify_pb2 import VerifyServiceGetInfoResponse as VerifyInfo

SUFFIX_LENGTHS = 4  # suffix matches of 4 tokens and more share one acceptance estimate


@dataclass
class AdaptiveState:
    """What the coordinator's requests share per target: step costs per drafter kept fresh by
    every live round, and acceptance estimates per drafter (and per lookup and match length) that
    warm-start each new request (an EMA over what the requests that ended observed; the request
    store shares them between coordinator replicas, each writing back only what its own requests
    observed: :meth:`remember`). ``prior_rate`` seeds a model drafter's estimates never seen:
    optimistic, so that the first requests try it and measure it (its acceptance is observed only
    in the rounds that use it). ``lookup_prior_rate`` seeds the
    lookups': a coin toss, as their acceptance is observed every round whether used or not,
    and an optimistic start would have the first requests on a loaded service verify long lookups
    that mostly fail.
    ``forced_prior_rate`` seeds the forced-token lookup's: high, as the target is masked by the same
    grammar, so a forced token fails only where the grammar also allows another tokenization of
    the same text; it is observed every round too. ``step_budget``: the requests on one target
    bid for one speculation budget per step (``bids``, by target model; :meth:`AdaptiveK._within_budget`).

    Warm starts are kept per owner (the API key's owner hash; "" without keys, or for every key
    with ``--shared-caches``): a request starts from, and blends into, its own owner's only, so no
    tenant's requests can steer another's estimates (say, lower its K with requests whose drafts
    all fail; docs/security.md#tenants-and-the-caches). Step costs stay shared: they measure the
    services, which every request meets alike. ``service_line``: the verify service's newest
    published step line (:attr:`StepCosts.service_line`; None: the coordinator's own only).
    ``lookup_memory``: per target and owner, whether new requests under load start with the hybrid
    lookups beside their model drafter (:class:`LookupMemory`)."""

    probe_interval: int = 16
    prior_rate: float = 0.8
    lookup_prior_rate: float = 0.5
    forced_prior_rate: float = 0.9
    request_weight: float = 0.5
    step_budget: bool = True
    costs: dict[tuple[str, str], StepCosts] = field(default_factory=dict)
    priors: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)  # by (source, target, owner)
    bids: dict[str, MutableMapping[AdaptiveK, Bid]] = field(default_factory=dict)
    service_line: Callable[[], tuple[float, float] | None] | None = None
    lookup_memory: dict[tuple[str, str], LookupMemory] = field(default_factory=dict)  # by (target, owner)

    def policy(
        self,
        drafter: DrafterInfo | None,
        target: VerifyInfo,
        k_max: int,
        lookups: Mapping[str, int],
        others: int = 0,
        hidden_behind_verify: bool = False,
        owner: str = "",
    ) -> AdaptiveK:
        """A new request's :class:`AdaptiveK`, from the services' GetInfo replies. ``drafter``
        None: the lookups only (the request's drafter is ``ngram`` or ``suffix``). ``lookups``:
        the lookups that compete, each with its number of match-length estimates (the n-gram
        index's ``ngram_max``, SUFFIX_LENGTHS). ``others``: the requests running besides it, the
        load it assumes until its first round reports the service's. ``hidden_behind_verify``: the
        request's model drafter drafts ahead on hardware of its own (:meth:`StepCosts.draft_wait_ms`
        prices its rounds; not where the draft shares the target's cores: its forwards ahead then
        slow the verify they would hide behind). ``owner``: whose warm starts it uses. A request with
        a model drafter starts without ``lookups`` where its owner's recent requests under load
        never chose theirs (:class:`LookupMemory`); a request whose drafter is a lookup keeps it."""
        name = drafter.name if drafter else None
        memory = self.lookup_memory.setdefault((target.model, owner), LookupMemory())
        if name and lookups and not memory.with_lookups(others):
            lookups = {}
        key = (name or "+".join(lookups), target.model)
        if key not in self.costs:
            measured = list(target.verify_ms) or [1.0]  # unmeasured: every round costs the same
            measured += measured[-1:] * (k_max + 1 - len(measured))
            batched = {cost.num_tokens: cost.ms for cost in target.step_costs if cost.num_seqs > 1}
            draft_ms = drafter.step_ms if drafter else 0.0
            self.costs[key] = StepCosts(
                draft_ms,
                measured,
                batched_ms=batched,
                draft_prefill_ms_per_token=draft_ms / TOKENS_PER_CATCH_UP_FORWARD,
                service_line=self.service_line,
            )
        if target.load.step_intercept_ms or target.load.step_ms_per_token:  # the line as of this GetInfo
            self.costs[key].reported_line = (target.load.step_intercept_ms, target.load.step_ms_per_token)
        return AdaptiveK(
            k_max,
            name,
            self._warm_start(name, target.model, k_max, self.prior_rate, owner) if name else None,
            {
                lookup: [
                    self._warm_start(f"{lookup}/{n}", target.model, k_max, self.lookup_prior_rate, owner)
                    for n in range(1, lengths + 1)
                ]
                for lookup, lengths in lookups.items()
            },
            self.costs[key],
            target.model,
            self.probe_interval,
            load=Load(others_seqs=others, others_tokens=others),
            forced=self._warm_start(
                FORCED, target.model, len(self.costs[key].verify_ms) - 1, self.forced_prior_rate, owner
            ),
            hidden_behind_verify=hidden_behind_verify,
            bids=self.bids.setdefault(target.model, weakref.WeakKeyDictionary()) if self.step_budget else None,
            owner=owner,
            shared=self,
        )

    def _warm_start(self, source: str, target: str, k_max: int, prior_rate: float, owner: str) -> AcceptanceModel:
        prior = self.priors.setdefault((source, target, owner), [])
        prior += [prior_rate] * (k_max - len(prior))
        return AcceptanceModel(prior[:k_max])

    def set_priors(self, target: str, priors: dict[str, list[float]], owner: str = "") -> None:
        """Replaces ``owner``'s warm starts for ``target`` with those from the request store (every
        coordinator replica's requests of that owner blend into them, each writing back the sources
        its rounds observed: :meth:`remember`)."""
        for source, rates in priors.items():
            self.priors[(source, target, owner)] = list(rates)

    def remember(self, policy: AdaptiveK) -> dict[str, list[float]]:
        """Blends an ended request's acceptance estimates into its owner's warm starts, at the
        positions its rounds observed (its :meth:`AdaptiveK.end` calls it). Returns those warm
        starts, by source (drafter, ``ngram/<n>``, ``forced``), for the request store: the ones
        it changed alone. Every other warm start of this replica holds what it last loaded from the
        store, or the default prior of a source it never loaded, and writing that back would
        overwrite what another replica's requests measured since. Also tells the lookup memory of
        the request's target and owner what its lookups did (:meth:`LookupMemory.ended`)."""
        if policy.lookups:
            self.lookup_memory[(policy.target, policy.owner)].ended(policy.lookup_ledger)
        learnt = {}
        for source, model in policy.acceptance_models().items():
            prior = self.priors[(source, policy.target, policy.owner)]
            for i, rate in enumerate(model.rates[: model.observed]):
                prior[i] = ema(prior[i], rate, self.request_weight)
            learnt[source] = list(prior)
        return learnt
