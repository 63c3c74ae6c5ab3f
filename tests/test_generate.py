"""Streaming generation: decode-step logits equal full forward passes, caches stay constant."""
from argparse import Namespace

import pytest
import torch

from fibattn.config import ModelConfig
from fibattn.data.tokenizers import ByteTokenizer
from fibattn.cli import generate as cli_generate
from fibattn.cli.generate import run
from fibattn.generation.decode import DecodeSession, Sampling, generate, generate_tokens, sample
from fibattn.generation.text import TextStream
from fibattn.model.lm import FibLM

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decoding is many tiny ops: one thread avoids OpenMP wake-ups on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROMPT, NEW = 9, 31          # context 40 > seq_len 16: decoding runs past the training length


def small(**kw) -> ModelConfig:
    args = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, seq_len=16, max_seq_len=4096,
                window=3, base_k=6)
    args.update(kw)
    return ModelConfig(**args)


def build(seed=0, **kw) -> FibLM:
    torch.manual_seed(seed)
    model = FibLM(small(**kw)).eval()
    for layer in model.layers():          # generic (non-grid) learned alphas
        if layer.learned:
            layer.alphas.theta.data.add_(torch.randn(1) * 0.3)
    return model


def run_greedy(model, prompt, new=NEW, **kw):
    steps = list(generate(model, prompt, max_new_tokens=new, temperature=0, **kw))
    seq = list(prompt) + [int(s.tokens[0]) for s in steps]
    return steps, seq


LEARNED = dict(schedule="learned", learned_init="linear")
CONFIGS = {
    "fib-fixed": dict(schedule="fixed", alpha=1.0),
    "fib-linear": dict(schedule="linear"),
    "fib-coprime": dict(schedule="coprime", n_layers=4),
    "fib-learned": LEARNED,
    "fib-custom": dict(schedule="custom", alphas=[0.7, 1.1, 1.45]),
    "custom-base": dict(base="custom", base_values=[4, 7, 19, 30], schedule="linear"),
    "pow2-fixed": dict(base="pow2", schedule="fixed", alpha=1.25),
    "pow2-linear": dict(base="pow2", schedule="linear"),
    "pow2-learned": dict(base="pow2", **LEARNED),
    "dense": dict(attention="dense"),
    "torch-backend": dict(schedule="linear", backend="torch"),
    "torch-learned": dict(backend="torch", **LEARNED),
}
# pow2 with alpha < 1 is not prefix-stable (its base grows with T): only the final-length check holds
PREFIX_STABLE = {name for name in CONFIGS if name not in ("pow2-linear", "pow2-learned")}


