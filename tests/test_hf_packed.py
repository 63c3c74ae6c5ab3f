"""Padding-free packed batches (``DataCollatorWithFlattening``: one row, positions restarting at each document,
``cu_seq_lens_*``) in the transformers drop-in and the ``export --format hf`` remote code: every document gets
the logits of its own unpadded call."""
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fibattn  # noqa: E402
from fibattn.interop import hf_documents as D  # noqa: E402
from fibattn.interop import hf_llama as H  # noqa: E402
from fibattn.interop.hf_export import export_hf  # noqa: E402
from conftest import own_remote_code_cache  # noqa: E402
from test_export_hf_remote import make_run  # noqa: E402

LENGTHS = (13, 1, 30, 7, 21)
ATOL = RTOL = 1e-5
# integer alphas; fractional ones (rounded); pow2 with alpha < 1, whose set gains short distances with the
# length (one set cannot serve every document); a reach cap
SETTINGS = [dict(window=2, base="fib:8", schedule="fixed", alpha=1.0),
            dict(window=3, schedule="linear", a_min=0.5, a_max=1.5),
            dict(window=2, base="pow2", schedule="fixed", alpha=0.5),
            dict(window=1, schedule="coprime", reach_len=16)]


def llama(**fib):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa")
    return H.apply_fibattn(transformers.LlamaForCausalLM(cfg).eval(), **fib)


def documents(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def flattened(docs, **kw):
    """What DataCollatorWithFlattening makes of ``docs``: input_ids, labels, position_ids (and kw's extras)."""
    return transformers.DataCollatorWithFlattening(**kw)([{"input_ids": d.tolist()} for d in docs])


def recording(calls):
    """fibattn's op, noting the document_ids of each call."""
    def spy(*args, **kwargs):
        calls.append(kwargs.get("document_ids"))
        return fibattn.sparse_attention(*args, **kwargs)
    return spy


def separate(model, docs):
    with torch.no_grad():
        return torch.cat([model(d[None]).logits[0] for d in docs])


@pytest.mark.parametrize("fib", SETTINGS)
def test_flattened_batch_gives_each_documents_own_logits(fib, monkeypatch):
    model, docs = llama(**fib), documents()
    want = separate(model, docs)
    calls = []
    monkeypatch.setattr(D, "sparse_attention", recording(calls))
    with torch.no_grad():
        for kw, extra in [(dict(), dict()),                                         # position_ids alone
                          (dict(return_flash_attn_kwargs=True), dict()),            # and cu_seq_lens_*
                          (dict(), dict(use_cache=False)),          # transformers' block-diagonal mask too
                          (dict(return_flash_attn_kwargs=True, return_position_ids=False), dict())]:
            batch = flattened(docs, **kw)
            batch.pop("labels")
            torch.testing.assert_close(model(**batch, **extra).logits[0], want, atol=ATOL, rtol=RTOL)
    # the op with documents, one call a layer where one set serves every document; pow2 at alpha 0.5 gains short
    # distances with the length: its five documents take four sets, a call each
    assert all(ids is not None for ids in calls)
    assert len(calls) == 4 * 2 * (4 if fib.get("base") == "pow2" else 1)


def test_packed_batches_build_no_t_by_t_mask(monkeypatch):
    """transformers' packed-sequence mask (it makes one without a cache) is deferred: the attention reads it at its
    own columns only, finds that it hides nothing inside a document, and no (B, 1, T, T) mask is built."""
    built, sdpa = [], transformers.masking_utils.sdpa_mask
    monkeypatch.setattr(transformers.masking_utils, "sdpa_mask", lambda *a, **k: built.append(1) or sdpa(*a, **k))
    docs = documents()
    batch = flattened(docs)
    batch.pop("labels")
    for fib in SETTINGS:
        model = llama(**fib)
        with torch.no_grad():
            got = model(**batch, use_cache=False).logits[0]
        torch.testing.assert_close(got, separate(model, docs), atol=ATOL, rtol=RTOL)
    assert not built


def test_a_deferred_mask_that_hides_a_key_is_built():
    from transformers import masking_utils as mu

    from fibattn.interop.hf_batch import DeferredMask
    ids = torch.tensor([[0] * 5 + [1] * 6])
    packed = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids))
    assert not DeferredMask(dict(mask_function=packed)).hides(ids, [0, 1, 2, 4, 9])
    for hidden in (lambda b, h, q, kv: kv != 7, lambda b, h, q, kv: q - kv != 4):
        assert DeferredMask(dict(mask_function=mu.and_masks(packed, hidden))).hides(ids, [0, 1, 2, 4])
    # a hidden key at a distance no query's document reaches (10) or that is not in the set (3) is not read
    assert not DeferredMask(dict(mask_function=mu.and_masks(packed, lambda b, h, q, kv: q - kv != 10))).hides(
        ids, [0, 1, 2, 4, 10])
    assert not DeferredMask(dict(mask_function=mu.and_masks(packed, lambda b, h, q, kv: q - kv != 3))).hides(
        ids, [0, 1, 2, 4])
    calls = []
    once = DeferredMask(dict(mask_function=lambda *a: calls.append(1) or packed(*a)))  # every layer gets it
    assert [once.hides(ids, d) for d in ([0, 1, 2, 4], [4, 2, 1, 0], [0, 1, 2, 4], [0, 9])] == [False] * 4
    assert len(calls) == 2                                         # once a set; another ids tensor asks again
    assert not once.hides(ids.clone(), [0, 9]) and len(calls) == 3


