"""The static decode step (issue 55's offline goals, ``fibattn.generation.static``): the same tokens as the eager
reference (static, learned and dense layers, sampled and greedy, ragged batches, RoPE scaling, stop tokens),
compiled whole (``fullgraph``) without a recompile from token to token, one read back per streamed token and
none per token when collecting, state allocated once, and batched rows equal to each prompt alone."""
import logging

import pytest
import torch

from fibattn.checks import UsageError
from fibattn.generation import static as S
from fibattn.generation.decode import DecodeSession, generate, generate_tokens
from fibattn.generation.sampling import Sampling, sample, uniforms
from fibattn.model.lm import FibLM
from fibattn.presets import tiny
from readbacks import recording

PROMPTS = [[1, 2, 3], [5] * 11, [7, 8, 9, 10, 11, 12, 13], [4]]


def _model(kind="static", n_layers=3, seq_len=32, window=3, base_k=None):
    cfg = tiny().model
    cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = 32, n_layers, 4, 2
    cfg.seq_len, cfg.window = seq_len, window
    if base_k is not None:
        cfg.base_k = base_k
    cfg.backend = "torch"
    if kind == "dense":
        cfg.attention = "dense"
    elif kind == "learned":
        cfg.schedule = "learned"
    elif kind == "mixed":                      # dense and sparse layers in one model
        cfg.schedule = "custom"
        cfg.alphas = [0.7, 1.3, 1.0][:n_layers]
    torch.manual_seed(0)
    return FibLM(cfg).eval()


KINDS = ["static", "learned", "dense", "mixed"]
SAMPLINGS = [dict(temperature=0), dict(temperature=1.0, seed=3),
             dict(temperature=0.8, top_k=7, top_p=0.9, seed=[4, 5, 6, 7])]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", SAMPLINGS, ids=["greedy", "sampled", "top-k-p"])
def test_static_gives_the_eager_tokens_and_logits(kind, how):
    model = _model(kind)
    eager = list(generate(model, PROMPTS, max_new_tokens=30, decode="eager", **how))
    static = [(st.tokens, st.finished, st.logits.clone()) for st in generate(model, PROMPTS, max_new_tokens=30,
                                                                             decode="static", **how)]
    assert len(static) == len(eager)
    for e, (tokens, finished, logits) in zip(eager, static):
        assert torch.equal(tokens, e.tokens) and torch.equal(finished, e.finished)
        torch.testing.assert_close(logits, e.logits, rtol=1e-5, atol=1e-5)
    assert generate_tokens(model, PROMPTS, max_new_tokens=30, decode="static", **how) == \
        generate_tokens(model, PROMPTS, max_new_tokens=30, decode="eager", **how)


@pytest.mark.parametrize("extra", [dict(rope_scaling="yarn", context=96), dict(dense_window=5),
                                   dict(context=200)], ids=["yarn", "dense-window", "long-context"])
def test_static_follows_the_session_options(extra):
    model = _model("mixed")
    kw = dict(max_new_tokens=25, temperature=0, **extra)
    assert generate_tokens(model, PROMPTS, decode="static", **kw) == generate_tokens(model, PROMPTS, decode="eager",
                                                                                     **kw)


def test_stop_tokens_end_rows_as_eager_does():
    model = _model("static")
    free = generate_tokens(model, PROMPTS, max_new_tokens=40, temperature=0, decode="eager")
    stop = free[0][4]                                     # a token row 0 draws: some rows stop early
    kw = dict(max_new_tokens=40, temperature=0, stop_ids=[stop])
    want = generate_tokens(model, PROMPTS, decode="eager", **kw)
    assert want[0][-1] == stop and len(want[0]) <= 5
    assert generate_tokens(model, PROMPTS, decode="static", **kw) == want
    eager = [st.tokens for st in generate(model, PROMPTS, decode="eager", **kw)]
    static = [st.tokens for st in generate(model, PROMPTS, decode="static", **kw)]
    assert len(static) == len(eager) and all(torch.equal(a, b) for a, b in zip(static, eager))


@pytest.mark.parametrize("kind", ["learned", "mixed"])
def test_a_ragged_batch_equals_each_prompt_alone(kind):
    model = _model(kind)
    context = max(map(len, PROMPTS)) + 20
    seeds = [11, 12, 13, 14]
    batch = generate_tokens(model, PROMPTS, max_new_tokens=20, temperature=1.0, seed=seeds, context=context,
                            decode="static")
    alone = [generate_tokens(model, [p], max_new_tokens=20, temperature=1.0, seed=[s], context=context,
                             decode="static")[0] for p, s in zip(PROMPTS, seeds)]
    assert batch == alone


