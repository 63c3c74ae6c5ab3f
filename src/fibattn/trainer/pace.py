"""Signs of life for long training: what the run will cost on this device before its first step, a line
after each slow step until the progress lines take over, and a warning up front when the run would take days
here, saying what to use instead (issue 60: a paper-preset run on a CPU printed nothing for 90 s, one step
took 106 s, and nothing said the run would take 16 days)."""
from __future__ import annotations

import time

import torch

from .logs import fmt_duration

DAYS = 86400.0              # a run this long on this device is said so up front
SHOW_AFTER_S = 10.0         # a step that leaves the next progress line further away than this gets its own line
HEARTBEAT_S = 60.0          # never longer than this without a line while steps end
CPU_CEILING = 5e12          # FLOP/s no CPU reaches in fp32 torch: below total / CEILING of an hour nothing is measured


def cpu_matmul_rate(n: int = 512, rounds: int = 3) -> float:
    """fp32 matmul FLOP/s of this CPU on torch's current threads (the best of ``rounds``, ~0.1 s)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / max(best, 1e-9)


def instead(device: torch.device) -> str:
    """What to use instead of a run that takes days on ``device``."""
    if device.type == "cpu":
        return ("it is sized for a GPU: train on one (--device cuda; docs/gpu.md), or on this CPU use --preset tiny "
                "(minutes) or fewer train.steps")
    return "use fewer train.steps, a smaller model, or more GPUs (torchrun --nproc-per-node N)"


def estimate_lines(steps_left: int, flops_per_step: float, device: torch.device, peak: float | None,
                   rate=cpu_matmul_rate) -> tuple[list[str], bool]:
    """Before the first step: the least time a step can take on ``device`` (its FLOPs at the device's peak, or
    on a CPU at its measured matmul rate) when that is long, and a warning when the run would take days; and
    whether that warning was given. ``rate``: the CPU's FLOP/s (a function, measured only for a large run)."""
    total = flops_per_step * steps_left
    if device.type == "cpu":
        if total / CPU_CEILING < 3600:          # short whatever the CPU: nothing to measure or say
            return [], False
        speed, how = rate(), "this CPU's measured fp32 matmul rate"
    elif peak:
        speed, how = peak, "the device's peak"
    else:
        return [], False
    step_s = flops_per_step / speed
    lines = []
    if step_s >= SHOW_AFTER_S / 2:
        lines.append(f"fibattn: each step takes at least {step_s:.0f} s on {device.type} ({flops_per_step:.3g} FLOP at "
                     f"{how}, {speed / 1e9:.0f} GFLOP/s); a line follows each slow step until the progress lines do")
    warned = steps_left * step_s >= DAYS
    if warned:
        lines.append(eta_warning(steps_left * step_s, device, "at least, from its FLOPs"))
    return lines, warned


def eta_warning(eta_s: float, device: torch.device, how: str) -> str:
    return (f"fibattn: WARNING: this run would take {fmt_duration(eta_s)} on {device.type} ({how}); "
            f"{instead(device)}")


class Pace:
    """Decides, after each step, whether a line goes out between the progress lines: after a slow first step,
    then whenever ``HEARTBEAT_S`` passed without one; and the measured ETA's warning, once, when the run would
    take days (after a compiled model's first step, whose compile time would overstate it)."""

    def __init__(self, total: int, log_every: int, device: torch.device, warned: bool = False,
                 compiled: bool = False, clock=time.monotonic):
        self.total, self.log_every, self.device = total, log_every, device
        self.warned, self.compiled, self.clock = warned, compiled, clock
        self.last = clock()
        self.seen = 0                        # steps of this process

    def shown(self) -> None:
        """A line went out (a progress line): the heartbeat counts from now."""
        self.last = self.clock()

    def after(self, step: int, dt: float, eta_s: float, logged: bool) -> list[str]:
        """Lines to print after ``step`` took ``dt`` s (``eta_s``: the rest at the current pace; ``logged``: a
        progress line goes out for this step anyway)."""
        self.seen += 1
        out = []
        measured = self.seen > (1 if self.compiled else 0)
        if measured and not self.warned and eta_s >= DAYS:
            self.warned = True
            out.append(eta_warning(eta_s, self.device, f"measured: {dt:.1f} s a step"))
        if logged:
            self.shown()
            return out
        to_next = (self.log_every - step % self.log_every) * dt
        first = self.seen == 1 and to_next > SHOW_AFTER_S
        if first or self.clock() - self.last >= HEARTBEAT_S:
            what = " (the first of this run: warm-up included)" if self.seen == 1 else ""
            out.append(f"step {step}/{self.total}: {dt:.1f} s a step{what} | eta {fmt_duration(eta_s)}")
        if out:
            self.shown()
        return out
