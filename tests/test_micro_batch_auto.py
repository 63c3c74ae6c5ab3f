"""``train.micro_batch = 0`` (auto, ``fibattn.trainer.micro_batch``): the largest divisor of the rank's
sequences whose trial step fits, chosen before training; elsewhere the fallback. The CUDA measurement is
stood in for by a peak function; the trial step itself runs here on the real model."""
import logging

import pytest
import torch

from fibattn.config import ConfigError, RunConfig, apply_overrides
from fibattn.model.lm import FibLM
from fibattn.presets import paper
from fibattn.trainer import micro_batch as M
from fibattn.trainer.setup import autocast_for
from fibattn.trainer.trainer import train
from fibattn.validation import validate
from run_helpers import micro_config


def test_divisors_largest_first():
    assert M.divisors_desc(12) == [12, 6, 4, 3, 2, 1]
    assert M.divisors_desc(1) == [1]
    assert M.divisors_desc(7) == [7, 1]


def test_largest_fitting_takes_the_first_within_budget_and_skips_out_of_memory():
    asked = []

    def peak(c):
        asked.append(c)
        return None if c > 6 else 100 * c             # 12 runs out of memory, 6 needs 600 bytes

    assert M.largest_fitting([12, 6, 4, 3], peak, budget=450) == (4, 400)
    assert asked == [12, 6, 4]                         # stops at the first that fits
    with pytest.raises(ConfigError, match="train.micro_batch auto: not even 1 sequence"):
        M.largest_fitting([2, 1], lambda c: 10 ** 12, budget=10)


def _model(seq_len=32, learned=False):
    cfg = micro_config("unused", "unused", n_layers=2).model
    cfg.seq_len = seq_len
    if learned:
        cfg.schedule = "learned"
    return FibLM(cfg)


@pytest.mark.parametrize("learned", [False, True])
def test_trial_step_leaves_weights_gradients_and_the_rng_as_they_were(learned):
    model = _model(learned=learned)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    M.trial_step(model, 3, autocast_for("fp32", torch.device("cpu")), torch.Generator().manual_seed(0))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)      # bit-exact resume draws from it
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_choose_tries_the_largest_the_lower_bound_allows_and_logs_it(caplog):
    """With a stand-in measurement: divisors of the rank's 24 sequences, largest first; the one chosen is the
    first whose peak fits within the headroom once AdamW's moments are counted."""
    model = _model()
    cfg = micro_config("unused", "unused", n_layers=2)
    moments = 8 * sum(p.numel() for p in model.parameters())
    memory = 10 ** 9
    budget = int(M.HEADROOM * memory) - moments
    tried = []

    def peak(c):
        tried.append(c)
        return budget + 1 if c > 8 else budget - 1

    with caplog.at_level(logging.INFO, logger="fibattn"):
        got = M.choose(cfg, model, torch.device("cpu"), autocast_for("fp32", torch.device("cpu")), 24,
                       peak=peak, memory=memory)
    assert got == 8 and tried == [24, 12, 8]
    assert "train.micro_batch auto -> 8" in caplog.text


@pytest.mark.parametrize("per_rank,context,want", [(32, 1, 8), (12, 1, 6), (5, 1, 5), (7, 1, 7), (32, 2, 8)])
def test_choose_falls_back_without_cuda_or_under_context_parallelism(per_rank, context, want, caplog):
    model, cfg = _model(), micro_config("unused", "unused", n_layers=2)
    with caplog.at_level(logging.INFO, logger="fibattn"):
        got = M.choose(cfg, model, torch.device("cpu"), autocast_for("fp32", torch.device("cpu")), per_rank,
                       context=context, peak=(lambda c: 0) if context > 1 else None)
    assert got == want
    assert f"train.micro_batch auto -> {want}" in caplog.text


def test_auto_is_the_default_and_the_paper_preset_leaves_it_to_fibattn():
    assert RunConfig().train.micro_batch == 0 and paper().train.micro_batch == 0
    cfg = paper()
    apply_overrides(cfg, ["train.micro_batch=0"])
    validate(cfg)
    cfg.train.batch_tokens = 1000                       # not whole sequences: the message names seq_len alone
    with pytest.raises(ConfigError, match=r"multiple of model.seq_len \(1024\)"):
        validate(cfg)
    apply_overrides(cfg, ["train.micro_batch=-1"])
    with pytest.raises(ConfigError, match="train.micro_batch"):
        validate(cfg)


def test_training_with_auto_on_a_cpu_takes_the_fallback_and_saves_the_choice(tmp_path, tiny_data):
    """On a CPU auto is the former default (8, capped to a divisor), so CPU runs train as before; the run's
    config.json holds the micro-batch it trained with."""
    import json
    cfg = micro_config(tmp_path / "run", tiny_data, steps=1, batch_tokens=32 * 12, eval_tokens=64, threads=1,
                       results_db="off")
    assert cfg.train.micro_batch == 0
    train(cfg)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["micro_batch"] == 6
