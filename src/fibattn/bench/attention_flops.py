"""Achieved GFLOP/s of the fused ops in ``fibattn bench attention`` against the machine's fp32
matmul rate (issue 29), and the CPU kernels alone (outputs written into tensors allocated once),
the public op and ``torch.mm`` timed in the same interleaved rounds: the share of the matmul rate
from times taken under the same load.

Work counted: 12 * Dh flops per query, head and attended column for forward+backward (4 * Dh
forward: q.k and p.v; backward adds dout.v, dq, dk and dv), a column attended by the rows that
reach it (``T - lo`` rows of column ``lo``, method.md §1, §3). An interpolated rung counts once,
although it reads two rows; packed documents are counted as one document per row (an upper
bound on the work done).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from ..ops import cpu_backend
from ..ops.columns import ColumnSpec, host_columns
from ..ops.host_pages import huge_empty
from ..schedules import as_base, attended_distances, interpolation_plan

FLOP_PATHS = ("integer", "interpolated", "integer-docs", "interpolated-docs")


MM_N = 2048                # the torch.mm shape of the run's peak, also timed between the op's rounds


def matmul_peak(n: int = MM_N, rounds: int = 5) -> float:
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


def round_ratios(a, b) -> list[float]:
    """``a``'s time over ``b``'s in each timed round (records of one interleaved run; without rounds, the
    ratio of their times): a round's two times share that moment's load."""
    pairs = list(zip(a.rounds_ms or [], b.rounds_ms or []))
    return [x / y for x, y in pairs] if pairs else [a.ms / b.ms]


def round_ratio(a, b) -> float:
    """The median of :func:`round_ratios`: this machine's speed drifts by tens of percent within a run."""
    return statistics.median(round_ratios(a, b))


def ratio_range(ratios) -> tuple | None:
    """The lowest and highest of the rounds' ratios (None for one round or none)."""
    return (min(ratios), max(ratios)) if ratios and len(ratios) > 1 else None


def spread(ratios) -> str:
    """``", rounds LO to HI"``: how far the rounds' ratios behind a median lie apart ("" for one round),
    so that a reader sees the run's noise next to a ratio held against a goal."""
    r = ratio_range(ratios)
    return f", rounds {r[0]:.2f} to {r[1]:.2f}" if r else ""


def flop_lines(records, peak: float | None) -> list[str]:
    """Per (length, mode): each fused path's GFLOP/s and share of ``peak``."""
    lines = []
    for T, mode in sorted({(r.T, r.mode) for r in records}):
        by = {r.path: r for r in records if r.T == T and r.mode == mode and getattr(r, "gflop_s", None)}
        if not by:
            continue
        parts = [f"{p} {r.gflop_s:.1f} GFLOP/s" + (f" ({r.gflop_s / peak:.0%} of peak)" if peak else "")
                 for p, r in by.items()]
        lines.append(f"T={T} {mode}: " + ", ".join(parts))
    return lines


@dataclass
class KernelTimes:
    op_ms: float             # the public op, fastest round
    kernels_ms: float        # its cpu kernels alone, fastest round
    mm_gflop_s: float        # torch.mm in the same rounds
    far_cost: float           # the kernels alone over the same on packed columns: median of the rounds' ratios
    far_range: tuple | None = None    # the rounds' lowest and highest of those ratios (None: one round)
    grouped_kv_heads: int | None = None   # grouped_kv_heads(cfg), or None: no grouped-heads check
    grouped_ratio: float | None = None    # the kernels alone on those KV heads over on H: median of the rounds
    grouped_range: tuple | None = None


def packed_columns(cols, T: int):
    """``cols`` moved next to the diagonal, in order (a column's taps right after the one before's;
    never-valid columns stay so): the same taps and weights, but every row they read was read a few
    rows before, so it is still in the caches. The kernels' time on them bounds from above what the op
    would cost if its far columns' rows came as cheaply as the window's: packed, a column is reached by
    more rows (at 4K 4 % more taps; at short lengths by all of them, and the ratio drops below 1)."""
    lo, near = [], 0
    for c, two in zip(cols.lo, cols.two):
        if c >= T:
            lo.append(c)
        else:
            lo.append(near)
            near += 2 if two else 1
    return dataclasses.replace(cols, lo=tuple(lo))


def grouped_kv_heads(cfg) -> int | None:
    """The KV heads of the grouped-heads check (issue 29: grouped heads as fast per query head as one KV
    head per query head): 2 when the bench runs one KV head per query head and 2 groups them; else None."""
    return 2 if cfg.kv_heads == cfg.heads and cfg.heads > 2 and cfg.heads % 2 == 0 else None


