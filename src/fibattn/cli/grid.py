"""``fibattn grid``: run an experiment grid (or print its torchrun / Slurm commands)."""
from __future__ import annotations


from ..checks import UsageError
from ..files import check_creatable
from ..study import runner as R
from ..study.commands import commands
from ..study.grid import GRIDS, build_grid


def parse_devices(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [d.strip() for d in text.split(",") if d.strip()]
    if not items or not all(d.isdigit() for d in items):
        raise UsageError(f"--devices must be a comma-separated list of GPU indices like 0,1,2,3, got {text!r}")
    if len(set(items)) != len(items):
        raise UsageError(f"--devices lists a GPU twice: {text!r}")
    return items


def configure_parser(parser) -> None:
    parser.add_argument("grid", metavar="NAME", help=f"grid name: {', '.join(GRIDS)}")
    parser.add_argument("--only", default=None, metavar="PATTERNS", help="comma-separated name patterns, e.g. 'fib_*_w12'")
    parser.add_argument("--extend", default=None, metavar="FILE.json", help="extra runs: a JSON list of "
                        "{name, preset, overrides, seed}")
    parser.add_argument("--root", default=None, metavar="DIR", help="runs folder (default runs/NAME)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every run, e.g. data.out_dir=/scratch/paper (repeat)")
    parser.add_argument("--devices", default=None, metavar="0,1,...", help="run one run per GPU in parallel")
    parser.add_argument("--print-commands", choices=("torchrun", "slurm"), default=None,
                        help="print torchrun commands or a Slurm array script instead of running")
    parser.add_argument("--gpus-per-run", type=int, default=1, metavar="N", help="torchrun/slurm: GPUs per run")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; run nothing")
    parser.add_argument("--prepare-only", action="store_true", help="prepare the runs' data, then stop")


def run(args) -> int:
    grid = build_grid(args.grid, only=args.only, extend=args.extend, sets=args.set)
    root = check_creatable(args.root or f"runs/{args.grid}", "--root")
    if args.gpus_per_run < 1:
        raise UsageError(f"--gpus-per-run must be >= 1, got {args.gpus_per_run}")
    if args.print_commands:
        print(commands(grid, root, args.print_commands, gpus=args.gpus_per_run, only=args.only), end="")
        return 0
    devices = parse_devices(args.devices)
    if args.dry_run:
        print(R.describe(grid, root))
        return 0
    if args.prepare_only:
        R.prepare_data(R.states(grid, root))
        return 0
    summary = R.run_grid(grid, root, devices=devices)
    return 0 if not summary.failed else 1
