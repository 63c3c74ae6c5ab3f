"""The edges every entry point shares (issue 58 kinds 7, 10, 12, 16, 17; issue 60 items 1, 6): flags parsed
exactly (no abbreviations, the closest flag suggested, every numeric flag range-checked where it is parsed),
text that is not UTF-8 refused in one line, one device check, the lm-eval wrapper's one-line errors, and a
benchmark that never prints an impossible time. Everything here fails at the edge, before work starts."""
import argparse
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibattn import cli, entry
from fibattn.checks import UsageError
from fibattn.cli import main

# placeholders for each command's positional arguments: parsing stops before any of them is used
POSITIONALS = {"eval": ["RUN"], "generate": ["RUN"], "export": ["RUN", "OUT"], "grid": ["demo"], "report": ["demo"]}


def needed(prefix, parser) -> list[str]:
    """Placeholders for what ``parser`` requires (positionals, required flags), so that the flag tried is what
    it reports on."""
    flags = [x for a in parser._actions if a.required and a.option_strings for x in (a.option_strings[-1], "x")]
    return flags + POSITIONALS.get(prefix[0], [])


def parsers():
    """``(argv prefix, parser)`` for every command and bench suite."""
    top = cli.build_parser()
    out = []

    def walk(prefix, parser):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out.append((prefix, parser))
        for action in subs:
            for name, p in action.choices.items():
                walk(prefix + [name], p)
    walk([], top)
    return out


