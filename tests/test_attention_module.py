import math

import pytest
import torch
import torch.nn.functional as F

from fibattn.model.attention import FibAttention, config_layer_alphas
from fibattn.config import ModelConfig
from fibattn.model.rope import RotaryEmbedding
from fibattn.schedules import attended_distances

torch.manual_seed(0)


def masked_attention(q, k, v, dists):
    """Independent check: dense softmax over an explicit (T, T) mask built from the distances."""
    B, H, T, Dh = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    rel = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for d in dists:
        allowed |= rel == d
    s = (q @ k.transpose(-1, -2)) / math.sqrt(Dh)
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


def layer(**kw):
    args = dict(window=3, base="fib:8", backend="torch")
    args.update(kw)
    return FibAttention(32, 4, 2, **args).double()


def test_static_layer_matches_masked_dense():
    att = layer(alpha=1.3)
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    q, k, v = att.qkv(x)
    assert q.shape == (2, 4, 40, 8) and k.shape == (2, 2, 40, 8)
    want = att.merge(masked_attention(q, k, v, attended_distances(3, 1.3, "fib:8", 40)))
    torch.testing.assert_close(att(x), want)
    assert att.distances(40) == attended_distances(3, 1.3, "fib:8", 40)
    assert att.distances(40) is att.distances(40)          # cached per (T, reach)


def test_full_window_sparse_equals_dense():
    sparse = layer(window=50)
    dense = layer(attention="dense")
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(2, 33, 32, dtype=torch.float64)
    torch.testing.assert_close(sparse(x), dense(x))


def test_learned_integer_alpha_equals_static_and_alpha_gets_gradient():
    static = layer(alpha=1.0)
    learned = layer(alpha=1.0, learned=True)
    learned.load_state_dict(static.state_dict(), strict=False)
    x = torch.randn(1, 30, 32, dtype=torch.float64)
    torch.testing.assert_close(learned(x), static(x), atol=1e-6, rtol=1e-6)
    moved = layer(alpha=1.17, learned=True)
    assert abs(moved.current_alpha() - 1.17) < 1e-5
    w = torch.randn(1, 30, 32, dtype=torch.float64)

    def loss():
        return (moved(x) * w).sum()
    loss().backward()
    theta = moved.alphas.theta
    # the gradient against central differences of the loss in theta (float64; every alpha * b
    # stays well away from the points where its floor or rounding changes: smooth in alpha there)
    h = 1e-6
    with torch.no_grad():
        theta += h
        up = loss().item()
        theta -= 2 * h
        down = loss().item()
        theta += h
    fd = torch.tensor([(up - down) / (2 * h)], dtype=torch.float64)
    assert fd.abs().item() > 1e-3                      # a real signal, not a zero/zero match
    torch.testing.assert_close(theta.grad, fd, rtol=1e-5, atol=1e-8)


def test_rope_is_relative_and_applied_before_attention():
    rope = RotaryEmbedding(8, theta=1e4)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    dots = [(rope(q, off + 5) * rope(k, off)).sum().item() for off in (0, 7, 100)]
    assert dots[0] == pytest.approx(dots[1]) == pytest.approx(dots[2])
    att = layer()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    q, k, v = att.qkv(x)
    raw_q = att.q_proj(x).view(1, 12, 4, 8).transpose(1, 2)
    torch.testing.assert_close(q, rope(raw_q))
    # a shifted window of positions gives the same output: the layer only sees relative positions
    torch.testing.assert_close(att(x, offset=9), att(x))


def test_reach_train_caps_distances():
    study = layer(window=2, base=[1, 2, 4, 8, 16, 32], reach="study")
    train = layer(window=2, base=[1, 2, 4, 8, 16, 32], reach="train", reach_len=10)
    assert max(study.distances(64)) == 32
    assert max(train.distances(64)) <= 9
    x = torch.randn(1, 64, 32, dtype=torch.float64)
    train.load_state_dict(study.state_dict())
    q, k, v = train.qkv(x)
    torch.testing.assert_close(train(x), train.merge(masked_attention(q, k, v, train.distances(64))))


def test_gqa_dense_matches_repeated_heads():
    att = layer(attention="dense")
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    q, k, v = att.qkv(x)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(att(x), att.merge(want))


