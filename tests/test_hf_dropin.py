"""fibattn inside a transformers Llama model through the attention-function registry."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fibattn import attended_distances, layer_alphas, sparse_attention  # noqa: E402
from fibattn.interop.hf_llama import IMPL_NAME, apply_fibattn, fibattn_attention, remove_fibattn  # noqa: E402

T = 40


def llama(seed=0, layers=3):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval()


def ids(b=2, t=T, seed=1):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_full_window_equals_dense():
    dense = llama()
    x = ids()
    with torch.no_grad():
        want = dense(x).logits
        fib = apply_fibattn(copy.deepcopy(dense), window=T, schedule="linear")
        got = fib(x).logits
    assert fib.config._attn_implementation == IMPL_NAME
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(remove_fibattn(fib)(x).logits, want, rtol=1e-5, atol=1e-5)


def test_sparse_layers_equal_sparse_attention():
    model = apply_fibattn(llama(), window=3, base="fib:8", schedule="linear", a_min=0.6, a_max=1.4)
    alphas = layer_alphas("linear", 3, a_min=0.6, a_max=1.4)
    assert [m.self_attn.fibattn_spec.alpha for m in model.model.layers] == pytest.approx(alphas)
    seen = {}

    def spy(module, q, k, v, mask=None, **kw):
        out, w = fibattn_attention(module, q, k, v, mask, **kw)
        seen[module.layer_idx] = (q, k, v, out)
        return out, w

    transformers.AttentionInterface.register(IMPL_NAME, spy)
    try:
        with torch.no_grad():
            model(ids())
    finally:
        transformers.AttentionInterface.register(IMPL_NAME, fibattn_attention)
    assert sorted(seen) == [0, 1, 2]
    dists = []
    for layer, (q, k, v, out) in seen.items():
        d = attended_distances(3, alphas[layer], "fib:8", T)
        dists.append(tuple(d))
        ref = sparse_attention(q, k, v, d, backend="torch").transpose(1, 2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # independent check: dense softmax under the sparse mask
        gap = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        mask = torch.isin(gap, torch.tensor(d)) & (gap >= 0)
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        att = (q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        torch.testing.assert_close(out, (att @ vv).transpose(1, 2), rtol=1e-4, atol=1e-5)
    assert len(set(dists)) == 3                # staggered: every layer attends a different set


def test_cached_decoding_matches_full_forward():
    model = apply_fibattn(llama(), window=2, schedule="coprime")
    x = ids(b=1)
    with torch.no_grad():
        full = model(x).logits[:, -1]
        pre = model(x[:, :-1], use_cache=True)
        cache = getattr(pre, "cache", None) or pre.past_key_values
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        step = model(x[:, -1:], use_cache=True, **{name: cache}).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-5)


def masked_dense_attention(module, q, k, v, mask=None, scaling=None, dropout=0.0, **kw):
    """Independent reference for the registered function: dense softmax under the layer's sparse mask."""
    T = q.shape[2]
    gap = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    allowed = torch.isin(gap, torch.tensor(module.fibattn_spec.distances(T))) & (gap >= 0)
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    return (s.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv).transpose(1, 2), None


def test_gradients_match_masked_dense_reference():
    """Every parameter's gradient (float64) equals the one through an explicit masked softmax."""
    model = apply_fibattn(llama(), window=2, schedule="linear").double().train()
    x = ids()
    model(x, labels=x).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    transformers.AttentionInterface.register(IMPL_NAME, masked_dense_attention)
    try:
        model(x, labels=x).loss.backward()
    finally:
        transformers.AttentionInterface.register(IMPL_NAME, fibattn_attention)
    want = {n: p.grad for n, p in model.named_parameters()}
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-7, atol=1e-10, msg=lambda m: f"{name}: {m}")
    for i in range(len(model.model.layers)):    # the projections feeding the attention core all get a gradient
        for proj in "qkv":
            assert want[f"model.layers.{i}.self_attn.{proj}_proj.weight"].abs().max() > 1e-6
    # and the sparse pattern matters: dense attention gives other gradients
    model.zero_grad(set_to_none=True)
    remove_fibattn(model)(x, labels=x).loss.backward()
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(dict(model.named_parameters())[q0].grad, want[q0], rtol=1e-3, atol=0)


