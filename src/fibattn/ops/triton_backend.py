"""The ``triton`` backend: fused forward and backward kernels (``triton_kernels``) for CUDA.

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)`` (any strides; a non-unit stride on
``Dh`` is copied once). float16, bfloat16, float32 and float64 inputs; float32
accumulation (float64 for float64 inputs); outputs and gradients in the input dtype. The
forward saves ``lse`` ``(B, H, T)`` (float32; float64 for float64 inputs), not the probabilities: the backward
recomputes them per column, so nothing ``T × C`` is kept between passes.

Three launches per forward (one for the fractional op's column plan, computed on the
device so that ``alpha`` is never read back to the host), two per backward plus the
``alpha`` gradient's small reduction. ``T`` is a runtime argument of every kernel.

On CPU tensors the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``,
set before fibattn first uses this backend): slow, but exact enough to test against the
reference without a GPU.

Tile sizes: ``BLOCK_M`` rows per program and ``num_warps`` (see :func:`config`). The
environment variables ``FIBATTN_TRITON_BLOCK_M`` and ``FIBATTN_TRITON_WARPS`` override
them (the GPU check script sweeps them).
"""
from __future__ import annotations

import functools
import os

import torch

from .columns import ColumnSpec, dalpha

name = "triton"
LOG2E = 1.4426950408889634        # log2(e): the kernels use exp2
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
        raise ValueError(f"{key} must be a power of two, got {raw!r}") from None
    if value < 1 or value & (value - 1):
        raise ValueError(f"{key} must be a power of two, got {value}")
    return value


def config(group: int, head_dim: int) -> dict:
    """Block sizes and warps of a launch (one choice per group size and head size, never per T).

    Every program holds a few ``group x rows x Dh`` blocks in registers (q and the output
    accumulator; q, dout and dq in the backward); about 2048 elements per block over 8
    warps keeps each kernel under ~130 registers per thread with no spills on sm_90
    (``tools/triton_resources.py`` prints them).
    """
    bg, bd = _pow2(group), max(_pow2(head_dim), 2)
    bm = min(64, max(4, 2048 // (bg * bd)))
    if interpreting():
        bm = 64             # the interpreter's cost is per program and per op, not per element
    bm = _env_int("FIBATTN_TRITON_BLOCK_M", bm)
    warps = min(8, max(2, bg * bm * bd // 256))
    return dict(BLOCK_G=bg, BLOCK_D=bd, BLOCK_M=bm, num_warps=_env_int("FIBATTN_TRITON_WARPS", warps))


# ----------------------------------------------------------------------------- columns
@functools.lru_cache(maxsize=256)
def _int_tensor(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values or (0,), dtype=torch.int32, device=device)


def _columns(spec: ColumnSpec, alpha, T: int, device):
    """``(LO, WLO, WHI, NWIN, TWO_TAP)`` device arrays of ``spec.count`` columns."""
    if not spec.interpolated:
        lo = _int_tensor(tuple(spec.dists), device)
        return lo, lo, lo, 0, False         # WLO / WHI are never read without TWO_TAP
    C, K = spec.count, len(spec.base)
    lo = torch.empty(C, dtype=torch.int32, device=device)
    wlo = torch.empty(C, dtype=torch.float64, device=device)
    whi = torch.empty(C, dtype=torch.float64, device=device)
    a = alpha.detach()
    if a.device != device:
        a = a.to(device)
    kernels().plan_kernel[(1,)](a, _int_tensor(spec.base, device), lo, wlo, whi, K, spec.cap(T),
                                W=spec.window, BLOCK_W=_pow2(spec.window + 1), BLOCK_K=_pow2(K))
    return lo, wlo, whi, spec.window + 1, True


def _acc(dtype):
    tl = kernels().tl
    return tl.float64 if dtype == torch.float64 else tl.float32


def _prep(*xs):
    if xs[0].dtype not in _DTYPES:
        raise ValueError(f"triton backend takes float16, bfloat16, float32 or float64 tensors, got {xs[0].dtype}")
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _s3(x):
    return x.stride(0), x.stride(1), x.stride(2)


# ----------------------------------------------------------------------------- the op interface
def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def aux_like(q, spec):
    """The saved softmax state: log-sum-exp (base 2) ``(B, H, T)`` in the accumulation dtype."""
    return q.new_empty(q.shape[:3], dtype=_acc_dtype(q.dtype))


def forward(q, k, v, spec: ColumnSpec, alpha, scale: float):
    q, k, v = _prep(q, k, v)
    B, H, T, D = q.shape
    hkv = k.shape[1]
    lo, wlo, whi, nwin, two = _columns(spec, alpha, T, q.device)
    out = q.new_empty(q.shape)
    lse = aux_like(q, spec)
    cfg = config(H // hkv, D)
    grid = (triton_cdiv(T, cfg["BLOCK_M"]), B * hkv)
    kernels().fwd_kernel[grid](q, k, v, out, lse, lo, wlo, whi, *_s3(q), *_s3(k), *_s3(v), *_s3(out),
                               T, spec.count, nwin, hkv, H, H // hkv, D, scale * LOG2E,
                               TWO_TAP=two, ACC=_acc(q.dtype), **cfg)
    return out, lse


def backward(dout, q, k, v, out, lse, spec: ColumnSpec, alpha, scale: float, need_dalpha: bool):
    q, k, v, out, dout = _prep(q, k, v, out, dout)
    B, H, T, D = q.shape
    hkv, C = k.shape[1], spec.count
    lo, wlo, whi, nwin, two = _columns(spec, alpha, T, q.device)
    cfg = config(H // hkv, D)
    n_m = triton_cdiv(T, cfg["BLOCK_M"])
    grid = (n_m, B * hkv)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    delta = aux_like(q, spec)
    edge_k = torch.zeros(B * hkv * C * D if two else 1, dtype=delta.dtype, device=q.device)
    edge_v = torch.zeros_like(edge_k)
    need = bool(need_dalpha and two)
    dfrac = torch.zeros(B * hkv * n_m * C if need else 1, dtype=torch.float64, device=q.device)
    dims = dict(TWO_TAP=two, ACC=_acc(q.dtype), **cfg)
    kern = kernels()
    kern.bwd_dq_kernel[grid](q, k, v, out, dout, lse, delta, dq, edge_k, edge_v, dfrac, lo, wlo, whi,
                             *_s3(q), *_s3(k), *_s3(v), *_s3(out), *_s3(dout), *_s3(dq),
                             T, C, nwin, hkv, H, H // hkv, D, scale * LOG2E, scale, NEED_DFRAC=need, **dims)
    kern.bwd_dkdv_kernel[grid](q, k, v, dout, lse, delta, dk, dv, edge_k, edge_v, lo, wlo, whi,
                               *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dk), *_s3(dv),
                               T, C, nwin, hkv, H, H // hkv, D, scale * LOG2E, scale, **dims)
    da = None
    if need_dalpha:
        if need:
            b = (0,) * nwin + spec.base
            da = dalpha(dfrac.view(-1, C).sum(0), b, alpha)
        else:
            da = torch.zeros((), dtype=alpha.dtype, device=alpha.device)
    return dq, dk, dv, da


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
