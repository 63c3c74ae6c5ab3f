"""``fibattn export --format hf`` of a sparse model is transformers remote code: plain transformers refuses it
without ``trust_remote_code``, loads it with ``trust_remote_code=True`` where fibattn cannot be imported at all,
and its logits equal the FibLM's (1× and 4× the training length, both reaches, cached generation, left padding).
A dense model is a plain Llama. The remote loads run in subprocesses with their own ``HF_HOME``."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import fibattn  # noqa: E402
from fibattn.interop import hf_llama as H  # noqa: E402
from fibattn.interop.hf_export import REMOTE_DIR, export_hf  # noqa: E402
from fibattn.model.lm import FibLM  # noqa: E402
from fibattn.presets import tiny  # noqa: E402
from fibattn.schedules import Base, attended_distances  # noqa: E402
from run_helpers import write_checkpoint  # noqa: E402

# reach "train" with a base long enough to pass T at 4×; the default reach with pow2 (its rungs grow with T)
MODELS = {"train": dict(reach="train", base_k=10), "study": dict(base="pow2"), "dense": dict(attention="dense")}
ATOL = RTOL = 1e-5
PROMPT, NEW, PAD = 40, 6, 5

# Runs in a child process: with "block", any import of fibattn fails, as where it is not installed.
CHILD = r'''
import inspect, json, sys
if sys.argv[1] == "block":
    sys.modules["fibattn"] = None
    try:
        import fibattn
        raise SystemExit("fibattn still importable")
    except ImportError:
        pass
import torch, transformers
args = json.loads(sys.argv[2])
ids, res, P, pad = torch.load(args["ids"], weights_only=True), {}, args["prompt"], args["pad"]
for name, folder in args["folders"].items():
    try:
        transformers.AutoModelForCausalLM.from_pretrained(folder)
        res[f"{name}/plain"] = torch.tensor(1)
    except ValueError as exc:
        res[f"{name}/plain"] = torch.tensor(0 if "trust_remote_code" in str(exc) else 2)
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    fast = getattr(sys.modules[type(m).__module__], "sparse_attention", None)
    res[f"{name}/fast"] = torch.tensor(int(fast is not None))
    with torch.no_grad():
        for key in ("1x", "4x"):
            res[f"{name}/{key}"] = m(ids[key]).logits
        x = ids["4x"][:1]
        mask = torch.ones(2, x.shape[1] + pad, dtype=torch.long)
        mask[0, :pad] = 0
        batch = torch.cat([torch.cat([torch.zeros_like(x[:, :pad]), x], 1), torch.cat([x[:, :pad], x], 1)])
        res[f"{name}/padded"] = m(batch, attention_mask=mask).logits[0, pad:]
        kw = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
        first = m(x[:, :P], use_cache=True)                                  # then Tq = 20 < Tk = 60
        res[f"{name}/chunked"] = m(x[:, P:P + 20], use_cache=True, **{kw: getattr(first, kw)}).logits[0]
        prompts = {"gen": (x[:, :P], None), "gen_padded": (batch[:1, :pad + P], mask[:1, :pad + P])}
        for key, (inp, am) in prompts.items():
            g = m.generate(inp, attention_mask=am, max_new_tokens=args["new"], do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
            res[f"{name}/{key}"] = g.sequences[0, inp.shape[1]:]
            res[f"{name}/{key}_logits"] = torch.cat(g.logits)
            cache = getattr(g, "cache", None) or g.past_key_values
            res[f"{name}/{key}_cache"] = torch.tensor(int(type(cache).__name__ == "FibattnCache"))
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    res[f"{name}/tok"] = torch.tensor(tok("ROMEO: what light")["input_ids"])
torch.save(res, args["out"])
'''


def make_run(root, **model):
    """A run folder with one verified checkpoint of a seeded, untrained FibLM: d_model 32, 2 layers, 2 query /
    1 key-value heads, T=32, W=4, fib:6, torch backend, byte tokens (exporting needs no training)."""
    cfg = tiny()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.seq_len, m.window, m.base_k = 32, 2, 2, 1, 32, 4, 6
    m.backend = "torch"
    for key, value in model.items():
        setattr(m, key, value)
    cfg.name, cfg.data.out_dir = root.name, str(root / "no-data")
    torch.manual_seed(0)
    write_checkpoint(root, 1, FibLM(m), cfg)
    return root


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-remote")
    return {name: (fibattn.from_pretrained(make_run(root / name, **model)).eval(),
                   export_hf(root / name, root / f"{name}-hf")) for name, model in MODELS.items()}


@pytest.fixture(scope="module")
def ids(exports):
    T = exports["train"][0].cfg.seq_len
    g = torch.Generator().manual_seed(0)
    return {"1x": torch.randint(0, 256, (2, T), generator=g), "4x": torch.randint(0, 256, (2, 4 * T), generator=g)}


def child(exports, ids, tmp, mode: str) -> dict:
    """Load every export with transformers in a fresh process; ``mode`` "block" makes fibattn unimportable."""
    torch.save(ids, tmp / "ids.pt")
    env = dict(os.environ, HF_HOME=str(tmp / "hf-home"), HF_MODULES_CACHE=str(tmp / "hf-home" / "modules"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    args = {"folders": {name: str(out) for name, (_, out) in exports.items()}, "ids": str(tmp / "ids.pt"),
            "out": str(tmp / "out.pt"), "prompt": PROMPT, "new": NEW, "pad": PAD}
    r = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(args)], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300)     # stdin closed: the trust prompt refuses
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=True)


@pytest.fixture(scope="module")
def without_fibattn(exports, ids, tmp_path_factory):
    return child(exports, ids, tmp_path_factory.mktemp("no-fibattn"), "block")


def greedy(fib, prompt, n):
    """FibLM's greedy continuation and its logits at each new position (full forwards, no cache)."""
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, fib(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, prompt.shape[1]:], fib(seq[:, :-1])[0, prompt.shape[1] - 1:]


