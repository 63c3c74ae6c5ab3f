"""The alpha report: largest-move line, table, history sources, run folders."""
import json

import pytest
import torch

from fibattn.eval import alpha_report as A
from fibattn.config import ModelConfig, RunConfig
from fibattn.model.lm import FibLM
from fibattn.storage.results import ResultsDB


def test_largest_move_line():
    r = A.AlphaReport("r", start=[1.0, 1.0, 1.0, 1.0], end=[0.99, 1.01, 1.0, 1.042])
    assert r.largest_move_line() == "largest move from start: layer 3, 1.000 → 1.042 (+0.042)"
    down = A.AlphaReport("r", start=[0.5, 1.5], end=[0.5, 1.4])
    assert down.largest_move_line() == "largest move from start: layer 1, 1.500 → 1.400 (-0.100)"
    tie = A.AlphaReport("r", start=[1.0, 1.0], end=[1.1, 0.9])
    assert tie.largest_move()[0] == 0                              # ties go to the lower layer


def test_markdown_table_and_excursion():
    hist = [(s, [1.0 + s / 1000, 1.0 - s / 2000]) for s in range(10, 110, 10)]
    r = A.AlphaReport("r", start=[1.0, 1.0], end=[1.05, 0.99], history=hist, end_step=120, source="test")
    md = r.markdown(max_steps=3)
    head = md.splitlines()[0]
    assert head.startswith("| layer | start | step 10 | step 50 | step 100 | end (step 120) | move |")
    assert "| 0 | 1.0000 | 1.0100 | 1.0500 | 1.1000 | 1.0500 | +0.0500 | 0.1000 |" in md
    assert md.splitlines()[-2] == r.largest_move_line()
    assert r.max_excursion() == pytest.approx([0.1, 0.05])
    with pytest.raises(ValueError, match="one start and one end value per layer"):
        A.AlphaReport("r", start=[1.0], end=[1.0, 1.0])


def _learned_model():
    cfg = RunConfig()
    cfg.model = ModelConfig(vocab_size=16, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, seq_len=16, window=2,
                            base_k=5, schedule="learned", learned_init="linear", backend="torch")
    model = FibLM(cfg.model)
    with torch.no_grad():
        model.blocks[1].attn.alphas.theta.add_(0.2)
    return model, cfg


def test_report_for_run_reads_db_then_metrics(tmp_path):
    model, cfg = _learned_model()
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 2.0, "alphas": [0.5, 1.01, 1.5]}) + "\n"
                                       + json.dumps({"step": 6, "loss": 2.0}) + "\n")
    r = A.report_for_run(run, model, cfg, end_step=9)
    assert r.start == pytest.approx([0.5, 1.0, 1.5], abs=1e-5) and r.source == "metrics.jsonl"
    assert r.history == [(5, [0.5, 1.01, 1.5])] and r.largest_move()[0] == 1 and r.end_step == 9
    db = tmp_path / "runs" / "results.sqlite"
    with ResultsDB(db) as d:
        d.log_alphas("a", 3, [0.5, 1.02, 1.5])
        d.log_alphas("a", 4, [0.5, 1.03, 1.5])
    r2 = A.report_for_run(run, model, cfg, db_path=db)
    assert [s for s, _ in r2.history] == [3, 4] and r2.source.startswith("results DB")
    paths = A.write_report(r2, run, plot=False)
    assert r2.largest_move_line() in paths["markdown"].read_text()
    cfg.model.schedule = "linear"
    with pytest.raises(ValueError, match="needs a learned schedule"):
        A.report_for_run(run, model, cfg)
