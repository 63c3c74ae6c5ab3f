"""``fibattn bench train``: training tokens/s of one model with dense vs sparse attention.

Both variants share the preset's shape (default ``tiny``); sparse is fib base, linear
schedule (``--schedule learned`` for a learned alpha), W=12 (``--window``). Each step is
forward + backward + AdamW on random tokens, ``--tokens`` tokens per step (batch =
tokens // T; default 8192 on CPU, 32768 on CUDA, the study's step), bf16 autocast on
CUDA. ``--compile`` adds both models under ``torch.compile(fullgraph=True)``. Each step makes its loss the
way training does (``--loss-head``, as ``train.loss_head``: auto is chunked on CUDA, plain on CPU), and the
dense model's attention runs on the fastest SDPA backend the card has (``--dense-sdpa``; auto tries cuDNN,
then FlashAttention-2, memory-efficient, math: cuDNN measured 1.6x flash on an H200), so that the baseline
is the fair one.

For each length every variant's model is built first (all live at once), each is warmed
up (one step; two for a compiled model, whose first steps compile the forward and the
backward graphs), then ``--steps`` (>= 5) timed steps per variant run *interleaved*,
round-robin (dense, sparse[, dense compiled, sparse compiled], dense, sparse, ...), so
load from other processes hits all variants alike; on CUDA each timed step is synchronised
before and after. Reported per variant: the median tokens/s over its timed steps and the
spread (min–max of the per-step tokens/s); ratios are ratios of medians (sparse / dense,
compiled / eager); the seconds of its warm-up steps (a compiled model's compile time, reported apart from
its tokens/s); on CUDA also its peak memory of one step and its MFU (model FLOPs from the attended columns,
:mod:`fibattn.trainer.throughput`, against the card's bf16 peak).
Goals: sparse / dense >= 1.2x at T=1024 and >= 2x at T=4096 on a CPU, >= 1.0x and >= 1.5x
on CUDA; compiled / eager >= 1.0x; ``--compiled-only`` on CUDA: >= 1.1x, 1.4x, 3x at T = 1024, 4096, 16384.

``--activation-checkpointing full`` times the sparse model with ``none`` and ``full`` instead (the same
interleaving; with ``--compile`` also both compiled) and prints each one's peak memory of one step: the
weights, optimizer moments and batch it starts with plus the most it allocates at once during the step
(:mod:`fibattn.bench.memory`). Goals at T=16384: full's peak <= 1/3 of none's, tokens/s >= 0.7x.
"""
from __future__ import annotations

import copy
import json

import torch

from ..checks import parse_int_list
from ..config import ACTIVATION_CHECKPOINTING, ConfigError
from ..devices import resolve_device
from ..model.head_loss import logit_rows
from ..presets import get_preset
from ..threads import MAX_THREADS, TORCH_DEFAULT, use_threads
from ..trainer.setup import loss_head_for
from ..validation import check_training_fits
from .attention_paths import check_documents
from .memory import step_peak_bytes
from .train_steps import device_fields, make_step, sdpa_backends, timed

SDPA = ("auto", "cudnn", "flash", "efficient", "math")
GOALS = {"cpu": {1024: 1.2, 4096: 2.0}, "cuda": {1024: 1.0, 4096: 1.5},
         "cuda compiled": {1024: 1.1, 4096: 1.4, 16384: 3.0}}      # issue 54: both compiled, dense on cuDNN
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
    parser.add_argument("--compiled-only", action="store_true",
                        help="time only the compiled models (as dense and sparse): what training on CUDA runs")
    parser.add_argument("--activation-checkpointing", default="none", choices=ACTIVATION_CHECKPOINTING,
                        help="full: time the sparse model with each block recomputed in the backward next to none, "
                             "with each one's peak memory (train.activation_checkpointing)")
    parser.add_argument("--documents", type=int, default=0, metavar="N",
                        help="N equal packed documents per row, attention masked to each (default 0: off)")
    parser.add_argument("--loss-head", default="auto", choices=("auto", "plain", "chunked", "liger"),
                        help="how each step makes its loss (train.loss_head; default auto: chunked on CUDA)")
    parser.add_argument("--dense-sdpa", default="auto", choices=SDPA,
                        help="the dense model's SDPA backend (default auto: cudnn, flash, efficient, math in that "
                             "order on CUDA; torch's choice on CPU)")
    parser.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N (default cpu)")
    parser.add_argument("--threads", default="0", metavar="N[,N...]",
                        help="CPU thread counts, each timed in turn (0: the cores free now, fibattn's default; "
                             "e.g. 0,1 or 0,%d: the default beside a chosen count; default 0)" % TORCH_DEFAULT)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def variant(preset: str, attention: str, T: int, window: int, backend: str, schedule: str = "linear"):
    cfg = copy.deepcopy(get_preset(preset).model)
    cfg.attention, cfg.seq_len, cfg.max_seq_len = attention, T, max(cfg.max_seq_len, T)
    cfg.base, cfg.base_k, cfg.schedule, cfg.window, cfg.backend = "fib", 15, schedule, window, backend
    cfg.learned_init = "linear"
    return cfg


