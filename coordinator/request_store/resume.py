"""Request ids and the checks on resuming a stored request (GenerateRequest.resume_from)."""

import re

from coordinator.request_store.store import FINISHED, StoredRequest
from specdec.rpc.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import coordinator_pb2, verify_pb2

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")
# Fields the coordinator fills in before storing a request, so that a resume on a coordinator with
# other defaults continues the same completion.
FILLED_IN = ("seed", "max_new_tokens")


def check_request_id(request: coordinator_pb2.GenerateRequest) -> None:
    """Raises InvalidArgument for a malformed request_id, or resume_from without one or below 0."""
    if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
        raise InvalidArgument("request_id must be 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'")
    if request.HasField("resume_from"):
        if not request.request_id:
            raise InvalidArgument("resume_from needs the request_id of the request to resume")
        if request.resume_from < 0:
            raise InvalidArgument(
                f"resume_from is {request.resume_from}, below its bound of 0: send the number of tokens already "
                "received (0 to have the whole output again)"
            )


def check_resume(request: coordinator_pb2.GenerateRequest, stored: StoredRequest) -> None:
    """Raises InvalidArgument when a resume's other fields differ from the stored request's, or
    when it claims more tokens than a finished request generated; FailedPrecondition when the
    request asks for log-probabilities and the store does not hold one per generated token (part
    of the record was lost: the resumed stream would carry some without)."""
    given = coordinator_pb2.GenerateRequest()
    given.CopyFrom(request)
    given.ClearField("request_id")
    given.ClearField("resume_from")
    original = coordinator_pb2.GenerateRequest()
    original.CopyFrom(stored.request)
    for name in FILLED_IN:
        if not given.HasField(name):
            original.ClearField(name)  # the coordinator's choice, not the client's
    if given.ListFields() and given != original:
        raise InvalidArgument(
            f"request {stored.request_id!r} was started with other fields: resend them unchanged, "
            "or only request_id and resume_from"
        )
    if stored.request.logprobs and len(stored.logprobs) != len(stored.generated):
        raise FailedPrecondition(
            f"request {stored.request_id!r} has {len(stored.generated)} generated tokens stored but the "
            f"log-probabilities of {len(stored.logprobs)}: send it again without resume_from"
        )
    if stored.status == FINISHED and request.resume_from > len(stored.generated):
        raise InvalidArgument(
            f"resume_from is {request.resume_from}, beyond its bound: request {stored.request_id!r} finished after "
            f"{len(stored.generated)} tokens; send the number of tokens already received, 0 to "
            f"{len(stored.generated)}"
        )


def check_same_target(stored: StoredRequest, target: verify_pb2.VerifyServiceGetInfoResponse) -> None:
    """Raises FailedPrecondition when the stored request ran on another target model (its tokens
    would not continue the same completion)."""
    if (stored.target, stored.vocab_fingerprint) != (target.model, target.vocab_fingerprint):
        raise FailedPrecondition(
            f"request {stored.request_id!r} was started on the target {stored.target}; the verify "
            f"service now serves {target.model}: send it again without resume_from"
        )
