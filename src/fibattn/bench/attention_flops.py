"""Achieved GFLOP/s of the fused ops in ``fibattn bench attention`` against the machine's fp32
matmul rate (issue 29), and the old-vs-new CPU kernel comparison.

Work counted: 12 * Dh flops per query, head and attended column for forward+backward (4 * Dh
forward: q.k and p.v; backward adds dout.v, dq, dk and dv), a column attended by the rows that
reach it (``T - lo`` rows of column ``lo``, method.md §1, §3). An interpolated rung counts once,
although it reads two rows; packed documents are counted as one document per row (an upper
bound on the work done).
"""
from __future__ import annotations

import time

import torch

from ..schedules import attended_distances, interpolation_plan

FLOP_PATHS = ("integer", "interpolated", "integer-docs", "interpolated-docs", "integer-rows", "interpolated-rows")


def matmul_peak(n: int = 2048, rounds: int = 5) -> float:
    """fp32 ``torch.mm`` GFLOP/s on this CPU with torch's current thread count (best of ``rounds``:
    the machine's rate, as little of other processes' load as one can get)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)                                      # warm-up: thread pool, caches
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(times) / 1e9


def columns_rows(cfg, path: str, T: int) -> int:
    """Sum over attended columns of the rows that attend them (one row per query)."""
    if path.startswith("interpolated"):
        plan = interpolation_plan(cfg.window, cfg.alpha, f"fib:{cfg.fib_k}", T)
        los = list(plan.window) + [lo for lo, _ in plan.rungs]
    else:
        los = attended_distances(cfg.window, cfg.alpha, f"fib:{cfg.fib_k}", T)
    return sum(max(T - lo, 0) for lo in los)


def gflop_rate(cfg, path: str, T: int, ms: float | None, backward: bool = True) -> float | None:
    """Achieved GFLOP/s of a fused-op path (None for the others or without a time)."""
    if path not in FLOP_PATHS or not ms:
        return None
    per = (12 if backward else 4) * cfg.head_dim
    return per * cfg.batch * cfg.heads * columns_rows(cfg, path, T) / (ms / 1e3) / 1e9


def peak_line(peak: float) -> str:
    return (f"fp32 matmul peak: {peak:.1f} GFLOP/s (torch.mm 2048x2048, {torch.get_num_threads()} threads, "
            f"best of 5, measured in this run)")


def flop_lines(records, peak: float | None) -> list[str]:
    """Per (length, mode): each fused path's GFLOP/s and share of ``peak``, and tiled vs rows kernels."""
    lines = []
    for T, mode in sorted({(r.T, r.mode) for r in records}):
        by = {r.path: r for r in records if r.T == T and r.mode == mode and getattr(r, "gflop_s", None)}
        if not by:
            continue
        parts = [f"{p} {r.gflop_s:.1f} GFLOP/s" + (f" ({r.gflop_s / peak:.0%} of peak)" if peak else "")
                 for p, r in by.items()]
        lines.append(f"T={T} {mode}: " + ", ".join(parts))
        for op in ("integer", "interpolated"):
            if op in by and f"{op}-rows" in by:
                lines.append(f"T={T} {mode}: {op}, generic rows kernel / tiled kernel = "
                             f"{by[f'{op}-rows'].ms / by[op].ms:.2f}x ({by[f'{op}-rows'].ms:.1f} vs {by[op].ms:.1f} ms)")
    return lines
