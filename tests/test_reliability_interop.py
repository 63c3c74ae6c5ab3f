"""No silent wrong result on the interop surfaces: every weight source's shapes checked in full, exported
tokenizers that agree with fibattn's on hostile input, option bags that refuse unknown keys, flags that
cannot lose their meaning, malformed foreign files and folders of the wrong kind named in one line."""
import json
import random

import pytest
import torch
from safetensors.torch import save_file

from fibattn.checks import check_keys
from fibattn.config import ModelConfig, to_dict
from fibattn.data.tokenizers import ByteTokenizer, load_tokenizer, train_bpe
from fibattn.model.llama_names import to_llama
from fibattn.model.lm import FibLM
from fibattn.trainer.trainer import train
from run_helpers import micro_config, write_checkpoint
from storage_helpers import assert_one_line, run_cli, snapshot

ARCH = dict(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32, window=4, base_k=6)
K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def llama_doc(m: ModelConfig, **changes) -> dict:
    doc = {"model_type": "llama", "hidden_size": m.d_model, "num_attention_heads": m.n_heads,
           "num_key_value_heads": m.n_kv_heads, "num_hidden_layers": m.n_layers, "vocab_size": m.vocab_size,
           "intermediate_size": m.ffn_hidden, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e4}
    return {**doc, **changes}


def llama_folder(path, *, shards: bool = False, change=None):
    """A transformers Llama folder of a micro FibLM; ``change(tensors)`` edits the tensors before saving."""
    m = ModelConfig(**ARCH)
    torch.manual_seed(0)
    tensors = to_llama(FibLM(m).state_dict(), heads=2, kv_heads=1, head_dim=16, tied=True)
    if change:
        change(tensors)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(llama_doc(m)))
    if not shards:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def transpose(name):
    def change(tensors):
        tensors[name] = tensors[name].T.contiguous()
    return change


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_data):
    w = tmp_path_factory.mktemp("rel-interop")
    cfg = micro_config(w / "run", tiny_data, steps=1, batch_tokens=64, micro_batch=2, ckpt_every=1, eval_tokens=64,
                       threads=1, results_db="off")
    train(cfg)
    llama_folder(w / "llama")
    llama_folder(w / "llama-kt", change=transpose(K_PROJ))
    llama_folder(w / "shards-kt", shards=True, change=transpose(K_PROJ))
    llama_folder(w / "shards", shards=True)
    return w, cfg


def train_argv(data, out, *extra):
    return ["train", "--preset", "tiny", "--out", out, "--set", f"data.out_dir={data}", "--set", "train.steps=1",
            "--set", "train.results_db=off", "--set", "train.batch_tokens=64", "--set", "train.micro_batch=2",
            "--set", "model.seq_len=32", "--set", "train.eval_tokens=64", "--set", "model.backend=torch", *extra]


def refused(capsys, argv, root, *needles):
    """One stderr line naming every needle, exit 2, no traceback; nothing under ``root`` changed."""
    before = snapshot(root)
    rc, _, err = run_cli(capsys, argv)
    assert_one_line(rc, err)
    for n in needles:
        assert str(n) in err[0], err[0]
    assert snapshot(root) == before
    return err[0]


# ------------------------------------------------------------------------------ 1. one shape check
@pytest.mark.parametrize("folder, file", [("llama-kt", "model.safetensors"),
                                          ("shards-kt", "model-00002-of-00002.safetensors")])
def test_a_transposed_llama_tensor_is_refused_naming_tensor_file_and_shapes(env, tiny_data, tmp_path, capsys,
                                                                            folder, file):
    w, _ = env
    line = refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", w / folder), w,
                   "--init-from", K_PROJ, f"{w / folder / file}", "(32, 16)", "(16, 32)", "config.json")
    assert "loaded" not in line and not (tmp_path / "out").exists()