def _check_fit(lengths, tokens: int, preset: str, window: int, backend: str, dev: torch.device,
               loss_head: str = "plain") -> None:
    for T in lengths:                        # every length is checked before the first is timed
        cfg = variant(preset, "dense", T, window, backend)
        check_training_fits(cfg, max(1, tokens // T), dev.type == "cuda", dev, flags="--tokens / --lengths",
                            logit_rows=logit_rows(loss_head, cfg.vocab_size))


def bench(lengths, steps: int, tokens: int, preset: str = "tiny", window: int = 12, backend: str = "auto",
          device: str = "cpu", schedule: str = "linear", compiled: bool = False, documents: int = 0,
          loss_head: str = "auto", dense_sdpa: str = "auto", eager: bool = True) -> list[dict]:
    """Rows of tokens/s per length; ``eager=False`` (with ``compiled``): the compiled models alone, as
    ``dense`` and ``sparse``."""
    check_steps(steps)
    dev = torch.device(device)
    how = {"loss_head": loss_head_for(loss_head, dev, field="--loss-head"), "sdpa": sdpa_backends(dense_sdpa, dev)}
    goals = GOALS["cpu" if dev.type != "cuda" else "cuda compiled" if compiled and not eager else "cuda"]
    _check_fit(lengths, tokens, preset, window, backend, dev, how["loss_head"])
    rows = []
    for T in lengths:
        batch = max(1, tokens // T)
        cfgs = {a: variant(preset, a, T, window, backend, schedule) for a in ("dense", "sparse")}
        names = [("dense", "dense", False), ("sparse", "sparse", False)]
        if compiled and not eager:
            names = [("dense", "dense", True), ("sparse", "sparse", True)]
        elif compiled:
            names += [("dense_compiled", "dense", True), ("sparse_compiled", "sparse", True)]
        built = {name: make_step(cfgs[a], batch, dev, c, documents=documents, **how)   # all models live at once
                 for name, a, c in names}
        row = {"length": T, "batch": batch, **timed(built, steps, dev, batch * T)}
        device_fields(row, built, {name: cfgs[a] for name, a, _ in names}, dev)
        del built
        row.update(ratio=row["sparse_tok_s"] / row["dense_tok_s"], goal=goals.get(T), steps=steps,
                   compiled=compiled and not eager)
        if compiled and eager:
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
                        compiled: bool = False, documents: int = 0, loss_head: str = "auto") -> list[dict]:
    """The sparse model with activation checkpointing ``none`` and ``full`` side by side: tokens/s timed as
    :func:`bench` does, then one more step of each for its peak memory (MB)."""
    check_steps(steps)
    dev = torch.device(device)
    head = loss_head_for(loss_head, dev, field="--loss-head")
    _check_fit(lengths, tokens, preset, window, backend, dev, head)
    rows = []
    for T in lengths:
        batch = max(1, tokens // T)
        cfg = variant(preset, "sparse", T, window, backend, schedule)
        built = {mode + suffix: make_step(cfg, batch, dev, bool(suffix), mode, documents, head)
                 for suffix in _suffixes(compiled) for mode in ACTIVATION_CHECKPOINTING}
        row = {"length": T, "batch": batch, **timed(built, steps, dev, batch * T)}
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
    return "\n".join(lines + _variant_lines(rows) + _timing_note(rows))


def _variant_lines(rows: list[dict]) -> list[str]:
    """Per variant: its warm-up seconds (a compiled one's compile time), and on CUDA its peak MB and MFU."""
    lines = ["", f"{'T':>6} {'variant':<16} {'warm-up s':>10} {'peak MB':>9} {'MFU':>6}"]
    for r in rows:
        for name in (k[: -len("_warmup_s")] for k in r if k.endswith("_warmup_s")):
            peak, util = r.get(f"{name}_peak_mb"), r.get(f"{name}_mfu")
            lines.append(f"{r['length']:>6} {name:<16} {r[f'{name}_warmup_s']:>10.2f} "
                         f"{'-' if peak is None else f'{peak:.0f}':>9} {'-' if util is None else f'{util:.1%}':>6}")
    return lines + ["warm-up s: the steps before timing (a compiled model's compile time); peak MB and MFU on CUDA"]


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
    args.device = str(resolve_device(args.device))      # first: the defaults below depend on it
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
    if args.activation_checkpointing == "full" and args.compiled_only:
        raise ConfigError("--compiled-only times dense against sparse; --activation-checkpointing full times the "
                          "sparse model's modes against each other: use --compile with it instead")
    counts = parse_int_list(args.threads, "--threads", minimum=0, error=ConfigError, maximum=MAX_THREADS)
    if len(counts) != len(set(counts)):
        raise ConfigError(f"--threads lists a count twice: {args.threads!r}")
    rows = []
    for n in counts:                       # each count's rows in turn: the default beside a chosen one
        used = use_threads(n, "--threads")
        rows += [{**r, "threads": used, "threads_asked": n} for r in _rows(args, lengths)]
    return _show(args, rows, counts)


def _rows(args, lengths) -> list[dict]:
    checkpointing = args.activation_checkpointing == "full"
    common = (lengths, args.steps, args.tokens, args.preset, args.window, args.backend, args.device, args.schedule)
    if checkpointing:
        return bench_checkpointing(*common, args.compile, args.documents, loss_head=args.loss_head)
    return bench(*common, args.compile or args.compiled_only, args.documents, loss_head=args.loss_head,
                 dense_sdpa=args.dense_sdpa, eager=not args.compiled_only)


def _show(args, rows: list[dict], counts: list[int]) -> int:
    checkpointing = args.activation_checkpointing == "full"
    threads = sorted({r["threads"] for r in rows})
    if args.json:
        print(json.dumps({"preset": args.preset, "window": args.window, "schedule": args.schedule,
                          "device": args.device, "threads": threads[0] if len(threads) == 1 else threads,
                          "threads_asked": counts, "steps": args.steps,
                          "stat": "median", "spread": SPREAD, "order": "interleaved round-robin",
                          "activation_checkpointing": args.activation_checkpointing, "documents": args.documents,
                          "loss_head": args.loss_head, "dense_sdpa": args.dense_sdpa,
                          **({"peak_mb": MEMORY} if checkpointing else {}), "rows": rows}, indent=2))
        return 0
    for n in counts:
        part = [r for r in rows if r["threads_asked"] == n]
        used = f"{part[0]['threads']} thread{'s' if part[0]['threads'] != 1 else ''}" + (
            " (0: the cores free now)" if n == 0 else "")
        if checkpointing:
            print(f"training memory and throughput, preset {args.preset} shape, fib/{args.schedule} W={args.window}, "
                  f"activation checkpointing full vs none, {used}, {args.device}"
                  + (f", {args.documents} packed documents per row" if args.documents else ""))
            print(format_checkpointing_table(part, args.compile))
            continue
        print(f"training throughput, preset {args.preset} shape, fib/{args.schedule} W={args.window} vs dense, "
              f"{used}, {args.device}" + (f", {args.documents} packed documents per row" if args.documents else ""))
        if args.compiled_only:
            print("both models compiled (torch.compile, fullgraph=True)")
        print(format_table(part, args.compile and not args.compiled_only))
    if len(counts) > 1:
        print(thread_summary(rows, counts))
    return 0


def thread_summary(rows: list[dict], counts: list[int]) -> str:
    """Each thread count's tokens/s over the first count's, per length and variant (the counts timed in turn)."""
    first = {r["length"]: r for r in rows if r["threads_asked"] == counts[0]}
    lines = [f"threads side by side (each count timed in turn; over --threads {counts[0]}):"]
    for n in counts[1:]:
        for r in (r for r in rows if r["threads_asked"] == n):
            base = first[r["length"]]
            parts = [f"{k[:-len('_tok_s')]} {r[k] / base[k]:.2f}x" for k in r
                     if k.endswith("_tok_s") and base.get(k)]
            lines.append(f"  T={r['length']}: {r['threads']} thread{'s' if r['threads'] != 1 else ''}: "
                         f"{', '.join(parts)}")
    return "\n".join(lines)
