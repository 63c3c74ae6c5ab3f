"""``fibattn bench train|generate|attention``: fairness plumbing (never timing goals).

Interleaving, medians and spreads of the train bench; per-variant decode thread counts and
repeated prefill of the generate bench; the dense SDPA backend label of the attention bench.
"""
import json
import types

import pytest
import torch
import torch.nn.functional as F

from fibattn.bench import attention as ba
from fibattn.bench import attention_paths as bp
from fibattn.bench import generate as bg
from fibattn.bench import memory as bm
from fibattn.bench import train as bt
from fibattn.bench import train_steps as bts
from fibattn.checks import parse_int_list
from fibattn.cli import main as cli_main
from fibattn.config import ConfigError
from bench_fakes import fake_train
from conftest import own_remote_code_cache


# ----------------------------------------------------------------------------- bench train
@pytest.mark.parametrize("compiled", [False, True])
def test_bench_train_interleaves_round_robin(monkeypatch, compiled):
    durations = {"dense": 2.0, "sparse": 1.0, "dense_compiled": 1.0, "sparse_compiled": 0.5}
    log = fake_train(monkeypatch, durations)
    rows = bt.bench([64], steps=6, tokens=256, compiled=compiled)
    names = ["dense", "sparse"] + (["dense_compiled", "sparse_compiled"] if compiled else [])
    warm = ["dense", "sparse"] + (["dense_compiled"] * 2 + ["sparse_compiled"] * 2 if compiled else [])
    assert log == warm + names * 6                     # every model warmed up, then strict round-robin
    r = rows[0]
    assert r["length"] == 64 and r["batch"] == 4 and r["steps"] == 6
    assert r["dense_tok_s"] == pytest.approx(256 / 2.0) and r["sparse_tok_s"] == pytest.approx(256 / 1.0)
    assert r["ratio"] == pytest.approx(2.0)
    assert r["dense_tok_s_min"] == r["dense_tok_s_max"] == pytest.approx(128.0)
    if compiled:
        assert r["dense_compiled_tok_s"] == pytest.approx(256.0)
        assert r["dense_compiled_over_eager"] == pytest.approx(2.0)
        assert r["sparse_compiled_over_eager"] == pytest.approx(2.0)
    else:
        assert "dense_compiled_tok_s" not in r


def test_bench_train_steps_make_their_loss_as_training_and_dense_on_the_fastest_sdpa(monkeypatch):
    """Every variant's step gets the resolved loss head (auto: plain on CPU, chunked on CUDA) and the SDPA
    order (auto: cuDNN first on CUDA, torch's own on CPU); the warm-up seconds are reported apart."""
    from torch.nn.attention import SDPBackend as B
    seen = []

    def make_step(model_cfg, batch, device, compiled=False, documents=0, **how):
        seen.append(how)
        return (lambda: None), 1
    monkeypatch.setattr(bt, "make_step", make_step)
    row = bt.bench([64], steps=5, tokens=128, loss_head="chunked", dense_sdpa="math")[0]
    assert seen == [{"loss_head": "chunked", "sdpa": [B.MATH]}] * 2
    assert row["dense_warmup_s"] >= 0 and row["sparse_warmup_s"] >= 0 and "dense_peak_mb" not in row
    seen.clear()
    bt.bench([64], steps=5, tokens=128)
    assert seen == [{"loss_head": "plain", "sdpa": None}] * 2
    assert bts.sdpa_backends("auto", torch.device("cuda")) == [B.CUDNN_ATTENTION, B.FLASH_ATTENTION,
                                                              B.EFFICIENT_ATTENTION, B.MATH]
    assert bts.sdpa_backends("flash", torch.device("cpu")) == [B.FLASH_ATTENTION]


