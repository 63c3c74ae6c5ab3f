"""``fibattn demo``: train and evaluate the demo grid on the bundled corpus, print the tables."""
from __future__ import annotations

import os

from ..checks import UsageError
from ..files import check_creatable
from ..study import report as Rp
from ..study.controls import control_lines
from ..study.demo import NOTE, RETROFIT_NOTE, extrapolation_lines, forget_runs, headline_lines, retrofit_lines
from ..study.grid import build_grid
from ..study.runner import run_grid


def configure_parser(parser) -> None:
    parser.add_argument("--root", default="runs/demo", metavar="DIR", help="runs folder (default runs/demo)")
    parser.add_argument("--only", default=None, metavar="PATTERNS",
                        help="comma-separated run names or patterns, e.g. dense,fib_stagger")
    parser.add_argument("--fresh", action="store_true", help="delete earlier demo runs under --root first")
    parser.add_argument("--retrofit", action="store_true",
                        help="the retrofit demo: fine-tune the dense demo run to sparse schedules for 5-40 %% of its "
                             "steps, next to the from-scratch runs (reuses the demo's runs under --root)")
    parser.add_argument("--device", default="cpu", help="cpu (default) | auto | cuda | cuda:N")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override for every run (experiments; changes the run identity)")
    parser.add_argument("--jobs", type=int, default=0, metavar="N",
                        help="CPU runs in parallel, one thread each (default: one per core, at most 4; "
                             "1 = one run at a time in this process)")


def cpu_workers(jobs: int, device: str) -> list[str] | None:
    """Worker slots for :func:`run_grid`: ``cpu0..cpuN-1`` on CPU, or None for one run at a time."""
    if jobs < 0:
        raise UsageError(f"--jobs must be >= 0 (0 = auto), got {jobs}")
    if device != "cpu":
        return None
    n = jobs or min(4, os.cpu_count() or 1)
    return [f"cpu{i}" for i in range(n)] if n > 1 else None


def run(args) -> int:
    sets = list(args.set) + [f"train.device={args.device}"]
    grid = build_grid("retrofit" if args.retrofit else "demo", only=args.only, sets=sets)
    root = check_creatable(args.root, "--root")
    cfg = grid.config(next((r for r in grid.runs if not r.init_from), grid.runs[0]), root)   # a from-scratch run
    T, lengths = cfg.model.seq_len, list(cfg.eval.lengths)
    print(f"fibattn demo: {len(grid.runs)} runs ({', '.join(grid.names())}) under {root}\n"
          f"  {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, trained at {T} tokens for "
          f"{cfg.train.steps} steps × {cfg.train.batch_tokens} tokens on the bundled corpus, device "
          f"{cfg.train.device}; evaluated at {', '.join(map(str, lengths))} tokens"
          + (f" (sparse also {', '.join(map(str, cfg.eval.sparse_lengths))})" if cfg.eval.sparse_lengths else "")
          + (f"; dense also {', '.join(cfg.eval.dense_modes)}" if cfg.eval.dense_modes else ""), flush=True)
    if args.fresh:
        removed = forget_runs(grid, root)
        print(f"--fresh: removed {len(removed)} earlier run(s) under {root}" if removed else
              f"--fresh: nothing to remove under {root}", flush=True)
    workers = cpu_workers(args.jobs, args.device)
    if workers:
        print(f"  {len(workers)} runs at a time, one CPU thread each; each run's log is ROOT/RUN/grid.log",
              flush=True)
    summary = run_grid(grid, root, devices=workers)
    files = Rp.build_report(grid, root)
    print()
    shown = ("Retrofit",) if args.retrofit else ("Perplexity at", "Length extrapolation", "Window-only controls")
    for table in files.tables:
        if table.title.startswith(shown):
            print(table.markdown(), end="\n\n")
    if not args.retrofit and files.datasets:
        lines = extrapolation_lines(files.results, files.datasets[0])
        versus = control_lines(Rp.primary([r for r in files.results if r.ppl and not r.mode]), files.datasets[0])
        for block in (lines, ["Would a sliding window of the same cost do as well?"] + versus if versus else []):
            if block:
                print("\n".join(block) + "\n")
    if args.retrofit:
        print("\n".join(retrofit_lines(files)))
    elif files.checks and files.factor:
        print("\n".join(headline_lines(files.checks, files.datasets[0], files.factor, T)))
    else:
        print("Headline check: not available (no run evaluated at 2× or more of the training length)")
    print()
    print((RETROFIT_NOTE if args.retrofit else NOTE).format(T=T, L=max(lengths), steps=cfg.train.steps))
    print()
    print(f"report: {files.markdown}\n        {files.html}")
    for p in files.images:
        print(f"plot:   {p}")
    if summary.failed:
        print(f"{len(summary.failed)} run(s) failed: {', '.join(summary.failed)} (re-run to resume them)")
        return 1
    return 0