@pytest.mark.parametrize("reach", ["study", "train"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_logits_equal_full_forward(name, reach):
    if name == "dense" and reach == "train":
        pytest.skip("reach does not apply to dense attention")
    model = build(**CONFIGS[name], reach=reach)
    # geometry: every sparse layer's ring (its largest distance + 1 rows: 5 to 33 here) is shorter than the 40
    # positions decoded, so it wraps around while the full forward sees the whole sequence; the window (3) is
    # shorter than the rungs; the 9-token prompt is shorter than most rings (the first steps' rows clamp at 0)
    if name != "dense":
        assert max(DecodeSession(model, 1, PROMPT + NEW).cache_rows) < PROMPT + NEW
    prompt = torch.randint(0, 64, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    steps, seq = run_greedy(model, prompt)
    assert len(steps) == NEW
    with torch.no_grad():
        full = model(torch.tensor([seq]))[0]           # one pass at the context length
        for i, st in enumerate(steps):
            torch.testing.assert_close(st.logits[0], full[PROMPT - 1 + i], rtol=1e-5, atol=1e-5)
        if name in PREFIX_STABLE:                      # ... and every prefix alone
            for i in range(0, NEW, 6):
                n = PROMPT + i
                torch.testing.assert_close(steps[i].logits[0], model(torch.tensor([seq[:n]]))[0, -1],
                                           rtol=1e-5, atol=1e-5)


def test_ring_wraps_and_is_sized_by_the_distance_set():
    model = build(schedule="linear", reach="train")
    session = DecodeSession(model, 1, 40)
    spans = [max(layer.distances(40)) + 1 for layer in model.layers()]
    assert session.cache_rows == spans and max(spans) <= 16 < 40      # so positions wrap around the ring
    learned = build(**LEARNED)
    from fibattn.schedules import interpolation_plan
    want = [interpolation_plan(3, a, "fib:6", 40).span for a in learned.alphas()]
    assert DecodeSession(learned, 1, 40).cache_rows == want


@pytest.mark.parametrize("kw", [dict(schedule="linear"), LEARNED, dict(attention="dense")],
                         ids=["static", "learned", "dense"])
def test_batched_prompts_of_different_lengths_equal_single_runs(kw):
    model = build(**kw)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 11, 7, 11)]
    batch = list(generate(model, prompts, max_new_tokens=12, temperature=0))
    for r, prompt in enumerate(prompts):
        single = list(generate(model, prompt, max_new_tokens=12, temperature=0))
        assert [int(s.tokens[r]) for s in batch] == [int(s.tokens[0]) for s in single]
        for a, b in zip(batch, single):
            torch.testing.assert_close(a.logits[r], b.logits[0], rtol=1e-5, atol=1e-5)
    sampled = generate_tokens(model, prompts, max_new_tokens=10, temperature=1.0, seed=[5, 6, 7, 8])
    for r, prompt in enumerate(prompts):
        assert sampled[r] == generate_tokens(model, prompt, max_new_tokens=10, temperature=1.0, seed=5 + r)[0]


def test_greedy_deterministic_and_seeded_sampling_reproducible():
    model = build(**LEARNED)
    prompt = [1, 2, 3, 4]
    greedy = generate_tokens(model, prompt, max_new_tokens=15, temperature=0)
    assert greedy == generate_tokens(model, prompt, max_new_tokens=15, temperature=0)
    assert greedy == generate_tokens(model, torch.tensor([prompt]), max_new_tokens=15, temperature=0)
    kw = dict(max_new_tokens=20, temperature=1.3, top_k=20, top_p=0.95)
    a = generate_tokens(model, prompt, seed=11, **kw)
    assert a == generate_tokens(model, prompt, seed=11, **kw)
    assert a != generate_tokens(model, prompt, seed=12, **kw)
    # the FibLM.stream steps themselves: 20 steps, numbered, the last one finished, tokens as above
    steps = list(model.stream(prompt, seed=11, **kw))
    tokens = [int(s.tokens[0]) for s in steps]
    assert tokens == a[0] and len(tokens) == 20 and all(0 <= t < 64 for t in tokens)
    assert [s.index for s in steps] == list(range(20))
    assert [bool(s.finished[0]) for s in steps] == [False] * 19 + [True]
    assert [int(s.tokens[0]) for s in model.stream(prompt, seed=11, **kw)] == tokens      # same seed, same tokens
    with torch.no_grad():
        full = model(torch.tensor([prompt + tokens]))[0]
    replay = torch.Generator().manual_seed(11)
    for i, (st, tok) in enumerate(zip(steps, tokens)):
        # each step's logits are the full forward's at the previous position
        torch.testing.assert_close(st.logits[0], full[len(prompt) - 1 + i], rtol=1e-5, atol=1e-5)
        # the token lies in the top_k=20 / top_p=0.95 support of those logits at temperature 1.3
        x = st.logits[0].double() / 1.3
        assert (x > x[tok]).sum().item() < 20
        p = torch.softmax(x.masked_fill(x < x.topk(20).values[-1], float("-inf")), -1)
        assert p[p > p[tok]].sum().item() < 0.95
        # and is the one draw per step from the row's generator seeded with 11
        assert sample(st.logits, Sampling(1.3, 20, 0.95), [replay]).item() == tok


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).repeat(400, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    assert set(sample(logits, Sampling(0.0), gens).tolist()) == {1}
    assert set(sample(logits, Sampling(1.0, top_k=1), gens).tolist()) == {1}
    assert set(sample(logits, Sampling(1.0, top_p=0.01), gens).tolist()) == {1}
    assert set(sample(logits, Sampling(1.0, top_k=2), gens).tolist()) == {1, 2}
    assert set(sample(logits, Sampling(5.0), gens).tolist()) == {0, 1, 2, 3, 4}
    # top_p keeps the smallest set whose mass reaches p: tokens 1, 2 hold ~0.78 of the mass
    assert set(sample(logits, Sampling(1.0, top_p=0.7), gens).tolist()) == {1, 2}


@pytest.mark.parametrize("kw", [dict(schedule="linear"), LEARNED, dict(base="pow2", reach="train")],
                         ids=["static", "learned", "pow2-train"])
def test_sparse_cache_size_independent_of_context(kw):
    model = build(**kw)
    sizes = {n: DecodeSession(model, 1, n) for n in (200, 2000)}
    assert sizes[200].cache_bytes == sizes[2000].cache_bytes > 0
    assert sizes[200].cache_rows == sizes[2000].cache_rows
    steps = list(generate(model, [1, 2, 3], max_new_tokens=5, temperature=0, context=2000))
    assert len(steps) == 5


def test_dense_cache_grows_and_dense_window():
    model = build(attention="dense")
    session = DecodeSession(model, 1, 2000)
    with torch.no_grad():
        session.prefill([0], torch.randint(0, 64, (1, 600)))
    assert session.cache_rows == [600] * 3
    windowed = DecodeSession(model, 1, 2000, dense_window=50)
    assert windowed.cache_rows == [50] * 3
    prompt = list(range(30))            # shorter than the window: exact
    a = [s.logits for s in generate(model, prompt, max_new_tokens=10, temperature=0)]
    b = [s.logits for s in generate(model, prompt, max_new_tokens=10, temperature=0, dense_window=50)]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_stop_ids_and_finished_rows():
    model = build()
    prompts = [[5, 6], [7, 8, 9]]
    first = generate_tokens(model, prompts, max_new_tokens=6, temperature=0)
    stop = first[0][0]
    steps = list(generate(model, prompts, max_new_tokens=6, temperature=0, stop_ids=[stop]))
    col0 = [int(s.tokens[0]) for s in steps]
    col1 = [int(s.tokens[1]) for s in steps]
    assert col0[0] == stop and bool(steps[0].finished[0]) and all(t == -1 for t in col0[1:])
    n1 = first[1].index(stop) + 1 if stop in first[1] else 6
    assert col1[:n1] == first[1][:n1] and len(steps) == n1 and bool(steps[-1].finished.all())
    assert list(generate(model, [1, 2], max_new_tokens=0)) == []


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_new_tokens=-1), "max_new_tokens"), (dict(prompt=[]), "empty"),
    (dict(prompt=[[1], []]), "empty"), (dict(prompt=[1, 99]), "prompt_ids"), (dict(seed=-3), "seed"),
    (dict(stop_ids=[64]), "stop_ids"), (dict(context=5), "context"), (dict(max_new_tokens=5000), "max_seq_len"),
])
def test_bad_arguments_raise(kwargs, name):
    model = build()
    prompt = kwargs.pop("prompt", [1, 2, 3])
    with pytest.raises(ValueError, match=name):
        generate(model, prompt, **{"max_new_tokens": 4, **kwargs})


