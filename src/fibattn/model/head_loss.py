"""The output head and its cross-entropy as one step, three ways (``train.loss_head``).

- ``plain``: the ``(N, V)`` logits, then ``F.cross_entropy`` on them in fp32 (what ``FibLM.forward`` returns).
- ``chunked``: the same sum, ``chunk`` rows at a time, never holding more than ``chunk x V`` logits. The
  gradients are made in the forward, chunk by chunk, while each chunk's logits exist (cross-entropy is the
  last op, so its input gradients are known then); the backward only scales them by the incoming gradient.
  Three head matmuls per step, as plain, and none of the 32,768-way logits kept (4 GiB in fp32 at
  32,768 tokens a step).
- ``liger``: liger-kernel's fused linear cross-entropy (the same idea in Triton kernels), when installed
  (``pip install liger-kernel``). It reads the count of counted targets back to the host once per call
  (a synchronisation on CUDA), which the chunked head does not.

Targets equal to -100 are ignored and the loss is the mean over the rest (``F.cross_entropy``'s defaults).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import UsageError
from ..config import LOSS_HEADS

IGNORE = -100
LOGITS_PER_CHUNK = 1 << 26          # fp32 logits of one chunk: 256 MiB


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: about :data:`LOGITS_PER_CHUNK` logits, a multiple of 64 rows (the matmul tiles)."""
    return max(64, LOGITS_PER_CHUNK // max(vocab, 1) // 64 * 64)


def logit_rows(how: str, vocab: int) -> int | None:
    """The most rows of logits the ``how`` head holds at once, None for all of them (plain): what the memory
    checks count (:func:`fibattn.validation.check_training_fits`'s ``logit_rows``)."""
    return None if how == "plain" else chunk_rows(vocab)


def liger_available() -> bool:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain loss: mean cross-entropy of logits ``(..., V)`` against ``targets (...)``, in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``mean_i CE(h_i W^T, t_i)`` over rows with ``t_i != -100``; ``h (N, C)``, ``weight (V, C)``,
    ``targets (N,)``. Under autocast the matmuls run in its dtype, the softmax in fp32 (as plain)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int):
        valid = targets != IGNORE
        count = valid.sum()
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if want_w else None
        total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        for s in range(0, h.shape[0], chunk):
            hc, ok = h[s:s + chunk], valid[s:s + chunk]
            tc = torch.where(ok, targets[s:s + chunk], 0)[:, None]
            lin = F.linear(hc, weight)                  # in autocast's dtype when on, as plain
            logits = lin.to(total.dtype)                # fp32 at least: the softmax of 32,768 classes
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            total = total + torch.where(ok, (lse - logits.gather(1, tc))[:, 0], 0.0).sum()
            if want_h or want_w:
                # d loss_sum / d logits = softmax - onehot(target), zero on ignored rows; over count: the mean
                g = torch.exp(logits - lse).scatter_add_(1, tc, -torch.ones_like(lse))
                g = (g * ok[:, None] / count).to(lin.dtype)
                if want_h:
                    grad_h[s:s + chunk] = (g @ weight.to(g.dtype)).to(h.dtype)
                if want_w:
                    grad_w += g.t() @ hc.to(g.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
        grad_w = None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None


@torch.library.custom_op("fibattn::liger_linear_cross_entropy", mutates_args=())
def _liger_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """liger-kernel's fused loss behind a custom op, so that ``torch.compile`` (fullgraph) keeps it whole
    instead of tracing into liger's Python: ``(loss, d loss/d h, d loss/d weight)``, the gradients made in
    liger's forward (empty when ``grads`` is false)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    with torch.enable_grad():
        a, b = h.detach().requires_grad_(grads), weight.detach().requires_grad_(grads)
        loss = liger_fused_linear_cross_entropy(a, b, targets, ignore_index=IGNORE)
        grad_h, grad_w = torch.autograd.grad(loss, (a, b)) if grads else (h.new_empty(0), h.new_empty(0))
    return loss.detach().float(), grad_h, grad_w


@_liger_loss.register_fake
def _(h, weight, targets, grads):
    return (h.new_empty((), dtype=torch.float32), torch.empty_like(h) if grads else h.new_empty(0),
            torch.empty_like(weight) if grads else h.new_empty(0))


def _liger_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _liger_backward(ctx, grad_loss, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), None, None


_liger_loss.register_autograd(_liger_backward, setup_context=_liger_setup)


def head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, how: str = "plain",
              chunk: int | None = None) -> torch.Tensor:
    """Mean token cross-entropy of the head ``weight (V, C)`` on hidden states ``h (..., C)`` against
    ``targets (...)`` (-100 ignored), computed the ``how`` way (:data:`LOSS_HEADS`)."""
    h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1).long()
    if how == "plain":
        return logits_loss(F.linear(h2, weight), t)
    if how == "chunked":
        return ChunkedLinearCrossEntropy.apply(h2, weight, t, chunk or chunk_rows(weight.shape[0]))
    if how == "liger":
        if not liger_available():
            raise UsageError("loss head 'liger' needs liger-kernel: pip install liger-kernel (or use chunked)")
        kind = h.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype
        grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        return _liger_loss(h2.to(dtype), weight.to(dtype), t, grads)[0]
    raise UsageError(f"loss head must be one of {', '.join(LOSS_HEADS)}, got {how!r}")