@pytest.mark.parametrize("name", ["train", "study"])
def test_sparse_export_is_remote_code(exports, name):
    _, out = exports[name]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fibattn_llama" and config["architectures"] == ["FibattnLlamaForCausalLM"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert config["fibattn"]["reach_len"] == (32 if name == "train" else None)
    for f in ("modeling_fibattn_llama.py", "configuration_fibattn_llama.py"):       # the templates, verbatim
        assert (out / f).read_bytes() == (REMOTE_DIR / f).read_bytes()
    card = (out / "README.md").read_text()
    assert "trust_remote_code=True" in card and "hf_llama.from_pretrained" in card


@pytest.mark.parametrize("name", ["train", "study"])
def test_remote_code_without_fibattn_equals_the_fiblm(exports, ids, without_fibattn, name):
    fib, _ = exports[name]
    res = {k.split("/", 1)[1]: v for k, v in without_fibattn.items() if k.startswith(name + "/")}
    assert res["plain"].item() == 0                   # refused, naming trust_remote_code: never a dense model
    assert res["fast"].item() == 0                    # fibattn was not importable: the gathered columns ran
    with torch.no_grad():
        for key, x in ids.items():                   # 1× and 4× the training length
            torch.testing.assert_close(res[key], fib(x), atol=ATOL, rtol=RTOL)
        x = ids["4x"][:1]
        torch.testing.assert_close(res["padded"], fib(x)[0], atol=ATOL, rtol=RTOL)
        # cached: a chunk and generate's steps give the full forward's logits (lengths 40..60 keep one pow2 set;
        # where a set gains short distances with the length, cached decoding differs from a full forward)
        torch.testing.assert_close(res["chunked"], fib(x[:, :PROMPT + 20])[0, PROMPT:], atol=ATOL, rtol=RTOL)
        tokens, logits = greedy(fib, x[:, :PROMPT], NEW)
    for key in ("gen", "gen_padded"):
        torch.testing.assert_close(res[f"{key}_logits"], logits, atol=ATOL, rtol=RTOL)
        assert res[key].tolist() == tokens.tolist()
        assert res[f"{key}_cache"].item() == 1        # the export's own constant-memory cache, without fibattn
    assert res["tok"].tolist() == fib.tokenizer.encode("ROMEO: what light")


def test_dense_export_is_a_plain_llama(exports, ids, without_fibattn):
    fib, out = exports["dense"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config and "fibattn" not in config
    assert not list(out.glob("*.py"))
    res = {k.split("/", 1)[1]: v for k, v in without_fibattn.items() if k.startswith("dense/")}
    assert res["plain"].item() == 1                   # loads without trust_remote_code, without fibattn
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        for key, x in ids.items():
            torch.testing.assert_close(res[key], fib(x), atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(plain(x).logits, fib(x), atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="apply_fibattn"):         # nothing sparse to restore
        H.from_pretrained(out)


@pytest.mark.parametrize("name", ["train", "study"])
def test_hf_llama_loads_the_export_on_fibattns_op(exports, ids, name):
    fib, out = exports[name]
    model = H.from_pretrained(out).eval()                           # no trust_remote_code needed
    assert type(model) is transformers.LlamaForCausalLM and model.config._attn_implementation == H.IMPL_NAME
    with torch.no_grad():
        for x in ids.values():
            torch.testing.assert_close(model(x).logits, fib(x), atol=ATOL, rtol=RTOL)


def test_the_same_files_run_on_fibattns_op_where_it_is_installed(exports, ids, monkeypatch):
    from fibattn.interop.hf_remote import modeling_fibattn_llama as R        # the template, imported as a module
    assert R.sparse_attention is fibattn.sparse_attention
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return fibattn.sparse_attention(*args, **kwargs)
    monkeypatch.setattr(R, "sparse_attention", spy)
    for name in ("train", "study"):
        fib, out = exports[name]
        model = R.FibattnLlamaForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
        assert model.config._attn_implementation == R.IMPL                   # no dense fallback on request
        with torch.no_grad():
            for x in ids.values():
                torch.testing.assert_close(model(x).logits, fib(x), atol=ATOL, rtol=RTOL)
    assert len(calls) == 2 * 2 * 2                                           # models × lengths × layers


def test_remote_distances_equal_fibattns():
    from fibattn.interop.hf_remote import modeling_fibattn_llama as R
    bases = [Base("fib", 15), Base("fib", 3), Base("pow2"), Base("custom", values=(7, 3, 40, 3, 100))]
    for base in bases:
        saved = {"kind": base.kind, "k": base.k, "values": list(base.values)}
        for window in (0, 1, 4, 12):
            for alpha in (0.5, 0.75, 1.0, 1.25, 1.5, 2.5):
                for seq_len in (1, 2, 9, 32, 130, 1024):
                    for reach in (None, 1, 16, 32, 4096):
                        want = attended_distances(window, alpha, base, seq_len, reach=reach)
                        assert R.attended_distances(window, alpha, saved, seq_len, reach) == want, \
                            (base, window, alpha, seq_len, reach)


def test_learned_alphas_are_refused(exports, tmp_path, monkeypatch):
    from fibattn.interop import hf_export
    load_run = hf_export.load_run

    def learned(ckpt):
        model, cfg, tok = load_run(ckpt)
        cfg.model.schedule = "learned"
        return model, cfg, tok
    monkeypatch.setattr(hf_export, "load_run", learned)
    run = exports["train"][1].parent / "train"                # a sparse run, its alphas relabelled learned
    with pytest.raises(ValueError, match="learned-alpha"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
