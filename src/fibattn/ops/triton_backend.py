"""The ``triton`` backend: fused forward and backward kernels (``triton_kernels``) for CUDA.

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)`` (any strides; a non-unit stride on
``Dh`` is copied once). float16, bfloat16, float32 and float64 inputs; float32
accumulation (float64 for float64 inputs); outputs and gradients in the input dtype. The
forward saves ``lse`` ``(B, H, T)`` (float32; float64 for float64 inputs), not the
probabilities; the backward's query pass writes the rungs' ``P`` and ``dS`` ``(B·H·T, R)``
for its key pass (freed when the backward returns).

Four launches per forward — ``flags_kernel`` (with the zero fill of its per-head summary), one read of K and V
marking the rows that hold a NaN or inf so that such a value reaches only the queries that attend it, and the
attention twice: unchecked for the heads without one, checked for the others (:data:`_CHECKED`) — (five for the
fractional op: its rung plan is computed on the device so that ``alpha`` is never read back to the host), six
per backward (the flags with their zero fill, each pass twice) plus the ``alpha`` gradient's sum. ``T`` is a
runtime argument of every kernel. Documents: ``forward`` and ``backward`` take ``off`` (int32 ``(B, T)``,
contiguous, on q's device: each position's offset in its document; None for one document per row), compiled as a
separate kernel variant.

On CPU tensors the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``,
set before fibattn first uses this backend): slow, but exact enough to test against the
reference without a GPU.

Tile sizes: ``triton_config`` (:func:`config`; the environment variables of ``SETTINGS`` override them, and the
GPU check script sweeps them).
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

from ..checks import UsageError
from .columns import ColumnSpec, dalpha
from .triton_config import (SETTINGS, _args, _pow2, config, forward_tiles, interpreting, kernels, key_pass_rows,
                            key_pass_rungs, query_pass_rungs)

name = "triton"
LOG2E = 1.4426950408889634        # log2(e): the kernels use exp2
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return (f"triton is not importable ({exc}); CUDA builds of torch ship it, "
                f"or `pip install triton`")
    return None


def unavailable(device) -> str | None:
    """``None`` when the kernels can run on ``device``, else the reason they cannot."""
    why = _import_error()
    if why is not None:
        return why
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return None
    if kind == "cpu":
        return "the triton backend runs on CUDA tensors (CPU tensors only under TRITON_INTERPRET=1)"
    return f"the triton backend runs on CUDA tensors, got device {device}"


# ----------------------------------------------------------------------------- columns
def traced(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tracer's stand-in (fake or functional: a ``triton_op`` being traced, ``triton_ops``),
    not a real tensor."""
    return type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter


def _launcher(kernel, trace: bool):
    """``kernel`` itself, or while tracing its ``wrap_triton`` wrapper: the compiler records the launch."""
    if not trace:
        return kernel
    from torch.library import wrap_triton
    return wrap_triton(kernel)