def test_bench_train_reports_peak_memory_and_mfu_on_cuda(monkeypatch):
    """On CUDA each variant's peak MB (its state plus one more step's peak) and its MFU (tok/s x the model
    FLOPs per token from its attended columns / the card's peak), checked with the device parts faked."""
    from fibattn.trainer.throughput import flops_per_token
    cfgs = {"dense": bt.variant("tiny", "dense", 64, 12, "auto"), "sparse": bt.variant("tiny", "sparse", 64, 12,
                                                                                       "auto")}
    step = types.SimpleNamespace(state_bytes=lambda: 1 << 20)
    built = {name: (step, 1) for name in cfgs}
    row = {"dense_tok_s": 1000.0, "sparse_tok_s": 2000.0}
    monkeypatch.setattr(bts, "step_peak_bytes", lambda s, dev: 3 << 20)
    monkeypatch.setattr(bts, "peak_flops", lambda dev, bf16: (1e12, "fake"))
    bts.device_fields(row, built, cfgs, torch.device("cuda"))
    assert row["dense_peak_mb"] == row["sparse_peak_mb"] == 4.0
    assert row["sparse_mfu"] == pytest.approx(2000.0 * flops_per_token(cfgs["sparse"])[0] / 1e12)
    assert row["dense_mfu"] == pytest.approx(1000.0 * flops_per_token(cfgs["dense"])[0] / 1e12)
    text = bt.format_table([{**row, "length": 64, "batch": 2, "dense_tok_s_min": 1, "dense_tok_s_max": 1,
                             "sparse_tok_s_min": 1, "sparse_tok_s_max": 1, "ratio": 2.0, "goal": None, "steps": 5,
                             "dense_warmup_s": 1.5, "sparse_warmup_s": 0.5}], compiled=False)
    assert "warm-up s" in text and "1.50" in text and "4 " in text


