"""``fibattn probe --extrapolate``: the reach computation against brute force, a micro run end to end,
and the CLI's refusals (one line, exit 2, nothing written)."""
import itertools
import json

import numpy as np
import pytest

from fibattn import plots
from fibattn.cli import main
from fibattn.schedules import attended_distances, layer_alphas, matched_window
from fibattn.study.probe import ProbeModel
from fibattn.study.probe_extrapolate import ExtrapolateConfig, preset
from fibattn.study.probe_extrapolate_report import run_extrapolate
from fibattn.study.probe_reach import (bucket_label, coverage, distance_buckets, reachable,
                                       smallest_unreachable)


def brute_reach(sets, length):
    """Every sum of one distance per set (0 always allowed: the residual path), below ``length``."""
    sums = {sum(c) for c in itertools.product(*[sorted(set(s) | {0}) for s in sets])}
    return {d for d in sums if d < length}


@pytest.mark.parametrize("length", [7, 40, 130])
def test_reach_matches_brute_force(length):
    rng = np.random.default_rng(length)
    cases = [[attended_distances(3, a, "fib", length) for a in layer_alphas("linear", 3)],
             [attended_distances(2, 1.0, "fib", length)] * 3,
             [attended_distances(5, 1.0, "none", length)] * 2,
             [list(range(length))] * 2,
             [sorted(rng.choice(np.arange(1, length + 5), size=4, replace=False).tolist()) for _ in range(3)]]
    for sets in cases:
        got = reachable(sets, length)
        assert set(np.flatnonzero(got).tolist()) == brute_reach(sets, length)
        want = brute_reach(sets, length)
        missing = [d for d in range(1, length - 1) if d not in want]
        assert smallest_unreachable(got, length - 2) == (missing[0] if missing else None)
        for b, share in zip(distance_buckets(length - 2), coverage(got, distance_buckets(length - 2)).values()):
            assert share == pytest.approx(np.mean([d in want for d in range(b[0], b[1] + 1)]))


def test_buckets():
    assert distance_buckets(14) == [(1, 1), (2, 3), (4, 7), (8, 14)]
    assert [bucket_label(b) for b in distance_buckets(14)] == ["1", "2-3", "4-7", "8-15"]
    assert distance_buckets(1) == [(1, 1)]


def micro(**kw):
    return ExtrapolateConfig(seq_len=16, factors=(1, 4), n_layers=2, model=ProbeModel(d_model=16), n_distractors=2,
                             steps=2, batch_size=4, warmup=1, eval_samples=4, **kw)


def test_extrapolate_micro_end_to_end(tmp_path, one_thread):
    cfg = micro()
    report = run_extrapolate(cfg, tmp_path, plot=False, echo=lambda s: None)
    doc = json.loads((tmp_path / "probe_extrapolate.json").read_text())
    names = [r["name"] for r in doc["rows"]]
    assert names == ["fib_linear", "fib_fixed", "window_matched", "dense", "dense+ntk", "dense+yarn"]
    assert doc["config"]["lengths"] == [16, 64]
    W = matched_window(4, layer_alphas("linear", 2), "fib", 16)
    assert doc["config"]["matched_window"] == W and doc["rows"][2]["window"] == W
    sets = {"fib_linear": lambda n: [attended_distances(4, a, "fib", n) for a in (0.5, 1.5)],
            "fib_fixed": lambda n: [attended_distances(4, 1.0, "fib", n)] * 2,
            "window_matched": lambda n: [list(range(W + 1))] * 2,
            "dense": lambda n: [list(range(n))] * 2}
    for row in doc["rows"]:
        for n in (16, 64):
            labels = [bucket_label(b) for b in distance_buckets(n - 2)]
            acc = row["accuracy"][str(n)]
            assert list(acc) == labels and all(0 <= a <= 1 for a in acc.values())
            want = brute_reach(sets[row["variant"]](n), n)
            cov = row["coverage"][str(n)]
            for b, lab in zip(distance_buckets(n - 2), labels):
                assert cov[lab] == pytest.approx(np.mean([d in want for d in range(b[0], b[1] + 1)]))
            missing = [d for d in range(1, n - 1) if d not in want]
            assert row["unreachable"][str(n)] == (missing[0] if missing else None)
    dense = {r["name"]: r["accuracy"] for r in doc["rows"] if r["variant"] == "dense"}
    assert dense["dense+ntk"]["16"] == dense["dense"]["16"] == dense["dense+yarn"]["16"]   # factor 1: plain RoPE
    assert doc["rows"][3]["unreachable"]["64"] is None and doc["rows"][2]["unreachable"]["64"] == 2 * W + 1
    md = (tmp_path / "probe_extrapolate.md").read_text()
    assert md.startswith("# Retrieval past the training length") and "| model | length | 1 | 2-3 |" in md
    assert "| window_matched | 64 (4×) |" in md and "smallest unreachable" in md
    assert len(report.rows) == 6 and not (tmp_path / "probe_extrapolate.png").exists()


def test_extrapolate_heat_map(tmp_path, one_thread):          # default suite: about 1 s
    if not plots.available():
        pytest.skip("matplotlib is not installed")
    run_extrapolate(micro(variants=("window_matched", "dense")), tmp_path, echo=lambda s: None)
    assert (tmp_path / "probe_extrapolate.png").read_bytes()[:4] == b"\x89PNG"


def test_presets_share_settings_across_variants():
    cpu, paper = preset("cpu"), preset("paper")
    assert preset("tiny") == cpu and preset("study") == paper
    assert cpu.factors == (1, 4, 16) and set(cpu.variants) == {"fib_linear", "fib_fixed", "window_matched", "dense"}
    cpu.validate()
    paper.validate()
    cfgs = [cpu.model_config(v) for v in cpu.variants]
    for field in ("d_model", "n_layers", "n_heads", "seq_len", "max_seq_len", "vocab_size", "reach"):
        assert len({getattr(c, field) for c in cfgs}) == 1, field
    assert cfgs[0].max_seq_len == 16 * cpu.seq_len


@pytest.mark.parametrize("argv, needle", [
    (["--distances", "3"], "--distances does not apply to --extrapolate"),
    (["--starts", "uniform"], "--starts does not apply to --extrapolate"),
    (["--marked"], "--marked does not apply to --extrapolate"),
    (["--depths", "2,4"], "--depths takes one value with --extrapolate"),
    (["--factors", "1,0"], "--factors must be a comma-separated list of integers >= 1"),
    (["--factors", "4,4"], "factors (--factors) must be distinct"),
    (["--variants", "fib_linear,sparse"], "variants (--variants) must be distinct names among"),
    (["--reach", "far"], "reach (--reach) must be one of"),
    (["--seq-len", "3"], "seq_len (--seq-len) must be an integer >= 4"),
    (["--steps", "0"], "steps must be an integer >= 1 (--steps)"),
    (["--preset", "huge"], "--preset must be tiny (= cpu) or paper (= study) with --extrapolate"),
    (["--jobs", "-1"], "--jobs must be an integer >= 0"),
])
def test_cli_refuses_bad_flags(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(["probe", "--extrapolate", "--out", str(out), *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_cli_refuses_extrapolate_flags_without_it(tmp_path, capsys):
    rc = main(["probe", "--factors", "1,4", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--factors applies to --extrapolate only" in err[0]


def test_cli_refuses_to_overwrite_a_users_file(tmp_path, capsys):
    (tmp_path / "probe_extrapolate.md").write_text("my notes\n")
    rc = main(["probe", "--extrapolate", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "probe_extrapolate.md" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe_extrapolate.md"]
