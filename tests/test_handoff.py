"""specdec.handoff alone: an Outbox delivers at once outside together(), a block's items as one
list per outbox when it ends (also when it raises), nested blocks with the outermost."""

import threading

import pytest

from specdec.handoff import Outbox, together


def outboxes(n: int) -> tuple[list[Outbox], list[list]]:
    delivered: list[list] = [[] for _ in range(n)]
    return [Outbox(d.append) for d in delivered], delivered


def test_outside_a_block_each_item_goes_alone():
    (box,), (got,) = outboxes(1)
    box.put(1)
    box.put(2)
    assert got == [[1], [2]]


def test_a_block_delivers_each_outboxs_items_as_one_list_in_order_when_it_ends():
    (a, b), (got_a, got_b) = outboxes(2)
    with together():
        a.put(1)
        b.put("x")
        a.put(2)
        assert got_a == got_b == []
    assert got_a == [[1, 2]] and got_b == [["x"]]


def test_a_block_that_raises_still_delivers_and_nested_blocks_deliver_with_the_outermost():
    (box,), (got,) = outboxes(1)
    with pytest.raises(RuntimeError), together():
        box.put(1)
        with together():
            box.put(2)
        assert got == []
        raise RuntimeError("a step failed")
    assert got == [[1, 2]]


def test_a_block_holds_only_its_own_threads_items():
    (box,), (got,) = outboxes(1)
    with together():
        thread = threading.Thread(target=box.put, args=("other",))
        thread.start()
        thread.join()
        box.put("mine")
        assert got == [["other"]]
    assert got == [["other"], ["mine"]]
