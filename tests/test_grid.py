import json
import sqlite3

import pytest

from fibattn.study import grid as G
from fibattn.study import runner as R
from fibattn.cli import main as cli_main
from fibattn.config import ConfigError
from fibattn.cli import grid as CG


def _cfg(grid, name, root="runs"):
    run = next(r for r in grid.runs if r.name == name)
    return grid.config(run, root)


# ------------------------------------------------------------------------------ definitions
def test_paper_grid_names_and_settings():
    grid = G.paper_grid()
    names = grid.names()
    matrix = [f"fib_{t}_w{w}" for w in (6, 8, 10, 12) for t in ("fixed", "learned", "stagger", "hdc")]
    matrix += [f"logsparse_stagger_w{w}" for w in (6, 8, 10, 12)] + ["logsparse_w8"]
    reps = [f"{n}_s{s}" for s in (43, 44) for n in ("fib_fixed_w12", "fib_learned_w12", "fib_stagger_w12",
                                                     "fib_hdc_w12", "logsparse_stagger_w12")]
    controls = [f"window_{k}_w{w}" for w in (6, 8, 10, 12) for k in ("rungs_off", "matched")]
    assert len(matrix) == 21 and sorted(names) == sorted(matrix + ["dense"] + reps + controls)
    assert len(set(names)) == len(names)
    for w, matched in ((6, 16), (8, 18), (10, 19), (12, 21)):      # fib K=15 linear 0.5..1.5 at 1024
        m = _cfg(grid, f"window_rungs_off_w{w}").model
        assert (m.attention, m.base, m.schedule, m.window) == ("sparse", "none", "fixed", w)
        m = _cfg(grid, f"window_matched_w{w}").model
        assert (m.base, m.window) == ("none", matched)
    m = _cfg(grid, "fib_hdc_w10").model
    assert (m.attention, m.schedule, m.window, m.base) == ("sparse", "coprime", 10, "fib")
    m = _cfg(grid, "logsparse_w8").model
    assert (m.base, m.schedule, m.window) == ("pow2", "fixed", 8)
    m = _cfg(grid, "fib_learned_w6").model
    assert (m.schedule, m.learned_init, m.alpha) == ("learned", "fixed", 1.0)
    assert _cfg(grid, "fib_stagger_w12").model.schedule == "linear"
    assert _cfg(grid, "dense").model.attention == "dense"
    c = _cfg(grid, "fib_stagger_w12_s43")
    assert c.train.seed == 43 and c.model.window == 12 and c.name == "fib_stagger_w12_s43"
    c = _cfg(grid, "fib_fixed_w6", "/x/root")
    assert c.train.out_dir == "/x/root/fib_fixed_w6" and c.eval.lengths == [1024, 4096, 16384, 65536]
    assert c.eval.sparse_lengths == [262144] and c.eval.dense_modes == ["linear", "ntk", "yarn", "window"]
    assert c.model.seq_len == 1024 and c.train.seed == 42 and c.data.tokenizer == "bpe"
    assert {s.name for s in c.data.sources} >= {"fineweb_edu", "wikipedia", "tinystories"}


def test_demo_grid_uses_demo_setting():
    grid = G.demo_grid()
    assert grid.names() == ["dense", "fib_fixed", "fib_learned", "fib_stagger", "fib_hdc", "window_rungs_off",
                            "window_matched", "logsparse", "logsparse_stagger"]
    # the controls: the demo's W, no rungs; and the fib linear model's 9.4 columns per query at T=32 -> W 8
    assert [(_cfg(grid, n).model.base, _cfg(grid, n).model.window) for n in grid.names()[5:7]] == \
        [("none", 6), ("none", 8)]
    assert G.control_title("window_matched") == "window (matched cost)" and G.control_title("fib_fixed") is None
    c = _cfg(grid, "fib_stagger", "/r")
    setting = dict(s.split("=", 1) for s in G.demo_setting())
    assert c.model.seq_len == int(setting["model.seq_len"]) and c.train.steps == int(setting["train.steps"])
    T = c.model.seq_len                                 # 1×, 4×, 16×, 64×; sparse also 256×
    assert c.eval.lengths == [T, 4 * T, 16 * T, 64 * T] and c.eval.sparse_lengths == [256 * T]
    assert c.data.out_dir == "/r/data/shakespeare-byte" and c.data.sources[0].kind == "bundled"
    g2 = G.build_grid("demo", sets=["data.out_dir=/shared/d"])
    assert _cfg(g2, "dense", "/r").data.out_dir == "/shared/d"              # --set wins over the root default
    m = _cfg(grid, "logsparse").model
    assert (m.base, m.schedule) == ("pow2", "fixed")


