"""The fused ops as ``torch.library`` custom ops: what ``torch.compile`` sees.

- ``fibattn::sparse_attention_v2(q, k, v, dists, scale, backend, off) -> (out, aux)``
- ``fibattn::interpolated_sparse_attention_v2(q, k, v, alpha, window, base, reach, scale,
  backend, off) -> (out, aux)``

(``off``: the packed documents' offsets, ``documents``, or None)

each with a ``..._backward`` op and a registered autograd formula, and a ``..._forward`` op returning
``out`` alone for a forward that no backward follows (:func:`needs_state`): under ``no_grad`` or on inputs
that need no gradient the kernels save nothing (the cpu kernels skip ``P`` and the slopes, as eager does).
The names end in
:data:`SAVED_STATE_VERSION`: torch.compile's on-disk caches key a compiled graph by its code,
which names the ops, and not by their fake implementations, so a graph cached under another
layout of ``aux`` would fail a size assert after an upgrade; a new name makes it a cache miss.

Under tracing (the compiler, functorch, a dispatch mode) the public functions call them through
:class:`SparseAttention` / :class:`InterpolatedSparseAttention`, autograd Functions sharing
that formula, because functorch's transforms see those and not a registered formula; plain
eager calls skip this dispatch (``eager``).

``aux`` is the backend's saved softmax state (``P`` ``(B, H, T, C)`` for ``torch`` / ``cpu``, and
for ``cpu``'s interpolated op ``P`` and the score slopes, ``(B, H, 2T, C)``; the log-sum-exp
``(B, H, T)`` for ``triton``); its shape depends only on the arguments,
never on ``alpha`` (``columns.ColumnSpec.count``), so the fake implementations are exact
and a learned alpha's column plan is computed *inside* the op — no graph break, no host
sync on CUDA.

``backend`` is the public name (``auto`` included): the op resolves it on the tensors'
device, and the real (not the fake) implementation logs an ``auto`` choice once.
Backends without a custom op: ``reference`` (plain PyTorch, traced as it is) and ``flex``.

``torch.func.grad`` works through the registered autograd, and ``torch.vmap`` through a
rule that folds the mapped dimension into the batch (per-sample gradients included).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .backends import kernel_set
from .columns import ColumnSpec, docs


SAVED_STATE_VERSION = 2   # bumped whenever a backend's ``aux`` changes shape (tests/test_compile.py pins them)


def needs_state(*tensors) -> bool:
    """Whether a forward on ``tensors`` (None skipped) must save the softmax state for a backward: grad
    mode is on and one of them requires grad (functorch's ``grad`` marks what it differentiates so). The
    compiler guards both, so a compiled graph is specialised on the answer."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _name(op: str) -> str:
    return f"fibattn::{op}_v{SAVED_STATE_VERSION}"


def _spec(dists=None, window=0, base=(), reach=None) -> ColumnSpec:
    return ColumnSpec(None if dists is None else tuple(dists), window, tuple(base), reach)


def _vmap_rule(op):
    """``torch.vmap`` support: the mapped dimension is folded into the batch dimension B (one
    call); a mapped ``alpha``, or a backward that must return ``d alpha`` per mapped slice,
    runs one call per slice instead."""
    def rule(info, in_dims, *args):
        n = info.batch_size
        per_slice = any(d is not None and isinstance(a, Tensor) and a.dim() == 1 for a, d in zip(args, in_dims))
        if op is interpolated_backward_op and args[-2] and any(d is not None for d in in_dims):   # need_dalpha
            per_slice = True
        if per_slice:
            def one(i):
                return op(*[a.select(d, i) if isinstance(a, Tensor) and d is not None else a
                            for a, d in zip(args, in_dims)])
            outs = [one(i) for i in range(n)]
            if isinstance(outs[0], Tensor):                  # a forward-only op: out alone
                return torch.stack(outs), 0
            return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])

        def fold(a, d):
            if not isinstance(a, Tensor) or a.dim() == 0:
                return a
            a = a.movedim(d, 0) if d is not None else a.expand(n, *a.shape)
            return a.flatten(0, 1)
        res = op(*[fold(a, d) for a, d in zip(args, in_dims)])
        if isinstance(res, Tensor):                          # a forward-only op: out alone
            return res.unflatten(0, (n, -1)), 0
        return (tuple(r.unflatten(0, (n, -1)) if r.dim() else r for r in res),
                tuple(0 if r.dim() else None for r in res))
    return rule


