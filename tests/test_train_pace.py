"""Signs of life for long training (issue 60 item 2): before the first step, what a step costs on this device
and a warning when the run would take days here, with what to use instead; a line after a slow step until the
progress lines take over, and at least one a minute. Step times and rates are faked: nothing slow runs."""
import torch

from fibattn.trainer.logs import fmt_duration
from fibattn.trainer.pace import DAYS, Pace, estimate_lines

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_a_paper_size_run_on_a_cpu_is_told_up_front_that_it_takes_days():
    # the paper preset: 12 TFLOP a step, 13000 steps; a CPU measured at 42 GFLOP/s
    lines, warned = estimate_lines(13000, 12e12, CPU, None, rate=lambda: 42e9)
    assert warned and len(lines) == 2
    assert "each step takes at least 286 s on cpu" in lines[0]
    assert lines[1].startswith("fibattn: WARNING: this run would take 42d") and "sized for a GPU" in lines[1]
    assert "--device cuda" in lines[1] and "--preset tiny" in lines[1]


def test_a_small_run_measures_nothing_and_says_nothing():
    def boom():
        raise AssertionError("the CPU's rate is measured only for a large run")
    assert estimate_lines(400, 4096 * 4.6e6, CPU, None, rate=boom) == ([], False)     # the tiny preset
    assert estimate_lines(13000, 12e12, CUDA, 989e12) == ([], False)                  # paper on an H200
    assert estimate_lines(13000, 12e12, CUDA, None) == ([], False)                    # an unknown card: measured later


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_slow_first_step_gets_its_line_with_the_step_time_and_eta_and_days_are_warned_once():
    clock = Clock()
    pace = Pace(13000, 10, CPU, clock=clock)
    clock.t = 106
    out = pace.after(1, 106.0, 106.0 * 12999, logged=False)
    assert len(out) == 2 and "WARNING" in out[0] and "measured: 106.0 s a step" in out[0]
    assert out[1] == f"step 1/13000: 106.0 s a step (the first of this run: warm-up included) | eta " \
                     f"{fmt_duration(106.0 * 12999)}"
    clock.t += 106
    assert len(pace.after(2, 106.0, 106.0 * 12998, logged=False)) == 1          # a minute passed: the heartbeat
    assert not any("WARNING" in x for x in pace.after(10, 106.0, 1e6, logged=True))   # warned once


def test_fast_steps_print_nothing_between_progress_lines_and_a_minute_never_passes_silently():
    clock = Clock()
    pace = Pace(400, 25, CPU, clock=clock)
    for step in range(1, 25):
        clock.t += 0.05
        assert pace.after(step, 0.05, 20.0, logged=False) == []
    assert pace.after(25, 0.05, 20.0, logged=True) == []
    clock.t += 61
    assert pace.after(26, 0.05, 20.0, logged=False)[0].startswith("step 26/400: 0.1 s a step | eta 20s")


def test_a_compiled_first_step_does_not_warn_from_its_compile_time():
    clock = Clock()
    pace = Pace(13000, 10, CUDA, compiled=True, clock=clock)
    assert not any("WARNING" in x for x in pace.after(1, 90.0, 90.0 * 12999, logged=False))
    assert any("WARNING" in x for x in pace.after(2, 30.0, 30.0 * 12998, logged=False))
    assert "more GPUs" in [x for x in Pace(9, 1, CUDA).after(1, 1.0, DAYS, False) if "WARNING" in x][0]


def test_durations_of_days_read_as_days():
    assert fmt_duration(16 * 86400 + 3 * 3600) == "16d03h" and fmt_duration(5400) == "1h30m"
