"""``fibattn generate``: stream text from a trained run with constant-memory sparse caches."""
from __future__ import annotations

import itertools
import logging
import math
import sys
import time

from ..checks import SEED_MAX, UsageError, check_int, int_flag
from ..devices import resolve_device
from ..generation.decode import generate
from ..generation.static import DECODE_MODES
from ..generation.text import TextStream
from ..model.rope import SCALING_KINDS, check_factor
from ..storage.pretrained import load_model
from ..storage.runs import parse_step
from ..threads import use_threads

log = logging.getLogger("fibattn")


def configure_parser(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="a training run folder, a checkpoint folder or an export folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="tokens to generate after the prompt (default 200)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int_flag(0, SEED_MAX), default=None,
                        help="sampling seed, for repeatable output (default: a fresh one each call)")
    parser.add_argument("--step", default="latest", help="checkpoint step (default: latest)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the cores free now)")
    parser.add_argument("--rope-scaling", default="none", metavar="KIND",
                        help="none (default) | linear | ntk | yarn: RoPE scaling while generating (method.md §7)")
    parser.add_argument("--rope-factor", type=float, default=None, metavar="F",
                        help="RoPE scaling factor >= 1 (default: context / training length, at least 1)")
    parser.add_argument("--decode", default="auto", choices=DECODE_MODES,
                        help="auto (default: compiled on CUDA, eager elsewhere) | eager | static (one shape per step, "
                             "a CUDA graph on CUDA) | compiled (static through torch.compile)")
    parser.add_argument("--prefill-chunk", type=int_flag(1), default=None, metavar="N",
                        help="prompt tokens per prefill pass (default 8192): a prompt of any length takes one "
                             "chunk's activations")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="runtime model setting: model.reach, model.backend or model.max_seq_len")


def _check_flags(args) -> None:
    check_int("--max-new-tokens", args.max_new_tokens, 1)    # 0 would print the prompt back as a "generation"
    check_int("--top-k", args.top_k, 0)
    if args.seed is not None:
        check_int("--seed", args.seed, 0)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not (0 < args.top_p <= 1):
        raise UsageError(f"--top-p must be a number in (0, 1] (1 = off), got {args.top_p}")
    kind, factor = getattr(args, "rope_scaling", "none"), getattr(args, "rope_factor", None)
    if kind not in SCALING_KINDS:
        raise UsageError(f"--rope-scaling must be one of {', '.join(SCALING_KINDS)}, got {kind!r}")
    if factor is not None:
        check_factor(factor, "--rope-factor")
        if kind == "none":
            raise UsageError(f"--rope-factor applies with --rope-scaling linear, ntk or yarn, got --rope-scaling "
                             f"none and --rope-factor {factor:g}")


def run(args, out=None) -> int:
    out = out or sys.stdout
    _check_flags(args)                     # named as flags here, before the model is loaded
    step = parse_step(args.step)
    device = resolve_device(args.device)
    use_threads(args.threads, "--threads")
    model, tokenizer = load_model(args.run_dir, step=step, device=device, model_overrides=args.overrides)
    if tokenizer is None:
        raise UsageError(f"{args.run_dir} has no tokenizer (tokenizer.json in the checkpoint, export or data folder)")
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise UsageError("--prompt encodes to no tokens; give a non-empty prompt")
    eos = getattr(tokenizer, "eos_id", None)
    kind, factor = getattr(args, "rope_scaling", "none"), getattr(args, "rope_factor", None)
    steps = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                     stop_ids=() if eos is None else (eos,), rope_scaling=kind, rope_factor=factor,
                     decode=getattr(args, "decode", "auto"), prefill_chunk=getattr(args, "prefill_chunk", None))
    if kind != "none":
        sparse = any(layer.attention == "sparse" for layer in model.layers())
        log.info("fibattn generate: RoPE scaling %s, factor %s%s", kind,
                 f"{factor:g}" if factor else "context / training length (at least 1)",
                 " (on a sparse model: the angles of the attended distances change)" if sparse else "")
    stream = TextStream(tokenizer)
    t0 = time.perf_counter()
    first = next(steps, None)             # the prefill, whose notes (backend auto -> ...) precede the text
    getattr(args, "_logs_before_output", lambda: None)()     # held notes out now, never inside the text
    out.write(args.prompt)
    out.flush()
    n = 0
    for st in () if first is None else itertools.chain((first,), steps):
        n += 1
        out.write(stream.push(int(st.tokens[0])))
        out.flush()
    out.write(stream.flush() + "\n")
    out.flush()
    dt = time.perf_counter() - t0
    log.info("fibattn generate: %d tokens in %.2f s (%.1f tok/s)", n, dt, n / dt if dt > 0 else float("nan"))
    return 0
