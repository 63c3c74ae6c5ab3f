"""The ordered all-reduce hook, in one process: the layout it reduces, its futures, its results."""
import torch

from fibattn.trainer import grad_reduce as G


class Bucket:
    """The parts of DDP's GradBucket the hook uses: its gradients are views of one buffer."""

    def __init__(self, params, last):
        self.params, self.last = params, last
        self.buf = torch.cat([p.grad_init.reshape(-1) for p in params])
        self.views, o = [], 0
        for p in params:
            self.views.append(self.buf[o:o + p.numel()].view_as(p))
            o += p.numel()

    def is_last(self):
        return self.last

    def parameters(self):
        return self.params

    def gradients(self):
        return self.views

    def buffer(self):
        return self.buf


def test_the_hook_reduces_every_gradient_once_in_parameter_order_whatever_the_buckets(monkeypatch):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 1, 4, 2)]
    for i, p in enumerate(params):
        p.grad_init = torch.full((p.numel(),), float(i + 1))
    seen = []

    def all_reduce(t, group=None):        # four processes holding the same gradients
        seen.append(t.clone())
        t.mul_(4)

    monkeypatch.setattr(G.tdist, "all_reduce", all_reduce)
    monkeypatch.setattr(G.tdist, "get_world_size", lambda group=None: 4)
    state = G.OrderedReduce(params)
    first, last = Bucket([params[3], params[1]], False), Bucket([params[0], params[2]], True)
    f1 = G.ordered_reduce_hook(state, first)
    assert not f1.done() and not seen             # nothing reduced before the last bucket
    f2 = G.ordered_reduce_hook(state, last)
    assert f1.done() and f2.done() and len(seen) == 1
    order = torch.cat([p.grad_init for p in params])
    torch.testing.assert_close(seen[0], order, rtol=0, atol=0)          # the model's order, not the buckets'
    torch.testing.assert_close(f1.value(), torch.cat([params[3].grad_init, params[1].grad_init]), rtol=0, atol=0)
    torch.testing.assert_close(f2.value(), torch.cat([params[0].grad_init, params[2].grad_init]), rtol=0, atol=0)
    assert state.pending == []                    # the next backward starts afresh
