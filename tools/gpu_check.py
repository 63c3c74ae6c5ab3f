"""The GPU check: everything fibattn claims on CUDA, measured in one run on one machine.

    python3 tools/gpu_check.py [--out DIR] [--budget SECONDS] [--quick]

Steps, in order of priority (each with its own time limit; when the budget runs low the
remaining steps are skipped and say so):

1. ``pytest -m gpu``: every backend against ``reference`` on CUDA (outputs and gradients,
   bf16 tolerances), the compiled FibLM, no recompile when only T changes;
2. ``fibattn bench attention --device cuda --json`` (B=4, H=8, Hkv=2, Dh=64, bf16;
   T = 1K … 64K fwd+bwd, 128K forward) and FlexAttention at 4K;
3. ``fibattn bench op --device cuda --json`` (T = 4K, 16K, 64K): the op's forward + backward replayed from a
   CUDA graph (the device's time) and eager, beside the best dense SDPA kernel; the host's µs per eager call;
   then ``fibattn bench train --device cuda --preset paper --compiled-only --json`` (T = 1024, 4096, 16384):
   tok/s, MFU, peak memory, sparse ÷ dense, compile time cold, then warm from the same inductor cache;
4. a 200-step training run of the paper model shape, dense and fib-linear (W=12), on
   the bundled corpus (byte tokens, the paper's 32768-entry embedding): tok/s and loss;
5. ``fibattn bench generate --device cuda --shapes paper --json``: the captured static decode step at
   contexts 1K / 16K / 64K (every variant) and 1M (sparse), the compiled step at 16K with batch 1 and 64, the
   compiled, chunked prefill at 4K / 16K / 64K (dense and static): tokens/s against issue 55's goals; and
   ``fibattn bench hf-generate``: the transformers remote-code export's ``generate()`` beside fibattn's;
6. issue 29's CPU goals on this machine's own CPU (a GPU host's is likely to have AVX-512, the
   cpu kernels' other vector width, which no CPU-only session has measured): ``fibattn bench
   attention --device cpu`` on 2 threads (fp32, B=1, H=8, Dh=64; T = 4K, 16K): the share of the
   matmul peak, interpolated ÷ integer, grouped heads;
7. a sweep of ``FIBATTN_TRITON_BLOCK_M`` / ``FIBATTN_TRITON_WARPS`` (and the rungs in one chunk of the tile, at
   two rungs a step and at one, and one pipeline stage) at T=16384;
8. ``tools/gpu_static.py --json``: the static H200 model's estimate (compiled code, no device)
   next to the measured forward + backward times, as measured ÷ estimated per length;
9. what limits the integer op's memory traffic at 64K (issue 56 item 3): its time with one stage left out —
   the band alone, the rungs alone, P·V without the probabilities' hi + lo split — beside the default.

Writes every step's log and ``summary.json`` (goals with their measured ratios) to
``--out`` (default ``$OUT`` or ``gpu_check_out``). Needs only the repository and a
Python with torch (CUDA) and triton: it runs from ``src/`` without installing.
``--quick`` shrinks every step to a plumbing check (it also runs on a CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))      # its steps' module, also when loaded from a file
from gpu_check_steps import _fibattn, _json_lines, generate, op, train_bench  # noqa: E402
GOALS = {  # issues 11 and 22: ratios measured side by side on the H200 (bf16, B=4, H=8, Hkv=2, Dh=64)
    "dense/integer fwd+bwd at 4096": 2.0, "dense/integer fwd+bwd at 16384": 10.0,
    "dense/integer fwd+bwd at 65536": 60.0, "torch/integer fwd+bwd at 4096": 10.0,
    "flex/integer fwd+bwd at 4096": 3.0, "integer GB/s / copy GB/s at 65536": 0.40,
    # issue 54: the paper model compiled, dense on its fastest SDPA backend; thousands of tokens/s
    "train compiled sparse/dense at 1024": 1.1, "train compiled sparse/dense at 4096": 1.4,
    "train compiled sparse/dense at 16384": 3.0, "train compiled sparse ktok/s at 1024": 800.0,
    "train compiled sparse ktok/s at 4096": 700.0,
}
GOALS.update({"op dense/integer fwd+bwd at 4096": 2.0, "op dense/integer fwd+bwd at 16384": 15.0,  # issue 56,
              "op dense/integer fwd+bwd at 65536": 70.0})                 # CUDA-graph replay, dense on its best
GOALS.update({"decode sparse tok/s batch 1 (worst context and variant)": 1000.0,   # issue 55
              "decode sparse tok/s batch 64 (worst variant)": 30000.0,
              "prefill dense/sparse at 4096": 1.2, "prefill dense/sparse at 16384": 3.0})
MAX_GOALS = {"op interpolated/integer (worst length)": 1.4, "op documents/integer (worst length)": 1.1,
             "op integer backward/forward at 4096": 3.0,                  # issue 56 item 1
             "op host us per eager fwd+bwd (integer)": 60.0, "op graph ms / static estimate at 4096": 1.5,
             "prefill sparse ms at 16384": 8.0, "interpolated/integer (worst length)": 1.5,
             "train compile s cold (worst variant)": 90.0, "train compile s warm (worst variant)": 15.0}
CPU_LENGTHS = (4096, 16384)      # issue 29: fp32, B=1, H=Hkv=8, Dh=64, 2 threads, on the host's CPU
for _T in CPU_LENGTHS:
    GOALS[f"cpu integer share of the matmul peak at {_T}"] = 0.30
    MAX_GOALS[f"cpu interpolated/integer fwd+bwd at {_T}"] = 1.4


class Runner:
    def __init__(self, out: Path, budget: float, quick: bool):
        self.out, self.deadline, self.quick = out, time.monotonic() + budget, quick
        self.device = "cuda" if _cuda() or not quick else "cpu"     # --quick also runs on a CPU
        self.steps: dict = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], limit: float, env: dict | None = None) -> str | None:
        """Run ``cmd`` with its output in ``OUT/name.log``; its stdout, or None when skipped or failed."""
        limit = min(limit, self.left() - 5)
        if limit < 20:
            self.steps[name] = {"status": "skipped", "why": "time budget used up"}
            print(f"== {name}: skipped (budget)", flush=True)
            return None
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        log = self.out / f"{name}.log"
        try:
            res = subprocess.run(cmd, cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True, text=True,
                                 timeout=limit)
            rc, stdout, stderr = res.returncode, res.stdout, res.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = "timeout", _text(exc.stdout), _text(exc.stderr)
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
        secs = round(time.monotonic() - t0, 1)
        self.steps[name] = {"status": "ok" if rc == 0 else "failed", "rc": rc, "seconds": secs}
        print(f"   {name}: rc={rc} in {secs}s", flush=True)
        if rc != 0:
            print("\n".join((stdout + stderr).strip().splitlines()[-15:]), flush=True)
        return stdout if rc == 0 else None


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


# ----------------------------------------------------------------------------- steps
def tests(r: Runner, summary: dict) -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE",
           "tests/test_ops_triton.py", "tests/test_compile.py", "tests/test_ops.py", "tests/test_triton_ops.py",
           "tests/test_reliability_ops.py"]
    try:
        import xdist  # noqa: F401
        cmd += ["-n", "8"]            # kernel compilation dominates: compile in parallel
    except ImportError:
        pass
    out = r.run("tests", cmd, 240)
    text = (r.out / "tests.log").read_text() if (r.out / "tests.log").exists() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
    # passed only when tests ran and none failed or was skipped: a GPU test skipped (no CUDA) proves nothing
    summary["tests"] = {"passed_all": out is not None and counts.get("passed", 0) > 0 and not counts.get("skipped"),
                        **counts}
    if out is not None and counts.get("skipped"):
        r.steps["tests"].update(status="skipped" if not counts.get("passed") else "partly skipped",
                                why=f"{counts['skipped']} test(s) skipped (no CUDA device?)")


def attention(r: Runner, summary: dict) -> None:
    main = ["bench", "attention", "--device", r.device, "--json", "--repeats", "3",
            "--paths", "dense,mask,torch,integer,interpolated"]
    if r.quick:      # the memory workers (a process per path) are tests/test_bench.py's, not 20 s of this check's
        main += ["--lengths", "256", "--forward-lengths", "512", "--repeats", "1", "--no-memory"]
    recs = _json_lines(r.run("bench_attention", _fibattn(*main), 300))
    flex = ["bench", "attention", "--device", r.device, "--json", "--paths", "flex,integer", "--no-memory",
            "--lengths", "256" if r.quick else "4096", "--forward-lengths", ""]
    recs += [x for x in _json_lines(r.run("bench_attention_flex", _fibattn(*flex), 240))
             if x.get("path") == "flex"]
    copy = [x["gb_s"] for x in recs if x.get("check") == "copy"]
    rows = [x for x in recs if "path" in x]
    summary["attention"] = {"copy_gb_s": copy[0] if copy else None, "records": rows}
    ms = {(x["T"], x["mode"], x["path"]): x["ms"] for x in rows if x.get("ms")}
    ratios = summary.setdefault("ratios", {})
    for (T, mode, path), t in ms.items():
        ours = ms.get((T, mode, "integer"))
        if ours and path != "integer":
            ratios[f"{path}/integer {mode} at {T}"] = t / ours
    interp = [v for k, v in ratios.items() if k.startswith("interpolated/integer")]
    if interp:
        ratios["interpolated/integer (worst length)"] = max(interp)
    for x in rows:
        if x["path"] == "integer" and x.get("gb_s") and copy and x["mode"] == "fwd+bwd":
            ratios[f"integer GB/s / copy GB/s at {x['T']}"] = x["gb_s"] / copy[0]


def training(r: Runner, summary: dict) -> None:
    """200 steps of the paper model shape on the bundled corpus, dense and fib-linear."""
    data = r.out / "data"
    if r.run("prepare", _fibattn("prepare", "--preset", "tiny", "--out", str(data), "--quiet"), 120) is None:
        return
    steps = 3 if r.quick else 200
    shape = ["model.vocab_size=32768", "model.d_model=512", "model.n_layers=16", "model.n_heads=8",
             "model.n_kv_heads=2", "model.seq_len=1024", "model.window=12", "model.base_k=15",
             f"train.steps={steps}", "train.batch_tokens=32768", "train.micro_batch=8", "train.lr=3e-4",
             f"train.warmup_steps={min(20, steps)}", f"train.log_every={1 if r.quick else 10}", "train.eval_every=0",
             "train.eval_tokens=65536", f"train.ckpt_every={steps}", "train.results_db=off",
             f"data.out_dir={data}", f"train.device={r.device}"]
    if r.quick:
        shape += ["model.d_model=64", "model.n_layers=2", "model.seq_len=128", "train.batch_tokens=1024",
                  "train.micro_batch=8", "model.vocab_size=256"]
    result = {}
    for name, extra in (("dense", ["model.attention=dense"]),
                        ("fib_linear", ["model.attention=sparse", "model.schedule=linear"])):
        run_dir = r.out / "runs" / name
        sets = [x for kv in shape + extra for x in ("--set", kv)]
        if r.run(f"train_{name}", _fibattn("train", "--preset", "tiny", *sets, "--out", str(run_dir)), 200) is None:
            continue
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        tok = [m["tok_s"] for m in metrics if "tok_s" in m][1:]       # the first window holds the warm-up
        loss = [m["loss"] for m in metrics if "loss" in m]
        result[name] = {"tok_s_median": sorted(tok)[len(tok) // 2] if tok else None,
                        "first_loss": loss[0] if loss else None, "final_loss": loss[-1] if loss else None,
                        "steps": steps}
    summary["training"] = result
    if result.get("dense", {}).get("tok_s_median") and result.get("fib_linear", {}).get("tok_s_median"):
        summary.setdefault("ratios", {})["training run sparse/dense tok/s"] = (
            result["fib_linear"]["tok_s_median"] / result["dense"]["tok_s_median"])


# (BLOCK_M, warps, maxnreg, other settings), the default first. Then what the model cannot settle, checked on the
# card: the rungs in one chunk of the tile (the kernels before rung chunks: triton_config.rung_chunk), the same at one
# rung a step in the query and key passes, the key pass's blocks placed by selects (the other candidates of
# triton_occupancy's choices), and one
# software-pipeline stage (7-16 % fewer instructions, the loads' latency bare). 168 registers: 3 programs per SM.
SWEEP = ((16, 4, 0, {}), (16, 4, 0, {"FIBATTN_TRITON_RUNG_CHUNK": "16"}),
         (16, 4, 0, {"FIBATTN_TRITON_RUNG_CHUNK": "16", "FIBATTN_TRITON_RUNG_STEP": "1",
                     "FIBATTN_TRITON_RB_KEY_PASS": "1", "FIBATTN_TRITON_KEY_PASS_PRODUCTS": "0"}),
         (16, 4, 0, {"FIBATTN_TRITON_STAGES": "1"}), (16, 4, 168, {}), (16, 8, 0, {}), (32, 4, 0, {}), (32, 8, 0, {}))


def sweep(r: Runner, summary: dict) -> None:
    """Block rows x warps (and the settings in :data:`SWEEP`'s comment) at T=16384: the data for choosing
    ``triton_config.config`` on this GPU."""
    T = "256" if r.quick else "16384"
    results = []
    for bm, warps, regs, extra in SWEEP:
        env = {"FIBATTN_TRITON_BLOCK_M": str(bm), "FIBATTN_TRITON_WARPS": str(warps),
               "FIBATTN_TRITON_MAXNREG": str(regs), **extra}       # 168: 3 programs per SM
        name = f"sweep_m{bm}_w{warps}_r{regs}" + "".join(f"_{k.removeprefix('FIBATTN_TRITON_').lower()}{v}"
                                                           for k, v in extra.items())
        out = r.run(name, _fibattn("bench", "attention", "--device", r.device, "--json", "--paths",
                                   "integer,interpolated", "--no-memory", "--lengths", T, "--forward-lengths", ""),
                    60, env)
        for x in _json_lines(out):
            if "path" in x:
                results.append({"BLOCK_M": bm, "num_warps": warps, "maxnreg": regs, **extra, "path": x["path"],
                                "ms": x["ms"]})
    summary["sweep"] = results


# (label, window, Fibonacci rungs K, settings): the integer op with one stage left out. One Fibonacci number's
# distance (round(1.5) = 2) lies inside the window: the band alone; a window of 0 leaves distance 0 and rungs only
# (15 of them: the distances 2..12 become rungs too; each record carries its band and rung counts)
ABLATION = (("default", 12, 15, {}), ("band only", 12, 1, {}), ("rungs only", 0, 15, {}),
            ("no hi/lo split", 12, 15, {"FIBATTN_TRITON_SPLIT_P": "0"}))


def ablation(r: Runner, summary: dict) -> None:
    """Issue 56 item 3: the integer op at T=65536 with one stage left out (:data:`ABLATION`), each variant's time,
    traffic and columns, and its time as a share of the default's."""
    sys.path.insert(0, str(ROOT / "src"))
    from fibattn.schedules import attended_distances
    T = 256 if r.quick else 65536
    rows = []
    for label, window, k, env in ABLATION:
        name = "ablation_" + re.sub(r"\W+", "_", label).strip("_")
        out = r.run(name, _fibattn("bench", "attention", "--device", r.device, "--json", "--paths", "integer",
                                   "--no-memory", "--lengths", str(T), "--forward-lengths", "", "--window",
                                   str(window), "--fib-k", str(k)), 90, env)
        dists = attended_distances(window, 1.5, f"fib:{k}", T)
        rows += [{"variant": label, "ms": x["ms"], "gb_s": x.get("gb_s"), "band": window + 1,
                  "rungs": sum(1 for d in dists if d > window)} for x in _json_lines(out)
                 if x.get("path") == "integer" and x.get("ms")]
    base = next((x["ms"] for x in rows if x["variant"] == "default"), None)
    summary["ablation"] = {"T": T, "records": rows,
                           "share_of_default": {x["variant"]: x["ms"] / base for x in rows} if base else {}}


def cpu_flags() -> dict:
    """The host CPU's model and the vector extensions the cpu kernels can use (the flags as the cpu
    backend reads them for its build; Linux, else no model and no flags)."""
    sys.path.insert(0, str(ROOT / "src"))
    from fibattn.devices import cpu_flags as cpuinfo_flags
    flags = set(cpuinfo_flags().partition(":")[2].split())
    try:
        model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        model = None
    return {"model": model.group(1).strip() if model else None, "cores": os.cpu_count(),
            **{f: f in flags for f in ("avx2", "fma", "avx512f", "amx_tile")}}


def cpu(r: Runner, summary: dict) -> None:
    """Issue 29's goals measured on this machine's CPU, on 2 threads as they were set."""
    sys.path.insert(0, str(ROOT / "src"))
    from fibattn.bench.attention_flops import round_ratio        # the bench's own ratio of two paths
    lengths = "256" if r.quick else ",".join(map(str, CPU_LENGTHS))
    args = ["bench", "attention", "--device", "cpu", "--json", "--no-memory", "--repeats", "1" if r.quick else "5",
            "--paths", "integer,interpolated", "--lengths", lengths]
    recs = _json_lines(r.run("bench_cpu", _fibattn(*args), 180, {"OMP_NUM_THREADS": "2"}))
    rows = {(x["T"], x["path"]): x for x in recs if "path" in x and x.get("ms")}
    checks = [x for x in recs if x.get("check") == "cpu_kernels"]
    summary["cpu"] = {**cpu_flags(), "records": [x for x in recs if "path" in x], "kernel_checks": checks}
    # the compiled code's figures for this same CPU (tools/cpu_static.py), beside its measured times
    path = r.out / "cpu_static.json"
    tool = [sys.executable, str(ROOT / "tools" / "cpu_static.py"), "--targets", "native", "--json", str(path)]
    if platform.machine() == "x86_64" and shutil.which("objdump") and r.run("cpu_static", tool, 120) is not None:
        summary["cpu"]["static"] = json.loads(path.read_text())["targets"]["native"]
    ratios = summary.setdefault("ratios", {})
    for (T, path), x in rows.items():
        if path == "interpolated" and (T, "integer") in rows:
            ratios[f"cpu interpolated/integer fwd+bwd at {T}"] = round_ratio(
                SimpleNamespace(**x), SimpleNamespace(**rows[T, "integer"]))
    for c in checks:
        if c["op"] == "integer" and c.get("peak_gflop_s"):
            ratios[f"cpu integer share of the matmul peak at {c['T']}"] = c["op_gflop_s"] / c["peak_gflop_s"]
        if c.get("far_cost"):      # what the far columns' rows cost this CPU's caches (bench attention_flops)
            ratios[f"cpu {c['op']} kernels alone: far columns' cost at {c['T']}"] = c["far_cost"]
        if c.get("grouped_ratio"):  # issue 29: grouped heads as fast per query head as one KV head per query head
            key = f"cpu {c['op']} kernels alone: Hkv {c['grouped_kv_heads']} / Hkv = H at {c['T']}"
            ratios[key] = c["grouped_ratio"]


def static(r: Runner, summary: dict) -> None:
    """How far the offline model (``tools/gpu_static.py``) is from the measured times."""
    path = r.out / "gpu_static.json"
    if r.run("gpu_static", [sys.executable, str(ROOT / "tools" / "gpu_static.py"), "--json", str(path)], 120,
             {"TRITON_INTERPRET": "0"}) is None or not path.exists():
        return
    est = json.loads(path.read_text())
    rows = summary.get("attention", {}).get("records", [])
    measured = {str(x["T"]): x["ms"] for x in rows
                if x.get("path") == "integer" and x.get("mode") == "fwd+bwd" and x.get("ms")}
    graph = {str(x["T"]): x["graph_ms"] for x in summary.get("op", {}).get("results", [])
             if x.get("path") == "integer" and x.get("graph_ms")}            # bench op: device time alone
    summary["static_model"] = {
        "estimate_ms": est["estimate_ms"], "measured_ms": measured, "graph_ms": graph,
        "measured_over_estimate": {T: measured[T] / e for T, e in est["estimate_ms"].items() if T in measured},
        "graph_over_estimate": {T: graph[T] / e for T, e in est["estimate_ms"].items() if T in graph},
        "thread_instructions_per_query_head_column": est["thread_instructions_per_query_head_column"]}
    for T, ratio in summary["static_model"]["graph_over_estimate"].items():
        summary.setdefault("ratios", {})[f"op graph ms / static estimate at {T}"] = ratio


def verdicts(summary: dict, quick: bool = False) -> dict:
    """Each goal with its measured value and whether it is met; ``--quick`` measures plumbing sizes on whatever
    device there is, so its goals are not judged (``met`` None, ``judged`` False), only shown."""
    got = summary.get("ratios", {})
    out = {}
    for key, goal, sign, ok in [(k, g, ">=", lambda v, g: v >= g) for k, g in GOALS.items()] + \
                               [(k, g, "<=", lambda v, g: v <= g) for k, g in MAX_GOALS.items()]:
        val = got.get(key)
        out[key] = {"goal": f"{sign} {goal}", "measured": val,
                    "met": None if val is None or quick else ok(val, goal), "judged": val is not None and not quick}
        if quick and val is not None:
            out[key]["why"] = "not judged: --quick measures plumbing sizes, not the goal's setting"
    return out


def environment() -> dict:
    info = {"python": sys.version.split()[0]}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.version.cuda, device=(
            torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"))
    except ImportError as exc:
        info["torch"] = f"not importable: {exc}"
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"not importable: {exc}"
    return info


MIN_BUDGET, MAX_BUDGET = 60.0, 86400.0     # seconds: below a minute every step would be skipped


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None


def refusal(args, steps: dict) -> str | None:
    """Why the check cannot run as asked (one line), or None: checked before anything is written."""
    import math
    if not (math.isfinite(args.budget) and MIN_BUDGET <= args.budget <= MAX_BUDGET):
        return (f"--budget must be a number of seconds from {MIN_BUDGET:g} to {MAX_BUDGET:g} (each step needs at "
                f"least 20 s), got {args.budget}")
    chosen = list(steps) if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in chosen if s not in steps]
    if bad or not chosen:
        return f"--only: unknown step(s) {', '.join(bad) or repr(args.only)}; choose among {', '.join(steps)}"
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc}): install fibattn's dependencies first (docs/gpu.md)"
    if not args.quick and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, " + (f"built for CUDA {torch.version.cuda}, but no CUDA device is "
                                                  f"visible" if torch.version.cuda else "built without CUDA")
        return (f"no CUDA device here ({build}): the GPU check measures a GPU; run it on one (docs/gpu.md, "
                f"'Install on a GPU machine'), or give --quick for the CPU plumbing check (its goals are not judged)")
    if not args.quick:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"triton is not importable ({exc}): install the Triton that matches this CUDA torch (docs/gpu.md)"
    if "tests" in chosen:
        try:
            import pytest  # noqa: F401
        except ImportError:
            return "pytest is not installed (the 'tests' step): pip install -e '.[test]' (docs/gpu.md)"
    return None


