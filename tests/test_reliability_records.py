# ruff: noqa: F811  (pytest fixtures imported from storage_helpers are requested by name)
"""Records reliability: the results database, ``eval.json`` and ``metrics.jsonl`` (split from
``test_reliability_storage.py``; the same helpers and micro runs, ``storage_helpers``).

- a corrupted or read-only results database is one line naming the file and the setting,
  found before training / evaluation starts; a failure during training stops with a checkpoint;
- ``eval.json`` entries are validated;
- a torn last line of ``metrics.jsonl`` is dropped with a notice; a resume is marked there and
  the loss window continues (the log equals an uninterrupted run's).

A read-only database is **simulated** (tests run as root, where file modes do not stop writes):
SQLite connections to that file are opened with ``mode=ro``.
"""
import json
import logging
import shutil
import sqlite3
from pathlib import Path

import pytest

from fibattn.storage import results as RS
from fibattn.storage.export import export_run
from fibattn.storage.pretrained import is_export
from fibattn.storage.runs import read_eval_doc
from fibattn.trainer.trainer import train
from storage_helpers import (assert_one_line, data_dir, micro, records, run, run_cli, save_cfg, shared,  # noqa: F401
                             snapshot, steps_of)


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


def _bad_db(monkeypatch, db: Path, kind: str) -> None:
    if kind == "corrupted":
        _garbage_db(db)
    else:
        _good_db(db)
        _read_only(monkeypatch, db)


@pytest.mark.parametrize("kind", ["corrupted", "read-only"])
def test_bad_results_db_is_found_before_training(tmp_path, data_dir, capsys, monkeypatch, kind):
    db = tmp_path / "dbs" / "results.sqlite"
    _bad_db(monkeypatch, db, kind)
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
    _bad_db(monkeypatch, db, kind)
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