@functools.lru_cache(maxsize=256)
def _table(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def device_values(values: tuple, device, trace: bool = False, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device`` (``(0,)`` when empty): cached per device when eager; while
    tracing built by device ops alone, which the compiler fuses into one small kernel, rather than a
    host constant copied over on every call (a host-to-device copy that a CUDA graph cannot hold)."""
    values = values or (0,)
    if not trace:
        return _table(values, dtype, torch.device(device))
    return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])


def band_width(dists) -> int:
    """The band ``0..WB`` of an integer distance list: the longest run of consecutive distances from 0."""
    present = set(dists)
    wb = -1
    while wb + 1 in present:
        wb += 1
    return wb


@functools.lru_cache(maxsize=256)
def _integer_columns(dists: tuple[int, ...], T: int, device, trace: bool = False):
    """:func:`_columns` of integer distances (cached when eager: every layer calls with its own list)."""
    wb = band_width(dists)
    rungs = tuple(sorted(d for d in set(dists) if wb < d < T))    # distances >= T are never valid
    lo = device_values(rungs or (kernels().NEVER,), device, trace)
    n = device_values((len(rungs),), device, trace)
    return (lo, lo, lo, lo, n), max(len(rungs), 1), wb, False   # RWLO, RWHI, RBASE: read only when TWO_TAP


def _columns(spec: ColumnSpec, alpha, T: int, device, trace: bool = False):
    """``(rungs, R, WB, TWO_TAP)``: the rungs' device arrays ``(RLO, RWLO, RWHI, RBASE, RN)`` —
    ``RN`` of ``R`` slots in use, packed at the front — and the band width ``WB``."""
    if not spec.interpolated:
        if trace:
            return _integer_columns.__wrapped__(spec.dists, T, device, True)
        return _integer_columns(spec.dists, T, device)
    K = max(len(spec.base), 1)
    lo = torch.empty(K, dtype=torch.int32, device=device)
    n = torch.empty(1, dtype=torch.int32, device=device)
    wlo, whi, rbase = (torch.empty(K, dtype=torch.float64, device=device) for _ in range(3))
    a = alpha.detach()
    if a.device != device:
        a = a.to(device)
    cap = spec.cap(T)
    # the base in float64: alpha * b as Python takes it, for any value (int32 would not hold every one)
    base = device_values(tuple(float(b) for b in spec.base), device, trace, torch.float64)
    _launcher(kernels().plan_kernel, trace)[(1,)](a, base, lo, wlo, whi, rbase, n, len(spec.base), cap,
                                                  W=spec.window, BLOCK_K=_pow2(len(spec.base)))
    return (lo, wlo, whi, rbase, n), K, min(spec.window, cap), True


def _tl_dtype(dtype):
    tl = kernels().tl
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


def _prep(*xs):
    if xs[0].dtype not in _DTYPES:
        raise UsageError(f"triton backend takes float16, bfloat16, float32 or float64 tensors, got {xs[0].dtype}")
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _s3(x):
    return x.stride()[:3]


# ----------------------------------------------------------------------------- the op interface
def split(x: float) -> tuple[float, float]:
    """``x`` as two float32 values ``hi + lo`` (a kernel's float argument is float32; ``_scale`` adds them back in
    float64 for float64 inputs, so their scale is not rounded to float32)."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def aux_like(q, spec):
    """The saved softmax state: log-sum-exp (base 2) ``(B, H, T)`` in the accumulation dtype."""
    return q.new_empty(q.shape[:3], dtype=_acc_dtype(q.dtype))


def wide(tensors, elements: int = 0) -> bool:
    """Whether the kernels index in int64 (``WIDE``, ``triton_tiles._program``): some element offset of one of
    ``tensors`` (its strides' reach), or an index into a buffer of ``elements``, may reach 2**31. An offset past
    it in a masked lane (a rung slot not in use, a row past ``T``) is never dereferenced."""
    reach = max([sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1 for x in tensors] + [elements])
    return bool(reach >= 2 ** 31)


def _launch(q, hkv, wb, trace: bool = False, big: bool = False):
    """``(grid, constexprs, launch options)`` of a launch over ``q``'s rows: worked out once per shape and
    setting when eager (the host's time per call is the op's cost below ~16K; the settings are read each
    call, so that a changed ``FIBATTN_TRITON_*`` takes effect)."""
    env = os.environ
    key = tuple(env.get(k) for k in SETTINGS + ("TRITON_INTERPRET",))
    if trace:                     # symbolic sizes: nothing to cache
        return _launch_plan.__wrapped__(tuple(q.shape), q.dtype, hkv, wb, key, q.device, big, True)
    return _launch_plan(tuple(q.shape), q.dtype, hkv, wb, key, q.device, big)


@functools.lru_cache(maxsize=256)
def _launch_plan(shape, dtype, hkv: int, wb: int, _settings, device, big: bool = False, trace: bool = False):
    B, H, T, D = shape
    cfg = config(H // hkv, D, max(wb, 0))
    opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    cap = cfg.pop("maxnreg", None)
    if cap and not trace and not interpreting():
        opts["maxnreg"] = cap       # a traced launch leaves it out: the compiler's wrapper would pass it as an argument
    # the interpreter multiplies bfloat16 blocks as raw 16-bit integers: give it float32 operands
    dot = torch.float32 if interpreting() and dtype == torch.bfloat16 else dtype
    # the head dim a constexpr: at a power of two the head-dim masks fold away
    dims = dict(ACC=_tl_dtype(_acc_dtype(dtype)), IN=_tl_dtype(dtype), DOT=_tl_dtype(dot), DH=D, WIDE=big, **cfg)
    target = _target(device)
    if target is not None:
        from . import triton_occupancy
        # a traced launch cannot take a register cap (see above): no capped variants then
        dims["choose"] = functools.partial(triton_occupancy.choose, dtype=_DTYPE_NAMES[dtype], head_dim=D,
                                           options=dict(opts), target=target, caps=not trace)
    return (triton_cdiv(T, cfg["BLOCK_M"]), B * hkv), dims, opts


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def _target(device):
    """The ``GPUTarget`` whose compiled code decides the tile choices (:func:`_chosen`), or None: a CPU tensor
    (the interpreter), or a CUDA one traced on a machine without a device."""
    if device.type != "cuda" or interpreting() or not torch.cuda.is_available():
        return None
    from . import triton_occupancy
    return triton_occupancy.device_target(torch.cuda.current_device() if device.index is None else device.index)


def _row_flags(k, v, trace: bool, big: bool) -> torch.Tensor:
    """``(B, Hkv, T + 2)`` int32: which key (bit 0) and value (bit 1) rows hold a NaN or inf, at ``T`` whether
    any of the head's does (``flags_kernel``), and at ``T + 1``, zero here, whether any of its query rows is
    unfinished (set by the query pass, read by the key pass: ``triton_tiles._head_flags``)."""
    B, hkv, T, D = k.shape
    flags = torch.zeros(B, hkv, T + 2, dtype=torch.int32, device=k.device)
    _launcher(kernels().flags_kernel, trace)[(triton_cdiv(T, 64), B * hkv)](
        k, v, flags, *_s3(k), *_s3(v), T, hkv, D, BLOCK_R=64, BLOCK_D=max(_pow2(D), 16), WIDE=big)
    return flags


def forward(q, k, v, spec: ColumnSpec, alpha, scale: float, off=None, save: bool = True):
    # save=False (no backward follows) changes nothing here: the saved state, lse, is (B, H, T)
    q, k, v = _prep(q, k, v)
    B, H, T, D = q.shape
    hkv = k.shape[1]
    trace = traced(q)
    rungs, _, wb, two = _columns(spec, alpha, T, q.device, trace)
    rlo, rwlo, rwhi, _, rn = rungs
    out = q.new_empty(q.shape)
    lse = aux_like(q, spec)
    big = wide((q, k, v, out), B * H * (T + 2))
    grid, dims, opts = _launch(q, hkv, wb, trace, big)
    tiles, cap = _options(forward_tiles(dims, two, off is not None))
    flags = _row_flags(k, v, trace, big)
    for check in _CHECKED:
        _launcher(kernels().fwd_kernel, trace)[grid](q, k, v, out, lse, flags, rlo, rwlo, rwhi, rn, off, *_s3(q),
                                                     *_s3(k), *_s3(v), *_s3(out), T, wb, hkv, H, H // hkv,
                                                     *split(scale * LOG2E), TWO_TAP=two, HAS_DOCS=off is not None,
                                                     CHECK=check, **_args(kernels().fwd_kernel, {**dims, **tiles}),
                                                     **opts, **cap)
    return out, lse


# each kernel is launched twice: for the heads without a NaN or inf in their keys and values (the key pass: without
# an unfinished query row), unchecked, then for the others, each row read checked (triton_tiles._any_flagged,
# _any_unfinished); a program leaves at once where its head is the other launch's. One kernel holding both would be
# compiled for the checked one's registers.
_CHECKED = (False, True)


def backward(dout, q, k, v, out, lse, spec: ColumnSpec, alpha, scale: float, need_dalpha: bool, off=None):
    q, k, v, out, dout = _prep(q, k, v, out, dout)
    B, H, T, D = q.shape
    hkv = k.shape[1]
    trace = traced(q)
    rungs, R, wb, two = _columns(spec, alpha, T, q.device, trace)
    rlo, rwlo, rwhi, rbase, rn = rungs
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    # the rungs' stored values are indexed (row, head, rung slot): B * H * T * R; the flags B * Hkv * (T + 2)
    big = wide((q, k, v, out, dout, dq, dk, dv), B * H * (T + 2) * max(R, 1))
    grid, dims, opts = _launch(q, hkv, wb, trace, big)
    delta = aux_like(q, spec)
    # the rungs' P and dS per (row, head, rung), written by the query pass, read by the key pass
    n = max(B * H * T * R, 1)
    pr = torch.empty(n, dtype=delta.dtype, device=q.device)
    dsr = torch.empty_like(pr)
    need = bool(need_dalpha and two and spec.base)
    # per (row, head, rung slot); slots past the used rungs are never written (none at all unless need: no fill)
    dfrac = torch.zeros(n, dtype=delta.dtype, device=q.device) if need else delta.new_empty(1)
    kern = kernels()
    docs = off is not None
    flags = _row_flags(k, v, trace, big)
    rungs_dq, dq_cap = _options(query_pass_rungs(dims, two, docs, need))
    dq_dims = _args(kern.bwd_dq_kernel, {**dims, **rungs_dq})
    for check in _CHECKED:
        _launcher(kern.bwd_dq_kernel, trace)[grid](q, k, v, out, dout, lse, delta, dq, pr, dsr, dfrac, flags, rlo,
                                                   rwlo, rwhi, rn, off, *_s3(q), *_s3(k), *_s3(v), *_s3(out),
                                                   *_s3(dout), *_s3(dq), T, R, wb, hkv, H, H // hkv,
                                                   *split(scale * LOG2E), *split(scale), TWO_TAP=two, NEED_DFRAC=need,
                                                   HAS_DOCS=docs, CHECK=check, **dq_dims, **opts, **dq_cap)
    keys = key_pass_rows(dims["BLOCK_M"], two)
    rbk, key_cap = _options(key_pass_rungs(dims, two, docs))
    key_grid = (triton_cdiv(T, keys), grid[1])
    for check in _CHECKED:        # here for the heads whose query rows are all finished, then for the others
        _launcher(kern.bwd_dkdv_kernel, trace)[key_grid](q, k, v, dout, lse, delta, dk, dv, pr, dsr, flags, rlo, rwlo,
                                                         rwhi, rn, off, *_s3(q), *_s3(k), *_s3(v), *_s3(dout),
                                                         *_s3(dk), *_s3(dv), T, R, wb, hkv, H, H // hkv,
                                                         *split(scale * LOG2E), *split(scale), TWO_TAP=two,
                                                         HAS_DOCS=docs, KEYS=keys, CHECK=check, **rbk,
                                                         **_args(kern.bwd_dkdv_kernel, dims), **opts, **key_cap)
    da = None
    if need_dalpha:
        if need:
            da = dalpha(dfrac.view(-1, R).sum(0, dtype=torch.float64), rbase, alpha)
        else:
            da = torch.zeros((), dtype=alpha.dtype, device=alpha.device)
    return dq, dk, dv, da


def _options(choice: dict) -> tuple[dict, dict]:
    """A tile choice (``triton_config``) as its constexprs and its launch options (a register cap)."""
    return ({k: v for k, v in choice.items() if k != "maxnreg"},
            {k: v for k, v in choice.items() if k == "maxnreg"})


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
