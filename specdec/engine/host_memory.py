"""Host memory that a model's steps reuse instead of faulting in again (glibc's ``mallopt``).

Why (docs/profiles.md#large-buffers-mapped-afresh-every-step-and-what-a-verified-token-costs-at-least):
glibc's malloc serves an allocation over its mmap threshold (adjusted up to 32 MB on 64-bit) with
a fresh ``mmap`` and unmaps it on free, and trims a freed heap top past twice that. A step's
logits are rows x vocabulary x 4 bytes (float32), so on SmolLM2's 49,152-token vocabulary any
step of more than about 170 rows gets new pages from the kernel every step and writes each of
them for the first time (a page fault and the kernel zeroing it).

:func:`keep_freed_memory` raises both thresholds for the process (``M_MMAP_THRESHOLD`` and
``M_TRIM_THRESHOLD`` to :data:`KEEP_BYTES`), so large buffers come from the heap and a freed one
serves the next step. The cost: the process keeps up to :data:`KEEP_BYTES` of freed memory
instead of returning it to the system, so its resident size stays near its peak. Outputs do not
change (the same arithmetic on other addresses). Nothing is changed where the process does not
use glibc, or where the operator tuned its malloc (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, or a ``glibc.malloc.*`` entry of ``GLIBC_TUNABLES``, read by glibc at
start-up): theirs stands.
"""

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

KEEP_BYTES = 1 << 30  # 1 GiB: above any step's logits on the default models, well below a node's memory

# mallopt's parameter numbers, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # variables glibc reads at start-up


def _operator_tuned() -> bool:
    """Whether the environment sets glibc's malloc thresholds or any of its malloc tunables."""
    return any(name in os.environ for name in OPERATOR_SETTINGS) or "glibc.malloc." in os.environ.get(
        "GLIBC_TUNABLES", ""
    )


def keep_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds to :data:`KEEP_BYTES` (see the module docstring).
    Returns whether it did: False without glibc or where the operator tuned its malloc."""
    if platform.libc_ver()[0] != "glibc" or _operator_tuned():
        return False
    libc = ctypes.CDLL(None)  # the process's own C library
    done = all(libc.mallopt(param, KEEP_BYTES) == 1 for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    if not done:
        log.warning("glibc refused mallopt: large buffers are mapped afresh every step")
    return done
