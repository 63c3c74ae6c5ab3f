"""The ``triton`` backend's tiles: block sizes, warps and pipeline stages of each kernel's launch, from rules on the
setting's sizes (:func:`config`), the environment (:data:`SETTINGS`) and, where a choice trades instructions for
registers, the compiled code (:func:`_chosen`, ``triton_occupancy``). ``tools/gpu_static.py`` compiles with the
same choices (``triton_static``). Also where the kernels module is imported, once ``TRITON_INTERPRET`` is settled.
"""
from __future__ import annotations

import functools
import os

from ..checks import UsageError


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def kernels():
    from . import triton_kernels
    return triton_kernels


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _env_int(key: str, default: int) -> int:
    raw = os.environ.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{key} must be a power of two, got {raw!r}") from None
    if value < 1 or value & (value - 1):
        raise UsageError(f"{key} must be a power of two, got {value}")
    return value


def _env_choice(key: str, default: int, allowed: tuple) -> int:
    """One of ``allowed`` from the environment."""
    raw = os.environ.get(key)
    if raw is None:
        return default
    if raw.strip() not in [str(a) for a in allowed]:
        raise UsageError(f"{key} must be one of {', '.join(map(str, allowed))}, got {raw!r}")
    return int(raw)


def _env_tile(key: str, default: int) -> int:
    """A tile side from the environment (:func:`_env_int`): at least 16, a tensor-core product's least size."""
    value = _env_int(key, default)
    if value < 16:
        raise UsageError(f"{key} must be at least 16 (a tensor-core product's least size), got {value}")
    return value


