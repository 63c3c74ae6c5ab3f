"""``bench attention``'s achieved GFLOP/s, matmul peak and the kernels timed alone (issue 29)."""
import dataclasses
import json

import pytest
import torch

from fibattn.bench import attention as ba
from fibattn.bench import attention_flops as bf
from fibattn.ops import cpu_backend
from fibattn.ops.columns import ColumnSpec, host_columns
from fibattn.schedules import as_base

pytestmark = pytest.mark.skipif(cpu_backend.unavailable("cpu") is not None, reason="cpu kernels unavailable")


def test_flops_count_rows_per_attended_column():
    cfg = ba.BenchConfig(heads=2, head_dim=16, window=2, fib_k=4, alpha=1.0)
    # integer at T=10: distances 0, 1, 2 (window), 3 and 5 (fib:4 = 1, 2, 3, 5 at alpha 1): 10 + 9 + 8 + 7 + 5 rows
    assert bf.columns_rows(cfg, "integer", 10) == 39
    assert bf.gflop_rate(cfg, "integer", 10, 1.0) == pytest.approx(12 * 16 * 2 * 39 / 1e-3 / 1e9)
    assert bf.gflop_rate(cfg, "integer", 10, 1.0, backward=False) == pytest.approx(4 * 16 * 2 * 39 / 1e-3 / 1e9)
    assert bf.gflop_rate(cfg, "dense", 10, 1.0) is None and bf.gflop_rate(cfg, "integer", 10, None) is None
    # an interpolated rung counts once (one score), although it reads two rows
    assert bf.columns_rows(cfg, "interpolated-docs", 10) == bf.columns_rows(cfg, "interpolated", 10) < 2 * 39


def test_fused_paths_report_their_rate_against_the_peak(monkeypatch, one_thread):
    seen = []
    real = cpu_backend._fast

    def spy():
        fast = real()
        seen.append(fast.value)
        return fast

    monkeypatch.setattr(cpu_backend, "_fast", spy)
    cfg = ba.BenchConfig(lengths=[64], repeats=1, heads=2, kv_heads=1, head_dim=16, memory=False,
                         paths=["dense", "integer", "interpolated"])
    recs = ba.bench_length(cfg, 64)
    assert [r.backend for r in recs][1:] == ["cpu", "cpu"] and recs[0].gflop_s is None
    assert all(r.gflop_s > 0 for r in recs[1:]) and set(seen) == {1}     # the vector rows only
    lines = bf.flop_lines(recs, 100.0)
    assert len(lines) == 1 and lines[0].startswith("T=64 fwd+bwd: integer ") and "dense" not in lines[0]
    assert lines[0].count("% of peak)") == 2 and ", interpolated " in lines[0]
    assert bf.matmul_peak(n=64, rounds=1) > 0
    assert "fp32 matmul peak: 12.5 GFLOP/s" in bf.peak_line(12.5)
    assert torch.get_num_threads() == 1


def test_kernel_ratio_is_the_median_of_each_rounds_ratio():
    """Rounds are interleaved, so a round's two times share the machine's load of that moment."""
    slow = ba.Record(64, "integer-docs", "cpu", ms=3.0, gflop_s=1.0, rounds_ms=[2.0, 8.0, 3.0])
    fast = ba.Record(64, "integer", "cpu", ms=1.0, gflop_s=3.0, rounds_ms=[1.0, 8.0, 1.0])
    assert bf.round_ratio(slow, fast) == 2.0                     # ratios 2, 1, 3 (medians alone: 3)
    assert bf.round_ratio(ba.Record(64, "a", "cpu", ms=3.0), ba.Record(64, "b", "cpu", ms=2.0)) == 1.5
    assert bf.round_ratios(slow, fast) == [2.0, 1.0, 3.0]
    # the rounds' spread beside the median: the run's noise, next to a ratio held against a goal
    assert bf.spread([2.0]) == "" and bf.ratio_range([2.0]) is None and bf.spread((1.5, 2.5)) == ", rounds 1.50 to 2.50"
    interp = ba.Record(64, "interpolated", "cpu", ms=1.4, rounds_ms=[1.3, 12.0, 1.5])
    text = ba.table([fast, interp])
    assert "interpolated/integer = 1.50x (median of the rounds' ratios, rounds 1.30 to 1.50)" in text


