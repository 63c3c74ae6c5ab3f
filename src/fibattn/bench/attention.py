"""``fibattn bench attention``: forward+backward time and peak extra memory, side by side.

Paths, all on ``q (B, H, T, Dh)``, ``k, v (B, Hkv, T, Dh)``. Defaults: on CPU B=1, H=Hkv=8,
Dh=64, float32; on CUDA B=4, H=8, Hkv=2, Dh=64, bfloat16 (the GPU goals' setting).

- ``dense``: causal ``scaled_dot_product_attention`` (the baseline). Its SDPA backend is
  chosen per length by running one warm-up step under
  ``torch.nn.attention.sdpa_kernel([backend])`` for each backend in torch's priority order
  (on this torch: flash, efficient, then math; cudnn is tried before math, the unfused
  reference) and keeping the first that runs on these inputs; the timed steps and the memory
  measurement then run under that backend explicitly, so the label (``sdpa-flash``,
  ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-math`` on CUDA; ``sdpa-cpu-flash`` or
  ``sdpa-cpu-math`` on CPU) is what ran;
- ``mask``: SDPA with the boolean T×T mask of the distance set (the study's static path;
  skipped, with the reason printed, when its estimated memory exceeds ``--mask-budget-gb``:
  about 17 bytes per mask entry on CPU with torch 2.13, the bool mask plus the float
  copies SDPA makes of it — measured 0.29 GB at T=4096 and 4.6 GB at T=16384);
- ``flex``: FlexAttention compiled with the distance set's block mask (CUDA only);
- ``torch``: :func:`fibattn.sparse_attention` on the portable ``torch`` backend (CUDA only);
- ``integer``: :func:`fibattn.sparse_attention` with the ``auto`` backend (named in the table);
- ``interpolated``: :func:`fibattn.interpolated_sparse_attention` with a learnable ``alpha``;
- ``integer-docs``, ``interpolated-docs`` (with ``--documents N``, next to their plain op): the
  same with ``N`` packed documents of equal length per row (document masking), and a line
  giving their cost over the plain op.

Achieved GFLOP/s against a fp32 matmul peak: ``bench.attention_flops``.

After the table, one line per op gives its per-call host overhead (:func:`host_overhead`, ~0.5 s
each): the public op on the ``cpu`` backend at T=16, forward+backward, against its kernels
called directly, and how much of the difference autograd alone accounts for; then the same with
the caches emptied before each call, as a model's other layers or long sequences leave them.

On CUDA each timed round runs enough calls to last ~20 ms before it synchronises, and the
integer and interpolated rows also report the kernels' own memory traffic in GB/s (each
kernel reading its inputs and writing its outputs once) next to a device-to-device copy
measured in the same run, the practical bandwidth ceiling. ``--forward-lengths`` (CUDA
default 131072) times the forward alone, under ``no_grad``.

Times are the median of ``--repeats`` rounds after one warm-up; the paths are interleaved
round by round so that load from other processes hits them alike. Peak extra memory is
measured for each (T, path) in a fresh subprocess on CPU (peak RSS over the RSS after the
inputs exist; the peak is reset through ``/proc/self/clear_refs`` where Linux allows it,
otherwise ``ru_maxrss`` is used) and with ``torch.cuda.max_memory_allocated`` on CUDA.
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..ops import backend_available
from .attention_args import config_from_args, configure_parser
from .attention_flops import (flop_lines, gflop_rate, kernel_checks, kernel_lines, matmul_peak, peak_line,
                              round_ratios, spread)
from .attention_paths import (DOC_PATHS, PATHS, BenchConfig, _inputs, backend_name, document_lines,
                              make_step, mask_bytes, pick_sdpa, sdpa_label, traffic_bytes)
from .host_overhead import HostOverhead, host_overhead

__all__ = ["BenchConfig", "HostOverhead", "Record", "PATHS", "bench_length", "configure_parser", "host_overhead", "run",
           "table"]


@dataclass
class Record:
    T: int
    path: str
    backend: str
    ms: float | None = None
    peak_extra_mb: float | None = None
    skipped: str | None = None
    mode: str = "fwd+bwd"
    gb_s: float | None = None
    gflop_s: float | None = None
    rounds_ms: list[float] | None = None     # each timed round, in the interleaved order


def copy_gb_s(device: str, nbytes: int = 1 << 31) -> float:
    """A device-to-device copy's rate (bytes read + written per second): the practical ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 10 * nbytes / (time.perf_counter() - t0) / 1e9