def test_bad_arguments():
    model = llama(layers=2)
    with pytest.raises(ValueError, match="schedule"):
        apply_fibattn(model, schedule="learned")
    with pytest.raises(ValueError, match="alphas"):
        apply_fibattn(model, schedule="custom", alphas=[1.0])
    with pytest.raises(ValueError, match="window"):
        apply_fibattn(model, window=-1)
    with pytest.raises(ValueError, match="layer_idx and q_proj"):
        apply_fibattn(torch.nn.Linear(2, 2))
    plain = llama(layers=1)
    plain.set_attn_implementation(IMPL_NAME)
    with pytest.raises(ValueError, match="apply_fibattn"):
        plain(ids(t=4))


def test_save_pretrained_round_trip_keeps_the_sparse_attention(tmp_path):
    from fibattn.interop import hf_llama as H
    m = apply_fibattn(llama(), window=3, schedule="coprime").eval()
    x = ids(1)
    with torch.no_grad():
        ref = m(x).logits
    m.save_pretrained(tmp_path / "m")
    loaded = [H.from_pretrained(tmp_path / "m"),
              transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation=IMPL_NAME)]
    with torch.no_grad():
        for model in loaded:
            torch.testing.assert_close(model.eval()(x).logits, ref)
    plain = llama()
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="apply_fibattn"):      # never a silent dense model
        H.from_pretrained(tmp_path / "plain")


