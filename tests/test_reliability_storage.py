"""Storage reliability: nothing of the user's is lost, nothing unverified is recorded, and a bad
file gives one line naming it.

- ``export --force`` replaces only what the earlier export's ``config.json`` lists;
- resuming an older checkpoint into a run with newer ones is refused (branch into a new ``--out``);
  pruning never deletes a checkpoint newer than the one just saved; a folder in the way of a
  save is set aside, never deleted;
- a checkpoint is checked against its folder name and its run's ``config.json``; malformed
  ``meta.json`` shapes are verification failures (``--resume auto`` falls back past them);
- a corrupted or read-only results database is one line naming the file and the setting,
  found before training / evaluation starts; a failure during training stops with a checkpoint;
- ``eval.json`` entries are validated;
- a torn last line of ``metrics.jsonl`` is dropped with a notice; a resume is marked there and
  the loss window continues (the log equals an uninterrupted run's).

CLI cases run in-process through ``fibattn.cli.main``: exit 2, one stderr line naming the file,
no traceback, and the files compared before and after. Micro runs (d_model 32, one layer, CPU).
A read-only database is **simulated** (tests run as root, where file modes do not stop writes):
SQLite connections to that file are opened with ``mode=ro``.
"""
import hashlib
import json
import logging
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from fibattn import config as C
from fibattn.cli import main
from fibattn.storage import checkpoint as ck
from fibattn.storage import results as RS
from fibattn.storage.export import export_run
from fibattn.storage.pretrained import is_export, verify_export
from fibattn.storage.runs import load_run, read_eval_doc
from fibattn.trainer.trainer import train
from run_helpers import micro_config


# ------------------------------------------------------------------ helpers and shared runs
def micro(out, data_dir, **kw):
    t = dict(steps=6, batch_tokens=64, micro_batch=2, lr=3e-3, warmup_steps=2, log_every=2, ckpt_every=1,
             keep_ckpts=10, eval_tokens=64, threads=1, results_db="off")
    cfg = micro_config(out, data_dir, **{**t, **kw})
    cfg.eval.lengths, cfg.eval.tokens, cfg.eval.batch_size = [32], 128, 2
    return cfg


