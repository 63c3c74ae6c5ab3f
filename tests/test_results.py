import sqlite3

import pytest

from fibattn.storage.results import ResultsDB, default_db_path, resolve_db_path, run_key


def test_tables_and_roundtrip(tmp_path):
    path = tmp_path / "results.sqlite"
    with ResultsDB(path) as db:
        db.start_run("a", config={"x": 1}, out_dir="/runs/a", label="tiny")
        db.log_metrics("a", 10, {"loss": 2.5, "lr": 1e-3})
        db.log_metrics("a", 20, {"loss": 2.0})
        db.log_alphas("a", 10, [0.5, 1.0])
        db.log_alphas("a", 20, [0.51, 0.99])
        db.log_eval("a", "shakespeare", 256, "study", ppl=5.0, bpb=2.3, tokens=1000, extra={"loss": 1.6})
        db.log_eval("a", "shakespeare", 256, "study", ppl=4.0, tokens=1000)      # replaces
        assert db.metrics("a", "loss") == [(10, 2.5), (20, 2.0)]
        assert db.alphas("a") == {10: [0.5, 1.0], 20: [0.51, 0.99]}
        rows = db.eval_results("a")
        assert len(rows) == 1 and rows[0]["ppl"] == 4.0 and rows[0]["bpb"] is None
        db.truncate("a", 10)
        assert db.metrics("a", "loss") == [(10, 2.5)] and list(db.alphas("a")) == [10]
        db.finish_run("a")
        run = db.runs()[0]
        assert run["status"] == "finished" and run["label"] == "tiny" and run["finished"] >= run["started"]
        with pytest.raises(ValueError, match="status"):
            db.finish_run("a", "exploded")
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "metrics", "alphas", "eval_results"} <= tables


def test_paths(tmp_path):
    out = tmp_path / "runs" / "w12"
    assert run_key(out) == "w12"
    assert default_db_path(out) == (tmp_path / "runs" / "results.sqlite").resolve()
    assert resolve_db_path(out, "off") is None
    assert resolve_db_path(out, str(tmp_path / "x.db")) == tmp_path / "x.db"
