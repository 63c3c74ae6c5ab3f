"""Issue 23, CLI-wide: one top-level error handler (input errors one line, bugs say so), size flags checked
against this machine's memory by one mechanism, bounded tokenizer training, no output for a meaningless
request, numeric edges of sampling, optimizer ranges, and OS errors that name the setting."""
import errno
import resource
import time

import pytest
import torch

from fibattn import devices
from fibattn.cli import main
from fibattn.config import ModelConfig
from fibattn.generation.decode import Sampling, generate, sample
from fibattn.model.lm import FibLM
from fibattn.ops import backends
from fibattn.trainer.trainer import train
from run_helpers import micro_config
from storage_helpers import assert_one_line, run_cli, snapshot

SMALL_MEMORY = 64 << 20             # what the size checks see in these tests: 64 MB


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_data):
    w = tmp_path_factory.mktemp("bounds")
    cfg = micro_config(w / "run", tiny_data, steps=1, batch_tokens=64, micro_batch=2, ckpt_every=100,
                       eval_tokens=64, threads=1, results_db="off")
    cfg.eval.lengths, cfg.eval.tokens = [32], 256
    train(cfg)
    (w / "empty-root").mkdir()
    return w


MICRO = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
         "--set", "model.n_kv_heads=1", "--set", "model.seq_len=32", "--set", "train.batch_tokens=64",
         "--set", "train.micro_batch=2", "--set", "train.steps=1", "--set", "train.threads=1",
         "--set", "train.results_db=off"]

def _case(case_id, argv, needles, memory=None):
    return pytest.param(argv, needles, memory, id=case_id)


def _no_triton(name, device):             # triton as on a machine without a GPU (the tests run it interpreted)
    return "the triton backend runs on CUDA tensors (test)" if name == "triton" else None


