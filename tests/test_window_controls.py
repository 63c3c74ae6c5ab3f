"""The window-only controls (issue 27): ``model.base=none`` is a plain sliding window of ``W + 1`` columns.

Checked against a dense softmax under a band mask computed here, independently of fibattn: every op
backend (outputs and gradients), the model, generation's constant cache, the exports and the
transformers drop-in.
"""
import pytest
import torch

import fibattn
from fibattn.config import ConfigError, ModelConfig
from fibattn.model.lm import FibLM
from fibattn.ops import backend_available
from fibattn.schedules import attended_distances, layer_alphas, matched_window
from op_helpers import make, run

W = 5


def band_attention(q, k, v, window):
    """Causal softmax attention where query ``i`` sees keys ``i - window .. i`` (GQA by repeating k, v)."""
    H, Hkv, T = q.shape[1], k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return torch.softmax(scores.masked_fill(~((j <= i) & (i - j <= window)), float("-inf")), -1) @ v


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu", "triton",
                                     pytest.param("flex", marks=pytest.mark.slow)])     # flex compiles: seconds
@pytest.mark.parametrize("op", ["sparse", "interpolated"])
def test_every_backend_with_no_rungs_is_a_sliding_window(backend, op, one_thread):
    why = backend_available(backend, torch.device("cpu"))
    if why is not None:
        pytest.skip(f"{backend}: {why}")
    if backend == "flex" and op == "interpolated":
        pytest.skip("flex has integer distances only")
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=23, Dh=8, dtype=torch.float64, seed=3)
    want = run(lambda q, k, v: band_attention(q, k, v, W), q, k, v, dout)
    assert attended_distances(W, 1.37, "none", 23) == list(range(W + 1))       # alpha is inert
    if backend == "flex":             # forward only on CPU
        got = fibattn.sparse_attention(q, k, v, list(range(W + 1)), backend="flex")
        torch.testing.assert_close(got, want[0], rtol=1e-9, atol=1e-10)
        return
    if op == "sparse":
        got = run(lambda q, k, v: fibattn.sparse_attention(q, k, v, attended_distances(W, 1.0, "none", 23),
                                                           backend=backend), q, k, v, dout)
    else:
        alpha = torch.tensor(1.3, dtype=torch.float64)
        got = run(lambda q, k, v, a: fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="none", window=W,
                                                                           backend=backend), q, k, v, dout, alpha)
        assert got.pop() == 0                                                   # no rung: no alpha gradient
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def small(**kw) -> ModelConfig:
    args = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, max_seq_len=4096,
                window=W, base="none", schedule="fixed", backend="torch")
    args.update(kw)
    return ModelConfig(**args)


def test_model_is_a_sliding_window_whatever_the_schedule_and_decodes_with_w_plus_1_rows():
    from fibattn.generation.decode import DecodeSession, generate
    torch.manual_seed(0)
    model = FibLM(small()).eval()
    staggered = FibLM(small(schedule="linear")).eval()
    staggered.load_state_dict(model.state_dict())
    x = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(staggered(x), model(x), rtol=0, atol=0)     # alpha moves nothing
        # the same weights as a dense model: equal while the whole sequence fits in the window
        dense = FibLM(small(attention="dense")).eval()
        dense.load_state_dict(model.state_dict())
        torch.testing.assert_close(dense(x[:, :W + 1]), model(x[:, :W + 1]), rtol=1e-5, atol=1e-5)
    assert all(d == list(range(W + 1)) for d in model.distances(40))
    assert DecodeSession(model, 1, 40).cache_rows == [W + 1] * 2                # constant memory: W + 1 rows
    prompt = x[0, :7].tolist()
    steps = list(generate(model, prompt, max_new_tokens=8, temperature=0))
    seq = prompt + [int(s.tokens[0]) for s in steps]
    with torch.no_grad():
        full = model(torch.tensor([seq]))[0]
    for i, st in enumerate(steps):
        torch.testing.assert_close(st.logits[0], full[len(prompt) - 1 + i], rtol=1e-5, atol=1e-5)


def test_config_refuses_a_learned_alpha_without_rungs():
    with pytest.raises(ConfigError, match="model.schedule=learned has nothing to learn with model.base=none"):
        FibLM(small(schedule="learned"))
    from fibattn.config import RunConfig
    from fibattn.effective import unread
    from fibattn.study.settings import _cell            # the report's settings table: no alpha without rungs
    cfg = RunConfig()
    cfg.model.base, cfg.model.window = "none", 8
    flat = {"model.attention": "sparse", "model.base": "none", "model.alpha": 1.0, "model.window": 8}
    assert (_cell(flat, "model.alpha", unread(cfg)), _cell(flat, "model.window", unread(cfg))) == ("—", "8")


