"""``fibattn bench context-parallel``: what context parallelism sends, from the plan and measured.

**Plan.** For each length ``T`` and context size ``P`` (chunk ``c = T / P``), the rows of keys and
values a rank receives per layer before its attention (:mod:`fibattn.parallel.halo`; the worst
rank and layer of the preset's model, both taps of interpolated rungs counted), their bytes
(keys and values, ``2 · Hkv · Dh`` elements a row, bf16), and ring attention's / an all-gather's
``c · (P − 1)`` rows beside them as a ratio. Goal: flat in ``T`` and ``P`` while the largest
distance is below the chunk; at ``T = 256K``, ``P = 8`` with the paper preset ≥ 100× fewer.

**Measured** (``--measure T``): ``P`` gloo processes of this machine (``--measure-ranks``, ≤ 4)
run the preset's model at length ``T`` split across them — forward and backward, or the forward
alone (``--forward-only``, an evaluation) — counting the rows each rank actually receives per layer
(compared with the plan) and each rank's peak memory (its peak RSS over the RSS before the step),
next to one process running the whole sequence.
"""
from __future__ import annotations

import json
import os
import resource
import tempfile

import torch

from ..checks import UsageError, parse_int_list
from ..presets import get_preset

PLAN_LENGTHS = "16384,65536,262144,1048576"
PLAN_RANKS = "2,4,8,64"
MAX_PLAN_RANKS = 256      # the plan's cost grows with P squared: 0.8 s at P = 64, a minute at P = 512


def configure_parser(parser) -> None:
    parser.add_argument("--preset", default="paper", help="model whose distances are planned (default paper)")
    parser.add_argument("--lengths", default=PLAN_LENGTHS, help=f"sequence lengths T (default {PLAN_LENGTHS})")
    parser.add_argument("--ranks", default=PLAN_RANKS, help=f"context sizes P (default {PLAN_RANKS})")
    parser.add_argument("--measure", type=int, default=0, metavar="T",
                        help="also run the preset's model at length T split across --measure-ranks gloo processes")
    parser.add_argument("--measure-ranks", type=int, default=None, metavar="P",
                        help="processes for --measure (2..4, default 2)")
    parser.add_argument("--forward-only", action="store_true", help="--measure: the forward alone (an evaluation)")
    parser.add_argument("--json", action="store_true", help="one JSON record per line instead of a table")


def _layers(model_cfg):
    from ..model.attention import FibAttention
    return [FibAttention.from_config(model_cfg, i) for i in range(model_cfg.n_layers)]


def plan_records(model_cfg, lengths, ranks) -> list[dict]:
    """One record per (T, P): the worst rank's and layer's rows and bytes received, and ring's rows."""
    from ..parallel import halo_plan, layer_dists, ring_rows
    layers = _layers(model_cfg)
    row_bytes = 2 * model_cfg.n_kv_heads * (model_cfg.d_model // model_cfg.n_heads) * 2
    out = []
    for T in lengths:
        sets = {tuple(d) if (d := layer_dists(layer, T)) is not None else None for layer in layers}
        for P in ranks:
            if T % P:
                continue
            c = T // P
            rows = max(halo_plan(d, r, P, c).rows_received for d in sets for r in range(P))
            ring = ring_rows(P, c)
            largest = max((max(d) for d in sets if d), default=0)
            out.append(dict(T=T, P=P, chunk=c, halo_rows=rows, halo_bytes=rows * row_bytes, ring_rows=ring,
                            ring_bytes=ring * row_bytes, ratio=ring / rows if rows else float("inf"),
                            largest_distance=largest))
    return out


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _worker(rank: int, P: int, init: str, preset: str, T: int, forward_only: bool, out: str) -> None:
    import torch.distributed as tdist

    from ..model.lm import FibLM
    from ..parallel import ContextShard, context, sharded
    torch.set_num_threads(1)
    if P > 1:
        tdist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=P)
    cfg = get_preset(preset).model
    cfg.max_seq_len = max(cfg.max_seq_len, T)
    torch.manual_seed(0)
    model = FibLM(cfg)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (1, T), generator=g) for _ in range(2))
    received: list[int] = []
    context.RECEIVED = received
    base = _rss_mb()
    with torch.no_grad() if forward_only else torch.enable_grad():
        if P > 1:
            shard = ContextShard(None, tuple(range(P)), rank, T)
            with sharded(model, shard):
                loss = model(shard.local(x), shard.local(y), offset=shard.start)[1]
        else:
            loss = model(x, y)[1]
        if not forward_only:
            loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    context.RECEIVED = None
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "rows_per_layer": received[:cfg.n_layers], "peak_extra_mb": peak}, f)
    if P > 1:
        tdist.destroy_process_group()