def test_the_untouched_llama_folders_load(env):
    from fibattn.storage.init_source import open_source
    w, _ = env
    a, b = open_source(w / "llama"), open_source(w / "shards")
    assert a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_every_fibattn_weight_source_checks_full_shapes(env, tmp_path):
    """A checkpoint whose tensor is stored transposed (checksums valid): --init-from, load_run and resuming
    all refuse it naming the tensor, the file and both shapes."""
    from fibattn.storage.init_source import open_source
    from fibattn.storage.runs import load_run
    _, cfg = env
    model = FibLM(cfg.model)
    state = dict(model.state_dict())
    name = "blocks.0.attn.k_proj.weight"
    state[name] = state[name].T.contiguous()

    class Fake:
        def state_dict(self):
            return state
    write_checkpoint(tmp_path / "bad", 1, Fake(), cfg)
    want = (name, "model.safetensors", str(tuple(state[name].shape)), str(tuple(state[name].T.shape)))
    for call in (lambda: open_source(tmp_path / "bad"), lambda: load_run(tmp_path / "bad")):
        with pytest.raises(ValueError) as exc:
            call()
        assert all(x in str(exc.value) for x in want) and "\n" not in str(exc.value), exc.value


def test_optimizer_moments_of_the_wrong_shape_are_refused(env):
    from fibattn.trainer.optim import build_optimizer, param_names
    from fibattn.trainer.state import check_moments
    _, cfg = env
    model = FibLM(cfg.model)
    opt, names = build_optimizer(model, cfg.train), param_names(model)
    model(torch.randint(0, 256, (1, 8)))[0].sum().backward()
    opt.step()
    check_moments(opt, names, "ckpt")
    first = opt.param_groups[0]["params"][0]
    opt.state[first]["exp_avg"] = torch.zeros(1)          # AdamW would broadcast it silently
    with pytest.raises(ValueError, match=rf"ckpt: optimizer state of {names[0]}: tensor exp_avg has shape \(1,\)"):
        check_moments(opt, names, "ckpt")


# ------------------------------------------------------------------------------ 5. malformed foreign files
@pytest.mark.parametrize("change, key", [
    ({"vocab_size": None}, "vocab_size"), ({"hidden_size": "32"}, "hidden_size"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers"), ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_theta": None}, "rope_theta"), ({"rope_scaling": [1]}, "rope_scaling"),
    ({"intermediate_size": None}, "intermediate_size"), ({"rms_norm_eps": -1}, "rms_norm_eps"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"), ({"intermediate_size": "__drop__"}, "intermediate_size"),
    ({"hidden_act": 3}, "hidden_act"), ({"attention_bias": "no"}, "attention_bias"),
    ({"model_type": "mistral"}, "model_type"),
])
def test_a_malformed_llama_config_is_one_line_naming_file_and_key(env, tiny_data, tmp_path, capsys, change, key):
    import shutil
    w, _ = env
    src = tmp_path / "src"
    shutil.copytree(w / "llama", src)
    doc = {**llama_doc(ModelConfig(**ARCH)), **change}
    doc = {k: v for k, v in doc.items() if v != "__drop__"}
    (src / "config.json").write_text(json.dumps(doc))
    refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", src), tmp_path,
            f"{src / 'config.json'}", repr(key))


@pytest.mark.parametrize("text, needle", [
    ("[1, 2]", "JSON object"), ("{nope", "not valid JSON"), ('{"weight_map": null}', "'weight_map'"),
    ('{"weight_map": {"x": 5}}', "'weight_map'"), ('{"weight_map": {"x": "../escape.safetensors"}}', "'weight_map'"),
    ('{"weight_map": []}', "'weight_map'"),
])
def test_a_malformed_shard_index_is_one_line_naming_it(env, tiny_data, tmp_path, capsys, text, needle):
    import shutil
    w, _ = env
    src = tmp_path / "src"
    shutil.copytree(w / "shards", src)
    (src / "model.safetensors.index.json").write_text(text)
    refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", src), tmp_path,
            "model.safetensors.index.json", needle)


def test_a_foreign_config_that_is_not_an_object_is_named(env, tiny_data, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("[]")
    refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", src), tmp_path, "config.json",
            "JSON object")


