"""``tools/gpu_check.py`` keeps running where no GPU is: its ``--quick`` plumbing on the CPU
(the attention bench's records, issue 29's CPU step and the static model's step, with the
summary's goals), so that the script a lent device runs has not gone stale by the time one is lent."""
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def quick_summary(tmp_path, only):
    """Runs ``gpu_check.py --quick --only ONLY`` (compiled, not interpreted) and returns its summary, errors
    refused."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--quick", "--only", only,
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary.get("errors"), summary.get("errors")
    return summary


def test_quick_check_runs_on_cpu(tmp_path):
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton without its NVIDIA backend")
    summary = quick_summary(tmp_path, "attention,cpu,static")
    assert {s["status"] for s in summary["steps"].values()} == {"ok"}, summary["steps"]
    paths = {x["path"] for x in summary["attention"]["records"]}
    assert {"dense", "integer", "interpolated"} <= paths, paths
    static = summary["static_model"]
    assert set(static["estimate_ms"]) == {"4096", "16384", "65536"} and static["measured_ms"]
    assert summary["goals"]["interpolated/integer (worst length)"]["measured"] > 0
    assert summary["goals"]["dense/integer fwd+bwd at 65536"]["goal"] == ">= 60.0"
    cpu, ratios = summary["cpu"], summary["ratios"]
    assert {x["path"] for x in cpu["records"]} == {"integer", "interpolated"}
    assert [(c["T"], c["op"]) for c in cpu["kernel_checks"]] == [(256, "integer"), (256, "interpolated")]
    assert "avx512f" in cpu and cpu["cores"] >= 1
    if platform.machine() == "x86_64" and shutil.which("objdump"):          # the compiled code's figures beside them
        assert cpu["static"]["forward"]["all"]["fmas"] > 0
    for key in ("cpu interpolated/integer fwd+bwd", "cpu integer share of the matmul peak",
                "cpu interpolated kernels alone: far columns' cost", "cpu integer kernels alone: Hkv 2 / Hkv = H"):
        assert ratios[f"{key} at 256"] > 0, key
    assert summary["goals"]["cpu integer share of the matmul peak at 4096"]["goal"] == ">= 0.3"
    assert summary["goals"]["cpu interpolated/integer fwd+bwd at 16384"]["goal"] == "<= 1.4"


@pytest.mark.slow
def test_quick_train_bench_step_runs_on_cpu(tmp_path):
    """Issue 54's step: both models compiled (inductor, on the CPU here), tok/s, sparse/dense and the compile
    time cold, then warm from the same inductor cache in a second process (a minute of compiling on two cores:
    the default suite runs the step's plumbing below)."""
    summary = quick_summary(tmp_path, "train_bench")
    assert [s["status"] for s in summary["steps"].values()] == ["ok", "ok"], summary["steps"]
    row = summary["train_bench"][0]
    assert row["compiled"] is True and row["ratio"] > 0 and row["dense_warmup_s"] > 0
    goals = summary["goals"]
    assert goals["train compile s cold (worst variant)"]["measured"] > 0
    assert goals["train compile s warm (worst variant)"]["measured"] > 0
    assert goals["train compiled sparse/dense at 16384"]["goal"] == ">= 3.0"
    assert summary["ratios"]["train compiled sparse/dense at 64"] > 0


def test_the_train_bench_step_asks_what_the_bench_takes_and_reads_what_it_writes(tmp_path, monkeypatch, capsys):
    """Issue 54's step without compiling: both of its runs go through fibattn's own command line in this process,
    the models faked (``bench_fakes``), and the step turns the bench's own JSON into its goals' numbers."""
    from bench_fakes import fake_train
    from fibattn.cli import main as cli_main
    fake_train(monkeypatch, {"dense_compiled": 2.0, "sparse_compiled": 1.0})
    calls = []

    class Stub:
        quick, device, out = True, "cpu", tmp_path

        def run(self, name, cmd, limit, env=None):
            calls.append((name, env))
            assert cli_main(cmd[3:]) == 0           # after "python -m fibattn.cli"
            return capsys.readouterr().out

    summary, tool = {}, _tool()
    tool.train_bench(Stub(), summary)
    assert [n for n, _ in calls] == ["bench_train", "bench_train_warm"]
    assert {e["TORCHINDUCTOR_CACHE_DIR"] for _, e in calls} == {str(tmp_path / "inductor_cache")}   # warm: the same
    row = summary["train_bench"][0]
    assert row["compiled"] is True and row["ratio"] == pytest.approx(2.0)
    ratios = summary["ratios"]
    assert ratios["train compiled sparse/dense at 64"] == pytest.approx(2.0)
    assert ratios["train compile s cold (worst variant)"] > 0 and ratios["train compile s warm (worst variant)"] > 0
    goals = tool.verdicts(summary, quick=True)
    assert goals["train compiled sparse/dense at 16384"]["goal"] == ">= 3.0"
    assert goals["train compile s warm (worst variant)"]["measured"] == ratios["train compile s warm (worst variant)"]


def test_quick_generate_step_runs_on_cpu(tmp_path):
    """Issue 55's step: the four decode runs (contexts, the long one, the compiled step at batch 1 and 64; static
    in --quick) and prefill, each giving its goal's number."""
    summary = quick_summary(tmp_path, "generate")
    assert list(summary["steps"]) == ["bench_generate", "bench_generate_prefill", "bench_generate_long",
                                      "bench_generate_compiled", "bench_generate_batch64", "bench_hf_generate"]
    assert all(s["status"] == "ok" for s in summary["steps"].values()), summary["steps"]
    goals = summary["goals"]
    for key in ("decode sparse tok/s batch 1 (worst context and variant)", "decode sparse tok/s batch 64 (worst "
                "variant)"):
        assert goals[key]["measured"] > 0
    assert goals["decode sparse tok/s batch 64 (worst variant)"]["goal"] == ">= 30000.0"
    batch = summary["generate"]["bench_generate_batch64"]["settings"]
    assert batch["batch"] == 64 and batch["decode"] == "static"
    prefill = [x for x in summary["generate"]["bench_generate_prefill"]["results"] if "prefill_s" in x]
    assert {x["variant"] for x in prefill} == {"dense", "static"} and all(x["prefill_s"] > 0 for x in prefill)
    assert goals["prefill dense/sparse at 16384"]["goal"] == ">= 3.0"
    (hf,) = summary["generate"]["bench_hf_generate"]["results"]
    assert hf["tokens_equal"] and summary["ratios"]["fibattn / transformers export decode at 64"] > 0


def test_quick_op_step_runs_on_cpu(tmp_path):
    """Issues 54 / 56: the op timed beside dense (wall time on the CPU; graph replay on CUDA), its backward over its
    forward, and the host's time per call, each giving its goal's number (not judged in --quick)."""
    summary = quick_summary(tmp_path, "op")
    assert [s["status"] for s in summary["steps"].values()] == ["ok"], summary["steps"]
    ratios, goals = summary["ratios"], summary["goals"]
    for key in ("op dense/integer fwd+bwd at 256", "op interpolated/integer (worst length)",
                "op documents/integer (worst length)", "op host us per eager fwd+bwd (integer)",
                "op integer backward/forward at 256", "op interpolated backward/forward at 256"):
        assert ratios[key] > 0, key
    assert goals["op integer backward/forward at 4096"]["goal"] == "<= 3.0"
    assert goals["op host us per eager fwd+bwd (integer)"]["goal"] == "<= 60.0"
    assert goals["op dense/integer fwd+bwd at 65536"]["goal"] == ">= 70.0"
    assert goals["op interpolated/integer (worst length)"]["judged"] is False


# ----------------------------------------------------------------------------- refusals and verdicts (kind 8)
def _tool():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check_tool", ROOT / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, needle", [
    (["--budget", "0"], "--budget"), (["--budget", "-5"], "--budget"), (["--budget", "nan"], "--budget"),
    (["--budget", "inf"], "--budget"), (["--budget", "1e30"], "--budget"), (["--budget", "5", "--quick"], "--budget"),
    (["--only", "nothing", "--quick"], "--only"), (["--only", ",", "--quick"], "--only"),
    (["--quick", "--out", "{F}/sub"], "--out"), (["--quick", "--out", "{F}"], "--out"),
    ([], "no CUDA device here"), (["--quick", "--bud", "100"], "unrecognized arguments: --bud"),
    (["--quick", "--budget", "soon"], "--budget"),
])
def test_the_gpu_check_refuses_up_front_in_one_line(tmp_path, capsys, monkeypatch, argv, needle):
    """Without CUDA (unless --quick), with a budget no step fits in, an unknown step or an output folder it cannot
    write: one line, exit 2, nothing written."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "afile").write_text("x")
    tool = _tool()
    out = tmp_path / "out"
    args = [a.format(F=tmp_path / "afile") for a in argv]
    rc = tool.main(args + ([] if "--out" in args else ["--out", str(out)]))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0] and err[0].startswith("gpu_check: error: "), err
    assert not out.exists()
    if not argv:
        assert f"torch {torch.__version__}" in err[0] and "--quick" in err[0]


def test_quick_goals_are_not_judged_and_skipped_steps_are_never_passed():
    tool = _tool()
    summary = {"ratios": {"dense/integer fwd+bwd at 4096": 5.31, "interpolated/integer (worst length)": 9.0}}
    full, quick = tool.verdicts(summary), tool.verdicts(summary, quick=True)
    assert full["dense/integer fwd+bwd at 4096"]["met"] is True
    assert full["interpolated/integer (worst length)"]["met"] is False
    for key in summary["ratios"]:
        assert quick[key]["met"] is None and quick[key]["judged"] is False and "not judged" in quick[key]["why"]
        assert quick[key]["measured"] == summary["ratios"][key]
    assert all(v["met"] is None for k, v in quick.items() if k not in summary["ratios"])
    skipped = {"a": {"status": "skipped"}, "b": {"status": "skipped"}}
    assert tool.outcome(skipped, {})["exit"] == 1 and "nothing was measured" in tool.outcome(skipped, {})["line"]
    assert tool.outcome({"a": {"status": "ok"}, "b": {"status": "skipped"}}, {})["exit"] == 0
    assert tool.outcome({"a": {"status": "ok"}, "b": {"status": "failed"}}, {})["exit"] == 1
    assert tool.outcome({"a": {"status": "ok"}}, {"errors": {"x": "KeyError"}})["exit"] == 1


def test_gpu_tests_that_were_skipped_are_not_counted_as_passed(tmp_path, monkeypatch):
    """The tests step: pytest exits 0 when every GPU test is skipped (no CUDA); the summary says skipped."""
    tool = _tool()
    r = tool.Runner(tmp_path, 600, quick=True)

    def fake_run(name, cmd, limit, env=None):
        (tmp_path / "tests.log").write_text("12 skipped, 3 deselected in 1.0s")
        r.steps[name] = {"status": "ok", "rc": 0, "seconds": 1.0}
        return "12 skipped"
    monkeypatch.setattr(r, "run", fake_run)
    summary: dict = {}
    tool.tests(r, summary)
    assert summary["tests"]["passed_all"] is False and summary["tests"]["skipped"] == 12
    assert r.steps["tests"]["status"] == "skipped" and tool.outcome(r.steps, summary)["exit"] == 1


def test_the_sweep_step_asks_for_what_the_cli_and_the_backend_take(monkeypatch):
    """The sweep's seven runs (seven processes; not run here): each command is one fibattn's own parser takes,
    each setting one ``triton_config.config`` takes (the rung choices' other candidates and one pipeline stage
    among them), and each record carries its settings."""
    from fibattn.cli import build_parser
    from fibattn.ops import triton_config
    calls = []

    class Stub:
        quick, device = False, "cuda"

        def run(self, name, cmd, limit, env=None):
            calls.append((name, cmd, env))
            return '{"path": "integer", "ms": 1.0}\n'

    summary = {}
    _tool().sweep(Stub(), summary)
    assert len(calls) == len(summary["sweep"]) == 8 and len({name for name, _, _ in calls}) == 8
    for name, cmd, env in calls:
        assert build_parser().parse_args(cmd[3:]).lengths == "16384"          # after "python -m fibattn.cli"
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        cfg = triton_config.config(4, 64, 12)
        assert (cfg["BLOCK_M"], cfg["num_warps"]) == (int(env["FIBATTN_TRITON_BLOCK_M"]),
                                                      int(env["FIBATTN_TRITON_WARPS"]))
        assert set(env) <= set(triton_config.SETTINGS)
        for key in env:
            monkeypatch.delenv(key)
    one_chunk = [x for x in summary["sweep"] if x.get("FIBATTN_TRITON_RUNG_CHUNK") == "16"]
    one_rung = [x for x in one_chunk if x.get("FIBATTN_TRITON_RUNG_STEP") == "1"]
    one_stage = [x for x in summary["sweep"] if x.get("FIBATTN_TRITON_STAGES") == "1"]
    assert len(one_chunk) == 2 and len(one_rung) == len(one_stage) == 1
    for key, value in {**one_rung[0], **one_stage[0]}.items():
        if key.startswith("FIBATTN_TRITON_") and key not in ("FIBATTN_TRITON_BLOCK_M", "FIBATTN_TRITON_WARPS"):
            monkeypatch.setenv(key, value)
    cfg = triton_config.config(4, 64, 12)
    assert (cfg["RUNGS"], cfg["RB_KEY_PASS"], cfg["num_stages"]) == (((16, 1),), ((1, 0),), 1)
    monkeypatch.delenv("FIBATTN_TRITON_RUNG_STEP")
    assert triton_config.config(4, 64, 12)["RUNGS"] == ((16, 2), (16, 1))       # the other one-chunk row


def test_the_ablation_step_leaves_one_stage_out_each(monkeypatch):
    """Issue 56 item 3's step (four processes; not run here): the integer op at 64K as it is, with the band alone,
    the rungs alone and P·V without the hi + lo split — each command one that fibattn's own bench takes (its
    distance set checked: one rung inside the window, a window of 0), each setting one the backend reads, and
    each variant's time given as a share of the default's."""
    from fibattn.bench.attention_args import config_from_args
    from fibattn.cli import build_parser
    from fibattn.ops import triton_config
    from fibattn.schedules import attended_distances
    calls = []

    class Stub:
        quick, device = False, "cuda"

        def run(self, name, cmd, limit, env=None):
            calls.append((name, cmd, env))
            return '{"path": "integer", "ms": %d.0, "gb_s": 1.0}\n' % (len(calls) + 1)

    summary = {}
    _tool().ablation(Stub(), summary)
    assert [n for n, _, _ in calls] == ["ablation_default", "ablation_band_only", "ablation_rungs_only",
                                        "ablation_no_hi_lo_split"]
    for (name, cmd, env), rec in zip(calls, summary["ablation"]["records"]):
        args = build_parser().parse_args(cmd[3:])
        args.device = "cpu"
        cfg = config_from_args(args)
        assert cfg.lengths == [65536] and cfg.paths == ["integer"] and cfg.alpha == 1.5
        dists = attended_distances(cfg.window, cfg.alpha, f"fib:{cfg.fib_k}", 65536)
        assert (rec["band"], rec["rungs"]) == (cfg.window + 1, len([d for d in dists if d > cfg.window]))
        assert set(env) <= set(triton_config.SETTINGS)
    assert [(x["band"], x["rungs"]) for x in summary["ablation"]["records"]] == [(13, 10), (13, 0), (1, 15), (13, 10)]
    monkeypatch.setenv("FIBATTN_TRITON_SPLIT_P", calls[3][2]["FIBATTN_TRITON_SPLIT_P"])
    assert triton_config.config(4, 64, 12)["SPLIT_P"] == 0
    assert summary["ablation"]["share_of_default"] == {"default": 1.0, "band only": 1.5, "rungs only": 2.0,
                                                       "no hi/lo split": 2.5}