TRAIN = ["train", "--preset", "tiny", "--out", "{O}", "--set", "data.out_dir={D}", *MICRO]
# argv, needles of the one error line, the memory the size checks see (None: this machine's)
CASES = [
    # a backend that cannot run the model: refused before any output, naming the setting
    _case("train-flex-learned", TRAIN + ["--set", "model.backend=flex", "--set", "model.schedule=learned"],
          ["model.backend=flex", "integer distances"]),
    _case("train-flex-cpu", TRAIN + ["--set", "model.backend=flex", "--set", "train.device=cpu"],
          ["model.backend=flex", "no backward on CPU"]),
    _case("train-triton-cpu", TRAIN + ["--set", "model.backend=triton"], ["model.backend=triton", "cannot run"]),
    _case("generate-triton-cpu", ["generate", "{R}", "--prompt", "hi", "--device", "cpu", "--set",
                                  "model.backend=triton"], ["model.backend=triton"]),
    _case("grid-triton-cpu", ["grid", "demo", "--root", "{O}", "--set", "model.backend=triton"],
          ["run fib_fixed", "model.backend=triton"]),
    _case("grid-missing-source", ["grid", "demo", "--root", "{O}", "--set",
                                  'data.sources=[{{"name":"x","kind":"files","path":"{W}/none.txt"}}]'],
          ["data.sources[0].path", "none.txt"]),
    # optimizer hyper-parameters at their real ranges
    _case("train-beta1-one", TRAIN + ["--set", "train.beta1=1"], ["train.beta1", "[0, 1)"]),
    _case("train-beta2-one", TRAIN + ["--set", "train.beta2=1.0"], ["train.beta2", "[0, 1)"]),
    _case("train-beta1-negative", TRAIN + ["--set", "train.beta1=-0.1"], ["train.beta1"]),
    _case("train-activation-checkpointing", TRAIN + ["--set", "train.activation_checkpointing=some"],
          ["train.activation_checkpointing", "none, full", "'some'"]),
    # size flags against memory: the flag, the value, what fits
    _case("hf-cache-contexts", ["bench", "hf-cache", "--contexts", "100000000"], ["--contexts 100000000", "at most"],
          SMALL_MEMORY),
    _case("hf-cache-new", ["bench", "hf-cache", "--new", "100000000", "--contexts", "100000001"],
          ["--new 100000000", "at most"], SMALL_MEMORY),
    _case("probe-seq-len", ["probe", "--out", "{O}", "--seq-len", "1000000"], ["--seq-len 1000000", "at most"],
          SMALL_MEMORY),
    _case("probe-batch-size", ["probe", "--out", "{O}", "--batch-size", "1000000"],
          ["--batch-size 1000000", "at most"], SMALL_MEMORY),
    _case("bench-generate-contexts", ["bench", "generate", "--shapes", "tiny", "--contexts", "100000000"],
          ["--contexts 100000000", "at most"], SMALL_MEMORY),
    _case("bench-generate-prefill", ["bench", "generate", "--shapes", "tiny", "--prefill", "100000000000"],
          ["--prefill 100000000000", "at most"]),
    _case("eval-lengths", ["eval", "{R}", "--lengths", "100000", "--tokens", "200000", "--db", "off"],
          ["--lengths", "100000", "at most"], SMALL_MEMORY),
    _case("bench-attention-lengths", ["bench", "attention", "--lengths", "1000000"], ["--lengths 1000000", "at most"],
          SMALL_MEMORY),
    # meaningless requests
    _case("report-no-runs", ["report", "demo", "--root", "{W}/empty-root", "--out", "{O}"],
          ["--root", "empty-root", "no evaluated run"]),
    _case("generate-zero-tokens", ["generate", "{R}", "--prompt", "hi", "--max-new-tokens", "0"],
          ["--max-new-tokens"]),
    # held-out round three: flags that would lose their meaning, messages naming the flag the user gave
    _case("train-stop-at-beyond-steps", TRAIN + ["--stop-at", "5"], ["--stop-at 5", "train.steps (1)"]),
    _case("train-batch-beyond-the-data", TRAIN + ["--set", "train.batch_tokens=1099511627776"],
          ["train.batch_tokens (1099511627776)", "training data holds"]),          # was 17e9 micro-batches a step
    _case("train-out-a-file-names-flag", ["train", "--preset", "tiny", "--out", "{R}/config.json", *MICRO[:-2]],
          ["--out (train.out_dir)", "config.json"]),
    _case("train-resume-missing-names-flag", TRAIN + ["--resume", "{W}/none"], ["--resume {W}/none"]),
    _case("prepare-vocab-size-names-flag", ["prepare", "--tokenizer", "bpe", "--vocab-size", "10", "--out", "{O}"],
          ["--vocab-size", "10"]),
    _case("generate-set-names-flag", ["generate", "{R}", "--prompt", "hi", "--set", "model.window=3"],
          ["generate --set", "model.window"]),
    _case("generate-set-that-does-not-fit", ["generate", "{R}", "--prompt", "hi", "--set", "model.max_seq_len=2"],
          ["generate --set", "model.max_seq_len=2"]),
    _case("probe-starts-names-flag", ["probe", "--out", "{O}", "--starts", "middle"], ["--starts", "middle"]),
    _case("probe-lr-names-flag", ["probe", "--out", "{O}", "--lr", "0"], ["--lr"]),
    _case("probe-steps-names-flag", ["probe", "--out", "{O}", "--steps", "0"], ["--steps"]),
    _case("probe-seq-len-names-flag", ["probe", "--out", "{O}", "--seq-len", "4"], ["--seq-len", "--distances"]),
    _case("bench-attention-more-documents-than-tokens", ["bench", "attention", "--documents", "100", "--lengths",
                                                         "64", "--no-memory"], ["--documents 100", "64"]),
    _case("bench-train-more-documents-than-tokens", ["bench", "train", "--documents", "100", "--lengths", "32"],
          ["--documents 100", "32"]),
    _case("bench-cp-forward-only-without-measure", ["bench", "context-parallel", "--forward-only"],
          ["--forward-only", "--measure"]),
    _case("bench-cp-measure-ranks-without-measure", ["bench", "context-parallel", "--measure-ranks", "3"],
          ["--measure-ranks", "--measure"]),
]


@pytest.mark.parametrize("argv, needles, memory", CASES)
def test_refused_with_one_line_before_writing(env, tiny_data, tmp_path, monkeypatch, capsys, argv, needles, memory):
    if memory is not None:
        monkeypatch.setattr(devices, "host_memory_bytes", lambda: memory)
    monkeypatch.setattr(backends, "backend_available", _no_triton)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    subs = {"D": str(tiny_data), "R": str(env / "run"), "O": str(out), "W": str(env)}
    before = snapshot(env)
    rc, _, err = run_cli(capsys, [a.format(**subs) for a in argv])
    assert_one_line(rc, err, *[n.format(**subs) for n in needles])
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []
    assert snapshot(env) == before


