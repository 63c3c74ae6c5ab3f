"""Scheduler scripts for a grid: ``fibattn grid NAME --print-commands torchrun|slurm`` (one command
or one Slurm array task per run; each re-reads the grid by name and runs it with ``--only``)."""
from __future__ import annotations

import shlex
from pathlib import Path

from ..checks import UsageError
from .grid import Grid


def _cd_line() -> str:
    return f"cd {shlex.quote(str(Path.cwd()))}"


def _grid_args(grid: Grid, root: Path) -> str:
    args = ["--root", str(root.resolve())]
    if grid.extend_file:
        args += ["--extend", grid.extend_file]
    for item in grid.sets:
        args += ["--set", item]
    return " ".join(shlex.quote(a) for a in args)


def _launcher(gpus: int) -> str:
    return (f"torchrun --standalone --nproc_per_node={gpus} -m fibattn.cli" if gpus > 1
            else "python -m fibattn.cli")


def commands(grid: Grid, root, kind: str, *, gpus: int = 1, only: str | None = None) -> str:
    """``torchrun`` commands (one per run) or a Slurm array script for ``grid``."""
    root = Path(root)
    for r in grid.runs:                  # context parallelism splits each run's processes into groups of P
        P = grid.config(r, root).train.context_parallel
        if gpus % P:
            raise UsageError(f"--gpus-per-run {gpus}: run {r.name} sets train.context_parallel={P}; the processes "
                             f"of a run must be a multiple of it")
    extra = _grid_args(grid, root)
    names = grid.names()
    prep = f"python -m fibattn.cli grid {grid.name} {extra} --prepare-only" + (
        f" --only {shlex.quote(only)}" if only else "")
    if kind == "torchrun":
        lines = [f"# fibattn grid {grid.name}: {len(names)} runs under {root.resolve()}; each command trains with "
                 f"DDP on {gpus} GPU(s), evaluates on rank 0 and records the run; re-running skips finished runs.",
                 f"# prepare the data once first: {prep}", _cd_line()]
        for r in grid.runs:
            lines.append(f"# {r.name}: preset {r.preset}, seed {r.seed}: {' '.join(r.overrides)}")
            lines.append(f"torchrun --standalone --nproc_per_node={gpus} -m fibattn.cli grid {grid.name} {extra} "
                         f"--only {r.name}")
        return "\n".join(lines) + "\n"
    if kind != "slurm":
        raise UsageError(f"--print-commands must be torchrun or slurm, got {kind!r}")
    logs = root.resolve() / "slurm"
    lines = ["#!/bin/bash",
             f"# fibattn grid {grid.name}: one Slurm array task per run ({len(names)} runs) under {root.resolve()}.",
             f"# Prepare the data once before submitting: {prep}",
             f"# Create the log folder first: mkdir -p {shlex.quote(str(logs))}",
             "# Resubmitting skips finished runs; an interrupted run resumes from its newest checkpoint.",
             "# Add --time / --partition / --account lines for your cluster.",
             f"#SBATCH --job-name=fibattn-{grid.name}",
             f"#SBATCH --array=0-{len(names) - 1}",
             "#SBATCH --nodes=1", "#SBATCH --ntasks=1", f"#SBATCH --gpus={gpus}",
             f"#SBATCH --cpus-per-task={8 * gpus}",
             f"#SBATCH --output={logs}/%x-%A_%a.out",
             "#SBATCH --signal=TERM@120      # training checkpoints and stops on SIGTERM",
             "set -euo pipefail", _cd_line(), "RUNS=(", *[f"  {n}" for n in names], ")",
             'RUN="${RUNS[$SLURM_ARRAY_TASK_ID]}"',
             f'{_launcher(gpus)} grid {grid.name} {extra} --only "$RUN"']
    return "\n".join(lines) + "\n"
