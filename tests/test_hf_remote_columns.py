"""The ``export --format hf`` remote code computes only the attended columns (no T x T tensor anywhere), keeps a
constant-memory cache of its own for ``generate``, gives fibattn's own greedy tokens, accepts fibattn's
``FibCache`` too, and computes RoPE angles as precisely as fibattn (the 4x logit gap). In-process, on the
template module with fibattn's op switched off (``sparse_attention = None``: the path it takes without fibattn);
the subprocess test where fibattn cannot be imported at all is test_export_hf_remote.py."""
import inspect
import types

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import fibattn  # noqa: E402
from fibattn.interop.hf_cache import FibCache  # noqa: E402
from fibattn.interop.hf_export import export_hf  # noqa: E402
from fibattn.interop.hf_remote import modeling_fibattn_llama as R  # noqa: E402
from fibattn.schedules import attended_distances  # noqa: E402
from test_export_hf_remote import make_run  # noqa: E402

ATOL = RTOL = 1e-5
SETTINGS = {"window": 3, "alphas": [0.75, 1.5], "reach_len": None, "schedule": "custom", "backend": "torch",
            "base": {"kind": "fib", "k": 7, "values": []}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(FibLM, the remote-code model of its export, the export folder) for a fib run with reach "train"."""
    root = tmp_path_factory.mktemp("hf-columns")
    run = make_run(root / "run", reach="train", base_k=10)
    out = export_hf(run, root / "hf")
    return fibattn.from_pretrained(run).eval(), R.FibattnLlamaForCausalLM.from_pretrained(out).eval(), out


@pytest.fixture
def gathered(monkeypatch):
    monkeypatch.setattr(R, "sparse_attention", None)      # as where fibattn is not installed


def layer(idx=0, settings=SETTINGS):
    return types.SimpleNamespace(config=types.SimpleNamespace(fibattn=settings), layer_idx=idx)


def reference(module, q, k, v, seq_lens, keys=None):
    """Dense attention through a boolean pattern: query ``Tk - Tq + i`` of row ``b`` sees key ``j`` when the
    distance is in the set of the row's length ``seq_lens[b]`` and ``keys[b, j]`` (a real key)."""
    s, tq, tk = module.config.fibattn, q.shape[2], k.shape[2]
    gap = torch.arange(tk - tq, tk)[:, None] - torch.arange(tk)
    rows = []
    for n in seq_lens:
        ds = attended_distances(s["window"], s["alphas"][module.layer_idx], fibattn.schedules.Base(
            s["base"]["kind"], s["base"]["k"]), n, reach=s["reach_len"])
        rows.append(torch.isin(gap, torch.tensor(ds)) & (gap >= 0))
    mask = torch.stack(rows)[:, None] & (True if keys is None else keys[:, None, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def test_the_gathered_columns_equal_a_dense_pattern_and_build_no_t_by_t_tensor(gathered):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out
    g = torch.Generator().manual_seed(0)
    T, B = 512, 2
    q, k, v = (torch.randn(B, h, T, 8, generator=g) for h in (4, 2, 2))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :37] = False                                             # a left-padded row
    with Largest():
        out, _ = R.fibattn_llama_attention(layer(1), q, k, v, attention_mask=mask, scaling=8 ** -0.5)
    assert Largest.numel < T * T                   # the largest tensor: B x H x T x Dh, or T x |D| scores
    want = reference(layer(1), q, k, v, [T, T - 37], mask)
    torch.testing.assert_close(out[0], want[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[1, 37:], want[1, 37:], atol=ATOL, rtol=RTOL)
    # kept keys from a cache (marked with their first position): the queries are the last Tq
    kk, vv = k[:1, :, -40:].clone(), v[:1, :, -40:].clone()
    setattr(kk, R.FIRST_KEY_POSITION, T - 40)
    got, _ = R.fibattn_llama_attention(layer(1), q[:1, :, -3:], kk, vv, scaling=8 ** -0.5)
    torch.testing.assert_close(got[0], reference(layer(1), q[:1], k[:1], v[:1], [T])[0, -3:], atol=ATOL, rtol=RTOL)


def test_packed_documents_and_the_none_base(gathered):
    g = torch.Generator().manual_seed(1)
    lengths = (20, 3, 40)
    q, k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g) for _ in range(3))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    for kind in ("fib", "none"):
        module = layer(0, dict(SETTINGS, base={"kind": kind, "k": 7, "values": []}))
        out, _ = R.fibattn_llama_attention(module, q, k, v, position_ids=pos)
        at, want = 0, []
        for n in lengths:
            want.append(reference(module, *(x[:, :, at:at + n] for x in (q, k, v)), [n])[0])
            at += n
        torch.testing.assert_close(out[0], torch.cat(want), atol=ATOL, rtol=RTOL)
    assert R.longest_distance(module.config.fibattn, 0) == 3         # none: the window alone, at any length


def check_generate(fib, model, new):
    """generate's default cache is FibattnCache, each layer keeping max(D) at its context; fibattn's tokens."""
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    g = model.generate(x, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    cache = getattr(g, "cache", None) or g.past_key_values
    assert type(cache).__name__ == "FibattnCache"
    keeps = [layer.keys.shape[-2] for layer in cache.layers]
    assert keeps == [R.longest_distance(model.config.fibattn, i, 20 + new) for i in range(2)]
    assert g.sequences[0, 20:].tolist() == fib.generate(x, max_new_tokens=new, temperature=0)[0]
    return x, g.sequences, keeps


def test_generate_keeps_a_constant_memory_cache_and_fibattns_tokens(pair, gathered):
    check_generate(pair[0], pair[1], 2)


def test_generate_past_reach_len_and_with_fibattns_fibcache(pair, gathered):      # default suite: < 1 s
    fib, model, _ = pair
    x, seq, keeps = check_generate(fib, model, 14)
    # from reach_len (32) on, each layer keeps a constant max(D), whatever the generated length
    assert keeps == [R.longest_distance(model.config.fibattn, i) for i in range(2)] == \
        [max(d) for d in fib.distances(32)]
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    got = model.generate(x, max_new_tokens=14, do_sample=False, **{kw: FibCache(model, context=34)})
    assert got[0, 20:].tolist() == seq[0, 20:].tolist()          # fibattn's FibCache serves it too


def test_fibcache_accepts_the_remote_code_model(pair):
    cache = FibCache(pair[1], context=34)
    assert cache.keeps == [R.longest_distance(pair[1].config.fibattn, i, 34) for i in range(2)]


@pytest.mark.parametrize("loader", ["remote code", "hf_llama"])
def test_rope_angles_are_float64_as_fibattns(pair, loader):
    from fibattn.interop import hf_llama as H
    model = pair[1] if loader == "remote code" else H.from_pretrained(pair[2])
    rotary = model.model.rotary_emb
    pos = torch.arange(0, 16384, 7)[None]
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, pos)
    inv = rotary.config.rope_parameters["rope_theta"] ** (-torch.arange(cos.shape[-1] // 2, dtype=torch.float64)
                                                           * 2 / cos.shape[-1])
    ang = pos[0, :, None].double() * inv
    exact = torch.cat([ang, ang], -1)
    assert (cos[0].double() - exact.cos()).abs().max() < 1e-7 and (sin[0].double() - exact.sin()).abs().max() < 1e-7
