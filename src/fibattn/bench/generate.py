"""``fibattn bench generate``: per-token decode latency, cache memory and prefill time.

Variants (random weights, batch 1; float32 on CPU, bfloat16 with ``--device cuda``):
``dense``; ``static`` (fib base, linear schedule, W=12, 15 rungs); ``learned`` (the same
with a learned alpha started from linear: alpha·b is fractional, so each rung interpolates
two rows). Shapes: the ``tiny`` and ``paper`` presets.

- Decode: a :class:`fibattn.generation.decode.DecodeSession` per (variant, context) is put at
  position ``context - 1`` with *random* cached keys/values (no prefill is run: a dense
  64K prefill would take too long on a CPU), then ``--steps`` tokens are timed per block
  (after one untimed token, which wakes the thread pool after a thread-count change);
  blocks run interleaved (rep → context → variant → thread count) so all numbers are side
  by side. On a CPU every block is run at each of the ``--decode-threads`` candidates
  (default ``1,0``: one thread and ``--threads``/torch's default), and each (variant,
  context) is reported at its own fastest thread count (one token is many tiny ops: one
  thread suits the small sparse step, a long dense context can use more); on CUDA the
  thread count does not matter and is not searched. Reported: the best block's time per
  token (load from other processes only adds time), the thread count it ran with, and
  the cache bytes.
- Prefill: each ``--prefill`` length is timed ``--prefill-reps`` times (default 3; the
  runs interleaved across variants) with ``--threads`` threads, and the median is
  reported, total and inside the attention core. For models deeper than 4 layers only
  ``--prefill-layers`` blocks (default 1, the middle one) run and times are scaled by
  ``n_layers / K`` (blocks cost the same). ``--contexts ''`` times prefill alone (no decode
  step is built or compiled), ``--prefill ''`` decode alone.

Goals on a CPU: sparse decode at the longest context within 1.2× of the shortest, with
the same cache size once the distance set is complete; learned ≤ 1.5× static; sparse
prefill at 16K ≥ 10× faster than dense. The whole-model prefill ratio is bounded by the
projections and feed-forward layers both variants run (Amdahl), so the attention-core
ratio is printed next to it.
"""
from __future__ import annotations

import copy
import json
import statistics
import time

import torch

from ..checks import int_flag
from ..config import ConfigError
from ..devices import resolve_device, synchronize
from ..generation.decode import DecodeSession
from ..generation.kvcache import layer_read_plan
from ..generation.sampling import Sampling
from ..generation.static import DECODE_MODES, StaticStep, resolve_decode
from ..model.lm import FibLM
from .prefill import prefill_time
from ..presets import get_preset
from ..threads import MAX_THREADS
from ..validation import check_sizes_fit, estimate_params

VARIANTS = ("dense", "static", "learned")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _list(text: str, name: str, kind=int, allowed=None, empty: bool = False) -> list:
    try:
        vals = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name} must be a comma-separated list, got {text!r}") from None
    if not vals and not empty:
        raise ConfigError(f"{name} must not be empty")
    if allowed is not None and any(v not in allowed for v in vals):
        raise ConfigError(f"{name} values must be among {', '.join(allowed)}, got {text!r}")
    if kind is int and any(v < 2 for v in vals):
        raise ConfigError(f"{name} must list integers >= 2, got {text!r}")
    return vals