def test_bench_train_compiled_only_with_checkpointing_is_refused(capsys):
    assert cli_main(["bench", "train", "--compiled-only", "--activation-checkpointing", "full"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compiled-only" in err[0] and "--compile" in err[0]


def test_bench_train_interleave_syncs_only_on_cuda(monkeypatch):
    order = []
    monkeypatch.setattr(bts, "synchronize", lambda dev: order.append("sync"))
    secs = bts.interleave({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 2,
                         torch.device("cpu"))
    assert order == ["sync", "a", "sync", "sync", "b", "sync"] * 2
    assert len(secs["a"]) == len(secs["b"]) == 2


def test_bench_train_median_and_spread():
    s = bts.summarize(100, [1.0, 2.0, 4.0, 0.5, 10.0])     # rates 100, 50, 25, 200, 10 tok/s
    assert s == {"tok_s": 50.0, "min": 10.0, "max": 200.0, "steps": 5}
    assert bts.summarize(10, [1.0, 2.0, 4.0, 0.5, 0.25, 8.0])["tok_s"] == pytest.approx(7.5)  # even: mean of 5, 10
    assert bt.SPREAD == "min-max"


def test_bench_train_median_resists_one_slow_step(monkeypatch):
    """One step stalled by another process moves the spread, not the median."""
    now, calls = [0.0], {"dense": 0, "sparse": 0}

    def make_step(model_cfg, batch, device, compiled=False, documents=0, **how):
        name = model_cfg.attention

        def step():
            calls[name] += 1
            now[0] += 100.0 if (name == "dense" and calls[name] == 3) else 1.0
        return step, 1

    monkeypatch.setattr(bt, "make_step", make_step)
    monkeypatch.setattr(bts, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    r = bt.bench([64], steps=5, tokens=64)[0]
    assert r["dense_tok_s"] == pytest.approx(64.0) and r["ratio"] == pytest.approx(1.0)
    assert r["dense_tok_s_min"] == pytest.approx(0.64) and r["dense_tok_s_max"] == pytest.approx(64.0)


@pytest.mark.parametrize("steps", [0, 1, 4])
def test_bench_train_rejects_fewer_than_5_steps(steps, capsys):
    with pytest.raises(ConfigError, match="--steps must be >= 5"):
        bt.bench([64], steps=steps, tokens=128)
    assert cli_main(["bench", "train", "--steps", str(steps), "--lengths", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps" in err[0] and "Traceback" not in err[0]


def test_bench_train_json_keeps_fields(monkeypatch, capsys):
    fake_train(monkeypatch, {"dense": 2.0, "sparse": 1.0, "dense_compiled": 1.0, "sparse_compiled": 1.0})
    assert cli_main(["bench", "train", "--lengths", "64,128", "--tokens", "256", "--compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 5 and out["stat"] == "median" and out["spread"] == "min-max"
    for row in out["rows"]:
        for key in ("length", "batch", "dense_tok_s", "sparse_tok_s", "ratio", "goal", "dense_compiled_tok_s",
                    "sparse_compiled_tok_s", "dense_compiled_over_eager", "sparse_compiled_over_eager",
                    "dense_tok_s_min", "dense_tok_s_max", "sparse_tok_s_min", "sparse_tok_s_max"):
            assert key in row
    table_rows = bt.bench([64], steps=5, tokens=256)
    text = bt.format_table(table_rows, compiled=False)
    assert "median of 5 timed steps" in text and "(min-max)" in text


def test_bench_train_smoke(one_thread):
    rows = bt.bench([64], steps=5, tokens=128)
    r = rows[0]
    assert r["length"] == 64 and r["batch"] == 2 and r["ratio"] > 0
    assert r["dense_tok_s_min"] <= r["dense_tok_s"] <= r["dense_tok_s_max"]
    assert r["sparse_tok_s_min"] <= r["sparse_tok_s"] <= r["sparse_tok_s_max"]
    with pytest.raises(ConfigError, match="--lengths"):
        parse_int_list("1024,x", "--lengths", minimum=2, error=ConfigError)


def test_bench_train_with_documents_masks_every_step(one_thread, monkeypatch):
    """``--documents N``: each model's forward gets N equal packed documents per row."""
    from fibattn.model.lm import FibLM
    seen, real = [], FibLM.forward

    def spy(self, idx, targets=None, **kw):
        seen.append(kw.get("document_ids"))
        return real(self, idx, targets, **kw)
    monkeypatch.setattr(FibLM, "forward", spy)
    rows = bt.bench([64], steps=5, tokens=128, documents=4)
    assert rows[0]["ratio"] > 0 and seen and all(ids is not None and ids.shape == (2, 64) for ids in seen)
    assert all(ids[0].tolist() == [i // 16 for i in range(64)] for ids in seen)


@pytest.mark.parametrize("compiled", [False, True])
def test_bench_train_checkpointing_interleaves_and_measures_each_mode(monkeypatch, compiled):
    """``--activation-checkpointing full``: the sparse model with none and full, timed round-robin, then one
    memory step each; ratios are full / none, goals only at T=16384."""
    log, now, modes = [], [0.0], {}

    def make_step(model_cfg, batch, device, compiled=False, checkpointing="none", documents=0, *how):
        name = checkpointing + ("_compiled" if compiled else "")
        modes[name] = model_cfg.attention

        def step():
            log.append(name)
            now[0] += {"none": 1.0, "full": 1.25}[checkpointing]
        step.state_bytes = lambda: 1 << 20
        return step, 1

    monkeypatch.setattr(bt, "make_step", make_step)
    monkeypatch.setattr(bts, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(bt, "step_peak_bytes", lambda step, dev: (step(), {"none": 5, "full": 1}[log[-1][:4]] << 20)[1])
    rows = bt.bench_checkpointing([64, 16384], steps=5, tokens=256, compiled=compiled)
    names = ["none", "full"] + (["none_compiled", "full_compiled"] if compiled else [])
    assert log == (names + names * 5 + names) * 2             # warm-up, 5 timed rounds, one memory step each
    assert set(modes.values()) == {"sparse"}
    r = rows[0]
    assert r["none_tok_s"] == pytest.approx(256.0) and r["full_tok_s"] == pytest.approx(256 / 1.25)
    assert r["none_peak_mb"] == pytest.approx(6.0) and r["full_peak_mb"] == pytest.approx(2.0)
    assert r["memory_ratio"] == pytest.approx(1 / 3) and r["speed_ratio"] == pytest.approx(0.8)
    assert ("memory_ratio_compiled" in r) == compiled and r["goal"] is None
    assert rows[1]["goal"] == {"memory": 1 / 3, "speed": 0.7} and rows[1]["batch"] == 1
    text = bt.format_checkpointing_table(rows, compiled)
    assert "full / none: peak memory 0.33x (goal <= 0.33x), tok/s 0.80x (goal >= 0.7x)" in text
    assert "peak MB: the weights, optimizer moments and batch" in text


def test_step_peak_bytes_counts_what_a_step_holds_at_once():
    def step():
        a = torch.empty(4 << 20, dtype=torch.uint8)
        b = torch.empty(8 << 20, dtype=torch.uint8)        # 12 MB held here
        del a, b
        torch.empty(2 << 20, dtype=torch.uint8)
    assert bm.step_peak_bytes(step, torch.device("cpu")) == 12 << 20
    w = torch.zeros(4)
    assert bm.live_bytes(w, w[:2], torch.zeros(2, dtype=torch.float64)) == 16 + 16     # a view counts once


def test_bench_train_checkpointing_smoke(capsys, one_thread):
    assert cli_main(["bench", "train", "--activation-checkpointing", "full", "--lengths", "64", "--tokens", "256",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["activation_checkpointing"] == "full" and "max_memory_allocated" in out["peak_mb"]
    r = out["rows"][0]
    assert r["none_tok_s"] > 0 and r["full_tok_s"] > 0
    assert 0 < r["full_peak_mb"] < r["none_peak_mb"]                # recomputing keeps fewer activations


# ----------------------------------------------------------------------------- bench generate
def test_generate_thread_candidates():
    now = torch.get_num_threads()
    assert bg.thread_candidates("1,0") == sorted({1, now})
    assert bg.thread_candidates("3,3,1") == [1, 3]
    assert bg.thread_candidates(0) == [now]
    assert bg.thread_candidates("1,2", "cuda") == [now]               # no search on CUDA
    for bad in ("x", "-1", ""):
        with pytest.raises(ConfigError, match="--decode-threads"):
            bg.thread_candidates(bad)


def test_generate_decode_reports_a_thread_count_per_variant(one_thread):
    models = {v: bg.build("tiny", v) for v in ("dense", "static")}
    seen = []
    real = torch.set_num_threads
    try:
        torch.set_num_threads = lambda n: (seen.append(n), real(n))[1]
        lat = bg.decode_latency(models, [16, 32], steps=1, reps=1, threads=[1, 2])
    finally:
        torch.set_num_threads = real
    assert torch.get_num_threads() == 1                              # restored
    assert set(lat) == {(v, c) for v in models for c in (16, 32)}
    for ms, nbytes, th in lat.values():
        assert ms > 0 and nbytes > 0 and th in (1, 2)
    assert 1 in seen and 2 in seen                                   # both candidates were timed


def test_generate_repeats_prefill_and_labels_threads(monkeypatch, one_thread):
    calls = []
    real = bg.prefill_time

    def counted(model, length, layers, *more):
        calls.append((model.cfg.attention, length))
        return real(model, length, layers, *more)

    monkeypatch.setattr(bg, "prefill_time", counted)
    args = types.SimpleNamespace(device="cpu", dtype="float32", steps=1, reps=1, decode_threads=[1],
                                 prefill_layers=1, prefill_reps=3)
    recs = bg.measure_shape("tiny", ["dense", "static"], [16], [32], args)
    timed = [c for c in calls if c[1] == 32]
    assert timed == [("dense", 32), ("sparse", 32)] * 3              # 3 runs each, interleaved
    by = {(r["variant"], r["context"]): r for r in recs}
    for v in ("dense", "static"):
        assert by[v, 16]["decode_threads"] == 1
        pre = by[v, 32]
        assert pre["prefill_reps"] == 3 and pre["prefill_threads"] == 1
        assert pre["prefill_s_min"] <= pre["prefill_s"] <= pre["prefill_s_max"]
    text = bg.format_table(recs, bg.ratios(recs), [1])
    assert "threads" in text.splitlines()[0] and "median of 3 interleaved runs" in text


def test_generate_times_the_static_step_of_a_batch(capsys, one_thread):
    """``--decode static --batch 3``: the static engine is what is timed (tokens/s counts every row), the
    run's settings say so, and a dense layer's cache is whole from the start."""
    assert cli_main(["bench", "generate", "--shapes", "tiny", "--contexts", "16,32", "--prefill", "32", "--steps",
                     "2", "--reps", "1", "--prefill-reps", "1", "--decode-threads", "1", "--decode", "static",
                     "--batch", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["decode"] == "static" and doc["settings"]["batch"] == 3
    dec = [r for r in doc["results"] if "decode_ms" in r]
    assert {(r["variant"], r["context"]) for r in dec} == {(v, c) for v in bg.VARIANTS for c in (16, 32)}
    for r in dec:
        assert r["decode"] == "static" and r["batch"] == 3
        assert r["decode_tok_s"] == pytest.approx(3e3 / r["decode_ms"])
    dense = {r["context"]: r["cache_bytes"] for r in dec if r["variant"] == "dense"}
    assert dense[16] < dense[32]                     # sized to the context, not grown from 256 rows


def test_generate_prefill_compiled_and_in_chunks(capsys, one_thread, dynamo_only):
    """``--contexts '' --decode compiled --prefill-chunk 24``: prefill only (no decode step compiled), compiled, in
    chunks, its compile run untimed, and reported as a total (the attention core is inside the graphs). Dynamo
    captures whole graphs here, but without inductor's code generation (20-30 s on 2 cores): what inductor makes
    of a chunked prefill is test_prefill_chunks.py's."""
    torch._dynamo.reset()
    assert cli_main(["bench", "generate", "--shapes", "tiny", "--contexts", "", "--prefill", "48",
                     "--variants", "static", "--prefill-reps", "1", "--decode", "compiled", "--prefill-chunk", "24",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (pre,) = doc["results"]
    assert "decode_ms" not in pre and doc["ratios"] == {"tiny": {}}
    assert pre["prefill_compiled"] and pre["prefill_attn_s"] is None and pre["prefill_s"] > 0
    assert cli_main(["bench", "generate", "--contexts", "", "--prefill", ""]) == 2
    assert "--contexts and --prefill are both empty" in capsys.readouterr().err


def test_hf_generate_times_the_remote_code_export_beside_fibattn(capsys, tmp_path, one_thread):
    """``bench hf-generate``: the tiny model exported as remote code and loaded back with transformers, both sides'
    decode tokens/s, and the same greedy tokens (float32 on a CPU)."""
    pytest.importorskip("transformers")
    with own_remote_code_cache(tmp_path):
        assert cli_main(["bench", "hf-generate", "--contexts", "40", "--new", "4", "--reps", "1", "--json"]) == 0
    (rec,) = json.loads(capsys.readouterr().out)["results"]
    assert rec["context"] == 40 and rec["tokens_equal"] and rec["hf_tok_s"] > 0 and rec["fibattn_tok_s"] > 0
    assert cli_main(["bench", "hf-generate", "--contexts", "4", "--new", "4"]) == 2


@pytest.mark.parametrize("argv, flag", [(["--decode-threads", "a"], "--decode-threads"),
                                        (["--prefill-reps", "0"], "--prefill-reps"),
                                        (["--batch", "0"], "--batch")])
def test_generate_rejects_bad_thread_and_rep_flags(argv, flag, capsys):
    assert cli_main(["bench", "generate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0]


# ----------------------------------------------------------------------------- bench attention
def _cfg(**kw):
    return ba.BenchConfig(lengths=[64], repeats=2, heads=2, kv_heads=2, head_dim=16, memory=False,
                          paths=["dense", "integer"], **kw)


def _spy_sdpa(monkeypatch):
    """Record which SDPA backends were enabled at each dense call."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return real(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def test_attention_dense_backend_label_on_cpu(monkeypatch, one_thread):
    seen = _spy_sdpa(monkeypatch)
    recs = {r.path: r for r in ba.bench_length(_cfg(), 64)}
    assert recs["dense"].backend == "sdpa-cpu-flash"                 # torch's CPU flash kernel runs these
    assert recs["dense"].ms > 0 and recs["integer"].backend == "cpu"
    assert seen and all(s == (True, False) for s in seen)            # every dense call: flash alone
    assert "sdpa-cpu-flash" in ba.table(list(recs.values()))
    assert bp.sdpa_order()[0] == "flash" and bp.sdpa_order()[-1] == "math"


def test_attention_dense_backend_falls_through_to_first_that_runs(monkeypatch, one_thread):
    seen = _spy_sdpa(monkeypatch)
    monkeypatch.setattr(bp, "sdpa_order", lambda: ["efficient", "cudnn", "math", "flash"])   # no CUDA kernels here
    recs = {r.path: r for r in ba.bench_length(_cfg(), 64, backward=False)}
    assert recs["dense"].backend == "sdpa-cpu-math" and recs["dense"].mode == "fwd"
    assert seen[-3:] == [(False, True)] * 3                         # warm-up pick + 2 timed rounds: math alone
    monkeypatch.setattr(bp, "sdpa_order", lambda: ["efficient", "cudnn"])
    with pytest.raises(RuntimeError, match="no backend runs"):
        ba.bench_length(_cfg(), 64)


def test_memory_worker_measures_a_path_in_a_process_of_its_own():
    """The bench's CPU peak-memory figure comes from a fresh process per path (``measure_in_subprocess``)."""
    cfg = ba.BenchConfig(lengths=[64], repeats=1, heads=2, kv_heads=2, head_dim=16, paths=["integer"])
    mem = ba.measure_in_subprocess(cfg, "integer", 64)
    assert set(mem) == {"peak_extra_mb", "ms"} and mem["peak_extra_mb"] >= 0 and mem["ms"] > 0


def test_attention_json_backend_field(capsys, one_thread):
    assert cli_main(["bench", "attention", "--lengths", "32", "--repeats", "1", "--no-memory", "--paths", "dense",
                     "--heads", "2", "--head-dim", "16", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    rec = lines[0]
    assert rec["path"] == "dense" and rec["backend"].startswith("sdpa-cpu-")
    host = [r for r in lines if r.get("check") == "host_overhead"]       # values: the benchmark's business
    assert [(r["op"], r["cold"]) for r in host] == [("integer", False), ("interpolated", False), ("integer", True),
                                                    ("interpolated", True)] and all(r["public_us"] > 0 for r in host)
    assert bp.sdpa_label("flash", "cuda:0") == "sdpa-flash" and bp.sdpa_label("math", "cpu") == "sdpa-cpu-math"


def test_attention_documents_time_the_masked_ops_next_to_the_plain_ones(capsys, one_thread):
    assert cli_main(["bench", "attention", "--lengths", "64", "--repeats", "1", "--no-memory", "--paths",
                     "integer,interpolated", "--heads", "2", "--head-dim", "16", "--documents", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[2] for line in out.splitlines() if line.strip().startswith("64 ")]
    assert rows == ["integer", "integer-docs", "interpolated", "interpolated-docs"]
    assert "document masking (4 documents per row), integer fwd+bwd at T=64" in out
    assert bp.document_ids(bp.BenchConfig(batch=2, documents=3), 7, "cpu").tolist() == [[0, 0, 0, 1, 1, 2, 2]] * 2


def test_attention_times_the_pattern_asked_for(capsys, one_thread):
    """--window, --fib-k and --alpha set the pattern both fused ops attend (the header names it)."""
    assert cli_main(["bench", "attention", "--lengths", "64", "--repeats", "1", "--no-memory", "--paths",
                     "integer,interpolated", "--heads", "2", "--head-dim", "16", "--window", "4", "--fib-k", "8",
                     "--alpha", "1.37"]) == 0
    out = capsys.readouterr().out
    assert "W=4 fib K=8 alpha=1.37" in out.splitlines()[0]
    assert [line.split()[2] for line in out.splitlines() if line.strip().startswith("64 ")] == ["integer",
                                                                                                "interpolated"]


@pytest.mark.parametrize("argv, flag", [(["--alpha", "0"], "--alpha"), (["--alpha", "inf"], "--alpha"),
                                        (["--window", "-1"], "--window"), (["--fib-k", "0"], "--fib-k"),
                                        (["--fib-k", "65"], "--fib-k")])
def test_attention_refuses_a_bad_pattern(argv, flag, capsys):
    assert cli_main(["bench", "attention", "--lengths", "64", "--no-memory", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0]
