"""Bad input on every CLI command: one clear line naming the field, exit status 2, nothing written.

Each case runs in-process through ``fibattn.cli.main`` with the working directory set to an
empty folder. It must return 2, print exactly one stderr line that names the field (or
argument) and no traceback, leave the output folder ``{O}`` uncreated, the working folder
empty and the shared fixture (prepared data, a trained micro run) byte-for-byte unchanged.
Placeholders: ``{D}`` prepared data, ``{R}`` trained run, ``{O}`` output folder (absent),
``{W}`` the fixture folder (bad files live there).
"""
import json
import shutil

import pytest

from fibattn.cli import main
from fibattn.trainer.trainer import train
from run_helpers import micro_config

MICRO = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
         "--set", "model.n_kv_heads=1", "--set", "model.seq_len=32", "--set", "train.batch_tokens=64",
         "--set", "train.micro_batch=2", "--set", "train.steps=2", "--set", "model.backend=torch",
         "--set", "train.threads=1", "--set", "train.results_db=off"]
TRAIN = ["train", "--preset", "tiny", "--out", "{O}", "--set", "data.out_dir={D}"] + MICRO


def _tr(*extra):
    return TRAIN + list(extra)


def _set(*items):
    return [x for item in items for x in ("--set", item)]


# (case id, argv, text the single error line must contain)
CASES = [
    # ---- train: config fields (type, range, unknown keys, relations)
    ("train-lr-type", _tr(*_set("train.lr=abc")), "train.lr"),
    ("train-lr-range", _tr(*_set("train.lr=-1")), "train.lr"),
    ("train-steps-zero", _tr(*_set("train.steps=0")), "train.steps"),
    ("train-bool-type", _tr(*_set("train.compile=maybe")), "train.compile"),
    ("train-context-split", _tr(*_set("train.context_parallel=3")), "train.context_parallel"),
    ("train-context-zero", _tr(*_set("train.context_parallel=0")), "train.context_parallel"),
    ("train-context-compile", _tr(*_set("train.context_parallel=2", "train.compile=true")), "train.compile"),
    ("train-documents-type", _tr(*_set("train.document_masking=maybe")), "train.document_masking"),
    ("train-unknown-field", _tr(*_set("model.bogus=1")), "model.bogus"),
    ("train-unknown-section", _tr(*_set("nosection=1")), "nosection"),
    ("train-section-as-field", _tr(*_set("model=1")), "model"),
    ("train-override-syntax", _tr("--set", "train.steps"), "section.field=value"),
    ("train-precision-choice", _tr(*_set("train.precision=fp8")), "train.precision"),
    ("train-device-choice", _tr(*_set("train.device=tpu")), "train.device"),
    ("train-window-negative", _tr(*_set("model.window=-1")), "model.window"),
    ("train-seq-above-max", _tr(*_set("model.seq_len=64", "model.max_seq_len=32")), "model.max_seq_len"),
    ("train-heads-divide", _tr(*_set("model.d_model=33")), "model.d_model"),
    ("train-kv-heads-divide", _tr(*_set("model.n_kv_heads=3")), "model.n_kv_heads"),
    ("train-alpha-range", _tr(*_set("model.schedule=fixed", "model.alpha=9")), "model.alpha"),
    ("train-custom-alphas", _tr(*_set("model.schedule=custom", "model.alphas=[1.0,1.0]")), "model.alphas"),
    ("train-custom-base", _tr(*_set("model.base=custom", "model.base_values=[0]")), "model.base_values"),
    ("train-batch-multiple", _tr(*_set("train.batch_tokens=100")), "train.batch_tokens"),
    ("train-warmup-beyond-steps", _tr(*_set("train.warmup_steps=3")), "train.warmup_steps (3)"),
    ("train-eval-lengths", _tr(*_set("eval.lengths=[0]")), "eval.lengths"),
    ("train-vocab-vs-tokenizer", _tr(*_set("model.vocab_size=100")), "model.vocab_size"),
    ("train-source-missing-file", _tr(*_set("data.out_dir={O}-data",
                                            'data.sources=[{{"name":"x","kind":"files","path":"{W}/missing"}}]')),
     "data.sources[0].path"),
    ("train-source-unknown-key", _tr(*_set('data.sources=[{{"name":"x","colour":"red"}}]')), "colour"),
    ("train-tokenizer-mismatch", _tr(*_set("data.out_dir={W}/data-badtok")), "tokenizer"),
    # ---- train: command-line arguments and files
    ("train-resume-missing", _tr("--resume", "{W}/no-such-checkpoint"), "no-such-checkpoint"),
    ("train-resume-empty", _tr("--resume", ""), "resume"),
    ("train-resume-corrupt", _tr("--resume", "{W}/bad-ckpt/checkpoints/step-2"), "model.safetensors"),
    ("train-stop-at-zero", _tr("--stop-at", "0"), "--stop-at"),
    ("train-stop-at-type", _tr("--stop-at", "x"), "--stop-at"),
    ("train-unknown-flag", _tr("--bogus"), "--bogus"),
    ("train-preset-unknown", ["train", "--preset", "huge", "--out", "{O}"], "--preset"),
    ("train-preset-and-config", ["train", "--preset", "tiny", "--config", "{W}/cfg-unknown.json", "--out", "{O}"],
     "--config"),
    ("train-config-missing", ["train", "--config", "{W}/missing.json", "--out", "{O}"], "missing.json"),
    ("train-config-unknown-key", ["train", "--config", "{W}/cfg-unknown.json", "--out", "{O}"], "bogus"),
    ("train-config-not-json", ["train", "--config", "{W}/cfg-broken.json", "--out", "{O}"], "cfg-broken.json"),
    ("train-out-under-file", TRAIN[:4] + ["{W}/afile/sub"] + TRAIN[5:], "train.out_dir"),
    ("train-out-is-file", TRAIN[:4] + ["{W}/afile"] + TRAIN[5:], "train.out_dir"),
    # ---- prepare
    ("config-bad-value", ["config", *_set("model.window=x")], "model.window"),
    ("config-preset-and-config", ["config", "--preset", "tiny", "--config", "c.json"], "--preset"),
    ("config-missing-file", ["config", "--config", "missing.json"], "missing.json"),
    ("prepare-val-fraction", ["prepare", "--quiet", "--out", "{O}", *_set("data.val_fraction=2")],
     "data.val_fraction"),
    ("prepare-tokenizer-choice", ["prepare", "--quiet", "--out", "{O}", *_set("data.tokenizer=wordpiece")],
     "data.tokenizer"),
    ("prepare-shard-tokens", ["prepare", "--quiet", "--out", "{O}", *_set("data.shard_tokens=10")],
     "data.shard_tokens"),
    ("prepare-unknown-key", ["prepare", "--quiet", "--out", "{O}", *_set("train.bogus=1")], "train.bogus"),
    ("prepare-preset", ["prepare", "--quiet", "--out", "{O}", "--preset", "huge"], "--preset"),
    ("prepare-empty-corpus", ["prepare", "--quiet", "--out", "{O}",
                              *_set('data.sources=[{{"name":"e","kind":"files","path":"{W}/empty.txt"}}]')],
     "data.sources[0]"),
    ("prepare-missing-source", ["prepare", "--quiet", "--out", "{O}",
                                *_set('data.sources=[{{"name":"e","kind":"files","path":"{W}/none.txt"}}]')],
     "data.sources[0].path"),
    ("prepare-not-a-data-folder", ["prepare", "--quiet", "--out", "{R}", "--set", "data.val_fraction=0.1"],
     "data.out_dir"),
    ("prepare-verify-missing", ["prepare", "--verify", "{W}/missing"], "manifest.json"),
    ("prepare-verify-tokenizer", ["prepare", "--verify", "{W}/data-badtok"], "tokenizer"),
    ("prepare-verify-corrupt", ["prepare", "--verify", "{W}/data-corrupt"], "train_shakespeare_00000.bin"),
    # ---- eval
    ("eval-lengths-zero", ["eval", "{R}", "--lengths", "0"], "--lengths"),
    ("eval-lengths-type", ["eval", "{R}", "--lengths", "a,b"], "--lengths"),
    ("eval-step-missing", ["eval", "{R}", "--step", "7"], "step-7"),
    ("eval-step-type", ["eval", "{R}", "--step", "x"], "--step"),
    ("eval-run-missing", ["eval", "{W}/missing-run"], "missing-run"),
    ("eval-reach", ["eval", "{R}", "--reach", "far"], "--reach"),
    ("eval-tokens", ["eval", "{R}", "--tokens", "0"], "--tokens"),
    ("eval-precision", ["eval", "{R}", "--precision", "fp8"], "--precision"),
    ("eval-batch-size", ["eval", "{R}", "--batch-size", "0"], "--batch-size"),
    ("eval-datasets", ["eval", "{R}", "--datasets", "nope"], "--datasets"),
    ("eval-data-missing", ["eval", "{R}", "--data", "{W}/missing"], "--data"),
    ("eval-data-other-tokenizer", ["eval", "{R}", "--data", "{W}/data-othertok"], "tokenizer"),
    ("eval-corrupt-checkpoint", ["eval", "{W}/bad-ckpt", "--step", "2"], "model.safetensors"),
    # ---- generate
    ("generate-temperature", ["generate", "{R}", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    ("generate-top-k", ["generate", "{R}", "--prompt", "hi", "--top-k", "-1"], "--top-k"),
    ("generate-top-p", ["generate", "{R}", "--prompt", "hi", "--top-p", "0"], "--top-p"),
    ("generate-max-new", ["generate", "{R}", "--prompt", "hi", "--max-new-tokens", "-5"], "--max-new-tokens"),
    ("generate-seed", ["generate", "{R}", "--prompt", "hi", "--seed", "-1"], "--seed"),
    ("generate-run-missing", ["generate", "{W}/missing-run", "--prompt", "hi"], "missing-run"),
    ("generate-device", ["generate", "{R}", "--prompt", "hi", "--device", "tpu"], "--device"),
    ("generate-weights-override", ["generate", "{R}", "--prompt", "hi", "--set", "model.window=3"], "model.window"),
    ("generate-empty-prompt", ["generate", "{R}", "--prompt", ""], "--prompt"),
    ("generate-no-prompt", ["generate", "{R}"], "--prompt"),
    # ---- probe
    ("probe-preset", ["probe", "--out", "{O}", "--preset", "huge"], "--preset"),
    ("probe-depths", ["probe", "--out", "{O}", "--depths", "0"], "--depths"),
    ("probe-steps", ["probe", "--out", "{O}", "--steps", "0"], "steps"),
    ("probe-starts", ["probe", "--out", "{O}", "--starts", "sideways"], "starts"),
    ("probe-lr", ["probe", "--out", "{O}", "--lr", "-1"], "lr"),
    ("probe-seq-len", ["probe", "--out", "{O}", "--seq-len", "1"], "seq_len"),
    # ---- grid / report / demo
    ("grid-name", ["grid", "nogrid", "--root", "{O}"], "grid"),
    ("grid-unknown-key", ["grid", "demo", "--root", "{O}", "--set", "model.bogus=1"], "model.bogus"),
    ("grid-only", ["grid", "demo", "--root", "{O}", "--only", "zzz*"], "--only"),
    ("grid-extend-missing", ["grid", "demo", "--root", "{O}", "--extend", "{W}/missing.json"], "--extend"),
    ("grid-gpus-per-run", ["grid", "demo", "--root", "{O}", "--gpus-per-run", "0"], "--gpus-per-run"),
    ("report-name", ["report", "nogrid", "--root", "{O}"], "grid"),
    ("report-root-missing", ["report", "demo", "--root", "{W}/missing-root", "--out", "{O}"], "--root"),
    ("demo-device", ["demo", "--root", "{O}", "--device", "tpu"], "device"),
    ("demo-only", ["demo", "--root", "{O}", "--only", "zzz*"], "--only"),
    ("demo-set-type", ["demo", "--root", "{O}", "--set", "train.lr=x"], "train.lr"),
    ("demo-root-under-file", ["demo", "--root", "{W}/afile/sub"], "afile"),
    # ---- export / bench / top level
    ("export-run-missing", ["export", "{W}/missing-run", "{O}"], "missing-run"),
    ("bench-attention-lengths", ["bench", "attention", "--lengths", "a"], "--lengths"),
    ("bench-attention-repeats", ["bench", "attention", "--repeats", "0"], "--repeats"),
    ("bench-train-lengths", ["bench", "train", "--lengths", "0"], "--lengths"),
    ("bench-train-preset", ["bench", "train", "--preset", "huge"], "--preset"),
    ("bench-generate-shapes", ["bench", "generate", "--shapes", "huge"], "--shapes"),
    ("bench-generate-steps", ["bench", "generate", "--steps", "0"], "--steps"),
    ("bench-suite", ["bench", "nosuite"], "SUITE"),
    # ---- issue 60 item 6: the closest flag or full key, a schedule's other name, train --device
    ("train-flag-prefix", _tr("--dat", "{W}"), "did you mean --data? (see fibattn train --help)"),
    ("generate-flag-typo", ["generate", "{R}", "--prompt", "hi", "--temprature", "0.5"], "did you mean --temperature"),
    ("config-key-full", ["config", *_set("model.windw=8")], "did you mean 'model.window'"),
    ("train-schedule-word", _tr(*_set("model.schedule=stagger")), "use linear"),
    ("train-device-typo", _tr("--device", "gpu"), "--device"),
    ("train-seed-beyond-64-bits", _tr(*_set(f"train.seed={2 ** 64}")), "train.seed"),
    ("probe-seed-huge", ["probe", "--out", "{O}", "--seed", str(2 ** 40)], "--seed"),
    ("train-threads-huge", _tr(*_set("train.threads=5000")), "train.threads"),
    ("generate-threads-huge", ["generate", "{R}", "--prompt", "hi", "--threads", "5000"], "--threads"),
    ("bench-generate-decode-threads-huge", ["bench", "generate", "--decode-threads", "99999999999"],
     "--decode-threads"),
    ("bench-attention-memory-check-huge", ["bench", "attention", "--lengths", "64", "--memory-check", "2000000000"],
     "--memory-check 2000000000"),
    ("train-device-twice", _tr("--device", "cpu", *_set("train.device=cpu")), "--device cpu and --set train.device"),
    ("no-command", [], "COMMAND"),
    ("unknown-command", ["frobnicate"], "frobnicate"),
]


def _copy_data(src, dst, tokenizer_text=None, fix_manifest=False):
    shutil.copytree(src, dst)
    if tokenizer_text is not None:
        (dst / "tokenizer.json").write_text(tokenizer_text)
    if fix_manifest:
        from fibattn.data.tokenizers import tokenizer_sha256
        man = json.loads((dst / "manifest.json").read_text())
        man["tokenizer"]["sha256"] = tokenizer_sha256(dst / "tokenizer.json")
        (dst / "manifest.json").write_text(json.dumps(man))


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_data):
    w = tmp_path_factory.mktemp("rel-cli")
    (w / "data").symlink_to(tiny_data, target_is_directory=True)        # read only: {D} in the cases
    cfg = micro_config(w / "run", tiny_data, steps=2, batch_tokens=64, micro_batch=2, log_every=1, ckpt_every=100,
                       eval_tokens=64, threads=1, results_db="off")
    cfg.eval.lengths, cfg.eval.tokens = [32], 256
    train(cfg)
    shutil.copytree(w / "run", w / "bad-ckpt")
    f = w / "bad-ckpt" / "checkpoints" / "step-2" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    tok = (tiny_data / "tokenizer.json").read_text()
    _copy_data(tiny_data, w / "data-badtok", tokenizer_text=tok + "\n ")              # file != manifest
    _copy_data(tiny_data, w / "data-othertok", tokenizer_text=tok + "\n ", fix_manifest=True)
    _copy_data(tiny_data, w / "data-corrupt")
    shard = w / "data-corrupt" / "train_shakespeare_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0x01
    shard.write_bytes(bytes(raw))
    (w / "afile").write_text("x")
    (w / "empty.txt").write_text("")
    (w / "cfg-unknown.json").write_text(json.dumps({"name": "x", "bogus": 1}))
    (w / "cfg-broken.json").write_text("{nope")
    return w


def snapshot(root):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(env, tmp_path, monkeypatch, capsys, argv, needle):
    out = tmp_path / "out"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    subs = {"D": str(env / "data"), "R": str(env / "run"), "O": str(out), "W": str(env)}
    args = [a.format(**subs) for a in argv]
    before = snapshot(env)
    rc = main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert needle.format(**subs) in lines[0], lines[0]
    assert "Traceback" not in err and "error" in lines[0]
    assert not out.exists() and not (tmp_path / "out-data").exists()
    assert list(cwd.iterdir()) == []
    assert snapshot(env) == before


def test_case_table_covers_every_command():
    from fibattn.cli import COMMANDS
    used = {argv[0] for _, argv, _ in CASES if argv}
    assert set(COMMANDS) <= used
    assert len(CASES) >= 30


def test_notes_logged_before_a_refusal_are_dropped_and_kept_otherwise(monkeypatch):
    """stderr logging holds its first lines briefly: a refused command prints its one error line alone;
    otherwise the held notes come out, in order, at the end or once the hold expires."""
    import io
    import logging
    import time
    from fibattn import cli

    def records(handler, *msgs):
        for m in msgs:
            handler.handle(logging.LogRecord("fibattn", logging.INFO, __file__, 1, m, None, None))

    for keep, want in ((False, ""), (True, "a\nb\n")):
        h = cli._HeldLog()
        h.setStream(io.StringIO())
        records(h, "a", "b")
        assert h.stream.getvalue() == ""
        h.let_go(keep=keep)
        records(h, "c")                                  # released: lines pass straight through
        assert h.stream.getvalue() == want + "c\n"
    monkeypatch.setattr(cli._HeldLog, "HOLD_S", 0.05)
    h = cli._HeldLog()
    h.setStream(io.StringIO())
    records(h, "late")
    time.sleep(0.5)
    assert h.stream.getvalue() == "late\n"


def test_a_bad_value_read_from_a_config_file_names_the_file_and_a_model_folder_given_as_data_says_so(
        tmp_path, capsys, tiny_data):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"model": {"d_model": None}}))
    typo = tmp_path / "t.json"
    typo.write_text(json.dumps({"model": {"d_modl": 3}}))
    for argv, want in ((["config", "--config", str(bad)], f"config file {bad}: model.d_model"),
                       (["train", "--config", str(bad), "--out", str(tmp_path / "o")], f"config file {bad}: model.d_model"),
                       (["config", "--config", str(typo)], f"config file {typo}: unknown config key model.d_modl")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], err
    assert main(["config", "--config", str(bad), "--set", "model.d_model=64"]) == 0     # --set overrides the file
    capsys.readouterr()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert main(["train", "--preset", "tiny", "--data", str(run), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "it holds a model" in err[0] and "(from --data)" in err[0], err
    assert not (tmp_path / "o").exists()