@pytest.mark.parametrize("fib", [SETTINGS[1], SETTINGS[2]])
def test_training_loss_and_gradients_match_separate_documents(fib):
    model, docs = llama(**fib), documents((9, 17, 11))
    batch = flattened(docs, return_flash_attn_kwargs=True)
    model.train()
    model(**batch).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the collator's labels: each document's first token predicts nothing; the mean is over every label
    n = sum(len(d) - 1 for d in docs)
    sum(model(d[None], labels=d[None]).loss * (len(d) - 1) / n for d in docs).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("fib", [SETTINGS[0], SETTINGS[2]])
def test_packed_rows_with_padding(fib):
    """Two packed rows, one right-padded, one left-padded, with an attention mask: every document its own logits."""
    model, docs = llama(**fib), documents((13, 9, 6, 11))
    zeros = torch.zeros(9, dtype=torch.long)
    x = torch.stack([torch.cat([docs[0], docs[1], zeros[:4]]), torch.cat([zeros, docs[2], docs[3]])])
    mask = torch.stack([torch.arange(26) < 22, torch.arange(26) >= 9]).long()
    # the pads: positions continuing the last document (right) or all zero (left)
    pos = torch.stack([torch.cat([torch.arange(13), torch.arange(13)]),
                       torch.cat([zeros, torch.arange(6), torch.arange(11)])])
    want = separate(model, docs)
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=pos).logits
    assert not torch.isnan(out).any()
    torch.testing.assert_close(torch.cat([out[0, :22], out[1, 9:]]), want, atol=ATOL, rtol=RTOL)


def test_cu_seq_lens_are_preferred_and_checked():
    model, docs = llama(**SETTINGS[0]), documents((10, 12))
    want = separate(model, docs)
    x = torch.cat(docs)[None]
    cu = torch.tensor([0, 10, 22], dtype=torch.int32)
    with torch.no_grad():       # positions that do not restart: the documents are the cu_seq_lens' alone
        got = model(x, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12).logits[0]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        with pytest.raises(ValueError, match="cu_seq_lens"):
            model(x.expand(2, -1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)


# --------------------------------------------------------------------------------------------- remote code
@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """FibLM runs (fib; pow2, whose layer-0 set at alpha 0.5 grows with the length) exported with ``--format hf``
    and loaded with ``trust_remote_code`` from the folder, in this process: its modules in a cache of their own."""
    root = tmp_path_factory.mktemp("hf-packed")
    with own_remote_code_cache(root):
        models = {}
        for base in ("fib", "pow2"):
            run = make_run(root / base, base=base)
            folder = export_hf(run, root / f"{base}-hf")
            models[base] = (fibattn.from_pretrained(run).eval(),
                            transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval())
        yield models


def test_each_folder_runs_its_own_code(remote):
    """Two export folders loaded in one process (the second after the first): each model's attention and mask
    functions are its own folder's copy, not the last one loaded (versions of the code may differ)."""
    from fibattn.interop.hf_remote import modeling_fibattn_llama as template
    names = {template.IMPL}
    for _, model in remote.values():
        impl, own = model.config._attn_implementation, type(model).__module__
        assert transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[impl].__module__ == own
        assert transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[impl].__module__ == own
        names.add(impl)
    assert len(names) == 3
    assert transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[template.IMPL].__module__ == template.__name__


@pytest.mark.parametrize("base", ["fib", "pow2"])
@pytest.mark.parametrize("op", [True, False], ids=["fibattn op", "own pattern"])
def test_remote_code_packed(remote, base, op, monkeypatch):
    fib, model = remote[base]
    # each folder's model runs its own copy's attention (transformers looks it up by name, process-wide)
    attention = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    code = sys.modules[attention.__module__]
    assert code is sys.modules[type(model).__module__] and code.__name__.startswith("transformers_modules")
    calls = []
    monkeypatch.setattr(code, "sparse_attention", recording(calls) if op else None)   # None: as where fibattn is not installed
    docs = documents((20, 3, 40, 9))
    with torch.no_grad():
        want = torch.cat([fib(d[None])[0] for d in docs])
        batch = flattened(docs, return_flash_attn_kwargs=True)
        batch.pop("labels")
        torch.testing.assert_close(model(**batch).logits[0], want, atol=ATOL, rtol=RTOL)
        got = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # fib: one set serves every document, the op runs with them; pow2 at alpha 0.5 (layer 0): the pattern
    assert len(calls) == (0 if not op else 2 * (2 if base == "fib" else 1))
    assert all(ids is not None for ids in calls)