@pytest.mark.parametrize("kw, needle", [
    (dict(d_model=30, n_heads=4), "divisible by n_heads"),
    (dict(n_kv_heads=3), "divisible by n_kv_heads"),
    (dict(d_model=12, n_heads=4, n_kv_heads=2), "even"),
    (dict(attention="flash"), "attention must be"),
    (dict(reach="train"), "reach_len"),
    (dict(reach="far"), "reach must be"),
    (dict(backend="cuda"), "backend must be"),
    (dict(attention="dense", learned=True), "learned=True"),
    (dict(alpha=0), "alpha"),
    (dict(window=-1), "window"),
    (dict(base="fibonacci"), "base"),
    (dict(learned=True, alpha=2.0), "alpha"),
])
def test_constructor_errors(kw, needle):
    args = dict(d_model=32, n_heads=4, n_kv_heads=2)
    args.update(kw)
    with pytest.raises(ValueError, match=needle):
        FibAttention(**args)


def test_bad_input_shape():
    with pytest.raises(ValueError, match=r"\(B, T, 32\)"):
        layer()(torch.randn(3, 32, dtype=torch.float64))


def test_from_config_schedules():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=64, window=4,
                      schedule="linear", backend="torch")
    alphas = [FibAttention.from_config(cfg, i).current_alpha() for i in range(4)]
    assert alphas == pytest.approx([0.5, 5 / 6, 7 / 6, 1.5])
    cfg.schedule, cfg.learned_init = "learned", "coprime"
    layers = [FibAttention.from_config(cfg, i) for i in range(4)]
    assert all(a.learned for a in layers)
    assert [a.current_alpha() for a in layers] == pytest.approx(config_layer_alphas(cfg), abs=1e-5)
    assert layers[0].reach_len == 64
    with pytest.raises(ValueError, match="layer_idx"):
        FibAttention.from_config(cfg, 4)


def _rope_by_hand(x, positions, head_dim, theta):
    """RoPE from its closed form, element by element with ``math``: pair ``(2j, 2j+1)`` at
    position ``m`` is multiplied (as ``x[2j] + i x[2j+1]``) by ``exp(i * m * theta**(-2j/Dh))``."""
    out = torch.empty_like(x, dtype=torch.float64)
    B, H, T, Dh = x.shape
    for b in range(B):
        for h in range(H):
            for t, m in enumerate(positions):
                for j in range(Dh // 2):
                    ang = m * theta ** (-2 * j / head_dim)
                    re, im = float(x[b, h, t, 2 * j]), float(x[b, h, t, 2 * j + 1])
                    out[b, h, t, 2 * j] = re * math.cos(ang) - im * math.sin(ang)
                    out[b, h, t, 2 * j + 1] = re * math.sin(ang) + im * math.cos(ang)
    return out


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compile-path"])
@pytest.mark.parametrize("head_dim, theta", [(8, 1e4), (6, 500.0)])
def test_rope_matches_closed_form_angles(monkeypatch, compiling, head_dim, theta):
    if compiling:                       # the real-arithmetic branch torch.compile traces
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    rope = RotaryEmbedding(head_dim, theta=theta)
    x = torch.randn(1, 2, 3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    # offsets 0, small, and past the first 256-row table (the cache is regrown on demand)
    for offset in (0, 5, 300, 1000):
        got = rope(x, offset)
        assert got.dtype == torch.float64 and got.shape == x.shape
        want = _rope_by_hand(x, [offset + t for t in range(3)], head_dim, theta)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)   # rotation in float32
    # a single pair, exactly: (1, 0) at position m rotates onto (cos, sin) of m * theta**(-2j/Dh)
    j, m = head_dim // 2 - 1, 7
    e = torch.zeros(1, 1, 1, head_dim, dtype=torch.float64)
    e[..., 2 * j] = 1.0
    ang = m * theta ** (-2 * j / head_dim)
    got = rope(e, m)[0, 0, 0]
    assert got[2 * j].item() == pytest.approx(math.cos(ang), abs=1e-6)
    assert got[2 * j + 1].item() == pytest.approx(math.sin(ang), abs=1e-6)
    assert got[: 2 * j].abs().max().item() == 0.0


def test_rope_real_path_matches_complex(monkeypatch):
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 5, 8)
    want = rope(x, 4)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)      # the path torch.compile traces
    torch.testing.assert_close(rope(x, 4), want)