def one_line(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (argv, rc, err)
    return lines[0]


# ----------------------------------------------------------------------------- numeric flags (kind 10)
def numeric_flags():
    for prefix, parser in parsers():
        for action in parser._actions:
            if action.option_strings and action.type is not None and getattr(action.type, "__name__", "") in (
                    "int", "float"):
                yield prefix, parser, action


def test_every_numeric_flag_is_range_checked_where_it_is_parsed(capsys):
    """A huge value (or inf) for any number flag of any command is refused by the parser, naming the flag and
    its limit: nothing reaches torch unchecked."""
    seen = 0
    for prefix, parser, action in numeric_flags():
        assert hasattr(action.type, "bounds"), (prefix, action.option_strings)     # no plain int/float escaped
        flag = action.option_strings[-1]
        for value in (["1" + "0" * 40] if action.type.__name__ == "int" else ["inf", "nan", "-inf"]):
            line = one_line(capsys, prefix + [f"{flag}={value}"] + needed(prefix, parser))
            assert f"argument {flag}" in line or flag in line, line
            assert "must be" in line and f"see fibattn {' '.join(prefix)} --help" in line, line
        seen += 1
    assert seen >= 40


def test_a_seed_takes_what_torch_takes_and_no_more(capsys):
    line = one_line(capsys, ["generate", "RUN", "--prompt", "x", "--seed", str(2 ** 64)])
    assert "--seed" in line and str(2 ** 64 - 1) in line
    line = one_line(capsys, ["bench", "context-parallel", "--ranks", "100000"])
    assert "--ranks" in line and "256" in line
    line = one_line(capsys, ["bench", "context-parallel", "--measure", "1000000000"])
    assert "--measure 1000000000" in line and "fits" in line


# ----------------------------------------------------------------------------- flags (issue 60 item 6)
def test_no_flag_is_taken_from_a_prefix_of_another(capsys):
    """argparse's abbreviations are off everywhere: ``--dat`` is refused (with the flag it resembles), never
    silently read as ``--data``."""
    tried = 0
    for prefix, parser in parsers():
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        for flag in sorted(flags):
            short = flag[:-1]
            if len(short) < 4 or short in flags:
                continue
            line = one_line(capsys, prefix + [short, "1"] + needed(prefix, parser))
            assert f"unrecognized arguments: {short}" in line, line
            tried += 1
    assert tried >= 80


@pytest.mark.parametrize("argv, want", [
    (["generate", "RUN", "--prompt", "x", "--temprature", "0.5"], "did you mean --temperature? (see fibattn generate "
                                                                   "--help)"),
    (["train", "--dat", "x"], "did you mean --data? (see fibattn train --help)"),
    (["bench", "attention", "--lenghts", "8"], "did you mean --lengths? (see fibattn bench attention --help)"),
    (["genrate"], "did you mean generate?"),
    (["bench", "atention"], "did you mean attention?"),
])
def test_a_misspelt_flag_or_command_gets_the_closest_and_the_commands_own_help(capsys, argv, want):
    assert want in one_line(capsys, argv)


# ----------------------------------------------------------------------------- not UTF-8 (kind 17)
BAD = "a\udcff"          # what Python makes of the byte 0xff in an argument (surrogateescape)


@pytest.mark.parametrize("argv, named", [
    (["generate", "RUN", "--prompt", BAD], "--prompt 'a\\xff'"),
    (["eval", BAD], "argument 'a\\xff'"),
    (["train", "--out", BAD], "--out 'a\\xff'"),
    (["train", f"--out={BAD}"], "--out 'a\\xff'"),
    (["config", "--set", f"model.window={BAD}"], "--set"),
    (["bench", "attention", "--paths", BAD], "--paths"),
    (["prepare", "--files", BAD], "--files"),
    (["export", "RUN", BAD], "argument"),
    (["grid", "demo", "--only", BAD], "--only"),
])
def test_an_argument_that_is_not_utf8_is_one_line_naming_it(capsys, argv, named):
    line = one_line(capsys, argv)
    assert named in line and "not UTF-8" in line and "\\xff" in line and "\udcff" not in line, line


def test_a_fibattn_variable_that_is_not_utf8_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("FIBATTN_CACHE", "/tmp/c\udcff")
    line = one_line(capsys, ["config"])
    assert "FIBATTN_CACHE" in line and "\\xff" in line


def test_real_bytes_on_the_command_line():
    """The bytes as a shell passes them, through a fresh interpreter."""
    r = subprocess.run([sys.executable, "-m", "fibattn.cli", "generate", "RUN", "--prompt", b"a\xff"],
                       capture_output=True, timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and len(err.strip().splitlines()) == 1 and "not UTF-8" in err, err


def test_a_name_read_from_the_system_that_is_not_utf8_is_one_line_not_a_bug():
    """The safety net behind the argument check: a file name found on disk (a folder listing, the working
    folder) that cannot be written as UTF-8 is a one-line refusal, never an internal error."""
    try:
        "run-\udcff".encode("utf-8")
    except UnicodeEncodeError as exc:
        code, line = entry.error_line(exc)
    assert code == 2 and "run-\\xff" in line and "not UTF-8" in line
    assert entry.shown("x\udcff\ud800") == "x\\xff\\ud800"
    assert entry.error_line(ValueError("a bug")) is None


# ----------------------------------------------------------------------------- the device (kind 7, item 1)
NO_CUDA = [
    ["bench", "attention", "--device", "cuda"],          # with its defaults: the device, not another flag
    ["bench", "attention", "--device", "cuda:1", "--paths", "integer-docs", "--documents", "0"],
    ["bench", "train", "--device", "cuda"],
    ["bench", "generate", "--device", "cuda"],
    ["train", "--device", "cuda", "--out", "{O}"],
    ["train", "--set", "train.device=cuda:0", "--out", "{O}"],
    ["eval", "{O}", "--device", "cuda"],
    ["generate", "{O}", "--prompt", "x", "--device", "cuda:0"],
    ["probe", "--device", "cuda", "--out", "{O}"],
    ["demo", "--device", "cuda", "--root", "{O}"],
]


@pytest.mark.parametrize("argv", NO_CUDA, ids=[" ".join(a[:3]) for a in NO_CUDA])
def test_cuda_asked_for_without_cuda_is_one_line_naming_the_torch_build(capsys, monkeypatch, tmp_path, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = one_line(capsys, [a.format(O=tmp_path / "o") for a in argv])
    assert "CUDA is not available here" in line and f"torch {torch.__version__}" in line, line
    assert not (tmp_path / "o").exists()


def test_bench_attention_runs_with_its_cuda_defaults(monkeypatch):
    """The defaults the README names (``--device cuda``, nothing else) make a config: every path, the -docs ones
    with their default documents per row."""
    from fibattn import devices
    from fibattn.bench import attention_args as aa
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "device_memory_bytes", lambda device: 80 * 2 ** 30)
    p = argparse.ArgumentParser()
    aa.configure_parser(p)
    cfg = aa.config_from_args(p.parse_args(["--device", "cuda"]))
    assert cfg.documents == aa.DEFAULT_DOCUMENTS and {"integer-docs", "interpolated-docs"} <= set(cfg.paths)
    assert cfg.device == "cuda" and cfg.lengths and cfg.forward_lengths == [131072]
    off = aa.config_from_args(p.parse_args(["--device", "cuda", "--documents", "0"]))
    assert off.documents == 0 and not {"integer-docs", "interpolated-docs"} & set(off.paths)
    with pytest.raises(UsageError, match="default of 4 documents per row is more than the 2 tokens"):
        aa.config_from_args(p.parse_args(["--device", "cuda", "--lengths", "2", "--forward-lengths", ""]))


# ----------------------------------------------------------------------------- lm-eval's entry point (kind 12)
def test_the_lm_eval_wrapper_prints_a_users_mistake_as_one_line(monkeypatch, capsys, tmp_path):
    pytest.importorskip("lm_eval")
    import lm_eval.__main__ as lm_main
    from fibattn.interop import lm_eval_adapter as adapter
    mistakes = [dict(path=str(tmp_path / "missing")), dict(path=str(tmp_path), max_lenght=8), dict()]
    for kwargs in mistakes:                  # what lm-eval does with --model_args: build the model
        monkeypatch.setattr(lm_main, "cli_evaluate", lambda kw=kwargs: adapter.FibattnLM(device="cpu", **kw))
        assert adapter.main(["--model", "fibattn"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fibattn lm-eval: error: ") and "Traceback" not in err[0], err
    assert adapter.main(["--model", "fibattn", "--model_args", f"path={BAD}"]) == 2
    assert "not UTF-8" in capsys.readouterr().err

    def bug():
        raise KeyError("a bug")
    monkeypatch.setattr(lm_main, "cli_evaluate", bug)
    with pytest.raises(KeyError):            # a bug keeps its traceback
        adapter.main([])


# ----------------------------------------------------------------------------- impossible figures (kind 16)
@settings(max_examples=200, deadline=None)
@given(st.floats(1, 1e4), st.floats(1, 1e4), st.floats(1, 1e4), st.floats(0, 1e3), st.booleans())
def test_the_host_overhead_line_never_shows_a_negative_time(public, bare, direct, spread, cold):
    from fibattn.bench.host_overhead import HostOverhead
    res = HostOverhead("integer", public, direct, public - direct, bare - direct, cold, spread)
    line, rec = res.line(), res.record()
    assert not re.search(r"-\d", line), line
    assert res.noisy == (min(public - direct, bare - direct, public - bare) < 0)
    if res.noisy:
        assert "too noisy" in line and rec["too_noisy"] and rec["overhead_us"] is None and rec["fibattn_us"] is None
    else:
        assert all(rec[k] >= 0 for k in ("overhead_us", "autograd_us", "fibattn_us"))


# ----------------------------------------------------------------------------- plots and exports (issue 60 item 8)
def test_a_model_keeps_its_colour_in_every_panel_of_a_figure(tmp_path, monkeypatch):
    """The perplexity figure's second panel leaves dense out: the other models must not change colour."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    from fibattn import plots
    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: (drawn.append((k["label"], k["color"])),
                                                                              real(self, *a, **k))[1])
    series = [plots.Series(name, [1, 2], [1.0, 2.0]) for name in ("dense", "fib fixed", "fib linear")]
    plots.save_panels(tmp_path / "p.png", [plots.Panel("all", "x", "y", series),
                                           plots.Panel("no dense", "x", "y", series[1:])])
    by_label: dict = {}
    for label, colour in drawn:
        by_label.setdefault(label, set()).add(tuple(colour))
    assert len(drawn) == 5 and all(len(c) == 1 for c in by_label.values())
    assert len({next(iter(c)) for c in by_label.values()}) == 3


def test_a_one_file_hf_export_prints_no_progress_bar_and_restores_the_setting():
    transformers = pytest.importorskip("transformers")
    from fibattn.interop.hf_export import _no_progress_bar
    tl = transformers.utils.logging
    tl.enable_progress_bar()
    with _no_progress_bar(transformers):
        assert not tl.is_progress_bar_enabled()
    assert tl.is_progress_bar_enabled()


def test_an_output_path_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """A plain argument in a working folder whose name is not UTF-8: the output's absolute path is what fibattn
    records (config.json, the results database), so it is refused by the output check, naming the flag."""
    odd = tmp_path / "w\udcff"
    odd.mkdir()
    monkeypatch.chdir(odd)
    for argv, flag in ((["train", "--out", "run", "--set", "train.steps=1"], "--out (train.out_dir)"),
                       (["prepare", "--files", str(tmp_path), "--out", "d"], "--out"),
                       (["export", str(tmp_path / "none"), "e"], "OUT")):
        line = one_line(capsys, argv)
        assert flag in line and "w\\xff" in line and "not UTF-8" in line, line
    assert list(odd.iterdir()) == []
