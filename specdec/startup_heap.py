"""A service's start-up objects out of the cyclic garbage collector's full collections.

Why (docs/profiles.md#full-garbage-collections-stalled-every-stream): start-up leaves hundreds of
thousands of tracked objects that live until the process exits (the modules of torch,
transformers and gRPC, the tokenizer, the model's modules), and every full (generation 2)
collection traverses them all while holding the GIL. In the coordinator at the near-free
ceiling's 64 streams each took 210-250 ms, every 7-10 s, and no stream's round ran meanwhile.

:func:`freeze` collects once, then moves every object alive into the collector's permanent
generation (``gc.freeze``), so later full collections traverse only what serving made: 7-12 ms
there. vLLM freezes its heap after its warm-up the same way (``freeze_gc_heap``), and SGLang
offers it (``freeze_gc``). The cost: a frozen object in a reference cycle is never collected, so
start-up objects that die later in a cycle would stay; what dies without a cycle is freed by its
reference count as before.
"""

import gc


def freeze() -> int:
    """Collects, then freezes every object alive (module docstring); returns how many objects the
    permanent generation holds (``gc.get_freeze_count``). Call it once start-up is done."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
