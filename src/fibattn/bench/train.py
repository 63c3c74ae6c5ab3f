"""``fibattn bench train``: training tokens/s of one model with dense vs sparse attention.

Both variants share the preset's shape (default ``tiny``); sparse is fib base, linear
schedule (``--schedule learned`` for a learned alpha), W=12 (``--window``). Each step is
forward + backward + AdamW on random tokens, ``--tokens`` tokens per step (batch =
tokens // T; default 8192 on CPU, 32768 on CUDA, the study's step), bf16 autocast on
CUDA. ``--compile`` adds both models under ``torch.compile(fullgraph=True)``.

For each length every variant's model is built first (all live at once), each is warmed
up (one step; two for a compiled model, whose first steps compile the forward and the
backward graphs), then ``--steps`` (>= 5) timed steps per variant run *interleaved*,
round-robin (dense, sparse[, dense compiled, sparse compiled], dense, sparse, ...), so
load from other processes hits all variants alike; on CUDA each timed step is synchronised
before and after. Reported per variant: the median tokens/s over its timed steps and the
spread (min–max of the per-step tokens/s); ratios are ratios of medians (sparse / dense,
compiled / eager).
Goals: sparse / dense >= 1.2x at T=1024 and >= 2x at T=4096 on a CPU, >= 1.0x and >= 1.5x
on CUDA; compiled / eager >= 1.0x.

``--activation-checkpointing full`` times the sparse model with ``none`` and ``full`` instead (the same
interleaving; with ``--compile`` also both compiled) and prints each one's peak memory of one step: the
weights, optimizer moments and batch it starts with plus the most it allocates at once during the step
(:mod:`fibattn.bench.memory`). Goals at T=16384: full's peak <= 1/3 of none's, tokens/s >= 0.7x.
"""
from __future__ import annotations

import contextlib
import copy
import json
import statistics
import time

import torch

from ..checks import parse_int_list
from ..config import ACTIVATION_CHECKPOINTING, ConfigError
from ..model.lm import FibLM
from ..presets import get_preset
from ..validation import check_training_fits
from .attention_paths import check_documents, equal_documents
from .memory import live_bytes, step_peak_bytes

GOALS = {"cpu": {1024: 1.2, 4096: 2.0}, "cuda": {1024: 1.0, 4096: 1.5}}
CHECKPOINTING_GOALS = {16384: {"memory": 1 / 3, "speed": 0.7}}     # full / none: peak at most, tokens/s at least
MEMORY = ("the weights, optimizer moments and batch a step starts with plus the most one more step allocates at "
          "once (CPU: PyTorch's allocator through the profiler; CUDA: max_memory_allocated)")
MIN_STEPS = 5
SPREAD = "min-max"           # what the *_min / *_max fields and the table's range are


def check_steps(steps: int) -> int:
    if steps < MIN_STEPS:
        raise ConfigError(f"--steps must be >= {MIN_STEPS} (the median over interleaved timed steps "
                          f"needs at least {MIN_STEPS}), got {steps}")
    return steps


