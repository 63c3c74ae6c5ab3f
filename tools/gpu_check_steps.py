"""The GPU check's measuring steps for issues 54-56 (``tools/gpu_check.py`` runs them): the compiled training
step, generation (decode, prefill, the transformers export) and the op timed without host time in it. Each takes
the check's runner (``gpu_check.Runner``) and summary and adds its records and ratios (the goals live in
``gpu_check``)."""
from __future__ import annotations

import json
import shutil
import sys

TRAIN_LENGTHS = (1024, 4096, 16384)
OP_LENGTHS = (4096, 16384, 65536)


def _json_lines(text: str | None) -> list[dict]:
    out = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _fibattn(*args: str) -> list[str]:
    return [sys.executable, "-m", "fibattn.cli", *args]



def train_bench(r, summary: dict) -> None:
    """Issue 54: the paper model, both compiled (fullgraph, the chunked loss head, dense on cuDNN SDPA first),
    T = 1024 / 4096 / 16384: tok/s, MFU, sparse/dense, peak memory; compile time cold (a fresh inductor cache)
    and warm (the same cache, the first length again in a new process, as a resumed run compiles)."""
    cache = r.out / "inductor_cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    base = ["bench", "train", "--device", r.device, "--json", "--steps", "5", "--compiled-only"]
    base += ["--preset", "tiny", "--tokens", "256"] if r.quick else ["--preset", "paper"]
    lengths = ["64"] if r.quick else [str(T) for T in TRAIN_LENGTHS]
    out = r.run("bench_train", _fibattn(*base, "--lengths", ",".join(lengths)), 300, env=env)
    if not out:
        return
    rows = json.loads(out)["rows"]
    summary["train_bench"] = rows
    ratios = summary.setdefault("ratios", {})
    for row in rows:
        T = row["length"]
        ratios[f"train compiled sparse/dense at {T}"] = row["ratio"]
        ratios[f"train compiled sparse ktok/s at {T}"] = row["sparse_tok_s"] / 1e3
        for name in ("dense", "sparse"):
            for key in ("mfu", "peak_mb"):
                if f"{name}_{key}" in row:
                    ratios[f"train compiled {name} {key} at {T}"] = row[f"{name}_{key}"]
    ratios["train compile s cold (worst variant)"] = max(row[f"{n}_warmup_s"] for row in rows
                                                         for n in ("dense", "sparse"))
    warm = r.run("bench_train_warm", _fibattn(*base, "--lengths", lengths[0]), 120, env=env)
    if warm:
        row = json.loads(warm)["rows"][0]
        ratios["train compile s warm (worst variant)"] = max(row["dense_warmup_s"], row["sparse_warmup_s"])


GEN_CONTEXTS = (1024, 16384, 65536)        # issue 55: every variant; sparse also at GEN_LONG
GEN_LONG = 1 << 20
GEN_PREFILL = (4096, 16384, 65536)


def generate(r, summary: dict) -> None:
    """Decode tokens/s (the captured static step; the compiled one at 16K, batch 1 and 64) and prefill, paper
    shape: issue 55's goals."""
    shape, ctxs, long_ctx = "paper", ",".join(map(str, GEN_CONTEXTS)), str(GEN_LONG)
    pre = ",".join(map(str, GEN_PREFILL))
    extra = ["--steps", "20", "--prefill-layers", "16"]
    if r.quick:
        shape, ctxs, long_ctx, pre, extra = "tiny", "64,256", "1024", "128", ["--steps", "1", "--reps", "1"]
    base = ["bench", "generate", "--device", r.device, "--shapes", shape, "--json"]
    runs = {"bench_generate": base + ["--contexts", ctxs, "--prefill", "", "--decode", "static", *extra],
            # the prefill through the compiled model, in chunks (its compile run untimed), sparse beside dense
            "bench_generate_prefill": base + ["--contexts", "", "--prefill", pre, "--variants",
                                              "dense,static", "--decode", "compiled", "--prefill-reps", "1", *extra],
            "bench_generate_long": base + ["--contexts", long_ctx, "--prefill", "", "--variants", "static,learned",
                                           "--decode", "static", *extra],
            "bench_generate_compiled": base + ["--contexts", ctxs.split(",")[1], "--prefill", "", "--variants",
                                               "static,learned", "--decode", "compiled", *extra],
            "bench_generate_batch64": base + ["--contexts", ctxs.split(",")[1], "--prefill", "", "--variants",
                                              "static,learned", "--decode", "compiled", "--batch", "64", *extra]}
    got = summary.setdefault("ratios", {})
    for name, args in runs.items():
        if r.quick:              # the compile's plumbing is tests/test_decode_static.py's, not a minute of CPU here
            args = ["static" if a == "compiled" else a for a in args]
        out = r.run(name, _fibattn(*args), 150)
        if not out:
            continue
        doc = json.loads(out)
        summary.setdefault("generate", {})[name] = doc
        dec = [x for x in doc["results"] if "decode_tok_s" in x]
        sparse = [x["decode_tok_s"] for x in dec if x["variant"] != "dense"]
        if sparse and name != "bench_generate_batch64":
            key = "decode sparse tok/s batch 1 (worst context and variant)"
            got[key] = min(sparse + ([got[key]] if key in got else []))
        elif sparse:
            got["decode sparse tok/s batch 64 (worst variant)"] = min(sparse)
        pre_s = {(x["variant"], x["context"]): x["prefill_s"] for x in doc["results"] if "prefill_s" in x}
        for T in (4096, 16384):
            if ("dense", T) in pre_s and ("static", T) in pre_s:
                got[f"prefill dense/sparse at {T}"] = pre_s["dense", T] / pre_s["static", T]
        if ("static", 16384) in pre_s:
            got["prefill sparse ms at 16384"] = pre_s["static", 16384] * 1e3
    # the transformers remote-code export's generate() (its FibattnCache) beside fibattn's, same weights
    hf = ["bench", "hf-generate", "--device", r.device, "--json"]
    hf += ["--contexts", "64", "--new", "4", "--reps", "1"] if r.quick else \
        ["--shape", "paper", "--contexts", "1024,16384", "--new", "64"]
    out = r.run("bench_hf_generate", _fibattn(*hf), 120)
    if out:
        doc = json.loads(out)
        summary.setdefault("generate", {})["bench_hf_generate"] = doc
        for x in doc["results"]:
            got[f"transformers export decode tok/s at {x['context']}"] = x["hf_tok_s"]
            got[f"fibattn / transformers export decode at {x['context']}"] = x["fibattn_over_hf"]


def op(r, summary: dict) -> None:
    """Issues 54 and 56: the op's forward + backward replayed from a CUDA graph (the device's time), eager (host
    time included) and the best dense SDPA kernel beside it (``fibattn bench op``); the host's µs per eager
    call at a length where the kernels take microseconds."""
    args = ["bench", "op", "--device", r.device, "--json"]
    args += ["--lengths", "256", "--iters", "3", "--batch", "1"] if r.quick else \
        ["--lengths", ",".join(map(str, OP_LENGTHS))]
    out = r.run("bench_op", _fibattn(*args), 240)
    if not out:
        return
    doc = json.loads(out)
    summary["op"] = doc
    got = summary.setdefault("ratios", {})
    for name, value in doc["ratios"].items():
        got[f"op {name}"] = value
    for name in ("interpolated/integer", "documents/integer"):
        worst = [v for k, v in doc["ratios"].items() if k.startswith(name)]
        if worst:
            got[f"op {name} (worst length)"] = max(worst)
    got["op host us per eager fwd+bwd (integer)"] = doc["host_us"]["integer"]