def snapshot(root: Path) -> dict:
    """Every file (sha256) and folder under ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(Path(root).rglob("*"))}


def run_cli(capsys, argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, [line for line in cap.err.splitlines() if line.strip()]


def assert_one_line(rc, err, *needles):
    assert rc == 2, err
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and "error" in err[0]
    for n in needles:
        assert str(n) in err[0], err[0]


def steps_of(out) -> list[int]:
    return [s for s, _ in ck.list_checkpoints(Path(out) / "checkpoints")]


def records(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def data_dir(tiny_data):
    return tiny_data


@pytest.fixture(scope="module")
def shared(tmp_path_factory, data_dir):
    """``run``: 6 steps, a checkpoint at every step. ``other``: the same with model.window=5 (another model)."""
    w = tmp_path_factory.mktemp("storage")
    train(micro(w / "run", data_dir))
    other = micro(w / "other", data_dir, ckpt_every=2)
    other.model.window = 5
    train(other)
    return w


@pytest.fixture
def run(shared, tmp_path):
    out = tmp_path / "runs" / "run"
    shutil.copytree(shared / "run", out)
    return out


def save_cfg(cfg, path) -> Path:
    C.save(cfg, path)
    return path


# ------------------------------------------------------------------ 1. export --force
def test_export_force_keeps_files_the_user_added(tmp_path, run, capsys):
    out = tmp_path / "exp"
    export_run(run, out, step=6)
    (out / "notes.txt").write_text("my notes")
    (out / "eval-mine").mkdir()
    (out / "eval-mine" / "scores.csv").write_text("a,b\n1,2\n")
    rc, stdout, err = run_cli(capsys, ["export", run, out, "--step", "3", "--force"])
    assert rc == 0 and not err and "wrote" in stdout
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "eval-mine" / "scores.csv").read_text() == "a,b\n1,2\n"
    meta = verify_export(out)
    assert meta["source"]["step"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "eval-mine", "model.safetensors",
                                                     "notes.txt", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]          # no staging left


def test_export_force_removes_only_files_the_earlier_export_listed(tmp_path, run, capsys):
    out = tmp_path / "exp"
    export_run(run, out)
    meta = json.loads((out / "config.json").read_text())
    (out / "extra.bin").write_bytes(b"old export part")            # a part of the earlier export ...
    meta["files"]["extra.bin"] = {"sha256": hashlib.sha256(b"old export part").hexdigest(), "bytes": 15}
    (out / "config.json").write_text(json.dumps(meta))              # ... listed by its config.json
    (out / "mine.txt").write_text("keep")
    rc, _, err = run_cli(capsys, ["export", run, out, "--force"])
    assert rc == 0 and not err
    assert not (out / "extra.bin").exists() and (out / "mine.txt").read_text() == "keep"
    verify_export(out)


def test_export_force_refuses_to_overwrite_an_unlisted_user_file(tmp_path, run, capsys):
    out = tmp_path / "exp"
    export_run(run, out)
    meta = json.loads((out / "config.json").read_text())
    del meta["files"]["README.md"]                                  # the earlier export did not write a card
    (out / "config.json").write_text(json.dumps(meta))
    (out / "README.md").write_text("# my own write-up\n")
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["export", run, out, "--force"])
    assert_one_line(rc, err, "README.md", str(out))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["not-an-export", "broken-config", "listing-escapes"])
def test_export_force_refuses_a_folder_that_is_not_an_earlier_export(tmp_path, run, capsys, kind):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    victim = tmp_path / "victim.txt"
    victim.write_text("outside")
    if kind == "broken-config":
        (out / "config.json").write_text('{"fibattn_format": 1, "model": ')
    elif kind == "listing-escapes":
        (out / "config.json").write_text(json.dumps({"fibattn_format": 1, "model": {}, "files": {
            "model.safetensors": {"sha256": "0", "bytes": 1}, "../victim.txt": {"sha256": "0", "bytes": 7}}}))
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["export", run, out, "--force"])
    assert_one_line(rc, err, str(out))
    assert snapshot(tmp_path) == before and victim.read_text() == "outside"


def test_export_config_with_a_wrong_tokenizer_field_is_named(tmp_path, run):
    from fibattn.storage.pretrained import ExportError, load_model
    out = export_run(run, tmp_path / "exp")
    meta = json.loads((out / "config.json").read_text())
    meta["tokenizer"] = ["tokenizer.json"]                  # was a TypeError (unhashable list) traceback
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=r"exp: config.json is corrupted \(field 'tokenizer'"):
        load_model(out)


# ------------------------------------------------------------------ 2. resuming an older checkpoint
def test_resume_older_checkpoint_in_place_is_refused_and_changes_nothing(tmp_path, run, data_dir, capsys):
    cfg = save_cfg(micro(run, data_dir), tmp_path / "cfg.json")
    before = snapshot(run)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg, "--resume", run / "checkpoints" / "step-3",
                                  "--stop-at", "5", "--set", "train.lr=0.001"])
    assert_one_line(rc, err, "step-4", "step-6", "--out", "--resume auto")
    assert snapshot(run) == before                    # newer checkpoints, metrics.jsonl: untouched


def test_branch_into_a_new_out_leaves_the_run_untouched(tmp_path, run, data_dir):
    before = snapshot(run)
    branch = tmp_path / "runs" / "branch"
    res = train(micro(branch, data_dir, lr=1e-3), resume=str(run / "checkpoints" / "step-3"), stop_at=5)
    assert res.status == "stopped" and res.step == 5 and [s for s, _ in res.losses] == [4, 5]
    assert snapshot(run) == before
    assert steps_of(branch) == [4, 5]
    marker = [r for r in records(branch) if "resumed_from" in r]
    assert marker and marker[0]["resumed_from"] == 3 and "train.lr" in marker[0]["changed"]
    res = train(micro(branch, data_dir, lr=1e-3), resume="auto")        # the branch continues on its own
    assert res.status == "finished" and res.losses[0][0] == 6
    model, _, _ = load_run(branch)
    other, _, _ = load_run(run)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_resume_from_another_run_into_a_run_with_checkpoints_is_refused(tmp_path, run, shared, data_dir, capsys):
    src = tmp_path / "src"
    shutil.copytree(shared / "run", src)
    shutil.rmtree(run / "checkpoints" / "step-6")            # `run` now ends at step 5; src's step-6 is "newer"
    cfg = save_cfg(micro(run, data_dir), tmp_path / "cfg.json")
    before = snapshot(run)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg, "--resume", src / "checkpoints" / "step-6"])
    assert_one_line(rc, err, "another run", "--out")
    assert snapshot(run) == before


def test_prune_never_deletes_a_checkpoint_newer_than_the_one_saved(tmp_path):
    for s in (1, 2, 3, 4, 5):
        tmp = ck.begin(tmp_path, s)
        ck.write_state(tmp, "trainer", {"step": s})
        ck.finish(tmp_path, s)
    gone = ck.prune(tmp_path, 2, upto=3)
    assert [p.name for p in gone] == ["step-1"] and [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 3, 4, 5]


def test_a_folder_in_the_way_of_a_save_is_set_aside_not_deleted(tmp_path):
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "precious.bin").write_bytes(b"user data")
    tmp = ck.begin(tmp_path, 3)
    ck.write_state(tmp, "trainer", {"step": 3})
    ck.finish(tmp_path, 3)
    assert ck.Checkpoint.open(tmp_path / "step-3").step == 3
    assert (tmp_path / "step-3.set-aside" / "precious.bin").read_bytes() == b"user data"
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3]


# ------------------------------------------------------------------ 3. checkpoint identity
def _plant_renamed(run):
    """A checkpoint folder named step-9 that holds the run's own step 2."""
    shutil.copytree(run / "checkpoints" / "step-2", run / "checkpoints" / "step-9")
    return run / "checkpoints" / "step-9"


