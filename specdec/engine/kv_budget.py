"""The memory budget of a paged KV store (:class:`specdec.engine.ragged_lm.RaggedLM`): its size in bytes,
the automatic default, the admission watermark, and the usage a service reports.

Each service that runs a transformers model (the verify service's target, the draft service's
transformers drafter) caps its KV pool at ``kv_cache_max_bytes``; the pool grows by doubling up to
that cap and never past it, new sequences are admitted by bytes against it, and a running one
that cannot grow within it preempts another (docs/architecture.md#kv-memory-a-budget-in-bytes).

The automatic budget (``kv_cache_max_bytes = 0``), decided here:

- on a GPU, :data:`GPU_MEMORY_FRACTION` (0.9) of the device memory that is free once the model is
  loaded, as vLLM's ``gpu_memory_utilization`` leaves a tenth of the device for activations;
- on a CPU, :data:`CPU_MEMORY_FRACTION` (0.4) of the memory available when the model is loaded:
  ``MemAvailable`` of ``/proc/meminfo``, or less where a cgroup (a container's memory limit) leaves
  less. 0.4, not more: the budget is a cap, not an allocation, so the draft and the verify service
  on one machine may each take that share of what was available when they started, and together
  they then stay below 80% of it, the rest left to the steps' activations and logits.

Set ``kv_cache_max_bytes`` where the machine is shared otherwise. The llama-cpp drafter has no
budget of its own: llama.cpp allocates its whole KV up front, ``--llama-cpp-n-ctx`` x
``--llama-cpp-max-num-seqs`` tokens x its bytes per token.

Torch-free: the coordinator's metrics import it.
"""

import math
from dataclasses import dataclass
from pathlib import Path

GPU_MEMORY_FRACTION = 0.9  # of the device memory free after the model loads
CPU_MEMORY_FRACTION = 0.4  # of the host memory available when the model loads
WATERMARK = 0.01  # of the budget's blocks kept free at admission, as vLLM's block manager (at least one block)
SETTING = "kv_cache_max_bytes"  # the services' setting (--kv-cache-max-bytes), named in every refusal

# the memory limit and usage of this process's cgroup: v2, then v1 (absent, or "max": no limit)
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


@dataclass(frozen=True)
class KVUsage:
    """A KV store's blocks (of ``block_bytes`` bytes and ``block_size`` tokens each) at one moment:
    ``budget`` the most the pool may hold (``kv_cache_max_bytes`` in whole blocks), ``pool`` those
    allocated now, ``used`` those held by live sequences (or promised to one admitted and still
    prefilling), ``cached`` those the prefix cache keeps for sequences that are gone (evictable:
    free for the budget's purposes); ``num_preemptions`` the sequences preempted since start."""

    block_bytes: int
    budget: int
    pool: int
    used: int
    cached: int
    num_preemptions: int
    block_size: int

    @property
    def usage_perc(self) -> float:
        """Used blocks as a fraction of the budget, 0 to 1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.used / self.budget

    @property
    def free(self) -> int:
        """Blocks a new sequence could take now: free ones, the prefix cache's evictable ones and
        room for the pool to grow, less those promised (budget - used; admission keeps a watermark
        of them for the running sequences, :func:`watermark_blocks`)."""
        return self.budget - self.used


def watermark_blocks(budget_blocks: int) -> int:
    """Blocks an admission leaves free for the running sequences to grow into."""
    return max(1, math.ceil(WATERMARK * budget_blocks))


def available_host_bytes(meminfo: Path = Path("/proc/meminfo"), cgroups=CGROUP_FILES) -> int:
    """Bytes this process could still allocate: the kernel's ``MemAvailable``, or less when its
    cgroup's memory limit leaves less (limit - usage). Raises OSError where /proc/meminfo is
    missing (not Linux): set ``kv_cache_max_bytes`` there."""
    available = None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024  # kB
    if available is None:
        raise OSError(f"{meminfo} has no MemAvailable: set {SETTING}")
    for limit_file, usage_file in cgroups:
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit != "max":
            available = min(available, max(0, int(limit) - int(usage)))
        break
    return available


def automatic_budget(free_device_bytes: int | None) -> int:
    """The budget of ``kv_cache_max_bytes = 0``, in bytes (see the module docstring):
    ``free_device_bytes`` is the GPU's free memory after the model loaded, None on a CPU."""
    if free_device_bytes is not None:
        return int(GPU_MEMORY_FRACTION * free_device_bytes)
    return int(CPU_MEMORY_FRACTION * available_host_bytes())
