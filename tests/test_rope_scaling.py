"""RoPE scaling as evaluation modes (method.md §7): the angles of linear / ntk / yarn against hand-computed
values, yarn's temperature, ``none`` bit for bit, exact restore, eval modes side by side, generation."""
import json
import math
import sqlite3

import pytest
import torch

from fibattn.cli import main
from fibattn.config import ModelConfig
from fibattn.eval import perplexity as E
from fibattn.eval.modes import mode_name, resolve_mode, rope_scaling_mode
from fibattn.generation.decode import generate, generate_tokens
from fibattn.model.lm import FibLM
from fibattn.model.rope import RopeScaling, RotaryEmbedding, make_scaling
from fibattn.storage.runs import eval_doc_problem
from fibattn.trainer.trainer import train
from run_helpers import micro_config

DH, THETA, S = 8, 1e4, 4.0


# ----------------------------------------------------------------------------- hand-computed frequencies
def plain_freqs():
    return [THETA ** (-2 * j / DH) for j in range(DH // 2)]            # 1, 0.1, 0.01, 0.001


def hand_freqs(kind, original_len):
    """The published definitions, written out with plain floats."""
    if kind == "linear":                                               # Chen et al. 2023: positions / s
        return [f / S for f in plain_freqs()]
    if kind == "ntk":                                                  # bloc97: base * s^(Dh / (Dh - 2))
        base = THETA * S ** (DH / (DH - 2))
        return [base ** (-2 * j / DH) for j in range(DH // 2)]
    out = []                                                           # YaRN, alpha = 1, beta = 32
    for f in plain_freqs():
        r = original_len / (2 * math.pi / f)
        gamma = 0.0 if r < 1 else 1.0 if r > 32 else (r - 1) / 31
        out.append((1 - gamma) * f / S + gamma * f)
    return out


# the same numbers, worked on paper (4 significant digits suffice to catch a wrong formula)
PAPER = {("linear", 16): [0.25, 0.025, 0.0025, 0.00025],
         ("ntk", 16): [1.0, 0.06300, 0.003969, 0.00025],            # 0.1 * 4^(-1/3), 0.01 * 4^(-2/3), 0.001 / 4
         ("yarn", 16): [0.2874, 0.025, 0.0025, 0.00025],              # r = 2.546, 0.2546, ...: gamma = 0.0499, 0, 0, 0
         ("yarn", 1024): [1.0, 0.06201, 0.002652, 0.00025]}           # r = 163, 16.30, 1.630, 0.163


@pytest.mark.parametrize("kind, original_len", [("linear", 16), ("ntk", 16), ("yarn", 16), ("yarn", 1024)])
def test_frequencies_match_the_published_definitions(kind, original_len):
    want = hand_freqs(kind, original_len)
    assert want == pytest.approx(PAPER[(kind, original_len)], rel=2e-4)
    got = RopeScaling(kind, S, original_len).inv_freq(THETA, DH)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    assert got[-1].item() == pytest.approx(plain_freqs()[-1] / S, rel=1e-12)   # every mode interpolates the lowest


@pytest.mark.parametrize("kind", ["linear", "ntk", "yarn"])
def test_rotation_angles_and_the_yarn_temperature(kind):
    rope = RotaryEmbedding(DH, theta=THETA)
    m = 0.1 * math.log(S) + 1 if kind == "yarn" else 1.0                # sqrt(1/t), on q and on k
    freqs = hand_freqs(kind, 16)
    with rope_scaling_mode(rope, kind, S, original_len=16) as sc:
        assert sc.qk_scale == pytest.approx(m, rel=1e-15)
        assert sc.temperature == pytest.approx(1 / m ** 2, rel=1e-15)
        table = rope.rotations(300, "cpu")
        for pos in (0, 1, 7, 40, 299):
            for j, f in enumerate(freqs):
                assert table[pos, j, 0].item() == pytest.approx(m * math.cos(pos * f), abs=1e-6)
                assert table[pos, j, 1].item() == pytest.approx(m * math.sin(pos * f), abs=1e-6)
        # a unit pair at position 9 lands on angle 9 * f_j, with length m
        e = torch.zeros(1, 1, 1, DH, dtype=torch.float64)
        e[..., 2] = 1.0
        out = rope(e, 9)[0, 0, 0]
        assert math.atan2(out[3].item(), out[2].item()) == pytest.approx(9 * freqs[1], abs=1e-6)
        assert math.hypot(out[2].item(), out[3].item()) == pytest.approx(m, abs=1e-6)
        # logits: q·k is a function of the distance only, scaled by m^2 = 1/t
        q, k = torch.randn(1, 1, 1, DH, dtype=torch.float64), torch.randn(1, 1, 1, DH, dtype=torch.float64)
        dots = [(rope(q, off + 5) * rope(k, off)).sum().item() for off in (0, 11, 200)]
        assert dots[0] == pytest.approx(dots[1], rel=1e-5) == pytest.approx(dots[2], rel=1e-5)
    assert rope.scaling is None
    if kind == "yarn":                                                  # 0.1 ln 4 + 1, by hand
        assert m == pytest.approx(1.1386294, abs=1e-7) and 1 / m ** 2 == pytest.approx(0.7713211, abs=1e-7)


def test_factor_defaults_to_length_over_training_length_and_is_checked():
    assert make_scaling("linear", 16, length=64).factor == 4.0
    assert make_scaling("yarn", 16, length=16) is None and make_scaling("ntk", 16, length=8) is None
    assert make_scaling("ntk", 16, factor=2.5, length=64).factor == 2.5
    assert make_scaling("none", 16, length=64) is None
    for bad, msg in [(dict(kind="yarn", factor=0.5), "factor must be a finite number >= 1, got 0.5"),
                     (dict(kind="foo", factor=2), "one of none, linear, ntk, yarn, got 'foo'"),
                     (dict(kind="linear"), "needs a factor or the length")]:
        with pytest.raises(ValueError, match=msg):
            make_scaling(bad.pop("kind"), 16, **bad)
    with pytest.raises(ValueError, match="nan"):
        RopeScaling("linear", float("nan"), 16)


# ----------------------------------------------------------------------------- models
def small(**kw) -> FibLM:
    args = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, window=3, base_k=6,
                schedule="linear", backend="torch")
    args.update(kw)
    torch.manual_seed(0)
    return FibLM(ModelConfig(**args)).eval()


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_none_is_bit_identical_and_the_context_manager_restores_exactly(attention):
    model = small(attention=attention)
    x = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
        with rope_scaling_mode(model, "none"):
            assert torch.equal(model(x), before)
        with rope_scaling_mode(model, "yarn", length=16) as sc:          # factor 1: nothing changes
            assert sc is None and torch.equal(model(x), before)
        for kind in ("linear", "ntk", "yarn"):
            with rope_scaling_mode(model, kind, length=48) as sc:
                assert sc.factor == 3.0 and sc.original_len == 16
                assert all(layer.rope.scaling == sc for layer in model.layers())
                assert not torch.allclose(model(x), before)
            assert all(layer.rope.scaling is None for layer in model.layers())
            assert torch.equal(model(x), before)                          # restored exactly
        with pytest.raises(RuntimeError):
            with rope_scaling_mode(model, "linear", 2.0):
                raise RuntimeError("inside")
        assert torch.equal(model(x), before)                              # restored after an error too


def test_mode_names_and_their_aliases():
    assert [mode_name(m, "study") for m in ("none", "window", "yarn")] == ["study", "dense-window", "study+yarn"]
    assert mode_name("ntk", "train", 4.0) == "train+ntk@4" and mode_name("linear", "study", 2.5) == "study+linear@2.5"
    assert resolve_mode() == "none" and resolve_mode(dense_window=True) == resolve_mode("window") == "window"
    assert resolve_mode("yarn") == "yarn" and resolve_mode("window", dense_window=True) == "window"
    with pytest.raises(ValueError, match="--mode must be one of none, linear, ntk, yarn, window, got 'wide'"):
        resolve_mode("wide")
    with pytest.raises(ValueError, match="dense_window=True is mode 'window' and does not combine with mode 'yarn'"):
        resolve_mode("yarn", dense_window=True)


def test_evaluate_scales_per_length_and_labels_a_sparse_model():
    model = small()
    toks = torch.randint(0, 64, (400,), generator=torch.Generator().manual_seed(2)).numpy()
    plain = E.evaluate(model, {"a": toks}, [16, 32], tokens=256)
    yarn = E.evaluate(model, {"a": toks}, [16, 32], tokens=256, mode="yarn")
    assert yarn.settings["mode"] == "study+yarn" and "sparse model" in yarn.settings["scaling_note"]
    assert [(r.rope_scaling, r.rope_factor) for r in yarn.records] == [("yarn", 1.0), ("yarn", 2.0)]
    assert yarn.records[0].nll == plain.records[0].nll                    # at the training length: unscaled
    assert yarn.records[1].nll != plain.records[1].nll
    fixed = E.evaluate(model, {"a": toks}, [16], tokens=256, mode="linear", rope_factor=2, reach="train")
    assert fixed.records[0].mode == "train+linear@2" and fixed.records[0].rope_factor == 2.0
    assert "| RoPE scaling |" in fixed.table() and "linear ×2" in fixed.table()
    assert "RoPE scaling" not in plain.table()                            # the old table, unchanged
    assert all(layer.rope.scaling is None for layer in model.layers())
    with pytest.raises(ValueError, match="rope_factor.*not to mode 'none'"):
        E.evaluate(model, {"a": toks}, [16], tokens=256, rope_factor=2)


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("kind", ["linear", "ntk", "yarn"])
@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_generation_steps_equal_a_scaled_full_forward(kind, attention):
    model = small(attention=attention, max_seq_len=4096)
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    steps = list(generate(model, prompt, max_new_tokens=31, temperature=0, rope_scaling=kind))
    assert all(layer.rope.scaling is None for layer in model.layers())   # left as it was
    seq = prompt + [int(s.tokens[0]) for s in steps]
    with torch.no_grad(), rope_scaling_mode(model, kind, 40 / 16):        # default factor: context / seq_len
        full = model(torch.tensor([seq]))[0]
    for i, st in enumerate(steps):
        torch.testing.assert_close(st.logits[0], full[9 - 1 + i], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(model(torch.tensor([seq]))[0], full)
    same = model.generate(prompt, max_new_tokens=31, temperature=0, rope_scaling=kind, rope_factor=2.5)
    assert same == [int(s.tokens[0]) for s in steps]                      # FibLM passes the options through


def test_generation_none_is_unchanged_and_bad_values_raise():
    model = small(max_seq_len=4096)
    prompt = [1, 2, 3]
    want = generate_tokens(model, prompt, max_new_tokens=20, temperature=0)
    assert generate_tokens(model, prompt, max_new_tokens=20, temperature=0, rope_scaling="none") == want
    assert generate_tokens(model, prompt, max_new_tokens=10, temperature=0, rope_scaling="yarn") == \
        generate_tokens(model, prompt, max_new_tokens=10, temperature=0)          # context 13 <= 16: factor 1
    for kw, msg in [(dict(rope_scaling="foo"), "rope_scaling must be one of none, linear, ntk, yarn, got 'foo'"),
                    (dict(rope_scaling="yarn", rope_factor=0.5), "factor must be a finite number >= 1"),
                    (dict(rope_factor=2.0), "rope_factor applies with rope_scaling")]:
        with pytest.raises(ValueError, match=msg):
            generate(model, prompt, max_new_tokens=4, **kw)


# ----------------------------------------------------------------------------- a trained run and the CLI
@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("rope")
    for name, attention in (("dense", "dense"), ("sparse", "sparse")):
        cfg = micro_config(root / name, tiny_data, steps=2, batch_tokens=64, micro_batch=2, log_every=1,
                           ckpt_every=100, eval_tokens=64, threads=1, results_db="off")
        cfg.model.attention = attention
        cfg.eval.lengths, cfg.eval.tokens = [32, 64], 128
        train(cfg)
    return root


def test_eval_cli_records_every_mode_side_by_side(runs, capsys):
    run, db = runs / "dense", runs / "modes.sqlite"
    common = [str(run), "--device", "cpu", "--no-plot", "--db", str(db)]
    for extra in ([], ["--mode", "yarn"], ["--mode", "linear"], ["--mode", "window"],
                  ["--mode", "ntk", "--rope-factor", "2"], ["--reach", "train", "--mode", "yarn"]):
        assert main(["eval", *common, *extra]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "| RoPE scaling |" in out and "ntk ×2" in out and "on a sparse model" not in out
    doc = json.loads((run / "eval.json").read_text())
    assert eval_doc_problem(doc) is None
    got = {(r["mode"], r["length"]): (r["rope_scaling"], r["rope_factor"]) for r in doc["results"]}
    modes = {"study", "study+yarn", "study+linear", "dense-window", "study+ntk@2", "train+yarn"}
    assert {m for m, _ in got} == modes and len(doc["results"]) == 2 * len(modes)    # one dataset, two lengths
    assert got[("study+yarn", 32)] == ("yarn", 1.0) and got[("study+yarn", 64)] == ("yarn", 2.0)
    assert got[("study+ntk@2", 32)] == ("ntk", 2.0) and got[("study", 64)] == (None, None)
    ppl = {(r["mode"], r["length"]): r["ppl"] for r in doc["results"]}
    assert ppl[("study+yarn", 32)] == ppl[("study", 32)]                 # no scaling at the training length
    assert ppl[("study+yarn", 64)] != ppl[("study", 64)]
    with sqlite3.connect(db) as con:
        rows = set(con.execute("SELECT reach, length FROM eval_results WHERE run='dense'").fetchall())
    assert rows == {(m, n) for m in modes for n in (32, 64)}
    assert main(["eval", str(runs / "sparse"), "--device", "cpu", "--no-plot", "--db", "off", "--lengths", "64",
                 "--mode", "yarn"]) == 0
    out = capsys.readouterr().out
    assert "RoPE scaling yarn on a sparse model: the angles of the attended distances change" in out
    assert "| study+yarn | yarn ×2 |" in out


@pytest.mark.parametrize("argv, msg", [
    (["--mode", "yarn", "--rope-factor", "0.5"], "--rope-factor must be a finite number >= 1, got 0.5"),
    (["--mode", "stretch"], "--mode must be one of none, linear, ntk, yarn, window, got 'stretch'"),
    (["--mode", "window", "--rope-factor", "2"], "--rope-factor applies to the RoPE scaling modes"),
    (["--rope-factor", "2"], "--rope-factor applies to the RoPE scaling modes"),
])
def test_eval_cli_bad_values_are_one_line_errors(runs, capsys, argv, msg):
    assert main(["eval", str(runs / "dense"), "--device", "cpu", "--no-plot", "--db", "off", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err


@pytest.mark.parametrize("argv, msg", [
    (["--rope-scaling", "yarn"], "--rope-scaling yarn is not an eval flag any more; use --mode yarn"),
    (["--rope-scaling", "foo"], "use --mode none|linear|ntk|yarn"),
    (["--dense-window"], "--dense-window is not an eval flag any more; use --mode window"),
    (["--mode", "yarn", "--dense-window"], "use --mode window"),
])
def test_eval_has_one_mode_flag_and_refuses_the_old_ones(tmp_path, capsys, argv, msg):
    assert main(["eval", str(tmp_path / "no-run"), *argv]) == 2          # refused before the run is looked at
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err
    from fibattn.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["eval"]
    assert "--rope-scaling" not in sub.format_help() and "--dense-window" not in sub.format_help()
    assert not (tmp_path / "no-run").exists()


def test_generate_cli_with_scaling_and_bad_values(runs, capsys):
    base = ["generate", str(runs / "sparse"), "--prompt", "To be", "--max-new-tokens", "40", "--temperature", "0",
            "--device", "cpu"]
    assert main([*base, "--rope-scaling", "yarn"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    for argv, msg in [(["--rope-scaling", "foo"], "--rope-scaling must be one of none, linear, ntk, yarn"),
                      (["--rope-scaling", "ntk", "--rope-factor", "0.9"], "--rope-factor must be a finite number"),
                      (["--rope-factor", "3"], "--rope-factor applies with --rope-scaling")]:
        assert main([*base, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err


def test_eval_doc_checks_the_scaling_fields():
    entry = {"dataset": "a", "length": 64, "mode": "study+yarn", "ppl": 3.0, "rope_scaling": "yarn", "rope_factor": 2}
    assert eval_doc_problem({"results": [entry]}) is None
    assert "rope_factor" in eval_doc_problem({"results": [{**entry, "rope_factor": 0.5}]})
    assert "rope_scaling" in eval_doc_problem({"results": [{**entry, "rope_scaling": "stretch"}]})


def test_tables_cover_the_positions_asked_for_in_any_order():
    """A context-parallel rank asks for its own positions only (method.md §9): the cached table holds that
    range, not the prefix before it, and any sequence of offsets gives the rows a fresh module gives."""
    x = torch.randn(1, 2, 40, DH, dtype=torch.float64)
    rope = RotaryEmbedding(DH, theta=THETA)
    for offset in (5000, 5040, 700, 0, 5400, 5000, 9999):
        torch.testing.assert_close(rope(x, offset), RotaryEmbedding(DH, theta=THETA)(x, offset), rtol=0, atol=0)
    rope = RotaryEmbedding(DH, theta=THETA)
    rope(x, 1 << 18)
    (lo, table), = rope._cache.values()
    assert lo == 1 << 18 and table.shape[0] == 256            # not (1 << 18) + 40 rows
