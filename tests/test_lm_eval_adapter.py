"""lm-evaluation-harness adapter: scores equal the model's own log-probs; generation stops at `until`."""
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fibattn.config import ModelConfig
from fibattn.data.tokenizers import ByteTokenizer
from fibattn.interop.lm_eval_adapter import FibScorer, run_requests
from fibattn.model.lm import FibLM
from fibattn.presets import tiny
from run_helpers import write_checkpoint  # noqa: E402

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"


def small_model(seed=0) -> FibLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32,
                      max_seq_len=4096, window=3, base_k=6, backend="torch")
    return FibLM(cfg).eval()


@pytest.fixture(scope="module")
def scorer():
    return FibScorer(small_model(), ByteTokenizer(), max_length=16)


def direct_logprobs(model, ids):
    """Log-prob of ids[t] given ids[:t] for t >= 1, from one full forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0].float()
    return F.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_loglikelihood_matches_direct(scorer):
    ctx, cont = "To be,", " or not"
    ll, greedy = scorer.loglikelihood(ctx, cont)
    ids = list(ctx.encode()) + list(cont.encode())
    want = direct_logprobs(scorer.model, ids)[-len(cont):].sum()
    assert ll == pytest.approx(float(want), rel=1e-5, abs=1e-5) and isinstance(greedy, bool)
    # empty context: the end-of-document token stands in
    ll0, _ = scorer.loglikelihood("", "To")
    want0 = direct_logprobs(scorer.model, [255] + list(b"To")).sum()
    assert ll0 == pytest.approx(float(want0), rel=1e-5, abs=1e-5)


def test_is_greedy(scorer):
    prompt = list(b"To be, or")
    with torch.no_grad():
        nxt = int(scorer.model(torch.tensor([prompt]))[0, -1].argmax())
    assert scorer.score(prompt, [nxt])[1] is True
    assert scorer.score(prompt, [(nxt + 1) % 256])[1] is False


def test_long_context_truncated_left(scorer):
    ctx, cont = TEXT[:60], TEXT[60:64]
    ll, _ = scorer.loglikelihood(ctx, cont)
    ids = (list(ctx.encode()) + list(cont.encode()))[-17:]
    assert ll == pytest.approx(float(direct_logprobs(scorer.model, ids)[-4:].sum()), rel=1e-5, abs=1e-5)


def test_rolling_scores_every_token_once(scorer):
    toks = list(TEXT.encode())
    windows = scorer.rolling_windows(toks)
    assert [t for _, tgt in windows for t in tgt] == toks
    assert all(len(inp) <= 16 and len(tgt) <= len(inp) for inp, tgt in windows)
    seq = [255] + toks
    total = 0.0
    for inp, tgt in windows:
        lp = direct_logprobs(scorer.model, inp + [tgt[-1]])
        total += float(lp[-len(tgt):].sum())
    assert scorer.loglikelihood_rolling(TEXT) == pytest.approx(total, rel=1e-5)
    # one window when max_length covers the text: the whole text after eos
    big = FibScorer(scorer.model, scorer.tokenizer, max_length=len(toks) + 1)
    assert big.loglikelihood_rolling(TEXT) == pytest.approx(float(direct_logprobs(big.model, seq).sum()), rel=1e-5)


def test_generate_until_stops(scorer):
    free = scorer.generate_until("To be", {"max_gen_toks": 12, "until": []})
    full = bytes(t for t in _greedy(scorer.model, list(b"To be"), 12)).decode("utf-8", errors="replace")
    assert free == full
    stop = free[4:6]
    cut = scorer.generate_until("To be", {"max_gen_toks": 12, "until": [stop, "\x00never"]})
    assert cut == free[:free.find(stop)] and stop not in cut


@pytest.mark.parametrize("L", [16, 13, 83])
def test_a_short_last_window_keeps_a_full_max_length_of_context(scorer, L):
    """The docstring's promise, written out here: window ``j`` predicts tokens ``jL .. min((j+1)L, n) - 1`` from
    the ``L`` inputs (end-of-document, then the text) right before its last target, so a short last window
    (84 tokens: 4 targets at L=16, 6 at 13, 1 at 83) still reads a full ``L`` of context."""
    toks = list(TEXT.encode())
    n, seq = len(toks), [255] + toks
    assert n % L and n > L
    want = [(seq[max(0, end - L):end], toks[start:end])
            for start in range(0, n, L) for end in [min(start + L, n)]]
    got = FibScorer(scorer.model, scorer.tokenizer, max_length=L).rolling_windows(toks)
    assert got == want
    assert all(len(inputs) == L for inputs, _ in got)          # the last, short window too
    total = 0.0
    for inputs, targets in want:                               # each window on its own, by the model
        lp = direct_logprobs(scorer.model, inputs + [targets[-1]])
        total += float(lp[-len(targets):].sum())
    got_total = FibScorer(scorer.model, scorer.tokenizer, max_length=L).loglikelihood_rolling(TEXT)
    assert got_total == pytest.approx(total, rel=1e-5)


def test_generate_until_cuts_at_the_earliest_of_several_stops(scorer):
    """Stops that occur at different places, in either order in ``until``: the text ends before the earliest
    one, whichever is listed first, also when one token completes two stops at once (sampled text: a micro
    model's greedy text repeats one character)."""
    kw = {"max_gen_toks": 12, "do_sample": True, "temperature": 1.0, "seed": 3}
    free = scorer.generate_until("To be", {**kw, "until": []})
    first = {}
    for i, ch in enumerate(free):
        if ch.isascii() and ch.isprintable():
            first.setdefault(ch, i)
    at = sorted(first.items(), key=lambda kv: kv[1])[1:]       # not at 0: an empty cut proves less
    assert len(at) >= 3, free
    (early, i), (middle, _), (late, _) = at[0], at[len(at) // 2], at[-1]
    for until in ([early, late], [late, early], [late, middle, early], [late, "\x00never", early]):
        got = scorer.generate_until("To be", {**kw, "until": until})
        assert got == free[:i], f"until={until!r}: {got!r}, want {free[:i]!r}"
    assert scorer.generate_until("To be", {**kw, "until": [late]}) == free[:free.index(late)]
    # two stops completed by one token: a longer one and its last character; the longer starts earlier
    p = next(p for p in range(1, len(free) - 2) if all(c.isascii() and c.isprintable() for c in free[p:p + 3])
             and free.index(free[p:p + 3]) == p and free.index(free[p + 2]) == p + 2)
    longer, last = free[p:p + 3], free[p + 2]
    for until in ([last, longer], [longer, last]):
        assert scorer.generate_until("To be", {**kw, "until": until}) == free[:p], until


def _greedy(model, ids, n):
    out = []
    for _ in range(n):
        with torch.no_grad():
            t = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        if t == 255:
            break
        out.append(t)
    return out


@pytest.mark.parametrize("batch_size", [3, "auto"])
def test_batches_give_the_one_at_a_time_scores(scorer, batch_size, monkeypatch):
    """Requests of one input length share a forward (batch_size rows; auto fills about AUTO_TOKENS tokens), the
    scores those of one request at a time, in the requests' order."""
    import fibattn.interop.lm_eval_adapter as adapter
    pairs = [(TEXT[:n], TEXT[n:n + k]) for n, k in [(9, 3), (12, 4), (9, 2), (9, 5), (30, 7), (12, 1), (9, 3)]]
    texts = [TEXT[:40], TEXT[5:23], TEXT]
    alone = [scorer.loglikelihood(*p) for p in pairs], [scorer.loglikelihood_rolling(t) for t in texts]
    monkeypatch.setattr(adapter, "AUTO_TOKENS", 40)
    batched = FibScorer(scorer.model, scorer.tokenizer, max_length=16, batch_size=batch_size)
    forwards, hidden = [], batched.model.hidden
    monkeypatch.setattr(batched.model, "hidden",
                        lambda x, *a, **k: forwards.append(tuple(x.shape)) or hidden(x, *a, **k))
    got = run_requests(batched, "loglikelihood", pairs), run_requests(batched, "loglikelihood_rolling",
                                                                      [(t,) for t in texts])
    for g, want in zip(got[0], alone[0]):
        assert g[0] == pytest.approx(want[0], rel=1e-5, abs=1e-5) and g[1] == want[1]
    assert got[1] == pytest.approx(alone[1], rel=1e-5, abs=1e-5)
    rows = 3 if batch_size == 3 else None
    assert all(r <= (rows or 40 // t) for r, t in forwards) and any(r > 1 for r, _ in forwards)
    assert sum(r for r, _ in forwards) == len(pairs) + sum(len(scorer.rolling_windows(list(t.encode())))
                                                           for t in texts)


def test_bad_arguments(scorer):
    with pytest.raises(ValueError, match="max_length"):
        FibScorer(scorer.model, scorer.tokenizer, max_length=0)
    with pytest.raises(ValueError, match="max_gen_toks"):
        scorer.generate_until("x", {"max_gen_toks": 16})
    with pytest.raises(ValueError, match="kind"):
        run_requests(scorer, "perplexity", [])
    for bad in (dict(batch_size=0), dict(batch_size="many"), dict(max_batch_size=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FibScorer(scorer.model, scorer.tokenizer, max_length=16, **bad)


# ----------------------------------------------------------------------------- with lm-eval installed
def _run_folder(root):
    cfg = tiny()
    model = small_model(1)
    cfg.model = model.cfg
    cfg.data.out_dir = str(root / "no-data")
    write_checkpoint(root, 1, model, cfg)
    return root, model


def test_harness_model_registered(tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import MODEL_REGISTRY, get_model
    import fibattn.interop.lm_eval_adapter as adapter
    from fibattn.storage.export import export_run
    run, model = _run_folder(tmp_path / "run")
    out = export_run(run, tmp_path / "exp")
    cls = get_model("fibattn")
    assert cls is adapter.FibattnLM and "hf" in MODEL_REGISTRY     # built-in models still found
    lm = cls.create_from_arg_string(f"path={out},max_length=16", {"batch_size": 1, "device": "cpu"})
    ref = FibScorer(model, ByteTokenizer(), 16)
    text = tmp_path / "doc.txt"
    text.write_text(TEXT)
    doc = text.read_text()
    ll = [Instance("loglikelihood", {}, (doc[:20], doc[20:25]), 0)]
    roll = [Instance("loglikelihood_rolling", {}, (doc,), 0)]
    gen = [Instance("generate_until", {}, ("To be", {"until": ["\n"], "max_gen_toks": 8}), 0)]
    assert lm.loglikelihood(ll) == [ref.loglikelihood(doc[:20], doc[20:25])]
    assert lm.loglikelihood_rolling(roll) == [pytest.approx(ref.loglikelihood_rolling(doc))]
    assert lm.generate_until(gen) == [ref.generate_until("To be", {"until": ["\n"], "max_gen_toks": 8})]
    lm_run = cls.create_from_arg_string(f"path={run},max_length=16,step=1")
    assert lm_run.max_length == 16


def test_shipped_local_task_runs_offline(tmp_path, monkeypatch, caplog):
    """The local YAML task shipped in examples/lm_eval (docs/ecosystem.md): lm-eval's bits_per_byte equals
    the model's own rolling log-likelihood over the shipped documents, and loading it warns of no metric left
    without an aggregation or a higher_is_better."""
    pytest.importorskip("lm_eval")
    import math
    import yaml
    import lm_eval
    from lm_eval.tasks import TaskManager
    import fibattn.interop.lm_eval_adapter  # noqa: F401  (registers "fibattn")
    from fibattn.storage.export import export_run
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = Path(__file__).resolve().parents[1]
    shipped = yaml.safe_load((root / "examples" / "lm_eval" / "shakespeare_tail.yaml").read_text())
    data = root / shipped["dataset_kwargs"]["data_files"]["test"]            # relative to the repository root
    docs = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    assert len(docs) >= 5 and all(docs)
    # the same task, with the data path made absolute and the datasets cache kept in tmp_path
    shipped["dataset_kwargs"] = {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "task.yaml").write_text(yaml.safe_dump(shipped))
    run, model = _run_folder(tmp_path / "run")
    out = export_run(run, tmp_path / "exp")
    harness = logging.getLogger("lm_eval")          # it may stop propagating to the root logger caplog watches
    harness.addHandler(caplog.handler)
    try:
        res = lm_eval.simple_evaluate(model="fibattn", model_args=f"path={out},max_length=64",
                                      tasks=[shipped["task"]], device="cpu",
                                      # the shipped task alone: indexing lm-eval's own tasks takes ~19 s
                                      task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                                               include_defaults=False))
    finally:
        harness.removeHandler(caplog.handler)
    unset = [r.getMessage() for r in caplog.records if "aggregation" in r.getMessage()
             or "higher_is_better" in r.getMessage()]
    assert unset == []
    bpb = res["results"][shipped["task"]]["bits_per_byte,none"]
    ref = FibScorer(model, ByteTokenizer(), 64)
    nll = -sum(ref.loglikelihood_rolling(d) for d in docs)
    assert bpb == pytest.approx(nll / sum(len(d.encode()) for d in docs) / math.log(2), rel=1e-5)


def _local_task(tmp_path):
    """The shipped local task, its data path absolute and its datasets cache in ``tmp_path``: (folder, name, docs)."""
    import yaml
    root = Path(__file__).resolve().parents[1]
    shipped = yaml.safe_load((root / "examples" / "lm_eval" / "shakespeare_tail.yaml").read_text())
    data = root / shipped["dataset_kwargs"]["data_files"]["test"]
    shipped["dataset_kwargs"] = {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "task.yaml").write_text(yaml.safe_dump(shipped))
    return tmp_path / "tasks", shipped["task"], [json.loads(line)["text"] for line in data.read_text().splitlines()]


@pytest.mark.slow
def test_lm_evals_own_command_line_on_both_exports(tmp_path):
    """What lm-eval users type (docs/ecosystem.md §2): the ``lm_eval`` command with ``--model hf`` on a
    ``--format hf`` export (trust_remote_code; needs accelerate, in the ``eval`` extra), and ``--model fibattn``
    through ``python -m fibattn.interop.lm_eval_adapter``: both report the model's own bits per byte."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import math
    import os
    import subprocess
    import sys
    from fibattn.interop.hf_export import export_hf
    from fibattn.storage.export import export_run
    tasks, name, docs = _local_task(tmp_path)
    run, model = _run_folder(tmp_path / "run")
    ref = FibScorer(model, ByteTokenizer(), 64)
    want = -sum(ref.loglikelihood_rolling(d) for d in docs) / sum(len(d.encode()) for d in docs) / math.log(2)
    lm_eval_cmd = Path(sys.executable).with_name("lm_eval")
    commands = {
        "hf": [str(lm_eval_cmd), "--model", "hf", "--model_args",
               f"pretrained={export_hf(run, tmp_path / 'hf')},trust_remote_code=True,max_length=64,dtype=float32"],
        "fibattn": [sys.executable, "-m", "fibattn.interop.lm_eval_adapter", "--model", "fibattn", "--model_args",
                    f"path={export_run(run, tmp_path / 'exp')},max_length=64"]}
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    for key, cmd in commands.items():
        out = tmp_path / f"out-{key}"
        r = subprocess.run(cmd + ["--include_path", str(tasks), "--tasks", name, "--device", "cpu", "--batch_size",
                                  "1", "--output_path", str(out)], env=env, capture_output=True, text=True,
                           timeout=900, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "aggregation is not" not in r.stderr and "higher_is_better is not" not in r.stderr
        res = json.loads(next(out.rglob("results*.json")).read_text())
        assert res["results"][name]["bits_per_byte,none"] == pytest.approx(want, rel=1e-4), key
