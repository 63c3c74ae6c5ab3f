"""The cpu op's tensors on huge pages (``ops.host_pages``): the advice stays inside memory fibattn
maps or allocates; freed tensors' pages are reused by the next tensor of the same rounded size, never
while any view of them lives; the pool keeps at most ``FIBATTN_HOST_POOL_MB``; results are the same
with the pool on and off."""
import ctypes
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import torch

from fibattn.checks import UsageError
from fibattn.ops import cpu_backend, host_pages
from fibattn.ops.columns import ColumnSpec, host_columns

from op_helpers import close, make

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _empty_pool():
    host_pages.empty_cache()
    yield
    host_pages.empty_cache()


def _recording(monkeypatch):
    """Record madvise calls (and still make them, where libc has madvise)."""
    calls, advise = [], host_pages._madvise()
    monkeypatch.setattr(host_pages, "_madvise", lambda: lambda *a: calls.append(a) or (advise(*a) if advise else 0))
    return calls


def test_without_the_pool_large_tensors_ask_for_huge_pages_within_their_own_memory(monkeypatch):
    """Pool off: the advice covers the 2 MiB-aligned part of the tensor and nothing outside it; small
    tensors get none."""
    monkeypatch.setenv("FIBATTN_HOST_POOL_MB", "0")
    calls = _recording(monkeypatch)
    q = torch.zeros(2)
    big = host_pages.huge_empty(q, 3, MiB)                        # 12 MiB
    (start, length, advice), = calls
    assert advice == 14 and start % (2 * MiB) == 0 and length % (2 * MiB) == 0 and length >= 8 * MiB
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + big.numel() * 4
    assert big.shape == (3, MiB) and big.dtype == q.dtype
    host_pages.huge_empty(q, 1000)
    assert len(calls) == 1 and host_pages.cached_bytes() == 0


