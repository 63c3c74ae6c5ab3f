import sqlite3

import pytest

from fibattn.study import demo as D
from fibattn.study import grid as G
from fibattn.study import report as Rp
from fibattn.study.headline import headline_check
from fibattn.cli import main as cli_main
from fibattn.storage.results import ResultsDB


def _checks(dense_long, sparse_long):
    res = [Rp.RunResult("dense", "dense", None, 42, 128, {("s", 128): 10.0, ("s", 512): dense_long})]
    res += [Rp.RunResult(f"fib_{i}", "linear", 8, 42, 128, {("s", 128): 10.0, ("s", 512): v})
            for i, v in enumerate(sparse_long)]
    return headline_check(res, "s", 4)


def test_headline_lines_pass():
    lines = D.headline_lines(_checks(25.0, [10.2, 9.7]), "s", 4, 128)
    assert lines[0] == "Headline check: s perplexity from 128 to 512 tokens (4× the training length)"
    assert lines[1].split()[:7] == ["PASS", "dense", "10.00", "->", "25.00", "+150.0", "%"]
    assert "goal >= +50 %" in lines[1] and "study +200.7 %" in lines[1]
    assert lines[2].startswith("  PASS  fib_0") and "+2.0 %" in lines[2] and "within ±5 %" in lines[2]
    assert lines[-1] == "Headline: 3/3 PASS — dense degrades and the sparse variants hold"


def test_headline_lines_fail():
    lines = D.headline_lines(_checks(14.0, [10.2, 11.0]), "s", 4, 128)
    assert lines[1].startswith("  FAIL  dense") and "+40.0 %" in lines[1]
    assert lines[2].startswith("  PASS  fib_0") and lines[3].startswith("  FAIL  fib_1")
    assert lines[-1] == "Headline: 1/3 PASS — see FAIL lines above"
    missing = headline_check([Rp.RunResult("fib_x", "fixed", 8, 42, 128, {("s", 128): 10.0})], "s", 4)
    assert not missing[0].passed and missing[0].change is None


