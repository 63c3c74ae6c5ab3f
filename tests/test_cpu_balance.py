"""The cpu kernels' work split (cpu_kernels.c, fa_ranges): a thread that runs out of its own blocks takes
blocks from the back of the others' ranges, and the backward's key-row pass of a block waits for the
query-row pass of the blocks that read it, whoever ran them. A build with one thread slowed
(``FA_SLOW_THREAD``) makes the others steal most of its blocks; its results must be the bits of the
plain build: forward, backward and d alpha, both kernel sets, documents, grouped heads, one head split
between threads."""
import ctypes

import pytest
import torch

from fibattn.ops import cpu_backend
from fibattn.ops.columns import ColumnSpec, host_columns
from fibattn.ops.documents import offsets_unchecked

from op_helpers import cpu_kernels, doc_ids, make, poison_scratch, use_kernel_build

pytestmark = pytest.mark.skipif(cpu_backend.unavailable("cpu") is not None, reason="cpu kernels unavailable")

CASES = [  # B, H, Hkv, T, Dh, documents
    (1, 4, 2, 700, 64, None),        # two heads on two threads: each thread's own range is a head
    (1, 2, 1, 900, 32, (300, 1)),    # one head split between the threads, documents, grouped
    (2, 2, 2, 333, 24, None),        # ragged last blocks
    (1, 3, 3, 64, 64, None),         # one block per head: 3 units over 2 or 3 threads
]
COLUMNS = [ColumnSpec((0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233)),
           ColumnSpec(None, 6, (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233), None)]


def _results():
    out = []
    for B, H, Hkv, T, Dh, docs in CASES:
        q, k, v, dout = make(B=B, H=H, Hkv=Hkv, T=T, Dh=Dh, seed=T)
        off = None if docs is None else offsets_unchecked(doc_ids(B, T, docs))
        for spec in COLUMNS:
            cols = host_columns(spec, 1.37 if spec.interpolated else None, T)
            for kind in ("vector", "generic"):
                for threads in (2, 3):
                    cpu_kernels(q, k, v, dout, cols, kind, threads, off)     # sizes the dS scratch
                    poison_scratch()
                    out.append(cpu_kernels(q, k, v, dout, cols, kind, threads, off))
    return out


def test_stolen_blocks_give_the_same_bits(tmp_path, monkeypatch):
    """Thread 1 slowed: with 2 threads thread 0 takes blocks from the back of its range, with 3 threads
    threads 0 and 2 do, and thread 0's last blocks wait on the first of thread 1's range."""
    plain = _results()
    lib = use_kernel_build(monkeypatch, tmp_path, (*cpu_backend._CFLAGS, "-DFA_SLOW_THREAD=1"))
    steals = ctypes.c_long.in_dll(lib, "fa_steals")
    got = _results()
    assert steals.value > 0                         # the other threads did take the slowed thread's blocks
    for want, have in zip(plain, got, strict=True):
        for a, b in zip(want, have):
            assert torch.equal(a, b)
