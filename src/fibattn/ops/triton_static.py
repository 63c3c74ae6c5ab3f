"""What ``tools/gpu_static.py`` compiles for sm_90 without a device: the ``triton`` backend's kernels
(:mod:`fibattn.ops.triton_backend`) with the tiles (:mod:`fibattn.ops.triton_config`), signature, specialisations
and launch options a real launch gives them, and what each program of an interior tile does (loops, products,
bytes)."""
from __future__ import annotations

import functools

from . import triton_occupancy
from .triton_config import config, forward_tiles, kernels, key_pass_rows, key_pass_rungs, query_pass_rungs

SM90 = ("cuda", 90, 32)            # the GPUTarget the static tool compiles for (H100 / H200)


def static_kernels(group: int, head_dim: int, window: int, n_rungs: int, two_tap: bool,
                   dtype: str = "bf16", docs: bool = False) -> list[dict]:
    """What ``tools/gpu_static.py`` compiles for sm_90 without a device: one dict per kernel of a
    forward + backward (the fractional op's one-program plan launch aside), with ``loop_trips``
    (the trip count of each outermost loop, in source order, for a program of an interior tile),
    ``query_heads`` ((query, head) rows a program serves), ``rows_per_program`` (positions of
    ``T``), ``tensor_flops_per_program`` (its ``tl.dot`` products) and ``bytes_per_program`` (what it
    reads from and writes to memory once: q/k/v-shaped rows, statistics, the rungs' ``P``/``dS``; not
    the documents' int32 offsets, < 1 % of it) and ``launches`` (two for a kernel launched once unchecked and
    once checked: the unchecked one is compiled, ``CHECK=False``). ``docs``: the kernels with documents (``off``)."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    kern = kernels()
    cfg = config(group, head_dim, window)
    opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"),
                **({"maxnreg": cfg.pop("maxnreg")} if "maxnreg" in cfg else {}))
    el = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    tdt = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    # the tile choices as a launch on an sm_90 device makes them (triton_config._chosen)
    dims = dict(ACC=tl.float32, IN=tdt, DOT=tdt, DH=head_dim, WIDE=False, **cfg,
                choose=functools.partial(triton_occupancy.choose, dtype=dtype, head_dim=head_dim, options=opts,
                                         target=GPUTarget(*SM90)))
    M, BN, D = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"]
    tiles_f = forward_tiles(dims, two_tap, docs)          # with "maxnreg" where the choice is a capped variant
    bn_f, RB, MC = tiles_f["BLOCK_N"], tiles_f["RB"], tiles_f["MC"]
    GM = cfg["BLOCK_G"] * M
    band = -(-(M + window) // BN)               # band steps of an interior tile (the forward's: band_f)
    band_f = -(-(M + window) // bn_f)
    chunks = -(-n_rungs // RB)
    rungs_dq = query_pass_rungs(dims, two_tap, docs)
    dq_chunks = -(-n_rungs // rungs_dq["RB"])
    band_q = -(-(M + window) // cfg["BLOCK_Q"])   # the key pass's band steps
    half = dtype in ("bf16", "fp16")
    mm = 2.0 * D                                 # flops of one (row, column) product
    split_p = 2 if half and cfg["SPLIT_P"] else 1          # probabilities in as hi + lo
    # forward: band q.k and p.v; rung blocks q.k and p.v, each per tap
    taps = 2 if two_tap else 1
    fwd = band_f * GM * bn_f * mm * (1 + split_p) + chunks * GM * RB * MC * mm * taps * (1 + split_p)
    rb_dq, mc_dq = rungs_dq["RB"], rungs_dq["MC"]
    dq = band * GM * BN * mm * 3 + dq_chunks * GM * rb_dq * mc_dq * mm * 3 * taps      # q.k, dout.v, dS.k per tap
    dkdv = (band_q * cfg["BLOCK_G"] * cfg["BLOCK_Q"] * M * mm * (4 + split_p)
            + n_rungs * taps * M * GM * mm * (1 + split_p))
    q_rows, kv_rows, stats = GM * head_dim * el, M * head_dim * el, GM * 4
    rung_stats = 2 * GM * n_rungs * 4            # P and dS of the rungs, float32 (and d frac: 3 with two taps)
    keys = key_pass_rows(M, two_tap)             # key rows a program of the key pass owns (writes)
    rungs_k = key_pass_rungs(dims, two_tap, docs)
    rbk = rungs_k["RBK"]
    plans = [(kern.fwd_kernel, "forward", tiles_f, [band_f, chunks], fwd,
              2 * q_rows + 2 * kv_rows + stats, M),
             (kern.bwd_dq_kernel, "backward", {"NEED_DFRAC": two_tap, **rungs_dq}, [band, dq_chunks], dq,
              4 * q_rows + 2 * kv_rows + 2 * stats + rung_stats * (3 if two_tap else 2) // 2, M),
             (kern.bwd_dkdv_kernel, "backward", {"KEYS": keys, **rungs_k}, [band_q, -(-n_rungs // rbk)], dkdv,
              2 * q_rows + 4 * kv_rows + 2 * stats + rung_stats, keys)]
    res = []
    for fn, kind, extra, trips, flops, nbytes, rows in plans:
        consts = {k: v for k, v in dict(TWO_TAP=two_tap, HAS_DOCS=docs, CHECK=False, **dims).items()
                  if k in fn.arg_names}
        cap = {k: extra.pop(k) for k in list(extra) if k == "maxnreg"}     # a chosen capped variant's option
        consts.update(extra, **({} if docs else {"OFF": None}))          # no documents: launched with off=None
        sig, aligned = triton_occupancy.signature(fn, consts, dtype, head_dim)
        tags = ", ".join(t for t, on in (("two-tap", two_tap), ("documents", docs)) if on)
        name = fn.__name__ + (f" ({tags})" if tags else "")
        res.append(dict(name=name, fn=fn, signature=sig, attrs=aligned,
                        constexprs=consts, loop_trips=trips, query_heads=cfg["BLOCK_G"] * rows, rows_per_program=rows,
                        columns=window + 1 + n_rungs, tensor_flops_per_program=flops, bytes_per_program=nbytes,
                        launches=2 if "CHECK" in fn.arg_names else 1, **{"pass": kind}, **opts, **cap))
    return res