@pytest.mark.parametrize("bug, name", [(lambda: {}["missing"], "KeyError"), (lambda: int("x"), "ValueError"),
                                       (lambda: max([]), "ValueError")])
def test_a_bug_keeps_its_traceback_and_says_it_is_one(monkeypatch, capsys, bug, name):
    """Only fibattn's input errors (UsageError and its kinds) are one-line exit 2: a plain ValueError from a
    bug inside fibattn is not mistaken for the user's input."""
    from fibattn.cli import show_config
    monkeypatch.setattr(show_config, "run", lambda args: bug())
    rc = main(["config"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" in err and name in err
    last = err.strip().splitlines()[-1]
    assert "internal error" in last and "a bug" in last and "test_reliability_bounds.py:" in last


def test_fibattn_raises_its_input_errors_as_usage_errors():
    """The CLI tells input from bugs by type: no fibattn module raises, builds or defaults to a plain ValueError
    (catching one is fine). The remote-code files run without fibattn and are not scanned."""
    import ast
    from pathlib import Path

    import fibattn

    def plain(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "ValueError"
    root, found = Path(fibattn.__file__).parent, []
    for path in sorted(root.rglob("*.py")):
        if "hf_remote" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and plain(node.func) or isinstance(node, ast.Raise) and plain(node.exc):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
            elif isinstance(node, ast.arguments):
                found += [f"{path.relative_to(root)}:{d.lineno}" for d in node.defaults + node.kw_defaults if plain(d)]
    assert found == [], "raise fibattn.checks.UsageError (or a kind of it) for bad input"


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: "
                                                               "can't allocate memory: you tried to allocate 8 bytes")])
def test_out_of_memory_is_one_line_not_a_bug(monkeypatch, capsys, exc):
    from fibattn.cli import show_config

    def hungry(args):
        raise exc
    monkeypatch.setattr(show_config, "run", hungry)
    rc, _, err = run_cli(capsys, ["config"])
    assert rc == 1 and len(err) == 1 and "out of memory" in err[0] and "Traceback" not in err[0]


def test_an_os_error_names_the_setting_that_holds_the_path(env, tmp_path, monkeypatch, capsys):
    from fibattn.cli import report

    out = tmp_path / "rep"

    def refused(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(out / "report.md"))
    monkeypatch.setattr(report, "build_report", refused)
    rc, _, err = run_cli(capsys, ["report", "demo", "--root", env / "empty-root", "--out", out])
    assert_one_line(rc, err, "report.md", "Permission denied", "(from --out)")
    rc, _, err = run_cli(capsys, ["report", "demo", "--root", env / "empty-root", "--set", f"train.out_dir={out}"])
    assert_one_line(rc, err, "report.md", "(from train.out_dir)")


