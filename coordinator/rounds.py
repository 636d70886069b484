"""The speculative round loop's state for one request: the committed token log and the sessions
on the draft and verify services.

Each round: the draft proposes K tokens (carrying the committed tokens it has not yet seen), the
verify service accepts n of them and returns the next token, and the committed log grows by
draft[:n] + [next]. K = 0, or an empty proposal, is a plain decode step on the verify service.
Under adaptive K a round's proposal may instead come from the coordinator's own n-gram index
(:meth:`SpeculativeSession.ngram_match`); the draft session then catches up at its next Propose. A
service that answers NOT_FOUND (its session expired or it restarted) is prefilled again from the
committed log and the call is retried once.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from coordinator.clients import ServiceClients
from coordinator.metrics import RoundRecord
from coordinator.request import ResolvedRequest
from specdec.errors import NotFound
from specdec.ngram import NgramIndex, NgramMatch
from specdec.timing import ms_since
from specdec.v1 import draft_pb2, verify_pb2
from specdec.wire import point_masses

log = logging.getLogger(__name__)
T = TypeVar("T")


class SpeculativeSession:
    def __init__(
        self, clients: ServiceClients, session_id: str, request: ResolvedRequest, ngram: NgramIndex | None = None
    ):
        self.clients = clients
        self.session_id = session_id
        self.request = request
        self.committed: list[int] = list(request.prompt_ids)
        self.uses_draft = request.uses_draft_service
        self.ngram = ngram
        self.draft_seen = 0  # length of the committed prefix the draft session has seen
        self._round_bytes = 0  # protobuf bytes of the current round's messages

    async def prefill(self) -> None:
        """Opens the session on the verify service (and the draft service when K > 0)."""
        calls = [self._prefill_verify()]
        if self.uses_draft:
            calls.append(self._prefill_draft())
        await asyncio.gather(*calls)

    async def _prefill_verify(self) -> None:
        request = verify_pb2.VerifyServicePrefillRequest(
            session_id=self.session_id, token_ids=self.committed, sampling=self.request.sampling.to_proto()
        )
        await self.clients.call_verify("Prefill", request, self.clients.prefill_timeout_s)

    async def _prefill_draft(self) -> None:
        request = draft_pb2.DraftServicePrefillRequest(
            session_id=self.session_id,
            drafter=self.request.drafter,
            token_ids=self.committed,
            sampling=self.request.sampling.to_proto(),
        )
        await self.clients.call_draft("Prefill", request, self.clients.prefill_timeout_s)
        self.draft_seen = len(self.committed)

    async def _rebuilding(self, call: Callable[[], Awaitable[T]], prefill: Callable[[], Awaitable[None]], where: str) -> T:
        try:
            return await call()
        except NotFound:
            log.warning("session %s lost on the %s service: prefilling it again", self.session_id, where)
            await prefill()
            return await call()

    def ngram_match(self, k: int) -> NgramMatch | None:
        """Up to ``k`` tokens from the session's n-gram index (None without one or a match)."""
        return self.ngram.lookup(self.committed, k) if self.ngram else None

    async def round(self, drafter: str, k: int, local_proposal: list[int] | None = None) -> tuple[list[int], RoundRecord]:
        """Runs one round with K = ``k`` draft tokens (0 = plain decode): ``local_proposal[:k]``
        when given (the coordinator's n-gram lookup), else a proposal from the draft service.
        Returns the newly committed tokens and the round's record (``drafter`` names the source)."""
        start, self._round_bytes = time.perf_counter(), 0
        draft_ms, proposal, distributions = 0.0, [], []
        if local_proposal is not None:
            proposal = local_proposal[:k]
            distributions = [] if self.request.sampling.greedy else point_masses(proposal)
        elif k > 0:
            proposed = await self._rebuilding(lambda: self._propose(k), self._prefill_draft, "draft")
            proposal, distributions, draft_ms = list(proposed.token_ids), proposed.distributions, proposed.compute_ms
        if proposal:
            verified = await self._rebuilding(
                lambda: self._verify(proposal, distributions), self._prefill_verify, "verify"
            )
            n, new, verify_ms = verified.num_accepted, [*proposal[: verified.num_accepted], verified.next_token_id], verified.compute_ms
        else:
            decoded = await self._rebuilding(self._decode, self._prefill_verify, "verify")
            n, new, verify_ms = 0, [decoded.token_id], decoded.compute_ms
        self.committed.extend(new)
        record = RoundRecord(drafter if k else "", k, len(proposal), n, draft_ms, verify_ms, ms_since(start), self._round_bytes)
        log.debug("session %s round: %s", self.session_id, record)
        return new, record

    def _count_bytes(self, request, response):
        """Adds a round message pair's protobuf size to the round's wire bytes; returns ``response``."""
        self._round_bytes += request.ByteSize() + response.ByteSize()
        return response

    async def _propose(self, k: int) -> draft_pb2.ProposeResponse:
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id,
            appended_token_ids=self.committed[self.draft_seen :],
            num_speculative_tokens=k,
        )
        response = await self.clients.call_draft("Propose", request)
        self.draft_seen = len(self.committed)
        return self._count_bytes(request, response)

    async def _verify(self, proposal: list[int], distributions) -> verify_pb2.VerifyResponse:
        request = verify_pb2.VerifyRequest(
            session_id=self.session_id, draft_token_ids=proposal, draft_distributions=distributions
        )
        return self._count_bytes(request, await self.clients.call_verify("Verify", request))

    async def _decode(self) -> verify_pb2.DecodeResponse:
        request = verify_pb2.DecodeRequest(session_id=self.session_id)
        return self._count_bytes(request, await self.clients.call_verify("Decode", request))

    async def release(self) -> None:
        """Releases both sessions; failures are logged (the services' idle timeout reclaims them)."""
        calls = [self.clients.call_verify("Release", verify_pb2.VerifyServiceReleaseRequest(session_id=self.session_id))]
        if self.uses_draft:
            calls.append(self.clients.call_draft("Release", draft_pb2.DraftServiceReleaseRequest(session_id=self.session_id)))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("releasing session %s failed: %s", self.session_id, result)
