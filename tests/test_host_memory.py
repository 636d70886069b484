import platform
import resource

import pytest

from specdec import host_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

BUFFER_BYTES = 64 << 20  # above glibc's largest automatic mmap threshold (32 MB): mapped afresh by default


def page_faults_of_a_buffer() -> int:
    """Minor page faults of allocating, writing and freeing a BUFFER_BYTES buffer."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = bytearray(BUFFER_BYTES)  # malloc + memset: every page written
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_a_freed_large_buffer_is_reused_without_page_faults(monkeypatch):
    for name in host_memory.OPERATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert host_memory.keep_freed_memory()
    page_faults_of_a_buffer()  # the heap grows once
    pages = BUFFER_BYTES // resource.getpagesize()
    assert page_faults_of_a_buffer() < pages // 100


@glibc
@pytest.mark.parametrize("name", host_memory.OPERATOR_SETTINGS)
def test_the_operators_malloc_settings_stand(monkeypatch, name):
    monkeypatch.setenv(name, "glibc.malloc.mmap_threshold=65536" if name == "GLIBC_TUNABLES" else "65536")
    assert not host_memory.keep_freed_memory()