def measure(preset: str, T: int, P: int, forward_only: bool) -> dict:
    """Rows received per rank and layer and peak memory, split across ``P`` processes and in one."""
    import torch.multiprocessing as mp
    res = {}
    # a fixed mmap threshold: glibc's adaptive one keeps freed blocks up to 32 MB on the heap, and the
    # high-water RSS then measures the allocator's history, not the tensors alive at the peak
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, P):
            out = os.path.join(tmp, f"ranks{n}")
            mp.spawn(_worker, args=(n, os.path.join(tmp, f"init{n}"), preset, T, forward_only, out), nprocs=n)
            res[n] = [json.load(open(f"{out}.{r}")) for r in range(n)]
    return {"T": T, "P": P, "forward_only": forward_only, "one_process_mb": res[1][0]["peak_extra_mb"],
            "ranks": res[P]}


def _check_measure_fits(cfg, T: int) -> None:
    """Refuse a ``--measure`` length whose one-process run (the comparison) cannot fit this machine's memory: fp32
    weights and gradients, eight saved activations per token and layer, the logits and their gradient."""
    from ..validation import check_sizes_fit, estimate_params
    n = estimate_params(cfg)
    check_sizes_fit("--measure", [T], lambda t: 8 * n + t * 4 * (8 * cfg.n_layers * cfg.d_model + 2 * cfg.vocab_size),
                    "the model's weights, gradients and activations in one process (fp32, batch 1)", "cpu")


def format_plan(records: list[dict], preset: str) -> str:
    lines = [f"context parallelism, {preset} preset: rows (and MB of bf16 keys + values) a rank receives per layer",
             f"{'T':>9} {'P':>4} {'chunk':>8} {'largest d':>9} {'halo rows':>10} {'halo MB':>9} "
             f"{'ring rows':>10} {'ring MB':>9} {'ring/halo':>10}"]
    for r in records:
        lines.append(f"{r['T']:>9} {r['P']:>4} {r['chunk']:>8} {r['largest_distance']:>9} {r['halo_rows']:>10} "
                     f"{r['halo_bytes'] / 2 ** 20:>9.3f} {r['ring_rows']:>10} {r['ring_bytes'] / 2 ** 20:>9.1f} "
                     f"{r['ratio']:>9.0f}x")
    return "\n".join(lines)


def format_measured(m: dict, plan: list[int]) -> str:
    what = "forward" if m["forward_only"] else "forward + backward"
    lines = [f"measured ({what}, T={m['T']}, {m['P']} gloo processes): one process peak extra "
             f"{m['one_process_mb']:.0f} MB"]
    for r in m["ranks"]:
        lines.append(f"  rank {r['rank']}: rows received per layer {r['rows_per_layer']} (plan "
                     f"{plan[r['rank']]}), peak extra {r['peak_extra_mb']:.0f} MB "
                     f"({r['peak_extra_mb'] / max(m['one_process_mb'], 1e-9):.2f} of one process)")
    return "\n".join(lines)


def run(args) -> int:
    lengths = parse_int_list(args.lengths, "--lengths")
    ranks = parse_int_list(args.ranks, "--ranks", maximum=MAX_PLAN_RANKS)
    if args.measure < 0:
        raise UsageError(f"--measure must be a length T >= 1 (0: off), got {args.measure}")
    if not args.measure and (args.measure_ranks is not None or args.forward_only):     # would be ignored
        given = "--measure-ranks" if args.measure_ranks is not None else "--forward-only"
        raise UsageError(f"{given} applies to --measure T, which was not given; add --measure T or drop {given}")
    args.measure_ranks = 2 if args.measure_ranks is None else args.measure_ranks
    cfg = get_preset(args.preset).model
    records = plan_records(cfg, lengths, ranks)
    if not records:
        raise UsageError(f"--lengths {args.lengths} / --ranks {args.ranks}: no length is divisible by a rank count")
    if args.measure and not 2 <= args.measure_ranks <= 4:
        raise UsageError(f"--measure-ranks must be 2, 3 or 4 (processes on this machine), got {args.measure_ranks}")
    if args.measure and args.measure % args.measure_ranks:
        raise UsageError(f"--measure {args.measure} must be divisible by --measure-ranks {args.measure_ranks}")
    if args.measure:
        _check_measure_fits(cfg, args.measure)
    print("\n".join(json.dumps(r) for r in records) if args.json else format_plan(records, args.preset), flush=True)
    if args.measure:
        from ..parallel import halo_plan, layer_dists
        T, P = args.measure, args.measure_ranks
        layers = _layers(cfg)
        plan = [[halo_plan(layer_dists(layer, T), r, P, T // P).rows_received for layer in layers]
                for r in range(P)]
        m = measure(args.preset, T, P, args.forward_only)
        print(json.dumps({**m, "plan_rows_per_layer": plan}) if args.json else format_measured(m, plan), flush=True)
    return 0
