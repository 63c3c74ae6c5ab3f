"""fibattn eval: perplexity, the same-tokens rule, reach, dense window, bits per byte, buckets, run folders, CLI."""
import argparse
import json
import math
import sqlite3

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fibattn import config as C
from fibattn.eval import perplexity as E
from fibattn.config import ModelConfig
from fibattn.data import ByteTokenizer
from fibattn.model.lm import FibLM
from fibattn.cli import evaluate as CE
from fibattn.eval.run_folder import evaluate_run
from run_helpers import write_checkpoint  # noqa: E402


class Unigram(nn.Module):
    """Fixed logits at every position: token t costs ``logsumexp(w) - w[t]``, whatever the context."""

    def __init__(self, logits):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(logits, dtype=torch.float32))

    def forward(self, x):
        return self.w.expand(x.shape[0], x.shape[1], -1)


def _small(**kw):
    base = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=32, window=2, base_k=6,
                backend="torch")
    base.update(kw)
    torch.manual_seed(0)
    return FibLM(ModelConfig(**base))


RNG = np.random.default_rng(0)
TOKS = RNG.integers(0, 4, size=1000).astype(np.uint16)


def test_perplexity_is_exp_mean_token_nll_on_a_stub_model():
    w = [0.0, 1.0, 2.0, -1.0]
    rep = E.evaluate(Unigram(w), {"a": TOKS}, [16, 64], tokens=600, batch_size=3)
    n = 576                                                        # 600 rounded down to a multiple of 64
    cost = np.log(np.exp(w).sum()) - np.asarray(w)
    expected = float(np.mean(cost[TOKS[1:n + 1]]))
    for L in (16, 64):
        r = rep.record("a", L)
        assert r.tokens == n and r.windows == n // L
        assert r.nll == pytest.approx(expected, rel=1e-6)
        assert r.ppl == pytest.approx(math.exp(expected), rel=1e-6)
        assert r.bpb is None                                       # no tokenizer given


def test_every_length_scores_the_same_tokens():
    lengths = [24, 48, 96]
    n = E.scored_budget(len(TOKS), 500, lengths)
    assert n == 480 and n % 96 == 0
    ref = np.arange(1, n + 1)
    for L in lengths:
        pos = E.scored_target_positions(n, L)
        assert len(pos) == n and np.array_equal(np.sort(pos), ref)      # same count, same identity
        assert np.array_equal(pos, ref)                                   # back-to-back windows
    rep = E.evaluate(Unigram([0.3, -0.2, 0.1, 0.0]), {"a": TOKS}, lengths, tokens=500)
    # a context-free model scores the same tokens the same way: identical ppl at every length
    assert len({round(r.nll, 10) for r in rep.records}) == 1
    assert {r.scored_sha256 for r in rep.records} == {rep.datasets["a"]["sha256"]}
    assert "scored the same 480 target tokens" in rep.fairness_lines()[0]
    with pytest.raises(ValueError, match="needs at least 97"):
        E.scored_budget(50, 500, lengths, "tiny")


def test_reach_changes_distances_as_spec_says():
    model = _small(base="pow2", schedule="fixed", seq_len=64, max_seq_len=1024)
    study = model.distances(256)
    with E.reach_mode(model, "train"):
        train = model.distances(256)
    assert all({64, 128} <= set(d) for d in study)               # study: rebuilt at 4x the training length
    assert all(max(d) <= 63 and not {64, 128} & set(d) for d in train)
    assert model.distances(256) == study                          # restored afterwards
    x = torch.from_numpy(RNG.integers(0, 32, size=2000))
    a = E.evaluate(model, {"a": x.numpy()}, [64, 256], tokens=512, reach="study")
    b = E.evaluate(model, {"a": x.numpy()}, [64, 256], tokens=512, reach="train")
    assert a.record("a", 64).nll == pytest.approx(b.record("a", 64).nll, abs=1e-6)   # same at the train length
    assert a.record("a", 256).nll != pytest.approx(b.record("a", 256).nll, abs=1e-6)
    assert a.records[0].reach == a.records[0].mode == "study" and b.records[0].mode == "train"
    with pytest.raises(ValueError, match="reach must be one of study, train"):
        E.evaluate(model, {"a": x.numpy()}, [64], tokens=64, reach="far")


def test_banded_attention_matches_a_masked_reference():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 50, 8), torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 8)
    for band in (1, 7, 16, 50, 80):
        d = torch.arange(50)[:, None] - torch.arange(50)[None, :]
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                             attn_mask=(d >= 0) & (d < band))
        assert torch.allclose(E.banded_attention(q, k, v, band), ref, atol=1e-5)


