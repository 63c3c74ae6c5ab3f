"""The ``triton`` kernels as ``triton_op``s (``fibattn.ops.triton_ops``): what a compiled call on CUDA runs.

Numbers: the ops called eagerly run the same kernels (in Triton's interpreter here) and must give the
eager path's outputs and gradients bit for bit, and the reference's within tolerance. Structure: a compiled
call on (fake) CUDA tensors, traced in a process without the interpreter, must launch the kernels itself —
no opaque fibattn op left in the graph — and hold nothing that makes or reads a host value.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fibattn.ops import backend_available, triton_config, triton_ops
from op_helpers import FP32, close, doc_ids, interp, make, run

pytestmark = pytest.mark.skipif(backend_available("triton", torch.device("cpu")) is not None,
                                reason="triton interpreter unavailable")

DISTS = [0, 1, 2, 3, 5, 8, 13, 21]          # a band 0..3 and four rungs: T = 37 crosses tile edges of 16


def _ops_integer(off=None):
    return lambda q, k, v: triton_ops.sparse_attention(q, k, v, DISTS, 0.5, off)


def _ops_interp(off=None):
    base = [1, 2, 3, 5, 8, 13, 21]
    return lambda q, k, v, a: triton_ops.interpolated_sparse_attention(q, k, v, a, 3, base, None, 0.5, off)


@pytest.mark.parametrize("documents", [False, True])
def test_integer_op_equals_the_eager_path_and_the_reference(documents):
    q, k, v, dout = make(B=2, H=4, Hkv=2, T=37, Dh=8)
    ids = doc_ids(2, 37, [11, 26]) if documents else None
    off = None
    if documents:
        from fibattn.ops.documents import offsets_unchecked
        off = offsets_unchecked(ids)
    import fibattn
    got = run(_ops_integer(off), q, k, v, dout)
    eager = run(lambda q, k, v: fibattn.sparse_attention(q, k, v, DISTS, scale=0.5, backend="triton",
                                                         document_ids=ids), q, k, v, dout)
    ref = run(lambda q, k, v: fibattn.sparse_attention(q, k, v, DISTS, scale=0.5, backend="reference",
                                                       document_ids=ids), q, k, v, dout)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    close(got, ref, **FP32)


def test_interpolated_op_equals_the_eager_path_and_the_reference():
    q, k, v, dout = make(B=1, H=4, Hkv=1, T=37, Dh=8, seed=3)
    alpha = torch.tensor(1.37)
    got = run(_ops_interp(), q, k, v, dout, alpha)
    eager = run(interp(3, [1, 2, 3, 5, 8, 13, 21], "triton", scale=0.5), q, k, v, dout, alpha)
    ref = run(interp(3, [1, 2, 3, 5, 8, 13, 21], "reference", scale=0.5), q, k, v, dout, alpha)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    close(got, ref, **FP32)


def _trace(kind: str, stderr: list | None = None) -> list:
    """The graphs ``trace_triton_ops.py`` captured; the ``triton_op``s never registered before the trace."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("trace_triton_ops.py")
    proc = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, env=env, timeout=300,
                          cwd=script.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["registered_before"] is False     # the public ops' first compiled call registers them (backends)
    return out["graphs"]


# each kernel but the plan and the flags twice: unchecked, then checked (triton_backend._CHECKED)
@pytest.mark.parametrize("kind, kernels", [
    ("integer", ["flags_kernel", "fwd_kernel", "fwd_kernel"]),
    ("interpolated", ["plan_kernel", "flags_kernel", "fwd_kernel", "fwd_kernel"]),
    ("backward", ["plan_kernel", "flags_kernel", "bwd_dq_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel",
                  "bwd_dkdv_kernel"])])
def test_a_compiled_cuda_call_launches_the_kernels_itself_and_reads_nothing_back(kind, kernels):
    (graph,) = _trace(kind)
    assert graph["kernels"] == kernels
    assert graph["fibattn_ops"] == []           # nothing opaque left: inductor sees, plans and launches it all
    assert graph["host"] == []                  # no host constant copied over, no value read back
    assert graph["devices"] == ["cuda"]         # every tensor the graph makes is on the device


def test_a_compiled_call_on_a_device_makes_its_tile_choices_while_tracing():
    """The backward traced as on an sm_90 device (no GPU needed: the choices compile their candidates offline):
    the query and key passes are launched with the rungs a step the compiled registers chose, each choice made and
    logged while tracing, none fallen back."""
    err = []
    (graph,) = _trace("backward-chosen", err)
    assert graph["kernels"] == ["plan_kernel", "flags_kernel", "bwd_dq_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel",
                                "bwd_dkdv_kernel"]
    rungs = graph["rungs"]
    assert (rungs["bwd_dq_kernel.MC"], rungs["bwd_dq_kernel.RB"]) in triton_config.config(2, 16, 3)["RUNGS"]
    assert (rungs["bwd_dkdv_kernel.RBK"], rungs["bwd_dkdv_kernel.PRODUCTS"]) in triton_config.config(2, 16, 3)[
        "RB_KEY_PASS"]
    assert rungs["bwd_dq_kernel.CHECK"] is True and rungs["bwd_dkdv_kernel.CHECK"] is True   # the last launch's
    assert "bwd_dq_kernel MC,RB=" in err[0] and "bwd_dkdv_kernel RBK,PRODUCTS=" in err[0]
    assert "not chosen by registers" not in err[0]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_on_the_gpu_equals_eager(mode):
    """On a CUDA device: inductor launches the kernels itself (a CUDA graph replays them under reduce-overhead),
    with the eager outputs and gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import fibattn
    torch._dynamo.reset()
    q, k, v, dout = (x.cuda().to(torch.bfloat16) for x in make(B=2, H=4, Hkv=2, T=300, Dh=64))
    alpha = torch.tensor(1.37, device="cuda")

    def f(q, k, v, a):
        return (fibattn.sparse_attention(q, k, v, DISTS) +
                fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib", window=3))
    want = run(f, q, k, v, dout, alpha)
    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):                   # reduce-overhead records, then replays its graph
        got = run(compiled, q, k, v, dout, alpha)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_on_the_gpu_the_compiler_copies_no_input_for_a_kernel():
    """With a device, Triton's own analysis tells the compiler which buffers each kernel writes: q, k, v, dout
    (and, in the backward, out and lse) are read only, so none is copied for a launch (``tensors_to_clone``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import fibattn
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    clones = {}

    def backend(gm, inputs):
        def keep(g, _):
            for n in g.graph.nodes:
                if "triton_kernel_wrapper" in str(n.target):
                    name = kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
                    clones.setdefault(name, set()).update(n.kwargs.get("tensors_to_clone", ()))
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)
    torch._dynamo.reset()
    q, k, v, dout = (x.cuda().to(torch.bfloat16) for x in make(B=1, H=4, Hkv=2, T=128, Dh=64))
    alpha = torch.tensor(1.37, device="cuda")
    f = torch.compile(lambda q, k, v, a: fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib",
                                                                                 window=3), backend=backend)
    run(f, q, k, v, dout, alpha)
    assert {"fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel"} <= set(clones)
    for name, cloned in clones.items():
        assert not cloned & {"Q", "K", "V", "DO", "ALPHA", "BASE"}, (name, cloned)
        if name.startswith("bwd"):
            assert not cloned & {"OUT", "LSE", "FLAGS"}, (name, cloned)
