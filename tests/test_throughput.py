"""Training says what it is doing (issue 28, item 5): parameters, tokens per parameter, the warm-up, flops
per token and MFU where a peak is known; evaluations say how many tokens they scored; long eval shows
progress."""
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fibattn.config import ModelConfig, RunConfig, TrainConfig
from fibattn.eval import perplexity
from fibattn.model.lm import FibLM
from fibattn.trainer import throughput as tp
from fibattn.trainer.logs import progress_line


def _model(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                          "seq_len": 64, "window": 4, "base_k": 8, **kw})


def test_flops_per_token_counts_the_models_matmul_weights_and_attended_columns():
    for tie in (True, False):
        m = _model(tie_embeddings=tie)
        model = FibLM(m)
        mats = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n)
        mats += 0 if not tie else m.vocab_size * m.d_model                # the tied head is still a matmul
        flops, cols = tp.flops_per_token(m)
        assert flops == pytest.approx(6 * mats + 12 * m.n_layers * m.d_model * cols)
    T = 64
    assert tp.mean_columns(_model(attention="dense")) == (T + 1) / 2
    assert tp.mean_columns(_model(window=T - 1)) == pytest.approx((T + 1) / 2)     # a window of all: dense
    assert tp.mean_columns(_model(base="none")) == pytest.approx(sum(T - d for d in range(5)) / T)
    fixed, learned = _model(schedule="fixed"), _model(schedule="learned")
    assert tp.mean_columns(fixed) < tp.mean_columns(learned) < 2 * tp.mean_columns(fixed)   # rungs read two columns


def test_mfu_only_where_a_peak_is_known(monkeypatch):
    assert tp.peak_flops(torch.device("cpu"), False) == (None, "no known peak FLOP/s for cpu")
    for name, bf16, want in (("NVIDIA H200", True, 989e12), ("NVIDIA H100 PCIe", True, 756e12),
                             ("NVIDIA L40S", False, 91.6e12), ("NVIDIA L4", True, 121e12),
                             ("NVIDIA GeForce GTX 1080", True, None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, n=name: n)
        peak, what = tp.peak_flops(torch.device("cuda", 0), bf16)
        assert peak == (pytest.approx(want) if want else None) and name in what
    assert tp.mfu(1000.0, 1e9, 1e13, 2) == pytest.approx(0.05) and tp.mfu(1000.0, 1e9, None, 1) is None
    line = progress_line(5, 10, 2.5, 1e-3, 0.5, 1234.0, 30.0, 0.412)
    assert line == "step 5/10 | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | tok/s 1234 | mfu 41.2% | eta 30s"
    assert "mfu" not in progress_line(5, 10, 2.5, 1e-3, 0.5, 1234.0, 30.0)


@pytest.mark.parametrize("warmup, steps, says", [
    (300, 13000, "warm-up over 300 of 13000 steps (2.3%), then cosine to 3.00e-05 at step 13000"),
    (300, 1000, "(30.0%; train.warmup_steps does not shrink with train.steps: set it to choose)"),
    (40, 40, "(100.0%; all of the run: train.lr is reached at its last step)"),
    (0, 10, "lr 3.00e-04: no warm-up, cosine"),
])
def test_the_start_lines_say_size_budget_warmup_and_flops(warmup, steps, says):
    t = TrainConfig(steps=steps, warmup_steps=warmup, batch_tokens=4096)
    lines = tp.start_lines(_model(), t, 2_000_000, 1_500_000, (None, "no known peak FLOP/s for cpu"), 1)
    assert lines[0] == (f"fibattn: model 2M parameters (1.5M without embeddings); {steps} steps x 4096 tokens = "
                        f"{tp.human(steps * 4096)} tokens, {steps * 4096 / 2e6:.3g} per parameter")
    assert says in lines[1]
    assert "FLOP per token" in lines[2] and lines[2].endswith("MFU not shown: no known peak FLOP/s for cpu")
    peak = (989e12, "NVIDIA H200 bf16 peak 989 TFLOP/s")
    assert tp.start_lines(_model(), t, 2, 1, peak, 8)[2].endswith("MFU against NVIDIA H200 bf16 peak 989 TFLOP/s x 8 "
                                                                  "devices")


def test_the_in_training_eval_line_says_how_many_tokens_it_scored():
    data = SimpleNamespace(val_names=["a", "b"], val_tokens=lambda n: np.zeros({"a": 5000, "b": 40}[n]))
    cfg = RunConfig()
    cfg.model.seq_len, cfg.train.eval_tokens = 256, 4096
    assert tp.eval_tokens_scored(data, 4096, 256) == {"a": 4096, "b": 39}      # whole rows; a short split whole
    line = tp.eval_line(7, {"a": 1.0, "b": 2.0}, data, cfg)
    assert line.startswith("eval step 7 | a loss 1.0000 ppl 2.72 over 4096 tokens | b loss 2.0000 ppl 7.39 over 39 "
                           "tokens (length 256; train.eval_tokens")


def test_long_evaluation_shows_progress(monkeypatch, caplog, one_thread):
    caplog.set_level(logging.INFO, logger="fibattn")
    monkeypatch.setattr(perplexity, "PROGRESS_S", 0.0)              # every batch counts as long here
    torch.manual_seed(0)
    model = FibLM(_model(backend="torch"))
    arr = np.random.default_rng(0).integers(0, 64, 4 * 32 + 1)
    perplexity.evaluate(model, {"val": arr}, [32], tokens=128, batch_size=1)
    text = caplog.text
    assert "val: scoring the same 128 tokens (of 128; budget tokens=128) at length 32" in text
    assert "val @ 32: 1/4 windows (25%), eta" in text and "val @ 32: 3/4 windows (75%)" in text