def test_kernels_alone_write_into_tensors_allocated_once(monkeypatch, one_thread):
    cfg = ba.BenchConfig(lengths=[40], repeats=2, heads=2, kv_heads=1, head_dim=16, window=3, fib_k=5,
                         memory=False, paths=["integer", "interpolated"])
    monkeypatch.setattr(bf, "MM_N", 64)
    checks = bf.kernel_checks(cfg, 50.0)
    assert [(c["check"], c["T"], c["op"]) for c in checks] == [("cpu_kernels", 40, "integer"),
                                                               ("cpu_kernels", 40, "interpolated")]
    assert all(c["peak_gflop_s"] == 50.0 and "rows_ratio" not in c for c in checks)
    assert all(c["far_cost_range"][0] <= c["far_cost"] <= c["far_cost_range"][1] for c in checks)
    assert all(c["op_ms"] > 0 and c["kernels_gflop_s"] > 0 and c["mm_gflop_s"] > 0 and c["far_cost"] > 0
               for c in checks)
    json.dumps(checks)                                            # what --json prints
    lines = bf.kernel_lines(checks)
    assert len(lines) == 1 and lines[0].startswith("T=40 fwd+bwd, public op vs its cpu kernels alone vs torch.mm 64x64")
    assert "integer " in lines[0] and "; interpolated " in lines[0] and "% of peak)" in lines[0]
    assert lines[0].count("of torch.mm") == 4 and lines[0].count(", torch.mm ") == 2
    assert lines[0].count("far columns' cost ") == 2 and lines[0].count(", rounds ") == 2
    calls = []
    for name in ("attn_forward", "attn_backward"):
        real = getattr(cpu_backend, name)
        monkeypatch.setattr(cpu_backend, name, lambda *a, _real=real, _name=name, **kw: (
            calls.append((_name, kw.get("into") is not None)), _real(*a, **kw))[1])
    kt = bf.kernel_ms(cfg, "integer", 40, 2)
    assert kt.op_ms > 0 and kt.kernels_ms > 0 and kt.mm_gflop_s > 0 and kt.far_cost > 0
    # three rounds (one warm-up) of the kernels alone on the op's columns and on the packed ones; they always
    # write into the tensors made beforehand (the public op reaches the kernels through the op interface)
    assert calls == [("attn_forward", True), ("attn_backward", True)] * 6
    assert bf.kernel_checks(ba.BenchConfig(device="cuda:0", paths=["integer"]), None) == []


def test_grouped_heads_are_timed_beside_one_kv_head_per_query_head(monkeypatch, one_thread):
    """Issue 29's grouped-heads goal in the same rounds: the kernels alone on 2 KV heads, the same queries."""
    assert [bf.grouped_kv_heads(ba.BenchConfig(heads=h, kv_heads=kv)) for h, kv in
            ((8, 8), (6, 6), (8, 2), (2, 2), (3, 3))] == [2, 2, None, None, None]
    monkeypatch.setattr(bf, "MM_N", 64)
    cfg = ba.BenchConfig(lengths=[40], repeats=3, heads=4, kv_heads=4, head_dim=16, window=3, fib_k=5,
                         memory=False, paths=["integer"])
    kv_heads = []
    monkeypatch.setattr(cpu_backend, "attn_backward", lambda *a, _real=cpu_backend.attn_backward, **kw: (
        kv_heads.append(a[1].shape[1]), _real(*a, **kw))[1])
    kt = bf.kernel_ms(cfg, "integer", 40, 3)
    assert kt.grouped_kv_heads == 2 and kt.grouped_ratio > 0
    assert kt.grouped_range[0] <= kt.grouped_ratio <= kt.grouped_range[1]
    assert kv_heads.count(2) == 4 and kv_heads.count(4) == 8          # 3 rounds and a warm-up; plain and packed
    check = bf.kernel_checks(cfg, None)[0]
    assert check["grouped_kv_heads"] == 2 and check["grouped_ratio"] > 0
    json.dumps(check)
    assert ", grouped heads " in bf.kernel_lines([check])[0] and "with 2 KV heads" in bf.kernel_lines([check])[0]
    assert bf.kernel_checks(dataclasses.replace(cfg, kv_heads=2), None)[0]["grouped_ratio"] is None


def test_packed_columns_keep_every_tap_and_weight_next_to_the_diagonal():
    """The far columns' cost compares the op's columns with these: the same taps, read from recent rows."""
    T = 4096
    exact = host_columns(ColumnSpec((0, 1, 2, 20, 51, 1480)), None, T)
    assert bf.packed_columns(exact, T).lo == (0, 1, 2, 3, 4, 5)
    base = tuple(as_base("fib:15").resolve(T))
    interp = host_columns(ColumnSpec(None, 12, base, None), 1.5, T)      # 10 rungs of two taps, 5 never valid
    near = bf.packed_columns(interp, T)
    assert near.lo == tuple(range(13)) + tuple(range(13, 33, 2)) + (T,) * 5
    assert (near.wlo, near.whi, near.two, near.b) == (interp.wlo, interp.whi, interp.two, interp.b)
    assert bf.packed_columns(host_columns(ColumnSpec((0, 5)), None, 3), 3).lo == (0, 5)   # 5 >= T: stays never valid