def prepare_out(path: str) -> tuple[Path | None, str | None]:
    """The output folder, created and proven writable, or the one line saying why it cannot be used."""
    out = Path(path).expanduser().resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".gpu_check_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return None, f"--out {path}: cannot write there ({exc.strerror or exc})"
    return out, None


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, as every refusal here, exit 2
        self.exit(2, f"gpu_check: error: {message} (see tools/gpu_check.py --help)\n")


def main(argv=None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--budget", type=_number, default=470.0,
                   help=f"seconds for the whole check ({MIN_BUDGET:g} to {MAX_BUDGET:g}, default 470)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: a plumbing check (also on a CPU; goals not judged)")
    p.add_argument("--only", default=None, help="comma-separated steps (tests,attention,op,train_bench,training,"
                                                "generate,cpu,sweep,static,ablation)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:            # --help (0) or a bad argument (2, its line printed)
        return exc.code if isinstance(exc.code, int) else 2
    steps = {"tests": tests, "attention": attention, "op": op, "train_bench": train_bench, "training": training,
             "generate": generate, "cpu": cpu, "sweep": sweep, "static": static, "ablation": ablation}
    why = refusal(args, steps)
    out = None
    if why is None:
        out, why = prepare_out(args.out)
    if why is not None:
        print(f"gpu_check: error: {why}", file=sys.stderr)
        return 2
    chosen = list(steps) if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    r = Runner(out, args.budget, args.quick)
    summary: dict = {"environment": environment(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "quick": args.quick}
    print(json.dumps(summary["environment"]), flush=True)
    for name in chosen:
        try:
            steps[name](r, summary)
        except Exception as exc:         # one broken step must not lose the others' numbers
            summary.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            print(f"   {name}: {type(exc).__name__}: {exc}", flush=True)
        (out / "summary.json").write_text(json.dumps({**summary, "steps": r.steps}, indent=2))
    summary["goals"] = verdicts(summary, args.quick)
    summary["steps"] = r.steps
    summary["outcome"] = outcome(r.steps, summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["goals"], indent=2))
    print(f"{summary['outcome']['line']}\nsummary: {out / 'summary.json'}")
    return summary["outcome"]["exit"]


def outcome(steps: dict, summary: dict) -> dict:
    """Counts of the steps by status and the exit status: 1 when a step failed or raised, or when nothing ran
    (every step skipped); skipped steps and skipped tests are counted as skipped, never as passed."""
    counts: dict = {}
    for v in steps.values():
        counts[v["status"]] = counts.get(v["status"], 0) + 1
    errors = len(summary.get("errors", {}))
    ran = counts.get("ok", 0)
    code = 1 if counts.get("failed") or errors or not ran else 0
    parts = [f"{n} {k}" for k, n in sorted(counts.items())] + ([f"{errors} raised"] if errors else [])
    line = f"steps: {', '.join(parts) or 'none ran'}" + (" (nothing was measured)" if not ran else "")
    return {**counts, "raised": errors, "exit": code, "line": line}


if __name__ == "__main__":
    sys.exit(main())