def config(group: int, head_dim: int, window: int) -> dict:
    """Tile sizes and warps of a launch (one choice per group size, head size and window, never per T).

    ``BLOCK_M = 16`` positions per program, the ``G`` query heads that share a key/value head stacked on them:
    ``G·16`` tile rows (64 for the goal setting: one Hopper warpgroup). ``BLOCK_N`` keys per band step cover
    ``M + W`` (up to 64 at a time); the key pass's band takes ``BLOCK_Q`` query positions per step. The forward
    and the query pass take the rungs in chunks of ``MC`` positions (:func:`rung_chunk`), ``RB`` rungs a step;
    the key pass ``RBK`` rungs a step, its rung blocks placed by products or by selects (``PRODUCTS``;
    ``triton_backward._placed``). ``RUNGS`` (``(MC, RB)`` pairs), ``RB_KEY_PASS`` (``(RBK, PRODUCTS)`` pairs) and
    ``BLOCK_N_TWO_TAP_DOCS`` (the two-tap forward's band step with documents) are candidates, in order of
    preference, that a launch on CUDA chooses from by the compiled code (:func:`_chosen`).
    The figures in the comments are ``tools/gpu_static.py``'s, for the goal setting.
    """
    bg, bd = _pow2(group), max(_pow2(head_dim), 16)
    bm = _env_tile("FIBATTN_TRITON_BLOCK_M", 16)
    bn = min(64, max(16, _pow2(bm + window)))
    # the key pass's band step takes G heads x BLOCK_Q query rows: at most a warpgroup's 64 (4 heads x 32 rows
    # held 186 registers, 2 programs per SM; x 16 rows 144, 3)
    bq = _env_tile("FIBATTN_TRITON_BLOCK_Q", min(bn, max(16, 64 // bg)))
    warps = _env_int("FIBATTN_TRITON_WARPS", 4 if bg * bm <= 64 else 8)
    # three choices trade instructions for registers, and the compiled code decides them (triton_occupancy): the
    # rungs' chunks and step in the forward and the query pass (chunks of 4 positions at 4 rungs a step: 22 % fewer
    # instructions than one chunk at 2 in the integer forward, 14 % in the query pass; two-tap, the query pass holds
    # 178 registers so, 168 in one chunk), the key pass's rungs
    # a step (two: 8-16 % fewer, a block of 2·G·M gathered query rows) and the two-tap forward's band step with
    # documents (32 keys, or 16). Candidates in order of preference; a setting in the environment is the only one
    mc = rung_chunk(bg, bm)
    rungs = _rung_candidates(mc, bm)
    # the key pass places its rung blocks by products where it can (unchecked: 9 % fewer instructions a step), but
    # they hold 0 / 1 blocks in registers: with documents two-tap, selects keep two rungs a step within 168
    rb_keys = tuple((rbk, prod) for rbk in _env_candidates("FIBATTN_TRITON_RB_KEY_PASS", (2, 1), _env_int)
                    for prod in _env_candidates("FIBATTN_TRITON_KEY_PASS_PRODUCTS", (1, 0),
                                                lambda k, d: _env_choice(k, d, (0, 1))))
    bn_docs = _env_candidates("FIBATTN_TRITON_BLOCK_N_TWO_TAP_DOCS", (bn, 16), _env_tile)
    # two stages: the loops' next gathers in flight while a step computes. One costs 7-16 % fewer instructions by
    # tools/gpu_static.py, but its model cannot price the loads' latency then left bare: the GPU check's sweep times it
    # SPLIT_P 0 (FIBATTN_TRITON_SPLIT_P): probabilities into P·V as one half-precision part, not hi + lo — for
    # timing what the split costs (issue 56 item 3), at half precision's accuracy
    return dict(BLOCK_G=bg, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, BLOCK_Q=bq, MC=rungs[0][0], RB=rungs[0][1],
                RUNGS=rungs, BLOCK_N_TWO_TAP_DOCS=bn_docs, RB_KEY_PASS=rb_keys,
                SPLIT_P=_env_choice("FIBATTN_TRITON_SPLIT_P", 1, (0, 1)), num_warps=warps,
                num_stages=_env_choice("FIBATTN_TRITON_STAGES", 2, (1, 2, 3, 4)), **register_cap())


def rung_chunk(block_g: int, block_m: int) -> int:
    """Tile positions a rung chunk takes (``MC``; ``triton_kernels``): a rung's scores are the block diagonal of
    each chunk's ``(G·MC) × (RB·MC)`` product, so ``MC`` is the factor of wasted work; ``G·MC = 16`` rows, the
    least a tensor-core product takes (``FIBATTN_TRITON_RUNG_CHUNK``: at most ``BLOCK_M``, the one-chunk tile)."""
    mc = _env_int("FIBATTN_TRITON_RUNG_CHUNK", min(block_m, max(1, 16 // block_g)))
    if mc > block_m:
        raise UsageError(f"FIBATTN_TRITON_RUNG_CHUNK must be at most FIBATTN_TRITON_BLOCK_M ({block_m}), got {mc}")
    return mc


def _rung_candidates(mc: int, bm: int) -> tuple:
    """``(MC, RB)`` candidates of the forward and the query pass (:func:`config`): the rung chunks, at as many rungs
    a step as make ``RB·MC >= 16`` columns (a tensor-core product's least depth: ``P·V`` and ``dS·K`` contract over
    them; at least 2), then the one-chunk tile at two rungs a step and one. ``FIBATTN_TRITON_RUNG_CHUNK`` keeps
    its chunk; ``FIBATTN_TRITON_RUNG_STEP`` sets the step at it, the only candidate."""
    key = "FIBATTN_TRITON_RUNG_STEP"
    if os.environ.get(key) is not None:
        step = _env_int(key, 2)
        if step * mc < 16:
            raise UsageError(f"{key} must be at least {-(-16 // mc)} at rung chunks of {mc} (the {mc} x RB columns "
                             f"of a step are a tensor-core product's depth, at least 16), got {step}")
        return ((mc, step),)
    if os.environ.get("FIBATTN_TRITON_RUNG_CHUNK") is not None:
        bm = mc
    return tuple(dict.fromkeys(c for c in ((mc, max(2, 16 // mc)), (bm, 2), (bm, 1)) if c[0] * c[1] >= 16))


def _env_candidates(key: str, default: tuple, parse) -> tuple:
    """``default`` without repeats, or the one value set in the environment (checked by ``parse``)."""
    if os.environ.get(key) is not None:
        return (parse(key, default[0]),)
    return tuple(dict.fromkeys(default))


def forward_tiles(dims: dict, two_tap: bool, docs: bool) -> dict:
    """The forward's keys per band step and rung chunk and step, ``{"BLOCK_N", "MC", "RB"}``: the choice
    (:func:`_chosen`) of ``RUNGS``, and with two taps and documents also of ``BLOCK_N_TWO_TAP_DOCS``, the rungs'
    first."""
    bns = dims["BLOCK_N_TWO_TAP_DOCS"] if two_tap and docs else (dims["BLOCK_N"],)
    cands = tuple((bn, mc, rb) for mc, rb in dims["RUNGS"] for bn in bns)
    (bn, mc, rb), extra = _chosen(dims, kernels().fwd_kernel, ("BLOCK_N", "MC", "RB"), cands, TWO_TAP=two_tap,
                                  HAS_DOCS=docs)
    return {"BLOCK_N": bn, "MC": mc, "RB": rb, **extra}


def query_pass_rungs(dims: dict, two_tap: bool, docs: bool = False, need_dfrac: bool = True) -> dict:
    """The backward's query pass's rung chunk and step, ``{"MC", "RB"}``: the choice of ``RUNGS`` (:func:`_chosen`)."""
    (mc, rb), extra = _chosen(dims, kernels().bwd_dq_kernel, ("MC", "RB"), dims["RUNGS"], TWO_TAP=two_tap,
                              HAS_DOCS=docs, NEED_DFRAC=need_dfrac and two_tap)
    return {"MC": mc, "RB": rb, **extra}


def key_pass_rungs(dims: dict, two_tap: bool, docs: bool = False) -> dict:
    """Rungs per step of the backward's key pass and how it places their blocks, ``{"RBK", "PRODUCTS"}``: the
    choice of ``RB_KEY_PASS`` (:func:`_chosen`)."""
    (rbk, prod), extra = _chosen(dims, kernels().bwd_dkdv_kernel, ("RBK", "PRODUCTS"), dims["RB_KEY_PASS"],
                                 TWO_TAP=two_tap, HAS_DOCS=docs, KEYS=key_pass_rows(dims["BLOCK_M"], two_tap))
    return {"RBK": rbk, "PRODUCTS": prod, **extra}


def _chosen(dims: dict, kernel, key, candidates: tuple, **flags) -> tuple:
    """``(value, options)``: of ``candidates`` for constexpr ``key`` of ``kernel`` (or a tuple of them, each
    candidate a tuple of their values), the one ``dims["choose"]`` takes (a bound ``triton_occupancy.choose``: the
    compiled registers decide), with the launch options it takes (a register cap, ``{"maxnreg": N}``, or none); or
    the first where there is none (the interpreter; a trace without a device). Remembered in ``dims``, so that a
    launch plan decides once."""
    choose = dims.get("choose")
    if choose is None or len(candidates) == 1:
        return candidates[0], {}
    memo = dims.setdefault("chosen", {})
    name = (kernel.__name__, key, tuple(sorted(flags.items())))
    if name not in memo:
        # the kernel launched for heads without a NaN / inf (CHECK: triton_tiles._any_flagged)
        check = {"CHECK": False} if "CHECK" in kernel.arg_names else {}
        consts = {**_args(kernel, dims), **check, **flags, **({} if flags["HAS_DOCS"] else {"OFF": None})}
        memo[name] = choose(kernel, key, candidates, consts)
    return memo[name]


def _args(kernel, dims: dict) -> dict:
    """The constexprs of ``dims`` that ``kernel`` takes (each kernel takes its own tile sizes)."""
    return {k: v for k, v in dims.items() if k in kernel.arg_names}


MAXNREG = 0        # no cap by default (168 would fit 3 programs of 4 warps per SM: 65536 / (168 x 128))


def register_cap() -> dict:
    """``{"maxnreg": N}``, the registers a thread may use (``FIBATTN_TRITON_MAXNREG``, 0 for no cap; default
    :data:`MAXNREG`), where this Triton takes it. The tiles of :func:`config` keep every kernel of the goal
    setting at 128-159 registers, 3 programs per SM, uncapped; other settings (Dh 128: up to 188) may gain from a
    cap, but ptxas spills below what a kernel needs, which ``tools/gpu_static.py``'s model does not price, so the
    GPU check's sweep times it before any cap becomes a default."""
    n = os.environ.get("FIBATTN_TRITON_MAXNREG")
    try:
        cap = MAXNREG if n is None else int(n)
    except ValueError:
        raise UsageError(f"FIBATTN_TRITON_MAXNREG must be a register count (0: none), got {n!r}") from None
    if cap < 0 or cap > 255:
        raise UsageError(f"FIBATTN_TRITON_MAXNREG must be from 0 to 255, got {cap}")
    return {"maxnreg": cap} if cap and _takes_maxnreg() else {}


@functools.lru_cache(maxsize=1)
def _takes_maxnreg() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "maxnreg" in getattr(CUDAOptions, "__dataclass_fields__", {})



def key_pass_rows(block_m: int, two_tap: bool) -> int:
    """Key rows a program of the backward's key pass owns: its tile's ``M``, or ``M - 1`` with two taps (the last
    row's second tap reads a query row past the tile's gather: the next program, whose first row it is, writes
    it; ``M / (M - 1)`` more programs in place of a second gather per rung)."""
    return block_m - 1 if two_tap else block_m


# what overrides :func:`config` (each checked there; a launch plan is keyed on them)
SETTINGS = ("FIBATTN_TRITON_BLOCK_M", "FIBATTN_TRITON_WARPS", "FIBATTN_TRITON_MAXNREG", "FIBATTN_TRITON_BLOCK_Q",
            "FIBATTN_TRITON_RUNG_STEP", "FIBATTN_TRITON_BLOCK_N_TWO_TAP_DOCS", "FIBATTN_TRITON_STAGES",
            "FIBATTN_TRITON_SPLIT_P", "FIBATTN_TRITON_RB_KEY_PASS", "FIBATTN_TRITON_KEY_PASS_PRODUCTS",
            "FIBATTN_TRITON_RUNG_CHUNK")
