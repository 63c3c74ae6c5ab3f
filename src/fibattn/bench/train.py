"""``fibattn bench train``: training tokens/s of one model with dense vs sparse attention.

Both variants share the preset's shape (default ``tiny``); sparse is fib base, linear
schedule (``--schedule learned`` for a learned alpha), W=12 (``--window``). Each step is
forward + backward + AdamW on random tokens, ``--tokens`` tokens per step (batch =
tokens // T; default 8192 on CPU, 32768 on CUDA, the study's step), bf16 autocast on
CUDA. After one warm-up step, ``--steps`` steps are timed; the table shows tokens/s and
sparse / dense. ``--compile`` also times both models under ``torch.compile(fullgraph=True)``
(warm-up includes the compilation) and prints compiled / eager.
Goals: sparse / dense >= 1.2x at T=1024 and >= 2x at T=4096 on a CPU, >= 1.0x and >= 1.5x
on CUDA; compiled / eager >= 1.0x.
"""
from __future__ import annotations

import copy
import json
import time

import torch

from ..config import ConfigError
from ..model import FibLM
from ..presets import get_preset

GOALS = {"cpu": {1024: 1.2, 4096: 2.0}, "cuda": {1024: 1.0, 4096: 1.5}}


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 2 for v in vals):
        raise ConfigError(f"{name} must list integers >= 2, got {text!r}")
    return vals


def configure_parser(parser) -> None:
    parser.add_argument("--lengths", default="1024,4096", help="sequence lengths (default 1024,4096)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (default 3)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step (default 8192 on CPU, 32768 on CUDA)")
    parser.add_argument("--preset", default="tiny", help="model shape: tiny | paper (default tiny)")
    parser.add_argument("--window", type=int, default=12, help="sparse window W (default 12)")
    parser.add_argument("--backend", default="auto", help="sparse backend (default auto)")
    parser.add_argument("--schedule", default="linear", choices=("linear", "learned"),
                        help="sparse schedule: linear (static) or learned alpha (default linear)")
    parser.add_argument("--compile", action="store_true",
                        help="also time both models under torch.compile(fullgraph=True)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default 0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def variant(preset: str, attention: str, T: int, window: int, backend: str, schedule: str = "linear"):
    cfg = copy.deepcopy(get_preset(preset).model)
    cfg.attention, cfg.seq_len, cfg.max_seq_len = attention, T, max(cfg.max_seq_len, T)
    cfg.base, cfg.base_k, cfg.schedule, cfg.window, cfg.backend = "fib", 15, schedule, window, backend
    cfg.learned_init = "linear"
    return cfg


def measure(model_cfg, batch: int, steps: int, device: torch.device, compiled: bool = False) -> float:
    """Training tokens/s over ``steps`` timed steps (after one warm-up step)."""
    torch.manual_seed(0)
    model = FibLM(model_cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model, fullgraph=True) if compiled else model
    T = model_cfg.seq_len
    x = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    y = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                    enabled=False)

    def step():
        with amp:
            _, loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if compiled:
        step()              # the backward graph of a compiled model is built on its first use
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return batch * T * steps / wall


def bench(lengths, steps: int, tokens: int, preset: str = "tiny", window: int = 12, backend: str = "auto",
          device: str = "cpu", schedule: str = "linear", compiled: bool = False) -> list[dict]:
    dev = torch.device(device)
    goals = GOALS["cuda" if dev.type == "cuda" else "cpu"]
    rows = []
    for T in lengths:
        batch = max(1, tokens // T)
        cfgs = {a: variant(preset, a, T, window, backend, schedule) for a in ("dense", "sparse")}
        row = {"length": T, "batch": batch}
        for a in ("dense", "sparse"):
            row[f"{a}_tok_s"] = measure(cfgs[a], batch, steps, dev)
        row.update(ratio=row["sparse_tok_s"] / row["dense_tok_s"], goal=goals.get(T))
        if compiled:
            for a in ("dense", "sparse"):
                row[f"{a}_compiled_tok_s"] = measure(cfgs[a], batch, steps, dev, compiled=True)
                row[f"{a}_compiled_over_eager"] = row[f"{a}_compiled_tok_s"] / row[f"{a}_tok_s"]
        rows.append(row)
    return rows


def run(args) -> int:
    lengths = _ints(args.lengths, "--lengths")
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.tokens is None:
        args.tokens = 32768 if args.device.startswith("cuda") else 8192
    if args.tokens < 2:
        raise ConfigError(f"--tokens must be >= 2, got {args.tokens}")
    if args.threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench(lengths, args.steps, args.tokens, args.preset, args.window, args.backend, args.device,
                 args.schedule, args.compile)
    if args.json:
        print(json.dumps({"preset": args.preset, "window": args.window, "schedule": args.schedule,
                          "device": args.device, "threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return 0
    print(f"training throughput, preset {args.preset} shape, fib/{args.schedule} W={args.window} vs dense, "
          f"{torch.get_num_threads()} threads, {args.device}")
    print(f"{'T':>6} {'batch':>5} {'dense tok/s':>12} {'sparse tok/s':>13} {'sparse/dense':>13} {'goal':>6}")
    for r in rows:
        goal = f">={r['goal']}x" if r["goal"] else ""
        print(f"{r['length']:>6} {r['batch']:>5} {r['dense_tok_s']:>12.0f} {r['sparse_tok_s']:>13.0f} "
              f"{r['ratio']:>12.2f}x {goal:>6}")
    if args.compile:
        print("\ncompiled (torch.compile, fullgraph=True) vs eager")
        print(f"{'T':>6} {'dense tok/s':>12} {'compiled/eager':>15} {'sparse tok/s':>13} {'compiled/eager':>15}")
        for r in rows:
            print(f"{r['length']:>6} {r['dense_compiled_tok_s']:>12.0f} {r['dense_compiled_over_eager']:>14.2f}x "
                  f"{r['sparse_compiled_tok_s']:>13.0f} {r['sparse_compiled_over_eager']:>14.2f}x")
    return 0