def test_decode_caches_that_cannot_fit_are_refused_before_the_first_token(monkeypatch):
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: SMALL_MEMORY)
    m = FibLM(ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32,
                          attention="dense", max_seq_len=1 << 40))
    with pytest.raises(ValueError, match=r"--max-new-tokens\) 10000000002 needs at least .* at most \d+ fits"):
        generate(m, [1, 2], max_new_tokens=10 ** 10)


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-30, 1e30, 1e300, 1.7e308])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 1e-30), (0, 1e-300), (100, 0.5)])
def test_extreme_sampling_values_give_valid_tokens(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 10
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for _ in range(5):
        tok = sample(logits, Sampling(temperature, top_k, top_p), gens)
        assert ((tok >= 0) & (tok < 50)).all()
        if temperature < 1e-20 or top_p < 1e-20 or top_k == 1:
            assert torch.equal(tok, logits.argmax(-1))          # a vanishing temperature / nucleus is greedy


def test_init_from_recipe_never_derives_a_zero_learning_rate():
    from fibattn.checks import ConfigError
    from fibattn.presets import tiny
    from fibattn.trainer.init_recipe import apply_recipe
    cfg = tiny()
    cfg.train.min_lr_ratio = 0.0
    with pytest.raises(ConfigError, match="train.min_lr_ratio=0.0"):
        apply_recipe(cfg, {"train.min_lr_ratio"})
    assert apply_recipe(cfg, {"train.min_lr_ratio", "train.lr"})          # an explicit train.lr is fine


def test_bpe_training_on_a_line_without_spaces_is_bounded():
    from fibattn.data.tokenizers import MAX_TRAIN_RUN, bounded_pieces, train_bpe
    text = "the cat sat on the mat\n" * 50
    assert list(bounded_pieces([text])) == [text]                      # ordinary text: trained as before
    line = "".join("abcdefghij"[(i * 7919) % 10] for i in range(1_000_000))      # 1 MB, no whitespace
    assert list(bounded_pieces(["x " + line + " y"])) == ["x " + line[:MAX_TRAIN_RUN], " y"]
    rss0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    tok = train_bpe([line], 400)
    seconds, grown_mb = time.perf_counter() - t0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert seconds < 30 and grown_mb < 500, (seconds, grown_mb)       # unbounded: minutes and gigabytes
    sample_text = line[:5000]
    assert tok.decode(tok.encode(sample_text)) == sample_text


def test_a_long_bpe_document_is_encoded_in_bounded_pieces_with_the_whole_documents_ids(monkeypatch):
    """Cut only where the ByteLevel pre-tokenizer cuts anyway: the ids equal the unchunked encoding's on
    hostile text (spaces, line breaks, unicode spaces, contractions, the eos text), every piece within the
    limit; a pretrained pipeline with a normalizer is never cut."""
    import random

    import fibattn.data.tokenizers as T
    tok = T.train_bpe(["hello world the quick brown fox's den " * 50, "ROMEO: <|endoftext|> é\n\nwhat light"], 400)
    monkeypatch.setattr(T, "MAX_ENCODE_CHARS", 40)
    real, sizes = tok._tok, []

    class Spy:                       # the backend, recording the pieces it is given
        def encode_batch_fast(self, texts, **kw):
            sizes.extend(map(len, texts))
            return real.encode_batch_fast(texts, **kw)
        encode_batch = encode_batch_fast

        def __getattr__(self, name):
            return getattr(real, name)
    monkeypatch.setattr(tok, "_tok", Spy())
    rng, cut = random.Random(0), 0
    alphabet = list("ab cd\n\t  é日😀'.,-0") + ["<|endoftext|>", "\r\n", "\u00a0", "\u2028", "\x1c", "'s", " 's"]
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))
        whole = real.encode(text, add_special_tokens=False).ids
        try:
            ids = tok.encode_batch([text, "x"])[0].tolist()
        except T.DocumentTooLong:
            assert len(text) > 40
            continue
        assert ids == whole and tok.encode(text) == whole, text
        cut += len(text) > 40
    assert cut > 100 and max(sizes) <= 40
    monkeypatch.setattr(tok, "_tok", real)
    assert T._cuts_at_spaces(real)
    assert not T._cuts_at_spaces(T.require("tokenizers", "test").Tokenizer.from_str(_normalized(real)))


def _normalized(tokenizer) -> str:
    import json
    doc = json.loads(tokenizer.to_str())
    doc["normalizer"] = {"type": "NFC"}
    return json.dumps(doc)


def test_prepare_refuses_a_document_it_cannot_encode_in_bounded_memory_naming_the_file(tmp_path, capsys,
                                                                                       monkeypatch):
    import fibattn.data.tokenizers as T
    monkeypatch.setattr(T, "MAX_ENCODE_CHARS", 1000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the cat sat on the mat\n" * 200)             # long, but cut at its spaces
    (src / "b.txt").write_text("ab" * 1000)                                    # one line, no whitespace
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["prepare", "--files", src, "--tokenizer", "bpe", "--vocab-size", "300", "--quiet",
                                  "--out", tmp_path / "out"])
    assert_one_line(rc, err, f"{src / 'b.txt'}", "2,000 characters", "MAX_ENCODE_CHARS = 1,000")
    assert snapshot(tmp_path) == before
    (src / "b.txt").write_text("ab " * 1000)
    rc, _, err = run_cli(capsys, ["prepare", "--files", src, "--tokenizer", "bpe", "--vocab-size", "300", "--quiet",
                                  "--out", tmp_path / "out"])
    assert rc == 0, err
