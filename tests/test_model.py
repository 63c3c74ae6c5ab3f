import math

import pytest
import torch
import torch.nn.functional as F

from fibattn.config import ConfigError, ModelConfig
from fibattn.model.lm import FibLM
from fibattn.presets import paper
from fibattn.schedules import attended_distances, layer_alphas


def small(**kw) -> ModelConfig:
    args = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, seq_len=32, max_seq_len=128,
                window=3, base_k=8, backend="torch")
    args.update(kw)
    return ModelConfig(**args)


def test_paper_parameter_count():
    model = FibLM(paper().model)
    assert abs(model.num_params() / 1e6 - 44.1) <= 0.1
    assert abs(model.num_params(non_embedding=False) / 1e6 - 60.9) <= 0.1
    assert paper().model.ffn_hidden == 1366


def test_forward_shapes_loss_and_tied_head():
    torch.manual_seed(0)
    model = FibLM(small())
    idx = torch.randint(0, 64, (2, 20))
    logits = model(idx)
    assert logits.shape == (2, 20, 64)
    logits2, loss = model(idx, idx.roll(-1, 1))
    torch.testing.assert_close(logits, logits2)
    want = F.cross_entropy(logits.reshape(-1, 64), idx.roll(-1, 1).reshape(-1))
    torch.testing.assert_close(loss, want)
    names = [n for n, _ in model.named_parameters()]
    assert not any("bias" in n for n in names) and sum("embed" in n for n in names) == 1
    torch.testing.assert_close(logits, model.hidden(idx) @ model.embed.weight.t())


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_causal(attention):
    torch.manual_seed(1)
    model = FibLM(small(attention=attention))
    idx = torch.randint(0, 64, (1, 24))
    changed = idx.clone()
    changed[0, 15:] = (changed[0, 15:] + 1) % 64
    torch.testing.assert_close(model(idx)[:, :15], model(changed)[:, :15])


def test_alphas_and_distances_follow_schedule():
    for schedule in ("fixed", "linear", "coprime"):
        model = FibLM(small(schedule=schedule, n_layers=4))
        want = layer_alphas(schedule, 4)
        assert model.alphas() == pytest.approx(want)
        assert model.distances(100) == [attended_distances(3, a, "fib:8", 100) for a in want]
    dense = FibLM(small(attention="dense"))
    assert dense.distances(5) == [list(range(5))] * 3


def test_learned_alphas_start_and_train():
    torch.manual_seed(0)
    model = FibLM(small(schedule="learned", learned_init="linear", n_layers=4))
    assert model.alphas() == pytest.approx(layer_alphas("linear", 4), abs=1e-5)
    model.double()
    with torch.no_grad():        # away from the bounds, and alpha * b away from integers (smooth in alpha)
        for block, theta in zip(model.blocks, (-0.7, 0.2, 0.9, -0.3)):
            block.attn.alphas.theta.fill_(theta)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))

    def loss64():                 # the model's loss, in float64 (its own loss is float32)
        return F.cross_entropy(model(idx).reshape(-1, 64), tgt.reshape(-1))
    loss = loss64()
    assert model(idx, tgt)[1].item() == pytest.approx(loss.item(), rel=1e-6)
    loss.backward()
    grads = torch.cat([b.attn.alphas.theta.grad for b in model.blocks])
    h, fd = 1e-4, []          # RoPE rotates in float32: a step well above its rounding noise
    with torch.no_grad():
        for block in model.blocks:
            theta = block.attn.alphas.theta
            theta += h
            up = loss64().item()
            theta -= 2 * h
            down = loss64().item()
            theta += h
            fd.append((up - down) / (2 * h))
    fd = torch.tensor(fd, dtype=torch.float64)
    assert fd.abs().min().item() > 1e-4                 # every layer's alpha matters to the loss
    torch.testing.assert_close(grads, fd, rtol=1e-4, atol=1e-8)
    # the training loss (float32 cross-entropy) gives the same gradient to float32 accuracy
    model.zero_grad()
    model(idx, tgt)[1].backward()
    torch.testing.assert_close(torch.cat([b.attn.alphas.theta.grad for b in model.blocks]), fd,
                               rtol=1e-2, atol=1e-6)


def test_reach_train_vs_study_beyond_training_length():
    study = FibLM(small(base="pow2", reach="study", schedule="fixed"))
    train = FibLM(small(base="pow2", reach="train", schedule="fixed"))
    assert max(study.distances(128)[0]) == 64
    assert max(train.distances(128)[0]) <= 31


def test_init_std_and_scaled_residuals():
    torch.manual_seed(0)
    model = FibLM(small(d_model=256, n_heads=4, n_layers=8, init_std=0.02))
    assert model.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].ffn.down.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_input_errors():
    model = FibLM(small())
    with pytest.raises(ValueError, match="model.max_seq_len"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.full((1, 4), 64))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 4))
    with pytest.raises(ConfigError, match="model.n_kv_heads"):
        FibLM(small(n_kv_heads=3))
