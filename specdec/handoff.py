"""Outcomes handed off together: what one producer finishes at once reaches each consumer as one
batch.

An engine step finishes many calls at once and hands each its outcome in turn; a Step stream
sends every result it has as one message. Left to timing, a stream's reader could wake between two
hand-offs of one step and send that step's results in two messages. Here the producer hands a
step's outcomes inside :func:`together`, and every :class:`Outbox` written to inside it delivers
what it got as one list when the block ends: one message per step per stream by construction, not
by luck. Outside a block an item is delivered at once, alone (a model-free drafter's Propose, an
error raised before any work was queued).
"""

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_local = threading.local()


class Outbox:
    """Where one consumer's items are put, from any thread: ``deliver(items)`` gets them, a list
    of one item outside :func:`together`, a block's items in the order put when it ends."""

    def __init__(self, deliver: Callable[[list[Any]], None]):
        self.deliver = deliver

    def put(self, item: Any) -> None:
        held: dict[Outbox, list[Any]] | None = getattr(_local, "held", None)
        if held is None:
            self.deliver([item])
        else:
            held.setdefault(self, []).append(item)


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Holds what this thread puts into any :class:`Outbox` until the block ends, then delivers
    each outbox's items as one list (also when the block raises). Nested blocks deliver with the
    outermost."""
    if getattr(_local, "held", None) is not None:
        yield
        return
    held: dict[Outbox, list[Any]] = {}
    _local.held = held
    try:
        yield
    finally:
        _local.held = None
        for outbox, items in held.items():
            outbox.deliver(items)
