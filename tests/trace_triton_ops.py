"""Run by ``tests/test_triton_ops.py`` in a process of its own, without Triton's interpreter: compile calls of
the public ops on fake CUDA tensors (no GPU needed) and print, as JSON, what each AOT graph holds — the
Triton kernels it launches itself, any other fibattn op, and anything that would make or read a host value —
and whether the ``triton_op``s were registered before the trace (the public ops register them on first use).

Argument: ``integer`` | ``interpolated`` | ``backward`` | ``backward-chosen`` (the backward as on an sm_90 device:
its tile choices made on code compiled while tracing; the rungs a step each pass was launched with are printed).
(Documents are left out: slicing a fake CUDA tensor needs CUDA in this torch; the ops pass ``off`` through as one
more tensor.)
"""
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import fibattn  # noqa: E402

HOST = {"aten._local_scalar_dense.default", "aten.lift_fresh_copy.default", "aten.item.default"}
DISTS = [0, 1, 2, 3, 5, 8, 13, 21, 34]          # a band 0..3 and five rungs, all below T = 40
BASE = [1, 2, 3, 5, 8, 13, 21, 34]


class Captured(Exception):
    pass


def describe(gm) -> dict:
    kernels, ops, host, devices, rungs = [], [], [], set(), {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            host.append(f"constant {node.target}")
        if node.op != "call_function":
            continue
        if "triton_kernel_wrapper" in str(node.target):
            name = kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
            kernels.append(name)
            args = {**kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]), **node.kwargs["kwargs"]}
            rungs.update({f"{name}.{k}": args[k] for k in ("MC", "RB", "RBK", "PRODUCTS", "CHECK") if k in args})
            continue
        name = str(node.target)
        ops.append(name)
        if name in HOST or "pin_memory" in name:
            host.append(name)
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(v, torch.Tensor):
                devices.add(v.device.type)
    return dict(kernels=kernels, fibattn_ops=[o for o in ops if "fibattn" in o], host=host, devices=sorted(devices),
                rungs=rungs)


def main(kind: str) -> None:
    graphs = []
    registered_before = "fibattn.ops.triton_ops" in sys.modules
    if kind.startswith("backward"):
        from fibattn.ops import triton_ops
    if kind == "backward-chosen":         # as on an H100 / H200: the choices compile their candidates for sm_90
        import logging

        from triton.backends.compiler import GPUTarget

        from fibattn.ops import triton_backend
        logging.basicConfig(level=logging.INFO)
        triton_backend._target = lambda device: GPUTarget("cuda", 90, 32)

    def backend(gm, inputs):
        def keep(g, _):
            graphs.append(describe(g))

            def run(*_):
                raise Captured()
            return make_boxed_func(run)
        return aot_module_simplified(gm, inputs, fw_compiler=keep)

    with FakeTensorMode():
        q = torch.empty(2, 4, 40, 16, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 2, 40, 16, device="cuda", dtype=torch.bfloat16)
        v = torch.empty_like(k)
        alpha = torch.empty((), device="cuda", dtype=torch.float32)

        def call(q, k, v, alpha):
            if kind == "integer":
                return fibattn.sparse_attention(q, k, v, DISTS, backend="auto")
            if kind == "interpolated":
                return fibattn.interpolated_sparse_attention(q, k, v, alpha=alpha, base="fib", window=3,
                                                             backend="triton")
            lse = torch.empty(q.shape[:3], device=q.device)            # the backward op, as autograd calls it
            return triton_ops.attention_backward_op(q, q, k, v, q, lse, alpha, None, 3, BASE, None, 0.25, True,
                                                    None)
        try:
            torch.compile(call, backend=backend, fullgraph=True)(q, k, v, alpha)
        except Captured:
            pass
    print(json.dumps({"graphs": graphs, "registered_before": registered_before}))


if __name__ == "__main__":
    main(sys.argv[1])