def configure_parser(parser) -> None:
    parser.add_argument("--lengths", default="1024,4096", help="sequence lengths (default 1024,4096)")
    parser.add_argument("--steps", type=int, default=MIN_STEPS,
                        help=f"timed steps per variant, interleaved round-robin; the median is reported "
                             f"(default and minimum {MIN_STEPS})")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step (default 8192 on CPU, 32768 on CUDA)")
    parser.add_argument("--preset", default="tiny", help="model shape: tiny | paper (default tiny)")
    parser.add_argument("--window", type=int, default=12, help="sparse window W (default 12)")
    parser.add_argument("--backend", default="auto", help="sparse backend (default auto)")
    parser.add_argument("--schedule", default="linear", choices=("linear", "learned"),
                        help="sparse schedule: linear (static) or learned alpha (default linear)")
    parser.add_argument("--compile", action="store_true",
                        help="also time both models under torch.compile(fullgraph=True)")
    parser.add_argument("--activation-checkpointing", default="none", choices=ACTIVATION_CHECKPOINTING,
                        help="full: time the sparse model with each block recomputed in the backward next to none, "
                             "with each one's peak memory (train.activation_checkpointing)")
    parser.add_argument("--documents", type=int, default=0, metavar="N",
                        help="N equal packed documents per row, attention masked to each (default 0: off)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default 0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def variant(preset: str, attention: str, T: int, window: int, backend: str, schedule: str = "linear"):
    cfg = copy.deepcopy(get_preset(preset).model)
    cfg.attention, cfg.seq_len, cfg.max_seq_len = attention, T, max(cfg.max_seq_len, T)
    cfg.base, cfg.base_k, cfg.schedule, cfg.window, cfg.backend = "fib", 15, schedule, window, backend
    cfg.learned_init = "linear"
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(model_cfg, batch: int, device: torch.device, compiled: bool = False, checkpointing: str = "none",
              documents: int = 0):
    """A fresh model (seed 0), its AdamW and random tokens; returns ``(step, warmup_steps)``
    where ``step()`` runs one forward + backward + optimizer step and ``step.state_bytes()`` counts
    the weights, optimizer moments and batch every step starts with; ``documents``: that many packed
    documents per row, attention masked to each (0: one document)."""
    torch.manual_seed(0)
    model = FibLM(model_cfg).to(device).set_activation_checkpointing(checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model, fullgraph=True) if compiled else model
    T = model_cfg.seq_len
    x = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    y = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    docs = {"document_ids": equal_documents(batch, T, documents, device)} if documents else {}
    cuda = device.type == "cuda"

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            _, loss = fwd(x, y, **docs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.state_bytes = lambda: live_bytes(*model.parameters(), *model.buffers(), x, y, *(
        v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)))
    # the backward graph of a compiled model is built on its first use, after the forward's
    return step, (2 if compiled else 1)


def interleave(steps: dict, n: int, device: torch.device, clock=None) -> dict[str, list[float]]:
    """Seconds of each of ``n`` timed calls per variant, run round-robin in ``steps``' order
    (v1, v2, ..., v1, v2, ...); each call is synchronised before and after on CUDA."""
    clock = clock or time.perf_counter
    secs: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            _sync(device)
            t0 = clock()
            step()
            _sync(device)
            secs[name].append(clock() - t0)
    return secs


def summarize(tokens_per_step: int, secs: list[float]) -> dict:
    """Median tokens/s over the timed steps and the min–max spread of the per-step rates."""
    rates = [tokens_per_step / s for s in secs]
    return {"tok_s": statistics.median(rates), "min": min(rates), "max": max(rates), "steps": len(rates)}


def _check_fit(lengths, tokens: int, preset: str, window: int, backend: str, dev: torch.device) -> None:
    for T in lengths:                        # every length is checked before the first is timed
        check_training_fits(variant(preset, "dense", T, window, backend), max(1, tokens // T), dev.type == "cuda",
                            dev, flags="--tokens / --lengths")


def _timed(built: dict, steps: int, dev: torch.device, tokens_per_step: int) -> dict:
    """Warm every ``(step, warmup_steps)`` in ``built`` up, time them interleaved; each one's row fields."""
    for step, warmup in built.values():
        for _ in range(warmup):
            step()
    secs = interleave({name: step for name, (step, _) in built.items()}, steps, dev)
    row = {}
    for name in built:
        s = summarize(tokens_per_step, secs[name])
        row.update({f"{name}_tok_s": s["tok_s"], f"{name}_tok_s_min": s["min"], f"{name}_tok_s_max": s["max"]})
    return row


def bench(lengths, steps: int, tokens: int, preset: str = "tiny", window: int = 12, backend: str = "auto",
          device: str = "cpu", schedule: str = "linear", compiled: bool = False, documents: int = 0) -> list[dict]:
    check_steps(steps)
    dev = torch.device(device)
    goals = GOALS["cuda" if dev.type == "cuda" else "cpu"]
    _check_fit(lengths, tokens, preset, window, backend, dev)
    rows = []
    for T in lengths:
        batch = max(1, tokens // T)
        cfgs = {a: variant(preset, a, T, window, backend, schedule) for a in ("dense", "sparse")}
        names = [("dense", "dense", False), ("sparse", "sparse", False)]
        if compiled:
            names += [("dense_compiled", "dense", True), ("sparse_compiled", "sparse", True)]
        built = {name: make_step(cfgs[a], batch, dev, c, documents=documents)     # all models live at once
                 for name, a, c in names}
        row = {"length": T, "batch": batch, **_timed(built, steps, dev, batch * T)}
        del built
        row.update(ratio=row["sparse_tok_s"] / row["dense_tok_s"], goal=goals.get(T), steps=steps)
        if compiled:
            for a in ("dense", "sparse"):
                row[f"{a}_compiled_over_eager"] = row[f"{a}_compiled_tok_s"] / row[f"{a}_tok_s"]
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _suffixes(compiled: bool) -> tuple[str, ...]:
    return ("", "_compiled") if compiled else ("",)


def bench_checkpointing(lengths, steps: int, tokens: int, preset: str = "tiny", window: int = 12,
                        backend: str = "auto", device: str = "cpu", schedule: str = "linear",
                        compiled: bool = False, documents: int = 0) -> list[dict]:
    """The sparse model with activation checkpointing ``none`` and ``full`` side by side: tokens/s timed as
    :func:`bench` does, then one more step of each for its peak memory (MB)."""
    check_steps(steps)
    dev = torch.device(device)
    _check_fit(lengths, tokens, preset, window, backend, dev)
    rows = []
    for T in lengths:
        batch = max(1, tokens // T)
        cfg = variant(preset, "sparse", T, window, backend, schedule)
        built = {mode + suffix: make_step(cfg, batch, dev, bool(suffix), mode, documents)
                 for suffix in _suffixes(compiled) for mode in ACTIVATION_CHECKPOINTING}
        row = {"length": T, "batch": batch, **_timed(built, steps, dev, batch * T)}
        for name, (step, _) in built.items():      # after the timing: the profiler slows the step it watches
            row[f"{name}_peak_mb"] = (step.state_bytes() + step_peak_bytes(step, dev)) / 2 ** 20
        del built
        for suffix in _suffixes(compiled):
            row[f"memory_ratio{suffix}"] = row[f"full{suffix}_peak_mb"] / row[f"none{suffix}_peak_mb"]
            row[f"speed_ratio{suffix}"] = row[f"full{suffix}_tok_s"] / row[f"none{suffix}_tok_s"]
        row.update(goal=CHECKPOINTING_GOALS.get(T), steps=steps)
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], compiled: bool) -> str:
    w = max([len(f"{r[k]:.0f}") for r in rows for k in r if k.endswith(("_min", "_max"))] + [1])
    rng = 2 * w + 3
    lines = [f"{'T':>6} {'batch':>5} {'dense tok/s':>12} {'(min-max)':<{rng}} {'sparse tok/s':>13} "
             f"{'(min-max)':<{rng}} {'sparse/dense':>13} {'goal':>6}"]
    for r in rows:
        goal = f">={r['goal']}x" if r["goal"] else ""
        rd = f"({r['dense_tok_s_min']:.0f}-{r['dense_tok_s_max']:.0f})"
        rs = f"({r['sparse_tok_s_min']:.0f}-{r['sparse_tok_s_max']:.0f})"
        lines.append(f"{r['length']:>6} {r['batch']:>5} {r['dense_tok_s']:>12.0f} {rd:<{rng}} "
                     f"{r['sparse_tok_s']:>13.0f} {rs:<{rng}} {r['ratio']:>12.2f}x {goal:>6}")
    if compiled:
        lines += ["", "compiled (torch.compile, fullgraph=True) vs eager",
                  f"{'T':>6} {'dense tok/s':>12} {'(min-max)':<{rng}} {'compiled/eager':>15} "
                  f"{'sparse tok/s':>13} {'(min-max)':<{rng}} {'compiled/eager':>15}"]
        for r in rows:
            rd = f"({r['dense_compiled_tok_s_min']:.0f}-{r['dense_compiled_tok_s_max']:.0f})"
            rs = f"({r['sparse_compiled_tok_s_min']:.0f}-{r['sparse_compiled_tok_s_max']:.0f})"
            lines.append(f"{r['length']:>6} {r['dense_compiled_tok_s']:>12.0f} {rd:<{rng}} "
                         f"{r['dense_compiled_over_eager']:>14.2f}x {r['sparse_compiled_tok_s']:>13.0f} "
                         f"{rs:<{rng}} {r['sparse_compiled_over_eager']:>14.2f}x")
    return "\n".join(lines + _timing_note(rows))


def _timing_note(rows: list[dict]) -> list[str]:
    steps = rows[0]["steps"] if rows else MIN_STEPS
    return ["", f"tok/s: median of {steps} timed steps per variant, interleaved round-robin after warm-up; "
                f"(min-max): spread of the per-step tok/s; ratios are ratios of medians"]


def format_checkpointing_table(rows: list[dict], compiled: bool) -> str:
    lines = [f"{'T':>6} {'batch':>5} {'checkpointing':<14} {'tok/s':>9} {'(min-max)':<17} {'peak MB':>9}"]
    for r in rows:
        for suffix in _suffixes(compiled):
            for mode in ACTIVATION_CHECKPOINTING:
                n = mode + suffix
                rng = f"({r[f'{n}_tok_s_min']:.0f}-{r[f'{n}_tok_s_max']:.0f})"
                lines.append(f"{r['length']:>6} {r['batch']:>5} {n:<14} {r[f'{n}_tok_s']:>9.0f} {rng:<17} "
                             f"{r[f'{n}_peak_mb']:>9.1f}")
            g = r["goal"]
            mem_goal, speed_goal = (f" (goal <= {g['memory']:.2f}x)", f" (goal >= {g['speed']}x)") if g else ("", "")
            lines.append(f"{'':>13}full{suffix} / none{suffix}: peak memory {r[f'memory_ratio{suffix}']:.2f}x"
                         f"{mem_goal}, tok/s {r[f'speed_ratio{suffix}']:.2f}x{speed_goal}")
    return "\n".join(lines + _timing_note(rows) + [f"peak MB: {MEMORY}"])


def run(args) -> int:
    lengths = parse_int_list(args.lengths, "--lengths", minimum=2, error=ConfigError)
    check_steps(args.steps)
    if args.tokens is None:
        args.tokens = 32768 if args.device.startswith("cuda") else 8192
    if args.tokens < 2:
        raise ConfigError(f"--tokens must be >= 2, got {args.tokens}")
    if args.documents < 0:
        raise ConfigError(f"--documents must be >= 1 (0: off), got {args.documents}")
    if args.documents:
        check_documents(args.documents, lengths)
    if args.threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpointing = args.activation_checkpointing == "full"
    rows = (bench_checkpointing if checkpointing else bench)(lengths, args.steps, args.tokens, args.preset, args.window,
                                                              args.backend, args.device, args.schedule, args.compile,
                                                              args.documents)
    if args.json:
        print(json.dumps({"preset": args.preset, "window": args.window, "schedule": args.schedule,
                          "device": args.device, "threads": torch.get_num_threads(), "steps": args.steps,
                          "stat": "median", "spread": SPREAD, "order": "interleaved round-robin",
                          "activation_checkpointing": args.activation_checkpointing, "documents": args.documents,
                          **({"peak_mb": MEMORY} if checkpointing else {}), "rows": rows}, indent=2))
        return 0
    if checkpointing:
        print(f"training memory and throughput, preset {args.preset} shape, fib/{args.schedule} W={args.window}, "
              f"activation checkpointing full vs none, {torch.get_num_threads()} threads, {args.device}"
              + (f", {args.documents} packed documents per row" if args.documents else ""))
        print(format_checkpointing_table(rows, args.compile))
        return 0
    print(f"training throughput, preset {args.preset} shape, fib/{args.schedule} W={args.window} vs dense, "
          f"{torch.get_num_threads()} threads, {args.device}"
          + (f", {args.documents} packed documents per row" if args.documents else ""))
    print(format_table(rows, args.compile))
    return 0
