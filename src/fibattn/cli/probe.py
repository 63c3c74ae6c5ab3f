"""``fibattn probe``: the retrieval probe (method.md §5) — train small models, test retrieval."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ..checks import UsageError, parse_int_list
from ..devices import resolve_device
from ..files import check_creatable, check_overwritable
from ..study.probe import ProbeConfig, preset, run_probe


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
    parser.add_argument("--seed", type=int, default=None, help="seed (data and initial weights)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch with --jobs 1 (0: default)")
    parser.add_argument("--jobs", type=int, default=0, help="worker processes, one thread each (0: auto = one per "
                        "core up to the number of models on CPU, 1 on CUDA)")
    parser.add_argument("--out", default="runs/probe", metavar="DIR", help="output folder (default runs/probe)")
    parser.add_argument("--no-plot", action="store_true", help="skip probe.png")


def _ints(text: str, name: str) -> tuple:
    return tuple(parse_int_list(text, name))


def config_from_args(args) -> ProbeConfig:
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


def run(args) -> int:
    cfg = config_from_args(args)
    mine = {"probe.json": '"config"', "probe.md": "# Retrieval probe"}     # how fibattn's own copies begin
    check_overwritable(check_creatable(args.out, "--out"), mine, "--out")
    if args.threads < 0:
        raise UsageError(f"--threads must be an integer >= 0 (0: torch's default), got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    t = cfg.task
    print(f"probe: {len(cfg.depths) * len(cfg.starts)} models | seq_len {t.seq_len} | distances {list(t.distances)}"
          f" | {'marked' if t.marked else 'plain'} | {cfg.steps} steps × {cfg.batch_size} | out {args.out}",
          flush=True)
    t0 = time.perf_counter()
    report = run_probe(cfg, args.out, plot=not args.no_plot, echo=lambda s: print(s, flush=True), jobs=args.jobs)
    print()
    print(report.table())
    print()
    print(report.alpha_table())
    for line in report.summary():
        print(line)
    print(f"total {time.perf_counter() - t0:.0f}s; wrote {Path(args.out) / 'probe.json'}")
    return 0
