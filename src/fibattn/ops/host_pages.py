"""CPU tensors on transparent huge pages, reused between calls, for the tensors the cpu kernels write
or read far back.

Two costs of 4 KiB pages, measured on a 2-core KVM guest (``cpu_kernels.c``'s forward + backward,
T = 4096, 8 heads of 64, one thread): glibc maps a tensor above its mmap threshold (at most 32 MB)
afresh on every call, and the first writes fault once per 4 KiB page (five 32 MB tensors: 75 ms
with 4 KiB pages, 24 ms with huge pages); and the rungs' rows, up to ~1,500 rows back, miss the
TLB (the kernels took 37 ms with every buffer on 4 KiB pages, 30 ms with their outputs on huge
pages, 27 ms with everything on them). Where the system has huge pages off, the advice is refused
and nothing changes.

Fresh huge pages still cost the kernel's zeroing of them (a third of the op's time at T = 16K), so
a freed tensor's pages go back to a pool and the next tensor of the same rounded size takes them,
as PyTorch's CUDA caching allocator does with device memory. ``FIBATTN_HOST_POOL_MB`` bounds the
free memory the pool keeps, the least recently freed dropped first (default 1024; 0: no pool);
:func:`empty_cache` hands it back. A tensor on pooled memory cannot be resized in place. Regions are
private memory, so a forked child (a DataLoader worker) writes copies of them, never its parent's tensors.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import threading
import weakref

import torch

from ..checks import UsageError

_HUGE = 2 << 20         # a transparent huge page (x86-64; arm64 with 4 KiB pages)
_MADV_HUGEPAGE = 14
_PRIVATE = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` (None where there is none)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).madvise        # the process's own symbols: libc's
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _advise(start: int, nbytes: int) -> None:
    """Ask for huge pages on the 2 MiB-aligned part of ``[start, start + nbytes)``."""
    fn = _madvise()
    lo, hi = -(-start // _HUGE) * _HUGE, (start + nbytes) // _HUGE * _HUGE
    if fn is not None and hi > lo:
        fn(lo, hi - lo, _MADV_HUGEPAGE)


_limit: tuple = (None, 0)   # the last FIBATTN_HOST_POOL_MB read and its bytes (a call per tensor parses it once)


def pool_limit() -> int:
    """The bytes of free memory the pool may keep (``FIBATTN_HOST_POOL_MB``, MiB)."""
    global _limit
    raw = os.environ.get("FIBATTN_HOST_POOL_MB", "1024")
    if raw != _limit[0]:
        try:
            mb = int(raw)
        except ValueError:
            mb = -1
        if mb < 0:
            raise UsageError(f"FIBATTN_HOST_POOL_MB must be a whole number of MiB, 0 or more, got {raw!r}")
        _limit = (raw, mb << 20)
    return _limit[1]


class _Region:
    """One anonymous mapping; ``start`` its first 2 MiB-aligned byte's offset, ``size`` what is usable."""

    def __init__(self, pool: "_Pool", size: int):
        self.pool = pool
        # private: Python's default for an anonymous map is MAP_SHARED, i.e. shmem, which the advice
        # below leaves on 4 KiB pages (shmem has huge pages only where shmem_enabled allows, off by default)
        self.map = mmap.mmap(-1, size + _HUGE, flags=_PRIVATE)     # room to start on a huge-page boundary
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.start, self.size, self.limit = -base % _HUGE, size, 0
        _advise(base + self.start, size)

    def returned(self, ref: weakref.ref) -> None:
        """The last tensor on this region is gone (``ref``, its memoryview's, is dead): back to the pool."""
        self.pool.lent.pop(id(ref), None)
        self.pool.give(self)


class _Pool:
    """Free regions, oldest first; a region comes back when the last tensor on it is freed, and the
    oldest are dropped (unmapped) while the pool holds more than the limit read when that region was
    handed out."""

    def __init__(self):
        self.lock, self.free, self.held = threading.Lock(), [], 0
        self.lent: dict[int, weakref.ref] = {}    # a weak reference per region out (by id: a writable
        # memoryview cannot be hashed), whose callback returns it

    def take(self, size: int, limit: int) -> _Region:
        with self.lock:
            found = next((j for j in range(len(self.free) - 1, -1, -1) if self.free[j].size == size), None)
            region = self.free.pop(found) if found is not None else None
            if region is not None:
                self.held -= size
        region = region or _Region(self, size)
        region.limit = limit
        return region

    def give(self, region: _Region) -> None:
        with self.lock:
            self.free.append(region)
            self.held += region.size
            while self.held > region.limit:
                self.held -= self.free.pop(0).size

    def after_fork(self) -> None:
        """In a forked child: a new lock (another thread of the parent may have held this one at the
        fork, and it would never be released here), the free list as the child inherited it."""
        self.lock = threading.Lock()
        self.held = sum(region.size for region in self.free)

    def clear(self) -> int:
        with self.lock:
            held, self.free, self.held = self.held, [], 0
        return held


_pool = _Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool.after_fork)


def empty_cache() -> int:
    """Hand the pool's free memory back to the system; returns the bytes it held."""
    return _pool.clear()


def cached_bytes() -> int:
    """The bytes of free memory the pool keeps now."""
    return _pool.held


def huge_empty(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """An uninitialised CPU tensor of ``like``'s dtype and ``shape``. Under 4 MiB: as ``new_empty``
    gives it. From 4 MiB: on a pooled region of huge pages; with the pool off, from ``new_empty`` with
    its 2 MiB-aligned part advised onto huge pages before anything touches it."""
    nbytes = math.prod(shape) * like.element_size()
    if nbytes < 2 * _HUGE:
        return like.new_empty(shape)
    limit = pool_limit()
    if limit == 0:
        x = like.new_empty(shape)
        _advise(x.data_ptr(), nbytes)
        return x
    region = _pool.take(-(-nbytes // _HUGE) * _HUGE, limit)
    view = memoryview(region.map)[region.start:region.start + nbytes]
    # the tensor keeps ``view`` alive; when the last tensor on it goes, the region goes back (a weak
    # reference with a callback: weakref.finalize cost 4 µs of the 9 µs this takes)
    ref = weakref.ref(view, region.returned)
    _pool.lent[id(ref)] = ref
    return torch.frombuffer(view, dtype=like.dtype, count=math.prod(shape)).view(shape)