# ------------------------------------------------------------------------------ 2. exported tokenizers
HOSTILE = ["hello", "ÿ", "aÿb", "ÿþ", "\x00", "a\x00b", "a\r\nb\rc\n\n\r", "😀👍🏽 ok", "e\u0301 n\u0303",
           "<|endoftext|>", "a<|endoftext|>b", "</s> <s>x<unk>", "x" * 3000, " " * 50, "\ufffd", " lead", "  two",
           "\t\t", "hello , world . it 's", "日本語テキスト", "\u200b\u2028\u2029", "Ġ Ċ", "<0x41>"]


def _llama_style_tokenizer(path):
    """A sentencepiece-style BPE (byte fallback, ▁ spaces, <s> added by a post-processor)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(["hello world the quick brown fox " * 50, "ROMEO: what light é"],
                           trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]
                                               + [f"<0x{i:02X}>" for i in range(256)]))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(path))
    return load_tokenizer(path)


def _bpe():
    return train_bpe(["hello world the quick brown fox " * 50, "ROMEO: <|endoftext|> é ÿ"], 300)


@pytest.mark.parametrize("kind", ["byte", "bpe", "pretrained"])
def test_the_exported_tokenizer_encodes_and_decodes_as_fibattn_does(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    from fibattn.data.autotokenizer import hf_tokenizer_files
    fib = {"byte": ByteTokenizer, "bpe": _bpe, "pretrained": lambda: _llama_style_tokenizer(tmp_path / "pre.json")}[kind]()
    (tmp_path / "hf").mkdir()
    for name, data in hf_tokenizer_files(fib).items():      # what both export formats write
        (tmp_path / "hf" / name).write_bytes(data)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")     # as a user of the export loads it
    assert hf.eos_token_id == fib.eos_id
    for text in HOSTILE:
        ids = fib.encode(text)
        assert hf(text)["input_ids"] == ids and hf.encode(text) == ids, text
        assert hf.decode(ids) == fib.decode(ids), text
    rng, V = random.Random(0), fib.vocab_size
    seqs = [[fib.eos_id], [1, fib.eos_id, 2], [fib.eos_id, 5, 6], list(range(V))]
    seqs += [[rng.randrange(V) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    if kind == "byte":       # invalid UTF-8: truncated sequences, lone surrogates' bytes, stray continuations
        seqs += [[0xC3], [0xED, 0xA0, 0x80], [0xF0, 0x9F], [0x80, 0x41], [0xFF, 0xFE], [0xE2, 0x82, 0x41]]
    for ids in seqs:
        assert hf.decode(ids) == fib.decode(ids), ids


def _bpe_run(path):
    """A run folder (one checkpoint, no training) of a micro model with a BPE tokenizer."""
    from fibattn.storage import checkpoint as ck
    cfg = micro_config(path, path / "no-data")
    cfg.model.vocab_size = 300
    tmp = ck.begin(ck.ckpt_root(path), 1)
    ck.write_tensors(tmp, "model", FibLM(cfg.model).state_dict())
    (tmp / "config.json").write_text(json.dumps(to_dict(cfg)))
    _bpe().save(tmp / "tokenizer.json")
    ck.finish(ck.ckpt_root(path), 1)
    return path


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_both_export_formats_give_autotokenizer_fibattns_tokenizer(env, tmp_path, kind):
    """Each format's folder, loaded as its user loads it: a literal <|endoftext|> in text stays text and a byte
    run's default export loads at all; fibattn still loads the run's own tokenizer file."""
    transformers = pytest.importorskip("transformers")
    import fibattn
    from fibattn.interop.hf_export import export_hf
    from fibattn.storage.export import export_run
    run = env[0] / "run" if kind == "byte" else _bpe_run(tmp_path / "run")
    fib = load_tokenizer(next((run / "checkpoints").glob("step-*")) / "tokenizer.json")
    export_run(run, tmp_path / "fib")
    export_hf(run, tmp_path / "hf")
    for out in (tmp_path / "fib", tmp_path / "hf"):
        hf = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        for text in ("a<|endoftext|>b", "ÿ\x00 é", "x " * 40):
            ids = fib.encode(text)
            assert hf.encode(text) == ids and hf.decode(ids + [fib.eos_id]) == fib.decode(ids), (out, text)
    assert type(fibattn.from_pretrained(tmp_path / "fib").tokenizer) is type(fib)


def test_eval_of_an_export_compares_the_runs_own_tokenizer_with_the_datas(env, tiny_data, tmp_path, capsys):
    """The export's tokenizer.json is transformers' form; eval --data still checks the run's own file: the
    byte run's export evaluates on byte data, a BPE run's export is refused on it, and data prepared with
    `--tokenizer EXPORT` (which reads the run's own file) evaluates."""
    from fibattn.storage.export import export_run
    opts = ["--lengths", "32", "--tokens", "64", "--db", "off", "--no-plot"]
    common = ["--data", tiny_data, *opts]
    export_run(env[0] / "run", tmp_path / "byte")
    rc, _, err = run_cli(capsys, ["eval", tmp_path / "byte", "--json", tmp_path / "e.json", *common])
    assert rc == 0, err
    export_run(_bpe_run(tmp_path / "run"), tmp_path / "bpe")
    refused(capsys, ["eval", tmp_path / "bpe", *common], tmp_path, "--data", "does not match the run's",
            "fibattn_tokenizer.json")
    (tmp_path / "text.txt").write_text("hello world the quick brown fox\n" * 40)
    for kind in ("byte", "bpe"):             # data prepared with an export's tokenizer (prepare --tokenizer EXPORT)
        rc, _, err = run_cli(capsys, ["prepare", "--files", tmp_path / "text.txt", "--tokenizer", tmp_path / kind,
                                      "--set", "data.val_fraction=0.5", "--out", tmp_path / f"data-{kind}", "--quiet"])
        assert rc == 0, err
        rc, _, err = run_cli(capsys, ["eval", tmp_path / kind, *opts, "--data", tmp_path / f"data-{kind}",
                                      "--json", tmp_path / f"{kind}.json"])
        assert rc == 0, err


# ------------------------------------------------------------------------------ 3. option bags
def test_check_keys_names_the_key_what_is_allowed_and_the_closest():
    with pytest.raises(ValueError, match=r"model_args: unknown key 'max_lenght' \(allowed: max_length, path\); "
                                         r"did you mean 'max_length'\?"):
        check_keys("model_args", {"max_lenght": 1}, ("path", "max_length"))
    check_keys("model_args", {"path": 1}, ("path", "max_length"))


def test_a_misspelt_lm_eval_model_arg_or_generation_option_is_refused(env):
    pytest.importorskip("lm_eval")
    from fibattn.interop.lm_eval_adapter import FibattnLM, FibScorer
    w, _ = env
    with pytest.raises(ValueError, match="lm-eval model_args: unknown key 'max_lenght'.*did you mean 'max_length'"):
        FibattnLM.create_from_arg_string(f"path={w / 'run'},max_lenght=8", {"batch_size": 1, "device": "cpu"})
    scorer = FibScorer.load(w / "run", max_length=16)
    with pytest.raises(ValueError, match="generation_kwargs: unknown key 'max_gen_tokens'.*'max_gen_toks'"):
        scorer.generate_until("To be", {"until": ["\n"], "max_gen_tokens": 4})


def test_config_keys_read_from_json_suggest_the_closest(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps({"name": "x", "model": {"windw": 3}}))
    line = refused(capsys, ["config", "--config", tmp_path / "c.json"], tmp_path, "model.windw")
    assert "did you mean 'model.window'" in line
    line = refused(capsys, ["config", "--set", "train.warmup_step=1"], tmp_path, "train.warmup_step")
    assert "did you mean 'train.warmup_steps'" in line


def test_a_misspelt_saved_fibattn_setting_of_a_transformers_folder_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fibattn.interop import hf_llama as H
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = H.apply_fibattn(transformers.LlamaForCausalLM(cfg), window=2)
    model.save_pretrained(tmp_path / "m")
    doc = json.loads((tmp_path / "m" / "config.json").read_text())
    doc["fibattn"]["reach_length"] = doc["fibattn"].pop("reach_len")
    (tmp_path / "m" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="unknown key 'reach_length'.*did you mean 'reach_len'"):
        H.from_pretrained(tmp_path / "m")


def test_the_remote_code_refuses_a_misspelt_saved_setting_too():
    pytest.importorskip("transformers")
    from fibattn.interop.hf_remote.configuration_fibattn_llama import FibattnLlamaConfig
    from fibattn.interop.hf_remote.modeling_fibattn_llama import FibattnLlamaForCausalLM
    settings = {"window": 2, "alphas": [1.0], "reach_length": None, "base": {"kind": "fib", "k": 6, "values": []}}
    cfg = FibattnLlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, fibattn=settings)
    with pytest.raises(ValueError, match="unknown key 'reach_length'.*did you mean 'reach_len'"):
        FibattnLlamaForCausalLM(cfg)


