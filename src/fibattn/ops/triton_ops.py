"""The ``triton`` kernels as ``torch.library.triton_op``s: what ``torch.compile`` sees on CUDA.

- ``fibattn::triton_attention_v2(q, k, v, alpha, dists, window, base, reach, scale, off) -> (out, lse)``
- ``fibattn::triton_attention_backward_v2(dout, q, k, v, out, lse, alpha, dists, window, base, reach, scale,
  need_dalpha, off) -> (dq, dk, dv, dalpha)``

Integer distances when ``dists`` is given (``alpha`` None), else the fractional op's window, base and
reach at ``alpha``. The generic custom ops (:mod:`fibattn.ops.custom_ops`) are opaque to the compiler;
these are traced: their bodies allocate with torch and launch the kernels through ``wrap_triton``, so
inductor plans the buffers, calls the kernels from its own code (no Python of fibattn's per call),
fuses what surrounds them and can capture the whole step in a CUDA graph. Nothing in them reads a
value back or makes a CPU tensor: the rung table of integer distances is built on the device while
tracing (``triton_backend.device_values``) and ``alpha``'s rungs by ``plan_kernel``.

Used only by a compiled call on CUDA with real (not interpreted) kernels
(``backends.compiled_triton``, which imports this module on first use: registering the ops imports
``torch._inductor``); eager calls keep ``eager.py``'s direct path, and functorch transforms, the
interpreter and the other backends the generic ops.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .backends import kernels
from .columns import ColumnSpec
from .custom_ops import SAVED_STATE_VERSION


def _name(op: str) -> str:
    return f"fibattn::{op}_v{SAVED_STATE_VERSION}"


def _spec(dists, window, base, reach) -> ColumnSpec:
    if dists is not None:
        return ColumnSpec(tuple(dists))
    return ColumnSpec(None, window, tuple(base), reach)


def _kernels():
    return kernels("triton")                # triton_backend, imported on first use (it imports triton)


@torch.library.triton_op(_name("triton_attention"), mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor | None, dists: list[int] | None, window: int,
                 base: list[int], reach: int | None, scale: float, off: Tensor | None) -> tuple[Tensor, Tensor]:
    return _kernels().forward(q, k, v, _spec(dists, window, base, reach), alpha, scale, off=off)


@torch.library.triton_op(_name("triton_attention_backward"), mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          alpha: Tensor | None, dists: list[int] | None, window: int, base: list[int],
                          reach: int | None, scale: float, need_dalpha: bool,
                          off: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = _spec(dists, window, base, reach)
    dq, dk, dv, da = _kernels().backward(dout, q, k, v, out, lse, spec, alpha, scale, need_dalpha, off=off)
    return dq, dk, dv, (da if da is not None else q.new_zeros((), dtype=torch.float64))


def _setup(ctx, inputs, output):
    q, k, v, alpha, dists, window, base, reach, scale, off = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alpha, off)
    ctx.args = (dists, window, base, reach, scale)
    ctx.mark_non_differentiable(lse)


def _grad(ctx, dout, _dlse):       # the backward op has no formula of its own: no double backward
    q, k, v, out, lse, alpha, off = ctx.saved_tensors
    need = alpha is not None and ctx.needs_input_grad[3]
    dq, dk, dv, da = attention_backward_op(dout, q, k, v, out, lse, alpha, *ctx.args, need, off)
    return dq, dk, dv, (da.to(alpha.dtype) if need else None), None, None, None, None, None, None


attention_op.register_autograd(_grad, setup_context=_setup)


def sparse_attention(q, k, v, dists: list[int], scale: float, off) -> Tensor:
    return attention_op(q, k, v, None, dists, 0, [], None, scale, off)[0]


def interpolated_sparse_attention(q, k, v, alpha: Tensor, window: int, base: list[int], reach, scale: float,
                                  off) -> Tensor:
    return attention_op(q, k, v, alpha, None, window, base, reach, scale, off)[0]
