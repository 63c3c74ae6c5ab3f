"""What the public ops cost per call on the host, over their kernels and over PyTorch's autograd floor
(issue 22: the eager path); ``fibattn bench attention`` prints it."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

import fibattn

from ..checks import UsageError
from ..ops import cpu_backend, eager
from ..ops.columns import ColumnSpec
from ..schedules import as_base


@dataclass
class HostOverhead:
    op: str
    public_us: float           # the public op, forward+backward through autograd
    direct_us: float           # its kernel set called directly, no autograd
    overhead_us: float         # public_us - direct_us
    autograd_us: float         # the floor: eager.Attention (the kernels in a bare autograd Function) - direct_us
    cold: bool = False         # each call right after the caches were emptied (the median call; else the fastest)
    spread_us: float = 0.0     # how far the rounds of the noisiest of the three calls lie from the value taken

    @property
    def fibattn_us(self) -> float:
        """What fibattn adds over the least a differentiable eager op costs (the floor)."""
        return self.overhead_us - self.autograd_us

    @property
    def noisy(self) -> bool:
        """A difference came out negative: load from other processes moved the calls by more than they differ,
        so no split of the overhead can be told (never printed as a negative time)."""
        return min(self.overhead_us, self.autograd_us, self.fibattn_us) < 0

    def line(self) -> str:
        where = f"{self.op}, caches emptied first" if self.cold else self.op
        head = f"host overhead per call (cpu, T=16, fwd+bwd, {where}): "
        if self.noisy:
            return (head + f"too noisy to split (public op {self.public_us:.0f} µs, kernels direct "
                    f"{self.direct_us:.0f} µs, bare autograd Function {self.direct_us + self.autograd_us:.0f} µs, "
                    f"rounds spread {self.spread_us:.0f} µs: the calls differ by less than the load moves them); "
                    f"run it again on a quieter machine")
        return (head + f"public op {self.public_us:.0f} µs, kernels direct {self.direct_us:.0f} µs, overhead "
                f"{self.overhead_us:.0f} µs = PyTorch's autograd floor {self.autograd_us:.0f} µs + fibattn "
                f"{self.fibattn_us:.0f} µs (rounds spread {self.spread_us:.0f} µs)")

    def record(self) -> dict:
        """The JSON record: the differences are None (and ``too_noisy`` true) when they cannot be told."""
        out = {**asdict(self), "fibattn_us": self.fibattn_us, "too_noisy": self.noisy}
        if self.noisy:
            out.update(overhead_us=None, autograd_us=None, fibattn_us=None)
        return out


def _emptier() -> torch.Tensor:
    """Bytes to write between cold calls: twice the largest cache (64 MiB where none is known)."""
    return torch.empty(2 * max(cpu_backend.cpu_cache_bytes().values(), default=32 << 20), dtype=torch.uint8)


def host_overhead(op: str = "integer", seconds: float = 0.5, calls: int = 20, cold: bool = False) -> HostOverhead:
    """What the public op (``integer`` or ``interpolated``) costs per call over its kernels.

    The ``cpu`` backend at B=1, H=2, T=16, Dh=16, one thread: forward+backward through autograd
    (``torch.autograd.grad``) against ``cpu_backend.plan`` / ``forward`` / ``backward`` called
    directly, and against the eager path's bare autograd Function (``eager.Attention``: the
    kernels and a cached column plan, no checks, no backend resolution — PyTorch's floor for any
    differentiable eager op); fibattn's own cost is what the public op adds over it. Rounds of ``calls``
    calls alternate for about ``seconds``; each is its fastest round, since load from other processes
    only ever adds time. ``cold``: each call right after writing twice the largest cache, as inside a
    model whose other layers have just run (or at long lengths, after the kernels' own traffic);
    rounds of one call each, and the median call of each.
    """
    if op not in ("integer", "interpolated"):
        raise UsageError(f"op must be 'integer' or 'interpolated', got {op!r}")
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scale = 0.25                             # the public ops' default at Dh=16
    if op == "integer":
        dists, alpha = [0, 1, 2, 3, 5, 8, 13], None
        spec = ColumnSpec(tuple(dists))

        def forward():
            return fibattn.sparse_attention(*leaves, dists, backend="cpu")
    else:
        alpha = torch.tensor(1.3, dtype=torch.float64)
        spec = ColumnSpec(None, 3, tuple(as_base("fib").resolve(16)), None)
        leaves.append(alpha.clone().requires_grad_())

        def forward():
            return fibattn.interpolated_sparse_attention(*leaves[:3], alpha=leaves[3], base="fib", window=3,
                                                         backend="cpu")

    def public():
        torch.autograd.grad(forward(), leaves, dout)

    def function():
        out = eager.Attention.apply(*leaves[:3], leaves[3] if len(leaves) > 3 else None, cpu_backend, spec, scale, None)
        torch.autograd.grad(out, leaves, dout)

    def direct():
        plan = cpu_backend.plan(spec, alpha, 16)
        out, aux = cpu_backend.forward(q, k, v, spec, alpha, scale, plan=plan)
        cpu_backend.backward(dout, q, k, v, out, aux, spec, alpha, scale, alpha is not None, plan=plan)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # an OpenMP team's start-up is not what is measured
    emptier, n = (_emptier(), 1) if cold else (None, calls)
    try:
        steps = (public, function, direct)
        for fn in steps:
            fn()                             # warm-up (and the kernels' first load)
        times: list[list[float]] = [[] for _ in steps]
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times[0]) < 3:
            for i, fn in enumerate(steps):
                if emptier is not None:
                    emptier.fill_(len(times[i]) % 251)
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times[i].append((time.perf_counter() - t0) / n * 1e6)
    finally:
        torch.set_num_threads(threads)
    pub, bare, kern = (statistics.median(t) if cold else min(t) for t in times)
    spread = max(_spread(t, cold) for t in times)
    return HostOverhead(op, pub, kern, pub - kern, bare - kern, cold, spread)


def _spread(t: list[float], cold: bool) -> float:
    """The rounds' spread about the value taken: half the interquartile range around the median (cold), the
    median's distance from the fastest round (warm: the fastest is taken)."""
    if len(t) < 2:
        return 0.0
    if cold:
        q = statistics.quantiles(t, n=4)
        return (q[2] - q[0]) / 2
    return statistics.median(t) - min(t)