def test_the_pool_reuses_freed_memory_only_when_nothing_views_it(monkeypatch):
    calls = _recording(monkeypatch)
    q = torch.zeros(1, dtype=torch.float64)
    a = host_pages.huge_empty(q, 3, MiB // 2)                     # 12 MiB: a region of its own, aligned
    (start, length, _), = calls
    assert start == a.data_ptr() and start % (2 * MiB) == 0 and length == 12 * MiB
    first, row = a.data_ptr(), a[2]
    del a
    b = host_pages.huge_empty(q, 3, MiB // 2)                     # a's row still lives: new memory
    assert b.data_ptr() != first and len(calls) == 2 and host_pages.cached_bytes() == 0
    row.fill_(1)
    del row
    assert host_pages.cached_bytes() == 12 * MiB
    c = host_pages.huge_empty(torch.zeros(1), 3 * MiB - 100)      # another shape and dtype, same rounded size
    assert c.data_ptr() == first and len(calls) == 2 and host_pages.cached_bytes() == 0
    assert c.shape == (3 * MiB - 100,) and c.dtype == torch.float32
    e = host_pages.huge_empty(q, 3, MiB // 2)                     # c holds the free region: new memory
    assert e.data_ptr() not in (first, b.data_ptr()) and len(calls) == 3
    d = host_pages.huge_empty(q, 5, MiB // 2)                     # 20 MiB: another size, new memory
    assert d.data_ptr() not in (first, b.data_ptr(), e.data_ptr()) and len(calls) == 4


def test_the_pool_keeps_at_most_its_limit(monkeypatch):
    monkeypatch.setenv("FIBATTN_HOST_POOL_MB", "16")
    q = torch.zeros(1)
    a, b = host_pages.huge_empty(q, 3, MiB), host_pages.huge_empty(q, 3, MiB)
    last = b.data_ptr()
    del a
    del b
    assert host_pages.cached_bytes() == 12 * MiB                  # both would pass 16 MiB: the older unmapped
    c = host_pages.huge_empty(q, 3 * MiB)
    assert c.data_ptr() == last and host_pages.cached_bytes() == 0
    del c
    assert host_pages.empty_cache() == 12 * MiB and host_pages.cached_bytes() == 0


@pytest.mark.parametrize("raw", ["-1", "lots", "1.5"])
def test_a_bad_pool_limit_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("FIBATTN_HOST_POOL_MB", raw)
    with pytest.raises(UsageError, match=f"FIBATTN_HOST_POOL_MB must be a whole number of MiB, 0 or more, got '{raw}'"):
        host_pages.huge_empty(torch.zeros(1), 3, MiB)


def test_threads_get_memory_of_their_own():
    q, got = torch.zeros(1), {}

    def work(i):
        for _ in range(20):
            x = host_pages.huge_empty(q, MiB + i)
            x.fill_(i)
            got[i] = bool((x == i).all())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: True for i in range(4)}


def _mapping(addr: int) -> str:
    """The /proc/self/smaps block of the mapping that holds ``addr``."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if lo <= addr < hi:
            return block
    raise AssertionError(f"no mapping holds {addr:#x}")


def _thp_faults() -> dict:
    return {k: int(n) for k, n in re.findall(r"^(thp_fault_\w+) (\d+)$", Path("/proc/vmstat").read_text(), re.M)}


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_pooled_regions_are_private_memory_that_gets_huge_pages():
    """A pooled region is private anonymous memory: the huge-page advice works on it (an anonymous
    mmap is shared by default, i.e. shmem, which the advice leaves on 4 KiB pages), and a forked child
    writes copies of it (see the next test). Where the kernel gives anonymous memory huge pages on
    advice, the region's first writes fault them in, unless none could be found (a fallback)."""
    x = host_pages.huge_empty(torch.zeros(1), 3, MiB)              # 12 MiB
    block = _mapping(x.data_ptr())
    assert block.split()[1].endswith("p"), block.splitlines()[0]
    assert " hg" in block, "the region was not advised onto huge pages"
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this system")
    before = _thp_faults()
    x.fill_(1)
    after = _thp_faults()
    huge = int(re.search(r"AnonHugePages:\s+(\d+) kB", _mapping(x.data_ptr())).group(1))
    fell_back = after.get("thp_fault_fallback", 0) > before.get("thp_fault_fallback", 0)
    assert huge >= 8 * 1024 or fell_back, (huge, before, after)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_and_its_parent_never_share_pooled_memory():
    """Both take the same free region from the pool they share at the fork: each must see only its
    own writes (on shared memory the child's tensor would hold the parent's values)."""
    q = torch.zeros(1, dtype=torch.uint8)
    n = 4 * MiB
    first = host_pages.huge_empty(q, n).data_ptr()                 # freed at once: the pool holds it
    (child_in, to_child), (parent_in, to_parent) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:                                                   # no torch kernels here: fork and OpenMP
        code = 1
        try:
            os.close(to_child), os.close(parent_in)
            mine = host_pages.huge_empty(q, n)
            code = 3
            if mine.data_ptr() == first:
                ctypes.memset(mine.data_ptr(), 1, n)
                os.write(to_parent, b"x"), os.read(child_in, 1)
                code = 0 if ctypes.string_at(mine.data_ptr(), n) == b"\x01" * n else 4
        finally:
            os._exit(code)
    os.close(child_in), os.close(to_parent)
    ready = os.read(parent_in, 1)                                  # b"": the child has exited
    theirs = host_pages.huge_empty(q, n)
    ctypes.memset(theirs.data_ptr(), 2, n)
    if ready:
        os.write(to_child, b"x")
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os.close(to_child), os.close(parent_in)
    assert code == 0, f"child exit {code}: 3, it did not take the pool's region; 4, it saw the parent's writes"
    assert theirs.data_ptr() == first
    assert ctypes.string_at(theirs.data_ptr(), n) == b"\x02" * n


@pytest.mark.skipif(cpu_backend.unavailable("cpu") is not None, reason="cpu kernels unavailable")
def test_op_results_are_the_same_with_the_pool_on_and_off_and_never_alias(monkeypatch):
    """The outputs of one call are not overwritten by the next while they live; the results of the
    pooled op equal the fresh tensors' bit for bit."""
    q, k, v, dout = make(B=1, H=8, Hkv=8, T=1200, Dh=128, seed=4)          # 4.9 MB each
    cols = host_columns(ColumnSpec((0, 1, 2, 3, 50, 700)), None, 1200)

    def both(q):
        out, aux = cpu_backend.attn_forward(q, k, v, cols, 0.3)
        return (out, *cpu_backend.attn_backward(q, k, v, out, aux, dout, cols, 0.3)[:3])

    monkeypatch.setenv("FIBATTN_HOST_POOL_MB", "0")
    fresh = [x.clone() for x in both(q)]
    monkeypatch.setenv("FIBATTN_HOST_POOL_MB", "2048")
    first = both(q)
    keep = [x.clone() for x in first]
    second = both(q.flip(2))                         # other values, while the first results live
    assert not {x.data_ptr() for x in first} & {x.data_ptr() for x in second}
    close(first, keep, rtol=0, atol=0)
    close(first, fresh, rtol=0, atol=0)
    ptrs = {x.data_ptr() for x in first}
    del first
    again = both(q)                                  # now on the first call's memory
    assert {x.data_ptr() for x in again} == ptrs
    close(again, fresh, rtol=0, atol=0)


def test_strided_inputs_are_copied_onto_huge_pages(monkeypatch):
    """A transposed input (the model's v, the gradient through a transpose) is made contiguous in memory
    advised onto huge pages; the op's results are those of a plain contiguous copy."""
    monkeypatch.setenv("FIBATTN_HOST_POOL_MB", "0")
    calls = _recording(monkeypatch)
    q, k, v, dout = make(B=1, H=8, Hkv=8, T=1200, Dh=128, seed=4)          # 4.9 MB each
    vt = v.transpose(1, 2).contiguous().transpose(1, 2)                     # strided, same values
    cols = host_columns(ColumnSpec((0, 1, 2, 3, 50, 700)), None, 1200)
    want, _ = cpu_backend.attn_forward(q, k, v, cols, 0.3)
    assert len(calls) == 1                       # out (P is under 4 MiB)
    got, _ = cpu_backend.attn_forward(q, k, vt, cols, 0.3)
    assert len(calls) == 3                       # and now v's copy
    close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_another_thread_held_the_pool_can_still_allocate():
    """The pool's lock is new in a forked child: the parent's thread that held it does not exist there."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with host_pages._pool.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)                                   # a deadlock ends the child, not the test run
                x = host_pages.huge_empty(torch.zeros(1, dtype=torch.uint8), 4 * MiB)
                del x
                code = 0 if host_pages.cached_bytes() == 4 * MiB else 2
            finally:
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        release.set()
        holder.join()
    assert code == 0, f"child exit {code} (-14: it waited on the parent's lock)"
