"""FibCache: ``model.generate`` through transformers in constant memory, with the full cache's tokens and logits."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fibattn.bench import hf_cache as bench  # noqa: E402
from fibattn.interop import hf_llama  # noqa: E402
from fibattn.interop.hf_cache import FibCache, FibCacheLayer, cache_bytes  # noqa: E402
from fibattn.interop.hf_llama import FIRST_KEY_POSITION, apply_fibattn, fibattn_attention  # noqa: E402

V = 256


def llama(layers=3, heads=4, kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=2048, attn_implementation="sdpa",
                                   eos_token_id=None)          # no stop token: every run makes all its tokens
    return transformers.LlamaForCausalLM(cfg).eval()


def ids(b=1, t=40, seed=1):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def cache_kw(model, cache) -> dict:
    """transformers 5 names the argument ``cache`` (``past_key_values`` before)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def greedy(model, x, new, cache=None, **kw):
    """Tokens ``(B, new)`` and the logits of every step ``(new, B, V)``."""
    out = model.generate(x, max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **(cache_kw(model, cache) if cache is not None else {}), **kw)
    return out.sequences[:, x.shape[1]:], torch.stack(out.logits)


@torch.no_grad()
def reference(model, x, new):
    """fibattn's reference: argmax of a full forward pass (no cache) at every step."""
    for _ in range(new):
        x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x[:, -new:]


SETUPS = {   # name: (apply_fibattn kwargs, FibCache context)
    "fib, reach_len": (dict(window=2, base="fib:6", schedule="linear", reach_len=24), None),
    "fib, context": (dict(window=2, base="fib:6", schedule="coprime"), 72),
    "window 0": (dict(window=0, base="fib:7", schedule="linear", a_min=0.6, a_max=1.3, reach_len=32), None),
    # pow2 with alpha < 1: a shorter set is not the longer one cut short, so earlier positions change as the
    # length grows and no cached decoding equals a full forward per step; FibCache still equals the full cache
    "pow2, context": (dict(window=1, base="pow2", schedule="linear", a_min=0.3, a_max=1.2), 72),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_greedy_tokens_and_logits_equal_the_full_cache(name):
    kwargs, context = SETUPS[name]
    model = apply_fibattn(llama(), **kwargs)
    x, new = ids(t=50), 22
    cache = FibCache(model, context=context)
    assert max(cache.keeps) + 1 < x.shape[1]              # the prompt is longer than any layer keeps
    tokens, logits = greedy(model, x, new, cache)
    full_tokens, full_logits = greedy(model, x, new)
    assert tokens.tolist() == full_tokens.tolist()
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-5)
    if not name.startswith("pow2"):
        assert tokens.tolist() == reference(model, x, new).tolist()
    # each layer holds its own last max(D) keys and values, nothing more
    total = x.shape[1] + new - 1                           # the last token is never fed back
    lengths = context or kwargs["reach_len"]
    for layer, spec, keep in zip(cache.layers, [m.fibattn_spec for m in hf_llama.attention_modules(model)],
                                 cache.keeps):
        assert keep == max(spec.distances(lengths))
        assert layer.keys.shape == layer.values.shape == (1, 2, keep, 16)
        assert layer.get_seq_length() == total
    assert len(set(cache.keeps)) > 1                       # per-layer lengths


def test_equal_length_batch_and_beam_search():
    model = apply_fibattn(llama(), window=2, base="fib:6", schedule="linear", reach_len=24)
    x, new = ids(b=3, t=30, seed=4), 20
    tokens, logits = greedy(model, x, new, FibCache(model))
    full_tokens, full_logits = greedy(model, x, new)
    assert tokens.tolist() == full_tokens.tolist()
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-5)
    for r in range(3):
        assert tokens[r].tolist() == greedy(model, x[r:r + 1], new, FibCache(model))[0][0].tolist()
    beams = dict(max_new_tokens=12, num_beams=2, do_sample=False)
    got = model.generate(x[:1], **cache_kw(model, FibCache(model)), **beams)
    assert got.tolist() == model.generate(x[:1], **beams).tolist()


def test_left_padded_batch_gives_the_unpadded_tokens():
    model = apply_fibattn(llama(), window=2, base="fib:6", schedule="coprime")
    long, short, new = ids(t=36, seed=5), ids(t=27, seed=6), 16
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)], 0)
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    context = batch.shape[1] + new
    cache = FibCache(model, context=context)
    assert max(cache.keeps) < short.shape[1]
    tokens, logits = greedy(model, batch, new, cache, attention_mask=mask)
    full_tokens, full_logits = greedy(model, batch, new, attention_mask=mask)
    assert tokens.tolist() == full_tokens.tolist()
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-5)
    for row, prompt in enumerate((long, short)):
        alone = greedy(model, prompt, new, FibCache(model, context=context))[0][0]
        assert tokens[row].tolist() == alone.tolist() == reference(model, prompt, new)[0].tolist()


def test_cache_bytes_do_not_grow_with_the_context():
    n = 256
    records = bench.measure([n, 4 * n], reach_len=64, new=4)
    assert [r["context"] for r in records] == [n, 4 * n]
    assert records[0]["fib_cache_bytes"] == records[1]["fib_cache_bytes"] > 0
    assert records[1]["full_cache_bytes"] > 3 * records[0]["full_cache_bytes"]
    assert all(r["tokens_equal"] for r in records)
    kept = records[0]["kept_keys"]
    rows = sum(FibCacheLayer.rows(k) for k in kept)                     # the kept keys and the room past them
    assert records[0]["fib_cache_bytes"] == rows * 2 * 2 * 16 * 4       # k and v, 2 KV heads, head size 16, fp32
    assert "FibCache bytes equal at every context: True" in bench.format_table(records)