def configure_parser(parser) -> None:
    parser.add_argument("--contexts", default="1024,4096,16384,65536", help="decode contexts ('': prefill only)")
    parser.add_argument("--prefill", default="4096,16384", help="prefill lengths ('': decode only)")
    parser.add_argument("--shapes", default="tiny,paper", help="model shapes: tiny, paper")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="dense, static, learned")
    parser.add_argument("--steps", type=int, default=6, help="timed decode tokens per block (default 6)")
    parser.add_argument("--reps", type=int, default=4, help="interleaved decode blocks (default 4)")
    parser.add_argument("--prefill-layers", type=int, default=1,
                        help="blocks run for prefill when a model has more than 4 (default 1: the middle one)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for prefill (0: torch default)")
    parser.add_argument("--decode-threads", default="1,0",
                        help="candidate torch CPU thread counts while decoding, comma-separated; each variant "
                             "and context is reported at its fastest (default 1,0: one thread and --threads; "
                             "0 means --threads / torch's default; not searched on CUDA)")
    parser.add_argument("--prefill-reps", type=int, default=3,
                        help="timed runs per prefill length and variant, the median is reported (default 3)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N] (default cpu)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="weights and caches (default float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--decode", default="auto", choices=DECODE_MODES,
                        help="the decode step timed: eager | static | compiled (fibattn.generation.static; a CUDA "
                             "graph on CUDA) | auto (default: compiled on CUDA, eager elsewhere)")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (default 1); tokens/s counts all")
    parser.add_argument("--prefill-chunk", type=int_flag(1), default=None,
                        help="prompt tokens per prefill pass (default 8192); with --decode compiled the prefill is "
                             "compiled too (its compile run untimed)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def model_config(shape: str, variant: str):
    cfg = copy.deepcopy(get_preset(shape).model)
    cfg.max_seq_len = max(cfg.max_seq_len, 1 << 20)
    if variant == "dense":
        cfg.attention = "dense"
        return cfg
    cfg.attention, cfg.base, cfg.base_k, cfg.window = "sparse", "fib", 15, 12
    cfg.schedule = "linear" if variant == "static" else "learned"
    cfg.learned_init = "linear"
    return cfg


def build(shape: str, variant: str, device="cpu", dtype=torch.float32) -> FibLM:
    torch.manual_seed(0)
    return FibLM(model_config(shape, variant)).eval().to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- measuring
def thread_candidates(spec, device="cpu") -> list[int]:
    """The decode thread counts to try: ``spec`` (``"1,0"``, a list or an int; 0 = the current
    count, i.e. ``--threads`` or torch's default), deduplicated; on CUDA only the current count."""
    now = torch.get_num_threads()
    if torch.device(device).type == "cuda":
        return [now]
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--decode-threads must be a comma-separated list of integers >= 0, "
                              f"got {spec!r}") from None
    elif isinstance(spec, int):
        spec = [spec]
    if not spec or any(not 0 <= t <= MAX_THREADS for t in spec):
        raise ConfigError(f"--decode-threads must be a comma-separated list of integers from 0 to {MAX_THREADS}, "
                          f"got {spec!r}")
    return sorted({t or now for t in spec})


@torch.no_grad()
def decode_latency(models: dict, contexts: list[int], steps: int, reps: int, threads=0, *, decode: str = "eager",
                   batch: int = 1) -> dict:
    """``{(variant, context): (best ms per token, cache bytes, threads)}``, interleaved; each block
    runs at every candidate in ``threads`` (see :func:`thread_candidates`) and each
    (variant, context) keeps its fastest. ``decode``: the step timed (eager, static or compiled); ``batch``
    rows step together (the time is per step, every row a token)."""
    before = torch.get_num_threads()
    device = next(iter(models.values())).embed.weight.device
    candidates = thread_candidates(threads, device)
    try:
        return _decode_latency(models, contexts, steps, reps, candidates, decode, batch)
    finally:
        torch.set_num_threads(before)


def _decode_latency(models: dict, contexts: list[int], steps: int, reps: int, candidates: list[int],
                    decode: str, batch: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    sessions, stepping = {}, {}
    per_block = steps + 1                            # one untimed token per block
    token = torch.zeros(batch, dtype=torch.long)
    for name, model in models.items():
        for ctx in contexts:
            s = DecodeSession(model, batch, ctx + (reps + 1) * len(candidates) * per_block + 2,
                              size_flag="--contexts", static=decode != "eager")
            if decode == "eager":
                stepping[name, ctx] = lambda s=s: s.step(token)
            else:                                   # captured before the history: the capture clears the caches
                stepping[name, ctx] = StaticStep(s, Sampling(0.0), set(), compiled=decode == "compiled").advance
            s.random_history(ctx, gen)
            sessions[name, ctx] = s
    times: dict = {(key, th): [] for key in sessions for th in candidates}
    for rep in range(reps + 1):                   # rep 0 warms up
        for ctx in contexts:
            for name in models:
                s = sessions[name, ctx]
                for th in candidates:
                    if torch.get_num_threads() != th:
                        torch.set_num_threads(th)
                    step = stepping[name, ctx]
                    step()                        # untimed: the pool wakes up at this count
                    synchronize(s.device)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        step()
                    synchronize(s.device)
                    if rep:
                        times[(name, ctx), th].append((time.perf_counter() - t0) / steps * 1e3)
    # the best block: other processes sharing the CPU only ever add time
    out = {}
    for key, s in sessions.items():
        ms, th = min((min(times[key, th]), th) for th in candidates)
        out[key] = (ms, s.cache_bytes, th)
    return out


def full_set_context(model: FibLM) -> int:
    """The shortest context at which every layer's ring has its final size."""
    return max(layer_read_plan(layer, model.cfg.max_seq_len).span for layer in model.layers())


def measure_shape(shape: str, variants: list[str], contexts: list[int], prefill: list[int], args) -> list[dict]:
    models = {v: build(shape, v, args.device, DTYPES[args.dtype]) for v in variants}
    batch, lat_mode = getattr(args, "batch", 1), getattr(args, "decode", "eager")
    lat = decode_latency(models, contexts, args.steps, args.reps, args.decode_threads, decode=lat_mode, batch=batch)
    records = {}
    for (v, ctx), (ms, nbytes, th) in lat.items():
        records[v, ctx] = dict(shape=shape, variant=v, context=ctx, decode_ms=ms, cache_bytes=nbytes,
                               decode_threads=th, decode_tok_s=batch * 1e3 / ms, decode=lat_mode, batch=batch)
        if v != "dense":        # from this context on the distance sets (and rings) stop growing
            records[v, ctx]["full_set_context"] = full_set_context(models[v])
    reps = getattr(args, "prefill_reps", 3)
    compiled, chunk = lat_mode == "compiled", getattr(args, "prefill_chunk", None)
    for v in variants if prefill else ():      # warm-up: kernel build / load, RoPE tables
        prefill_time(models[v], 64, args.prefill_layers)
    runs: dict = {(v, length): [] for length in prefill for v in variants}
    for _ in range(reps):              # interleaved: load from other processes hits every variant alike
        for length in prefill:
            for v in variants:
                runs[v, length].append(prefill_time(models[v], length, args.prefill_layers, compiled, chunk))
    for (v, length), got in runs.items():
        rec = records.setdefault((v, length), dict(shape=shape, variant=v, context=length))
        totals = [sec for sec, _, _ in got]
        cores = [c for _, c, _ in got if c is not None]
        rec.update(prefill_s=statistics.median(totals), prefill_attn_s=statistics.median(cores) if cores else None,
                   prefill_compiled=compiled,
                   prefill_s_min=min(totals), prefill_s_max=max(totals), prefill_reps=len(got),
                   prefill_threads=torch.get_num_threads(), prefill_layers_run=got[0][2],
                   n_layers=models[v].cfg.n_layers)
    return sorted(records.values(), key=lambda r: (VARIANTS.index(r["variant"]), r["context"]))


def ratios(records: list[dict]) -> dict:
    """The goal ratios per shape (only those whose inputs were measured)."""
    out: dict = {}
    for shape in sorted({r["shape"] for r in records}):
        rec = {(r["variant"], r["context"]): r for r in records if r["shape"] == shape}
        got: dict = {}
        decoded = sorted({c for (_, c), r in rec.items() if "decode_ms" in r})
        for v in ("static", "learned"):
            if len(decoded) > 1 and (v, decoded[0]) in rec and "decode_ms" in rec[v, decoded[0]]:
                lo, hi = rec[v, decoded[0]], rec[v, decoded[-1]]
                got[f"{v}_decode_{hi['context']}_over_{lo['context']}"] = hi["decode_ms"] / lo["decode_ms"]
                full = [c for c in decoded if c >= lo.get("full_set_context", 0)]
                if full:
                    same = len({rec[v, c]["cache_bytes"] for c in full}) == 1
                    got[f"{v}_cache_constant_from_{full[0]}"] = same
        for c in decoded:
            if ("static", c) in rec and ("learned", c) in rec:
                got[f"learned_over_static_decode_{c}"] = rec["learned", c]["decode_ms"] / rec["static", c]["decode_ms"]
        for (v, c), r in sorted(rec.items()):
            if v == "static" and "prefill_s" in r:
                if ("learned", c) in rec and "prefill_s" in rec["learned", c]:
                    got[f"learned_over_static_prefill_{c}"] = rec["learned", c]["prefill_s"] / r["prefill_s"]
                if ("dense", c) in rec and "prefill_s" in rec["dense", c]:
                    got[f"dense_over_static_prefill_{c}"] = rec["dense", c]["prefill_s"] / r["prefill_s"]
                    if r.get("prefill_attn_s") and rec["dense", c].get("prefill_attn_s"):
                        got[f"dense_over_static_prefill_attn_{c}"] = (rec["dense", c]["prefill_attn_s"]
                                                                      / r["prefill_attn_s"])
        out[shape] = got
    return out


def _goal(key: str, value) -> str:
    if "_cache_constant" in key:
        return "goal: same bytes -> " + ("met" if value else "MISSED")
    if key.startswith("learned_over_static"):
        return "goal <= 1.5 -> " + ("met" if value <= 1.5 else "MISSED")
    if "_decode_" in key and "_over_" in key:
        return "goal <= 1.2 -> " + ("met" if value <= 1.2 else "MISSED")
    if key.startswith(("dense_over_static_prefill_16384", "dense_over_static_prefill_attn_16384")):
        return "goal >= 10 -> " + ("met" if value >= 10 else "MISSED")
    return ""


def format_table(records: list[dict], rat: dict, candidates: list[int] | None = None) -> str:
    head = (f"{'shape':<6} {'variant':<8} {'context':>8} {'decode ms/tok':>14} {'tok/s':>9} {'threads':>7} "
            f"{'cache MiB':>10} {'prefill s':>10} {'(attn s)':>9}")
    lines = [head, "-" * len(head)]
    for r in records:
        ms = f"{r['decode_ms']:.2f}" if "decode_ms" in r else "-"
        tps = f"{r['decode_tok_s']:.0f}" if "decode_tok_s" in r else "-"
        thr = str(r["decode_threads"]) if "decode_threads" in r else "-"
        mib = f"{r['cache_bytes'] / 2**20:.2f}" if "cache_bytes" in r else "-"
        pre = f"{r['prefill_s']:.2f}" if "prefill_s" in r else "-"
        core = f"{r['prefill_attn_s']:.2f}" if r.get("prefill_attn_s") is not None else "-"
        if "prefill_s" in r and r["prefill_layers_run"] < r["n_layers"]:
            pre += "*"
        lines.append(f"{r['shape']:<6} {r['variant']:<8} {r['context']:>8} {ms:>14} {tps:>9} {thr:>7} {mib:>10} "
                     f"{pre:>10} {core:>9}")
    if any(r.get("prefill_layers_run", 0) < r.get("n_layers", 0) for r in records):
        lines.append("* prefill timed on a subset of the blocks and scaled to the full depth")
    dec = next((r for r in records if "decode" in r), None)
    lines.append("decode: best of the interleaved blocks, random cached keys/values at position context-1 "
                 "(no prefill run); threads: the CPU thread count of that best block"
                 + (f"; the {dec['decode']} step, {dec['batch']} row(s) a step (tok/s counts every row)"
                    if dec else ""))
    if candidates:
        lines.append(f"decode thread counts tried per variant and context: {', '.join(map(str, candidates))}")
    pre = [r for r in records if "prefill_s" in r]
    if pre:
        lines.append(f"prefill: median of {pre[0]['prefill_reps']} interleaved runs, {pre[0]['prefill_threads']} "
                     f"threads; (attn s): the part inside the attention core")
    full = sorted({r["full_set_context"] for r in records if "full_set_context" in r})
    if full:
        lines.append(f"sparse rings reach their final size at context {'/'.join(map(str, full))} "
                     f"(shorter contexts cap the distance set, so their rings are smaller)")
    for shape, got in rat.items():
        lines.append(f"ratios ({shape}):")
        for key, value in got.items():
            val = str(value) if isinstance(value, bool) else f"{value:.2f}"
            lines.append(f"  {key:<40} {val:>8}  {_goal(key, value)}")
    return "\n".join(lines)


def check_fits(shape: str, variants: list[str], contexts: list[int], prefill: list[int], args) -> None:
    """Refuse contexts and prefill lengths that cannot fit, before any model is built: weights plus, per token,
    the dense model's full cache (when dense is measured) or a prefill's hidden states, keys and values."""
    m = model_config(shape, "dense")
    item = DTYPES[args.dtype].itemsize
    weights, kv = estimate_params(m) * item, 2 * m.n_kv_heads * m.head_dim * item
    if "dense" in variants:
        rows = getattr(args, "batch", 1)
        check_sizes_fit("--contexts", contexts, lambda c: weights + rows * c * m.n_layers * kv,
                        f"the {shape} model's weights and dense key/value cache ({args.dtype})", args.device)
    check_sizes_fit("--prefill", prefill, lambda T: weights + T * (2 * m.d_model * item + kv),
                    f"the {shape} model's weights and one block's prefill activations ({args.dtype})", args.device)


def run(args) -> int:
    args.device = str(resolve_device(args.device))      # first: the checks below depend on it
    contexts = _list(args.contexts, "--contexts", empty=True)
    prefill = _list(args.prefill, "--prefill", empty=True)
    if not contexts and not prefill:
        raise ConfigError("--contexts and --prefill are both empty: nothing to time (give decode contexts, prefill "
                          "lengths or both)")
    shapes = _list(args.shapes, "--shapes", str, ("tiny", "paper"))
    variants = [v for v in VARIANTS if v in _list(args.variants, "--variants", str, VARIANTS)]
    thread_candidates(args.decode_threads, "cpu")            # checks the list before any work
    for name in ("steps", "reps", "prefill_layers", "prefill_reps", "batch"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(args, name)}")
    if not 0 <= args.threads <= MAX_THREADS:
        raise ConfigError(f"--threads must be an integer from 0 to {MAX_THREADS}, got {args.threads}")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.decode = resolve_decode(args.decode, torch.device(args.device))
    for shape in shapes:
        check_fits(shape, variants, contexts, prefill, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.decode_threads = candidates = thread_candidates(args.decode_threads, args.device)
    records = []
    for shape in shapes:
        records += measure_shape(shape, variants, sorted(contexts), sorted(prefill), args)
    rat = ratios(records)
    if args.json:
        settings = dict(contexts=contexts, prefill=prefill, shapes=shapes, variants=variants, steps=args.steps,
                        reps=args.reps, prefill_layers=args.prefill_layers, threads=torch.get_num_threads(),
                        decode_thread_candidates=candidates, decode_thread_search=len(candidates) > 1,
                        prefill_reps=args.prefill_reps, device=args.device, dtype=args.dtype, decode=args.decode,
                        batch=args.batch,
                        decode_cache="random keys/values at position context-1")
        print(json.dumps(dict(settings=settings, results=records, ratios=rat), indent=2))
    else:
        print(format_table(records, rat, candidates))
    return 0
