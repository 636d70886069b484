import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.engine import host_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

BUFFER_BYTES = 64 << 20  # above glibc's largest automatic mmap threshold (32 MB): mapped afresh by default


@pytest.fixture
def untuned(monkeypatch):
    """An environment without the operator's malloc settings."""
    for name in (*host_memory.OPERATOR_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# Minor page faults of allocating, writing and freeing a BUFFER_BYTES buffer a second time, in a
# fresh interpreter (after host_memory.keep_freed_memory() where argv[1] is "keep"), as a service
# calls it at start-up: a pytest worker that ran other files first once faulted in every page even
# so (its heap's state then is not the one a service starts with).
SECOND_BUFFER = f"""
import resource, sys
from specdec.engine import host_memory

def page_faults_of_a_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = bytearray({BUFFER_BYTES})  # malloc + memset: every page written
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

kept = sys.argv[1] == "keep" and host_memory.keep_freed_memory()
page_faults_of_a_buffer()  # the heap grows once (when kept)
print(kept, page_faults_of_a_buffer())
"""


@glibc
@pytest.mark.parametrize("keep", [True, False])
def test_a_freed_large_buffer_is_reused_without_page_faults(untuned, keep):
    """Kept: the second buffer reuses the first's pages; not kept (glibc's defaults): every page
    is mapped and faulted in again, the cost keep_freed_memory removes."""
    measured = subprocess.run(
        [sys.executable, "-c", SECOND_BUFFER, "keep" if keep else "default"],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pages = BUFFER_BYTES // resource.getpagesize()
    assert measured[0] == str(keep)
    assert (int(measured[1]) < pages // 100) == keep


@glibc
@pytest.mark.parametrize(
    "name, value",
    [*((name, "65536") for name in host_memory.OPERATOR_SETTINGS), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")],
)
def test_the_operators_malloc_settings_stand(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not host_memory.keep_freed_memory()


@glibc
def test_tunables_of_other_glibc_parts_do_not_count_as_malloc_settings(untuned):
    untuned.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    assert host_memory.keep_freed_memory()