# ------------------------------------------------------------------------------ filter / extend
def test_only_filters_with_patterns():
    grid = G.build_grid("paper", only="fib_*_w12, dense")
    assert grid.names() == ["dense", "fib_fixed_w12", "fib_learned_w12", "fib_stagger_w12", "fib_hdc_w12"]
    assert G.build_grid("demo", only="dense,fib_stagger").names() == ["dense", "fib_stagger"]
    with pytest.raises(ValueError, match="matches no run"):
        G.build_grid("paper", only="fib_*_w7")
    with pytest.raises(ValueError, match="--only"):
        G.build_grid("paper", only=" , ")
    with pytest.raises(ValueError, match="grid must be one of"):
        G.build_grid("nope")


def test_extend_adds_runs(tmp_path):
    f = tmp_path / "more.json"
    f.write_text(json.dumps([{"name": "fib_stagger_w16", "preset": "paper", "overrides": ["model.window=16"],
                              "seed": 7}, {"name": "x2", "preset": "tiny"}]))
    grid = G.build_grid("paper", extend=str(f), only="fib_stagger_w16,x2")
    assert grid.names() == ["fib_stagger_w16", "x2"] and grid.extend_file == str(f.resolve())
    c = _cfg(grid, "fib_stagger_w16")
    assert c.model.window == 16 and c.train.seed == 7
    assert _cfg(grid, "x2").train.seed == 42


@pytest.mark.parametrize("content, match", [
    ("{", "not valid JSON"),
    ("{}", "non-empty JSON list"),
    ('[{"name": "a"}]', r"more.json\[0\].preset must be one of"),
    ('[{"name": "a b", "preset": "tiny"}]', r"\[0\].name must be"),
    ('[{"name": "a", "preset": "tiny", "seeds": 1}]', "unknown key 'seeds'"),
    ('[{"name": "a", "preset": "tiny", "overrides": "model.window=3"}]', "overrides must be a list"),
    ('[{"name": "a", "preset": "tiny", "seed": -1}]', "seed must be an integer >= 0"),
    ('[{"name": "a", "preset": "tiny", "overrides": ["model.window=x"]}]', r"\[0\] \(a\): model.window expects"),
    ('[{"name": "a", "preset": "tiny", "overrides": ["model.nope=1"]}]', "unknown config key"),
    ('[{"name": "a", "preset": "tiny"}, {"name": "a", "preset": "tiny"}]', "names run 'a' twice"),
    ('[{"name": "dense", "preset": "tiny"}]', "reuses run name 'dense'"),
])
def test_bad_extension_files(tmp_path, content, match):
    f = tmp_path / "more.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        G.build_grid("paper", extend=str(f))


