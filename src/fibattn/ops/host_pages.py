"""CPU tensors on transparent huge pages, for the tensors the cpu kernels write or read far back.

Two costs of 4 KiB pages, measured on a 2-core KVM guest (``cpu_kernels.c``'s forward + backward,
T = 4096, 8 heads of 64, one thread): glibc maps a tensor above its mmap threshold (at most 32 MB)
afresh on every call, and the first writes fault once per 4 KiB page (five 32 MB tensors: 75 ms
with 4 KiB pages, 24 ms with huge pages); and the rungs' rows, up to ~1,500 rows back, miss the
TLB (the kernels took 37 ms with every buffer on 4 KiB pages, 30 ms with their outputs on huge
pages, 27 ms with everything on them). Where the system has huge pages off, the advice is refused
and nothing changes.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch

_HUGE = 2 << 20         # a transparent huge page (x86-64; arm64 with 4 KiB pages)
_MADV_HUGEPAGE = 14


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


def huge_empty(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s dtype and ``shape``, its 2 MiB-aligned part advised onto
    huge pages before anything touches it (4 MiB or more; smaller ones as ``new_empty`` gives them)."""
    x = like.new_empty(shape)
    nbytes, fn = x.numel() * x.element_size(), _madvise()
    if nbytes >= 2 * _HUGE and fn is not None:
        start = -(-x.data_ptr() // _HUGE) * _HUGE
        end = (x.data_ptr() + nbytes) // _HUGE * _HUGE
        fn(start, end - start, _MADV_HUGEPAGE)
    return x
