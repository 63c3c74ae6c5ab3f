"""``fibattn bench attention``'s command line: its flags, and the checked :class:`BenchConfig` they
give (every bad value refused in one line that names the flag, before anything runs)."""
from __future__ import annotations

import argparse

import torch

from ..checks import check_int, check_positive, float_flag, parse_int_list
from ..devices import resolve_device
from ..validation import ConfigError, check_sizes_fit
from .attention_paths import _DTYPES, CUDA_LENGTHS, DEFAULT_PATHS, DOC_PATHS, PATHS, BenchConfig, check_documents

MAX_FIB_K = 64      # fib(47) > 2^31 already: more rungs than that reach past any length
DEFAULT_DOCUMENTS = 4   # documents per row of the -docs paths when --documents is not given


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 1024,4096,16384)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up (median reported)")
    p.add_argument("--json", action="store_true",
                   help="JSON on stdout (per T and path; cpu kernel checks); table on stderr")
    p.add_argument("--memory-check", type=int, default=None, metavar="T",
                   help="run integer forward+backward at this length and report its peak extra memory")
    p.add_argument("--no-memory", action="store_true", help="skip the per-path memory subprocesses")
    p.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head size Dh (default 64)")
    p.add_argument("--window", type=int, default=12, help="dense window W (default 12)")
    p.add_argument("--fib-k", type=int, default=15, help="Fibonacci rungs K (default 15)")
    p.add_argument("--alpha", type=float_flag(1e-6, 1e6), default=1.5,       # float32 keeps it non-zero
                   help="alpha of both fused ops: integer distances round(alpha f_k), the interpolated op's "
                        "start (default 1.5)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="auto | cpu | cuda[:N] (default: cuda when available)")
    p.add_argument("--batch", type=int, default=None, help="batch size B (default 1 on CPU, 4 on CUDA)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="input dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--paths", default=None,
                   help=f"comma-separated paths among {','.join(PATHS)} (default: all on CUDA; "
                        f"{','.join(DEFAULT_PATHS['cpu'])} on CPU)")
    p.add_argument("--forward-lengths", default=None,
                   help="lengths timed forward only (default 131072 on CUDA, none on CPU)")
    p.add_argument("--documents", type=int, default=None, metavar="N",
                   help=f"also time integer-docs / interpolated-docs: N equal packed documents per row (default "
                        f"{DEFAULT_DOCUMENTS} where those paths are timed, as on CUDA; 0: leave them out)")
    p.add_argument("--mask-budget-gb", type=float, default=8.0,
                   help="skip the mask path when its estimated memory (~17 bytes x T^2) exceeds this")


def _check_fits(lengths, forward, batch, heads, kv, head_dim, dtype, device, memory_check=None) -> None:
    """Refuse lengths whose inputs, outputs and gradients alone exceed the device's memory (a lower bound)."""
    item = _DTYPES[dtype].itemsize
    sizes = f"--batch {batch}, --heads {heads}, --kv-heads {kv}, --head-dim {head_dim}, {dtype}"
    # each size alone first (the others at 1), so that the flag blamed is the one too large by itself
    for flag, value in (("--batch", batch), ("--heads", heads), ("--kv-heads", kv), ("--head-dim", head_dim),
                        ("--lengths", max(lengths, default=1)), ("--forward-lengths", max(forward, default=1)),
                        ("--memory-check", memory_check or 1)):
        check_sizes_fit(flag, [value], lambda n: 2 * 2 * n * item, f"q, k, v and the output with every other "
                        f"size at 1 ({dtype})", device)
    for flag, values, copies, what in (("--lengths", lengths, 4, "q, k, v and the output with their gradients"),
                                       ("--forward-lengths", forward, 2, "q, k, v and the output"),
                                       ("--memory-check", [memory_check] if memory_check else [], 4,
                                        "q, k, v and the output with their gradients")):
        check_sizes_fit(flag, values, lambda T, c=copies: c * batch * T * (heads + kv) * head_dim * item,
                        f"{what} ({sizes})", device)


def config_from_args(args) -> BenchConfig:
    device = str(resolve_device(args.device))        # first: the defaults and checks below depend on it
    cuda = device.startswith("cuda")
    if args.lengths is None:
        lengths = [] if args.memory_check else (list(CUDA_LENGTHS) if cuda else [1024, 4096, 16384])
    else:
        lengths = parse_int_list(args.lengths, "--lengths", error=ConfigError, empty=True)
    if args.forward_lengths is None:
        forward = [131072] if cuda and not args.memory_check and args.lengths is None else []
    else:
        forward = parse_int_list(args.forward_lengths, "--forward-lengths", error=ConfigError, empty=True)
    paths, documents = _paths(args, cuda, lengths + forward)
    return _rest(args, device, cuda, lengths, forward, paths, documents)


def _paths(args, cuda: bool, lengths: list[int]) -> tuple[list[str], int]:
    """The paths timed and the documents per row of their -docs paths; errors name what was given."""
    docs = set(DOC_PATHS.values())
    if args.paths is None:
        paths = [p for p in DEFAULT_PATHS["cuda" if cuda else "cpu"] if args.documents != 0 or p not in docs]
    else:
        paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        raise ConfigError(f"--paths must list some of {', '.join(PATHS)}, got {args.paths!r}")
    if args.documents is not None and args.documents < 0:
        raise ConfigError(f"--documents must be an integer >= 1 (0: off), got {args.documents}")
    if args.documents == 0 and docs.intersection(paths):
        raise ConfigError(f"--paths {args.paths}: the -docs paths need documents per row; drop --documents 0 "
                          f"(default {DEFAULT_DOCUMENTS}) or give --documents N >= 1")
    documents = args.documents if args.documents is not None else (
        DEFAULT_DOCUMENTS if docs.intersection(paths) else 0)
    if documents:
        check_documents(documents, lengths, given=args.documents is not None)
        paths = [q for p in paths for q in ((p, DOC_PATHS[p]) if p in DOC_PATHS and DOC_PATHS[p] not in paths
                                            else (p,))]
    return paths, documents


def _rest(args, device: str, cuda: bool, lengths, forward, paths, documents) -> BenchConfig:
    batch = (4 if cuda else 1) if args.batch is None else args.batch
    if batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {batch}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if args.memory_check is not None and args.memory_check < 1:
        raise ConfigError(f"--memory-check must be a length >= 1, got {args.memory_check}")
    kv = (2 if cuda else args.heads) if args.kv_heads is None else args.kv_heads
    if args.heads < 1 or kv < 1 or args.heads % kv:
        raise ConfigError(f"--heads ({args.heads}) must be a positive multiple of --kv-heads ({kv})")
    if args.head_dim < 1:
        raise ConfigError(f"--head-dim must be >= 1, got {args.head_dim}")
    if args.mask_budget_gb <= 0:
        raise ConfigError(f"--mask-budget-gb must be > 0, got {args.mask_budget_gb}")
    pattern = _pattern(args)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    _check_fits(lengths, forward, batch, args.heads, kv, args.head_dim, dtype, device, args.memory_check)
    return BenchConfig(lengths=lengths, repeats=args.repeats, heads=args.heads, kv_heads=kv,
                       head_dim=args.head_dim, device=device, mask_budget_gb=args.mask_budget_gb,
                       memory=not args.no_memory, memory_check=args.memory_check, batch=batch, dtype=dtype,
                       paths=paths, forward_lengths=forward, documents=documents, **pattern)


def _pattern(args) -> dict:
    """``window``, ``fib_k`` and ``alpha`` of the attended pattern, checked (a UsageError names the flag)."""
    out = {"window": check_int("--window", args.window, 0), "fib_k": check_int("--fib-k", args.fib_k, 1),
           "alpha": check_positive("--alpha", args.alpha)}
    if out["fib_k"] > MAX_FIB_K:
        raise ConfigError(f"--fib-k must be an integer from 1 to {MAX_FIB_K}, got {args.fib_k}")
    return out