def test_missing_extension_file_and_bad_devices(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        G.build_grid("paper", extend=str(tmp_path / "none.json"))
    assert CG.parse_devices("0, 2") == ["0", "2"]
    for bad in ("a", "0,0", ""):
        with pytest.raises(ValueError, match="--devices"):
            CG.parse_devices(bad)


# ------------------------------------------------------------------------------ commands
def test_print_commands_torchrun(capsys, tmp_path):
    assert cli_main(["grid", "paper", "--only", "fib_*_w12", "--root", str(tmp_path / "p"), "--print-commands",
                     "torchrun", "--gpus-per-run", "4", "--set", "data.out_dir=/scratch/d"]) == 0
    out = capsys.readouterr().out
    cmds = [ln for ln in out.splitlines() if ln.startswith("torchrun")]
    assert len(cmds) == 4
    assert cmds[2] == (f"torchrun --standalone --nproc_per_node=4 -m fibattn.cli grid paper --root {tmp_path / 'p'} "
                       f"--set data.out_dir=/scratch/d --only fib_stagger_w12")
    assert "# fib_hdc_w12: preset paper, seed 42:" in out and "model.schedule=coprime" in out
    assert "--prepare-only" in out


def test_print_commands_slurm(capsys, tmp_path):
    assert cli_main(["grid", "paper", "--root", str(tmp_path / "p"), "--print-commands", "slurm"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash" and "#SBATCH --array=0-39" in lines and "#SBATCH --gpus=1" in lines
    first_cmd = next(i for i, ln in enumerate(lines) if not ln.startswith("#"))
    assert max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH")) < first_cmd
    runs = lines[lines.index("RUNS=(") + 1: lines.index(")")]
    assert [r.strip() for r in runs] == G.paper_grid().names()
    assert lines[-1] == f'python -m fibattn.cli grid paper --root {tmp_path / "p"} --only "$RUN"'


def test_print_commands_with_context_parallelism_need_whole_groups(capsys, tmp_path):
    base = ["grid", "paper", "--root", str(tmp_path / "p"), "--set", "model.seq_len=262144", "--set",
            "train.context_parallel=8", "--set", "train.micro_batch=1", "--set", "train.batch_tokens=262144",
            "--print-commands", "slurm"]
    assert cli_main(base + ["--gpus-per-run", "4"]) == 2
    assert "--gpus-per-run 4" in capsys.readouterr().err
    assert cli_main(base + ["--gpus-per-run", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "#SBATCH --gpus=8" in lines and "--nproc_per_node=8" in lines[-1] and "train.context_parallel=8" in lines[-1]


# ------------------------------------------------------------------------------ running
@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    """The smoke grid (2 micro runs) run once through the CLI."""
    root = tmp_path_factory.mktemp("grid") / "smoke"
    assert cli_main(["grid", "smoke", "--root", str(root)]) == 0
    return root


def test_micro_grid_runs_and_records(smoke_root):
    db = sqlite3.connect(smoke_root / "results.sqlite")
    assert db.execute("SELECT name, status FROM runs ORDER BY name").fetchall() == [
        ("dense", "finished"), ("fib_stagger", "finished")]
    rows = db.execute("SELECT run, length FROM eval_results ORDER BY run, length").fetchall()
    assert {(r, n) for r, n in rows} == {("dense", 32), ("dense", 64), ("fib_stagger", 32), ("fib_stagger", 64)}
    assert (smoke_root / "dense" / "eval.json").is_file()
    assert [s.status for s in R.states(G.build_grid("smoke"), smoke_root)] == ["done", "done"]


def test_second_invocation_skips(smoke_root, capsys):
    capsys.readouterr()
    assert cli_main(["grid", "smoke", "--root", str(smoke_root)]) == 0
    out = capsys.readouterr().out
    assert "2 done, 0 to run" in out and out.count("done, skipped") == 2 and "step 1/" not in out
    assert cli_main(["grid", "smoke", "--root", str(smoke_root), "--dry-run"]) == 0
    assert "2 done, 0 evaluate, 0 resume, 0 new" in capsys.readouterr().out


def test_changed_settings_are_refused(smoke_root):
    grid = G.build_grid("smoke", sets=["train.steps=5"])
    with pytest.raises(ConfigError, match=r"other settings \(train.steps: 3 -> 5\)"):
        R.run_grid(grid, smoke_root, out=lambda s: None)


def test_missing_evaluation_is_redone(smoke_root, tmp_path):
    import shutil
    root = tmp_path / "copy"
    shutil.copytree(smoke_root, root)
    db = sqlite3.connect(root / "results.sqlite")
    with db:
        db.execute("DELETE FROM eval_results WHERE run='dense' AND length=64")
    grid = G.build_grid("smoke")
    assert [s.status for s in R.states(grid, root)] == ["evaluate", "done"]
    lines = []
    summary = R.run_grid(grid, root, out=lines.append)
    assert summary.ran == ["dense"] and summary.done == ["fib_stagger"] and not summary.failed
    assert any("run 1/2 dense: evaluating" in ln for ln in lines)
    assert db.execute("SELECT COUNT(*) FROM eval_results WHERE run='dense'").fetchone()[0] >= 2


def test_parallel_pool_assigns_devices(tmp_path, monkeypatch):
    """One subprocess per GPU (CUDA_VISIBLE_DEVICES), a bounded pool; a failing worker is reported."""
    import sys
    setting = tuple(G.smoke_setting())
    runs = [G.GridRun(n, "tiny", setting + ("model.attention=dense",)) for n in ("a", "b", "bad")]
    grid = G.Grid("smoke", runs, data_under_root=True)
    code = ("import os, sys; print('device', os.environ['CUDA_VISIBLE_DEVICES']); "
            "sys.exit(3 if sys.argv[1] == 'bad' else 0)")
    cmd = R.worker_command(G.build_grid("smoke", sets=["train.steps=2"]), tmp_path, "dense")
    assert cmd[1:] == ["-m", "fibattn.cli", "grid", "smoke", "--root", str(tmp_path), "--only", "dense",
                       "--set", "train.steps=2"]
    monkeypatch.setattr(R, "worker_command", lambda g, root, name: [sys.executable, "-c", code, name])
    lines = []
    summary = R.run_grid(grid, tmp_path, devices=["0", "1"], out=lines.append, progress_data=False)
    assert sorted(summary.ran) == ["a", "b"] and list(summary.failed) == ["bad"]
    assert "exit status 3" in summary.failed["bad"]
    for name in ("a", "b", "bad"):
        assert (tmp_path / name / "grid.log").read_text().strip() in ("device 0", "device 1")
    assert sum("started on GPU" in ln for ln in lines) == 3 and any("FAILED (exit status 3" in ln for ln in lines)


@pytest.mark.slow
def test_parallel_grid_for_real(tmp_path):
    """The smoke grid with two worker processes (CPU here: CUDA_VISIBLE_DEVICES is ignored without GPUs)."""
    root = tmp_path / "par"
    assert cli_main(["grid", "smoke", "--root", str(root), "--devices", "0,1"]) == 0
    assert [s.status for s in R.states(G.build_grid("smoke"), root)] == ["done", "done"]


def test_interrupted_run_resumes(tmp_path, smoke_root):
    from fibattn.trainer.trainer import train
    grid = G.build_grid("smoke", only="dense", sets=[f"data.out_dir={smoke_root / 'data' / 'shakespeare-byte'}"])
    cfg = grid.config(grid.runs[0], tmp_path)
    assert train(cfg, stop_at=2).status == "stopped"
    assert [s.status for s in R.states(grid, tmp_path)] == ["resume"]
    lines = []
    summary = R.run_grid(grid, tmp_path, out=lines.append)
    assert summary.ran == ["dense"] and any("run 1/1 dense: resuming training" in ln for ln in lines)
    metrics = (tmp_path / "dense" / "metrics.jsonl").read_text()
    assert '"step": 3' in metrics and [s.status for s in R.states(grid, tmp_path)] == ["done"]


def test_fine_tunes_wait_for_their_source_and_skip_when_it_failed(tmp_path, monkeypatch):
    import sys
    setting = tuple(G.smoke_setting())
    runs = [G.GridRun("tune_bad", "tiny", setting, init_from="bad", init_share=0.5),
            G.GridRun("tune_a", "tiny", setting, init_from="a", init_share=0.5),
            G.GridRun("a", "tiny", setting + ("model.attention=dense",)),
            G.GridRun("bad", "tiny", setting + ("model.attention=dense",))]
    grid = G.Grid("smoke", runs, data_under_root=True)
    code = ("import sys, time, pathlib; time.sleep(0.3 if sys.argv[1] in ('a', 'bad') else 0); "
            "pathlib.Path(sys.argv[2], sys.argv[1] + '.done').write_text(''); sys.exit(3 if sys.argv[1] == 'bad' else 0)")
    monkeypatch.setattr(R, "worker_command", lambda g, root, name: [sys.executable, "-c", code, name, str(tmp_path)])
    lines = []
    summary = R.run_grid(grid, tmp_path, devices=["0", "1"], out=lines.append, progress_data=False)
    assert sorted(summary.ran) == ["a", "tune_a"] and sorted(summary.failed) == ["bad", "tune_bad"]
    assert "source run bad failed" in summary.failed["tune_bad"] and not (tmp_path / "tune_bad.done").exists()
    # tune_a started only after a had finished
    assert (tmp_path / "a.done").stat().st_mtime_ns <= (tmp_path / "tune_a.done").stat().st_mtime_ns


def test_a_document_masked_grid_evaluates_and_reports_under_its_own_mode_names():
    """``eval.document_masking`` renames every recorded mode (``+docs``): the grid's to-do list and the
    report look results up under the masked names, never the unmasked ones."""
    from fibattn.config import RunConfig
    from fibattn.eval.modes import mode_name
    cfg = RunConfig()
    cfg.model.attention = "dense"
    cfg.eval.dense_modes = ["window", "yarn"]
    plain = [recorded for _, recorded, _ in R.eval_plan(cfg)]
    cfg.eval.document_masking = True
    masked = [recorded for _, recorded, _ in R.eval_plan(cfg)]
    assert plain == ["study", "dense-window", "study+yarn"]
    assert masked == ["study+docs", "dense-window+docs", "study+yarn+docs"]
    assert mode_name("yarn", "train", 2.0, documents=True) == "train+yarn@2+docs"