def _plant_foreign(run, shared):
    """Another model's step-6 checkpoint copied over the run's step-6 (name and step agree)."""
    shutil.rmtree(run / "checkpoints" / "step-6")
    shutil.copytree(shared / "other" / "checkpoints" / "step-6", run / "checkpoints" / "step-6")
    return run / "checkpoints" / "step-6"


def test_folder_name_must_match_meta_step(run):
    bad = _plant_renamed(run)
    with pytest.raises(ck.CheckpointError, match=r"step-9.*named for step 9.*says step 2"):
        ck.verify(bad)
    with pytest.raises(ck.CheckpointError, match="step-9"):
        load_run(run, step=9)
    assert ck.latest_valid(run / "checkpoints").name == "step-6"


def test_checkpoint_of_another_model_is_not_the_runs(run, shared):
    bad = _plant_foreign(run, shared)
    with pytest.raises(ck.CheckpointError, match=r"does not belong to run .*model.window is 5"):
        ck.verify(bad)
    model, cfg, _ = load_run(run)                           # latest skips it: the run's own step 5
    assert cfg.model.window == 4
    ref = ck.Checkpoint.open(run / "checkpoints" / "step-5").tensors("model")
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)


def test_eval_of_a_renamed_checkpoint_is_refused_and_records_nothing(tmp_path, run, data_dir, capsys):
    _plant_renamed(run)
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["eval", run, "--step", "9", "--data", data_dir, "--no-plot", "--db", "off",
                                  "--device", "cpu"])
    assert_one_line(rc, err, "step-9", "says step 2")
    assert snapshot(tmp_path) == before


def test_eval_latest_skips_a_foreign_checkpoint_and_records_the_real_step(tmp_path, run, shared, data_dir, capsys):
    _plant_foreign(run, shared)
    rc, _, err = run_cli(capsys, ["eval", run, "--data", data_dir, "--no-plot", "--db", "off", "--device", "cpu"])
    assert rc == 0, err
    doc = read_eval_doc(run / "eval.json")
    assert {r["step"] for r in doc["results"]} == {5} and doc["last_settings"]["step"] == 5


def test_export_of_a_foreign_checkpoint_is_refused(tmp_path, run, shared, capsys):
    _plant_foreign(run, shared)
    rc, _, err = run_cli(capsys, ["export", run, tmp_path / "exp", "--step", "6"])
    assert_one_line(rc, err, "step-6", "does not belong")
    assert not (tmp_path / "exp").exists()


