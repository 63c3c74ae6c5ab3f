"""Registers and spills of the ``triton`` backend's kernels on sm_90, compiled without a GPU.

    python tools/triton_resources.py [GROUPxDH ...]      (default: 1x64 2x64 4x64 4x128 8x128 4x32)

Compiles every kernel (integer and two-tap) with the launch configuration the backend
would pick (``triton_backend.config``; ``FIBATTN_TRITON_BLOCK_M`` / ``_WARPS`` override it)
through Triton's own ptxas, and prints ``cuobjdump -res-usage``'s registers per thread
and stack bytes (spills). Needs the ``triton`` package with its NVIDIA backend, no device.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fibattn.ops import triton_backend

warnings.filterwarnings("ignore")
TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
STATS = {"LSE", "DELTA", "EDGE_K", "EDGE_V"}


def signature(fn, consts: dict, dtype: str = "bf16") -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in TENSORS:
            sig[name] = f"*{dtype}"
        elif name in STATS:
            sig[name] = "*fp32"
        elif name == "LO":
            sig[name] = "*i32"
        elif name in ("WLO", "WHI", "DFRAC"):
            sig[name] = "*fp64"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def usage(fn, consts: dict, num_warps: int) -> tuple[int, int]:
    """``(registers per thread, stack bytes)`` of one compiled kernel."""
    kernel = triton.compile(ASTSource(fn=fn, signature=signature(fn, consts), constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(kernel.asm["cubin"])
        fh.flush()
        text = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split(":", 1) for tok in text.split() if tok.startswith(("REG:", "STACK:")))
    return int(fields["REG"]), int(fields["STACK"])


def report(group: int, head_dim: int) -> list[tuple[str, int, int]]:
    kern = triton_backend.kernels()
    cfg = triton_backend.config(group, head_dim)
    warps = cfg.pop("num_warps")
    rows = []
    for two in (False, True):
        for fn, extra in ((kern.fwd_kernel, {}), (kern.bwd_dq_kernel, {"NEED_DFRAC": two}),
                          (kern.bwd_dkdv_kernel, {})):
            consts = dict(TWO_TAP=two, ACC=tl.float32, **cfg, **extra)
            regs, stack = usage(fn, consts, warps)
            rows.append((f"{fn.__name__}{' (two-tap)' if two else ''}", regs, stack))
    print(f"group {group}, Dh {head_dim}: BLOCK_M={cfg['BLOCK_M']} num_warps={warps}")
    for name, regs, stack in rows:
        print(f"  {name:<28} {regs:>4} registers  {stack:>5} stack bytes")
    return rows


def main(argv: list[str]) -> int:
    shapes = argv or ["1x64", "2x64", "4x64", "4x128", "8x128", "4x32"]
    for shape in shapes:
        group, head_dim = (int(x) for x in shape.split("x"))
        report(group, head_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
