import platform
import resource

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


def page_faults_of_a_buffer() -> int:
    """Minor page faults of allocating, writing and freeing a BUFFER_BYTES buffer."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = bytearray(BUFFER_BYTES)  # malloc + memset: every page written
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_a_freed_large_buffer_is_reused_without_page_faults(untuned):
    assert host_memory.keep_freed_memory()
    page_faults_of_a_buffer()  # the heap grows once
    pages = BUFFER_BYTES // resource.getpagesize()
    assert page_faults_of_a_buffer() < pages // 100


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