def test_bench_cli(capsys):
    from fibattn.cli import main
    assert main(["bench", "hf-cache", "--contexts", "48,96", "--reach-len", "16", "--new", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"fib_cache_bytes"' in out and '"tokens_equal": true' in out
    assert main(["bench", "hf-cache", "--contexts", "2", "--new", "2"]) == 2
    assert "--contexts" in capsys.readouterr().err


def test_a_reach_len_beyond_the_context_sizes_nothing():
    """--reach-len allocates nothing itself (FibCache grows with the tokens seen, up to the context): a reach
    of 10**30 holds the full cache's rows and its buffer's room, so its memory is the --contexts check's."""
    far = bench.measure([48], reach_len=10 ** 30, new=2)[0]
    per_row = far["full_cache_bytes"] // 47                          # the 46 prompt tokens and one step's
    assert far["fib_cache_bytes"] == FibCacheLayer.rows(46) * per_row and far["tokens_equal"]


def test_chunked_prefill_and_the_marked_keys():
    """A second chunk of several tokens after a prefill attends the kept keys exactly."""
    model = apply_fibattn(llama(layers=2), window=1, base="pow2", schedule="linear", a_min=0.4, a_max=1.0)
    x = ids(t=50, seed=7)
    cache = FibCache(model, context=50)
    seen = {}

    def spy(module, q, k, v, *args, **kw):
        seen[module.layer_idx] = getattr(k, FIRST_KEY_POSITION, None), k.shape[2]
        return fibattn_attention(module, q, k, v, *args, **kw)

    with torch.no_grad():
        want = model(x).logits[:, 35:]
        model(x[:, :35], use_cache=True, **cache_kw(model, cache))
        transformers.AttentionInterface.register(hf_llama.IMPL_NAME, spy)
        try:
            got = model(x[:, 35:], use_cache=True, **cache_kw(model, cache)).logits
        finally:
            transformers.AttentionInterface.register(hf_llama.IMPL_NAME, fibattn_attention)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i, keep in enumerate(cache.keeps):
        assert seen[i] == (35 - keep, keep + 15)       # the kept tail, then the 15 new positions


def test_errors_are_clear():
    model = apply_fibattn(llama(layers=2), window=2, base="fib:6")
    with pytest.raises(ValueError, match="reach_len"):
        FibCache(model)                                        # the sets grow without bound: a context is needed
    with pytest.raises(ValueError, match="context must be an integer >= 1"):
        FibCache(model, context=0)
    cache = FibCache(model, context=30)
    with pytest.raises(ValueError, match="length 31 is past the cache's context 30"):
        greedy(model, ids(t=20), 12, cache)      # feeds 20 + 11 positions: never wrong numbers past the context
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-1)
    cache.reset()                                              # a reset cache starts over
    assert cache.get_seq_length() == 0 and cache.cache_bytes == 0
    assert greedy(model, ids(t=20), 5, cache)[0].tolist() == greedy(model, ids(t=20), 5)[0].tolist()
    with pytest.raises(ValueError, match="attn_implementation is 'sdpa'"):
        FibCache(llama(layers=1))
    assert cache_bytes(transformers.DynamicCache(config=model.config)) == 0


@pytest.mark.parametrize("prompt", [80, 6], ids=["prompt past the kept keys", "prompt shorter"])
def test_steps_write_into_the_buffer(prompt, monkeypatch):
    """A step copies its own key, not every kept one: past a prompt longer than what a layer keeps, only the
    prompt starts a buffer (later steps append, moving the kept rows to the start when the room runs out);
    after a short prompt the buffer grows a quarter at a time. The tokens and logits stay the full cache's."""
    model = apply_fibattn(llama(), window=2, base="fib:8", schedule="linear", reach_len=64)
    starts, start = [], FibCacheLayer._start_buffer
    monkeypatch.setattr(FibCacheLayer, "_start_buffer",
                        lambda self, k, v: starts.append(k.shape[-2]) or start(self, k, v))
    x, new = ids(2, prompt), 70
    cache = FibCache(model)
    tokens, logits = greedy(model, x, new, cache)
    want_tokens, want_logits = greedy(model, x, new)
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    layers = len(cache.keeps)
    if prompt > max(cache.keeps):
        assert starts == [prompt] * layers
    else:                                                     # a few growths, each a quarter more
        assert starts[:layers] == [prompt] * layers and layers < len(starts) <= layers * 8
    for layer, keep in zip(cache.layers, cache.keeps):
        row = layer.keys[:, :, :1].numel() * layer.keys.element_size()
        held = layer.keys.untyped_storage().nbytes()
        assert layer.keys.shape[-2] == keep and held <= FibCacheLayer.rows(keep) * row
        assert prompt < keep or held == FibCacheLayer.rows(keep) * row


def test_a_step_with_gradients_reaches_the_kept_keys():
    """With gradients on, the kept keys keep their history: a step's loss has the full cache's gradients."""
    model = apply_fibattn(llama(), window=2, base="fib:6", schedule="linear", reach_len=24)
    x = ids(1, 30)
    grads = []
    for cache in (FibCache(model), transformers.DynamicCache(config=model.config)):
        model.zero_grad()
        first = model(x[:, :-1], use_cache=True, **cache_kw(model, cache))
        model(x[:, -1:], use_cache=True, **cache_kw(model, getattr(first, "cache", None) or first.past_key_values)
              ).logits.square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)