@pytest.mark.parametrize("kw", [dict(window=3), dict(window=2, base="pow2", schedule="fixed", alpha=0.5)])
def test_left_padded_batch_gives_the_unpadded_outputs(kw):
    # pow2 with alpha < 1: the set gains short distances as the length grows, so a padded row must use its own
    m = apply_fibattn(llama(), **kw).eval()
    x, p = ids(1), 6
    padded = torch.cat([torch.zeros(1, p, dtype=torch.long), x], 1)
    batch = torch.cat([padded, torch.cat([x[:, :p], x], 1)], 0)
    mask = torch.ones_like(batch)
    mask[0, :p] = 0
    with torch.no_grad():
        ref = m(x).logits
        out = m(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out[0, p:], ref[0], atol=1e-5, rtol=1e-5)
    greedy = dict(max_new_tokens=8, do_sample=False)
    want = m.generate(x[:, :12], **greedy)[0, 12:]
    got = m.generate(padded[:, :p + 12], attention_mask=mask[:1, :p + 12], **greedy)[0, p + 12:]
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("kw", [dict(window=3), dict(window=2, base="pow2", schedule="fixed", alpha=0.5)])
def test_right_padded_batch_gives_the_unpadded_outputs(kw, monkeypatch):
    """The sparse op serves the batch, the masked path is not called. fib: every length's set is the set at T
    cut to it, one call a layer; pow2 with alpha < 1 gains short distances as the length grows, so the short
    row takes its own set, in a call of its own. Either way the real tokens get their unpadded outputs."""
    from fibattn.interop import hf_documents as D
    from fibattn.interop import hf_llama as H
    m = apply_fibattn(llama(), **kw).eval()
    x, y, n = ids(1, 12), ids(1, 46, seed=2), 12
    batch = torch.cat([torch.cat([x, torch.zeros(1, 46 - n, dtype=torch.long)], 1), y], 0)
    mask = torch.ones_like(batch)
    mask[0, n:] = 0
    masked, op, calls, sets = H._masked, D.sparse_attention, [], []
    monkeypatch.setattr(H, "_masked", lambda *a: calls.append(1) or masked(*a))
    monkeypatch.setattr(D, "sparse_attention",
                        lambda q, k, v, d, **kw: sets.append((q.shape[0], d)) or op(q, k, v, d, **kw))
    with torch.no_grad():
        out = m(batch, attention_mask=mask).logits
    assert not calls and len(sets) == 3 * (2 if kw.get("base") == "pow2" else 1)
    if kw.get("base") == "pow2":
        assert sets[:2] == [(1, m.model.layers[0].self_attn.fibattn_spec.distances(n)),
                            (1, m.model.layers[0].self_attn.fibattn_spec.distances(46))]
    with torch.no_grad():
        want_x, want_y = m(x).logits, m(y).logits
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out[0, :n], want_x[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], want_y[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("restart", [False, True], ids=["positions run on", "positions restart"])
@pytest.mark.parametrize("kw", [dict(window=3), dict(window=2, base="pow2", schedule="fixed", alpha=0.5)])
def test_padded_batches_run_the_sparse_op_on_a_2d_mask(kw, restart, monkeypatch):
    """Rows padded on the left, on both sides and on the right: transformers hands the attention the 2-D padding
    mask (no T x T mask is built), and every row runs on the sparse op as documents, through its own set (the
    dense path is not called). Each row's real tokens get their unpadded outputs. A gap inside a row's real
    tokens takes the dense path."""
    from fibattn.interop import hf_documents as D
    from fibattn.interop import hf_llama as H
    m = apply_fibattn(llama(), **kw).eval()
    x, y, z = ids(1, 20), ids(1, 30, seed=2), ids(1, 40, seed=3)
    pad = lambda n: torch.zeros(1, n, dtype=torch.long)                       # noqa: E731
    batch = torch.cat([torch.cat([pad(20), x], 1), torch.cat([pad(4), y, pad(6)], 1), z], 0)
    mask = torch.ones_like(batch)
    mask[0, :20] = mask[1, :4] = mask[1, 34:] = 0
    kwargs = dict(attention_mask=mask)
    if restart:                                               # as generate makes them: each pad its own document
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    attend, key_padding, calls, dims = D.attend, H.key_padding, [], []
    for module in (D, H):                                     # the packed and padded paths; the masked one
        monkeypatch.setattr(module, "attend", lambda *a: calls.append(1) or attend(*a))
    monkeypatch.setattr(H, "key_padding", lambda mask, *a: dims.append(mask.dim()) or key_padding(mask, *a))
    with torch.no_grad():
        out = m(batch, **kwargs).logits
        want = [m(r).logits[0] for r in (x, y, z)]
    assert not torch.isnan(out).any() and set(dims) == {2}
    for got, ref in zip((out[0, 20:], out[1, 4:34], out[2]), want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert not calls
    calls.clear()
    mask[1, 15] = 0                                           # a gap: the tokens before it are still y's
    with torch.no_grad():
        out = m(batch, attention_mask=mask).logits
    assert calls and not torch.isnan(out).any()
    torch.testing.assert_close(out[1, 4:15], want[1][:11], atol=1e-5, rtol=1e-5)


def test_padding_mask_is_2d_for_the_causal_mask_only():
    from transformers import masking_utils as mu

    from fibattn.interop.hf_batch import padding_mask
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=3, kv_length=3, q_offset=2, kv_offset=2, attention_mask=pad,
              allow_is_causal_skip=True, dtype=torch.float32, device=pad.device)
    assert padding_mask(mask_function=mu.causal_mask_function, **kw) is None     # the window holds no padding
    got = padding_mask(mask_function=mu.causal_mask_function, **dict(kw, q_length=5, kv_length=5, q_offset=0,
                                                                        kv_offset=0))
    assert torch.equal(got, pad)
    other = mu.sliding_window_causal_mask_function(2)
    want = mu.sdpa_mask(mask_function=other, **dict(kw, q_offset=0, kv_offset=0, q_length=5, kv_length=5))
    assert torch.equal(padding_mask(mask_function=other, **dict(kw, q_offset=0, kv_offset=0, q_length=5,
                                                                kv_length=5)), want)


def test_a_pad_inside_a_packed_document_stays_hidden():
    """Packed documents (restarting positions) with a pad that joins the second document: its mask must still
    hide the pad from that document's tokens, which then get the logits of the document alone."""
    m = apply_fibattn(llama(), window=3).eval()
    a, b = ids(1, 10), ids(1, 9, seed=2)
    row = torch.cat([a, torch.zeros(1, 1, dtype=torch.long), b], 1)
    pos = torch.cat([torch.arange(10), torch.arange(10)])[None]            # the pad at 0, then b at 1 .. 9
    mask = torch.ones_like(row)
    mask[0, 10] = 0
    with torch.no_grad():
        out = m(row, attention_mask=mask, position_ids=pos).logits[0]
        torch.testing.assert_close(out[:10], m(a).logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[11:], m(b).logits[0], atol=1e-5, rtol=1e-5)


def test_padded_rows_with_their_own_sets_give_the_unpadded_gradients():
    """pow2 with alpha < 1: the rows of a padded batch take their own sets in calls of their own; the gradients
    of a loss over the real tokens equal those of the rows run alone."""
    m = apply_fibattn(llama(), window=2, base="pow2", schedule="fixed", alpha=0.5)
    x, y = ids(1, 9), ids(1, 30, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 21, dtype=torch.long), x], 1), y], 0)
    mask = torch.ones_like(batch)
    mask[0, :21] = 0
    out = m(batch, attention_mask=mask).logits
    (out[0, 21:].square().sum() + out[1].square().sum()).backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    (m(x).logits.square().sum() + m(y).logits.square().sum()).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-4, rtol=1e-4, msg=n)