def test_matched_window_spends_the_fib_models_columns():
    alphas = layer_alphas("linear", 16, a_min=0.5, a_max=1.5)
    w = matched_window(12, alphas, "fib:15", 1024)
    counts = [len(attended_distances(12, a, "fib:15", 1024)) for a in alphas]
    assert w == 21 and abs((w + 1) - sum(counts) / 16) <= 0.5                   # the paper model: W 12 -> 21
    assert matched_window(6, [1.0], "none", 32) == 6                            # a window is its own match


def test_model_card_says_sliding_window():
    from fibattn.config import RunConfig
    from fibattn.storage.export import model_card
    cfg = RunConfig()
    cfg.model = small()
    card = model_card(FibLM(cfg.model), cfg, 0, None, None)
    assert f"sliding window only (no rungs, base `none`): each query attends distances 0..{W}" in card


@pytest.mark.slow
def test_export_and_transformers_drop_in_round_trip(tmp_path, tiny_data):
    """A base-none run exports (card says what it is), reloads, and loads in transformers with its logits."""
    from fibattn.storage.export import export_run
    from fibattn.trainer.trainer import train
    from run_helpers import micro_config
    cfg = micro_config(tmp_path / "run", tiny_data, n_layers=2, steps=1, batch_tokens=64, micro_batch=2,
                       results_db="off", eval_tokens=64)
    cfg.model.base, cfg.model.schedule = "none", "fixed"
    train(cfg)
    out = export_run(tmp_path / "run", tmp_path / "exp")
    card = (out / "README.md").read_text()
    assert "sliding window only" in card and f"0..{cfg.model.window}" in card
    model = fibattn.from_pretrained(out)
    x = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x)
        assert all(d == list(range(cfg.model.window + 1)) for d in model.distances(45))
    pytest.importorskip("transformers")
    from fibattn.interop import hf_llama as H
    from fibattn.interop.hf_export import export_hf
    from fibattn.interop.hf_remote import modeling_fibattn_llama as R
    hf = export_hf(tmp_path / "run", tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(H.from_pretrained(hf).eval()(x).logits, want, atol=1e-5, rtol=1e-5)
    assert R.attended_distances(cfg.model.window, 1.3, {"kind": "none", "k": 15, "values": []}, 45) == \
        list(range(cfg.model.window + 1))


# ------------------------------------------------------------------------------ grids, report, plots, demo
def _results():
    """Synthetic demo-like results: fib linear W=6 and both controls, with per-position buckets."""
    from fibattn.study import grid as G
    from fibattn.study import report as Rp
    grid = G.demo_grid()
    out = []
    ppl = {"dense": (6.25, 10.7, 32.5), "fib_stagger": (6.13, 5.94, 5.87), "window_rungs_off": (6.40, 6.20, 6.15),
           "window_matched": (6.20, 6.00, 5.95), "fib_fixed": (6.21, 6.01, 5.94)}
    for g in grid.runs:
        if g.name not in ppl:
            continue
        m = grid.config(g, "/r").model
        r = Rp.RunResult(g.name, Rp.variant_of(m), None if m.attention == "dense" else m.window, 42, 32, model=m)
        r.ppl = {("s", n): v for n, v in zip((32, 128, 2048), ppl[g.name])}
        if m.attention != "dense":
            r.ppl[("s", 8192)] = ppl[g.name][-1]
        for n in (32, 2048) if m.attention == "dense" else (32, 2048, 8192):
            r.positions[("s", n)] = [{"start": i * n // 4, "end": (i + 1) * n // 4, "loss": 1.8 - 0.1 * i + len(g.name) / 100}
                                     for i in range(4)]
        out.append(r)
    return out


def test_report_tables_carry_the_controls_and_state_fib_against_the_matched_window():
    from fibattn.study import report as Rp
    from fibattn.study.controls import control_lines, control_table
    res = _results()
    main = Rp.main_table(res, ["s"])
    assert main.header[-2:] == ["window (rungs off)", "window (matched cost)"]
    assert [row[0] for row in main.rows] == ["6"] and main.rows[0][-2:] == ["6.40", "6.20"]
    assert "window" not in main.note                                     # placed in the row, not a note
    t = control_table(res, "s")
    assert [row[1].split(",")[0] for row in t.rows] == ["fib linear (stagger)", "window (rungs off)",
                                                         "window (matched cost)"]
    assert [row[2] for row in t.rows] == ["9.4", "7", "9"]                # columns per query: the same cost
    assert t.header[3:6] == ["1×", "4×", "64×"] and t.rows[2][6:9] == ["-1.1 %", "-1.0 %", "-1.3 %"]
    lines = control_lines(res, "s")
    assert lines[0].startswith("fib linear W=6 (9.4 columns per query) against window (matched cost) W=8 (9 columns)")
    assert "1× 6.13 vs 6.20 (-1.1 %); 4× 5.94 vs 6.00 (-1.0 %); 64× 5.87 vs 5.95 (-1.3 %)" in lines[0]
    ext = Rp.extrapolation_table(res, ["s"])
    assert any(row[0] == "window_matched (window (matched cost), W=8)" for row in ext.rows)
    blocks, _, checks = Rp.build_blocks("demo", res, ["s"], [])
    assert any(getattr(b, "text", "").startswith("fib linear W=6") for b in blocks)


@pytest.mark.slow
def test_fib_vs_window_draws(tmp_path):
    pytest.importorskip("matplotlib")
    from fibattn.study import figures as F
    assert F.fib_vs_window(_results(), "s", tmp_path / "v.png").is_file()


def test_plots_compare_fib_and_the_matched_window_by_position_and_keep_dense(tmp_path):
    """What the panels hold (drawing stubbed out: matplotlib's import alone takes seconds)."""
    from fibattn.study import figures as F
    res = _results()
    import fibattn.plots as P
    seen = []
    real = P.save_panels
    P.save_panels = lambda path, panels, **kw: seen.append(panels) or path
    try:
        F.per_position(res, "s", tmp_path / "p.png")
        F.ppl_vs_length(res, ["s"], tmp_path / "l.png")
        F.fib_vs_window(res, "s", tmp_path / "v.png")
    finally:
        P.save_panels = real
    per_pos, lengths, versus = seen
    assert [p.title for p in per_pos] == ["s, windows of 32", "s, windows of 2048"]     # dense's longest, not 8192
    assert all(any(s.label == "dense" for s in p.series) for p in per_pos)
    assert len(lengths) == 2 and "dense left out" in lengths[1].title
    assert not any(s.label.startswith("dense") for s in lengths[1].series)
    assert "window_matched: window (matched cost), W=8" in [s.label for s in lengths[1].series]
    assert [s.label.split(":")[0] for s in versus[0].series] == ["fib_stagger", "window_matched", "dense"]
    assert versus[-1].title == "window_matched loss minus fib_stagger loss"
    assert versus[-1].series[0].y == pytest.approx([0.03] * 4)


def test_matched_window_follows_a_set_of_the_model():
    from fibattn.study import grid as G
    g = G.build_grid("demo", only="window_*", sets=["model.n_layers=1"])
    # one layer: linear's alpha is a_min 0.5 -> of the rungs at 0.5 only 10 (21 · 0.5) lies beyond W=6: 8 columns
    assert [g.config(r, "/r").model.window for r in g.runs] == [6, 7]
    g = G.build_grid("demo", only="window_matched", sets=["model.window=4"])
    assert g.config(g.runs[0], "/r").model.window == G._matched(g.config(g.runs[0], "/r").model, 4) > 4


MICRO = ["model.seq_len=32", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
         "model.backend=torch", "train.steps=3", "train.batch_tokens=128", "train.micro_batch=4",
         "train.warmup_steps=1", "train.log_every=1", "train.threads=1", "eval.lengths=[32,128]", "eval.tokens=2048"]


@pytest.mark.slow
def test_demo_micro_grid_prints_fib_against_the_matched_window(tmp_path, capsys):
    """The demo's grid shrunk (one layer, 3 steps) with both controls: trained, evaluated, reported, printed."""
    from fibattn.cli import main as cli_main
    root = tmp_path / "demo"
    args = ["demo", "--root", str(root), "--jobs", "1", "--only", "dense,fib_stagger,window_*"]
    assert cli_main(args + [a for s in MICRO for a in ("--set", s)]) == 0
    out = capsys.readouterr().out
    # one layer at alpha 0.5 with W=6, fib K=7: 8 columns per query -> the matched window is W=7
    assert "fib linear W=6 (8.0 columns per query) against window (matched cost) W=7 (8 columns)" in out
    assert "against window (rungs off) W=6 (7 columns)" in out and "Window-only controls" in out
    assert (root / "report" / "fib_vs_window.png").is_file() and "fib_vs_window.png" in out
    report = (root / "report" / "report.md").read_text()
    assert "Would a sliding window do as well?" in report and "window (matched cost)" in report