def test_resume_auto_falls_back_past_a_foreign_checkpoint_and_never_deletes_it(run, shared, data_dir):
    bad = _plant_foreign(run, shared)
    foreign = snapshot(bad)
    res = train(micro(run, data_dir, steps=7), resume="auto")
    assert res.status == "finished" and res.losses[0][0] == 6       # resumed from the run's own step 5
    assert snapshot(run / "checkpoints" / "step-6.set-aside") == foreign
    assert ck.Checkpoint.open(run / "checkpoints" / "step-6").step == 6
    ck.verify(run / "checkpoints" / "step-7")


META_DAMAGE = {
    "files-null": lambda m: {**m, "files": None},
    "files-list": lambda m: {**m, "files": list(m["files"])},
    "meta-list": lambda m: [m],
    "step-string": lambda m: {**m, "step": "6"},
    "entry-bytes-string": lambda m: {**m, "files": {k: {**v, "bytes": str(v["bytes"])} for k, v in m["files"].items()}},
    "entry-escapes": lambda m: {**m, "files": {**m["files"], "../../config.json": {"sha256": "0", "bytes": 1}}},
}


@pytest.mark.parametrize("damage", list(META_DAMAGE))
def test_malformed_meta_json_is_named_and_resume_auto_falls_back(run, data_dir, damage, caplog):
    path = run / "checkpoints" / "step-6" / ck.META
    path.write_text(json.dumps(META_DAMAGE[damage](json.loads(path.read_text()))))
    with pytest.raises(ck.CheckpointError, match=r"step-6: meta.json"):
        ck.verify(path.parent)
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        res = train(micro(run, data_dir, steps=7), resume="auto")
    assert res.losses[0][0] == 6 and "step-6" in caplog.text          # fell back to step 5, no traceback


def test_resume_auto_refuses_when_no_checkpoint_verifies(tmp_path, run, data_dir, capsys):
    for _, p in ck.list_checkpoints(run / "checkpoints"):
        (p / ck.META).write_text('{"files": null}')
    cfg = save_cfg(micro(run, data_dir), tmp_path / "cfg.json")
    before = snapshot(run)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg, "--resume", "auto"])
    assert_one_line(rc, err, str(run / "checkpoints"), "none verifies")
    assert snapshot(run) == before                     # not restarted from step 0 over the run's files


# ------------------------------------------------------------------ 4. results database
def _garbage_db(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not a sqlite file\n" * 200)
    return path


def _read_only(monkeypatch, db: Path) -> None:
    """Simulated read-only database: every SQLite connection to ``db`` is opened with mode=ro."""
    real = sqlite3.connect

    def connect(target, *args, **kwargs):
        if Path(str(target)).resolve() == db.resolve():
            kwargs.pop("uri", None)
            return real(f"file:{db.resolve()}?mode=ro", *args, uri=True, **kwargs)
        return real(target, *args, **kwargs)
    monkeypatch.setattr(RS.sqlite3, "connect", connect)


def _good_db(path: Path) -> Path:
    with RS.ResultsDB(path) as db:
        db.start_run("someone-else", config={}, out_dir="x")
    return path


@pytest.mark.parametrize("kind", ["corrupted", "read-only"])
def test_bad_results_db_is_found_before_training(tmp_path, data_dir, capsys, monkeypatch, kind):
    db = tmp_path / "dbs" / "results.sqlite"
    if kind == "corrupted":
        _garbage_db(db)
    else:
        _good_db(db)
        _read_only(monkeypatch, db)
    out = tmp_path / "runs" / "new"
    cfg = save_cfg(micro(out, data_dir, results_db=str(db)), tmp_path / "cfg.json")
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg])
    assert_one_line(rc, err, str(db), "train.results_db", "read-only" if kind == "read-only" else "corrupted")
    assert not out.exists() and snapshot(tmp_path) == before