def test_dense_window_equals_plain_when_it_covers_the_sequence():
    model = _small(attention="dense", seq_len=32)
    toks = RNG.integers(0, 32, size=700)
    plain = E.evaluate(model, {"a": toks}, [16, 32, 64], tokens=640)
    win = E.evaluate(model, {"a": toks}, [16, 32, 64], tokens=640, dense_window=True)
    for L in (16, 32):
        assert win.record("a", L).nll == pytest.approx(plain.record("a", L).nll, abs=1e-6)
    assert win.record("a", 64).nll != pytest.approx(plain.record("a", 64).nll, abs=1e-6)
    assert win.records[0].mode == "dense-window" and win.records[0].dense_window == 32
    assert all("attend" not in layer.__dict__ for layer in model.layers())          # restored
    with pytest.raises(ValueError, match="needs a dense model"):
        E.evaluate(_small(), {"a": toks}, [16], tokens=64, dense_window=True)


def test_bits_per_byte():
    assert E.bits_per_byte(10 * math.log(2), 5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        E.bits_per_byte(1.0, 0)
    tok = ByteTokenizer()
    toks = np.array([72, 105, 255, 33, 10] * 40, dtype=np.uint8)
    assert E.count_bytes(tok, toks[:5]) == 4                      # eos (255) is no byte
    rep = E.evaluate(Unigram([0.0] * 256), {"b": toks}, [8], tokens=160, tokenizer=tok)
    r = rep.record("b", 8)
    assert r.bytes == 128 and r.nll == pytest.approx(math.log(256))
    assert r.bpb == pytest.approx(r.nll * 160 / (math.log(2) * 128))


def test_per_position_buckets():
    pos_sum = np.arange(64, dtype=float) * 3                      # 3 windows, loss = position
    b = E.position_buckets(pos_sum, 3, 8)
    assert [x["start"] for x in b] == list(range(0, 64, 8)) and b[-1]["end"] == 64
    assert b[0]["loss"] == pytest.approx(3.5) and b[-1]["loss"] == pytest.approx(59.5)
    assert len(E.position_buckets(np.ones(5), 1, 32)) == 5         # never more buckets than positions
    rep = E.evaluate(_small(), {"a": RNG.integers(0, 32, size=300)}, [32, 64], tokens=256, buckets=4)
    for r in rep.records:
        assert len(r.buckets) == 4
        assert np.mean([x["loss"] for x in r.buckets]) == pytest.approx(r.nll, rel=1e-6)


def test_evaluate_restores_mode_and_validates():
    model = _small()
    model.train()
    E.evaluate(model, {"a": TOKS}, [8], tokens=64)
    assert model.training
    for bad, msg in [(dict(lengths=[0]), "length must be an integer >= 1"), (dict(lengths=[]), "at least one"),
                     (dict(lengths=[8], tokens=0), "tokens must"), (dict(lengths=[8], batch_size=0), "batch_size")]:
        lengths = bad.pop("lengths")
        with pytest.raises(ValueError, match=msg):
            E.evaluate(model, {"a": TOKS}, lengths, **bad)
    with pytest.raises(ValueError, match="1-D integer"):
        E.evaluate(model, {"a": np.zeros((4, 4))}, [8])


# ----------------------------------------------------------------------------- run folders and the CLI
class FakeData:
    def __init__(self, splits):
        self.splits, self.tokenizer = splits, ByteTokenizer()

    @property
    def val_names(self):
        return list(self.splits)

    def val_tokens(self, name):
        return self.splits[name]


def _make_run(tmp_path, schedule="linear", data_dir="nowhere"):
    cfg = C.RunConfig(name="t")
    cfg.model = ModelConfig(vocab_size=256, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=32,
                            window=2, base_k=6, schedule=schedule, backend="torch")
    cfg.data.out_dir = str(data_dir)
    cfg.eval = C.EvalConfig(lengths=[32, 64], tokens=256, batch_size=2)
    run = tmp_path / "runs" / "r1"
    cfg.train.out_dir = str(run)
    torch.manual_seed(0)
    model = FibLM(cfg.model)
    write_checkpoint(run, 7, model, cfg, tokenizer=False)
    return run, model


def test_evaluate_run_writes_json_db_and_plots(tmp_path):
    run, _ = _make_run(tmp_path, schedule="learned")
    rows = [json.dumps({"step": s, "loss": 1.0, "alphas": [1.0, 1.0 + s / 1000]}) for s in (2, 4)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    data = FakeData({"x": RNG.integers(0, 255, size=400).astype(np.uint8), "y": RNG.integers(0, 255, size=400)})
    rep = evaluate_run(run, data=data, device="cpu", datasets=["x"])
    assert [r.length for r in rep.records] == [32, 64] and rep.settings["step"] == 7
    evaluate_run(run, data=data, device="cpu", lengths=[32], reach="train", datasets=["x"], plot=False)
    doc = json.loads((run / "eval.json").read_text())
    keys = sorted((r["dataset"], r["length"], r["mode"]) for r in doc["results"])     # a list: duplicates show
    assert keys == [("x", 32, "study"), ("x", 32, "train"), ("x", 64, "study")]      # merged, not overwritten
    assert doc["results"][0]["buckets"] and doc["results"][0]["step"] == 7
    assert "largest move from start: layer" in doc["alphas"]["largest_move_line"]
    with sqlite3.connect(tmp_path / "runs" / "results.sqlite") as con:
        got = con.execute("SELECT run, dataset, length, reach FROM eval_results ORDER BY length, reach").fetchall()
    assert got == [("r1", "x", 32, "study"), ("r1", "x", 32, "train"), ("r1", "x", 64, "study")]
    assert (run / "eval_positions_study.png").is_file() and (run / "alphas.md").is_file()
    assert (run / "alphas.png").is_file()
    with pytest.raises(ValueError, match="unknown dataset 'z'.*x, y"):
        evaluate_run(run, data=data, device="cpu", datasets=["z"])


def test_evaluating_the_same_dataset_length_and_mode_again_replaces_its_record(tmp_path):
    """eval.json and the results DB hold one record per (dataset, length, mode): a re-evaluation replaces it
    (its new token budget shows), other modes at the same length and other lengths stay, and a request that
    names a length or dataset twice records it once. Compared as lists, so a duplicate cannot hide."""
    from collections import Counter
    run, _ = _make_run(tmp_path)
    data = FakeData({"x": RNG.integers(0, 255, size=400), "y": RNG.integers(0, 255, size=400)})
    evaluate_run(run, data=data, device="cpu", lengths=[32, 64], tokens=256, plot=False, alpha_report=False)
    yarn = evaluate_run(run, data=data, device="cpu", lengths=[32], datasets=["x"], tokens=256, mode="yarn",
                        rope_factor=2.0, plot=False, alpha_report=False).settings["mode"]
    again = evaluate_run(run, data=data, device="cpu", lengths=[32, 32], datasets=["x", "x"], tokens=128,
                         plot=False, alpha_report=False)
    assert [(r.dataset, r.length, r.mode) for r in again.records] == [("x", 32, "study")]
    want = sorted([("x", 32, "study"), ("x", 64, "study"), ("y", 32, "study"), ("y", 64, "study"), ("x", 32, yarn)])
    doc = json.loads((run / "eval.json").read_text())
    keys = [(r["dataset"], r["length"], r["mode"]) for r in doc["results"]]
    assert sorted(keys) == want and max(Counter(keys).values()) == 1
    tokens = {(r["dataset"], r["length"], r["mode"]): r["tokens"] for r in doc["results"]}
    assert tokens[("x", 32, "study")] == again.records[0].tokens < tokens[("y", 32, "study")] == tokens[("x", 32, yarn)]
    with sqlite3.connect(tmp_path / "runs" / "results.sqlite") as con:
        rows = con.execute("SELECT dataset, length, reach, tokens FROM eval_results WHERE run='r1'").fetchall()
    assert sorted((d, n, m) for d, n, m, _ in rows) == want
    assert {(d, n, m): t for d, n, m, t in rows} == tokens


def _cli(argv):
    parser = argparse.ArgumentParser()
    CE.configure_parser(parser)
    return CE.run(parser.parse_args(argv))


def test_cli_bad_input(tmp_path, capsys):
    from fibattn.cli import main
    run, _ = _make_run(tmp_path, data_dir=tmp_path / "missing-data")
    with pytest.raises(FileNotFoundError, match="run folder .*does not exist"):
        _cli([str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="--lengths must be a comma-separated list of integers >= 1"):
        _cli([str(run), "--lengths", "1024,0"])
    with pytest.raises(ValueError, match="--lengths"):
        _cli([str(run), "--lengths", "abc"])
    with pytest.raises(ValueError, match="--reach must be one of study, train"):
        _cli([str(run), "--reach", "wide"])
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        _cli([str(run), "--device", "tpu"])
    with pytest.raises(FileNotFoundError, match="validation data not found .*pass --data DIR"):
        _cli([str(run), "--device", "cpu"])
    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert "run folder" in capsys.readouterr().err