def kernel_ms(cfg, path: str, T: int, rounds: int) -> KernelTimes:
    """Fastest of ``rounds`` forward+backward calls, interleaved round by round, of the public op
    (``integer`` or ``interpolated``, the bench's shapes, autograd), of its cpu kernels alone
    (every output and the scratch allocated once beforehand) and of ``torch.mm`` (``MM_N``
    square); the kernels alone on :func:`packed_columns`, the far columns' cost; and
    (:func:`grouped_kv_heads`) the kernels alone on k and v of fewer heads for the same queries. The
    matmul rate comes from the same minutes as the op's times, where the run's peak (``matmul_peak``)
    is taken once at its start, and this machine's speed drifts by ±20 % over minutes."""
    from .attention_paths import _distances, _inputs, make_step

    leaves, dout = _inputs(cfg, T)
    q, k, v = (x.detach() for x in leaves)
    interp = path == "interpolated"
    spec = (ColumnSpec(None, cfg.window, tuple(as_base(f"fib:{cfg.fib_k}").resolve(T)), None) if interp
            else ColumnSpec(tuple(_distances(cfg, T))))
    cols, scale = host_columns(spec, cfg.alpha if interp else None, T), cfg.head_dim ** -0.5
    fwd = (huge_empty(q, *q.shape), huge_empty(q, *cpu_backend.aux_shape(q, len(cols.lo), cols.interpolated)))
    bwd = (huge_empty(q, *q.shape), huge_empty(k, *k.shape), huge_empty(v, *v.shape))   # as the op's own
    a, b = torch.randn(MM_N, MM_N), torch.randn(MM_N, MM_N)

    near = packed_columns(cols, T)

    def kernels(cols=cols, k=k, v=v, bwd=bwd):
        out, aux = cpu_backend.attn_forward(q, k, v, cols, scale, into=fwd)
        cpu_backend.attn_backward(q, k, v, out, aux, dout, cols, scale, need_dfrac=interp, into=bwd)

    steps = {"op": make_step(cfg, path, T, (leaves, dout)), "kernels": kernels, "mm": lambda: torch.mm(a, b),
             "packed": lambda: kernels(near)}
    hkv = grouped_kv_heads(cfg)
    if hkv:
        (_, kg, vg), _ = _inputs(dataclasses.replace(cfg, kv_heads=hkv), T)
        kg, vg = kg.detach(), vg.detach()
        bwd_g = (bwd[0], huge_empty(kg, *kg.shape), huge_empty(vg, *vg.shape))
        steps["grouped"] = lambda: kernels(k=kg, v=vg, bwd=bwd_g)
    times = {name: [] for name in steps}
    for r in range(rounds + 1):                          # the first round warms up (and builds the scratch)
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            if r:
                times[name].append(time.perf_counter() - t0)

    def over(a, b="kernels"):                         # (median, range) of the rounds' ratios, or (None, None)
        if a not in times:
            return None, None
        ratios = [x / y for x, y in zip(times[a], times[b])]
        return statistics.median(ratios), ratio_range(ratios)

    return KernelTimes(min(times["op"]) * 1e3, min(times["kernels"]) * 1e3, 2 * MM_N ** 3 / min(times["mm"]) / 1e9,
                       *over("kernels", "packed"), hkv, *over("grouped"))


def kernel_checks(cfg, peak: float | None) -> list[dict]:
    """Per forward+backward length on CPU and fused op: its public call and its kernels alone, against
    the run's matmul peak and a ``torch.mm`` rate measured in the same rounds: one ``cpu_kernels``
    record each."""
    ops = [p for p in ("integer", "interpolated") if p in cfg.paths]
    if cfg.on_cuda or not ops or cpu_backend.unavailable("cpu") is not None:
        return []
    checks = []
    for T in cfg.lengths:
        for op in ops:
            kt = kernel_ms(cfg, op, T, cfg.repeats)
            checks.append({"check": "cpu_kernels", "T": T, "op": op, "op_ms": kt.op_ms, "kernels_ms": kt.kernels_ms,
                           "op_gflop_s": gflop_rate(cfg, op, T, kt.op_ms),
                           "kernels_gflop_s": gflop_rate(cfg, op, T, kt.kernels_ms), "mm_gflop_s": kt.mm_gflop_s,
                           "peak_gflop_s": peak, "far_cost": kt.far_cost, "far_cost_range": kt.far_range,
                           "grouped_kv_heads": kt.grouped_kv_heads, "grouped_ratio": kt.grouped_ratio,
                           "grouped_ratio_range": kt.grouped_range,
                           "rounds": cfg.repeats,
                           "threads": torch.get_num_threads()})
    return checks


def kernel_lines(checks: list[dict]) -> list[str]:
    """:func:`kernel_checks`' records as one line per length."""
    lines = []
    for T in dict.fromkeys(c["T"] for c in checks):
        parts = []
        for c in [x for x in checks if x["T"] == T]:
            mm, peak, rate = c["mm_gflop_s"], c["peak_gflop_s"], c["kernels_gflop_s"]
            op_rate = c["op_gflop_s"]
            parts.append(f"{c['op']} {c['op_ms']:.1f} ms = {op_rate:.1f} GFLOP/s ({op_rate / mm:.0%} of torch.mm), "
                         f"kernels alone {c['kernels_ms']:.1f} ms = {rate:.1f} GFLOP/s ({rate / mm:.0%} of torch.mm"
                         + (f", {rate / peak:.0%} of peak)" if peak else ")") + f", torch.mm {mm:.1f} GFLOP/s"
                         + f", far columns' cost {c['far_cost']:.2f}x (kernels alone over the same on the columns "
                         f"packed next to the diagonal, median of the rounds' ratios{spread(c['far_cost_range'])})"
                         + (f", grouped heads {c['grouped_ratio']:.2f}x (kernels alone with {c['grouped_kv_heads']} "
                            f"KV heads over with one per query head, median of the rounds' ratios"
                            f"{spread(c['grouped_ratio_range'])})" if c.get("grouped_ratio") else ""))
        lines.append(f"T={T} fwd+bwd, public op vs its cpu kernels alone vs torch.mm {MM_N}x{MM_N} (outputs allocated "
                     f"once; fastest of {checks[0]['rounds']}, interleaved): " + "; ".join(parts))
    return lines
