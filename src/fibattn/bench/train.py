"""``fibattn bench train``: training tokens/s of one model with dense vs sparse attention.

Both variants share the preset's shape (default ``tiny``); sparse is fib base, linear
schedule, W=12 (``--window``). Each step is forward + backward + AdamW on random
tokens, ``--tokens`` tokens per step (batch = tokens // T). After one warm-up step,
``--steps`` steps are timed; the table shows tokens/s and sparse / dense.
Goals on a CPU: >= 1.2x at T=1024 and >= 2x at T=4096.
"""
from __future__ import annotations

import copy
import json
import time

import torch

from ..config import ConfigError
from ..model import FibLM
from ..presets import get_preset

GOALS = {1024: 1.2, 4096: 2.0}


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
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (default 8192)")
    parser.add_argument("--preset", default="tiny", help="model shape: tiny | paper (default tiny)")
    parser.add_argument("--window", type=int, default=12, help="sparse window W (default 12)")
    parser.add_argument("--backend", default="auto", help="sparse backend (default auto)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default 0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def variant(preset: str, attention: str, T: int, window: int, backend: str):
    cfg = copy.deepcopy(get_preset(preset).model)
    cfg.attention, cfg.seq_len, cfg.max_seq_len = attention, T, max(cfg.max_seq_len, T)
    cfg.base, cfg.base_k, cfg.schedule, cfg.window, cfg.backend = "fib", 15, "linear", window, backend
    return cfg


def measure(model_cfg, batch: int, steps: int, device: torch.device) -> float:
    """Training tokens/s over ``steps`` timed steps (after one warm-up step)."""
    torch.manual_seed(0)
    model = FibLM(model_cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    T = model_cfg.seq_len
    x = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    y = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                    enabled=False)

    def step():
        with amp:
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
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
          device: str = "cpu") -> list[dict]:
    dev = torch.device(device)
    rows = []
    for T in lengths:
        batch = max(1, tokens // T)
        dense = measure(variant(preset, "dense", T, window, backend), batch, steps, dev)
        sparse = measure(variant(preset, "sparse", T, window, backend), batch, steps, dev)
        rows.append({"length": T, "batch": batch, "dense_tok_s": dense, "sparse_tok_s": sparse,
                     "ratio": sparse / dense, "goal": GOALS.get(T)})
    return rows


def run(args) -> int:
    lengths = _ints(args.lengths, "--lengths")
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.tokens < 2:
        raise ConfigError(f"--tokens must be >= 2, got {args.tokens}")
    if args.threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench(lengths, args.steps, args.tokens, args.preset, args.window, args.backend, args.device)
    if args.json:
        print(json.dumps({"preset": args.preset, "window": args.window, "threads": torch.get_num_threads(),
                          "rows": rows}, indent=2))
        return 0
    print(f"training throughput, preset {args.preset} shape, fib/linear W={args.window} vs dense, "
          f"{torch.get_num_threads()} threads, {args.device}")
    print(f"{'T':>6} {'batch':>5} {'dense tok/s':>12} {'sparse tok/s':>13} {'sparse/dense':>13} {'goal':>6}")
    for r in rows:
        goal = f">={r['goal']}x" if r["goal"] else ""
        print(f"{r['length']:>6} {r['batch']:>5} {r['dense_tok_s']:>12.0f} {r['sparse_tok_s']:>13.0f} "
              f"{r['ratio']:>12.2f}x {goal:>6}")
    return 0
