"""``fibattn report``: the tables and plots of a grid, next to the study's numbers."""
from __future__ import annotations

from pathlib import Path

from ..files import check_creatable, check_overwritable
from ..study.grid import GRIDS, build_grid
from ..study.report import build_report


def configure_parser(parser) -> None:
    parser.add_argument("grid", metavar="NAME", help=f"grid name: {', '.join(GRIDS)}")
    parser.add_argument("--root", default=None, metavar="DIR", help="runs folder (default runs/NAME)")
    parser.add_argument("--out", default=None, metavar="DIR", help="report folder (default ROOT/report; "
                        "retrofit: ROOT/report-retrofit)")
    parser.add_argument("--only", default=None, metavar="PATTERNS", help="comma-separated run name patterns")
    parser.add_argument("--extend", default=None, metavar="FILE.json", help="the extension file the grid ran with")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the grid's --set overrides")
    parser.add_argument("--datasets", default=None, help="comma-separated validation splits for the tables "
                        "(default: fineweb_edu,wikipedia when present, else every split)")
    parser.add_argument("--no-plot", action="store_true", help="tables only")


def run(args) -> int:
    grid = build_grid(args.grid, only=args.only, extend=args.extend, sets=args.set)
    root = Path(args.root or f"runs/{args.grid}")
    if not root.is_dir():
        hint = " (`fibattn demo --retrofit` writes under runs/demo: pass --root runs/demo)" if args.grid == "retrofit" else ""
        raise FileNotFoundError(f"--root {root} does not exist; run `fibattn grid {args.grid} --root {root}` first"
                                + hint)
    out = check_creatable(args.out or root / grid.report_dir, "--out")
    check_overwritable(out, {"report.md": "# fibattn report", "report.html": "fibattn report"}, "--out")
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()] if args.datasets else None
    files = build_report(grid, root, out, datasets=datasets, plot=not args.no_plot)
    for t in files.tables:
        print(t.markdown(), end="\n\n")
    print(f"report: {files.markdown}\n        {files.html}")
    for p in files.images:
        print(f"plot:   {p}")
    return 0