# ------------------------------------------------------------------------------ 4. flags that lose their meaning
def test_init_from_flags_that_would_lose_their_meaning_are_refused(env, tiny_data, tmp_path, capsys):
    w, _ = env
    ckpt = next((w / "run" / "checkpoints").iterdir())
    refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", ""), tmp_path, "--init-from", "''")
    refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", w / "llama", "--resume", ""), tmp_path,
            "--resume must be")
    refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", w / "llama", "--resume", ckpt), tmp_path,
            "--init-from", "--resume", str(ckpt))
    # OUT holds a run trained from scratch: resuming it would keep its weights and record the wrong origin
    before = snapshot(w / "run")
    line = refused(capsys, train_argv(tiny_data, w / "run", "--init-from", w / "llama"), tmp_path, "--init-from",
                   str(w / "run"), "scratch")
    assert snapshot(w / "run") == before and "--out" in line


def test_settings_the_config_does_not_read_are_refused(tiny_data, tmp_path, capsys):
    out = tmp_path / "out"
    for argv, needles in [
        (train_argv(tiny_data, out, "--set", "data.vocab_size=1000"), ("data.vocab_size", "data.tokenizer='byte'")),
        (train_argv(tiny_data, out, "--set", "model.alphas=[1.0]"), ("model.alphas", "model.schedule")),
        (train_argv(tiny_data, out, "--set", "model.base=pow2", "--set", "model.base_k=9"), ("model.base_k",)),
        (train_argv(tiny_data, out, "--set", "model.learned_init=fixed"), ("model.learned_init",)),
        (["prepare", "--vocab-size", "500", "--out", out], ("--vocab-size", "data.tokenizer")),
        (["config", "--set", "model.base_values=[1,2]"], ("model.base_values", "model.base")),
    ]:
        refused(capsys, argv, tmp_path, *needles)
    # a --config file lists every key: a vocabulary size away from the default is the user's, and refused too;
    # the same file at the default (any saved byte-level run's config) still trains
    from fibattn import config as C
    from fibattn.presets import get_preset
    cfg = get_preset("tiny")
    cfg.data.vocab_size = 4096
    (tmp_path / "vocab.json").write_text(json.dumps(C.to_dict(cfg)))    # C.save would record only what acts
    refused(capsys, ["train", "--config", tmp_path / "vocab.json", "--out", out], tmp_path, "--config",
            "data.vocab_size", "data.tokenizer='byte'")
    from fibattn.validation import check_honoured, given_by_file
    default = get_preset("tiny")
    check_honoured(default, given_by_file(default, "x.json"))


# ------------------------------------------------------------------------------ 6. messages name what the user controls
def test_a_transformers_folder_given_to_eval_or_generate_says_what_it_is(env, tmp_path, capsys):
    w, _ = env
    for argv in (["eval", w / "llama"], ["generate", w / "llama", "--prompt", "hi"],
                 ["export", w / "llama", tmp_path / "x"]):
        refused(capsys, argv, tmp_path, "transformers folder", "model_type 'llama'", "--init-from")
    import fibattn
    with pytest.raises(ValueError, match="transformers folder"):
        fibattn.from_pretrained(w / "llama")


def test_a_source_that_does_not_fit_names_the_source_not_internal_fields(env, tiny_data, tmp_path, capsys):
    w, _ = env
    line = refused(capsys, train_argv(tiny_data, tmp_path / "out", "--init-from", w / "llama", "--set",
                                      "model.d_model=64", "--set", "model.n_heads=4"), tmp_path,
                   "--init-from", str(w / "llama"), "model.d_model=32")
    assert "train.init_from" not in line
