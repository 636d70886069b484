"""Span attributes of the coordinator's request and round spans, from the same RoundRecords and
RequestMetrics the request's own metrics are built from (times in ms, as there)."""

import dataclasses

from google.protobuf.message import Message

from coordinator.observability.metrics import RoundRecord

ROUND = "specdec.round"
REQUEST = "specdec.request"


def round_attributes(record: RoundRecord, num_committed: int) -> dict:
    """``specdec.round.<field>`` for every RoundRecord field, plus ``num_committed`` (tokens the
    round streamed) and ``fallback`` (K = 0: a plain decode round)."""
    attributes = {f"{ROUND}.{name}": value for name, value in dataclasses.asdict(record).items()}
    attributes.update({f"{ROUND}.num_committed": num_committed, f"{ROUND}.fallback": record.k == 0})
    return attributes


def request_attributes(message: Message, prefix: str = REQUEST) -> dict:
    """``specdec.request.<field>`` for every RequestMetrics field; repeated fields are arrays, and
    maps are flattened by key: ``specdec.request.drafter_usage.<drafter>.<field>`` (message
    values), ``specdec.request.draft_ahead_hits_per_branch.<branch>`` (number values)."""
    attributes = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key, entry in value.items():
                name = f"{prefix}.{field.name}.{key}"
                if isinstance(entry, Message):
                    attributes.update(request_attributes(entry, name))
                else:
                    attributes[name] = entry
        else:
            attributes[f"{prefix}.{field.name}"] = list(value) if field.is_repeated else value
    return attributes