def test_text_stream_never_splits_utf8():
    tok = ByteTokenizer()
    text = "héllo → wörld ✓"
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in tok.encode(text) + [tok.eos_id]]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_cli_streams_text(monkeypatch, capsys):
    model = build(vocab_size=256)
    monkeypatch.setattr(cli_generate, "load_model", lambda run_dir, step="latest", device="cpu", model_overrides=None:
                        (model, ByteTokenizer()))
    args = Namespace(run_dir="x", prompt="Hi ", max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                     step="latest", device="cpu", overrides=[], threads=0)
    assert run(args) == 0
    out = capsys.readouterr().out
    want = generate_tokens(model, list(b"Hi "), max_new_tokens=8, temperature=0, stop_ids=[255])[0]
    assert out == "Hi " + ByteTokenizer().decode(want) + "\n"


def test_text_stream_generic_tokenizer_holds_partial_characters():
    class Bytes:               # a stand-in for a byte-level BPE: ids are bytes, decode replaces partials
        name, eos_id = "bpe", 0

        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "añ✓b"
    stream = TextStream(Bytes())
    pieces = [stream.push(t) for t in text.encode()]
    assert "".join(pieces) + stream.flush() == text and all("\ufffd" not in p for p in pieces)


def test_fiblm_generate_returns_ids_and_text_like_other_libraries():
    model = build(vocab_size=256)
    tok = ByteTokenizer()
    kw = dict(max_new_tokens=8, temperature=0)
    want = generate_tokens(model, [list(b"Hi "), list(b"Yo")], stop_ids=[tok.eos_id], **kw)
    assert model.generate([list(b"Hi "), list(b"Yo")], stop_ids=[tok.eos_id], **kw) == want
    assert model.generate(list(b"Hi "), stop_ids=[tok.eos_id], **kw) == want[0]           # flat in, flat out
    assert model.generate(torch.tensor(list(b"Hi ")), stop_ids=[tok.eos_id], **kw) == want[0]
    assert model.generate(torch.tensor([list(b"Yo")]), stop_ids=[tok.eos_id], **kw) == [want[1]]
    texts = [tok.decode([t for t in w if t != tok.eos_id]) for w in want]
    assert model.generate("Hi ", tokenizer=tok, **kw) == texts[0]
    assert model.generate(["Hi ", "Yo"], tokenizer=tok, **kw) == texts
    model.tokenizer = tok                                             # what fibattn.from_pretrained attaches
    assert model.generate("Yo", **kw) == texts[1]
    with pytest.raises(ValueError, match="tokenizer"):
        build(vocab_size=256).generate("Hi ")
    with pytest.raises(ValueError, match="no tokens"):
        model.generate("", **kw)