def test_fresh_forgets_only_the_selected_runs(tmp_path):
    root = tmp_path / "demo"
    grid = G.build_grid("demo", only="dense,fib_stagger")
    for name in ("dense", "fib_stagger", "fib_fixed"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
        with ResultsDB(root / "results.sqlite") as db:
            db.start_run(name, config={})
            db.log_eval(name, "shakespeare", 128, "study", ppl=3.0)
    (root / "report").mkdir()
    for name in ("report.md", "ppl_vs_length.png"):
        (root / "report" / name).write_text("x")
    assert D.forget_runs(grid, root) == ["dense", "fib_stagger"]
    assert not (root / "dense").exists() and (root / "fib_fixed").exists() and not (root / "report").exists()
    db = sqlite3.connect(root / "results.sqlite")
    assert db.execute("SELECT name FROM runs").fetchall() == [("fib_fixed",)]
    assert db.execute("SELECT run FROM eval_results").fetchall() == [("fib_fixed",)]
    (root / "dense").mkdir()
    (root / "dense" / "grid.log").write_text("step 1/3")        # a run stopped before its config was written
    assert D.forget_runs(grid, root) == ["dense"] and not (root / "dense").exists()
    (root / "dense").mkdir()
    (root / "dense" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="does not look like a run folder"):
        D.forget_runs(grid, root)


def test_fresh_keeps_files_fibattn_did_not_write(tmp_path):
    root = tmp_path / "demo"
    grid = G.build_grid("demo", only="dense")
    run = root / "dense"
    (run / "checkpoints" / "step-3").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    for name in ("config.json", "metrics.jsonl", "eval.json", "eval_positions_study.png", "notes.txt"):
        (run / name).write_text("x")
    (run / "mine").mkdir()
    (root / "report").mkdir()
    for name in ("report.md", "report.html", "distances.png", "draft.md"):
        (root / "report" / name).write_text("x")
    assert D.forget_runs(grid, root) == ["dense"]
    assert sorted(p.name for p in run.iterdir()) == ["mine", "notes.txt"]
    assert sorted(p.name for p in (root / "report").iterdir()) == ["draft.md"]


MICRO = ["model.seq_len=32", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
         "model.base_k=6", "model.window=4", "model.backend=torch", "train.steps=3", "train.batch_tokens=128",
         "train.micro_batch=4", "train.warmup_steps=1", "train.log_every=1", "train.threads=1",
         "eval.lengths=[32,128]", "eval.tokens=2048"]


def test_demo_micro_end_to_end(tmp_path, capsys):
    root = tmp_path / "demo"
    args = ["demo", "--root", str(root), "--only", "dense,fib_stagger"] + [a for s in MICRO for a in ("--set", s)]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "fibattn demo: 2 runs (dense, fib_stagger)" in out and "step 3/3" in out
    assert "[grid demo] run 2/2 fib_stagger: finished" in out
    assert "Headline check: shakespeare perplexity from 32 to 128 tokens" in out and "Headline: " in out
    assert "cannot show the ordering" in out and "report.html" in out
    # the dense baselines of the same model, and the sparse model's extra length, in the extrapolation table
    for row in ("| dense + RoPE linear |", "| dense + RoPE NTK |", "| dense + YaRN |", "| dense + sliding window |"):
        assert row in out
    assert "| fib linear (stagger) | " in out and "8192 (256×)" in out and "Beyond the training length" in out
    assert "dense + YaRN" not in out.split("Headline check")[1]           # the headline judges the runs themselves
    import sqlite3
    db = sqlite3.connect(root / "results.sqlite")
    modes = {m for (m,) in db.execute("SELECT DISTINCT reach FROM eval_results WHERE run = 'dense'")}
    assert modes == {"study", "study+linear", "study+ntk", "study+yarn", "dense-window"}
    assert cli_main(args) == 0                                     # second call: both runs skipped
    out = capsys.readouterr().out
    assert out.count("done, skipped") == 2 and "step 1/3" not in out
    assert cli_main(args + ["--only", "dense", "--fresh"]) == 0      # forgets and retrains dense only
    out = capsys.readouterr().out
    assert "--fresh: removed 1 earlier run(s)" in out and "step 3/3" in out and "| fib linear (stagger) |" not in out


def test_extrapolation_lines_state_the_numbers():
    from fibattn.study.report import RunResult

    def run(name, variant, pts, mode=""):
        return RunResult(name, variant, None if variant.startswith("dense") else 6, train_len=32, mode=mode,
                         ppl={("s", n): v for n, v in pts.items()})
    results = [run("dense", "dense", {32: 6.0, 128: 9.0, 2048: 30.0}),
               run("dense + YaRN", "dense+yarn", {32: 6.0, 128: 6.6, 2048: 12.0}, "yarn"),
               run("fib", "linear", {32: 6.0, 128: 5.9, 2048: 5.94, 8192: 5.97}),
               run("pow2", "pow2+fixed", {32: 6.2, 128: 6.2, 2048: 6.51, 8192: 6.82})]
    lines = D.extrapolation_lines(results, "s")
    assert lines[1] == "  at 4× (128 tokens), dense from best to worst: dense + YaRN +10.0 %, dense +50.0 %"
    assert lines[2] == "  at 64× (2048 tokens), dense from best to worst: dense + YaRN +100.0 %, dense +400.0 %"
    assert lines[3] == "  at 4× (128 tokens), the 2 sparse models: -1.7 % … +0.0 %"
    assert lines[4] == "  at 64× (2048 tokens), the 2 sparse models: -1.0 % … +5.0 %"
    assert lines[5].startswith("  at 256× (8192 tokens), the 2 sparse models: -0.5 % … +10.0 % (beyond")
    assert D.extrapolation_lines(results[2:], "s") == []
