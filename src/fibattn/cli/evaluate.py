"""``fibattn eval``: perplexity of a run across lengths on its validation splits."""
from __future__ import annotations

import argparse
import os

from ..checks import UsageError, parse_int_list
from ..eval.modes import SCALING_KINDS
from ..eval.run_folder import evaluate_run
from ..storage.runs import parse_step
from ..threads import use_threads


def configure_parser(parser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run folder, one of its checkpoints/step-N folders, or an "
                        "export folder (then --data is required)")
    parser.add_argument("--step", default="latest", help="checkpoint step (default: the newest complete one)")
    parser.add_argument("--lengths", default=None, help="comma-separated lengths (default: the run's eval.lengths)")
    parser.add_argument("--datasets", default=None, help="comma-separated validation splits (default: all)")
    parser.add_argument("--tokens", type=int, default=None, help="token budget per split (default: eval.tokens)")
    parser.add_argument("--reach", default=None, help="study (rebuild distances at the evaluation length) | "
                        "train (cap at the training length); default: eval.reach")
    parser.add_argument("--mode", default=None, help="evaluation mode (method.md §7): none (default) | linear | ntk | "
                        "yarn (RoPE scaling, any model) | window (dense model: sliding window of the training length)")
    parser.add_argument("--rope-factor", type=float, default=None, metavar="F",
                        help="RoPE scaling factor >= 1 (default: evaluation length / training length, at least 1)")
    # earlier spellings of --mode: refused with the --mode to use (one flag for one choice)
    parser.add_argument("--rope-scaling", dest="_rope_scaling", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dense-window", dest="_dense_window", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--document-masking", action=argparse.BooleanOptionalAction, default=None,
                        help="score each document of a window on its own, its <eos> ending it (default: "
                        "eval.document_masking); results get the mode suffix +docs")
    parser.add_argument("--context-parallel", type=int, default=1, metavar="P",
                        help="under torchrun with P processes: each computes 1/P of every window (method.md §9)")
    parser.add_argument("--batch-size", type=int, default=None, help="windows per forward (default: eval.batch_size)")
    parser.add_argument("--buckets", type=int, default=32, help="per-position loss buckets (default 32)")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (default: the run's train.device)")
    parser.add_argument("--precision", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="prepared data folder (default: the run's data.out_dir)")
    parser.add_argument("--json", default=None, metavar="OUT", help="JSON file to merge into (default: RUN/eval.json)")
    parser.add_argument("--db", default="", metavar="PATH|off", help="results DB (default: the run's)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the cores free now)")


def _refuse_old_mode_flags(args) -> None:
    if getattr(args, "_rope_scaling", None) is not None:
        kind = args._rope_scaling
        use = f"--mode {kind}" if kind in SCALING_KINDS else "--mode none|linear|ntk|yarn"
        raise UsageError(f"--rope-scaling {kind} is not an eval flag any more; use {use} (one --mode picks RoPE "
                         f"scaling or the dense window)")
    if getattr(args, "_dense_window", False):
        raise UsageError("--dense-window is not an eval flag any more; use --mode window")


def run(args) -> int:
    _refuse_old_mode_flags(args)
    lengths = parse_int_list(args.lengths, "--lengths") if args.lengths else None
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()] if args.datasets else None
    if args.tokens is not None and args.tokens < 1:
        raise UsageError(f"--tokens must be an integer >= 1, got {args.tokens}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    if args.buckets < 1:
        raise UsageError(f"--buckets must be an integer >= 1, got {args.buckets}")
    use_threads(args.threads, "--threads", max(1, args.context_parallel))
    report = evaluate_run(args.run, step=parse_step(args.step), lengths=lengths, datasets=datasets,
                          tokens=args.tokens, reach=args.reach, mode=args.mode, rope_factor=args.rope_factor,
                          batch_size=args.batch_size, device=args.device, precision=args.precision, data=args.data,
                          json_out=args.json, db=args.db, plot=not args.no_plot, buckets=args.buckets,
                          document_masking=args.document_masking, context_parallel=args.context_parallel)
    if args.context_parallel > 1 and os.environ.get("RANK", "0") != "0":
        return 0                                 # the group's first process prints and writes
    s = report.settings
    print(f"run {s['run']} step {s['step']} | mode {s['mode']} | train length {s['train_len']} | "
          f"device {s['device']} | precision {s['precision']}")
    if "scaling_note" in s:
        print(s["scaling_note"])
    print(report.table())
    for line in report.fairness_lines():
        print(line)
    if "alpha_report" in s:
        print()
        print(s["alpha_report"])
    print(f"wrote {s['json']}" + (f"\nplot: {s['plot']}" if "plot" in s else ""))
    return 0