def test_results_db_failing_during_training_stops_with_a_checkpoint(tmp_path, data_dir, capsys, monkeypatch):
    from fibattn.trainer import logs as L
    db = tmp_path / "runs" / "results.sqlite"
    out = tmp_path / "runs" / "r"
    cfg = save_cfg(micro(out, data_dir, steps=8, ckpt_every=100, log_every=1, results_db=str(db)),
                   tmp_path / "cfg.json")
    real_log = L.MetricSinks.log

    def log(self, step, values, alphas=None):
        if step == 3 and self.db is not None:           # the database turns read-only mid-run
            self.db.conn.close()
            self.db.conn = sqlite3.connect(f"file:{db.resolve()}?mode=ro", uri=True)
        return real_log(self, step, values, alphas)
    monkeypatch.setattr(L.MetricSinks, "log", log)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg])
    assert_one_line(rc, err, str(db), "train.results_db", "read-only", "--resume auto")
    stopped = steps_of(out)
    assert stopped == [4]                                # one more step, then a checkpoint: nothing lost
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2, 3, 4]
    monkeypatch.setattr(L.MetricSinks, "log", real_log)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg, "--resume", "auto"])
    assert rc == 0, err
    con = sqlite3.connect(db)
    assert con.execute("SELECT status FROM runs WHERE name='r'").fetchone() == ("finished",)
    assert [s for (s,) in con.execute("SELECT step FROM metrics WHERE run='r' AND key='loss' ORDER BY step")] == \
        [1, 2, 5, 6, 7, 8]                               # steps 3-4 are in metrics.jsonl only


@pytest.mark.parametrize("kind", ["corrupted", "read-only"])
def test_bad_results_db_is_found_before_evaluating(tmp_path, run, data_dir, capsys, monkeypatch, kind):
    db = tmp_path / "runs" / "results.sqlite"
    if kind == "corrupted":
        _garbage_db(db)
    else:
        _good_db(db)
        _read_only(monkeypatch, db)
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["eval", run, "--data", data_dir, "--no-plot", "--db", db, "--device", "cpu"])
    assert_one_line(rc, err, str(db), "--db")
    assert snapshot(tmp_path) == before and not (run / "eval.json").exists()


@pytest.mark.parametrize("command", ["grid", "report"])
def test_corrupted_results_db_in_grid_and_report(tmp_path, capsys, command):
    root = tmp_path / "smoke"
    _garbage_db(root / "results.sqlite")
    argv = ["grid", "smoke", "--root", root, "--dry-run"] if command == "grid" else \
        ["report", "smoke", "--root", root, "--no-plot"]
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, argv)
    assert_one_line(rc, err, str(root / "results.sqlite"), "train.results_db", "corrupted")
    after = snapshot(tmp_path)
    assert after.pop("smoke/report", "dir") == "dir" and after == before    # report makes its (empty) folder first


def test_read_only_db_is_never_silently_not_forgotten(tmp_path, monkeypatch):
    db = _good_db(tmp_path / "results.sqlite")
    _read_only(monkeypatch, db)
    assert RS.run_status(db, "someone-else") == "running"          # reading a read-only database works
    with pytest.raises(RS.ResultsDBError, match="read-only"):
        RS.forget_runs(db, ["someone-else"])


# ------------------------------------------------------------------ 5. eval.json contents
EVAL_DAMAGE = {
    "entry-not-object": ([1, 2], "results[0]"),
    "missing-dataset": ([{"length": 32, "mode": "study", "ppl": 3.0}], "'dataset'"),
    "length-string": ([{"dataset": "x", "length": "32", "mode": "study", "ppl": 3.0}], "'length'"),
    "ppl-string": ([{"dataset": "x", "length": 32, "mode": "study", "ppl": "high"}], "'ppl'"),
    "buckets-bad": ([{"dataset": "x", "length": 32, "mode": "study", "buckets": [1]}], "'buckets'"),
}


@pytest.mark.parametrize("damage", list(EVAL_DAMAGE))
def test_eval_json_entries_are_validated(tmp_path, damage):
    results, needle = EVAL_DAMAGE[damage]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"format": 1, "run": "r", "results": results}))
    with pytest.raises(ValueError, match=str(path)) as info:
        read_eval_doc(path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_eval_json_other_fields_are_validated(tmp_path):
    path = tmp_path / "eval.json"
    for doc, needle in (({"results": [], "datasets": []}, "datasets"), ({"results": [], "alphas": {"end": "x"}},
                                                                          "alphas.end")):
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=needle):
            read_eval_doc(path)
    path.write_text(json.dumps({"results": [{"dataset": "x", "length": 32, "mode": "study"}]}))
    assert read_eval_doc(path)["results"][0]["dataset"] == "x"      # the minimal entry readers need


