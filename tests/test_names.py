"""One vocabulary for runs in outputs and the README, and runs counted as runs (issue 28 item 6)."""
import re
from pathlib import Path

from fibattn.study import grid as G
from fibattn.study.labels import evaluated_count, set_labels
from fibattn.study.report import BASELINE_LABELS, RunResult, variant_of

README = Path(__file__).resolve().parents[1] / "README.md"


def rr(name, variant, window, seed=42, mode="", ppl=True):
    return RunResult(name, variant, window, seed, 32, ppl={("s", 32): 5.0} if ppl else {}, mode=mode)


def test_labels_are_the_titles_made_unique():
    results = [rr("dense", "dense", None), rr("dense + YaRN", "dense+yarn", None, mode="yarn"),
               rr("fib_hdc", "coprime", 6), rr("logsparse", "pow2+fixed", 6), rr("fib_stagger_w8", "linear", 8),
               rr("fib_stagger_w12", "linear", 12), rr("fib_stagger_w12_s43", "linear", 12, seed=43),
               rr("mine", "custom", 6), rr("window_matched", "window", 8)]
    set_labels(results)
    assert [r.label for r in results] == [
        "dense", "dense + YaRN", "fib coprime (HDC)", "pow2 fixed", "fib linear (stagger), W=8",
        "fib linear (stagger), W=12, seed 42", "fib linear (stagger), W=12, seed 43", "mine", "window (matched cost)"]
    twins = [rr("a", "fixed", 6), rr("b", "fixed", 6)]       # same variant, window and seed: the run names
    set_labels(twins)
    assert [r.label for r in twins] == ["a", "b"]


def test_dense_modes_are_not_counted_as_runs():
    results = [rr("dense", "dense", None), rr("fib_fixed", "fixed", 6), rr("fib_hdc", "coprime", 6, ppl=False),
               rr("dense + YaRN", "dense+yarn", None, mode="yarn"), rr("dense + RoPE NTK", "dense+ntk", None, mode="ntk")]
    assert evaluated_count(results) == "2 of 3 runs evaluated (the dense runs also in 2 evaluation modes)"
    assert evaluated_count(results[:3]) == "2 of 3 runs evaluated"


def test_the_readme_demo_table_uses_the_names_the_demo_prints(tmp_path):
    text = README.read_text()
    section = text[text.index("## What `fibattn demo` shows"):]
    rows = {m.group(1).strip() for m in re.finditer(r"^\| ([^|]+) \|", section, re.M)} - {"model", "---"}
    grid = G.demo_grid()
    results = []
    for run in grid.runs:
        m = grid.config(run, tmp_path).model
        results.append(RunResult(run.name, variant_of(m), None if m.attention == "dense" else m.window))
    set_labels(results)
    shown = {r.label for r in results if r.variant in G.VARIANT_TITLES}
    assert shown and shown <= rows, shown - rows
    dense_modes = grid.config(grid.runs[0], tmp_path).eval.dense_modes
    assert {f"dense + {BASELINE_LABELS[m]}" for m in dense_modes} <= rows


def test_the_readme_set_up_commands_are_what_ci_runs():
    """The README's two set-up commands: the first makes and activates .venv; the test command activates it
    again (a fresh shell) and runs what .ci/run runs (issue 28 item 9)."""
    text = README.read_text()
    setup = text[text.index("## Set up"):text.index("## The op")]
    first, tests = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert tests.startswith(". .venv/bin/activate && ")
    ci = (README.parent / ".ci" / "run").read_text()
    install, run = tests.split(" && ")[1:]
    assert "python3 -m venv .venv" in ci and ". .venv/bin/activate" in ci
    assert install.replace("pip install ", "python -m pip install -q ") in ci and run in ci.splitlines()