def _timed(step, cuda: bool) -> float:
    """Milliseconds per call: on CUDA, enough calls per round to last ~20 ms, then one sync."""
    if not cuda:
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    n = max(1, min(200, int(0.02 / max(once, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


# ----------------------------------------------------------------------------- memory
def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2 ** 20


def _peak_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass        # ru_maxrss then includes earlier peaks: an over-estimate, never an under-estimate


def measure_in_process(cfg: BenchConfig, path: str, T: int, sdpa: str | None = None) -> dict:
    """One forward+backward of ``path``: peak extra memory (MB) and its time. A forward+backward at a tiny
    length runs first, so that one-time costs (kernel loading, thread pools, autograd start-up) are not counted."""
    make_step(cfg, path, min(T, 32), sdpa=sdpa)()
    inputs = _inputs(cfg, T)
    if cfg.on_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        make_step(cfg, path, T, inputs, sdpa=sdpa)()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        return {"peak_extra_mb": (torch.cuda.max_memory_allocated() - base) / 2 ** 20, "ms": ms}
    base = _rss_mb()
    _reset_peak()
    t0 = time.perf_counter()
    make_step(cfg, path, T, inputs, sdpa=sdpa)()     # the mask path's T×T mask is built in here: it counts
    ms = (time.perf_counter() - t0) * 1e3
    return {"peak_extra_mb": max(_peak_mb() - base, 0.0), "ms": ms}


def measure_in_subprocess(cfg: BenchConfig, path: str, T: int, sdpa: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "fibattn.bench.attention", json.dumps(asdict(cfg)), path, str(T),
           str(torch.get_num_threads())] + ([sdpa] if sdpa else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"memory worker for {path} at T={T} failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the run
def _skip_reason(cfg: BenchConfig, path: str, T: int) -> str | None:
    if path == "mask" and mask_bytes(T) > cfg.mask_budget_gb * 2 ** 30:
        return (f"a {T}x{T} mask path needs ~{mask_bytes(T) / 2 ** 30:.0f} GiB "
                f"> --mask-budget-gb {cfg.mask_budget_gb:g}")
    if path in ("flex", "torch") and not cfg.on_cuda:
        return f"the {path} path is measured on CUDA only"
    return None


def bench_length(cfg: BenchConfig, T: int, backward: bool = True) -> list[Record]:
    mode = "fwd+bwd" if backward else "fwd"
    recs = {p: Record(T, p, backend_name(cfg, p), skipped=_skip_reason(cfg, p, T), mode=mode) for p in cfg.paths}
    live = [p for p in cfg.paths if recs[p].skipped is None]
    sdpa, inputs = None, None
    if "dense" in live:             # the first SDPA backend that runs these inputs, then always that one
        inputs = _inputs(cfg, T)
        sdpa = pick_sdpa(lambda name: make_step(cfg, "dense", T, inputs, backward, sdpa=name)())
        recs["dense"].backend = sdpa_label(sdpa, cfg.device)
    steps = {p: make_step(cfg, p, T, inputs if p == "dense" else None, backward=backward,
                          sdpa=sdpa if p == "dense" else None) for p in live}
    times: dict[str, list[float]] = {p: [] for p in live}
    for p in live:
        if p != "dense":                              # dense ran its warm-up while its backend was picked
            steps[p]()                                # warm-up (and kernel compilation)
    for _ in range(cfg.repeats):
        for p in live:
            times[p].append(_timed(steps[p], cfg.on_cuda))
    del steps
    inputs = None
    for p in live:
        recs[p].rounds_ms, recs[p].ms = times[p], statistics.median(times[p])
        recs[p].gflop_s = gflop_rate(cfg, p, T, recs[p].ms, backward)
        if cfg.on_cuda and p in ("integer", "interpolated", *DOC_PATHS.values()):
            recs[p].gb_s = traffic_bytes(cfg, T, backward) / (recs[p].ms / 1e3) / 1e9
        if cfg.memory and backward:
            extra = sdpa if p == "dense" else None
            mem = measure_in_process(cfg, p, T, extra) if cfg.on_cuda else measure_in_subprocess(cfg, p, T, extra)
            recs[p].peak_extra_mb = mem["peak_extra_mb"]
    return [recs[p] for p in cfg.paths]


def _fmt(x, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def table(records: list[Record], copy_rate: float | None = None) -> str:
    w = max([8] + [len(r.backend) for r in records])
    lines = [f"{'T':>7} {'mode':<8} {'path':<17} {'backend':<{w}} {'ms':>10} {'peak extra MB':>14} {'GB/s':>7}  note"]
    for r in records:
        lines.append(f"{r.T:>7} {r.mode:<8} {r.path:<17} {r.backend:<{w}} {_fmt(r.ms, '10.3f')} "
                     f"{_fmt(r.peak_extra_mb, '14.1f')} {_fmt(r.gb_s, '7.0f')}  {r.skipped or ''}")
    lines.append("")
    for T, mode in sorted({(r.T, r.mode) for r in records}):
        by = {r.path: r for r in records if r.T == T and r.mode == mode}
        ours = by["integer"].ms if "integer" in by else None
        parts = [f"T={T} {mode}:"]
        for p in ("dense", "mask", "flex", "torch"):
            if ours and p in by and by[p].ms:
                parts.append(f"{p}/integer = {by[p].ms / ours:.1f}x")
        if ours and "interpolated" in by and by["interpolated"].ms:
            ratios = round_ratios(by["interpolated"], by["integer"])
            parts.append(f"interpolated/integer = {statistics.median(ratios):.2f}x"
                         + (f" (median of the rounds' ratios{spread(ratios)})" if len(ratios) > 1 else ""))
        if copy_rate and "integer" in by and by["integer"].gb_s:
            parts.append(f"integer traffic {by['integer'].gb_s:.0f} GB/s = {by['integer'].gb_s / copy_rate:.0%} "
                         f"of a device copy ({copy_rate:.0f} GB/s)")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def run(args) -> int:
    cfg = config_from_args(args)
    out = sys.stderr if args.json else sys.stdout
    where = torch.cuda.get_device_name(cfg.device) if cfg.on_cuda else f"cpu threads={torch.get_num_threads()}"
    print(f"attention: B={cfg.batch} H={cfg.heads} Hkv={cfg.kv_heads} Dh={cfg.head_dim} {cfg.dtype} W={cfg.window} "
          f"fib K={cfg.fib_k} alpha={cfg.alpha} device={cfg.device} ({where}) repeats={cfg.repeats}",
          file=out, flush=True)
    copy_rate, peak = None, None if cfg.on_cuda else matmul_peak()
    if peak:
        print(peak_line(peak), file=out, flush=True)
    if cfg.on_cuda:
        copy_rate = copy_gb_s(cfg.device)
        print(f"device-to-device copy: {copy_rate:.0f} GB/s (read + write)", file=out, flush=True)
        if args.json:
            print(json.dumps({"check": "copy", "gb_s": copy_rate}), flush=True)
    records: list[Record] = []
    runs = [(T, True) for T in cfg.lengths] + [(T, False) for T in cfg.forward_lengths]
    for T, backward in runs:
        recs = bench_length(cfg, T, backward)
        records += recs
        if args.json:
            for r in recs:
                print(json.dumps(asdict(r)), flush=True)
    if records:
        print(table(records, copy_rate), file=out, flush=True)
        checks = kernel_checks(cfg, peak)
        for line in document_lines(records, cfg.documents) + flop_lines(records, peak) + kernel_lines(checks):
            print(line, file=out, flush=True)
        for check in checks if args.json else []:
            print(json.dumps(check), flush=True)
    why = backend_available("cpu", torch.device("cpu"))
    if why is not None:
        print(f"host overhead: not measured, {why}", file=out, flush=True)
    else:
        for op, cold in (("integer", False), ("interpolated", False), ("integer", True), ("interpolated", True)):
            res = host_overhead(op, cold=cold)
            print(res.line(), file=out, flush=True)
            if args.json:
                print(json.dumps({**res.record(), "check": "host_overhead"}), flush=True)
    if cfg.memory_check:
        T = cfg.memory_check
        on_cuda = cfg.on_cuda
        mem = measure_in_process(cfg, "integer", T) if on_cuda else measure_in_subprocess(cfg, "integer", T)
        rec = Record(T, "integer", backend_name(cfg, "integer"), ms=mem["ms"], peak_extra_mb=mem["peak_extra_mb"])
        verdict = "within" if rec.peak_extra_mb < 2048 else "ABOVE"
        print(f"memory check: integer fwd+bwd at T={T}: peak extra {rec.peak_extra_mb:.1f} MB "
              f"({verdict} the 2 GB goal), one step {rec.ms:.0f} ms, backend {rec.backend}", file=out, flush=True)
        if args.json:
            print(json.dumps({**asdict(rec), "check": "memory"}), flush=True)
    return 0


def _worker(argv: list[str]) -> None:
    """``python -m fibattn.bench.attention CONFIG_JSON PATH T THREADS [SDPA]``: one measurement, one JSON line."""
    cfg_json, path, T, threads, *sdpa = argv
    torch.set_num_threads(int(threads))
    cfg = BenchConfig(**json.loads(cfg_json))
    print(json.dumps(measure_in_process(cfg, path, int(T), sdpa[0] if sdpa else None)))


if __name__ == "__main__":
    _worker(sys.argv[1:])
