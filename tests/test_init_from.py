"""``train --init-from``: a trained model's weights start a new run of any attention, from a run, a
checkpoint, an export or a transformers Llama folder; what does not fit is named before anything runs."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fibattn.cli import main
from fibattn.config import ModelConfig
from fibattn.model.lm import FibLM
from fibattn.storage.export import export_run
from fibattn.storage.init_source import load_into, open_source
from fibattn.trainer.trainer import train
from fibattn.validation import estimate_params
from run_helpers import micro_config

TRAIN = dict(steps=2, batch_tokens=64, micro_batch=2, results_db="off", eval_tokens=64, warmup_steps=1,
             ckpt_every=1, keep_ckpts=3)


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("init")
    cfg = micro_config(root / "dense", tiny_data, n_layers=2, **TRAIN)
    cfg.model.attention = "dense"
    train(cfg)
    return root / "dense"


def weights(run, step):
    return load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))


def sparse_cfg(out, data, schedule="linear", **model):
    cfg = micro_config(out, data, n_layers=2, **{**TRAIN, "steps": 1, "weight_decay": 0.0})
    cfg.model.schedule = schedule
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


@pytest.mark.parametrize("schedule", ["linear", "fixed", "learned"])
def test_a_dense_run_starts_a_sparse_one(dense_run, tiny_data, tmp_path, caplog, schedule):
    cfg = sparse_cfg(tmp_path / "ft", tiny_data, schedule)
    cfg.train.init_from = str(dense_run)
    with caplog.at_level("INFO", logger="fibattn"):
        train(cfg, loss_hook=lambda step, loss: loss * 0)       # zero gradients, no decay: no update
    src, got = weights(dense_run, 2), weights(tmp_path / "ft", 1)
    for k, v in src.items():                         # the weights are the source's, unchanged
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    line = next(r.getMessage() for r in caplog.records if "init-from" in r.getMessage())
    assert "loaded 20 tensors" in line and "(step 2)" in line
    learned = [k for k in got if k.endswith("alphas.theta")]
    assert ("blocks.*.attn.alphas.theta ×2" in line) == (schedule == "learned") and len(learned) == (
        2 if schedule == "learned" else 0)
    if schedule == "learned":                        # learned alphas start from their configured values
        fresh = FibLM(cfg.model)
        for k in learned:
            torch.testing.assert_close(got[k], fresh.state_dict()[k])
    saved = json.loads((tmp_path / "ft" / "config.json").read_text())["train"]
    assert saved["init_source"]["kind"] == "run" and saved["init_source"]["step"] == 2
    assert len(saved["init_source"]["sha256"]) == 64 and saved["init_source"]["path"].endswith("step-2")


def test_sources_run_at_step_checkpoint_and_export_are_the_same_weights(dense_run, tmp_path):
    exp = export_run(dense_run, tmp_path / "exp")
    want = weights(dense_run, 1)
    for spec in (f"{dense_run}@1", str(dense_run / "checkpoints" / "step-1")):
        src = open_source(spec)
        assert src.step == 1 and all(torch.equal(src.tensors[k], v) for k, v in want.items())
    src = open_source(exp)
    assert src.kind == "export" and src.step == 2
    assert all(torch.equal(src.tensors[k], v) for k, v in weights(dense_run, 2).items())


def test_a_resumed_run_is_not_initialised_again(dense_run, tiny_data, tmp_path):
    import shutil
    source = tmp_path / "source"
    shutil.copytree(dense_run, source)
    cfg = sparse_cfg(tmp_path / "ft", tiny_data)
    cfg.train.lr, cfg.train.steps = 3e-3, 2
    cfg.train.init_from = str(source)
    train(cfg, stop_at=1)
    first = weights(tmp_path / "ft", 1)
    recorded = json.loads((tmp_path / "ft" / "config.json").read_text())["train"]["init_source"]
    shutil.rmtree(source)                            # the source is not needed to resume, and not loaded again
    train(cfg)
    assert json.loads((tmp_path / "ft" / "config.json").read_text())["train"]["init_source"] == recorded
    straight = sparse_cfg(tmp_path / "straight", tiny_data)
    straight.train.lr, straight.train.steps, straight.train.init_from = 3e-3, 2, str(dense_run)
    train(straight)
    for k, v in weights(tmp_path / "straight", 2).items():
        torch.testing.assert_close(weights(tmp_path / "ft", 2)[k], v)
    assert any(not torch.equal(first[k], weights(dense_run, 2)[k]) for k in first)


def test_what_does_not_fit_is_named_before_anything_is_written(dense_run, tiny_data, tmp_path, capsys):
    base = ["train", "--preset", "tiny", "--set", f"data.out_dir={tiny_data}", "--set", "train.steps=1",
            "--set", "train.results_db=off"]
    cases = [
        (["--init-from", str(dense_run), "--set", "model.d_model=64", "--set", "model.n_heads=4"],
         "shapes differ (source -> this model): embed.weight (256, 32) -> (256, 64)"),
        (["--init-from", str(dense_run), "--set", "model.n_layers=3"], "this model has tensors the source lacks: "
         "blocks.*.attn_norm.weight"),
        (["--init-from", str(tmp_path / "nowhere")], "does not exist"),
        (["--init-from", f"{dense_run}@7"], "no checkpoint step-7"),
        (["--init-from", f"{dense_run}@x"], "the step after '@'"),
        (["--init-from", str(tiny_data)], "neither a fibattn run"),
    ]
    for extra, want in cases:
        out = tmp_path / "out"
        assert main([*base, "--out", str(out), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert want in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert not out.exists()


def test_the_cli_takes_the_sources_architecture(dense_run, tiny_data, tmp_path, capsys):
    out = tmp_path / "ft"
    assert main(["train", "--preset", "tiny", "--init-from", str(dense_run), "--out", str(out),
                 "--set", f"data.out_dir={tiny_data}", "--set", "train.steps=1", "--set", "train.results_db=off",
                 "--set", "train.batch_tokens=64", "--set", "train.micro_batch=2", "--set", "model.seq_len=32",
                 "--set", "train.eval_tokens=64"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model"]["d_model"], saved["model"]["n_layers"], saved["model"]["attention"]) == (32, 2, "sparse")
    assert saved["train"]["init_from"] == str(dense_run.resolve())


def test_untied_head_and_ffn_size_are_model_options():
    m = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=16, window=3, base_k=5,
                    ffn_dim=40, tie_embeddings=False)
    model = FibLM(m)
    assert model.blocks[0].ffn.up.weight.shape == (40, 32) and model.head.weight.shape == (50, 32)
    assert estimate_params(m) == model.num_params(non_embedding=False)
    x = torch.randint(0, 50, (2, 16))
    ref = torch.nn.functional.linear(model.hidden(x), model.head.weight)
    torch.testing.assert_close(model(x), ref)


def test_a_tied_source_starts_an_untied_head_from_the_embedding(dense_run):
    src = open_source(dense_run)
    arch = dict(src.architecture, tie_embeddings=False, attention="dense", seq_len=32, window=4, base_k=6)
    model = FibLM(ModelConfig(**arch))
    parts = load_into(model, src)
    assert parts["created"] == ["head.weight"]
    torch.testing.assert_close(model.head.weight, src.tensors["embed.weight"])


def test_pickled_or_broken_weights_are_refused(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
                                                     "num_hidden_layers": 1, "vocab_size": 10,
                                                     "intermediate_size": 64}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(ValueError, match="pytorch_model.bin is a pickle, which fibattn never loads"):
        open_source(folder)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        open_source(folder)
    for bad, want in (({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
                      ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'")):
        doc = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2, **bad}
        (folder / "config.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=want):
            open_source(folder, weights=False)
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))


def test_configs_written_before_the_new_keys_compare_equal(tmp_path):
    """A run made before model.ffn_dim / tie_embeddings / train.init_from existed still resumes and is
    still the grid's: missing keys count as their defaults."""
    from fibattn import config as C
    from fibattn.storage.checkpoint import _model_section
    from fibattn.study.runner import settings_diff
    from fibattn.trainer.state import check_compatible
    cfg = micro_config(tmp_path / "r", tmp_path / "d")
    old = C.to_dict(cfg)
    for section, key in (("model", "ffn_dim"), ("model", "tie_embeddings"), ("train", "init_from"),
                         ("train", "init_source")):
        del old[section][key]
    assert settings_diff(old, cfg) == []
    assert check_compatible(old, cfg, tmp_path) == []
    assert _model_section(old) == C.to_dict(cfg)["model"]
    old["model"]["tie_embeddings"] = False                   # a real difference is still one
    assert settings_diff(old, cfg) == ["model.tie_embeddings: False -> True"]
