"""The speculative round loop's state for one request: the committed token log and the sessions
on the draft service and on one verify replica.

Each round: the draft proposes K tokens (carrying the committed tokens it has not yet seen), the
verify service accepts n of them and returns the next token, and the committed log grows by
draft[:n] + [next]. K = 0, or an empty proposal, is a plain decode step on the verify service.
Under adaptive K a round's proposal may instead come from one of the coordinator's own lookups,
n-gram or suffix (:meth:`RequestRounds.lookup_matches`), or, with structured output, the tokens
the request's grammar forces (:class:`specdec.sampling.grammar.ForcedTokenLookup`); the draft session then
catches up at its next Propose.

The draft side (its session, draft-ahead, its faults) is :class:`coordinator.speculation.draft_client.DraftSession`'s;
the verify side is :class:`coordinator.speculation.verify_client.VerifySession`'s.

Draft-ahead (model drafters, ``DraftPlan.drafts_ahead``): while the verify service checks a round's
proposal, the draft service already drafts the next round's, on the branch where verification
accepts every proposed token and the bonus token is the draft's own most likely next token (as in
PEARL, Liu et al. 2025, and SSD, Kumar et al. 2025, with a single branch). When verification goes
down that branch (a hit) the next round's proposal is ready, and the draft's time hides behind the
verifier's; otherwise (a miss) the next round asks for a proposal as usual, and the draft rolls
back what it drafted ahead. Verification is unchanged, so output is too: under greedy decoding
and seeded sampling a pre-drafted proposal is the one a plain Propose would have drawn.

Decode ahead: a plain round's Decode carries no token of the coordinator's (the verify service
decodes after what it committed), so where the next round will be plain too (the request's K is
0, or adaptive K would choose plain decode now) its Decode is sent with this one, before this
one's answer; the verify service runs a session's calls in the order they came
(:meth:`specdec.rpc.sessions.SessionRegistry.start_when_free`), so the next step decodes it
without waiting for the coordinator's turnaround, a network round trip in it (docs/architecture.md#one-round).
Its answer is the next round's, whatever that round would have chosen; a Decode sent ahead that
failed, or went to a session rebuilt since, is decoded again. Every Decode names the committed
length it follows (``DecodeRequest.num_committed_tokens``): one that overtook the Decode before it
fails instead of committing out of order, and a session that committed a Decode given up on (run
late) fails the next one and is rebuilt (:meth:`coordinator.speculation.verify_client.VerifySession.decode`).

Faults. The committed log here is the truth; a service's session is a cache of it that can be
rebuilt by a Prefill of the log, under a new session id (so a late call to the old one cannot
collide; the old one is released in the background):
- the draft service fails (unreachable, its Propose deadline missed — see
  :class:`coordinator.speculation.upstream.ProposeDeadline` —, session limit, session lost twice): the
  round goes on as a plain decode step and later rounds run without the draft (plain decode, or
  the coordinator's n-gram and suffix lookups under adaptive K) until ``draft_retry_s`` has passed; then the
  draft session is prefilled again and speculation resumes when it answers;
- a verify call fails (the replica is unreachable or missed its deadline, or answers NOT_FOUND):
  the session is rebuilt on a replica and the call retried (:mod:`coordinator.speculation.verify_client`), until
  ``failover_timeout_s`` has passed; then the request fails with UNAVAILABLE.
A retried call is exact: Verify and Decode depend only on the committed log and the per-position
seed, so greedy and seeded sampling output is the same as without the fault.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from coordinator.observability.metrics import PLAIN, RoundRecord
from coordinator.speculation.draft_client import DraftClient, DraftProposal, DraftSession
from coordinator.speculation.plan import ResolvedRequest
from coordinator.speculation.policy.k_policy import KPolicy, Matches
from coordinator.speculation.verify_client import Admit, DecodeAhead, VerifyClient, VerifySession
from specdec.background import BackgroundTasks
from specdec.lookups.ngram import NgramIndex, NgramMatch
from specdec.lookups.suffix import SuffixIndex, SuffixMatch
from specdec.rpc.errors import FailedPrecondition, SpecdecError, Unavailable
from specdec.sampling.grammar import FORCED, ForcedMatch
from specdec.timing import ms_since
from specdec.token_ids import point_masses
from specdec.v1 import common_pb2, verify_pb2

log = logging.getLogger(__name__)
RELEASE_RETRY_S = 1.0  # the pause before another try of a Release the service did not answer, seconds
INDEX_CHUNK = 64  # prompt tokens the lookups index between two turns of the event loop (about 1 ms)


@dataclass(frozen=True, kw_only=True)
class RoundProposal:
    """A round's proposal: ``proposer`` (the drafter, a lookup's name, or PLAIN with no tokens), the
    K asked of it, its ``tokens`` with their draft distributions (empty under greedy) and, per
    token, whether the grammar forced it (empty when none was), and the draft service's side of
    the round (:class:`DraftProposal`: its wait, draft-ahead outcome and bytes; empty for a lookup
    or plain round)."""

    proposer: str
    k: int
    tokens: list[int] = field(default_factory=list)
    distributions: list[common_pb2.TokenDistribution] = field(default_factory=list)
    forced: tuple[bool, ...] = ()
    drafted: DraftProposal = field(default_factory=DraftProposal)


@dataclass(frozen=True, kw_only=True)
class Verified:
    """The target's answer to a round: ``num_accepted`` draft tokens accepted, the ``new`` tokens
    (those, then the bonus or recovered token; a Decode's one token), their log-probabilities
    (one per new token with ``sampling.logprobs``), the target's compute ms, the engine step that
    served it, the protobuf bytes of the call both ways, and whether its Decode was sent ahead,
    with the round before."""

    num_accepted: int
    new: list[int]
    logprobs: list[common_pb2.TokenLogprobs]
    verify_ms: float
    step: common_pb2.StepStats
    wire_bytes: int
    decoded_ahead: bool = False


def round_record(proposal: RoundProposal, verified: Verified, wall_ms: float) -> RoundRecord:
    """The record of a round that proposed ``proposal``, was answered ``verified`` and took
    ``wall_ms`` ms from its choice to its commit."""
    drafted, step = proposal.drafted, verified.step
    return RoundRecord(
        drafter=proposal.proposer,
        k=proposal.k,
        num_drafted=len(proposal.tokens),
        num_accepted=verified.num_accepted,
        draft_ms=drafted.wait_ms,
        verify_ms=verified.verify_ms,
        wall_ms=wall_ms,
        wire_bytes=drafted.wire_bytes + verified.wire_bytes,
        batch_size=step.num_seqs,
        batched_tokens=step.num_tokens,
        queue_ms=step.queue_ms,
        running_seqs=step.num_running_seqs,
        step_ms=step.step_ms,
        prefill_tokens=step.num_prefill_tokens,
        draft_ahead=drafted.ahead,
        forced=proposal.forced if any(proposal.forced) else (),
        draft_ahead_branch=drafted.branch,
        draft_ahead_branches=drafted.num_branches,
        draft_compute_ms=drafted.compute_ms,
        propose_call_ms=drafted.call_ms,
        ahead_call_ms=drafted.ahead_call_ms,
        decoded_ahead=verified.decoded_ahead,
    )


class RequestRounds:
    """One request's rounds: its committed log, its session on the draft service and its session
    on a verify replica (:class:`coordinator.speculation.verify_client.VerifySession`); :meth:`step` runs a round.

    Args: ``draft_client`` and ``verify_client``, the coordinator's clients of the draft and the verify service (both
    shared by its requests); ``session_prefix`` begins the id of every session the request opens
    (``<prefix>.d1``, ``<prefix>.v2``, ...: a rebuilt session gets a new id); ``committed`` the
    request's committed log (prompt plus generated tokens, when a resumed request starts from
    stored ones); ``lookups``: the coordinator's own model-free lookups by name (hybrid drafting
    under adaptive K); ``draft_retry_s``, ``failover_timeout_s`` in seconds; ``running_requests()``: the
    requests the coordinator runs now, this one included (the load the first token's decision on
    the draft counts, see :meth:`prefill`); ``owner``: the tag of the request's client that its
    sessions carry (:func:`coordinator.api.admission.owner_tag`). How the request uses the draft
    (draft-ahead, when its session prefills) is its plan, ``request.draft``
    (:class:`coordinator.speculation.plan.DraftPlan`). Each round's record says whether its proposal was
    drafted ahead (``RoundRecord.draft_ahead``)."""

    def __init__(
        self,
        draft_client: DraftClient,
        verify_client: VerifyClient,
        session_prefix: str,
        request: ResolvedRequest,
        committed: list[int],
        lookups: dict[str, NgramIndex | SuffixIndex] | None = None,
        draft_retry_s: float = 2.0,
        failover_timeout_s: float = 60.0,
        running_requests: Callable[[], int] = lambda: 1,
        decode_ahead: bool = True,
        owner: str = "",
    ):
        self.session_prefix = session_prefix
        self.request = request
        self.committed = committed
        self.lookups = lookups or {}
        self.forced = request.forced_token_lookup()  # adaptive K with structured output only
        self._generation = 0  # numbers the session ids of rebuilt sessions
        self._releases = BackgroundTasks()
        self.draft = DraftSession(
            draft_client,
            request,
            committed,
            lambda: self._new_session_id("d"),
            self._in_background,
            draft_retry_s,
            owner,
        )
        self.verify = VerifySession(
            verify_client,
            committed,
            request.sampling,
            lambda: self._new_session_id("v"),
            self._in_background,
            failover_timeout_s,
            request.max_length,
            request.cache_salt,
            owner,
        )
        self.running_requests = running_requests
        self.num_rounds = 0
        self.decode_ahead = decode_ahead
        self._ahead: DecodeAhead | None = None  # the next round's Decode, sent with this round's

    def _new_session_id(self, service: str) -> str:
        self._generation += 1
        return f"{self.session_prefix}.{service}{self._generation}"

    async def prefill(
        self, policy: KPolicy, admit: Admit | None = None
    ) -> tuple[list[int], list[common_pb2.TokenLogprobs]]:
        """Opens the session on a verify replica, which also decodes the request's first token in
        the forward of the prompt's last chunk, as plain decoding does; returns that token,
        appended to the committed log, and its log-probabilities as :meth:`step` does (none when
        the log holds generated tokens already: a resumed request goes on with rounds where its
        first run's rounds went on, so that a seed gives the same tokens). Raises UNAVAILABLE or
        RESOURCE_EXHAUSTED when no replica takes it; waits for a replica to answer up to
        ``failover_timeout_s`` (the only one may be restarting). ``admit(open)`` runs the opening
        (``open()``, retried while every replica is full: the coordinator's fair queue,
        :class:`coordinator.api.admission.FairQueue`); None: once. Rebuilds of the session wait
        their turn in ``admit`` too.

        The draft session (when the request uses one) is prefilled in the background when the
        first round may use it (:meth:`DraftSession.opens_at_once` under ``policy``: at once for a
        fixed K; decided again after the first token with the load the target's prefill met, or
        the coordinator's requests running then where more, :meth:`KPolicy.observe_prefill`, as
        in a burst the first prompts are prefilled before the others reach the verify service),
        else when a round first wants it; a draft that fails here is only retried later.
        It starts beside the target's prefill (a draft on its own device is then ready for the
        first round), or, without ``request.draft.prefill_with_target`` (greedy decoding), after the
        first token, so that no draft work slows the target's prefill where both share the same
        cores. The first round then waits for it (bounded, :meth:`DraftSession.wait_for_prefill`):
        plain rounds beside it would share the cores with it, each slower than alone and the
        prefill slower still (docs/architecture.md#one-round). With a draft on its own device, greedy rounds do not
        wait (a small draft prefills a long prompt slower than the target): they run without the
        draft until it is ready, which cannot change greedy output. Under sampling the first round
        waits for it too, because the sampled tokens depend on the proposals: a seed reproduces a
        completion only if the same rounds use the draft whatever the timing."""
        opened = self.request.draft.prefill_with_target and self.draft.opens_at_once(policy)
        if opened:
            self.draft.open()
        decode = len(self.committed) == len(self.request.prompt_ids)
        indexing = asyncio.ensure_future(self._index_lookups(list(self.committed)))

        def open_verify() -> Awaitable[verify_pb2.VerifyServicePrefillResponse]:
            return self.verify.open(time.monotonic() + self.verify.failover_timeout_s, decode=decode)

        self.verify.admit = admit
        try:
            response = await (admit(open_verify) if admit else open_verify())
        finally:
            await indexing
        first = [response.next_token_id] if decode else []
        self.committed.extend(first)
        if response.HasField("step"):
            running = max(response.step.num_running_seqs, self.running_requests())
            policy.observe_prefill(response.step.num_seqs, running)
        if not opened and self.draft.opens_at_once(policy):  # with the load the prefill met
            self.draft.open()
        return first, self._logprobs(response, first)

    async def _index_lookups(self, context: list[int]) -> None:
        """Indexes ``context`` (the committed log before the first token) in the lookups while the
        target prefills, ``INDEX_CHUNK`` tokens at a time, letting the event loop run the other
        requests' rounds in between, so that indexing a long prompt does not hold every other
        request's rounds; not in a worker thread, as the indexing holds the GIL
        (docs/profiles.md#where-the-cpu-time-goes)."""
        if not self.lookups:
            return
        for end in range(INDEX_CHUNK, len(context) + INDEX_CHUNK, INDEX_CHUNK):
            for index in self.lookups.values():
                index.lookup(context[:end], 0)
            await asyncio.sleep(0)

    # --- rounds --------------------------------------------------------------------------

    def lookup_matches(self, k: int, forced_k: int = 0, lookups: bool = True) -> Matches:
        """Each lookup's proposal of up to ``k`` tokens after the committed log, by lookup name
        (those without a match left out; none with ``lookups`` False: the request's lookups did
        not pay, :class:`coordinator.speculation.policy.lookup_ledger.LookupLedger`), and the forced-token
        lookup's of up to ``forced_k`` (a request with one: structured output under adaptive K).
        Call it every round: the lookups index the tokens committed since the last call."""
        matches: dict[str, NgramMatch | SuffixMatch | ForcedMatch | None] = {
            name: index.lookup(self.committed, k) for name, index in (self.lookups.items() if lookups else ())
        }
        if self.forced is not None:
            matches[FORCED] = self.forced.lookup(self.committed, forced_k)
        return {name: match for name, match in matches.items() if match}

    async def step(self, policy: KPolicy, max_k: int) -> tuple[list[int], list[common_pb2.TokenLogprobs], RoundRecord]:
        """Runs one round of at most ``max_k`` draft tokens (a round commits up to K + 1 tokens:
        never draft past the request's budget). Returns the newly committed tokens, their
        log-probabilities (one per token with ``sampling.logprobs``, else none) and the round's
        record. Read top to bottom, like gpt-fast's ``speculative_decode``:

        1. choose the proposer and K (``policy``): fixed by the request, or by adaptive K among the
           draft model and the coordinator's lookups, from their acceptance estimates;
        2. propose: a lookup's match, or the draft service's proposal (drafted ahead during the
           previous round when verification went down its branch, else asked for now); none while
           the draft is unavailable, which makes the round a plain decode step;
        3. verify the proposal on the target (accepted tokens plus the bonus or recovered token,
           with their log-probabilities when asked for), or decode one token when there is none
           (its Decode sent with the last round's, or now, with the next round's where that will
           decode too: decode ahead, see the module docstring);
        4. commit the new tokens to the log;
        5. let the policy learn from the outcome.
        """
        self.num_rounds += 1
        if self.num_rounds == 1 and not (self.request.draft.prefill_with_target and self.request.sampling.greedy):
            await self.draft.wait_for_prefill()  # sampled, or prefilled after the first token: see prefill()
        # the round's clock starts after that wait: it is the draft's opening, not a round's cost
        start = time.perf_counter()
        opened = self.draft.check_prefill()
        if opened is not None:
            policy.observe_draft_prefill(*opened)
        matches = self._round_matches(policy, max_k)
        if self._ahead is None:
            proposer, k = self._choose(policy, matches, max_k)  # 1.
            proposal = await self._propose(proposer, k, matches, start, max_k)  # 2.
        else:  # its Decode went out with the last round's: a plain round, whatever 1. would choose
            proposal = RoundProposal(proposer=PLAIN, k=0)
        ahead = not proposal.tokens and self._decodes_ahead(policy, matches, max_k)
        verified = await self._verify_or_decode(proposal.tokens, proposal.distributions, ahead)  # 3.
        if proposal.tokens:
            self.draft.observe_verify(verified.verify_ms)
        self.committed.extend(verified.new)  # 4.
        record = round_record(proposal, verified, ms_since(start))
        log.debug("sessions %s.* round: %s", self.session_prefix, record)
        policy.observe(record, matches, verified.new)  # 5.
        return verified.new, verified.logprobs, record

    def _round_matches(self, policy: KPolicy, max_k: int) -> Matches:
        """The lookups' matches ``policy`` chooses among (none for a fixed K: it has no lookups)."""
        return self.lookup_matches(min(policy.k_max, max_k), min(policy.k_limit, max_k), policy.lookups_on)

    def _choose(self, policy: KPolicy, matches: Matches, max_k: int) -> tuple[str, int]:
        """The round's proposer and K, ``policy``'s choice, which may first open the draft session
        (:meth:`KPolicy.wants_drafter`)."""
        if not self.draft.available() and policy.wants_drafter(matches, len(self.committed), max_k + 1):
            self.draft.open()
        proposer, k = policy.next_round(matches, self.draft.available())
        return proposer, min(k, max_k)

    async def _propose(self, proposer: str, k: int, matches: Matches, start: float, max_k: int) -> RoundProposal:
        """The proposal of ``k`` tokens by ``proposer``: a lookup's match (point masses under
        sampling), or the draft service's; an empty one, proposed by PLAIN, for K = 0 or while the
        draft is unavailable (``start``: the round's time.perf_counter(); ``max_k``: see
        :meth:`DraftSession.proposal`)."""
        if k == 0:
            return RoundProposal(proposer=PLAIN, k=0)
        if proposer in matches:
            tokens = matches[proposer].tokens[:k]
            return RoundProposal(
                proposer=proposer,
                k=k,
                tokens=tokens,
                distributions=[] if self.request.sampling.greedy else point_masses(tokens),
                forced=(True,) * len(tokens) if proposer == FORCED else (),
            )
        drafted = await self.draft.proposal(k, self.num_rounds, start, max_k)
        if drafted.response is None:  # the draft is unavailable: a plain decode round
            return RoundProposal(proposer=PLAIN, k=0, drafted=drafted)
        tokens = list(drafted.response.token_ids[:k])
        return RoundProposal(
            proposer=proposer,
            k=k,
            tokens=tokens,
            distributions=drafted.response.distributions[:k],
            forced=tuple(drafted.response.forced[: len(tokens)]),
            drafted=drafted,
        )

    def _decodes_ahead(self, policy: KPolicy, matches: Matches, max_k: int) -> bool:
        """Whether a plain round sends the next round's Decode with its own: the request's budget
        has a token for it (``max_k``, this round's, at least 1), and the next round will decode
        too: the request's fixed K is 0, or adaptive K would choose plain decode for ``matches``
        (:meth:`KPolicy.decodes_ahead`)."""
        return self.decode_ahead and max_k >= 1 and policy.decodes_ahead(matches, self.draft.available())

    async def _verify_or_decode(
        self, proposal: list[int], distributions: list[common_pb2.TokenDistribution], decode_ahead: bool
    ) -> Verified:
        """The target's answer to ``proposal`` (a Verify), or to none (a Decode: the one sent ahead
        with the last round's, or one sent now; with ``decode_ahead``, the next round's is sent
        with it). Raises FailedPrecondition when the request asks for log-probabilities and the
        verify service returned others than one per new token (a service that predates them)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not self.verify.usable(ahead):
            ahead = None  # failed already: decoded again, before the next round's Decode goes out
        if proposal:
            verified, size = await self.verify.verify(proposal, distributions)
            n, new = verified.num_accepted, [*proposal[: verified.num_accepted], verified.next_token_id]
            reply: verify_pb2.VerifyResponse | verify_pb2.DecodeResponse = verified
        else:
            decoding = self.verify.take(ahead) if ahead else self.verify.decode()
            sent = asyncio.ensure_future(decoding)  # sends this round's Decode before the next one's
            self._ahead = self.verify.decode_ahead() if decode_ahead else None
            reply, size = await sent
            n, new = 0, [reply.token_id]
        return Verified(
            num_accepted=n,
            new=new,
            logprobs=self._logprobs(reply, new),
            verify_ms=reply.compute_ms,
            step=reply.step,
            wire_bytes=size,
            decoded_ahead=ahead is not None,
        )

    def _logprobs(self, reply, new: list[int]) -> list[common_pb2.TokenLogprobs]:
        """The log-probabilities of the ``new`` tokens a verify service's ``reply`` committed.
        Raises FailedPrecondition when the request asks for log-probabilities and the service
        returned others than one per new token (a service that predates them)."""
        logprobs = list(reply.logprobs)
        if self.request.sampling.logprobs and len(logprobs) != len(new):
            raise FailedPrecondition(
                f"the verify service returned {len(logprobs)} log-probabilities for {len(new)} tokens: it "
                "does not support logprobs; upgrade it, or send the request without logprobs"
            )
        return logprobs

    def open_sessions(self) -> dict[str, str]:
        """The ids of the sessions this request holds now, by service (``verify``, ``draft``)."""
        held = {"verify": self.verify.session_id, "draft": self.draft.session_id or ""}
        return {service: session_id for service, session_id in held.items() if session_id}

    def release_left_behind(self, sessions: dict[str, str]) -> None:
        """Releases, in the background, the sessions (by service, as :meth:`open_sessions` gives
        them) that another coordinator opened for this request before it died: the draft
        service's, and the verify session on every replica (the others hold no session by that id:
        Release is a no-op there). They would otherwise hold KV cache until the services' idle
        timeout."""
        if sessions.get("draft"):
            self.draft.release_left_behind(sessions["draft"])
        if sessions.get("verify"):
            self.verify.release_everywhere(sessions["verify"])

    async def release(self) -> None:
        """Releases both sessions (:meth:`DraftSession.release`) and waits for the background
        releases; failures are logged (the services' idle timeout reclaims what is left). A Decode
        sent ahead for a round that never came (the request finished) is dropped."""
        if self._ahead is not None:
            self._ahead.task.cancel()
            self._ahead = None
        await self.draft.release()
        self.verify.release()
        await self._releases.wait()

    def _in_background(self, release: Callable[[], Awaitable]) -> None:
        """Runs a Release call (``release()`` makes it) without waiting for it. While the service
        does not answer (stopped, restarting) the call is repeated every RELEASE_RETRY_S for up to
        ``failover_timeout_s``, so a service that comes back frees the session at once; a failure
        after that is logged (the service's idle timeout reclaims the session, or it died with
        the service)."""

        async def retried():
            deadline = time.monotonic() + self.verify.failover_timeout_s
            while True:
                try:
                    await release()
                    return
                except Unavailable as err:
                    if time.monotonic() >= deadline:
                        log.info("sessions %s.*: a release failed: %s", self.session_prefix, err)
                        return
                except SpecdecError as err:
                    log.info("sessions %s.*: a release failed: %s", self.session_prefix, err)
                    return
                await asyncio.sleep(RELEASE_RETRY_S)

        self._releases.run(retried())
