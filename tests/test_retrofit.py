"""Retrofit: a transformers Llama round trip through ``--init-from`` and ``export --format hf``; the
fine-tuning recipe; the retrofit grid, its report table, plot and checks."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fibattn
from fibattn.cli import main
from fibattn.config import ModelConfig
from fibattn.model.lm import FibLM
from fibattn.presets import tiny
from fibattn.storage.init_source import load_into, open_source
from fibattn.study.grid import RETROFIT_FRACTIONS, build_grid, demo_setting
from fibattn.trainer.init_recipe import apply_recipe

SMALL = ["--set", "train.steps=2", "--set", "train.results_db=off", "--set", "train.batch_tokens=64",
         "--set", "train.micro_batch=2", "--set", "model.seq_len=32", "--set", "train.eval_tokens=64",
         "--set", "model.window=4", "--set", "model.base_k=6"]

LOAD = r'''
import json, sys, torch, transformers
args = json.loads(sys.argv[1])
m = transformers.AutoModelForCausalLM.from_pretrained(args["folder"], trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(m(torch.load(args["ids"], weights_only=True)).logits, args["out"])
'''


def plain_transformers_logits(folder, ids, tmp):
    """Logits of ``folder`` loaded by transformers alone (remote code allowed) in a fresh process."""
    torch.save(ids, tmp / "ids.pt")
    env = dict(os.environ, HF_HOME=str(tmp / "hf-home"), HF_MODULES_CACHE=str(tmp / "hf-home" / "modules"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    args = {"folder": str(folder), "ids": str(tmp / "ids.pt"), "out": str(tmp / "out.pt")}
    r = subprocess.run([sys.executable, "-c", LOAD, json.dumps(args)], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=True)


def test_a_transformers_llama_round_trip(tmp_path, tiny_data):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(cfg).eval()
    llama.save_pretrained(tmp_path / "llama")
    x = torch.randint(0, 256, (2, 40))
    # the weights load exactly: a dense FibLM of the source's shape computes the Llama's logits
    src = open_source(tmp_path / "llama")
    assert src.kind == "transformers" and src.architecture["ffn_dim"] == 72 and not src.architecture["tie_embeddings"]
    dense = FibLM(ModelConfig(**src.architecture, attention="dense", seq_len=32))
    parts = load_into(dense, src)
    assert parts["created"] == [] and parts["ignored"] == []
    with torch.no_grad():
        torch.testing.assert_close(dense(x), llama(x).logits, atol=1e-5, rtol=1e-5)
    # --init-from it (the architecture comes from the folder), fine-tune, export for transformers
    out = tmp_path / "ft"
    assert main(["train", "--preset", "tiny", "--init-from", str(tmp_path / "llama"), "--out", str(out),
                 "--set", f"data.out_dir={tiny_data}", *SMALL]) == 0
    assert main(["export", str(out), str(tmp_path / "hf"), "--format", "hf"]) == 0
    fib = fibattn.from_pretrained(out)
    assert fib.cfg.attention == "sparse" and not fib.cfg.tie_embeddings and fib.cfg.ffn_hidden == 72
    card = (tmp_path / "hf" / "README.md").read_text()
    assert str(tmp_path / "llama") in card
    with torch.no_grad():
        want = fib(x)
    got = plain_transformers_logits(tmp_path / "hf", x, tmp_path)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_recipe_is_relative_to_the_from_scratch_one_and_set_keys_win():
    cfg = tiny()
    cfg.train.steps, cfg.train.lr, cfg.train.min_lr_ratio, cfg.train.warmup_steps = 500, 3e-3, 0.1, 30
    assert apply_recipe(cfg, set()) == ["train.steps=50", "train.lr=0.0003", "train.warmup_steps=5"]
    cfg = tiny()
    cfg.train.steps, cfg.train.lr = 80, 1e-3
    assert apply_recipe(cfg, {"train.steps", "train.lr"}) == ["train.warmup_steps=8"]
    assert (cfg.train.steps, cfg.train.lr) == (80, 1e-3)


def test_the_cli_applies_the_recipe_only_where_the_command_names_the_source(tmp_path, tiny_data, capsys):
    run = tmp_path / "dense"
    dense = SMALL[:-4]                  # window and base_k: a dense model reads neither (refused if given)
    assert main(["train", "--preset", "tiny", "--out", str(run), "--set", f"data.out_dir={tiny_data}",
                 "--set", "model.attention=dense", *dense]) == 0
    from fibattn.cli import train as T
    args = T.__dict__["configure_parser"]
    import argparse
    parser = argparse.ArgumentParser()
    args(parser)
    cfg = T.build_config(parser.parse_args(["--preset", "tiny", "--init-from", str(run), "--set", "train.steps=40"]))
    assert (cfg.train.steps, cfg.train.warmup_steps) == (40, 4) and cfg.train.lr == pytest.approx(3e-4)
    saved = tmp_path / "cfg.json"
    from fibattn import config as C
    C.save(cfg, saved)
    again = T.build_config(parser.parse_args(["--config", str(saved)]))       # a config naming a source: as is
    assert (again.train.steps, again.train.warmup_steps, again.train.lr) == (40, 4, cfg.train.lr)


def test_the_retrofit_grid_reuses_the_demo_runs_and_derives_its_fine_tunes(tmp_path):
    grid = build_grid("retrofit")
    demo = build_grid("demo")
    by = {r.name: r for r in grid.runs}
    for name in ("dense", "fib_stagger", "fib_fixed"):              # the demo's runs, unchanged: reused
        assert by[name] == next(r for r in demo.runs if r.name == name)
    tunes = [r for r in grid.runs if r.init_from]
    assert len(tunes) == 2 * len(RETROFIT_FRACTIONS) and all(r.init_from == "dense" for r in tunes)
    steps = 500
    assert "train.steps=500" in demo_setting()
    cfg = grid.config(by["retro_stagger_10pct"], tmp_path)
    assert (cfg.train.steps, cfg.train.warmup_steps) == (steps // 10, 5) and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.init_from == str(tmp_path.absolute() / "dense") and cfg.model.schedule == "linear"
    assert cfg.eval.lengths == [32, 128] and cfg.eval.sparse_lengths == []         # the goals' 1× and 4×
    assert grid.report_dir == "report-retrofit" and demo.report_dir == "report"


MICRO = ["model.seq_len=32", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
         "model.base_k=6", "model.window=4", "model.backend=torch", "train.steps=20", "train.batch_tokens=128",
         "train.micro_batch=4", "train.log_every=5", "train.threads=1", "eval.lengths=[32,128]", "eval.tokens=2048"]


def test_retrofit_demo_micro_end_to_end(tmp_path, capsys):
    root = tmp_path / "demo"
    sets = [a for s in MICRO for a in ("--set", s)]
    # the demo's own runs first: the retrofit demo reuses them
    assert main(["demo", "--root", str(root), "--only", "dense,fib_stagger", "--jobs", "1", *sets]) == 0
    capsys.readouterr()
    args = ["demo", "--retrofit", "--root", str(root), "--only", "dense,fib_stagger,retro_stagger_*", "--jobs", "1"]
    assert main(args + sets) == 0
    out = capsys.readouterr().out
    assert out.count("done, skipped") == 2 and "4 to run" in out          # dense and fib_stagger reused
    assert "**Retrofit: the dense run fine-tuned to sparse attention" in out and "Retrofit check" in out
    assert "Retrofit: " in out and "retro_stagger_10pct at 4×" in out
    assert (root / "report-retrofit" / "retrofit.png").is_file() and (root / "report" / "report.md").is_file()
    for name, steps in (("retro_stagger_5pct", 1), ("retro_stagger_10pct", 2), ("retro_stagger_40pct", 8)):
        t = json.loads((root / name / "config.json").read_text())["train"]
        assert (t["steps"], t["warmup_steps"]) == (steps, max(1, round(steps / 10)))
        assert t["lr"] == pytest.approx(3e-3 * 0.1) and t["init_source"]["step"] == 20
    md = (root / "report-retrofit" / "report.md").read_text()
    assert "| retro_stagger_10pct | linear | 2 (10 %) |" in md


def test_retrofit_checks_judge_the_ten_percent_linear_run():
    from fibattn.study.report import RunResult
    from fibattn.study.retrofit_report import retrofit_checks, retrofits
    def run(name, variant, steps, a, b, init=""):
        return RunResult(name, variant, None if variant == "dense" else 6, train_len=32, steps=steps, init_from=init,
                         ppl={("s", 32): a, ("s", 128): b})
    results = [run("dense", "dense", 500, 6.0, 10.0), run("fib", "linear", 500, 6.0, 6.0),
               run("r5", "linear", 25, 6.3, 6.2, "dense"), run("r10", "linear", 50, 6.1, 6.5, "dense"),
               run("r20", "linear", 100, 6.0, 6.0, "dense")]
    checks = retrofit_checks(retrofits(results), "s", 4)
    assert [(n, ok) for n, ok, _ in checks] == [("dense source collapses", True), ("r10 at 1×", True),
                                                ("r10 at 4×", False)]
