"""Equivalences that must hold whatever the implementation: gradient accumulation equals one larger
micro-batch, a batch of prompts with one seed equals single-prompt runs with the documented per-row
seeds, and a loader resumed on other ranks or on changed data continues the global stream or refuses."""
import json

import numpy as np
import pytest
import torch

from fibattn.data import TokenData
from fibattn.generation.decode import generate_tokens
from fibattn.trainer.trainer import train
from run_helpers import micro_config


def _first_step(tmp_path, data_dir, micro_batch):
    """The gradients AdamW's first step uses, and the logged loss, for a 4-sequence global batch."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    grads = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: grads.append([p.grad.detach().double().clone()
                                                for g in opt.param_groups for p in g["params"]]))
    try:
        cfg = micro_config(tmp_path / f"mb{micro_batch}", data_dir, steps=1, warmup_steps=1, batch_tokens=4 * 32,
                           micro_batch=micro_batch, grad_clip=0.0, eval_tokens=32, results_db="off", threads=1)
        res = train(cfg)
    finally:
        handle.remove()
    assert res.step == 1 and len(grads) == 1
    return grads[0], res.losses[0][1]


def test_gradient_accumulation_equals_one_larger_micro_batch(tmp_path, tiny_data):
    # 4 x 1, 2 x 2 and 1 x 4 micro-batches read the same 4 sequences: same mean loss, same gradient
    ref_grads, ref_loss = _first_step(tmp_path, tiny_data, 4)
    for mb in (2, 1):
        grads, loss = _first_step(tmp_path, tiny_data, mb)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_a_batch_with_one_seed_equals_single_runs_with_seed_plus_row():
    from fibattn.config import ModelConfig
    from fibattn.model.lm import FibLM
    torch.manual_seed(0)
    model = FibLM(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32,
                              window=4, base_k=6, backend="torch")).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    kw = dict(max_new_tokens=8, temperature=1.5)
    batch = generate_tokens(model, prompts, seed=20, **kw)
    # documented (generation/decode.py): an int seed gives row r the seed seed + r
    assert batch == [generate_tokens(model, p, seed=20 + r, **kw)[0] for r, p in enumerate(prompts)]
    assert batch == generate_tokens(model, prompts, seed=[20, 21, 22], **kw)


@pytest.fixture(scope="module")
def data(tiny_data):
    return TokenData(tiny_data)


def test_every_rank_records_the_same_global_position(data):
    # next_global counts the sequences all ranks consumed, whichever rank's state it is
    ranks = [data.train_loader(16, 3, seed=4, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        for r in ranks:
            r.next()
    assert [r.state_dict()["next_global"] for r in ranks] == [5 * 2 * 3] * 2
    want = data.train_loader(16, 30, seed=4).sequences(np.arange(30, 36))
    for r in ranks:                                   # either rank's state resumes one process exactly
        solo = data.train_loader(16, 6, seed=4)
        solo.load_state_dict(r.state_dict())
        x, y = solo.next()
        assert np.array_equal(x.numpy(), want[:, :-1]) and np.array_equal(y.numpy(), want[:, 1:])


def _data_id(doc) -> str:
    fake = TokenData.__new__(TokenData)          # data_id reads the manifest only
    fake.manifest = doc
    return fake.data_id()


@pytest.mark.parametrize("change", ["weight", "shard", "name"])
def test_resuming_on_changed_training_data_is_refused(data, change):
    """Each thing that changes which tokens sequence n holds changes the data fingerprint, and a loader
    state saved on the old data is refused by the new."""
    state = data.train_loader(16, 2, seed=1).state_dict()
    doc = json.loads(json.dumps(data.manifest))
    src = doc["sources"][0]
    if change == "weight":                       # another mixture: other sources for the same ids
        src["weight"] = float(src["weight"]) * 2 + 1
    elif change == "shard":                      # other shard contents (a re-prepared corpus)
        src["shards"][0]["sha256"] = "0" * 64
    else:
        src["name"] += "-renamed"
    assert _data_id(doc) != state["data_id"]
    changed = data.train_loader(16, 2, seed=1)
    changed.data = type("Changed", (), {"data_id": lambda self: _data_id(doc)})()
    with pytest.raises(ValueError, match="data_id"):
        changed.load_state_dict(state)