@pytest.mark.parametrize("kw", [dict(window=3), dict(window=2, base="pow2", schedule="fixed", alpha=0.5)])
@pytest.mark.parametrize("cached", [False, True], ids=["every key", "FibCache keys"])
def test_cached_steps_gather_their_columns_as_the_masked_path(kw, cached):
    """A cached step (Tq < Tk; grouped heads; a left-padded row, a row padded on both sides, an unpadded one)
    reads only the keys at its distances: outputs and gradients equal the masked path over every key."""
    from fibattn.interop import hf_documents as D
    from fibattn.interop import hf_llama as H
    m = apply_fibattn(llama(), **kw)
    spec = m.model.layers[1].self_attn.fibattn_spec
    g = torch.Generator().manual_seed(0)
    tq, tk = 3, 29
    q = torch.randn(3, 4, tq, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(3, 2, tk, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    real = torch.ones(3, tk, dtype=torch.bool)
    real[0, :11] = real[1, :2] = real[1, -1] = False
    dists = spec.distances(tk + (40 if cached else 0))
    for pad in (real, None):
        got = D.gathered(spec, dists, q, k, v, pad, not cached, 0.25)
        mask = None if pad is None else (H.causal(tq, tk, q.device) & pad[:, None, :])[:, None]
        if mask is None:
            want = H.attend(q, k, v, H._cached_mask(dists, tq, tk, q.device)[None, None].expand(3, 1, tq, tk), 0.25)
        else:
            want = H._masked(spec.distances if not cached else dists, q, k, v, mask, 0.25)
        keep = torch.ones(3, 1, tq, 1, dtype=torch.float64)
        keep[1, :, -1] = 0                                    # the pad query's output is nobody's
        torch.testing.assert_close(got * keep, want * keep)
        grads = torch.autograd.grad((got * keep).square().sum(), (q, k, v))
        for a, b in zip(grads, torch.autograd.grad((want * keep).square().sum(), (q, k, v))):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kw,fib_cache", [(dict(window=2, base="pow2", schedule="fixed", alpha=0.5), False),
                                           (dict(window=2, base="fib:6", schedule="coprime"), False),
                                           (dict(window=2, base="fib:6", schedule="coprime"), True)])
def test_generation_reads_only_the_attended_keys(kw, fib_cache, monkeypatch):
    """generate with a left-padded batch: no step takes the masked path, and each row's greedy tokens are its
    unpadded prompt's (transformers' cache: each row through its own length's set; FibCache: the set at the
    batch's length, which for pow2 with alpha < 1 is not the short row's, so fib there)."""
    from fibattn.interop import hf_llama as H
    from fibattn.interop.hf_cache import FibCache
    m = apply_fibattn(llama(), **kw).eval()
    x, y = ids(1, 9), ids(1, 14, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), x], 1), y])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)      # no early end of sequence
    want = [m.generate(r, **greedy)[0, r.shape[1]:].tolist() for r in (x, y)]
    masked, calls = H._masked, []
    monkeypatch.setattr(H, "_masked", lambda *a: calls.append(1) or masked(*a))
    cache = dict(cache=FibCache(m, context=40)) if fib_cache else {}
    got = m.generate(batch, attention_mask=mask, **greedy, **cache)[:, 14:]
    assert got.tolist() == want and not calls