# ----------------------------------------------------------------------------- integer op
@torch.library.custom_op(_name("sparse_attention"), mutates_args=())
def sparse_op(q: Tensor, k: Tensor, v: Tensor, dists: list[int], scale: float, backend: str,
              off: Tensor | None) -> tuple[Tensor, Tensor]:
    return kernel_set(backend, q.device).forward(q, k, v, _spec(dists), None, scale, **docs(off))


@sparse_op.register_fake
def _(q, k, v, dists, scale, backend, off):
    return q.new_empty(q.shape), kernel_set(backend, q.device, log=False).aux_like(q, _spec(dists))


@torch.library.custom_op(_name("sparse_attention_forward"), mutates_args=())
def sparse_forward_op(q: Tensor, k: Tensor, v: Tensor, dists: list[int], scale: float, backend: str,
                      off: Tensor | None) -> Tensor:
    return kernel_set(backend, q.device).forward(q, k, v, _spec(dists), None, scale, save=False, **docs(off))[0]


@sparse_forward_op.register_fake
def _(q, k, v, dists, scale, backend, off):
    return q.new_empty(q.shape)


@torch.library.custom_op(_name("sparse_attention_backward"), mutates_args=())
def sparse_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, aux: Tensor, dists: list[int],
                       scale: float, backend: str, off: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv, _ = kernel_set(backend, q.device).backward(dout, q, k, v, out, aux, _spec(dists), None, scale,
                                                          False, **docs(off))
    return dq, dk, dv


@sparse_backward_op.register_fake
def _(dout, q, k, v, out, aux, dists, scale, backend, off):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def double_backward_error(name: str) -> RuntimeError:
    return RuntimeError(f"fibattn::{name} has no second derivative (double backward is not supported)")


def _no_double_backward(name):
    def backward(ctx, *grads):
        raise double_backward_error(name)
    return staticmethod(backward)


class _SparseBackward(torch.autograd.Function):
    """The backward op as a function of its inputs, for functorch, which differentiates
    through a backward (it runs it with ``create_graph``); its own backward raises."""

    generate_vmap_rule = True
    backward = _no_double_backward("sparse_attention")

    @staticmethod
    def forward(dout, q, k, v, out, aux, dists, scale, backend, off):
        return sparse_backward_op(dout, q, k, v, out, aux, dists, scale, backend, off)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass


def _sparse_setup(ctx, inputs, output):
    q, k, v, dists, scale, backend, off = inputs
    out, aux = output
    ctx.save_for_backward(q, k, v, out, aux, off)
    ctx.args = (dists, scale, backend)
    ctx.mark_non_differentiable(aux)


def _sparse_grad(ctx, dout, _daux):
    q, k, v, out, aux, off = ctx.saved_tensors
    dq, dk, dv = _SparseBackward.apply(dout, q, k, v, out, aux, *ctx.args, off)
    return dq, dk, dv, None, None, None, None


sparse_op.register_autograd(_sparse_grad, setup_context=_sparse_setup)


class SparseAttention(torch.autograd.Function):
    """The integer op for autograd *and* functorch (``torch.func.grad``, ``vmap``): a
    registered autograd formula alone is not seen by functorch's transforms."""

    generate_vmap_rule = True
    setup_context = staticmethod(_sparse_setup)
    backward = staticmethod(_sparse_grad)

    @staticmethod
    def forward(q, k, v, dists, scale, backend, off):
        return sparse_op(q, k, v, dists, scale, backend, off)


