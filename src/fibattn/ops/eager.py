"""The public ops' eager path: a kernel set called through a plain autograd Function.

A ``torch.library`` custom op costs ≈0.2–0.5 ms of dispatch per forward+backward, more than
the kernels themselves at small sizes (``fibattn bench attention`` prints the overhead left).
So plain eager calls skip ``custom_ops``: the public op resolves the backend once, and a host
kernel set's columns (its ``plan``) are computed once in the forward and handed to the
backward. Whatever must see the custom ops keeps going through them (:func:`eligible`):
``torch.compile``, functorch transforms (``torch.func``, ``vmap``), dispatch modes
(``FakeTensorMode``, ``make_fx``), the JIT tracer and tensor subclasses.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .backends import announce, kernels
from .columns import ColumnSpec
from .custom_ops import double_backward_error, needs_state

_C = torch._C
_PLAIN = (Tensor, torch.nn.Parameter)
_wrapped = _C._functorch.is_functorch_wrapped_tensor
_transforms_active = getattr(_C, "_are_functorch_transforms_active", None) or \
    (lambda: _C._functorch.maybe_current_level() is not None)          # torch without the direct query


def eligible(*tensors) -> bool:
    """Whether a call may skip the custom ops: nothing is tracing it and ``tensors`` are plain."""
    if torch.compiler.is_compiling() or _transforms_active() or _C._len_torch_dispatch_stack() \
            or _C._get_tracing_state() is not None:
        return False
    for x in tensors:
        if type(x) not in _PLAIN or _wrapped(x):
            return False
    return True


def attention(name: str, backend: str, q: Tensor, k: Tensor, v: Tensor, spec: ColumnSpec, alpha: Tensor | None,
              scale: float, off: Tensor | None = None) -> Tensor:
    """The op's output on the kernel set of ``name`` (``backend`` resolved by the caller; ``alpha``
    None for integer distances; ``off`` the documents' offsets or None); the same numbers as the
    custom op, bit for bit."""
    kern = kernels(name)
    announce(backend, q.device, name)
    if needs_state(q, k, v, alpha):
        return Attention.apply(q, k, v, alpha, kern, spec, scale, off)
    if off is None:                                               # nothing to differentiate: no autograd node
        return kern.forward(q, k, v, spec, alpha, scale, save=False)[0]     # and no saved state
    return kern.forward(q, k, v, spec, alpha, scale, off=off, save=False)[0]


class Attention(torch.autograd.Function):
    """Either op on kernel set ``kern`` (a module of ``backends``): ``apply(q, k, v, alpha, kern,
    spec, scale, off)``, ``alpha`` None for integer distances, ``off`` None without documents."""

    # forward(ctx, ...) rather than setup_context: Function.apply then skips an inspect.signature bind

    @staticmethod
    def forward(ctx, q, k, v, alpha, kern, spec, scale, off):
        plan = getattr(kern, "plan", None)           # triton has none: it plans on the device itself
        ctx.plan = {} if plan is None else {"plan": plan(spec, alpha, q.shape[2])}
        if off is not None:
            ctx.plan["off"] = off
        out, aux = kern.forward(q, k, v, spec, alpha, scale, **ctx.plan)
        ctx.save_for_backward(q, k, v, out, aux, alpha)
        ctx.op = (kern, spec, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        kern, spec, scale = ctx.op
        q, k, v, out, aux, alpha = ctx.saved_tensors
        need_dalpha = ctx.needs_input_grad[3]

        def grads():
            return kern.backward(dout, q, k, v, out, aux, spec, alpha, scale, need_dalpha, **ctx.plan)
        if torch.is_grad_enabled():                  # create_graph: a second derivative must raise, not be 0
            dq, dk, dv, da = _FirstOrderOnly.apply(spec, grads, dout, q, k, v, alpha)
        else:
            dq, dk, dv, da = grads()
        return dq, dk, dv, da, None, None, None, None


class _FirstOrderOnly(torch.autograd.Function):
    """Gradients computed under ``create_graph``, whose own backward raises."""

    @staticmethod
    def forward(ctx, spec, grads, *inputs):
        ctx.op = "interpolated_sparse_attention" if spec.interpolated else "sparse_attention"
        return grads()

    @staticmethod
    def backward(ctx, *_):
        raise double_backward_error(ctx.op)