def test_eval_with_a_bad_eval_json_fails_first_and_keeps_it(tmp_path, run, data_dir, capsys):
    (run / "eval.json").write_text(json.dumps({"format": 1, "results": [{"dataset": "x", "mode": "study"}]}))
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["eval", run, "--data", data_dir, "--no-plot", "--db", "off", "--device", "cpu"])
    assert_one_line(rc, err, str(run / "eval.json"), "'length'", "--json")
    assert snapshot(tmp_path) == before


def test_export_with_a_bad_eval_json_writes_a_card_without_results(tmp_path, run, caplog):
    (run / "eval.json").write_text(json.dumps({"results": [{"dataset": "x", "length": 32, "mode": "s",
                                                            "ppl": "n/a"}]}))
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        out = export_run(run, tmp_path / "exp")
    assert "eval.json" in caplog.text and "'ppl'" in caplog.text
    assert "No `eval.json`" in (out / "README.md").read_text() and is_export(out)


# ------------------------------------------------------------------ 6. crash leftovers in metrics.jsonl
def test_torn_last_metrics_line_is_dropped_with_a_notice(run, data_dir, caplog):
    shutil.rmtree(run / "checkpoints" / "step-6")
    (run / "checkpoints" / "step-6.tmp").mkdir()                        # a save killed mid-way
    kept = [r for r in records(run) if r["step"] <= 5]
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "loss": 4.1, "note": "unterminat')       # what a kill leaves
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        res = train(micro(run, data_dir), resume="auto")
    assert res.status == "finished" and res.losses[0][0] == 6
    assert "torn" in caplog.text and "metrics.jsonl" in caplog.text
    assert not (run / "checkpoints" / "step-6.tmp").exists()
    recs = records(run)
    assert recs[:len(kept)] == kept and recs[len(kept)] == {**recs[len(kept)], "step": 5, "resumed_from": 5}


def test_damaged_metrics_line_before_the_last_is_named(tmp_path, run, data_dir, capsys):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    cfg = save_cfg(micro(run, data_dir, steps=8), tmp_path / "cfg.json")
    before = snapshot(run)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg])
    assert_one_line(rc, err, str(run / "metrics.jsonl"), "line 2")
    assert snapshot(run) == before


def test_resume_is_marked_and_the_loss_window_continues(tmp_path, data_dir):
    kw = dict(steps=8, log_every=4, ckpt_every=100)
    train(micro(tmp_path / "full", data_dir, **kw))
    part = tmp_path / "part"
    train(micro(part, data_dir, **kw), stop_at=6)
    train(micro(part, data_dir, **kw), resume="auto")
    keys = ("loss", "lr", "grad_norm", "tokens")
    full = [{k: r[k] for k in keys} | {"step": r["step"]} for r in records(tmp_path / "full") if "loss" in r]
    mine = [{k: r[k] for k in keys} | {"step": r["step"]} for r in records(part) if "loss" in r]
    assert [r["step"] for r in mine] == [4, 8] and mine == full     # step 8 averages steps 5-8, as unbroken
    marker = [r for r in records(part) if "resumed_from" in r]
    assert len(marker) == 1 and marker[0]["step"] == 6 and marker[0]["checkpoint"].endswith("step-6")


def test_changed_settings_restart_the_window_and_keep_its_mean(tmp_path, data_dir):
    part = tmp_path / "part"
    train(micro(part, data_dir, steps=8, log_every=4, ckpt_every=100), stop_at=6)
    train(micro(part, data_dir, steps=8, log_every=4, ckpt_every=100, lr=1e-3), resume="auto")
    marker = [r for r in records(part) if "resumed_from" in r][0]
    assert marker["changed"] == ["train.lr"] and marker["window_steps"] == 2 and marker["window_loss"] > 0