# ----------------------------------------------------------------------------- fractional op
@torch.library.custom_op(_name("interpolated_sparse_attention"), mutates_args=())
def interpolated_op(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, window: int, base: list[int],
                    reach: int | None, scale: float, backend: str, off: Tensor | None) -> tuple[Tensor, Tensor]:
    spec = _spec(None, window, base, reach)
    return kernel_set(backend, q.device, interpolated=True).forward(q, k, v, spec, alpha, scale, **docs(off))


@interpolated_op.register_fake
def _(q, k, v, alpha, window, base, reach, scale, backend, off):
    kern = kernel_set(backend, q.device, interpolated=True, log=False)
    return q.new_empty(q.shape), kern.aux_like(q, _spec(None, window, base, reach))


@torch.library.custom_op(_name("interpolated_sparse_attention_forward"), mutates_args=())
def interpolated_forward_op(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, window: int, base: list[int],
                            reach: int | None, scale: float, backend: str, off: Tensor | None) -> Tensor:
    kern = kernel_set(backend, q.device, interpolated=True)
    return kern.forward(q, k, v, _spec(None, window, base, reach), alpha, scale, save=False, **docs(off))[0]


@interpolated_forward_op.register_fake
def _(q, k, v, alpha, window, base, reach, scale, backend, off):
    return q.new_empty(q.shape)


@torch.library.custom_op(_name("interpolated_sparse_attention_backward"), mutates_args=())
def interpolated_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, aux: Tensor, alpha: Tensor,
                             window: int, base: list[int], reach: int | None, scale: float, backend: str,
                             need_dalpha: bool, off: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = _spec(None, window, base, reach)
    kern = kernel_set(backend, q.device, interpolated=True)
    dq, dk, dv, da = kern.backward(dout, q, k, v, out, aux, spec, alpha, scale, need_dalpha, **docs(off))
    return dq, dk, dv, (da if da is not None else alpha.new_zeros(()))


@interpolated_backward_op.register_fake
def _(dout, q, k, v, out, aux, alpha, window, base, reach, scale, backend, need_dalpha, off):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), alpha.new_empty(())


class _InterpolatedBackward(torch.autograd.Function):
    generate_vmap_rule = True
    backward = _no_double_backward("interpolated_sparse_attention")

    @staticmethod
    def forward(dout, q, k, v, out, aux, alpha, window, base, reach, scale, backend, need_dalpha, off):
        return interpolated_backward_op(dout, q, k, v, out, aux, alpha, window, base, reach, scale, backend,
                                        need_dalpha, off)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass


def _interp_setup(ctx, inputs, output):
    q, k, v, alpha, window, base, reach, scale, backend, off = inputs
    out, aux = output
    ctx.save_for_backward(q, k, v, out, aux, alpha, off)
    ctx.args = (window, base, reach, scale, backend)
    ctx.mark_non_differentiable(aux)


def _interp_grad(ctx, dout, _daux):
    q, k, v, out, aux, alpha, off = ctx.saved_tensors
    need = ctx.needs_input_grad[3]
    dq, dk, dv, da = _InterpolatedBackward.apply(dout, q, k, v, out, aux, alpha, *ctx.args, need, off)
    return dq, dk, dv, (da if need else None), None, None, None, None, None, None


interpolated_op.register_autograd(_interp_grad, setup_context=_interp_setup)


class InterpolatedSparseAttention(torch.autograd.Function):
    """The fractional op for autograd and functorch (see :class:`SparseAttention`)."""

    generate_vmap_rule = True
    setup_context = staticmethod(_interp_setup)
    backward = staticmethod(_interp_grad)

    @staticmethod
    def forward(q, k, v, alpha, window, base, reach, scale, backend, off):
        return interpolated_op(q, k, v, alpha, window, base, reach, scale, backend, off)

for _op in (sparse_op, sparse_backward_op, sparse_forward_op, interpolated_op, interpolated_backward_op,
            interpolated_forward_op):
    _op.register_vmap(_vmap_rule(_op))
