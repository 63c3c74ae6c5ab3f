"""Prefill in chunks (issue 55 item 3): a prompt run ``chunk`` tokens at a time leaves the caches and gives the
logits of one pass over it, for every layer kind, and generation after it is unchanged.

Geometry: the tiny models below have rings of ``max(D) + 1`` rows (about 14 at window 3 with the fib base at
length 64), so chunks of 1, 5 and 13 tokens make the ring wrap inside a chunk and across chunk ends, a chunk
shorter than the window, and a chunk ending exactly at the first rung's reach; the dense layers read the whole
prefix, the learned ones both taps of each rung."""
import pytest
import torch

from fibattn.generation.decode import DecodeSession, generate_tokens
from test_decode_static import _model

PROMPT = [(i * 7 + 3) % 50 for i in range(41)]


@pytest.mark.parametrize("kind", ["static", "learned", "dense", "mixed"])
@pytest.mark.parametrize("chunk", [1, 5, 13, 40])
def test_a_chunked_prefill_leaves_the_caches_and_logits_of_one_pass(kind, chunk):
    model = _model(kind, seq_len=64)
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    whole = DecodeSession(model, 2, 64)
    want = whole.prefill([0, 1], ids)
    part = DecodeSession(model, 2, 64, prefill_chunk=chunk)
    got = part.prefill([0, 1], ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(part.layers, whole.layers):
        n = a.cache.rows if a.plan is not None else len(PROMPT)
        torch.testing.assert_close(a.cache.kv[:, :, :n], b.cache.kv[:, :, :n], rtol=1e-5, atol=1e-6)
    tok = torch.tensor([3, 4])
    torch.testing.assert_close(part.step(tok), whole.step(tok), rtol=1e-5, atol=1e-5)


def test_generation_after_a_chunked_prefill_is_unchanged():
    model = _model("mixed", seq_len=64)
    want = generate_tokens(model, [PROMPT, PROMPT[:9]], max_new_tokens=10, temperature=0)
    got = generate_tokens(model, [PROMPT, PROMPT[:9]], max_new_tokens=10, temperature=0, prefill_chunk=6)
    assert got == want


@pytest.mark.parametrize("kind", ["learned", "dense"])
def test_a_compiled_prefill_takes_a_graph_per_kind_of_chunk_and_gives_the_eager_logits(kind, request):
    """fullgraph (a break raises); chunks of 12 over 41 tokens with rings of at most 12 rows (fib:5): the first
    chunk, the middle ones (the rings full, a dense layer's growing prefix dynamic) and a short last one -> three
    graphs, and none for a new session. The learned model's graphs go through inductor; the dense one's graphs
    are dynamo's alone (the dynamic prefix is a capture question; inductor's code for it, 15 s on 2 cores, is
    torch's)."""
    from fibattn.generation.static import rope_tables
    torch._dynamo.reset()
    if kind == "dense":
        request.getfixturevalue("dynamo_only")
    torch._dynamo.utils.counters.clear()
    model = _model(kind, n_layers=2, seq_len=64, base_k=5)      # two layers: the graphs are the same
    assert all(layer.cache.rows <= 12 for layer in DecodeSession(model, 1, 64).layers if layer.plan is not None)
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    want = DecodeSession(model, 2, 64, prefill_chunk=12).prefill([0, 1], ids)
    for n in range(2):
        session = DecodeSession(model, 2, 64, prefill_chunk=12)
        session.compile_prefill(rope_tables(session))
        with torch._dynamo.config.patch(error_on_recompile=n == 1):
            got = session.prefill([0, 1], ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
