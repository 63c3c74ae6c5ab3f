"""The retrieval probe: generator determinism and correctness by construction, training smoke, CLI input."""
import argparse
import json

import numpy as np
import pytest

from fibattn.study import probe as P
from fibattn.study.probe_task import ProbeTask, make_batch
from fibattn.cli import probe as CP


def _check_sample(task, row, answer, d, key):
    q = task.seq_len - 1
    assert row[q] == key and task.key_base <= key < task.value_base
    assert row[q - d] == answer and task.value_base <= answer < task.marker_base      # exactly d before the query
    assert row[q - d - 1] == key
    keys_before = [p for p in range(q) if row[p] == key]
    planted = sorted(q - e - 1 for e in (task.distances if task.marked else (d,)))
    assert keys_before == planted                                 # distractor keys never equal the queried key
    for p in range(q):
        if task.key_base <= row[p] < task.value_base:             # every key is followed by a value
            assert task.value_base <= row[p + 1] < task.marker_base
    if task.marked:
        assert row[q - 1] == task.marker_base + task.distances.index(d)
        vals = [row[q - e] for e in task.distances]
        assert len(set(vals)) == len(vals)                        # the marker alone decides the answer
    else:
        assert not any(row[:q] >= task.marker_base)


@pytest.mark.parametrize("marked", [False, True])
def test_generator_is_deterministic_and_correct_by_construction(marked):
    task = ProbeTask(seq_len=48, distances=(5, 20, 33), marked=marked, n_distractors=6)
    a, b = make_batch(task, 200, 7), make_batch(task, 200, 7)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.answers, b.answers)
    assert not np.array_equal(a.tokens, make_batch(task, 200, 8).tokens)
    assert a.tokens.shape == (200, 48) and a.tokens.dtype == np.int64 and a.tokens.max() < task.vocab_size
    assert set(a.distances.tolist()) == {5, 20, 33}
    assert np.array_equal(a.value_pos, 47 - a.distances)
    for i in range(200):
        _check_sample(task, a.tokens[i], a.answers[i], a.distances[i], a.keys[i])
    fixed = make_batch(task, 50, [1, 2], distance=20)
    assert (fixed.distances == 20).all()
    n_distr = [(np.isin(r[:47], range(task.key_base, task.value_base))).sum() for r in a.tokens]
    assert max(n_distr) == 6 + (3 if marked else 1)               # every distractor pair was placed


def test_task_validation():
    with pytest.raises(ValueError, match="distance 70 needs seq_len >= 72"):
        ProbeTask(seq_len=64, distances=(70,))
    with pytest.raises(ValueError, match="must differ by >= 2"):
        ProbeTask(distances=(20, 21), marked=True)
    with pytest.raises(ValueError, match="n_distractors=40 is too many"):
        ProbeTask(n_distractors=40)
    with pytest.raises(ValueError, match="distances must be distinct"):
        ProbeTask(distances=(5, 5))
    with pytest.raises(ValueError, match="not one of the task's distances"):
        make_batch(ProbeTask(), 4, 0, distance=3)
    assert ProbeTask().vocab_size == 8 + 16 + 16 and ProbeTask(marked=True).vocab_size == 42


def test_probe_runs_end_to_end(tmp_path):
    cfg = P.ProbeConfig(task=ProbeTask(seq_len=24, distances=(6, 9), n_distractors=2), depths=(2,), steps=2,
                        batch_size=4, eval_samples=8, warmup=1)
    cfg.model.d_model = 16
    report = P.run_probe(cfg, tmp_path, plot=False, echo=lambda s: None)
    assert [(r.depth, r.start) for r in report.results] == [(2, "uniform"), (2, "staggered")]
    r = report.results[1]
    assert r.alpha_start == pytest.approx([0.5, 1.5], abs=1e-5) and len(r.alpha_end) == 2
    assert report.results[0].alpha_start == pytest.approx([1.0, 1.0])
    assert set(r.accuracy) == {6, 9} and all(0 <= a <= 1 for a in r.accuracy.values())
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert doc["results"][0]["depth"] == 2 and doc["config"]["task"]["distances"] == [6, 9]
    md = (tmp_path / "probe.md").read_text()
    assert "| depth | start | acc d=6 | acc d=9 |" in md and "staggered start: retrieves at depths" in md


def _args(argv):
    parser = argparse.ArgumentParser()
    CP.configure_parser(parser)
    return parser.parse_args(argv)


def test_cli_config_and_bad_input():
    cfg = CP.config_from_args(_args(["--depths", "2,4", "--distances", "10,30", "--marked", "--steps", "5"]))
    assert cfg.depths == (2, 4) and cfg.task.distances == (10, 30) and cfg.task.marked and cfg.steps == 5
    study = CP.config_from_args(_args(["--preset", "study"]))
    assert study.task.distances == (200, 350) and study.task.marked and study.depths == (2, 4, 8)
    for argv, msg in [(["--starts", "random"], "starts must be among uniform, staggered"),
                      (["--depths", "0"], "--depths must be a comma-separated list of integers >= 1"),
                      (["--distances", "100"], "needs seq_len >= 102"), (["--steps", "0"], "steps must be"),
                      (["--preset", "huge"], r"--preset must be tiny \(= cpu\) or paper \(= study\)")]:
        with pytest.raises(ValueError, match=msg):
            CP.config_from_args(_args(argv))


@pytest.mark.slow
def test_probe_in_worker_processes(tmp_path):
    cfg = P.ProbeConfig(task=ProbeTask(seq_len=24, distances=(6, 9), n_distractors=2), depths=(1, 2), steps=2,
                        batch_size=4, eval_samples=8, warmup=1)
    cfg.model.d_model = 16
    report = P.run_probe(cfg, None, echo=lambda s: None, jobs=2)
    assert [(r.depth, r.start) for r in report.results] == [(d, s) for d in (1, 2) for s in ("uniform", "staggered")]