def test_block_draws_equal_one_draw_per_step():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    block = uniforms(gens, 300)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    one = torch.stack([torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
                       for _ in range(300)], dim=1)
    assert torch.equal(block, one)
    logits = torch.randn(2, 50)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    sampling = Sampling(1.0, 5, 0.8)
    assert torch.equal(sample(logits, sampling, gens), S.pick(logits, sampling, block[:, 0]))


def test_more_than_one_block_of_draws():
    model = _model("static", seq_len=16)
    kw = dict(max_new_tokens=S.DRAW_BLOCK + 9, temperature=1.0, seed=5, context=300)
    assert generate_tokens(model, [[1, 2]], decode="static", **kw) == generate_tokens(model, [[1, 2]],
                                                                                      decode="eager", **kw)


def _reads(model, n, stream, **kw):
    with recording() as seen:
        if stream:
            for _ in generate(model, PROMPTS, max_new_tokens=n, decode="static", **kw):
                pass
        else:
            generate_tokens(model, PROMPTS, max_new_tokens=n, decode="static", **kw)
    return len(seen)


@pytest.mark.parametrize("how", SAMPLINGS[:2], ids=["greedy", "sampled"])
def test_one_read_back_per_streamed_token_and_none_per_collected_token(how):
    model = _model("mixed")
    assert _reads(model, 30, True, **how) - _reads(model, 10, True, **how) == 20
    assert _reads(model, 30, False, **how) == _reads(model, 10, False, **how)
    # with stop tokens, collecting reads whether every row stopped once per SYNC_EVERY steps
    stops = dict(how, stop_ids=[0])
    n = 3 * S.SYNC_EVERY
    assert _reads(model, n, False, **stops) - _reads(model, S.SYNC_EVERY, False, **stops) <= 2


def test_the_state_is_allocated_once():
    model = _model("mixed")
    session = DecodeSession(model, 2, 40, static=True)
    engine = S.StaticStep(session, Sampling(0.0), set(), compiled=False)
    session.prefill_rows([[1, 2, 3], [4] * 9])
    state = [s.cache.kv for s in session.layers] + [session.pos, engine.tok, engine.done, engine.logits]
    ptrs = [t.data_ptr() for t in state]
    assert all(s.cache.kv.shape[2] == (40 if s.plan is None else min(s.plan.span, 40)) for s in session.layers)
    for _ in range(20):
        engine.advance()
    assert [t.data_ptr() for t in state] == ptrs and session.pos.tolist() == [22, 28]


def test_compiled_whole_with_no_recompile_gives_the_eager_tokens():
    torch._dynamo.reset()
    model = _model("mixed", n_layers=2)
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=5, seed=2)
    want = generate_tokens(model, PROMPTS[:2], decode="eager", **kw)
    got = generate_tokens(model, PROMPTS[:2], decode="compiled", **kw)          # fullgraph: a break raises
    assert got == want
    with torch._dynamo.config.patch(error_on_recompile=True):                   # same shapes: no new graph
        assert generate_tokens(model, PROMPTS[:2], decode="compiled", **kw) == want


def test_decode_choice_is_checked_and_auto_is_logged(caplog):
    model = _model("static", n_layers=1)
    with pytest.raises(UsageError, match="decode must be one of auto, eager, static, compiled, got 'fast'"):
        generate(model, [1, 2], max_new_tokens=2, decode="fast")
    S._logged.discard("cpu")
    with caplog.at_level(logging.INFO, logger="fibattn"):
        assert S.resolve_decode("auto", torch.device("cpu")) == "eager"
    assert "decode auto -> eager" in caplog.text
    assert S.resolve_decode("compiled", torch.device("cpu")) == "compiled"
    session = DecodeSession(_model("dense", n_layers=1), 1, 300)      # a dense cache that would grow
    with pytest.raises(UsageError, match="static=True"):
        S.StaticStep(session, Sampling(0.0), set(), compiled=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["static", "compiled"])
@pytest.mark.parametrize("kind", ["mixed", "learned"])
def test_captured_on_cuda_gives_the_eager_tokens(mode, kind):
    """On CUDA the step is replayed from a CUDA graph: greedy tokens equal eager's (fp32), logits within fp32
    rounding, sampled tokens too."""
    model = _model(kind).cuda()
    session = DecodeSession(model, 2, 40, static=True)
    assert S.StaticStep(session, Sampling(0.0), set(), compiled=mode == "compiled").graph is not None
    for how in SAMPLINGS:
        kw = dict(max_new_tokens=30, **how)
        assert generate_tokens(model, PROMPTS, decode=mode, **kw) == generate_tokens(model, PROMPTS, decode="eager",
                                                                                     **kw)
    eager = list(generate(model, PROMPTS, max_new_tokens=10, temperature=0, decode="eager"))
    for e, st in zip(eager, generate(model, PROMPTS, max_new_tokens=10, temperature=0, decode=mode)):
        torch.testing.assert_close(st.logits, e.logits, rtol=1e-4, atol=1e-4)
