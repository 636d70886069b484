"""The start-up heap out of full collections (:mod:`specdec.startup_heap`), in a fresh interpreter
(a freeze in the test process would keep the suite's own objects for good)."""

import subprocess
import sys

SCRIPT = """
import gc, weakref
from specdec import startup_heap

class Node:
    pass

kept = [[i] for i in range(100_000)]  # start-up objects that live on
cycle = Node()
cycle.self = cycle  # start-up garbage in a cycle: collected before the freeze
dead = weakref.ref(cycle)
del cycle
frozen = startup_heap.freeze()
assert dead() is None, "the garbage was frozen"
assert frozen >= len(kept), frozen
assert len(gc.get_objects(generation=2)) < len(kept) // 10, len(gc.get_objects(generation=2))
later = [[i] for i in range(1000)]  # what serving makes: collected as before
gc.collect()
assert len(gc.get_objects(generation=2)) >= len(later)
print("ok")
"""


def test_freeze_collects_then_keeps_the_living_out_of_full_collections():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
