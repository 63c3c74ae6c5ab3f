"""``fibattn bench op``: the op's forward + backward timed so that host time cannot hide in kernel time (issues 54
and 56), beside the best dense SDPA kernel on the device.

For each path (``integer``, ``interpolated``, ``integer-docs``; ``bench attention``'s settings: B 4, H 8, Hkv 2,
Dh 64, W 12, fib:15 at alpha 1.5, bf16 on CUDA) and length:

- ``graph_ms``: one forward + backward captured in a CUDA graph and replayed ``--iters`` times between CUDA
  events: the device's time alone (what the kernels cost);
- ``eager_ms``: the same call made eagerly ``--iters`` times between events: device time plus whatever host time
  the device waits for (a host-bound op shows eager ≫ graph);
- ``forward_graph_ms`` (``forward_eager_ms`` on a CPU): the forward alone, so that the backward's share is seen
  (issue 56 item 1: the backward at most 3× the forward at 4K);
- the dense path: every SDPA backend that runs (cuDNN, flash, efficient), each replayed from a graph, and the
  fastest named: the fair baseline; ratios are taken against it.

``host_us``: the host's own time per eager forward + backward at T = ``--host-length`` (256), where the kernels
take microseconds: calls issued back to back for ``--iters`` rounds without a sync, the best round's wall time per
call (the device never makes the host wait). On a CPU (plumbing only) everything is wall time of the ``cpu``
backend and no graph is captured.
"""
from __future__ import annotations

import json
import statistics
import time
import warnings

import torch
from torch.nn.attention import sdpa_kernel

from ..checks import UsageError, int_flag, parse_int_list
from ..devices import resolve_device
from .attention_paths import SDPA_BY_NAME, BenchConfig, make_step

PATHS = ("integer", "interpolated", "integer-docs")
DENSE = ("cudnn", "flash", "efficient")


def configure_parser(parser) -> None:
    parser.add_argument("--device", default="auto", help="cuda | cuda:N | cpu (plumbing) | auto")
    parser.add_argument("--lengths", default="4096,16384,65536", help="sequence lengths T")
    parser.add_argument("--iters", type=int_flag(2, 10000), default=50, help="calls timed per figure (default 50)")
    parser.add_argument("--host-length", type=int_flag(16, 1 << 16), default=256,
                        help="T of the host-time figure (default 256)")
    parser.add_argument("--batch", type=int_flag(1, 1024), default=4, help="B (default 4)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _config(device: str, batch: int, paths) -> BenchConfig:
    cuda = device.startswith("cuda")
    return BenchConfig(device=device, batch=batch, heads=8, kv_heads=2, head_dim=64, documents=8, memory=False,
                       dtype="bfloat16" if cuda else "float32", paths=list(paths))


def _events_ms(run, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _graphed(step):
    """``step`` captured in a CUDA graph (after warm-up calls on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _wall_ms(run, iters: int) -> float:
    run()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_path(cfg: BenchConfig, path: str, T: int, iters: int) -> dict:
    cuda = cfg.on_cuda
    if path == "dense":
        got = {}
        for name in DENSE if cuda else ("math",):
            def step(name=name, run=make_step(cfg, "dense", T)):
                with sdpa_kernel([SDPA_BY_NAME[name]]):
                    run()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got[name] = _events_ms(_graphed(step), iters) if cuda else _wall_ms(step, iters)
            except (RuntimeError, NotImplementedError):        # no kernel of this backend for these inputs
                continue
        if not got:
            raise RuntimeError(f"dense SDPA: no backend runs T={T}")
        best = min(got, key=got.get)
        return {"path": "dense", "T": T, "graph_ms" if cuda else "eager_ms": got[best], "backend": best,
                "backends_ms": got}
    step, fwd = make_step(cfg, path, T), make_step(cfg, path, T, backward=False)
    if not cuda:
        return dict(path=path, T=T, eager_ms=_wall_ms(step, iters), forward_eager_ms=_wall_ms(fwd, iters))
    eager = _events_ms(step, iters)
    return dict(path=path, T=T, eager_ms=eager, graph_ms=_events_ms(_graphed(step), iters),
                forward_graph_ms=_events_ms(_graphed(fwd), iters))


def host_us(cfg: BenchConfig, path: str, T: int, iters: int, calls: int = 20) -> float:
    """The host's time per eager forward + backward (µs): ``calls`` back to back per round, the best round."""
    step = make_step(cfg, path, T)
    step()
    best = float("inf")
    for _ in range(iters):
        if cfg.on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, time.perf_counter() - t0)
        if cfg.on_cuda:
            torch.cuda.synchronize()
    return best / calls * 1e6


def ratios(records: list[dict]) -> dict:
    """dense ÷ integer (graph replay), interpolated ÷ integer and documents ÷ plain per length; each op's backward
    ÷ its forward."""
    at = {(r["path"], r["T"]): r for r in records}
    key = "graph_ms" if all("graph_ms" in r for r in records) else "eager_ms"
    out = {}
    for T in sorted({r["T"] for r in records}):
        base = at.get(("integer", T))
        if base is None:
            continue
        for path, name in (("dense", "dense/integer"), ("interpolated", "interpolated/integer"),
                           ("integer-docs", "documents/integer")):
            other = at.get((path, T))
            if other is not None and key in other:
                out[f"{name} fwd+bwd at {T}"] = other[key] / base[key]
        for path in ("integer", "interpolated"):
            r = at.get((path, T))
            if r is not None and r.get(f"forward_{key}"):
                out[f"{path} backward/forward at {T}"] = (r[key] - r[f"forward_{key}"]) / r[f"forward_{key}"]
    return out


def run(args) -> int:
    device = str(resolve_device(args.device, flag="--device"))
    lengths = parse_int_list(args.lengths, "--lengths", minimum=16)
    cfg = _config(device, args.batch, PATHS)
    from ..validation import check_sizes_fit
    item = 2 if cfg.on_cuda else 4
    check_sizes_fit("--lengths", lengths, lambda T: 12 * args.batch * 8 * T * 64 * item, "the op's inputs, outputs "
                    f"and gradients (B {args.batch}, H 8, Dh 64)", device)
    if not cfg.on_cuda and max(lengths) > 1 << 14:
        raise UsageError(f"--lengths {args.lengths}: on a CPU this bench is plumbing only; use lengths <= 16384 "
                         "or --device cuda")
    records = []
    for T in lengths:
        for path in ("dense",) + PATHS:
            records.append(time_path(cfg, path, T, args.iters))
    host = {path: host_us(cfg, path, args.host_length, min(args.iters, 20)) for path in PATHS}
    doc = dict(settings=dict(device=device, lengths=lengths, iters=args.iters, batch=args.batch, heads=8,
                             kv_heads=2, head_dim=64, dtype=cfg.dtype, host_length=args.host_length),
               results=records, host_us=host, ratios=ratios(records))
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{'path':>14} {'T':>7} {'graph ms':>10} {'eager ms':>10} {'forward ms':>11}  dense backend")
    def ms(x) -> str:
        return "-" if x is None else f"{x:.3f}"
    for r in records:
        fwd = r.get("forward_graph_ms", r.get("forward_eager_ms"))
        print(f"{r['path']:>14} {r['T']:>7} {ms(r.get('graph_ms')):>10} {ms(r.get('eager_ms')):>10} {ms(fwd):>11}  "
              f"{r.get('backend', '')}")
    for path, us in host.items():
        print(f"host time per eager forward + backward, {path} at T={args.host_length}: {us:.0f} µs")
    for name, value in doc["ratios"].items():
        print(f"  {name:<40} {value:.2f}")
    return 0
