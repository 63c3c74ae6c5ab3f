"""``fibattn bench attention``: forward+backward time and peak extra memory, side by side.

Paths, all on ``q (B, H, T, Dh)``, ``k, v (B, Hkv, T, Dh)`` with B=1, H=8, Dh=64 by default:

- ``dense``: causal ``scaled_dot_product_attention`` (the baseline);
- ``mask``: SDPA with the boolean T×T mask of the distance set (the study's static path;
  skipped, with the reason printed, when its estimated memory exceeds ``--mask-budget-gb``:
  about 17 bytes per mask entry on CPU with torch 2.13, the bool mask plus the float
  copies SDPA makes of it — measured 0.29 GB at T=4096 and 4.6 GB at T=16384);
- ``integer``: :func:`fibattn.sparse_attention` with the ``auto`` backend (named in the table);
- ``interpolated``: :func:`fibattn.interpolated_sparse_attention` with a learnable ``alpha``.

Times are the median of ``--repeats`` rounds after one warm-up; the paths are interleaved
round by round so that load from other processes hits them alike. Peak extra memory is
measured for each (T, path) in a fresh subprocess on CPU (peak RSS over the RSS after the
inputs exist; the peak is reset through ``/proc/self/clear_refs`` where Linux allows it,
otherwise ``ru_maxrss`` is used) and with ``torch.cuda.max_memory_allocated`` on CUDA.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

import fibattn
from ..ops import resolve_backend
from ..schedules import attended_distances

PATHS = ("dense", "mask", "integer", "interpolated")


@dataclass
class BenchConfig:
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    repeats: int = 3
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    window: int = 12
    fib_k: int = 15
    alpha: float = 1.5
    device: str = "cpu"
    mask_budget_gb: float = 8.0
    memory: bool = True
    memory_check: int | None = None


@dataclass
class Record:
    T: int
    path: str
    backend: str
    ms: float | None = None
    peak_extra_mb: float | None = None
    skipped: str | None = None


# ----------------------------------------------------------------------------- the paths
def _inputs(cfg: BenchConfig, T: int):
    g = torch.Generator().manual_seed(0)
    dev = torch.device(cfg.device)

    def rnd(h):
        return torch.randn(1, h, T, cfg.head_dim, generator=g).to(dev)

    q, k, v = rnd(cfg.heads), rnd(cfg.kv_heads), rnd(cfg.kv_heads)
    return [x.requires_grad_() for x in (q, k, v)], rnd(cfg.heads)


def _distances(cfg: BenchConfig, T: int) -> list[int]:
    return attended_distances(cfg.window, cfg.alpha, f"fib:{cfg.fib_k}", T)


MASK_BYTES_PER_ENTRY = 17


def mask_bytes(T: int) -> int:
    """Estimated peak extra memory of the mask path (see the module docstring)."""
    return MASK_BYTES_PER_ENTRY * T * T


def make_step(cfg: BenchConfig, path: str, T: int, inputs=None):
    """A closure running one forward+backward of ``path`` (on ``inputs`` or fresh ones)."""
    (q, k, v), dout = inputs or _inputs(cfg, T)
    gqa = cfg.kv_heads != cfg.heads
    if path == "dense":
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif path == "mask":
        dists = torch.tensor(_distances(cfg, T), device=q.device)
        pos = torch.arange(T, device=q.device)
        rel = pos[:, None] - pos[None, :]
        allowed = torch.zeros(T, dtype=torch.bool, device=q.device)
        allowed[dists] = True
        mask = (rel >= 0) & allowed[rel.clamp(min=0)]
        del rel

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    elif path == "integer":
        dists = _distances(cfg, T)

        def fwd():
            return fibattn.sparse_attention(q, k, v, dists, backend="auto")
    elif path == "interpolated":
        alpha = torch.tensor(cfg.alpha, requires_grad=True)

        def fwd():
            return fibattn.interpolated_sparse_attention(q, k, v, alpha=alpha, base=f"fib:{cfg.fib_k}",
                                                         window=cfg.window, backend="auto")
    else:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")

    def step():
        for x in (q, k, v):
            x.grad = None
        fwd().backward(dout)
        if q.is_cuda:
            torch.cuda.synchronize()
    return step


def backend_name(cfg: BenchConfig, path: str) -> str:
    if path in ("dense", "mask"):
        return "sdpa"
    return resolve_backend("auto", torch.device(cfg.device), interpolated=path == "interpolated")


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


def measure_in_process(cfg: BenchConfig, path: str, T: int) -> dict:
    """One forward+backward of ``path``: peak extra memory (MB) and its time.

    A forward+backward at a tiny length runs first so that one-time costs (kernel loading,
    thread pools, autograd start-up) are not counted as memory of the measured step.
    """
    make_step(cfg, path, min(T, 32))()
    inputs = _inputs(cfg, T)
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        make_step(cfg, path, T, inputs)()
        ms = (time.perf_counter() - t0) * 1e3
        return {"peak_extra_mb": (torch.cuda.max_memory_allocated() - base) / 2 ** 20, "ms": ms}
    base = _rss_mb()
    _reset_peak()
    t0 = time.perf_counter()
    make_step(cfg, path, T, inputs)()     # the mask path's T×T mask is built in here: it counts
    ms = (time.perf_counter() - t0) * 1e3
    return {"peak_extra_mb": max(_peak_mb() - base, 0.0), "ms": ms}


def measure_in_subprocess(cfg: BenchConfig, path: str, T: int) -> dict:
    cmd = [sys.executable, "-m", "fibattn.bench.attention", json.dumps(asdict(cfg)), path, str(T),
           str(torch.get_num_threads())]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"memory worker for {path} at T={T} failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the run
def _skip_reason(cfg: BenchConfig, path: str, T: int) -> str | None:
    if path == "mask" and mask_bytes(T) > cfg.mask_budget_gb * 2 ** 30:
        return (f"a {T}x{T} mask path needs ~{mask_bytes(T) / 2 ** 30:.0f} GiB "
                f"> --mask-budget-gb {cfg.mask_budget_gb:g}")
    return None


def bench_length(cfg: BenchConfig, T: int) -> list[Record]:
    recs = {p: Record(T, p, backend_name(cfg, p), skipped=_skip_reason(cfg, p, T)) for p in PATHS}
    live = [p for p in PATHS if recs[p].skipped is None]
    steps = {p: make_step(cfg, p, T) for p in live}
    times: dict[str, list[float]] = {p: [] for p in live}
    for p in live:
        steps[p]()                                    # warm-up (and kernel compilation)
    for _ in range(cfg.repeats):
        for p in live:
            t0 = time.perf_counter()
            steps[p]()
            times[p].append((time.perf_counter() - t0) * 1e3)
    del steps
    for p in live:
        recs[p].ms = statistics.median(times[p])
        if cfg.memory:
            on_cuda = cfg.device.startswith("cuda")
            mem = measure_in_process(cfg, p, T) if on_cuda else measure_in_subprocess(cfg, p, T)
            recs[p].peak_extra_mb = mem["peak_extra_mb"]
    return [recs[p] for p in PATHS]


def _fmt(x, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def table(records: list[Record]) -> str:
    lines = [f"{'T':>7} {'path':<13} {'backend':<8} {'fwd+bwd ms':>11} {'peak extra MB':>14}  note"]
    for r in records:
        lines.append(f"{r.T:>7} {r.path:<13} {r.backend:<8} {_fmt(r.ms, '11.2f')} "
                     f"{_fmt(r.peak_extra_mb, '14.1f')}  {r.skipped or ''}")
    lines.append("")
    for T in sorted({r.T for r in records}):
        by = {r.path: r for r in records if r.T == T}
        ours, dense, interp = by["integer"].ms, by["dense"].ms, by["interpolated"].ms
        parts = [f"T={T}:"]
        if ours and dense:
            parts.append(f"dense/integer = {dense / ours:.1f}x")
        if ours and by["mask"].ms:
            parts.append(f"mask/integer = {by['mask'].ms / ours:.1f}x")
        if ours and interp:
            parts.append(f"interpolated/integer = {interp / ours:.2f}x")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 1024,4096,16384)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up (median reported)")
    p.add_argument("--json", action="store_true", help="one JSON record per (T, path) on stdout; table on stderr")
    p.add_argument("--memory-check", type=int, default=None, metavar="T",
                   help="run integer forward+backward at this length and report its peak extra memory")
    p.add_argument("--no-memory", action="store_true", help="skip the per-path memory subprocesses")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mask-budget-gb", type=float, default=8.0,
                   help="skip the mask path when its estimated memory (~17 bytes x T^2) exceeds this")


def config_from_args(args) -> BenchConfig:
    if args.lengths is None:
        lengths = [] if args.memory_check else [1024, 4096, 16384]
    else:
        try:
            lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if any(T < 1 for T in lengths):
        raise ValueError(f"--lengths must be >= 1, got {lengths}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.memory_check is not None and args.memory_check < 1:
        raise ValueError(f"--memory-check must be a length >= 1, got {args.memory_check}")
    kv = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads < 1 or kv < 1 or args.heads % kv:
        raise ValueError(f"--heads ({args.heads}) must be a positive multiple of --kv-heads ({kv})")
    if args.head_dim < 1:
        raise ValueError(f"--head-dim must be >= 1, got {args.head_dim}")
    if args.mask_budget_gb <= 0:
        raise ValueError(f"--mask-budget-gb must be > 0, got {args.mask_budget_gb}")
    if not args.device.startswith(("cpu", "cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    return BenchConfig(lengths=lengths, repeats=args.repeats, heads=args.heads, kv_heads=kv,
                       head_dim=args.head_dim, device=args.device, mask_budget_gb=args.mask_budget_gb,
                       memory=not args.no_memory, memory_check=args.memory_check)


def run(args) -> int:
    cfg = config_from_args(args)
    out = sys.stderr if args.json else sys.stdout
    print(f"attention fwd+bwd: B=1 H={cfg.heads} Hkv={cfg.kv_heads} Dh={cfg.head_dim} W={cfg.window} "
          f"fib K={cfg.fib_k} alpha={cfg.alpha} device={cfg.device} threads={torch.get_num_threads()} "
          f"repeats={cfg.repeats}", file=out, flush=True)
    records: list[Record] = []
    for T in cfg.lengths:
        recs = bench_length(cfg, T)
        records += recs
        if args.json:
            for r in recs:
                print(json.dumps(asdict(r)), flush=True)
    if records:
        print(table(records), file=out, flush=True)
    if cfg.memory_check:
        T = cfg.memory_check
        on_cuda = cfg.device.startswith("cuda")
        mem = measure_in_process(cfg, "integer", T) if on_cuda else measure_in_subprocess(cfg, "integer", T)
        rec = Record(T, "integer", backend_name(cfg, "integer"), ms=mem["ms"], peak_extra_mb=mem["peak_extra_mb"])
        verdict = "within" if rec.peak_extra_mb < 2048 else "ABOVE"
        print(f"memory check: integer fwd+bwd at T={T}: peak extra {rec.peak_extra_mb:.1f} MB "
              f"({verdict} the 2 GB goal), one step {rec.ms:.0f} ms, backend {rec.backend}", file=out, flush=True)
        if args.json:
            print(json.dumps({**asdict(rec), "check": "memory"}), flush=True)
    return 0


def _worker(argv: list[str]) -> None:
    """``python -m fibattn.bench.attention CONFIG_JSON PATH T THREADS``: one measurement, one JSON line."""
    cfg_json, path, T, threads = argv
    torch.set_num_threads(int(threads))
    cfg = BenchConfig(**json.loads(cfg_json))
    print(json.dumps(measure_in_process(cfg, path, int(T))))


if __name__ == "__main__":
    _worker(sys.argv[1:])
