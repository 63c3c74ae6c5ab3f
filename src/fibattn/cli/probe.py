"""``fibattn probe``: the retrieval probe (method.md §5) — train small models, test retrieval.

``--extrapolate``: retrieval past the window and the training length (:mod:`fibattn.study.probe_extrapolate`)."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from ..checks import UsageError, check_int, int_flag, parse_int_list
from ..devices import resolve_device
from ..files import check_creatable, check_overwritable
from ..study import probe_extrapolate as PX
from ..study.probe import MAX_SEED as PROBE_SEED_MAX
from ..study.probe import ProbeConfig, preset, run_probe
from ..study.probe_extrapolate_report import TITLE, run_extrapolate
from ..threads import use_threads

PLAIN_ONLY = ("starts", "distances", "marked")          # flags of the plain probe that --extrapolate refuses


def configure_parser(parser) -> None:
    parser.add_argument("--preset", default="tiny",
                        help="tiny (default; also: cpu): minutes on a laptop CPU | paper (also: study): the study's "
                             "setting")
    parser.add_argument("--depths", default=None, help="comma-separated depths (default 2,4,8)")
    parser.add_argument("--starts", default=None, help="uniform,staggered (default both)")
    parser.add_argument("--distances", default=None, help="comma-separated distances (default: the preset's)")
    parser.add_argument("--marked", action="store_true", default=None, help="marked variant: one model, all distances")
    parser.add_argument("--seq-len", type=int, default=None, help="sample length (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per step")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--seed", type=int_flag(0, PROBE_SEED_MAX), default=None, help="seed (data and initial weights)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch with --jobs 1 (0: the cores free now)")
    parser.add_argument("--jobs", type=int, default=0, help="worker processes, one thread each (0: auto = one per "
                        "core up to the number of models on CPU, 1 on CUDA)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="output folder (default runs/probe, with --extrapolate runs/probe-extrapolate)")
    parser.add_argument("--no-plot", action="store_true", help="skip probe.png (probe_extrapolate.png)")
    parser.add_argument("--extrapolate", action="store_true",
                        help="retrieval past the training length: fib linear, fib fixed, window_matched and dense "
                             "trained at --seq-len, tested at each --factors multiple of it (--depths: one value, "
                             "the layers)")
    parser.add_argument("--factors", default=None, help="--extrapolate: evaluation lengths as multiples of the "
                        "training length (default 1,4,16)")
    parser.add_argument("--variants", default=None, help="--extrapolate: comma-separated among "
                        f"{','.join(PX.VARIANTS)} (default all)")
    parser.add_argument("--reach", default=None, help="--extrapolate: study (distances rebuilt at the evaluation "
                        "length, default) | train (capped at the training length); method.md §1")


def _ints(text: str, name: str) -> tuple:
    return tuple(parse_int_list(text, name))


def config_from_args(args) -> ProbeConfig:
    if getattr(args, "extrapolate", False):
        return extrapolate_config(args)
    for flag in ("factors", "variants", "reach"):
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag} applies to --extrapolate only, got --{flag} {getattr(args, flag)!r}")
    cfg = preset(args.preset)
    task_kw = {}
    if args.distances:
        task_kw["distances"] = _ints(args.distances, "--distances")
    if args.marked:
        task_kw["marked"] = True
    if args.seq_len is not None:
        task_kw["seq_len"] = args.seq_len
    if task_kw:
        cfg.task = dataclasses.replace(cfg.task, **task_kw)
    if args.depths:
        cfg.depths = _ints(args.depths, "--depths")
    if args.starts:
        cfg.starts = tuple(s.strip() for s in args.starts.split(",") if s.strip())
    for name in ("steps", "batch_size", "lr", "seed"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.device = str(resolve_device(args.device))
    return cfg.validate()


def extrapolate_config(args) -> PX.ExtrapolateConfig:
    """The ``--extrapolate`` settings: the preset, then the flags that apply to it."""
    for flag in PLAIN_ONLY:
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} does not apply to --extrapolate (it trains on every distance 1..T-2), "
                             f"got --{flag} {getattr(args, flag)!r}")
    cfg = PX.preset(args.preset)
    if args.depths:
        depths = _ints(args.depths, "--depths")
        if len(depths) != 1:
            raise UsageError(f"--depths takes one value with --extrapolate (the layers of every variant), "
                             f"got {args.depths!r}")
        cfg.n_layers = depths[0]
    if args.factors:
        cfg.factors = _ints(args.factors, "--factors")
    if args.variants:
        cfg.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if args.reach is not None:
        cfg.reach = args.reach
    for name in ("seq_len", "steps", "batch_size", "lr", "seed"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.device = str(resolve_device(args.device))
    return cfg.validate()


def _threads(args) -> None:
    use_threads(args.threads, "--threads")


def _show(tables: list[str], summary: list[str]) -> None:
    """The result tables, a blank line apart, then the summary lines (stdout)."""
    print("\n\n".join(tables))
    print("\n".join(summary))


def run_extrapolate_cli(args) -> int:
    """``--extrapolate``: progress on stderr, the tables on stdout."""
    cfg = config_from_args(args)
    out = args.out or "runs/probe-extrapolate"
    mine = {"probe_extrapolate.json": '"config"', "probe_extrapolate.md": TITLE}    # how fibattn's own copies begin
    check_overwritable(check_creatable(out, "--out"), mine, "--out")
    _threads(args)
    check_int("--jobs", args.jobs, 0)

    def err(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    err(f"probe --extrapolate: {len(cfg.variants)} models | T {cfg.seq_len} | lengths {cfg.lengths} | "
        f"{cfg.n_layers} layers | {cfg.steps} steps × {cfg.batch_size} | out {out}")
    t0 = time.perf_counter()
    report = run_extrapolate(cfg, out, plot=not args.no_plot, echo=err, jobs=args.jobs)
    _show([report.accuracy_table(), report.reach_table()], report.summary())
    err(f"total {time.perf_counter() - t0:.0f}s; wrote {Path(out) / 'probe_extrapolate.json'}")
    return 0


def run(args) -> int:
    if args.extrapolate:
        return run_extrapolate_cli(args)
    cfg = config_from_args(args)
    args.out = args.out or "runs/probe"
    mine = {"probe.json": '"config"', "probe.md": "# Retrieval probe"}     # how fibattn's own copies begin
    check_overwritable(check_creatable(args.out, "--out"), mine, "--out")
    _threads(args)
    t = cfg.task
    print(f"probe: {len(cfg.depths) * len(cfg.starts)} models | seq_len {t.seq_len} | distances {list(t.distances)}"
          f" | {'marked' if t.marked else 'plain'} | {cfg.steps} steps × {cfg.batch_size} | out {args.out}",
          flush=True)
    t0 = time.perf_counter()
    report = run_probe(cfg, args.out, plot=not args.no_plot, echo=lambda s: print(s, flush=True), jobs=args.jobs)
    print()
    _show([report.table(), report.alpha_table()], report.summary())
    print(f"total {time.perf_counter() - t0:.0f}s; wrote {Path(args.out) / 'probe.json'}")
    return 0
